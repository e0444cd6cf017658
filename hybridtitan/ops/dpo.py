"""Direct Preference Optimization's loss (Rafailov et al., arXiv 2305.18290), in plain torch: each response's
summed log-probability under a model, and the sigmoid DPO loss of a pair.

    logp = sequence_logprobs(hidden, weight, labels)          [rows]: sum over a row's counted labels of log p(label)
    loss, chosen_reward, rejected_reward = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)

    loss = -log sigmoid(beta x ((pi_c - ref_c) - (pi_r - ref_r)))     per pair
    chosen_reward = beta x (pi_c - ref_c), rejected_reward = beta x (pi_r - ref_r)   (the margin is their difference)

Only the labels of the response count (the preference loader marks the prompt's IGNORE_INDEX): the prompt's
tokens are no part of either sum. The output layer is formed on the counted positions alone, ``chunk_size`` of them
at a time, each chunk's logits recomputed in the backward (activation checkpointing) rather than kept: its extra
memory is one chunk of float32 logits, as the cross-entropy's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of a chunk of hidden states [c, D], in float32."""
    logits = (hidden @ weight.t()).float()
    return -F.cross_entropy(logits, targets, reduction="none")


def sequence_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                      chunk_size: int = 4096) -> torch.Tensor:
    """[B] float32: per row of ``labels`` [B, T], the sum of log softmax(hidden @ weight^T)[label] over its labels
    other than ``ignore_index``; ``hidden`` [B, T, D] the final hidden states, ``weight`` [V, D] the output layer."""
    B, T, D = hidden.shape
    flat = labels.reshape(-1)
    where = (flat != ignore_index).nonzero().squeeze(1)
    rows = torch.div(where, T, rounding_mode="floor")
    h = hidden.reshape(-1, D).index_select(0, where)
    targets = flat.index_select(0, where)
    total = torch.zeros(B, dtype=torch.float32, device=hidden.device)
    for start in range(0, len(where), chunk_size):
        stop = start + chunk_size
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            logp = checkpoint(_chunk_logprobs, h[start:stop], weight, targets[start:stop], use_reentrant=False)
        else:
            logp = _chunk_logprobs(h[start:stop], weight, targets[start:stop])
        total = total.index_add(0, rows[start:stop], logp)
    return total


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward), each [pairs]: the sigmoid DPO loss of summed log-probabilities
    (the module docstring). The reference's log-probabilities take no gradient."""
    chosen = beta * (policy_chosen - reference_chosen.detach())
    rejected = beta * (policy_rejected - reference_rejected.detach())
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()

"""The distillation losses, beside the cross-entropy: the KL divergence of a student's next-token distributions
from a frozen teacher's, over chunks of tokens (never the T x V logits of both models at once), and the distance
between two models' hidden states for layer distillation.

    KL_T(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)),   p = softmax(logits / T)

The loss a trainer adds is kl_weight * T^2 * KL_T (Hinton's scaling, so that the gradient keeps its size at any
temperature T) + ce_weight * cross-entropy; each chunk forms both models' logits from their final hidden states
and output weights, and computes the loss and the gradient of the student's logits while they are at hand (the
same scheme as hybridtitan.ops.cross_entropy). Where the kernel config asks, each chunk's elementwise part runs
through torch.compile; on GPUs, at T = 1, the KL alone is FLA's fused kernel (``fla_backend.kl_div``).
"""

from __future__ import annotations

import functools

import torch

from .cross_entropy import _accumulate


def kl_chunk(s_logits: torch.Tensor, t_logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
             temperature: float, kl_scale: float, ce_weight: float):
    """One chunk: (summed KL_T, summed cross-entropy, d loss / d student logits) with
    loss = kl_scale * KL_T + ce_weight * CE summed over the valid rows. s_logits, t_logits: [c, V];
    target: [c, 1] (in range); valid: [c]. The gradient in the student logits' dtype; the cross-entropy is formed
    only where ce_weight is not 0."""
    w = valid.to(torch.float32).unsqueeze(1)
    log_p_s = torch.log_softmax(s_logits.float() / temperature, dim=1)
    diff = torch.log_softmax(t_logits.float() / temperature, dim=1)
    p_t = diff.exp()
    kl = (torch.linalg.vecdot(p_t, diff.sub_(log_p_s), dim=1) * valid).sum()
    # d (T^2 KL_T) / d s = T (p_s - p_t)
    grad = log_p_s.exp_().sub_(p_t).mul_(w * (kl_scale / temperature))
    ce = torch.zeros((), dtype=torch.float32, device=s_logits.device)
    if ce_weight:
        log_p = torch.log_softmax(s_logits.float(), dim=1)
        ce = (-(log_p.gather(1, target)) * w).sum()
        grad += log_p.exp_().scatter_add_(1, target, -torch.ones_like(w)).mul_(w * ce_weight)
    return kl, ce, grad.to(s_logits.dtype)


def kl_chunk_sums(s_logits, t_logits, target, valid, temperature: float):
    """(summed KL_T, summed cross-entropy) of one chunk, without gradients (validation, layer selection)."""
    log_p_s = torch.log_softmax(s_logits.float() / temperature, dim=1)
    diff = torch.log_softmax(t_logits.float() / temperature, dim=1)
    kl = (torch.linalg.vecdot(diff.exp(), diff.sub_(log_p_s), dim=1) * valid).sum()
    log_p = log_p_s if temperature == 1 else torch.log_softmax(s_logits.float(), dim=1)
    return kl, (-(log_p.gather(1, target)).squeeze(1) * valid).sum()


@functools.cache
def compiled_kl_chunk():
    """``kl_chunk`` through torch.compile (once per process; the temperature and weights are constants of it)."""
    return torch.compile(kl_chunk, dynamic=False)


class _LinearKL(torch.autograd.Function):
    """The weighted loss of chunked KL (+ cross-entropy), its parts returned beside it (not differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, targets, valid, temperature, kl_scale, ce_weight,
                chunk_size, chunk_fn):
        n = hidden.shape[0]
        kl = torch.zeros((), dtype=torch.float32, device=hidden.device)
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, n, chunk_size):
            h = hidden[start:start + chunk_size]
            t = targets[start:start + chunk_size].unsqueeze(1)
            k, c, g = chunk_fn(h @ weight.t(), t_hidden[start:start + chunk_size] @ t_weight.t(), t,
                               valid[start:start + chunk_size], temperature, kl_scale, ce_weight)
            _accumulate(grad_hidden, grad_weight, g.to(hidden.dtype), h, weight, start)
            kl += k
            ce += c
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(kl, ce)
        return kl_scale * kl + ce_weight * ce, kl, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = grad_weight * grad_loss.to(grad_weight.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, *([None] * 9)


def linear_kl_div(hidden, weight, t_hidden, t_weight, targets, *, temperature: float = 1.0, kl_weight: float = 1.0,
                  ce_weight: float = 0.0, ignore_index: int = -100, chunk_size: int = 1024, chunk_fn=kl_chunk):
    """(loss, KL_T sum, cross-entropy sum, counted tokens) of a student (``hidden`` [..., D], ``weight`` [V, D])
    against a teacher (``t_hidden`` [..., Dt], ``t_weight`` [V, Dt]) over the tokens whose ``targets`` count;
    loss = kl_weight * T^2 * KL_T + ce_weight * CE (summed; divide by a token count for means). The teacher's
    tensors take no gradient. Without gradients (validation) only the sums are formed."""
    h = hidden.reshape(-1, hidden.shape[-1])
    th = t_hidden.reshape(-1, t_hidden.shape[-1]).to(h.dtype)
    tw = t_weight.detach().to(weight.dtype)
    t = targets.reshape(-1)
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t))
    kl_scale = kl_weight * temperature * temperature
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        loss, kl, ce = _LinearKL.apply(h, weight, th.detach(), tw, safe, valid, float(temperature), kl_scale,
                                       float(ce_weight), chunk_size, chunk_fn)
    else:
        with torch.no_grad():
            kl = ce = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, h.shape[0], chunk_size):
                end = start + chunk_size
                k, c = kl_chunk_sums(h[start:end] @ weight.t(), th[start:end] @ tw.t(), safe[start:end].unsqueeze(1),
                                     valid[start:end], temperature)
                kl, ce = kl + k, ce + c
            loss = kl_scale * kl + ce_weight * ce
    return loss, kl, ce, valid.sum()


def layer_distance(student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over the valid tokens of ||student - teacher||_2 over the hidden dimension (float32): layer
    distillation's distance between two models' states at one layer. student, teacher: [..., D]; valid: [...]."""
    diff = student.float() - teacher.detach().float()
    return (torch.linalg.vector_norm(diff, dim=-1) * valid.reshape(diff.shape[:-1])).sum()

"""AdamW with decoupled weight decay on the weight matrices only, and the warm-up + decay schedule.

Norm gains, biases, A_log, dt_bias and D (every parameter with fewer than two dimensions) take no weight
decay, as in Megatron/Primus and FLA. The schedule is torchtitan's: linear warm-up, then linear, sqrt or
cosine decay to ``lr * min_lr_factor``; ``decay_ratio`` turns it into warm-up-stable-decay.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torchtitan.components.lr_scheduler import build_lr_schedulers


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    o = cfg.optimizer
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # "fused": one kernel per parameter group (GPUs and CPUs); it can also skip a step with non-finite gradients
    # by itself, without the host waiting for the gradient norm (train._optimizer_step)
    fused = o.implementation == "fused"
    foreach = not fused and o.implementation != "for-loop"
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    return cls(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused, foreach=foreach)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg):
    return build_lr_schedulers([optimizer], cfg.lr_scheduler, cfg.training.steps)

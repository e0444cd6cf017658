"""AdamW with decoupled weight decay on the weight matrices only, and gradient clipping; the update and the
clipping work on each rank's shards of FSDP's parameters (the schedule: hybridtitan.lr_schedule).

Norm gains, biases, A_log, dt_bias and D (every parameter with fewer than two dimensions) take no weight
decay, as in FLA and in Megatron, which decides by the stored shape: Primus stores KDA's A_log as (1, 1, H, 1)
and so decays it, where this and FLA do not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from hybridtitan.job_config import JobConfig


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    o = cfg.optimizer
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # "fused": one kernel per parameter group (GPUs and CPUs); it can also skip a step with non-finite gradients
    # by itself, without the host waiting for the gradient norm (train.optimizer_step)
    fused = o.implementation == "fused"
    foreach = not fused and o.implementation != "for-loop"
    cls = LocalShardAdamW if o.name == "AdamW" else LocalShardAdam
    return cls(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused, foreach=foreach)


class _LocalShardUpdate:
    """Adam's and AdamW's update applied to each rank's shards of FSDP's parameters, not to the DTensors.

    The update is elementwise, so a shard's new values depend on that shard's parameter, gradient and moments
    only. Handing the DTensors to the update makes every operation pass DTensor's dispatch, several times the
    host time of the same update on the shards (docs/findings.md), and where micro-batches are small the host's
    time is the step's. The
    optimizer still holds the DTensors (its state is created like them), so state dicts and resharded
    checkpoints are unchanged. Only the tensor lists that torch's ``_init_group`` fills are replaced by their
    shards."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        for items in lists:
            if isinstance(items, list):
                items[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in items]
        return has_complex


class LocalShardAdamW(_LocalShardUpdate, torch.optim.AdamW):
    pass


class LocalShardAdam(_LocalShardUpdate, torch.optim.Adam):
    pass


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients in place so that their global L2 norm is at most ``max_norm``; returns that norm
    before scaling (a 0-dim float32 tensor, the same on every rank; not finite if a gradient is not).

    The result of ``torch.nn.utils.clip_grad_norm_``, for less host time: on FSDP's sharded gradients (DTensors
    of one mesh and placement) each operation there passes DTensor's dispatch; here the norm is formed from each
    rank's shards and summed over the sharded mesh dimensions in one all-reduce, for a fraction of the host time
    (docs/findings.md). The host's time is the step's time where
    micro-batches are small. Other gradients go to torch's function."""
    parameters = list(parameters)
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros((), device=parameters[0].device if parameters else None)
    first = grads[0]
    mesh = first.device_mesh if isinstance(first, DTensor) else None
    sharded = mesh is not None and not any(pl.is_partial() for pl in first.placements) and all(
        isinstance(g, DTensor) and g.device_mesh == mesh and g.placements == first.placements for g in grads)
    if not sharded:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    # the shards themselves: to_local() would pass autograd's machinery once per tensor
    local = [g._local_tensor for g in grads]
    squares = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local, 2.0)).float()).square()
    for dim, placement in enumerate(first.placements):
        if placement.is_shard():  # a replicated dimension holds the same shards: summed once
            dist.all_reduce(squares, group=mesh.get_group(dim))
    norm = squares.sqrt()
    # the same arithmetic as torch's: a scale of at most 1, never a division by zero
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(local, scale)
    return norm

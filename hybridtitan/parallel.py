"""Parallelism, applied from outside the model in a fixed order: activation checkpointing, torch.compile per
sublayer, then FSDP2 ``fully_shard`` per sublayer and at the root.

Data parallelism: FSDP over a 1-D mesh, or HSDP over a (replicate, shard) mesh; with context parallelism (each
sequence split over ``cp`` consecutive ranks that hold the same batch, hybridtitan.ops.context_parallel) FSDP
shards over the data-parallel shard ranks and the CP ranks together, torchtitan's ``dp_shard_cp``: the gradients
are reduced over the CP ranks too. The mesh is built here rather than with torchtitan's ParallelDims, which
assumes a GPU (it asks for a "cuda" mesh on a CPU machine).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger("hybridtitan")


@dataclass
class DataParallel:
    replicate: int
    shard: int

    @property
    def size(self) -> int:
        return self.replicate * self.shard


def resolve_data_parallel(replicate: int, shard: int, world_size: int) -> DataParallel:
    """The (replicate, shard) degrees for ``world_size`` ranks; shard = -1 takes what replicate leaves."""
    if replicate < 1:
        raise ValueError(f"parallelism.data_parallel_replicate_degree must be at least 1, got {replicate}")
    if shard == -1:
        if world_size % replicate:
            raise ValueError(f"parallelism.data_parallel_replicate_degree ({replicate}) does not divide the "
                             f"{world_size} ranks")
        shard = world_size // replicate
    if shard < 1 or replicate * shard != world_size:
        raise ValueError(f"parallelism: replicate ({replicate}) x shard ({shard}) degrees must equal the number of "
                         f"ranks ({world_size})")
    return DataParallel(replicate, shard)


def build_mesh(dp: DataParallel, device_type: str, cp: int = 1) -> DeviceMesh:
    """FSDP's mesh: (dp_replicate, dp_shard) or (dp_shard,); with ``cp`` > 1 the shard dimension takes the CP
    ranks in (dp_shard_cp: dp.shard x cp ranks, the CP ranks of a sequence consecutive within it)."""
    shard, name = dp.shard * cp, "dp_shard_cp" if cp > 1 else "dp_shard"
    if dp.replicate > 1:
        return init_device_mesh(device_type, (dp.replicate, shard), mesh_dim_names=("dp_replicate", name))
    return init_device_mesh(device_type, (shard,), mesh_dim_names=(name,))


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1, checkpoint_fn=None) -> None:
    """'full': recompute every sublayer in the backward; 'selective': every ``every``-th sublayer. ``checkpoint_fn``
    (a torch.utils.checkpoint.checkpoint with its arguments bound) replaces the non-reentrant default."""
    if mode == "none":
        return
    step = 1 if mode == "full" else every
    fn = summing_the_stream(checkpoint_fn or functools.partial(checkpoint, use_reentrant=False,
                                                               preserve_rng_state=False))
    for i, layer in enumerate(model.layers):
        if i % step == 0:
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_fn=fn)


def summing_the_stream(checkpoint_fn):
    """``checkpoint_fn`` given a sublayer's stream summed: a checkpointed sublayer keeps its inputs for the
    recomputation, and one tensor is half the memory of the pair (h, residual). The sum is the same numbers; the
    add is a pass of its own rather than one kernel with the norm."""

    def fn(layer, h, residual=None, **kwargs):
        return checkpoint_fn(layer, h if residual is None else h + residual, None, **kwargs)

    return fn


def remove_activation_checkpointing(model: nn.Module) -> None:
    """The plain sublayers again, where apply_activation_checkpointing wrapped them."""
    for i, layer in enumerate(model.layers):
        inner = getattr(layer, "_checkpoint_wrapped_module", None)
        if inner is not None:
            model.layers[i] = inner


def apply_compile(model: nn.Module) -> None:
    """torch.compile each sublayer in place (names and state-dict keys stay the same)."""
    for layer in model.layers:
        layer.compile()


def reshard_after_forward_for(policy: str, index: int | None, n_layers: int, shard_degree: int) -> bool:
    """Whether a sublayer (``index``; None: the root) frees its gathered parameters after the forward pass.

    'always' / 'never' as said. 'default': every sublayer but the last, whose parameters the backward pass needs
    again at once; the root keeps them. Over a shard degree of 1 nothing is freed: each rank holds every
    parameter anyway, and gathering them again for the backward costs a copy and a collective per sublayer for
    2 bytes of bf16 per parameter saved (0.6 GB for a 300M model)."""
    if policy not in ("default", "always", "never"):
        raise ValueError(f"parallelism.fsdp_reshard_after_forward must be default, always or never, got {policy!r}")
    if policy != "default":
        return policy == "always"
    return shard_degree > 1 and index is not None and index < n_layers - 1


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: str = "default", layers: nn.ModuleList | None = None) -> None:
    """fully_shard every sublayer, then the root (embedding, final norm and the tied output layer together).
    ``layers``: the blocks to shard one by one when they are not ``model.layers`` (the benchmark wraps FLA's
    models, whose blocks are ``model.model.layers``, the same way)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = model.layers if layers is None else layers
    n, shard_degree = len(layers), mesh.size(mesh.ndim - 1)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward_for(reshard_after_forward, i, n, shard_degree))
    fully_shard(model, mesh=mesh, mp_policy=mp,
                reshard_after_forward=reshard_after_forward_for(reshard_after_forward, None, n, shard_degree))
    if hasattr(model, "teacher_forced"):  # layer distillation's forward gathers and reshards as forward does
        register_fsdp_forward_method(model, "teacher_forced")


def is_checkpointed(layer: nn.Module) -> bool:
    return hasattr(layer, "_checkpoint_wrapped_module")


def parallelize(model: nn.Module, mesh: DeviceMesh, *, ac_mode: str, ac_every: int, compile_model: bool,
                param_dtype: torch.dtype, reduce_dtype: torch.dtype, reshard_after_forward: str) -> nn.Module:
    apply_activation_checkpointing(model, ac_mode, ac_every)
    if compile_model:
        apply_compile(model)
    apply_fsdp(model, mesh, param_dtype, reduce_dtype, reshard_after_forward)
    return model

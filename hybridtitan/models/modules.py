"""Small building blocks shared by the sublayers: RMSNorm, the gated output norm, the short convolution, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .rope import positions_of


class RMSNorm(nn.Module):
    """x / rms(x) * weight, of x + ``residual`` where a residual is given. With ``prenorm`` it returns (the norm, the
    sum), as FLA's norms do. The add and the norm are one kernel where ``Kernels.add_rms_norm`` has one."""

    def __init__(self, dim: int, eps: float = 1e-6, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.eps, self.ops = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, prenorm: bool = False):
        if residual is None:
            normed, total = self.ops.rms_norm(x, self.weight, self.eps), x
        else:
            normed, total = self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        return (normed, total) if prenorm else normed

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedRMSNorm(nn.Module):
    """Per-head output norm of the mixers, gated by a projection of the input (FLA's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float, activation: str = "swish", norm_before_gate: bool = True,
                 group_size: int | None = None, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.eps, self.activation, self.ops = eps, activation, kernels
        self.norm_before_gate, self.group_size = norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_rms_norm(x, gate, self.weight, self.eps, self.activation, self.norm_before_gate,
                                  self.group_size)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution + SiLU. The weight keeps nn.Conv1d's [channels, 1, width] shape (FLA's)."""

    def __init__(self, channels: int, width: int, bias: bool = False, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.width, self.ops = width, kernels
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def forward(self, x, cu_seqlens=None, cache=None, key="conv", context=None):
        """x: [B, T, D]. With a cache, the state under ``key`` is read and replaced (decoding). ``context``: the
        rank's context-parallel shard (hybridtitan.ops.context_parallel), x its local part."""
        return fused_short_conv(x, [self], cu_seqlens, cache, key, context)[0]


def is_plain_linear(layer: nn.Module) -> bool:
    """Whether ``layer`` is an nn.Linear itself, whose weight a fused product may read. A subclass swapped in from
    outside (float8 training's Float8Linear, hybridtitan.float8) computes its own product, so it is called as a module.
    """
    return type(layer) is nn.Linear


def fused_linear(x: torch.Tensor, *groups: nn.Linear | tuple[nn.Linear, ...]) -> list[torch.Tensor]:
    """The outputs of several bias-free projections of the same input, from one matrix product. A tuple of projections
    comes back as one tensor, their outputs side by side.

    The projections stay separate parameters, because their names and shapes are the published layouts'. One product
    instead of several small ones saves kernel launches and reads x once. A mixer's 1-wide gate projections alone would
    be two launches that barely use the GPU. Where one of the projections is not a plain nn.Linear, each is called as
    itself."""
    groups = [g if isinstance(g, tuple) else (g,) for g in groups]
    layers = [layer for g in groups for layer in g]
    if not all(map(is_plain_linear, layers)):
        return [torch.cat([layer(x) for layer in g], dim=-1) if len(g) > 1 else g[0](x) for g in groups]
    weight = torch.cat([layer.weight for layer in layers]) if len(layers) > 1 else layers[0].weight
    return list(F.linear(x, weight).split([sum(layer.out_features for layer in g) for g in groups], dim=-1))


def fused_short_conv(x: torch.Tensor, convs: list[ShortConvolution], cu_seqlens=None, cache=None,
                     key: str = "conv", context=None) -> list[torch.Tensor]:
    """Several short convolutions over the channel blocks of ``x``, run as one convolution, with one output per
    convolution. The convolution is depthwise, so each channel has its own filter and concatenating the filters is
    exact."""
    weight = torch.cat([c.weight for c in convs]).squeeze(1)
    biases = [c.bias for c in convs]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    state = cache.get(key) if cache is not None else None
    ys, new_state = convs[0].ops.short_conv(x, weight, bias, "silu", [c.weight.shape[0] for c in convs],
                                   cu_seqlens=cu_seqlens, initial_state=state, output_final_state=cache is not None,
                                   context=context)
    if cache is not None:
        cache[key] = new_state
    return ys


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with FLA's names."""

    def __init__(self, dim: int, hidden_dim: int, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.ops = kernels
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        # Two products, not one over the concatenated weights (fused_linear). The backward pass of that split
        # would concatenate the gate and up gradients, [tokens, 2 x hidden_dim], the largest copy of a step, and
        # the two products are each large enough to run at full speed.
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not is_plain_linear(self.down_proj):  # a Float8Linear computes its own product (is_plain_linear)
            return self.down_proj(F.silu(gate) * up)
        # the product silu(gate) * up is not kept for the backward pass (ops.swiglu_linear)
        return self.ops.swiglu_linear(gate, up, self.down_proj.weight)


@torch.no_grad()
def init_log_uniform_A(A_log: torch.Tensor, low: float = 1.0, high: float = 16.0) -> None:
    """A_log = log(A), A ~ U(low, high): decay rates spread over an order of magnitude."""
    nn.init.uniform_(A_log, low, high)
    A_log.log_()


@torch.no_grad()
def init_dt_bias(dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> None:
    """dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] and at least ``floor`` (Mamba's init)."""
    nn.init.uniform_(dt_bias)
    dt_bias.mul_(math.log(dt_max) - math.log(dt_min)).add_(math.log(dt_min)).exp_().clamp_(min=floor)
    dt_bias.add_(torch.log(-torch.expm1(-dt_bias)))


def new_positions(cache, key: str, T: int, rows: int, device, context=None) -> torch.Tensor:
    """The positions of an attention sublayer's T new tokens.

    They are [1, T] after the ``key`` sequence its cache holds. Where the cache holds left-padded rows of other lengths
    (``key_mask``), they are [B, T], each row after its own. Under context parallelism (``context``: the rank's shard)
    they are the positions the tokens have in the unsplit sequence."""
    if context is not None:
        return context.positions.to(device).unsqueeze(0)
    if cache is not None and "key_mask" in cache:
        return cache["key_mask"].sum(1, keepdim=True) + torch.arange(T, device=device)
    offset = cache[key].shape[1] if cache is not None and key in cache else 0
    return positions_of(T, rows, offset, device).unsqueeze(0)


def extend_cache(cache, **sequences: torch.Tensor) -> list[torch.Tensor]:
    """Each cached sequence [B, S, ...] with the new tokens' [B, T, ...] appended; the cache keeps the result. Where the
    cache holds a key mask, it grows by the T new positions, all real."""
    out = []
    for name, new in sequences.items():
        if name in cache:
            new = torch.cat([cache[name], new], dim=1)
        cache[name] = new
        out.append(new)
    if "key_mask" in cache:
        B, T = next(iter(sequences.values())).shape[:2]
        cache["key_mask"] = torch.cat([cache["key_mask"], cache["key_mask"].new_ones(B, T)], dim=1)
    return out

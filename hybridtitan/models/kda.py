"""Kimi Delta Attention (Kimi Linear, 2025), with FLA's parameter names and shapes.

Gated DeltaNet whose decay is one per key channel, from a low-rank projection:

    decay_t = -exp(A_log) * softplus(W_f2 W_f1 x + dt_bias)    (A_log per head, dt_bias per head and key channel)
    out     = W_o(RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g))    (low-rank output gate with a bias)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .args import KDAArgs
from .modules import GatedRMSNorm, ShortConvolution, fused_linear, fused_short_conv, init_dt_bias, init_log_uniform_A


class KimiDeltaAttention(nn.Module):
    def __init__(self, dim: int, args: KDAArgs, norm_eps: float, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.ops = kernels
        self.num_heads, self.head_dim, self.head_v_dim = args.num_heads, args.head_dim, args.head_v_dim
        key_dim, value_dim = args.num_heads * args.head_dim, args.num_heads * args.head_v_dim
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        self.q_conv1d = ShortConvolution(key_dim, args.conv_size, kernels=kernels)
        self.k_conv1d = ShortConvolution(key_dim, args.conv_size, kernels=kernels)
        self.v_conv1d = ShortConvolution(value_dim, args.conv_size, kernels=kernels)
        # low-rank decay: rank head_v_dim, as FLA
        self.f_proj = nn.Sequential(nn.Linear(dim, args.head_v_dim, bias=False),
                                    nn.Linear(args.head_v_dim, key_dim, bias=False))
        self.b_proj = nn.Linear(dim, args.num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(args.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(key_dim))
        self.g_proj = nn.Sequential(nn.Linear(dim, args.head_v_dim, bias=False),
                                    nn.Linear(args.head_v_dim, value_dim, bias=True))
        self.o_norm = GatedRMSNorm(args.head_v_dim, eps=norm_eps, activation="sigmoid", kernels=kernels)
        self.o_proj = nn.Linear(value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens=None, cache=None, context=None, **_) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_dim, self.head_v_dim
        qkv, f, g, b = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.f_proj[0], self.g_proj[0],
                                    self.b_proj)
        q, k, v = fused_short_conv(qkv, [self.q_conv1d, self.k_conv1d, self.v_conv1d], cu_seqlens, cache,
                                   context=context)
        o, state = self.ops.kda(
            q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V), self.f_proj[1](f).view(B, T, H, K), b,
            self.A_log, self.dt_bias, cu_seqlens=cu_seqlens,
            initial_state=cache.get("recurrent") if cache is not None else None, output_final_state=cache is not None,
            site=self, context=context,
        )
        if cache is not None:
            cache["recurrent"] = state
        o = self.o_norm(o.to(x.dtype), self.g_proj[1](g).view(B, T, H, V))
        return self.o_proj(o.reshape(B, T, -1))

    @torch.no_grad()
    def init_special(self) -> None:
        # dt_bias from Mamba's log-uniform dt: a dt_bias of ones (Primus's) makes the initial decay ~20x too strong
        init_log_uniform_A(self.A_log)
        init_dt_bias(self.dt_bias)

"""Gated DeltaNet (Yang et al., 2024), with FLA's parameter names and shapes.

    q, k, v  = SiLU(causal_conv(W_q x)), SiLU(causal_conv(W_k x)), SiLU(causal_conv(W_v x))
    decay_t  = -exp(A_log) * softplus(W_a x + dt_bias)        (one per value head, float32)
    beta_t   = sigmoid(W_b x)
    o        = gated_delta_rule(l2norm(q), l2norm(k), v, decay, beta)
    out      = W_o(RMSNorm(o) * SiLU(W_g x))                    (per head)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .args import GDNArgs
from .modules import GatedRMSNorm, ShortConvolution, fused_linear, fused_short_conv, init_dt_bias, init_log_uniform_A


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, args: GDNArgs, norm_eps: float, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.ops = kernels
        self.num_heads, self.num_v_heads = args.num_heads, args.num_v_heads
        self.head_dim, self.head_v_dim = args.head_dim, args.head_v_dim
        key_dim, value_dim = args.num_heads * args.head_dim, args.num_v_heads * args.head_v_dim
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        self.a_proj = nn.Linear(dim, args.num_v_heads, bias=False)
        self.b_proj = nn.Linear(dim, args.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(args.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(args.num_v_heads))
        self.q_conv1d = ShortConvolution(key_dim, args.conv_size, kernels=kernels)
        self.k_conv1d = ShortConvolution(key_dim, args.conv_size, kernels=kernels)
        self.v_conv1d = ShortConvolution(value_dim, args.conv_size, kernels=kernels)
        self.g_proj = nn.Linear(dim, value_dim, bias=False)
        self.o_norm = GatedRMSNorm(args.head_v_dim, eps=norm_eps, activation="swish", kernels=kernels)
        self.o_proj = nn.Linear(value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens=None, cache=None, context=None, **_) -> torch.Tensor:
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        qkv, g, a, b = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.g_proj, self.a_proj, self.b_proj)
        q, k, v = fused_short_conv(qkv, [self.q_conv1d, self.k_conv1d, self.v_conv1d], cu_seqlens, cache,
                                   context=context)
        o, state = self.ops.gated_delta_rule(
            q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V), a, b, self.A_log, self.dt_bias,
            cu_seqlens=cu_seqlens, initial_state=cache.get("recurrent") if cache is not None else None,
            output_final_state=cache is not None, site=self, context=context,
        )
        if cache is not None:
            cache["recurrent"] = state
        o = self.o_norm(o.to(x.dtype), g.view(B, T, HV, V))
        return self.o_proj(o.reshape(B, T, -1))

    @torch.no_grad()
    def init_special(self) -> None:
        init_log_uniform_A(self.A_log)
        init_dt_bias(self.dt_bias)

"""Mamba2 (Dao & Gu, 2024), the SSD layer as Megatron's MambaMixer lays it out.

    [z | x | B | C | dt] = W_in u
    x, B, C  = SiLU(causal_conv([x | B | C]) + b)       (x, B of xb_heads heads repeated to every head, where set)
    dt       = softplus(dt + dt_bias);  A = -exp(A_log)
    y        = SSD(x * dt, A * dt, B, C) + D * x
    out      = W_out(RMSNorm_grouped(y * SiLU(z)))

SSD is linear attention with one scalar decay per head, so it runs on the simple-GLA chunk kernel with
q = C, k = B, v = x * dt, log decay A * dt and scale 1: no mamba_ssm, no CUDA-only code.

With ``xb_heads`` set, x and B are projected (and convolved) for that many heads only, each then serving a group
of heads as grouped-query attention's keys and values do: MambaInLlama's layout, which an attention layer's
W_V, W_K (key/value heads) and W_Q initialise (hybridtitan.upcycle).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .args import Mamba2Args
from .modules import GatedRMSNorm, ShortConvolution, init_dt_bias, init_log_uniform_A


class Mamba2(nn.Module):
    def __init__(self, dim: int, args: Mamba2Args, norm_eps: float, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.ops = kernels
        self.d_inner = dim * args.expand
        self.head_dim, self.d_state, self.n_groups = args.head_dim, args.d_state, args.n_groups
        self.num_heads = self.d_inner // args.head_dim
        self.bc_dim = args.n_groups * args.d_state
        self.x_heads = args.xb_heads or self.num_heads  # heads of x as projected
        self.b_groups = args.xb_heads or args.n_groups  # groups of B as projected
        self.x_dim, self.b_dim = self.x_heads * args.head_dim, self.b_groups * args.d_state
        self.conv_dim = self.x_dim + self.b_dim + self.bc_dim
        self.in_proj = nn.Linear(dim, self.d_inner + self.conv_dim + self.num_heads, bias=False)
        self.conv1d = ShortConvolution(self.conv_dim, args.conv_size, bias=True, kernels=kernels)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, eps=args.norm_eps, activation="swish", norm_before_gate=False,
                                 group_size=self.d_inner // args.n_groups, kernels=kernels)
        self.out_proj = nn.Linear(self.d_inner, dim, bias=False)

    def forward(self, u: torch.Tensor, cu_seqlens=None, cache=None, context=None, **_) -> torch.Tensor:
        Bsz, T, _ = u.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        z, xbc, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, H], dim=-1)
        xbc = self.conv1d(xbc, cu_seqlens, cache, "conv", context)
        x, Bm, Cm = xbc.split([self.x_dim, self.b_dim, self.bc_dim], dim=-1)
        # every head of x and group of B and C serves consecutive heads (none shared: one each)
        x = x.view(Bsz, T, self.x_heads, P).repeat_interleave(H // self.x_heads, dim=2)
        Bm = Bm.view(Bsz, T, self.b_groups, N).repeat_interleave(H // self.b_groups, dim=2)
        Cm = Cm.view(Bsz, T, G, N).repeat_interleave(H // G, dim=2)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [B, T, H]
        A = -self.A_log.float().exp()
        y, state = self.ops.simple_gla(
            Cm, Bm, (x * dt.unsqueeze(-1)).to(x.dtype), A * dt, scale=1.0, cu_seqlens=cu_seqlens,
            initial_state=cache.get("recurrent") if cache is not None else None,
            output_final_state=cache is not None, site=self, context=context,
        )
        if cache is not None:
            cache["recurrent"] = state
        y = y.to(x.dtype) + x * self.D.to(x.dtype).view(H, 1)
        y = self.norm(y.reshape(Bsz, T, self.d_inner), z)
        return self.out_proj(y)

    @torch.no_grad()
    def init_special(self) -> None:
        init_log_uniform_A(self.A_log)
        init_dt_bias(self.dt_bias)
        nn.init.ones_(self.D)

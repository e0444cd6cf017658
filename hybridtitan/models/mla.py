"""Multi-latent attention (DeepSeek-V2), the attention of the hybrids.

    q            = W_q_up(RMSNorm(W_q_down x))                    per head [q_nope | q_rope]
    [c_kv | k_r] = W_kv_down x                                   one latent and one RoPE key shared by all heads
    [k_nope | v] = W_kv_up(RMSNorm(c_kv))                        per head
    o            = W_o softmax(q k^T * scale + causal) v,  k = [k_nope | RoPE(k_r)],  q = [q_nope | RoPE(q_rope)]

With ``latent_norm`` off, the two latent RMSNorms are left out. That is the MLA upcycled from attention
(hybridtitan.upcycle), whose low-rank factors reproduce the attention's projections only as plain products.

RoPE rotates the two halves of the rope channels (rotate-half). The exported model uses the same layout, so no channel
permutation is ever needed. YaRN scaling follows DeepSeek-V2; a scaling factor of 1 is plain RoPE. Decoding caches the
latent c_kv and the rotated k_r: (kv_lora_rank + qk_rope_head_dim) numbers per token."""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .args import MLAArgs
from .modules import RMSNorm, extend_cache, fused_linear, new_positions
from .rope import apply_rope, rope_cos_sin, yarn_inv_freq, yarn_mscale


def mla_inv_freq(args: MLAArgs, device=None) -> torch.Tensor:
    """The frequencies of the rope channels, YaRN-interpolated when rope_scaling_factor > 1."""
    return yarn_inv_freq(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling_factor,
                         args.original_max_position_embeddings, args.beta_fast, args.beta_slow, device)


class MultiLatentAttention(nn.Module):
    def __init__(self, dim: int, args: MLAArgs, norm_eps: float, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.ops = kernels
        self.args = args
        self.num_heads = args.num_heads
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank > 0:
            self.q_down_proj = nn.Linear(dim, args.q_lora_rank, bias=False)
            if args.latent_norm:
                self.q_norm = RMSNorm(args.q_lora_rank, eps=norm_eps, kernels=kernels)
            self.q_up_proj = nn.Linear(args.q_lora_rank, args.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, args.num_heads * self.qk_head_dim, bias=False)
        self.kv_down_proj = nn.Linear(dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        if args.latent_norm:
            self.kv_norm = RMSNorm(args.kv_lora_rank, eps=norm_eps, kernels=kernels)
        self.kv_up_proj = nn.Linear(args.kv_lora_rank, args.num_heads * (args.qk_nope_head_dim + args.v_head_dim),
                                    bias=False)
        self.o_proj = nn.Linear(args.num_heads * args.v_head_dim, dim, bias=False)
        m = yarn_mscale(args.rope_scaling_factor, args.mscale_all_dim)
        self.softmax_scale = self.qk_head_dim ** -0.5 * m * m
        # YaRN scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
        self.rope_mscale = yarn_mscale(args.rope_scaling_factor, args.mscale) / m

    def forward(self, x: torch.Tensor, cu_seqlens=None, cache=None, rows: int = 1, context=None, **_) -> torch.Tensor:
        B, T, _ = x.shape
        a = self.args
        H = self.num_heads
        if a.q_lora_rank > 0:
            q_latent, kv_latent = fused_linear(x, self.q_down_proj, self.kv_down_proj)
            q = self.q_up_proj(self.q_norm(q_latent) if a.latent_norm else q_latent)
        else:
            q, kv_latent = fused_linear(x, self.q_proj, self.kv_down_proj)
        q = q.view(B, T, H, self.qk_head_dim)
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = kv_latent.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)

        positions = new_positions(cache, "c_kv", T, rows, x.device, context)
        cos, sin = rope_cos_sin(positions, mla_inv_freq(a, x.device), self.rope_mscale)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)
        if cache is not None:
            c_kv, k_rope = extend_cache(cache, c_kv=c_kv, k_rope=k_rope)
        # context parallelism: the whole sequence's small latent and rope key, not its keys and values
        c_kv, k_rope = self.ops.whole_sequence(c_kv, context), self.ops.whole_sequence(k_rope, context)
        S = c_kv.shape[1]
        latent = self.kv_norm(c_kv) if a.latent_norm else c_kv
        kv = self.kv_up_proj(latent).view(B, S, H, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, S, H, a.qk_rope_head_dim)], dim=-1)
        o = self.ops.attention(q, k, v, self.softmax_scale, cu_seqlens=cu_seqlens, rows=rows,
                               key_mask=cache.get("key_mask") if cache is not None else None, context=context)
        return self.o_proj(o.reshape(B, T, H * a.v_head_dim))

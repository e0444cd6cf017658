"""Grouped-query attention with RoPE (Llama 3's attention), with transformers' LlamaAttention names and shapes.

    q = W_q x  (num_heads heads),   k = W_k x,  v = W_v x  (num_kv_heads heads, each shared by a group of
                                                            num_heads / num_kv_heads query heads)
    o = W_o softmax(RoPE(q) RoPE(k)^T / sqrt(head_dim) + causal) v

RoPE rotates every channel of q and k (rotate-half), at Llama 3.1's scaled frequencies where rope_scaling is
"llama3" (hybridtitan.models.rope). Decoding caches the rotated keys and the values of the kv heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .args import GQAArgs
from .modules import extend_cache, fused_linear, new_positions
from .rope import apply_rope, llama3_inv_freq, plain_inv_freq, rope_cos_sin


def gqa_inv_freq(args: GQAArgs, device=None) -> torch.Tensor:
    if args.rope_scaling == "llama3":
        return llama3_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling_factor, args.low_freq_factor,
                               args.high_freq_factor, args.original_max_position_embeddings, device)
    return plain_inv_freq(args.head_dim, args.rope_theta, device)


class GroupedQueryAttention(nn.Module):
    def __init__(self, dim: int, args: GQAArgs, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.ops, self.args = kernels, args
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(dim, args.num_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, args.num_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, args.num_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, dim, bias=False)
        self.softmax_scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cu_seqlens=None, cache=None, rows: int = 1, context=None, **_) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = fused_linear(x, self.q_proj, self.k_proj, self.v_proj)
        cos, sin = rope_cos_sin(new_positions(cache, "k", T, rows, x.device, context),
                                gqa_inv_freq(self.args, x.device))
        q = apply_rope(q.view(B, T, H, D), cos, sin)
        k = apply_rope(k.view(B, T, KV, D), cos, sin)
        v = v.view(B, T, KV, D)
        if cache is not None:
            k, v = extend_cache(cache, k=k, v=v)
        k, v = self.ops.whole_sequence(k, context), self.ops.whole_sequence(v, context)  # context parallelism
        o = self.ops.attention(q, k, v, self.softmax_scale, cu_seqlens=cu_seqlens, rows=rows,
                               key_mask=cache.get("key_mask") if cache is not None else None, context=context)
        return self.o_proj(o.reshape(B, T, H * D))

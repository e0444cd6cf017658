"""Training FLOPs per token, counted per sublayer from what it computes (forward + backward = 3 x forward).

Matrix products count 2 FLOPs per multiply-add. Every weight matrix costs 6 FLOPs per parameter per token. Beyond the
weights:

- Attention is quadratic. It is causal, so a token attends to (seq_len + 1) / 2 keys on average. The scores
  (q.k over qk_head_dim) and the weighted sum (over v_head_dim) cost 2 * H * ctx * (dqk + dv) forward for MLA.
  Grouped-query attention costs the same with dqk = dv = head_dim and H its query heads. With packed documents
  (cu_seqlens) tokens attend only within their document, so there this count, and the MFU made from it, is an
  upper bound.
- GDN and KDA are linear in the sequence. The chunked delta rule with chunk C = 64 does, per token and value
  head: the state read and write (q S, k S and k^T u: 3 x 2 K V), the within-chunk products (q k^T and k k^T:
  2 x C K, causal halves), and the triangular solve and its use (C (K + V) + C V, causal halves).
- Mamba2's SSD (simple GLA) does the state read and write (2 x 2 N P) and the within-chunk products (C N + C P).
- Short convolutions cost 2 W per channel.

The output layer, tied or not, counts as a weight matrix. The embedding lookup costs nothing."""

from __future__ import annotations

from .args import ModelArgs

CHUNK = 64


def _delta_rule_fwd(heads: int, k: int, v: int) -> float:
    return heads * (3 * 2 * k * v + 2 * CHUNK * k + CHUNK * (k + v) + CHUNK * v)


def sublayer_params(args: ModelArgs, kind: str) -> dict[str, int]:
    """Parameters of one sublayer: 'matmul' (weight matrices) and 'other' (norms, biases, convolutions, decays)."""
    d = args.dim
    if kind == "mlp":
        return {"matmul": 3 * d * args.ffn_dim, "other": d}
    if kind == "attention" and args.attention == "gqa":
        g = args.gqa
        return {"matmul": 2 * d * (g.num_heads + g.num_kv_heads) * g.head_dim, "other": d}
    if kind == "attention":
        a = args.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = d * a.q_lora_rank + a.q_lora_rank * a.num_heads * qk if a.q_lora_rank else d * a.num_heads * qk
        kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + \
            a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        o = a.num_heads * a.v_head_dim * d
        norms = d + (a.kv_lora_rank + (a.q_lora_rank or 0) if a.latent_norm else 0)
        return {"matmul": q + kv + o, "other": norms}
    if args.mixer == "gdn":
        g = args.gdn
        kd, vd = g.num_heads * g.head_dim, g.num_v_heads * g.head_v_dim
        matmul = d * (2 * kd + 2 * vd + 2 * g.num_v_heads) + vd * d
        other = g.conv_size * (2 * kd + vd) + 2 * g.num_v_heads + g.head_v_dim + d
        return {"matmul": matmul, "other": other}
    if args.mixer == "kda":
        g = args.kda
        kd, vd = g.num_heads * g.head_dim, g.num_heads * g.head_v_dim
        matmul = d * (2 * kd + vd) + (d * g.head_v_dim + g.head_v_dim * kd) + d * g.num_heads + \
            (d * g.head_v_dim + g.head_v_dim * vd) + vd * d
        other = g.conv_size * (2 * kd + vd) + g.num_heads + kd + vd + g.head_v_dim + d
        return {"matmul": matmul, "other": other}
    m = args.mamba2
    inner = d * m.expand
    heads = inner // m.head_dim
    conv = mamba2_conv_channels(args)
    matmul = d * (inner + conv + heads) + inner * d
    other = (m.conv_size + 1) * conv + 3 * heads + inner + d
    return {"matmul": matmul, "other": other}


def mamba2_conv_channels(args: ModelArgs) -> int:
    """Channels of Mamba2's x, B and C as projected. Where xb_heads is set, x and B have only xb_heads heads."""
    m = args.mamba2
    inner = args.dim * m.expand
    if m.xb_heads:
        return m.xb_heads * (m.head_dim + m.d_state) + m.n_groups * m.d_state
    return inner + 2 * m.n_groups * m.d_state


def sublayer_flops(args: ModelArgs, kind: str, seq_len: int) -> float:
    """Training FLOPs per token of one sublayer."""
    p = sublayer_params(args, kind)
    fwd = 2 * p["matmul"]
    if kind == "attention" and args.attention == "gqa":
        g = args.gqa
        fwd += 2 * g.num_heads * (seq_len + 1) / 2 * 2 * g.head_dim
    elif kind == "attention":
        a = args.mla
        ctx = (seq_len + 1) / 2
        fwd += 2 * a.num_heads * ctx * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    elif kind == "mixer" and args.mixer == "gdn":
        g = args.gdn
        fwd += _delta_rule_fwd(g.num_v_heads, g.head_dim, g.head_v_dim)
        fwd += 2 * g.conv_size * (2 * g.num_heads * g.head_dim + g.num_v_heads * g.head_v_dim)
    elif kind == "mixer" and args.mixer == "kda":
        g = args.kda
        fwd += _delta_rule_fwd(g.num_heads, g.head_dim, g.head_v_dim)
        fwd += 2 * g.conv_size * g.num_heads * (2 * g.head_dim + g.head_v_dim)
    elif kind == "mixer":
        m = args.mamba2
        heads = args.dim * m.expand // m.head_dim
        fwd += heads * (2 * 2 * m.d_state * m.head_dim + CHUNK * (m.d_state + m.head_dim))
        fwd += 2 * m.conv_size * mamba2_conv_channels(args)
    return 3 * fwd


def flops_per_token(args: ModelArgs, seq_len: int) -> dict:
    """Training FLOPs per token: per sublayer, the output layer and the total."""
    per_layer = [sublayer_flops(args, kind, seq_len) for kind in args.kinds]
    head = 6 * args.dim * args.vocab_size
    return {"sublayers": per_layer, "output_layer": head, "total": sum(per_layer) + head}


def param_counts(args: ModelArgs) -> dict:
    """Total parameters, and parameters outside the embedding and an untied output layer."""
    layers = sum(sum(sublayer_params(args, kind).values()) for kind in args.kinds)
    embedding = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else embedding
    final_norm = args.dim
    return {"total": layers + embedding + head + final_norm, "non_embedding": layers + final_norm,
            "embedding": embedding, "output_layer": head}

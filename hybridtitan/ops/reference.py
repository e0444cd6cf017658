"""PyTorch reference kernels: the chunked algorithms of FLA's Triton ops, written with torch operations.

They run wherever PyTorch runs (the CPU path of the trainer, the tests) and are checked against FLA's own
``naive`` recurrences. Every function takes FLA's argument conventions: tensors are [B, T, H, D], packed
documents come as ``cu_seqlens`` over a batch of one, states are [N, H, K, V]. Work inside a chunk is dense
matrix algebra; across chunks one Python loop over chunk *steps* carries the state (see chunking.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunking import make_layout, positions_in_segment, segment_bounds, segment_ids


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, as FLA's fused l2norm."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _pairwise(gamma: torch.Tensor, inclusive: bool, per_channel: bool) -> torch.Tensor:
    """exp(gamma_t - gamma_j) for j <= t (j < t if not inclusive), else 0.

    gamma: [..., C] (scalar gate) or [..., C, K] (per-channel gate); returns [..., C, C] or [..., C, C, K].
    The difference is masked before the exponential, so the upper triangle never overflows.
    """
    C = gamma.shape[-2] if per_channel else gamma.shape[-1]
    mask = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril(0 if inclusive else -1)
    if per_channel:
        diff = gamma.unsqueeze(-2) - gamma.unsqueeze(-3)  # [..., t, j, K]
        diff = diff.masked_fill(~mask[..., None], float("-inf"))
    else:
        diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # [..., t, j]
        diff = diff.masked_fill(~mask, float("-inf"))
    return diff.exp()


def _expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Grouped heads: value head h reads query/key head h // (HV / H), as FLA's kernels."""
    if x.shape[2] == num_heads:
        return x
    if num_heads % x.shape[2]:
        raise ValueError(f"{num_heads} value heads are not a multiple of {x.shape[2]} key heads")
    return x.repeat_interleave(num_heads // x.shape[2], dim=2)


def _to_chunks(layout, x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, *d] -> [num_chunks, H, C, *d] in float32."""
    flat = x.reshape(-1, *x.shape[2:]).float()
    y = layout.gather(flat)  # [NC, C, H, *d]
    return y.transpose(1, 2)


def _from_chunks(layout, y: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """[num_chunks, H, C, d] -> [B, T, H, d]."""
    flat = layout.scatter(y.transpose(1, 2))
    return flat.view(batch, seq_len, *flat.shape[1:])


def _initial_states(initial_state, layout, shape, device):
    if initial_state is None:
        return torch.zeros(layout.num_segments, *shape, device=device, dtype=torch.float32)
    if initial_state.shape[0] != layout.num_segments:
        raise ValueError(
            f"initial_state holds {initial_state.shape[0]} states for {layout.num_segments} sequences"
        )
    return initial_state.float().index_select(0, layout.order)


def _unsort_states(states: torch.Tensor, layout) -> torch.Tensor:
    out = torch.empty_like(states)
    return out.index_copy(0, layout.order, states)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked (WY representation), for a scalar gate (GDN) or a per-key-channel gate (KDA).

    Per head, with S the [K, V] state:  S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);
    S <- S + k_t u_t^T;  o_t = S^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K] (log decay); beta: [B, T, HV].
    Returns o [B, T, HV, V] (dtype of v) and, if asked, the final states [N, HV, K, V] (float32).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    per_channel = g.dim() == 4
    scale = K ** -0.5 if scale is None else scale
    q, k = _expand_heads(q, HV), _expand_heads(k, HV)
    layout = make_layout(segment_bounds(B, T, cu_seqlens), chunk_size, q.device)

    q, k, v = (_to_chunks(layout, x) for x in (q, k, v))  # [NC, HV, C, d]
    beta = _to_chunks(layout, beta.unsqueeze(-1))  # [NC, HV, C, 1]
    gate = _to_chunks(layout, g if per_channel else g.unsqueeze(-1))  # [NC, HV, C, K or 1]
    gamma = gate.cumsum(2)  # decay from the chunk start to each position (inclusive)
    q = q * scale

    if per_channel:
        decay_strict = _pairwise(gamma, inclusive=False, per_channel=True)  # [NC, HV, C, C, K]
        decay_incl = _pairwise(gamma, inclusive=True, per_channel=True)
        kk = torch.einsum("nhtc,nhjc,nhtjc->nhtj", k, k, decay_strict)
        qk = torch.einsum("nhtc,nhjc,nhtjc->nhtj", q, k, decay_incl)
    else:
        gs = gamma.squeeze(-1)
        kk = (k @ k.transpose(-1, -2)) * _pairwise(gs, inclusive=False, per_channel=False)
        qk = (q @ k.transpose(-1, -2)) * _pairwise(gs, inclusive=True, per_channel=False)

    # (I + diag(beta) L) [U | W] = diag(beta) [v | k * exp(gamma)]: one unit-lower-triangular solve per chunk
    C = q.shape[2]
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    system = eye + beta * kk
    rhs = torch.cat([beta * v, beta * k * gamma.exp()], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    U, W = sol[..., :V], sol[..., V:]
    q_decayed = q * gamma.exp()  # reads the state carried in from earlier chunks
    gamma_last = gamma[:, :, -1:, :]  # [NC, HV, 1, K or 1]
    k_to_end = k * (gamma_last - gamma).exp()  # carries each key to the chunk end

    S = _initial_states(initial_state, layout, (HV, K, V), q.device)
    outputs = []
    for _, start, n in layout.step_slices():
        sl = slice(start, start + n)
        S_act = S[:n]
        u = U[sl] - W[sl] @ S_act
        outputs.append(q_decayed[sl] @ S_act + qk[sl] @ u)
        S_new = S_act * gamma_last[sl].transpose(-1, -2).exp() + k_to_end[sl].transpose(-1, -2) @ u
        S = torch.cat([S_new, S[n:]], dim=0) if n < S.shape[0] else S_new
    o = torch.cat(outputs, dim=0) if outputs else v.new_zeros(0, HV, C, V)
    o = _from_chunks(layout, o, B, T).to(out_dtype)
    final = _unsort_states(S, layout) if output_final_state else None
    return o, final


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with a scalar decay per head (Mamba2's SSD): S <- exp(g_t) S + k_t v_t^T; o_t = S^T q_t.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H]. Returns o [B, T, H, V] and the final states.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    scale = K ** -0.5 if scale is None else scale
    layout = make_layout(segment_bounds(B, T, cu_seqlens), chunk_size, q.device)
    q, k, v = (_to_chunks(layout, x) for x in (q, k, v))
    gamma = _to_chunks(layout, g.unsqueeze(-1)).cumsum(2)  # [NC, H, C, 1]
    q = q * scale
    qk = (q @ k.transpose(-1, -2)) * _pairwise(gamma.squeeze(-1), inclusive=True, per_channel=False)
    intra = qk @ v
    q_decayed = q * gamma.exp()
    gamma_last = gamma[:, :, -1:, :]
    k_to_end = k * (gamma_last - gamma).exp()

    S = _initial_states(initial_state, layout, (H, K, V), q.device)
    outputs = []
    for _, start, n in layout.step_slices():
        sl = slice(start, start + n)
        S_act = S[:n]
        outputs.append(intra[sl] + q_decayed[sl] @ S_act)
        S_new = S_act * gamma_last[sl].exp() + k_to_end[sl].transpose(-1, -2) @ v[sl]
        S = torch.cat([S_new, S[n:]], dim=0) if n < S.shape[0] else S_new
    o = torch.cat(outputs, dim=0) if outputs else v.new_zeros(0, H, q.shape[2], V)
    o = _from_chunks(layout, o, B, T).to(out_dtype)
    final = _unsort_states(S, layout) if output_final_state else None
    return o, final


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution over time, restarted at every document start.

    x: [B, T, D]; weight: [D, W]; states are [N, D, W]: the last W inputs of each sequence, oldest first,
    as FLA's ``causal_conv1d``. One term per kernel tap (W of them), never a loop over tokens.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    bounds = segment_bounds(B, T, cu_seqlens)
    flat = x.reshape(B * T, D)
    pos = positions_in_segment(bounds, x.device)  # [BT]
    seg = segment_ids(bounds, x.device)
    y = flat * weight[:, W - 1]
    for shift in range(1, W):
        shifted = torch.cat([flat.new_zeros(shift, D), flat[:-shift]], dim=0)[: B * T]  # B * T may be < shift
        inside = (pos >= shift).unsqueeze(1)
        if initial_state is not None:
            # before its start, a sequence reads its initial state: index W - (shift - pos) of it
            hist_idx = (W - shift + pos).clamp(min=0, max=W - 1)
            hist = initial_state.to(flat.dtype)[seg, :, hist_idx]  # [BT, D]
            shifted = torch.where(inside, shifted, hist)
        else:
            shifted = torch.where(inside, shifted, torch.zeros((), dtype=flat.dtype, device=flat.device))
        y = y + shifted * weight[:, W - 1 - shift]
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    final = None
    if output_final_state:
        final = _conv_final_state(flat, bounds, W, initial_state)
    return y.view(B, T, D), final


def _conv_final_state(flat, bounds, W, initial_state):
    states = []
    for n in range(len(bounds) - 1):
        s, e = int(bounds[n]), int(bounds[n + 1])
        seq = flat[s:e].t()  # [D, L]
        if initial_state is not None:
            seq = torch.cat([initial_state[n].to(seq.dtype), seq], dim=1)
        elif seq.shape[1] < W:
            seq = torch.cat([seq.new_zeros(seq.shape[0], W - seq.shape[1]), seq], dim=1)
        states.append(seq[:, -W:])
    return torch.stack(states)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in the input dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "swish",
    norm_before_gate: bool = True, group_size: int | None = None,
) -> torch.Tensor:
    """Output norm of the mixers: rmsnorm(x) * act(gate) (FLA's FusedRMSNormGated, norm_before_gate=True), or
    rmsnorm(x * act(gate)) per group of channels (Mamba2's RMSNormGated, norm_before_gate=False)."""
    xf, gf = x.float(), gate.float()
    act = F.silu(gf) if activation in ("swish", "silu") else torch.sigmoid(gf)
    if not norm_before_gate:
        xf = xf * act
    shape = xf.shape
    if group_size is not None and group_size != shape[-1]:
        xf = xf.view(*shape[:-1], shape[-1] // group_size, group_size)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.view(shape) * weight.float()
    if norm_before_gate:
        y = y * act
    return y.to(x.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None,
    batch_rows: int = 1, key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention with SDPA; with ``cu_seqlens`` no token attends across a document; with
    ``key_mask`` [B, S] (rows of other lengths, left-padded) no query attends to a key that is False there.

    q: [B, T, H, Dk]; k: [B, S, Hk, Dk]; v: [B, S, Hk, Dv], Hk dividing H (grouped-query attention: key/value head
    j serves query heads j * H / Hk ... (j + 1) * H / Hk - 1). Packed documents arrive flattened as a batch of one;
    ``batch_rows`` (the rows they were flattened from) keeps the attention per row, so its cost does not grow with
    B^2.
    """
    B, T = q.shape[:2]
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    if cu_seqlens is None:
        S = k.shape[1]
        mask = None
        if S != T or key_mask is not None:  # decoding: the T new queries are the last T positions of the S keys
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            if key_mask is not None:
                mask = (mask & key_mask.bool()[:, None, :]).unsqueeze(1)  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            scale=scale, **gqa,
        )
        return out.transpose(1, 2)
    bounds = segment_bounds(B, T, cu_seqlens)
    rows = batch_rows
    if T % rows:
        raise ValueError(f"{T} packed tokens do not split into {rows} rows")
    L = T // rows
    seg = segment_ids(bounds, q.device).view(rows, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    mask = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal  # [rows, L, L]
    qr, kr, vr = (x.view(rows, L, *x.shape[2:]).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask.unsqueeze(1), scale=scale, **gqa)
    return out.transpose(1, 2).reshape(B, T, out.shape[1], out.shape[-1])

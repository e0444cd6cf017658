"""Context parallelism (CP): one training sequence split over the ranks of a process group, each rank computing
its shard, with outputs and gradients equal to the single-process computation.

The layout. Each row of T tokens (B dense rows, or one packed row of documents given by ``cu_seqlens``) is cut
into 2W equal chunks of C = T / 2W tokens for W ranks. Rank r holds two of them, in this order:

    contiguous   chunks 2r and 2r + 1        (one contiguous slice of T / W tokens)
    zigzag       chunks r and 2W - 1 - r     (causal attention's work balanced: an early chunk and a late one)

Locally, every chunk starts a new segment, and every document start inside a chunk starts another one: the
rank's ``cu_seqlens`` cut the documents at chunk boundaries. A segment that begins a chunk whose first token is
not a document start *continues* a document of the previous global chunk: it needs that chunk's state.

The recurrences (GDN, KDA, Mamba2's SSD through simple GLA) by affine summaries, the method of FLA's ``fla.ops.cp``
(written here with the ordinary ``Kernels`` ops, so the same code runs the PyTorch reference on CPUs and FLA's
kernels on GPUs):

    1. each local chunk's effect on the state it hands on is affine, S_out = M S_in + B: B is the chunk's final
       state from a zero initial state; M (K x K per value head for the delta rules, exp(sum of the log decays)
       per head for simple GLA) is the product of its per-token transitions, zero where a document starts inside;
    2. the summaries of all 2W chunks are all-gathered (with autograd: the gradients of the other ranks' uses
       come back through the gather's backward) and folded in global chunk order into the state entering each
       local chunk (zero where a chunk starts a document);
    3. the op runs on the local chunks again with those initial states.

The short convolution needs, per chunk, the previous global chunk's last width - 1 inputs (the halo); attention
gathers the keys and values (for the MLA: its small latent and rope key) and runs each local query segment against
its document's keys up to that segment's end. Every collective has autograd and every rank builds the same graph
(masks multiply, they never branch on the rank), so the backward passes issue the same collectives in the same
order on every rank. ``context_parallel_group`` makes the groups: consecutive blocks of the degree's ranks;
``shard_batch`` cuts a training batch (the trainer's, hybridtitan.train) into the rank's part and its shard.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "LAYOUTS", "ContextShard", "Segment", "all_gather", "chunks_of", "context_parallel_group", "cp_attention",
    "cp_causal_conv1d", "cp_gated_delta_rule", "cp_kda", "cp_short_conv", "cp_simple_gla", "gather_sequence",
    "local_cu_seqlens", "shard_batch", "shard_for", "split_sequence",
]

LAYOUTS = ("contiguous", "zigzag")


class Segment(NamedTuple):
    """One local segment of a row: a run of a rank's tokens inside one chunk and one document."""

    local_start: int  # among the rank's 2C tokens of the row
    local_end: int
    global_start: int  # in the row of T tokens
    global_end: int
    document_start: int  # global start of its document (== global_start where it starts the document)
    continues: bool  # continues a document of the previous global chunk: takes that chunk's state


@dataclasses.dataclass(frozen=True, eq=False)
class ContextShard:
    """What one rank holds of a CP-split batch, and what its ops need to know about the others' chunks.

    Per row (dense rows all share it; a packed batch is one row). Built by ``shard_for``; eq=False: it holds
    tensors and a process group, compared by identity."""

    group: dist.ProcessGroup | None  # None: the default group
    rank: int
    degree: int  # W, the ranks of the group
    layout: str  # "contiguous" or "zigzag"
    seq_len: int  # T, tokens per row before the split
    chunk_len: int  # C = T / 2W
    chunks: tuple[int, int]  # global index of each local chunk, in local order
    segments: tuple[Segment, ...]  # the local segments of a row, in local order
    chunk_document_start: tuple[int, ...]  # per global chunk: global start of the document holding its first token
    chunk_restarts: tuple[bool, ...]  # per global chunk: a document starts strictly inside it
    cu_seqlens: torch.Tensor  # [num segments + 1] int64 local boundaries of a row (``local_cu_seqlens``: B rows)
    first_segments: torch.Tensor  # [2] index of each local chunk's first segment
    last_segments: torch.Tensor  # [2] index of each local chunk's last segment
    token_index: torch.Tensor  # [2C] global index of each local token in its row
    positions: torch.Tensor  # [2C] RoPE position of each local token, as the unsplit model numbers them
    document_positions: torch.Tensor  # [2C] index of each local token inside its document

    @property
    def local_len(self) -> int:
        """Tokens of a row on this rank: 2C = T / W."""
        return 2 * self.chunk_len

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The global token ranges [start, end) this rank holds, in local order."""
        return tuple((j * self.chunk_len, (j + 1) * self.chunk_len) for j in self.chunks)

    @property
    def continues(self) -> tuple[bool, ...]:
        """Per local segment: whether it continues a document from the previous global chunk."""
        return tuple(s.continues for s in self.segments)

    def starts_document(self, chunk: int) -> bool:
        """Whether global chunk ``chunk`` begins with a document start (no state or halo comes into it)."""
        return self.chunk_document_start[chunk] == chunk * self.chunk_len

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return split_sequence(x, self)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, self)


# ---------------------------------------------------------------------------------------------------- the layout


def chunks_of(rank: int, degree: int, layout: str) -> tuple[int, int]:
    """The global chunks rank ``rank`` of ``degree`` holds, in local order."""
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    if layout == "zigzag":
        return rank, 2 * degree - 1 - rank
    raise ValueError(f"unknown context-parallel layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def context_parallel_group(degree: int) -> dist.ProcessGroup:
    """This rank's context-parallel group: the job's ranks in consecutive blocks of ``degree``, the ranks of one
    sequence neighbours (on one host where they fit; data parallelism spans the blocks). Every rank calls it, in
    the same order as its other new groups (``torch.distributed.new_group``'s rule). A degree that does not divide
    the world size is refused on every rank alike, before any group is made."""
    world = dist.get_world_size()
    if degree < 1 or world % degree:
        raise ValueError(f"context parallelism over {degree} ranks splits the job's {world} ranks into groups of "
                         f"{degree}: the degree must divide the world size")
    group, _ = dist.new_subgroups(group_size=degree)
    return group


def _document_starts(cu_seqlens: torch.Tensor | None, seq_len: int) -> list[int]:
    """The sorted global starts of the (non-empty) documents of a row; dense rows are one document."""
    if cu_seqlens is None:
        return [0]
    bounds = [int(b) for b in cu_seqlens.detach().cpu().tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len or any(b > c for b, c in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {seq_len}, got {bounds}")
    return sorted({b for b in bounds[:-1] if b < seq_len})  # empty documents (repeated bounds) hold no token


def _chunk_segments(starts: list[int], chunk: int, slot: int, C: int) -> list[Segment]:
    """The segments of global chunk ``chunk``, held in local slot ``slot``: cut at every document start inside."""
    begin, end = chunk * C, (chunk + 1) * C
    inside = starts[bisect.bisect_right(starts, begin): bisect.bisect_left(starts, end)]
    cuts = [begin, *inside, end]
    out = []
    for gs, ge in itertools.pairwise(cuts):
        doc = starts[bisect.bisect_right(starts, gs) - 1]
        out.append(Segment(slot * C + gs - begin, slot * C + ge - begin, gs, ge, doc, gs == begin and doc < begin))
    return out


def shard_for(cu_seqlens: torch.Tensor | None, seq_len: int, group: dist.ProcessGroup | None = None,
              layout: str = "contiguous", *, rows: int = 1, rank: int | None = None, degree: int | None = None,
              device: torch.device | str | None = None) -> ContextShard:
    """This rank's shard of rows of ``seq_len`` tokens: B dense rows (``cu_seqlens`` None) or one packed row whose
    documents ``cu_seqlens`` bounds (int64, 0 ... seq_len).

    ``rows``: the packed row was flattened from that many rows of seq_len / rows tokens, whose RoPE positions
    restart at each (the model's ``positions_of``). ``rank`` and ``degree`` default to the group's (given, they
    plan a shard without a process group: tools and tests). ``device``: of the shard's tensors (default: that of
    ``cu_seqlens``, else the CPU)."""
    rank = dist.get_rank(group) if rank is None else rank
    degree = dist.get_world_size(group) if degree is None else degree
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is not one of the {degree} ranks of a context-parallel group")
    chunks = chunks_of(rank, degree, layout)
    n_chunks = 2 * degree
    if seq_len <= 0 or seq_len % n_chunks:
        raise ValueError(f"context parallelism over {degree} ranks ({layout} layout) cuts a sequence into "
                         f"{n_chunks} equal chunks: T = {seq_len} tokens do not divide by {n_chunks}")
    if seq_len % rows:
        raise ValueError(f"{seq_len} packed tokens do not split into {rows} rows")
    C = seq_len // n_chunks
    starts = _document_starts(cu_seqlens, seq_len)
    if device is None:
        device = cu_seqlens.device if cu_seqlens is not None else "cpu"

    def doc_start(p: int) -> int:
        return starts[bisect.bisect_right(starts, p) - 1]

    segments = [s for slot, j in enumerate(chunks) for s in _chunk_segments(starts, j, slot, C)]
    first = [min(i for i, s in enumerate(segments) if s.local_start // C == slot) for slot in range(2)]
    last = [max(i for i, s in enumerate(segments) if s.local_start // C == slot) for slot in range(2)]
    token_index = torch.cat([torch.arange(j * C, (j + 1) * C) for j in chunks])
    starts_t = torch.tensor(starts, dtype=torch.long)
    doc_of_token = starts_t[torch.searchsorted(starts_t, token_index, right=True) - 1]
    return ContextShard(
        group=group, rank=rank, degree=degree, layout=layout, seq_len=seq_len, chunk_len=C, chunks=chunks,
        segments=tuple(segments),
        chunk_document_start=tuple(doc_start(j * C) for j in range(n_chunks)),
        chunk_restarts=tuple(bisect.bisect_left(starts, (j + 1) * C) > bisect.bisect_right(starts, j * C)
                             for j in range(n_chunks)),
        cu_seqlens=torch.tensor([0] + [s.local_end for s in segments], dtype=torch.long, device=device),
        first_segments=torch.tensor(first, dtype=torch.long, device=device),
        last_segments=torch.tensor(last, dtype=torch.long, device=device),
        token_index=token_index.to(device),
        positions=(token_index % (seq_len // rows)).to(device),
        document_positions=(token_index - doc_of_token).to(device),
    )


def shard_batch(batch: dict, group: dist.ProcessGroup | None = None, layout: str = "contiguous",
                device: torch.device | str | None = None) -> tuple[dict, ContextShard]:
    """This rank's part of a training batch ({"input_ids", "labels" [B, T][, "cu_seqlens"]}, the data loader's),
    and its shard: dense rows each cut alike ([B, 2C] each); packed documents (``cu_seqlens`` over the B rows
    flattened, the rows' starts among them) as one row of B x T tokens whose RoPE positions restart at each row,
    cut as one ([1, B x T / W] each, no ``cu_seqlens``: the shard holds the local boundaries). ``device``: of the
    shard's tensors (default: the batch's), so that a batch still on the host is cut there and only the rank's
    part travels."""
    ids = batch["input_ids"]
    B, T = ids.shape
    cu = batch.get("cu_seqlens")
    device = ids.device if device is None else device
    if cu is None:
        shard = shard_for(None, T, group, layout, device=device)
        rows = {name: batch[name] for name in ("input_ids", "labels")}
    else:
        shard = shard_for(cu.long(), B * T, group, layout, rows=B, device=device)
        rows = {name: batch[name].reshape(1, B * T) for name in ("input_ids", "labels")}
    return {name: split_sequence(x, shard) for name, x in rows.items()}, shard


def split_sequence(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """This rank's part [B, 2C, ...] of a [B, T, ...] tensor (a view in the contiguous layout)."""
    if x.shape[1] != shard.seq_len:
        raise ValueError(f"a sequence of {x.shape[1]} tokens given to a shard of {shard.seq_len}")
    (s0, e0), (s1, e1) = shard.ranges
    if e0 == s1:
        return x[:, s0:e1]
    return torch.cat([x[:, s0:e0], x[:, s1:e1]], dim=1)


class _AllGather(torch.autograd.Function):
    """[W, *x.shape]: every rank's x. Backward: the gradients all ranks hold for rank r's x, summed, to rank r (a
    reduce-scatter). Ours, on the list-based c10d calls that every supported torch keeps without a warning:
    torch.distributed.nn.functional.all_gather, all_gather_into_tensor and reduce_scatter_tensor are deprecated
    in torch 2.13 (a FutureWarning at each call), and their successors do not exist in torch 2.11."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_backend(ctx.group) != "gloo":  # NCCL (RCCL) reduce-scatters; gloo cannot on every supported
            out = torch.empty_like(grad[0])    # torch (on CPUs, or on a GPU: gpu_harness/checks/cp_check.py)
            dist.reduce_scatter(out, [g.contiguous() for g in grad.unbind(0)], group=ctx.group)
            return out, None
        summed = grad.contiguous().clone()  # all_reduce works in place; the incoming gradient may be shared
        dist.all_reduce(summed, group=ctx.group)
        return summed[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """[W, *x.shape]: every rank's ``x`` in rank order, with autograd (each rank's gradient for rank r's part is
    summed into rank r's ``x``)."""
    return _AllGather.apply(x, group)


def _gather_by_chunk(x: torch.Tensor, shard: ContextShard) -> list[torch.Tensor]:
    """All ranks' [B, 2, ...] per-local-chunk tensors (dim 1: the local slot) as one [B, ...] per global chunk,
    in global order. With autograd: each rank's gradient for a chunk is summed into its owner's."""
    parts = all_gather(x, shard.group)
    by_chunk: list[torch.Tensor] = [None] * (2 * shard.degree)  # type: ignore[list-item]
    for r, part in enumerate(parts):
        for slot, j in enumerate(chunks_of(r, shard.degree, shard.layout)):
            by_chunk[j] = part[:, slot]
    return by_chunk


def gather_sequence(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """The whole [B, T, ...] sequence in global order on every rank, from each rank's [B, 2C, ...] part; with
    autograd (the gradient of each rank's part is the sum of every rank's gradient for it)."""
    B, L = x.shape[:2]
    if L != shard.local_len:
        raise ValueError(f"a local part of {L} tokens given to a shard of {shard.local_len}")
    chunks = _gather_by_chunk(x.reshape(B, 2, shard.chunk_len, *x.shape[2:]), shard)
    return torch.cat(chunks, dim=1)


def local_cu_seqlens(shard: ContextShard, batch: int) -> torch.Tensor:
    """The local boundaries of ``batch`` rows flattened into one (the recurrent ops take packed segments as a
    batch of one): each row's segments after the previous row's."""
    if batch == 1:
        return shard.cu_seqlens
    offsets = torch.arange(batch, device=shard.cu_seqlens.device).unsqueeze(1) * shard.local_len
    starts = (shard.cu_seqlens[:-1].unsqueeze(0) + offsets).flatten()
    return torch.cat([starts, starts.new_full((1,), batch * shard.local_len)])


def _segment_rows(shard: ContextShard, which: torch.Tensor, batch: int) -> torch.Tensor:
    """[batch * 2] flat segment index of each (row, local chunk)'s first or last segment."""
    n = len(shard.segments)
    return (torch.arange(batch, device=which.device).unsqueeze(1) * n + which.unsqueeze(0)).flatten()


def _at_first_segments(shard: ContextShard, states: torch.Tensor) -> torch.Tensor:
    """[B * segments, ...] initial states: ``states`` [B, 2, ...] at each local chunk's first segment, zero at the
    others (they start documents). Differentiable in ``states``."""
    B = states.shape[0]
    flat = states.flatten(0, 1)
    index = _segment_rows(shard, shard.first_segments.to(states.device), B)
    return flat.new_zeros(B * len(shard.segments), *flat.shape[1:]).index_copy(0, index, flat)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] -> [1, B * L, ...]: rows as packed segments."""
    return x.reshape(1, -1, *x.shape[2:])


# ---------------------------------------------------------------------------------------------- the recurrences


def _fold(shard: ContextShard, transfers: list[torch.Tensor], offsets: list[torch.Tensor],
          scalar: bool) -> torch.Tensor:
    """The state entering each local chunk, [B, 2, ...], from every global chunk's summary S_out = M S_in + B
    (``transfers`` M: [B, H, K, K], or [B, H] where ``scalar``; ``offsets`` B: [B, H, K, V]).

    In global order from zero: a chunk with a document start inside hands on its last document's own state (its
    M is dropped), a chunk that starts a document takes none. Multiplying by 0 or 1 (not branching) keeps every
    rank's graph, and so its backward collectives, the same."""
    state = torch.zeros_like(offsets[0])
    entering = {0: state}
    for j in range(max(shard.chunks)):
        # a document starting inside chunk j cuts what came before it off: B is then its last segment's state
        # from zero, and M (that segment's transition, or for simple GLA the whole chunk's) must not apply
        through = 0.0 if shard.chunk_restarts[j] else 1.0
        carried = transfers[j][..., None, None] * state if scalar else transfers[j] @ state
        state = (through * carried + offsets[j]) * (0.0 if shard.starts_document(j + 1) else 1.0)
        entering[j + 1] = state
    return torch.stack([entering[j] for j in shard.chunks], dim=1)


def _last_segment_states(shard: ContextShard, final: torch.Tensor, batch: int) -> torch.Tensor:
    """[B, 2, ...]: the final state of each (row, local chunk)'s last segment, from [B * segments, ...]."""
    index = _segment_rows(shard, shard.last_segments.to(final.device), batch)
    return final.index_select(0, index).view(batch, 2, *final.shape[1:])


def _cp_delta_rule(op, shard: ContextShard, q, k, v, a, b, *, A_log, dt_bias):
    """The delta rules (GDN, KDA) under CP. Summary pass: the op over [v | 0] of value width V + K from the states
    [0 | I] gives, per segment, [B | M] (the columns of the state evolve apart, so the K extra columns carry the
    identity through the per-token transitions: M, K x K per value head), in one call."""
    Bsz, L, HV, V = v.shape
    K = k.shape[-1]
    cu = local_cu_seqlens(shard, Bsz)
    n = Bsz * len(shard.segments)
    v_aug = torch.cat([v, v.new_zeros(Bsz, L, HV, K)], dim=-1)
    eye = torch.eye(K, device=v.device, dtype=torch.float32).expand(n, HV, K, K)
    h0 = torch.cat([eye.new_zeros(n, HV, K, V), eye], dim=-1)
    _, final = op(_flat(q), _flat(k), _flat(v_aug), _flat(a), _flat(b), A_log, dt_bias, cu_seqlens=cu,
                  initial_state=h0, output_final_state=True)
    summaries = _gather_by_chunk(_last_segment_states(shard, final.float(), Bsz), shard)  # [B, HV, K, V + K] each
    entering = _fold(shard, [s[..., V:] for s in summaries], [s[..., :V] for s in summaries], scalar=False)
    o, _ = op(_flat(q), _flat(k), _flat(v), _flat(a), _flat(b), A_log, dt_bias, cu_seqlens=cu,
              initial_state=_at_first_segments(shard, entering), output_final_state=False)
    return o.view(Bsz, L, *o.shape[2:]), None


def cp_gated_delta_rule(kernels, shard: ContextShard, q, k, v, a, b, *, A_log, dt_bias):
    """``kernels.gated_delta_rule`` of the rank's part of the sequence (q, k: [B, 2C, H, K]; v: [B, 2C, HV, V];
    a, b: [B, 2C, HV]), as the whole sequence would give it. Returns (o [B, 2C, HV, V], None)."""
    return _cp_delta_rule(kernels.gated_delta_rule, shard, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias)


def cp_kda(kernels, shard: ContextShard, q, k, v, a, b, *, A_log, dt_bias):
    """``kernels.kda`` under CP, as ``cp_gated_delta_rule`` (a: [B, 2C, HV, K]). Returns (o, None)."""
    return _cp_delta_rule(kernels.kda, shard, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias)


def cp_simple_gla(kernels, shard: ContextShard, q, k, v, g, scale=None):
    """``kernels.simple_gla`` under CP (q, k: [B, 2C, H, K]; v: [B, 2C, H, V]; g: [B, 2C, H] log decay). The
    transition of a chunk is a scalar per head, exp(sum of g). Returns (o [B, 2C, H, V], None)."""
    Bsz, L, H = g.shape
    cu = local_cu_seqlens(shard, Bsz)
    _, final = kernels.simple_gla(_flat(q), _flat(k), _flat(v), _flat(g), scale=scale, cu_seqlens=cu,
                                  output_final_state=True)
    offsets = _gather_by_chunk(_last_segment_states(shard, final.float(), Bsz), shard)
    transfers = _gather_by_chunk(g.float().view(Bsz, 2, shard.chunk_len, H).sum(2).exp(), shard)
    entering = _fold(shard, transfers, offsets, scalar=True)
    o, _ = kernels.simple_gla(_flat(q), _flat(k), _flat(v), _flat(g), scale=scale, cu_seqlens=cu,
                              initial_state=_at_first_segments(shard, entering))
    return o.view(Bsz, L, *o.shape[2:]), None


# ------------------------------------------------------------------------------------------ the short convolution


def _halo_mask(shard: ContextShard, chunk: int, halo: int, device) -> torch.Tensor:
    """[halo] 1 where the position before global chunk ``chunk`` is of the document its first token is in."""
    begin = chunk * shard.chunk_len
    positions = torch.arange(begin - halo, begin, device=device)
    return (positions >= shard.chunk_document_start[chunk]).float()


def cp_causal_conv1d(kernels, shard: ContextShard, x, weight, bias=None, activation="silu"):
    """``kernels.causal_conv1d`` under CP (x: [B, 2C, D]; weight: [D, width]): each local chunk reads the last
    width - 1 inputs of the previous global chunk (those of its own document) as its initial state, the [N, D,
    width] window of the last inputs, oldest first. Needs C >= width - 1. Returns (y [B, 2C, D], None)."""
    Bsz, L, D = x.shape
    width = weight.shape[-1]
    halo, C = width - 1, shard.chunk_len
    if halo > C:
        raise ValueError(f"a convolution of width {width} needs chunks of at least {halo} tokens, got {C}")
    state = None
    if halo:
        tails = _gather_by_chunk(x.reshape(Bsz, 2, C, D)[:, :, C - halo:], shard)  # [B, halo, D] per chunk
        heads = []
        for j in shard.chunks:
            previous = tails[j - 1] if j > 0 else torch.zeros_like(tails[0])
            heads.append(previous * _halo_mask(shard, j, halo, x.device).to(x.dtype).unsqueeze(-1))
        windows = torch.cat([x.new_zeros(Bsz, 2, 1, D), torch.stack(heads, dim=1)], dim=2)  # [B, 2, width, D]
        state = _at_first_segments(shard, windows.transpose(-1, -2))
    y, _ = kernels.causal_conv1d(_flat(x), weight, bias, activation, cu_seqlens=local_cu_seqlens(shard, Bsz),
                                 initial_state=state)
    return y.view(Bsz, L, D), None


def cp_short_conv(kernels, shard: ContextShard, x, weight, bias=None, activation="silu", sizes=None):
    """``kernels.short_conv`` under CP: ``cp_causal_conv1d`` with its output as one view per block of ``sizes``
    channels. Returns (outputs, None)."""
    y, _ = cp_causal_conv1d(kernels, shard, x, weight, bias, activation)
    return list(y.split(tuple(sizes) if sizes else (x.shape[-1],), dim=-1)), None


# ---------------------------------------------------------------------------------------------------- attention


def _attention_spans(shard: ContextShard) -> list[tuple[int, int, int, int]]:
    """(local query start, end, global key start, end) per run of local segments that are one stretch of one
    document: its queries see the document's keys from its start up to the run's end, causally."""
    spans: list[list[int]] = []
    for s in shard.segments:
        if spans and s.continues and spans[-1][3] == s.global_start and spans[-1][1] == s.local_start:
            spans[-1][1], spans[-1][3] = s.local_end, s.global_end
        else:
            spans.append([s.local_start, s.local_end, s.document_start, s.global_end])
    return [tuple(span) for span in spans]


def cp_attention(kernels, shard: ContextShard, q, k, v, scale):
    """Causal attention of the rank's queries q [B, 2C, H, Dk] over the whole sequence's keys and values k, v
    [B, T, Hk, D] (``gather_sequence``), no query seeing another document. Each run of queries is the last
    positions of its key range (document start .. run end), the form ``kernels.attention`` takes for decoding
    (S > T: bottom-right causal), so no mask is built here. Returns o [B, 2C, H, Dv]."""
    if k.shape[1] != shard.seq_len or q.shape[1] != shard.local_len:
        raise ValueError(f"cp_attention takes the local queries ({shard.local_len} tokens) and the gathered keys "
                         f"({shard.seq_len}), got {q.shape[1]} and {k.shape[1]}")
    outs = [kernels.attention(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], scale)
            for qs, qe, ks, ke in _attention_spans(shard)]
    return torch.cat(outs, dim=1)

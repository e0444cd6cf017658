"""Chunk layout shared by the PyTorch reference kernels.

The chunked algorithms (the same ones FLA's Triton kernels implement) split every sequence into chunks of C
tokens: inside a chunk the work is a few dense matrix products, across chunks a state is carried. Packed
documents (``cu_seqlens``) are handled by giving every document its own chunks, padded at its end, so that no
chunk holds tokens of two documents and no state crosses a document.

The chunks are laid out *step-major*: step j holds the j-th chunk of every document that still has one, and
documents are sorted by their number of chunks (longest first), so the documents active at step j are always a
prefix of the sorted list. The inter-chunk recurrence is then one Python loop over steps (at most T / C of them,
never over tokens), each step a batched matrix product over the active prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkLayout:
    chunk_size: int
    num_tokens: int  # tokens of the flattened input
    num_segments: int  # documents (or batch rows)
    order: torch.Tensor  # [N] segment index of each sorted slot (longest first)
    active_per_step: list[int]  # number of active (sorted) segments at each step
    token_index: torch.Tensor  # [num_chunks * C] flat token index of each padded slot (clamped for padding)
    valid: torch.Tensor  # [num_chunks * C] bool, False on padding
    inverse: torch.Tensor  # [num_tokens] position of each token in the padded layout

    @property
    def num_chunks(self) -> int:
        return sum(self.active_per_step)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, *rest] -> [num_chunks, C, *rest], zeros on padding."""
        y = x.index_select(0, self.token_index)
        mask = self.valid.view(-1, *([1] * (x.dim() - 1)))
        y = torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))
        return y.view(self.num_chunks, self.chunk_size, *x.shape[1:])

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """[num_chunks, C, *rest] -> [num_tokens, *rest] (padding dropped)."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.inverse)

    def step_slices(self):
        """Yields (step, start chunk, number of active segments)."""
        start = 0
        for step, n in enumerate(self.active_per_step):
            yield step, start, n
            start += n


def segment_bounds(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Boundaries of the independent segments over the flattened [batch * seq_len] tokens."""
    if cu_seqlens is None:
        return torch.arange(batch + 1, dtype=torch.long) * seq_len
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 (flattened documents), got a batch of {batch}")
    bounds = cu_seqlens.detach().to("cpu", torch.long)
    if bounds[0] != 0 or bounds[-1] != seq_len or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {seq_len}, got {bounds.tolist()}")
    return bounds


def make_layout(bounds: torch.Tensor, chunk_size: int, device: torch.device) -> ChunkLayout:
    starts, ends = bounds[:-1], bounds[1:]
    lengths = ends - starts
    n_chunks = (lengths + chunk_size - 1) // chunk_size
    # longest first; stable so equal-length segments keep their order
    order = torch.argsort(-n_chunks, stable=True)
    sorted_chunks = n_chunks[order]
    max_steps = int(sorted_chunks[0]) if len(sorted_chunks) else 0
    active = [int((sorted_chunks > j).sum()) for j in range(max_steps)]

    slot_seg, slot_step = [], []
    for j, n in enumerate(active):
        slot_seg.append(order[:n])
        slot_step.append(torch.full((n,), j, dtype=torch.long))
    seg = torch.cat(slot_seg) if slot_seg else torch.zeros(0, dtype=torch.long)
    step = torch.cat(slot_step) if slot_step else torch.zeros(0, dtype=torch.long)
    offs = torch.arange(chunk_size, dtype=torch.long)
    pos = starts[seg][:, None] + step[:, None] * chunk_size + offs[None, :]  # [num_chunks, C]
    valid = pos < ends[seg][:, None]
    num_tokens = int(bounds[-1])
    flat_pos = pos.reshape(-1)
    flat_valid = valid.reshape(-1)
    inverse = torch.empty(num_tokens, dtype=torch.long)
    inverse[flat_pos[flat_valid]] = torch.nonzero(flat_valid).squeeze(1)
    token_index = torch.where(flat_valid, flat_pos, torch.zeros_like(flat_pos)).clamp(max=max(num_tokens - 1, 0))
    return ChunkLayout(
        chunk_size=chunk_size,
        num_tokens=num_tokens,
        num_segments=len(lengths),
        order=order.to(device),
        active_per_step=active,
        token_index=token_index.to(device),
        valid=flat_valid.to(device),
        inverse=inverse.to(device),
    )


def positions_in_segment(bounds: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[num_tokens] index of each token inside its own segment (0 at every document start)."""
    lengths = bounds[1:] - bounds[:-1]
    starts = torch.repeat_interleave(bounds[:-1], lengths)
    return (torch.arange(int(bounds[-1])) - starts).to(device)


def segment_ids(bounds: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[num_tokens] segment index of each token."""
    lengths = bounds[1:] - bounds[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)

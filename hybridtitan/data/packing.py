"""Packing: documents -> fixed windows of seq_len + 1 tokens, and the document boundaries inside them.

Rules (one place for them):
- EOS follows every document. Packing appends it; tokenization (on the fly, or scripts/prepare_data.py)
  never does. A document that already ends with EOS (Megatron data preprocessed with --append-eod) gets none.
- Documents are laid end to end and cut into windows of seq_len + 1 tokens; inputs = window[:-1],
  labels = window[1:]. A document longer than the rest of a window continues in the next one.
- Consecutive windows share one token: the last token of a window (a label only) is the first input of the
  next, as in Megatron's GPTDataset, so every token but the very first is a label exactly once.
- Document boundaries (for cu_seqlens): a window's first position starts a document, and so does every
  position right after an EOS.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)


def with_eos(tokens, eos: int) -> np.ndarray:
    """The document's tokens followed by EOS (not doubled where it already ends with one)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) and tokens[-1] == eos:
        return tokens
    return np.append(tokens, np.int64(eos))


class Packer:
    """Cuts the documents of `documents` (any object with next_document(), state_dict(), load_state_dict()
    and shard/num_shards) into windows. Its state is the document cursor before the document being cut, how
    many of its tokens are already placed, and the one token carried into the next window: a few integers,
    never the data."""

    def __init__(self, documents, seq_len: int, eos: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive (got {seq_len})")
        self.documents, self.seq_len, self.eos = documents, seq_len, eos
        self._doc, self._offset, self._doc_state = _EMPTY, 0, None
        self._carry = -1  # the token shared with the previous window; -1 before the first window

    def next_window(self) -> np.ndarray:
        """The next seq_len + 1 tokens (int64)."""
        window = np.empty(self.seq_len + 1, dtype=np.int64)
        n = 0
        if self._carry >= 0:
            window[0], n = self._carry, 1
        while n < len(window):
            if self._offset == len(self._doc):
                self._doc_state = self.documents.state_dict()
                self._doc, self._offset = with_eos(self.documents.next_document(), self.eos), 0
            take = min(len(window) - n, len(self._doc) - self._offset)
            window[n:n + take] = self._doc[self._offset:self._offset + take]
            n, self._offset = n + take, self._offset + take
        self._carry = int(window[-1])
        return window

    def state_dict(self) -> dict:
        if self._offset == len(self._doc):  # nothing left of the current document: point at the next one
            return {"documents": self.documents.state_dict(), "offset": 0, "carry": self._carry}
        return {"documents": self._doc_state, "offset": self._offset, "carry": self._carry}

    def load_state_dict(self, state: dict) -> None:
        saved = state["documents"]
        self.documents.load_state_dict(saved)
        self._doc, self._offset, self._carry = _EMPTY, 0, state["carry"]
        if (saved["shard"], saved["num_shards"]) != (self.documents.shard, self.documents.num_shards):
            # Another shard's (or world size's) cursor: the half-cut document is not ours; start a clean window.
            self._carry = -1
        elif state["offset"] > 0 and not getattr(self.documents, "resumes_exactly", True):
            # a shuffled stream reads other documents after a resume (datasets refills its shuffle buffer): the
            # saved offset belongs to a document it will not give again, so the next window starts a new one
            logger.warning("data: a shuffled stream does not resume exactly: the document half-cut at the "
                           "checkpoint is not continued (data.shuffle false resumes exactly)")
        elif state["offset"] > 0:
            self._doc_state = saved
            self._doc = with_eos(self.documents.next_document(), self.eos)
            self._offset = state["offset"]
            if self._offset > len(self._doc):
                raise ValueError("data: the checkpoint's data loader state does not match the data (a document is "
                                 "shorter than the saved offset into it)")


def document_starts(inputs, eos: int) -> np.ndarray:
    """Offsets in `inputs` (one sample) where a document starts: 0, and every position right after an EOS."""
    inputs = np.asarray(inputs)
    return np.concatenate([[0], np.flatnonzero(inputs[:-1] == eos) + 1]).astype(np.int64)


def cu_seqlens(input_ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Cumulative document boundaries over the flattened B * T tokens of a batch [B, T] (int32): starts with 0,
    ends with B * T, and every row start is a boundary (rows are separate windows)."""
    B, T = input_ids.shape
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos
    bounds = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([bounds, torch.tensor([B * T])]).to(torch.int32)

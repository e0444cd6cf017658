"""Megatron-LM's indexed dataset (.bin/.idx), read and written with numpy only.

The format (megatron/core/datasets/indexed_dataset.py), all little-endian:
    .idx: b"MMIDIDX\\x00\\x00"  version (uint64 = 1)  dtype code (uint8)  sequence count (uint64)
          document count (uint64)  sequence lengths (int32[sequences])  sequence byte offsets into .bin
          (int64[sequences])  document indices (int64[documents]): the sequence index where each document
          starts, beginning with 0 and ending with the sequence count (so documents + 1 entries)
    .bin: every sequence's tokens, back to back, in the dtype of the code
A document is the span of sequences between two document indices; data tokenized without sentence splitting
(ours, and Megatron's preprocess_data.py by default) has one sequence per document.

EOS rule: files we write hold the documents' tokens only, no EOS; packing appends one after every document
(and none where a document already ends with it, so files preprocessed by Megatron with --append-eod read the
same).
"""

from __future__ import annotations

import os
import struct

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}


def token_dtype(vocab_size: int):
    """The smallest dtype Megatron would pick for a vocabulary (its `optimal_dtype`)."""
    return np.uint16 if vocab_size < 65500 else np.int32


class MegatronDataset:
    """One .bin/.idx pair, memory-mapped: len() documents, doc(i) the tokens of document i (a numpy view)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        with open(idx_path, "rb") as f:
            if f.read(9) != HEADER:
                raise ValueError(f"data.path: {idx_path} is not a Megatron index (bad header)")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != VERSION:
                raise ValueError(f"data.path: {idx_path} has index version {version}, only {VERSION} is supported")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in DTYPES:
                raise ValueError(f"data.path: {idx_path} has unknown dtype code {code}")
            self.dtype = np.dtype(DTYPES[code])
            sequence_count, document_count = struct.unpack("<QQ", f.read(16))
            offset = f.tell()
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(index, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, document_count, offset)
        if document_count == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != sequence_count:
            raise ValueError(f"data.path: {idx_path} has inconsistent document indices")
        # An empty .bin cannot be memory-mapped; it holds no tokens anyway.
        self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype) if os.path.getsize(bin_path) else \
            np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.document_indices) - 1

    def doc(self, i: int) -> np.ndarray:
        first, end = int(self.document_indices[i]), int(self.document_indices[i + 1])
        if first == end:
            return self._bin[:0]
        # A document's sequences are contiguous in .bin: one slice from the first one's offset.
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        length = int(self.sequence_lengths[first:end].sum())
        return self._bin[start:start + length]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class MegatronWriter:
    """Writes one .bin/.idx pair, one sequence per document (no EOS added: packing adds it).

        with MegatronWriter("data/fineweb_00000", vocab_size=len(tok)) as w:
            w.add_document(ids)
    """

    def __init__(self, prefix: str, vocab_size: int | None = None, dtype=None):
        self.prefix = prefix
        if dtype is None:
            dtype = token_dtype(vocab_size) if vocab_size is not None else np.int32
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES or self.dtype.kind not in "iu":
            raise ValueError(f"MegatronWriter: token dtype {self.dtype} is not an integer type Megatron can store")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin", "wb")
        self.lengths: list[int] = []
        self.num_tokens = 0

    def add_document(self, tokens) -> None:
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"MegatronWriter: token ids outside {self.dtype}'s range")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.lengths.append(int(array.size))
        self.num_tokens += int(array.size)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        # Write to a temporary name and rename, so a crash never leaves a readable but truncated index.
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<QQ", len(lengths), len(document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(document_indices.tobytes(order="C"))
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def __enter__(self) -> MegatronWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()

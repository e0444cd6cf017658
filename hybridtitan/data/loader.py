"""The training data loader: packed windows from a document source, batched by a StatefulDataLoader whose state_dict()
and load_state_dict() resume the stream exactly.

    loader = build_dataloader(job.data, tokenizer, seq_len=4096, local_batch_size=8, dp_rank=r,
                              dp_world_size=w, seed=job.training.seed, vocab_size=model_args.vocab_size)
    batch = next(iter(loader))  # {"input_ids": [B, T] int64, "labels": [B, T] int64(, "cu_seqlens": int32)}

The iterator never ends. Epochs wrap, reshuffled with an epoch-dependent seed.

The checkpoint state is what `PackedDataset.state_dict()` returns; StatefulDataLoader nests it in its own dict:

    {"version": 1, "seq_len": T,
     "packer": {"documents": <cursor before the document being cut>, "offset": tokens of it already placed,
                "carry": the token the next window starts with, or -1}}
    cursor, random-access sources: {"epoch", "pos", "shard", "num_shards", "seed", "shuffle", "fingerprint"}
                                   (with data.document_slice, positions in the slice; the fingerprint names it)
    cursor, streaming hf:          {"epoch", "hf_state" (datasets' own, as a JSON string), "shard", "num_shards"}

It is a few integers. A resume re-reads (and re-tokenizes) at most the one document that was being cut. The structure
never changes along a run, because DCP loads a checkpoint into the structure of the live state_dict.

A resume on a different data-parallel size cannot be exact. Load any one rank's state, such as rank 0's, on every rank.
Each new shard then continues the same epoch, in the same order, from the point the old shards had reached together (see
ShardedDocuments.load_state_dict). A streaming dataset restarts the epoch instead. A warning says so. `data.num_workers`
must not change, because StatefulDataLoader keeps one state per worker."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from hybridtitan.errors import DataError

from .config import Data, validate_data_config
from .packing import Packer, cu_seqlens
from .sources import build_documents
from .tokenizer import eos_id, vocab_mismatch

STATE_VERSION = 1
IGNORE_INDEX = -100  # a label that counts for nothing (the loss's ignore_index)


class PackedDataset(IterableDataset):
    """Windows of seq_len + 1 tokens from this rank's documents, as {"input_ids", "labels"} samples. It is Stateful: the
    StatefulDataLoader saves and restores it, in each worker when there are workers."""

    def __init__(self, cfg: Data, tokenizer, *, seq_len: int, dp_rank: int, dp_world_size: int, seed: int,
                 eos: int, vocab_size: int | None):
        self.cfg, self.tokenizer, self.seq_len, self.eos = cfg, tokenizer, seq_len, eos
        self.dp_rank, self.dp_world_size, self.seed, self.vocab_size = dp_rank, dp_world_size, seed, vocab_size
        self._packer: Packer | None = None
        if cfg.num_workers == 0:
            self._build()  # now, so that a bad path or split fails at build time, not at the first batch

    def _build(self) -> Packer:
        # Workers split this rank's documents further: worker k of n is shard rank * n + k of world * n.
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        documents = build_documents(self.cfg, self.tokenizer, shard=self.dp_rank * workers + worker,
                                    num_shards=self.dp_world_size * workers, seed=self.seed, eos=self.eos,
                                    vocab_size=self.vocab_size, max_doc_len=2 * self.seq_len)
        self._packer = Packer(documents, self.seq_len, self.eos)
        return self._packer

    @property
    def packer(self) -> Packer:
        return self._packer if self._packer is not None else self._build()

    def __getstate__(self):
        # Workers rebuild their own source (memory maps and datasets do not travel well, and their shard differs).
        return {**self.__dict__, "_packer": None}

    def __iter__(self):
        packer = self.packer
        while True:
            window = torch.from_numpy(packer.next_window())
            yield {"input_ids": window[:-1], "labels": window[1:]}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "seq_len": self.seq_len, "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data: unknown data loader state version {state.get('version')!r}")
        # A different seq_len is fine: the cursor counts tokens, not windows.
        self.packer.load_state_dict(state["packer"])


class Collate:
    """Stacks samples into a batch. With document boundaries it adds cu_seqlens over the flattened batch."""

    def __init__(self, eos: int, document_boundaries: bool, vocab_size: int | None = None,
                 eod_mask_loss: bool = False):
        self.eos, self.document_boundaries, self.vocab_size = eos, document_boundaries, vocab_size
        self.eod_mask_loss = eod_mask_loss

    def __call__(self, samples: list[dict]) -> dict:
        batch = {"input_ids": torch.stack([s["input_ids"] for s in samples]),
                 "labels": torch.stack([s["labels"] for s in samples])}
        if self.vocab_size is not None:
            # token files made with another tokenizer: an id past the embedding table is an index error on a CPU
            # and a device-side assert on a GPU, far from its cause
            top = int(torch.maximum(batch["input_ids"].max(), batch["labels"].max()))
            if top >= self.vocab_size:
                raise DataError(f"data: token id {top} is outside the model's vocabulary ({self.vocab_size} ids): "
                                "data tokenized for another vocabulary?")
        if self.eod_mask_loss:  # no loss where the input is EOD: the label there is the next document's first token
            batch["labels"] = batch["labels"].masked_fill(batch["input_ids"] == self.eos, IGNORE_INDEX)
        if self.document_boundaries:
            batch["cu_seqlens"] = cu_seqlens(batch["input_ids"], self.eos)
        return batch


def build_dataloader(cfg: Data, tokenizer, *, seq_len: int, local_batch_size: int, dp_rank: int,
                     dp_world_size: int, seed: int, vocab_size: int | None = None,
                     eod_mask_loss: bool = False) -> StatefulDataLoader:
    """The infinite, exactly resumable loader of this data-parallel rank's batches (see the module docstring).
    `tokenizer` may be None for the mock source; EOS is then token 0."""
    validate_data_config(cfg)
    if seq_len < 1 or local_batch_size < 1:
        raise ValueError(f"seq_len and local_batch_size must be positive (got {seq_len}, {local_batch_size})")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_world_size - 1}")
    if tokenizer is None:
        if cfg.source != "mock":
            raise ValueError(f"data.tokenizer: the {cfg.source} source needs a tokenizer")
        eos = 0
    else:
        eos = eos_id(tokenizer)
        problem = vocab_size is not None and vocab_mismatch(tokenizer, vocab_size)
        if problem:
            raise ValueError(problem)
        vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
    if vocab_size is not None and eos >= vocab_size:
        raise ValueError(f"data.tokenizer: the EOS id ({eos}) is outside the model's vocab_size ({vocab_size})")
    dataset = PackedDataset(cfg, tokenizer, seq_len=seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size,
                            seed=seed, eos=eos, vocab_size=vocab_size)
    collate = Collate(eos, cfg.document_boundaries, vocab_size, eod_mask_loss)
    return StatefulDataLoader(dataset, batch_size=local_batch_size, collate_fn=collate,
                              num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available(),
                              worker_init_fn=_own_process_group if cfg.num_workers else None)


class HeldOut:
    """One rank's shard of a held-out set (validation) as batches. It is packed as the training data is, never shuffled,
    and read from its start on every pass, so each validation sees the same batches."""

    def __init__(self, cfg: Data, tokenizer, *, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, vocab_size: int, eod_mask_loss: bool = False):
        validate_data_config(cfg)
        self.cfg = dataclasses.replace(cfg, shuffle=False)
        self.tokenizer, self.seq_len, self.local_batch_size = tokenizer, seq_len, local_batch_size
        self.dp_rank, self.dp_world_size, self.vocab_size = dp_rank, dp_world_size, vocab_size
        self.eos = eos_id(tokenizer) if tokenizer is not None else 0
        self.collate = Collate(self.eos, cfg.document_boundaries, vocab_size, eod_mask_loss)
        self._documents()  # a bad path or split fails now, not at the first validation

    def _documents(self):
        return build_documents(self.cfg, self.tokenizer, shard=self.dp_rank, num_shards=self.dp_world_size, seed=0,
                               eos=self.eos, vocab_size=self.vocab_size, max_doc_len=2 * self.seq_len)

    def batches(self):
        """(batch, whether this rank's shard ended with it), forever. The shard starts over after its end."""
        documents = self._documents()
        packer = Packer(documents, self.seq_len, self.eos)
        while True:
            windows = [torch.from_numpy(packer.next_window()) for _ in range(self.local_batch_size)]
            batch = self.collate([{"input_ids": w[:-1], "labels": w[1:]} for w in windows])
            yield batch, documents.epoch > 0


def _own_process_group(worker_id: int) -> None:
    """Moves a loader worker out of the trainer's process group.

    A SIGTERM sent to the group (a terminal's job control, `kill -- -PGID`, torchrun stopping a rank) then reaches only
    the trainer. The trainer saves and stops (train.StopRequest), instead of the workers being killed first and the run
    with them. The loader stops its workers itself.

    A signal to the trainer's group, SIGKILL included, does not reach the worker either. So on Linux the worker is also
    killed as soon as its trainer dies, not a few seconds later by the loader's watchdog."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the watchdog remains

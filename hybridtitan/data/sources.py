"""Document sources: each rank's documents as token-id arrays, in a seeded order, epoch after epoch. A small cursor
holds the position, so it can be checkpointed.

Random-access sources (a Hugging Face map-style dataset, Megatron .bin/.idx files, mock tokens) share one ordering rule,
in `ShardedDocuments`. Epoch e visits the documents in the order of a permutation seeded by (seed, e), or the identity
without shuffle. Shard s of n takes positions s, s + n, s + 2n, ... of it. The permutation depends on neither the shard
nor the number of shards. That lets a checkpoint move to a different data-parallel size (see
`ShardedDocuments.load_state_dict`).

data.document_slice narrows the source first (`SlicedSource`): it keeps a fraction of one permutation seeded by
document_slice_seed. The shards then split the slice.

A streaming Hugging Face dataset has no random access. `StreamingDocuments` follows the stream and checkpoints it with
datasets' own state_dict."""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np

from hybridtitan.errors import DataError, first_error_line

from .config import Data, files_builder, local_data_files, looks_local, megatron_prefixes, resolve_path
from .megatron import MegatronDataset
from .tokenizer import encode_batch

logger = logging.getLogger(__name__)

# Documents fetched (and tokenized) per call to a source: enough for the Rust tokenizer to use its threads.
BLOCK = 64


# --------------------------------------------------------------------------------------------------------------
# Random-access sources: len(), documents(indices) -> list of int arrays, fingerprint (what a checkpoint checks)


def _text(value, field: str, where: str) -> str:
    """A document's text, or "" for a missing one. Anything else is bad data and raises DataError in one line. Otherwise
    the tokenizer would fail on it with a traceback, or encode a list as a pre-split text without a word."""
    if value is None or isinstance(value, str):
        return value or ""
    raise DataError(f"data: {where}: {field!r} holds {type(value).__name__} {repr(value)[:60]}, not text")


class HFSource:
    """A map-style Hugging Face dataset, tokenized on the fly. No special tokens are added; packing adds the EOS."""

    random_order = False

    def __init__(self, dataset, tokenizer, text_field: str):
        self.texts = dataset.select_columns([text_field])
        self.tokenizer, self.text_field = tokenizer, text_field
        self.fingerprint = f"hf:{len(self.texts)}"

    def __len__(self) -> int:
        return len(self.texts)

    def documents(self, indices) -> list[np.ndarray]:
        indices = [int(i) for i in indices]
        texts = [_text(t, self.text_field, f"document {i}")
                 for i, t in zip(indices, self.texts[indices][self.text_field])]
        return [np.asarray(ids, dtype=np.int64) for ids in encode_batch(self.tokenizer, texts)]


class MegatronSource:
    """One or more Megatron .bin/.idx files, read as one list of documents. The files are read uniformly, without
    blending weights."""

    random_order = False

    def __init__(self, prefixes: list[str]):
        self.files = [MegatronDataset(p) for p in prefixes]
        self.starts = np.cumsum([0] + [len(f) for f in self.files])
        self.fingerprint = f"megatron:{int(self.starts[-1])}"

    def __len__(self) -> int:
        return int(self.starts[-1])

    def documents(self, indices) -> list[np.ndarray]:
        out = []
        for i in indices:
            f = int(np.searchsorted(self.starts, i, side="right")) - 1
            out.append(np.asarray(self.files[f].doc(int(i) - int(self.starts[f])), dtype=np.int64))
        return out


class MockSource:
    """Random tokens in documents of random length, for smoke tests and benchmarks without data.

    Document i is drawn from its own generator seeded by (seed, i), so any document can be regenerated, in any order.
    Token ids never equal `eos`, so document boundaries are exactly where packing puts them."""

    random_order = True  # already random: no permutation (it could not be held for 2**40 documents anyway)

    def __init__(self, vocab_size: int, eos: int, seed: int, max_len: int, num_docs: int = 1 << 40):
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocab_size of at least 2 (got {vocab_size})")
        self.vocab_size, self.eos, self.seed, self.max_len, self.num_docs = vocab_size, eos, seed, max_len, num_docs
        self.fingerprint = f"mock:{vocab_size}:{seed}:{max_len}"

    def __len__(self) -> int:
        return self.num_docs

    def documents(self, indices) -> list[np.ndarray]:
        out = []
        for i in indices:
            rng = np.random.default_rng([self.seed, int(i)])
            tokens = rng.integers(0, self.vocab_size - 1, size=int(rng.integers(1, self.max_len + 1)), dtype=np.int64)
            out.append(tokens + (tokens >= self.eos))  # skip the EOS id
        return out


def slice_bounds(num_documents: int, document_slice) -> tuple[int, int]:
    """The positions [lo, hi) of the permutation that data.document_slice [start, end) keeps of ``num_documents``.

    They are round(start * n) and round(end * n). Slices that meet, such as [0, 0.2] and [0.2, 1], then share their
    bound, and no document is lost or repeated."""
    start, end = document_slice
    return round(start * num_documents), round(end * num_documents)


def slice_indices(num_documents: int, document_slice, seed: int) -> np.ndarray:
    """The indices of the documents that data.document_slice keeps of a random-access source of ``num_documents``. They
    are positions [lo, hi) (slice_bounds) of the permutation seeded by ``seed``, sorted into the files' order."""
    lo, hi = slice_bounds(num_documents, document_slice)
    dtype = np.int32 if num_documents < 2**31 else np.int64
    return np.sort(np.random.default_rng(seed).permutation(num_documents)[lo:hi]).astype(dtype)


class SlicedSource:
    """The documents of a random-access source that data.document_slice keeps.

    It keeps positions [lo, hi) of one permutation of all the documents. The permutation is seeded by
    data.document_slice_seed alone, not by the training seed or the shard. So every stage that reads the data takes its
    fraction of the same order, and every rank sees the same slice. The kept documents stay in the source's order; the
    loader shuffles them as it would the whole source.

    A source already in random order (mock) keeps the positions themselves, because its documents are independent draws.
    """

    def __init__(self, source, document_slice, seed: int):
        self.source = source
        self.random_order = source.random_order
        n = len(source)
        lo, hi = slice_bounds(n, document_slice)
        if hi <= lo:
            raise DataError(f"data.document_slice {list(document_slice)} holds no document of the "
                            f"{n} documents of data.path")
        if source.random_order:
            self.offset, self.indices = lo, None
            self.length = hi - lo
        else:
            self.indices = slice_indices(n, document_slice, seed)
            self.offset, self.length = 0, hi - lo
        start, end = (float(b) for b in document_slice)
        self.fingerprint = f"{source.fingerprint}:slice:{start}:{end}:{seed}"

    def __len__(self) -> int:
        return self.length

    def source_index(self, i: int) -> int:
        """The source's index of this slice's document i."""
        return self.offset + int(i) if self.indices is None else int(self.indices[int(i)])

    def documents(self, indices) -> list[np.ndarray]:
        return self.source.documents([self.source_index(i) for i in indices])


# --------------------------------------------------------------------------------------------------------------
# Cursors over a source, for one data-parallel shard


class ShardedDocuments:
    """Shard `shard` of `num_shards` of a random-access source, in a seeded order, forever (epochs wrap).

    The cursor is (epoch, pos). This shard's next document is at global position shard + pos * num_shards of epoch
    `epoch`'s order. Empty documents are skipped."""

    def __init__(self, source, *, shard: int, num_shards: int, seed: int, shuffle: bool):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        if len(source) < num_shards:
            what = "data.document_slice keeps" if isinstance(source, SlicedSource) else "the dataset has"
            raise ValueError(f"data: {what} {len(source)} documents, fewer than the {num_shards} "
                             "data-parallel ranks (x workers) reading it")
        self.source, self.shard, self.num_shards, self.seed, self.shuffle = source, shard, num_shards, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order_epoch, self._order = None, None
        self._cache: dict[tuple[int, int], np.ndarray] = {}  # (epoch, pos) -> tokens: read ahead, not state

    def _length(self) -> int:
        """Documents of this shard per epoch. Shards differ by at most one."""
        return math.ceil((len(self.source) - self.shard) / self.num_shards)

    def _global_index(self, epoch: int, pos: int) -> int:
        g = self.shard + pos * self.num_shards
        if not self.shuffle or self.source.random_order:
            return g
        if self._order_epoch != epoch:
            # Seeded by (seed, epoch) only: every shard, at any world size, sees the same order.
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.source))
            self._order_epoch = epoch
        return int(self._order[g])

    def _fetch(self, epoch: int, pos: int) -> np.ndarray:
        if (epoch, pos) not in self._cache:
            positions = range(pos, min(pos + BLOCK, self._length()))
            docs = self.source.documents([self._global_index(epoch, p) for p in positions])
            self._cache = {(epoch, p): d for p, d in zip(positions, docs)}
        return self._cache[(epoch, pos)]

    def next_document(self) -> np.ndarray:
        for _ in range(self._length() + 1):  # at most one full epoch of empty documents before giving up
            if self.pos >= self._length():
                self.epoch, self.pos = self.epoch + 1, 0
            tokens = self._fetch(self.epoch, self.pos)
            self.pos += 1
            if len(tokens):
                return tokens
        raise DataError(f"data: shard {self.shard} of {self.num_shards} holds only empty documents")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "shard": self.shard, "num_shards": self.num_shards,
                "seed": self.seed, "shuffle": self.shuffle, "fingerprint": self.source.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != self.source.fingerprint:
            mock = "; the mock source's documents follow training.seq_len" if state["fingerprint"].startswith(
                "mock:") else ""
            raise ValueError(f"data: the checkpoint's data loader state is for other data ({state['fingerprint']}, "
                             f"now {self.source.fingerprint}{mock}); to start this data from its beginning, add "
                             "dataloader to checkpoint.exclude_from_loading")
        # The order follows the seed and shuffle setting the run started with, so it stays one order.
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.pos = state["epoch"], state["pos"]
        if state["num_shards"] != self.num_shards:
            # Another data-parallel size: each old shard had read about `pos` documents, so the epoch's first
            # pos * old_shards documents are (nearly) all consumed. Each new shard continues at its first position
            # at or past that point. At most a few documents per shard are skipped or read twice.
            consumed = state["pos"] * state["num_shards"]
            self.pos = max(0, math.ceil((consumed - self.shard) / self.num_shards))
            logger.warning("data: resuming a loader saved with %d shards on %d shards: shard %d continues epoch %d "
                           "at document %d of %d (not an exact resume)", state["num_shards"], self.num_shards,
                           self.shard, self.epoch, self.pos, self._length())
        self._cache, self._order_epoch = {}, None


class StreamingDocuments:
    """A streaming Hugging Face dataset, split by data-parallel rank and tokenized on the fly.

    The cursor is the epoch and datasets' own state after the last document read (None at an epoch's start). Resume is
    exact without shuffle. With shuffle, datasets refills its shuffle buffer on resume (its documented limit), so the
    order after a resume differs from an uninterrupted run."""

    def __init__(self, dataset, tokenizer, text_field: str, *, shard: int, num_shards: int, seed: int,
                 shuffle: bool, buffer_size: int = 10_000):
        from datasets.distributed import split_dataset_by_node

        dataset = split_dataset_by_node(dataset, rank=shard, world_size=num_shards)
        self.dataset = dataset.shuffle(seed=seed, buffer_size=buffer_size) if shuffle else dataset
        self.resumes_exactly = not shuffle  # read by the Packer: see the class docstring
        self.tokenizer, self.text_field = tokenizer, text_field
        self.shard, self.num_shards = shard, num_shards
        self.epoch, self.hf_state = 0, None
        self._iter = None
        self._block: list[tuple[np.ndarray, dict]] = []  # read ahead: (tokens, datasets' state after it)

    def _read_block(self) -> None:
        if self._iter is None:
            self.dataset.set_epoch(self.epoch)
            if self.hf_state is not None:
                self.dataset.load_state_dict(self.hf_state)
            self._iter = iter(self.dataset)
        texts, states = [], []
        for example in self._iter:
            texts.append(_text(example[self.text_field], self.text_field, f"rank {self.shard}'s stream"))
            states.append(self.dataset.state_dict())
            if len(texts) == BLOCK:
                break
        self._block = list(zip((np.asarray(t, dtype=np.int64) for t in encode_batch(self.tokenizer, texts)), states))

    def next_document(self) -> np.ndarray:
        epoch_ends = 0
        while True:
            if not self._block:
                self._read_block()
                if not self._block:  # the epoch is over
                    epoch_ends += 1
                    if epoch_ends > 2:  # a whole epoch went by without one non-empty document
                        raise DataError(f"data: rank {self.shard} of {self.num_shards} got no documents "
                                         "from the stream")
                    self.epoch, self.hf_state, self._iter = self.epoch + 1, None, None
                    continue
            tokens, self.hf_state = self._block.pop(0)
            if len(tokens):
                return tokens

    def state_dict(self) -> dict:
        # datasets' state as one JSON string. Its nesting varies along the stream (None at an epoch start), but DCP
        # loads a checkpoint into the current state_dict's structure, which must therefore stay the same.
        hf_state = json.dumps(self.hf_state) if self.hf_state is not None else ""
        return {"epoch": self.epoch, "hf_state": hf_state, "shard": self.shard, "num_shards": self.num_shards}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._iter, self._block = state["epoch"], None, []
        self.hf_state = json.loads(state["hf_state"]) if state["hf_state"] else None
        if state["num_shards"] != self.num_shards or state["shard"] != self.shard:
            # The stream's position belongs to another split of the shards: it cannot be mapped onto this one.
            logger.warning("data: streaming state saved for shard %d of %d, loaded on shard %d of %d: "
                           "restarting epoch %d of this shard's stream", state["shard"], state["num_shards"],
                           self.shard, self.num_shards, self.epoch)
            self.hf_state = None


# --------------------------------------------------------------------------------------------------------------


def load_hf_dataset(cfg: Data, cache_dir: str | None = None):
    """datasets.load_dataset for `data.path`: a local folder, local files, or a hub name.

    For local files, the builder follows the extension, and the files form the split `data.split`. ``cache_dir`` is
    datasets' cache of the download and of what is made from it; by default it is datasets' own, under HF_HOME."""
    import datasets

    path = resolve_path(cfg.path)
    try:
        if os.path.isdir(path):
            ds = datasets.load_dataset(path, cfg.name or None, split=cfg.split, streaming=cfg.streaming,
                                       cache_dir=cache_dir)
        elif looks_local(cfg.path):
            files = local_data_files(path)
            if not files:
                raise ValueError(f"data.path: no such file or folder: {cfg.path}")
            if all(os.path.getsize(f) == 0 for f in files):  # datasets would say only "StopIteration"
                raise ValueError(f"data.path: {cfg.path} is empty: no documents")
            builder = files_builder(files, cfg.path)
            # The files are the split: name it as asked, or datasets would infer split names from file names.
            ds = datasets.load_dataset(builder, data_files={cfg.split: files}, split=cfg.split,
                                       streaming=cfg.streaming, cache_dir=cache_dir)
        else:
            ds = datasets.load_dataset(path, cfg.name or None, split=cfg.split, streaming=cfg.streaming,
                                       cache_dir=cache_dir)
    except ValueError as e:
        if str(e).startswith("data."):
            raise
        raise ValueError(f"data.path: cannot load {cfg.path} (split {cfg.split!r}): "
                         f"{first_error_line(e, with_type=True)}") from None
    except Exception as e:  # noqa: BLE001 -- network, missing split, bad files: one line naming the field
        raise ValueError(f"data.path: cannot load {cfg.path} (split {cfg.split!r}): "
                         f"{first_error_line(e, with_type=True)}") from None
    columns = ds.column_names
    if columns is not None and cfg.text_field not in columns:
        raise ValueError(f"data.text_field: no column {cfg.text_field!r} in {cfg.path} (columns: {', '.join(columns)})")
    return ds


def build_documents(cfg: Data, tokenizer, *, shard: int, num_shards: int, seed: int, eos: int,
                    vocab_size: int | None, max_doc_len: int):
    """The document cursor for one shard, for `data.source`."""
    if cfg.source == "mock":
        if vocab_size is None:
            raise ValueError("data.source = mock needs the model's vocab_size")
        source = MockSource(vocab_size, eos, seed, max_doc_len)
    elif cfg.source == "megatron":
        source = MegatronSource(megatron_prefixes(cfg.path))
    elif cfg.source == "hf":
        ds = load_hf_dataset(cfg)
        if cfg.streaming:
            return StreamingDocuments(ds, tokenizer, cfg.text_field, shard=shard, num_shards=num_shards, seed=seed,
                                      shuffle=cfg.shuffle)
        source = HFSource(ds, tokenizer, cfg.text_field)
    else:
        raise ValueError(f"data.source must be one of hf, megatron, mock (got {cfg.source!r})")
    if cfg.sliced():  # before the split over ranks and workers: the same documents on any number of them
        source = SlicedSource(source, cfg.document_slice, cfg.document_slice_seed)
    return ShardedDocuments(source, shard=shard, num_shards=num_shards, seed=seed, shuffle=cfg.shuffle)


def summarize(cfg: Data) -> dict | None:
    """What a [data] section holds: {"files", "documents", "tokens"}.

    "tokens" is None where the text is tokenized as it is read. With data.document_slice the counts are the slice's, and
    "all_documents" gives the whole source's. Returns None for mock data or a streamed dataset, which have no length."""
    if cfg.source == "megatron":
        files = [MegatronDataset(p) for p in megatron_prefixes(cfg.path)]
        summary = {"files": len(files), "documents": sum(len(f) for f in files),
                   "tokens": int(sum(int(f.sequence_lengths.sum(dtype=np.int64)) for f in files))}
        if cfg.sliced():
            per_document = np.concatenate([_document_tokens(f) for f in files]) if files else np.zeros(0, np.int64)
            kept = slice_indices(len(per_document), cfg.document_slice, cfg.document_slice_seed)
            summary.update(all_documents=summary["documents"], documents=len(kept),
                           tokens=int(per_document[kept].sum(dtype=np.int64)))
        return summary
    if cfg.source == "hf" and not cfg.streaming:
        local = looks_local(cfg.path) and not os.path.isdir(resolve_path(cfg.path))
        summary = {"files": len(local_data_files(cfg.path)) if local else None,
                   "documents": len(load_hf_dataset(cfg)), "tokens": None}
        if cfg.sliced():
            lo, hi = slice_bounds(summary["documents"], cfg.document_slice)
            summary.update(all_documents=summary["documents"], documents=hi - lo)
        return summary
    return None


def _document_tokens(f: MegatronDataset) -> np.ndarray:
    """Each document's tokens in one Megatron file. A document may be several sequences."""
    ends = np.concatenate([[0], np.cumsum(f.sequence_lengths, dtype=np.int64)])
    return ends[f.document_indices[1:]] - ends[f.document_indices[:-1]]

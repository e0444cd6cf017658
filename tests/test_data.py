"""Data pipeline: packing, determinism, sharding, exact resume, Megatron files, prepare_data.py, bad input.
Everything is built in tmp folders (a tiny BPE tokenizer, tiny jsonl files): no network, no repo assets."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hybridtitan.data import Data, MegatronWriter, build_dataloader, build_tokenizer, validate_data_config  # noqa: E402
from hybridtitan.data.megatron import MegatronDataset  # noqa: E402
from hybridtitan.data.packing import Packer, cu_seqlens, document_starts, with_eos  # noqa: E402
from hybridtitan.data.sources import (  # noqa: E402
    HFSource,
    MegatronSource,
    MockSource,
    ShardedDocuments,
    SlicedSource,
    build_documents,
    load_hf_dataset,
)
from hybridtitan.errors import DataError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while seven hybrid models learn to predict every next token "
         "from long documents packed into windows").split()


def make_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for _ in range(n)]


def prepare_data_argv(cache: Path, *args: str) -> list[str]:
    """``scripts/prepare_data.py ARGS`` with its datasets cache in ``cache`` (--cache-dir: a test's own, as a fresh
    HF_HOME would give it, so that its runs can be forks of the tests' server: helpers.start)."""
    return [str(REPO / "scripts" / "prepare_data.py"), *args, "--cache-dir", str(cache)]


def prepare_data(cache: Path, *args: str) -> subprocess.CompletedProcess:
    from helpers import env, run_processes

    return run_processes(prepare_data_argv(cache, *args), [env()], timeout=300)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(make_texts(200, 0), trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tok(tok_dir):
    return build_tokenizer(tok_dir)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """train.jsonl (60 documents, one empty) and validation.jsonl in one folder."""
    folder = tmp_path_factory.mktemp("corpus")
    texts = make_texts(60, 1)
    texts[7] = ""  # an empty document: skipped, never a lone EOS
    for name, rows in (("train", texts), ("validation", make_texts(10, 2))):
        with open(folder / f"{name}.jsonl", "w") as f:
            for i, t in enumerate(rows):
                f.write(json.dumps({"id": i, "text": t}) + "\n")
    return {"folder": str(folder), "train": str(folder / "train.jsonl"), "texts": texts}


@pytest.fixture(scope="session")
def megatron_prefix(tmp_path_factory, tok, corpus) -> str:
    """The train corpus tokenized into two Megatron files (prefix glob returned)."""
    folder = tmp_path_factory.mktemp("megatron")
    ids = tok(corpus["texts"], add_special_tokens=False)["input_ids"]
    for k, part in enumerate((ids[:25], ids[25:])):
        with MegatronWriter(str(folder / f"train_{k:05d}"), vocab_size=len(tok)) as w:
            for doc in part:
                if doc:
                    w.add_document(doc)
    return str(folder / "train_*")


def take(loader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def loader_for(kind: str, tok, corpus, megatron_prefix, *, rank=0, world=1, seed=0, seq_len=16, batch=4, **data):
    cfg = {"hf": Data(source="hf", path=corpus["train"]),
           "hf-folder": Data(source="hf", path=corpus["folder"]),
           "hf-stream": Data(source="hf", path=corpus["train"], streaming=True, shuffle=False),
           "megatron": Data(source="megatron", path=megatron_prefix),
           "mock": Data(source="mock")}[kind]
    cfg = dataclasses.replace(cfg, **data)
    return build_dataloader(cfg, tok, seq_len=seq_len, local_batch_size=batch, dp_rank=rank, dp_world_size=world,
                            seed=seed, vocab_size=512)


# ---------------------------------------------------------------------------------------------------- packing


class ListDocuments:
    """A minimal document cursor over a fixed list (wrapping), for packing tests."""

    shard, num_shards = 0, 1

    def __init__(self, docs):
        self.docs, self.i = docs, 0

    def next_document(self):
        doc = self.docs[self.i % len(self.docs)]
        self.i += 1
        return np.asarray(doc)

    def state_dict(self):
        return {"i": self.i, "shard": 0, "num_shards": 1}

    def load_state_dict(self, state):
        self.i = state["i"]


def test_packing_resumes_a_shuffled_stream_at_a_new_document():
    """A shuffled stream gives other documents after a resume (datasets refills its shuffle buffer): the offset
    into the half-cut document must not be applied to whichever document comes next (it was an error when that
    one was shorter, and silently wrong text when longer). The next window starts a new document instead."""

    class RefilledStream(ListDocuments):
        resumes_exactly = False

        def load_state_dict(self, state):
            self.i = state["i"] + 1  # the refill: the half-cut document does not come again

    docs = [list(range(1, 41)), [50, 51], [60, 61, 62]]
    packer = Packer(ListDocuments(docs), seq_len=8, eos=0)
    first = [packer.next_window() for _ in range(2)]  # the long document is half-cut after 17 of its 41 tokens
    state = packer.state_dict()
    assert state["offset"] == 17 and first[1][-1] == 17
    resumed = Packer(RefilledStream(docs), seq_len=8, eos=0)
    resumed.load_state_dict(state)
    window = resumed.next_window()
    assert window.tolist() == [17, 50, 51, 0, 60, 61, 62, 0, 1]  # the carried token, then whole new documents


def test_packing_hand_made():
    packer = Packer(ListDocuments([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]), seq_len=4, eos=0)
    windows = [packer.next_window() for _ in range(4)]
    # stream: 1 2 3 0 | 4 5 0 | 6 7 8 9 10 0 | 1 2 3 0 ...; consecutive windows share one token
    assert [w.tolist() for w in windows] == [[1, 2, 3, 0, 4], [4, 5, 0, 6, 7], [7, 8, 9, 10, 0], [0, 1, 2, 3, 0]]
    assert document_starts(windows[0][:-1], 0).tolist() == [0]
    assert document_starts(windows[1][:-1], 0).tolist() == [0, 3]
    assert document_starts(windows[3][:-1], 0).tolist() == [0, 1]
    batch = torch.from_numpy(np.stack([w[:-1] for w in windows]))
    assert cu_seqlens(batch, 0).tolist() == [0, 4, 7, 8, 12, 13, 16]
    assert cu_seqlens(batch, 0).dtype == torch.int32
    # EOS is not doubled after a document that already ends with it (Megatron --append-eod data)
    assert with_eos([5, 6, 0], 0).tolist() == [5, 6, 0] and with_eos([5, 6], 0).tolist() == [5, 6, 0]


def test_packer_resume_mid_document():
    docs = [list(range(1, 30)), [40, 41], list(range(50, 75))]
    a = Packer(ListDocuments(docs), seq_len=8, eos=0)
    [a.next_window() for _ in range(2)]  # stops inside the first document
    state = a.state_dict()
    assert state["offset"] > 0 and state["documents"] == {"i": 0, "shard": 0, "num_shards": 1}
    expected = [a.next_window() for _ in range(6)]
    b = Packer(ListDocuments(docs), seq_len=8, eos=0)
    b.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(expected, [b.next_window() for _ in range(6)]))


def test_loader_stream_is_documents_with_eos(tok, corpus, megatron_prefix):
    """Without shuffle, on one rank, the batches are exactly the documents, each followed by EOS, end to end."""
    eos = tok.eos_token_id
    stream = []
    for t in corpus["texts"]:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        if ids:
            stream += ids + [eos]
    loader = loader_for("hf", tok, corpus, megatron_prefix, shuffle=False, document_boundaries=True)
    batches = take(loader, 5)
    rows = [r for b in batches for r in zip(b["input_ids"], b["labels"])]
    for k, (inputs, labels) in enumerate(rows):
        window = stream[16 * k:16 * k + 17]  # windows of seq_len + 1, sharing one token
        assert inputs.tolist() == window[:-1] and labels.tolist() == window[1:]
    for b in batches:
        assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (4, 16)
        assert torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
        ids, cu = b["input_ids"], b["cu_seqlens"]
        flat = ids.flatten()
        expected = [p for p in range(ids.numel()) if p % 16 == 0 or flat[p - 1] == eos] + [ids.numel()]
        assert cu.tolist() == expected
    # the megatron copy of the same corpus gives the same stream
    assert same(take(loader_for("megatron", tok, corpus, megatron_prefix, shuffle=False, document_boundaries=True), 5),
                batches)


# ------------------------------------------------------------------------------------- determinism, sharding


@pytest.mark.parametrize("kind", ["hf", "megatron", "mock"])
def test_deterministic_for_a_seed(kind, tok, corpus, megatron_prefix):
    a = take(loader_for(kind, tok, corpus, megatron_prefix, seed=3), 6)
    assert same(a, take(loader_for(kind, tok, corpus, megatron_prefix, seed=3), 6))
    assert not same(a, take(loader_for(kind, tok, corpus, megatron_prefix, seed=4), 6))


def test_sharding_covers_the_epoch_once(tok, corpus, megatron_prefix):
    ds = load_hf_dataset(Data(source="hf", path=corpus["train"]))
    for source in (HFSource(ds, tok, "text"), MegatronSource([megatron_prefix[:-1] + "00000",
                                                              megatron_prefix[:-1] + "00001"])):
        everything = Counter(tuple(d.tolist()) for d in source.documents(range(len(source))) if len(d))
        seen = []
        for rank in range(2):
            docs = ShardedDocuments(source, shard=rank, num_shards=2, seed=5, shuffle=True)
            mine = []
            while docs.epoch == 0:
                mine.append(tuple(docs.next_document().tolist()))
                if docs.pos >= docs._length():
                    break
            seen.append(Counter(mine))
        assert not (set(seen[0]) & set(seen[1])), "the two ranks share documents"
        assert seen[0] + seen[1] == everything


def test_epochs_reshuffle(tok, corpus, megatron_prefix):
    source = MegatronSource([megatron_prefix[:-1] + "00000"])
    docs = ShardedDocuments(source, shard=0, num_shards=1, seed=0, shuffle=True)
    order = [docs._global_index(e, p) for e in (0, 1) for p in range(len(source))]
    assert sorted(order[:len(source)]) == list(range(len(source))) and order[:len(source)] != order[len(source):]


# ------------------------------------------------------------------------------------------------ document slices


def slice_cfg(kind: str, corpus, megatron_prefix, **data) -> Data:
    base = {"hf": Data(source="hf", path=corpus["train"]), "megatron": Data(source="megatron", path=megatron_prefix),
            "mock": Data(source="mock")}[kind]
    return dataclasses.replace(base, **data)


def epoch_documents(cfg: Data, tok, *, shard=0, num_shards=1, seed=0) -> Counter:
    """The documents (token tuples) one shard reads in its first epoch, as the loader builds its cursor."""
    docs = build_documents(cfg, tok, shard=shard, num_shards=num_shards, seed=seed, eos=tok.eos_token_id,
                           vocab_size=512, max_doc_len=32)
    seen = []
    while docs.pos < docs._length():
        seen.append(tuple(docs.next_document().tolist()))
        if docs.epoch > 0:  # the last documents were empty: the read wrapped
            seen.pop()
            break
    return Counter(seen)


@pytest.mark.parametrize("kind", ["hf", "megatron"])
def test_document_slices_are_disjoint_and_cover_the_data(kind, tok, corpus, megatron_prefix):
    """Stage 1 reads [0, 0.2), stage 2 [0.2, 1): no document in both, every document in one, 20% in the first;
    taken from a permutation (not the files' first 20%), the same for any training seed, another for another
    document_slice_seed."""
    whole = epoch_documents(slice_cfg(kind, corpus, megatron_prefix, shuffle=False), tok)
    first = epoch_documents(slice_cfg(kind, corpus, megatron_prefix, document_slice=[0.0, 0.2]), tok, seed=1)
    rest = epoch_documents(slice_cfg(kind, corpus, megatron_prefix, document_slice=[0.2, 1.0]), tok, seed=2)
    assert len(whole) == 59  # 60 documents, one empty
    assert not set(first) & set(rest), "the two stages share documents"
    assert first + rest == whole
    n = 60 if kind == "hf" else 59  # the hf file holds the empty document too (skipped as it is read)
    assert abs(sum(first.values()) - round(0.2 * n)) <= 1 and sum(rest.values()) >= round(0.8 * n) - 1
    in_order = [tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in corpus["texts"] if t]
    assert set(first) != set(in_order[:len(first)])  # a permutation's slice, not the head of the files
    assert epoch_documents(slice_cfg(kind, corpus, megatron_prefix, document_slice=[0.0, 0.2]), tok, seed=7) == first
    other = epoch_documents(slice_cfg(kind, corpus, megatron_prefix, document_slice=[0.0, 0.2],
                                      document_slice_seed=3), tok)
    assert other != first
    # three slices that meet also cover the data exactly once
    parts = [epoch_documents(slice_cfg(kind, corpus, megatron_prefix, document_slice=b), tok)
             for b in ([0.0, 0.33], [0.33, 0.7], [0.7, 1.0])]
    assert parts[0] + parts[1] + parts[2] == whole


@pytest.mark.parametrize("kind", ["hf", "megatron"])
def test_document_slice_is_the_same_on_any_number_of_ranks(kind, tok, corpus, megatron_prefix):
    """The slice is taken before the split over ranks (and workers): on 1 rank, on 2, on 2 ranks of 2 workers
    each, the shards together read the same documents, each once."""
    cfg = slice_cfg(kind, corpus, megatron_prefix, document_slice=[0.2, 1.0])
    one = epoch_documents(cfg, tok)
    assert sum(one.values()) > 40
    for num_shards in (2, 4):
        shards = [epoch_documents(cfg, tok, shard=r, num_shards=num_shards) for r in range(num_shards)]
        assert all(not set(a) & set(b) for i, a in enumerate(shards) for b in shards[i + 1:])
        assert sum(shards, Counter()) == one, num_shards
    # and through the loader: rank 0 of 2 reads only documents of the slice
    cursor = loader_for(kind, tok, corpus, megatron_prefix, rank=0, world=2, document_slice=[0.2, 1.0])
    assert isinstance(cursor.dataset.packer.documents.source, SlicedSource)


def test_mock_slices_are_disjoint():
    """The mock source (already random, 2**40 documents: no permutation) slices its positions."""
    source = MockSource(512, 0, seed=0, max_len=8)
    a, b = SlicedSource(source, [0.0, 0.2], 42), SlicedSource(source, [0.2, 1.0], 42)
    assert a.source_index(len(a) - 1) + 1 == b.source_index(0) and b.source_index(len(b) - 1) == len(source) - 1
    assert len(a) + len(b) == len(source)


def test_the_whole_data_is_not_permuted(tok, corpus, megatron_prefix):
    """The default [0.0, 1.0] reads the source itself, in today's order (test_loader_stream_is_documents_with_eos
    checks that order)."""
    docs = build_documents(slice_cfg("megatron", corpus, megatron_prefix), tok, shard=0, num_shards=1, seed=0,
                           eos=tok.eos_token_id, vocab_size=512, max_doc_len=32)
    assert isinstance(docs.source, MegatronSource)


@pytest.mark.parametrize("kind", ["hf", "megatron", "mock"])
def test_exact_resume_with_a_slice(kind, tok, corpus, megatron_prefix):
    """Saved in the slice's second epoch, mid-document: the resumed loader gives the same batches; a state saved
    without the slice, or with another, is refused as other data."""
    n, m = 55, 30  # the [0.2, 1.0) slice: ~3000 tokens, ~46 batches of 4 x 16 per epoch
    loader = loader_for(kind, tok, corpus, megatron_prefix, document_slice=[0.2, 1.0])
    it = iter(loader)
    [next(it) for _ in range(n)]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    expected = [next(it) for _ in range(m)]
    if kind != "mock":
        assert state["dataset_state"]["packer"]["documents"]["epoch"] == 1
    fresh = loader_for(kind, tok, corpus, megatron_prefix, document_slice=[0.2, 1.0])
    fresh.load_state_dict(state)
    assert same(take(fresh, m), expected)
    for other in ({"document_slice": [0.0, 0.2]}, {}, {"document_slice": [0.2, 1.0], "document_slice_seed": 1}):
        refused = loader_for(kind, tok, corpus, megatron_prefix, **other)
        refused.load_state_dict(state)
        with pytest.raises(ValueError, match="other data"):
            next(iter(refused))


def test_exact_resume_with_a_slice_and_workers(tok, corpus, megatron_prefix):
    loader = loader_for("megatron", tok, corpus, megatron_prefix, num_workers=2, document_slice=[0.0, 0.5])
    it = iter(loader)
    [next(it) for _ in range(9)]
    state = loader.state_dict()
    expected = [next(it) for _ in range(8)]
    fresh = loader_for("megatron", tok, corpus, megatron_prefix, num_workers=2, document_slice=[0.0, 0.5])
    fresh.load_state_dict(state)
    assert same(take(fresh, 8), expected)


def test_a_slice_without_documents_is_refused(tok, corpus, megatron_prefix):
    def error(**data):
        with pytest.raises(ValueError) as e:
            loader_for("megatron", tok, corpus, megatron_prefix, **data)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error(document_slice=[0.0, 0.005]) == ("data.document_slice [0.0, 0.005] holds no document of the 59 "
                                                  "documents of data.path")
    assert error(document_slice=[0.99, 1.0], world=2) == ("data: data.document_slice keeps 1 documents, fewer than "
                                                         "the 2 data-parallel ranks (x workers) reading it")
    assert error(document_slice=[0.5, 0.1]).startswith("data.document_slice must be [start, end] with 0 <= start")
    with pytest.raises(ValueError, match="a slice needs random access"):
        loader_for("hf-stream", tok, corpus, megatron_prefix, document_slice=[0.0, 0.2])


def test_what_a_slice_holds(tok, corpus, megatron_prefix):
    """summarize (the log's "data: ..." line and its epochs) counts the slice's documents and tokens: the two
    stages' add up to the whole, and the tokens are those the loader reads."""
    from types import SimpleNamespace

    from hybridtitan.data.sources import summarize
    from hybridtitan.preflight import what_the_run_reads

    whole = summarize(slice_cfg("megatron", corpus, megatron_prefix))
    first = summarize(slice_cfg("megatron", corpus, megatron_prefix, document_slice=[0.0, 0.2]))
    rest = summarize(slice_cfg("megatron", corpus, megatron_prefix, document_slice=[0.2, 1.0]))
    assert "all_documents" not in whole and first["all_documents"] == rest["all_documents"] == 59
    assert first["documents"] == 12 and first["documents"] + rest["documents"] == whole["documents"]
    assert first["tokens"] + rest["tokens"] == whole["tokens"] and 0 < first["tokens"] < whole["tokens"] / 2
    read = epoch_documents(slice_cfg("megatron", corpus, megatron_prefix, document_slice=[0.0, 0.2]), tok)
    assert sum(len(d) * k for d, k in read.items()) == first["tokens"]
    hf = summarize(slice_cfg("hf", corpus, megatron_prefix, document_slice=[0.2, 1.0]))
    assert hf["documents"] == 48 and hf["all_documents"] == 60 and hf["tokens"] is None
    cfg = SimpleNamespace(data=slice_cfg("megatron", corpus, megatron_prefix, document_slice=[0.0, 0.2]),
                          training=SimpleNamespace(steps=10, seq_len=64))
    line = what_the_run_reads(cfg, 8)
    epochs = 10 * 8 * 64 / (first["tokens"] + 12)
    assert line == (f"data: 2 file(s), data.document_slice [0.0, 0.2) of 59 documents: 12 documents, "
                    f"{first['tokens']:,} tokens; the run reads 5,120 tokens (10 steps x 8 x 64): {epochs:.2f} epochs")


def test_a_resume_with_another_slice_is_refused(tmp_path, tok, corpus, megatron_prefix):
    """The run record's data_identity names the slice: a resume that would load the loader's position into
    another slice (or the whole, or another seed) of the same files is refused in one line, as other files are;
    the same slice passes, and a run without a slice records what it recorded before."""
    from helpers import fake_step
    from hybridtitan.errors import ConfigError
    from hybridtitan.run_record import check_data, data_identity, record

    whole = slice_cfg("megatron", corpus, megatron_prefix)
    first = dataclasses.replace(whole, document_slice=[0, 0.2])
    assert data_identity(first) == data_identity(whole) + [["document_slice", 0.0, 0.2, 42]]
    assert all(entry[0] != "document_slice" for entry in data_identity(whole))
    fake_step(tmp_path / "run", 4, "debug_hybrid")
    step = tmp_path / "run" / "checkpoint" / "step-4"
    (step / "job_config.json").write_text(json.dumps({"data": {}, **record(first, None)}))
    check_data(str(step), dataclasses.replace(whole, document_slice=[0.0, 0.2]))  # the same slice, as floats
    for other, now in ((dataclasses.replace(whole, document_slice=[0.2, 1.0]), "[0.2, 1.0) seed 42 now"),
                       (whole, "all of it now"),
                       (dataclasses.replace(first, document_slice_seed=7), "[0.0, 0.2) seed 7 now")):
        with pytest.raises(ConfigError) as e:
            check_data(str(step), other)
        assert "\n" not in str(e.value)
        assert str(e.value).startswith(f"cannot resume from {step}: data.document_slice takes other documents of "
                                       f"the data than the run it continues ([0.0, 0.2) seed 42 then, {now})")
        assert str(e.value).endswith("--checkpoint.exclude_from_loading dataloader")
    # other files with the same slice: the files' message
    with pytest.raises(ConfigError, match="data.path reads other data than the run it continues"):
        check_data(str(step), dataclasses.replace(first, source="hf", path=corpus["train"]))


# ------------------------------------------------------------------------------------------------ exact resume


@pytest.mark.parametrize("kind,boundaries", [("hf", False), ("hf", True), ("hf-folder", False), ("hf-stream", True),
                                             ("megatron", False), ("megatron", True), ("mock", True)])
def test_exact_resume(kind, boundaries, tok, corpus, megatron_prefix):
    n, m = 65, 30  # 60 documents, ~3700 tokens: the state is saved in the second epoch, mid-document
    loader = loader_for(kind, tok, corpus, megatron_prefix, document_boundaries=boundaries)
    it = iter(loader)
    [next(it) for _ in range(n)]
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint would store it
    expected = [next(it) for _ in range(m)]
    if kind != "hf-stream":
        assert len(pickle.dumps(state)) < 2048, "the state must be positions, not data"
    fresh = loader_for(kind, tok, corpus, megatron_prefix, document_boundaries=boundaries)
    fresh.load_state_dict(state)
    assert same(take(fresh, m), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, no group: intended
@pytest.mark.parametrize("kind", ["hf-stream", "megatron"])
def test_exact_resume_through_dcp(kind, tmp_path, tok, corpus, megatron_prefix):
    """The trainer checkpoints the loader with DCP, which loads into the live state_dict's structure."""
    import torch.distributed.checkpoint as dcp

    loader = loader_for(kind, tok, corpus, megatron_prefix, document_boundaries=True)
    it = iter(loader)
    [next(it) for _ in range(40)]
    dcp.save({"dataloader": loader}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = [next(it) for _ in range(10)]
    fresh = loader_for(kind, tok, corpus, megatron_prefix, document_boundaries=True)
    dcp.load({"dataloader": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert same(take(fresh, 10), expected)


def test_exact_resume_with_workers(tok, corpus, megatron_prefix):
    loader = loader_for("mock", tok, corpus, megatron_prefix, num_workers=2)
    it = iter(loader)
    [next(it) for _ in range(5)]
    state = loader.state_dict()
    expected = [next(it) for _ in range(6)]
    fresh = loader_for("mock", tok, corpus, megatron_prefix, num_workers=2)
    fresh.load_state_dict(state)
    assert same(take(fresh, 6), expected)


@pytest.mark.parametrize("kind", ["hf", "megatron", "mock"])
def test_resume_world2_state_on_world1(kind, tok, corpus, megatron_prefix, caplog):
    loader = loader_for(kind, tok, corpus, megatron_prefix, rank=0, world=2)
    it = iter(loader)
    [next(it) for _ in range(5)]
    state = loader.state_dict()
    docs = state["dataset_state"]["packer"]["documents"]
    fresh = loader_for(kind, tok, corpus, megatron_prefix, rank=0, world=1)
    with caplog.at_level(logging.WARNING):
        fresh.load_state_dict(state)
        batches = take(fresh, 3)
    assert all(b["input_ids"].shape == (4, 16) for b in batches)
    assert "not an exact resume" in caplog.text
    cursor = fresh.dataset.packer.documents
    assert cursor.epoch == docs["epoch"] and cursor.pos >= docs["pos"] * 2  # continues where both ranks had got to


# ------------------------------------------------------------------------------------------------- Megatron


def test_bad_documents_met_while_training(tmp_path, tok):
    """Found only when the loader reaches them: a text field that is not text, and token files with ids past the
    model's vocabulary (made with another tokenizer). Each is one DataError line, not a traceback from the
    tokenizer or the embedding."""
    def first_batch(cfg):
        loader = build_dataloader(cfg, tok, seq_len=16, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0,
                                  vocab_size=512)
        with pytest.raises(DataError) as e:
            next(iter(loader))
        assert "\n" not in str(e.value)
        return str(e.value)

    for bad, kind in ((7, "int 7"), (["a", "list"], "list ['a', 'list']")):
        path = tmp_path / f"bad_{type(bad).__name__}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["some words here"] * 3 + [bad]))
        for streaming in (False, True):
            msg = first_batch(Data(path=str(path), shuffle=False, streaming=streaming))
            assert "'text' holds " + kind + ", not text" in msg, msg
    with MegatronWriter(str(tmp_path / "wide"), vocab_size=70000) as w:
        w.add_document(np.arange(40) * 1000)  # ids up to 39,000 for a model of 512
    msg = first_batch(Data(source="megatron", path=str(tmp_path / "wide")))
    assert msg.startswith("data: token id ") and "outside the model's vocabulary (512 ids)" in msg, msg


def test_megatron_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 70000, size=int(rng.integers(1, 50))) for _ in range(20)]
    with MegatronWriter(str(tmp_path / "big"), vocab_size=70000) as w:  # int32 (vocab >= 65500)
        for d in docs:
            w.add_document(d)
    small = [d % 1000 for d in docs]
    with MegatronWriter(str(tmp_path / "small"), vocab_size=1000) as w:  # uint16
        for d in small:
            w.add_document(d)
    for prefix, expected, code in (("big", docs, 4), ("small", small, 8)):
        raw = (tmp_path / f"{prefix}.idx").read_bytes()
        assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", raw[9:34]) == (1, code, 20, 21)
        ds = MegatronDataset(str(tmp_path / prefix))
        assert len(ds) == 20 and ds.document_indices.tolist() == list(range(21))
        assert all(np.array_equal(ds.doc(i), d) for i, d in enumerate(expected))
        assert (tmp_path / f"{prefix}.bin").stat().st_size == sum(map(len, expected)) * (4 if code == 4 else 2)


def test_megatron_documents_of_several_sequences(tmp_path):
    """Megatron data preprocessed with sentence splitting: a document spans several sequences."""
    seqs = [np.array([1, 2], np.int32), np.array([3], np.int32), np.array([4, 5, 6], np.int32)]
    (tmp_path / "s.bin").write_bytes(b"".join(s.tobytes() for s in seqs))
    lengths = np.array([2, 1, 3], np.int32)
    pointers = np.array([0, 8, 12], np.int64)
    doc_idx = np.array([0, 2, 3], np.int64)
    (tmp_path / "s.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3) + lengths.tobytes()
                                     + pointers.tobytes() + doc_idx.tobytes())
    ds = MegatronDataset(str(tmp_path / "s"))
    assert len(ds) == 2 and ds.doc(0).tolist() == [1, 2, 3] and ds.doc(1).tolist() == [4, 5, 6]


def test_prepare_data_end_to_end(tmp_path, tok_dir, tok, corpus):
    out = tmp_path / "out" / "train"
    result = prepare_data(tmp_path / "hf", "--dataset", corpus["train"], "--tokenizer", tok_dir, "--output", str(out),
                          "--workers", "2", "--shard-size-tokens", "500")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f'path = "{out}_*"' in result.stdout
    shards = sorted(p.name for p in out.parent.glob("*.idx"))
    assert len(shards) > 1 and shards[0] == "train_00000.idx"
    source = MegatronSource([str(out.parent / s[:-4]) for s in shards])
    expected = [ids for ids in tok(corpus["texts"], add_special_tokens=False)["input_ids"] if ids]  # no EOS
    got = source.documents(range(len(source)))
    assert len(got) == len(expected) and all(g.tolist() == e for g, e in zip(got, expected))
    # --validation 0.25: every fourth document held out, beside the training shards (which the glob leaves out)
    held = tmp_path / "held" / "train"
    result = prepare_data(tmp_path / "hf", "--dataset", corpus["train"], "--tokenizer", tok_dir, "--output", str(held),
                          "--workers", "1", "--validation", "0.25")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f'path = "{held}-validation"' in result.stdout
    from hybridtitan.data.config import megatron_prefixes

    assert megatron_prefixes(f"{held}_*") == [f"{held}_00000"]
    train, validation = MegatronSource([f"{held}_00000"]), MegatronSource([f"{held}-validation"])
    flags = [int((i + 1) * 0.25) > int(i * 0.25) for i in range(len(expected))]
    assert [d.tolist() for d in validation.documents(range(len(validation)))] == [
        e for e, f in zip(expected, flags) if f]
    assert [d.tolist() for d in train.documents(range(len(train)))] == [e for e, f in zip(expected, flags) if not f]
    assert 0.2 * len(expected) <= len(validation) <= 0.3 * len(expected)


def test_prepare_data_manifest_and_resume(tmp_path, tok_dir, tok, corpus):
    """The manifest names the tokenizer, each shard's documents and tokens and the held-out set, and says complete;
    a preparation cut short after its first shard is refused by the trainer, and --resume ends it with the very
    files of an uninterrupted one."""
    import shutil

    from hybridtitan.data import manifest
    from hybridtitan.data.config import megatron_prefixes
    from hybridtitan.data.tokenizer import eos_id, vocabulary_fingerprint

    def prepare(out: Path, *extra: str):
        return prepare_data(tmp_path / "hf", "--dataset", corpus["train"], "--tokenizer", tok_dir, "--output",
                            str(out), "--workers", "1", "--shard-size-tokens", "500", "--validation", "0.25", *extra)

    whole = tmp_path / "whole" / "train"
    assert prepare(whole).returncode == 0
    record = manifest.read(f"{whole}.manifest.json")
    assert record["complete"] and len(record["shards"]) > 2
    assert record["tokenizer"]["fingerprint"] == vocabulary_fingerprint(tok)
    assert record["tokenizer"]["eod_id"] == eos_id(tok)
    for entry in [*record["shards"], record["validation"]]:
        ds = MegatronDataset(str(whole.parent / entry["prefix"]))
        assert len(ds) == entry["documents"] and int(ds.sequence_lengths.sum()) == entry["tokens"]
    assert record["documents"] == sum(e["documents"] for e in record["shards"])
    assert manifest.check_shards(megatron_prefixes(f"{whole}_*"), vocabulary_fingerprint(tok)) == []
    # what a kill during the second shard leaves: the manifest of one finished shard, a .bin without its .idx
    cut = tmp_path / "cut" / "train"
    cut.parent.mkdir()
    first = record["shards"][0]["prefix"]
    for suffix in (".bin", ".idx"):
        shutil.copy(whole.parent / (first + suffix), cut.parent / (first + suffix))
    second = record["shards"][1]["prefix"]
    (cut.parent / f"{second}.bin").write_bytes((whole.parent / f"{second}.bin").read_bytes()[:100])
    manifest.write(f"{cut}.manifest.json", {k: v for k, v in record.items() if k not in ("format", "version")}
                   | {"complete": False, "shards": record["shards"][:1], "validation": None})
    with pytest.raises(ValueError, match=f"{second}.bin has no .idx beside it"):
        megatron_prefixes(f"{cut}_*")
    with pytest.raises(ValueError, match="from a preparation that did not finish"):
        manifest.check_shards([str(cut.parent / first)], None)
    again = prepare(cut)
    assert again.returncode == 2 and "--resume goes on from an interrupted one" in again.stderr
    resumed = prepare(cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming: 1 finished shard(s)" in resumed.stdout
    assert sorted(p.name for p in cut.parent.iterdir()) == sorted(p.name for p in whole.parent.iterdir())
    for f in whole.parent.glob("*.[bi][id][nx]"):
        assert (cut.parent / f.name).read_bytes() == f.read_bytes(), f.name
    assert manifest.read(f"{cut}.manifest.json") == record
    assert prepare(cut, "--resume").returncode == 2  # complete: nothing to resume
    # shards of another tokenizer are refused; shards without a manifest (other tools) load with a warning
    with pytest.raises(ValueError, match="was tokenized with .* not with data.tokenizer"):
        manifest.check_shards([str(whole.parent / first)], "0123456789abcdef")
    (whole.parent / "train.manifest.json").unlink()
    warnings = manifest.check_shards(megatron_prefixes(f"{whole}_*"), vocabulary_fingerprint(tok))
    assert len(warnings) == 1 and "no manifest of scripts/prepare_data.py" in warnings[0]


def test_the_trainer_refuses_data_it_cannot_trust(tmp_path, tok_dir, corpus, capsys):
    """Before anything is written, one line and exit code 2: a training glob that takes in the validation shards,
    and shards made with another tokenizer than data.tokenizer; an unquoted glob the shell expanded gets a hint."""
    import shutil

    from helpers import RECIPE, main_error

    out = tmp_path / "data" / "corpus"
    made = prepare_data(tmp_path / "hf", "--dataset", corpus["train"], "--tokenizer", tok_dir, "--output", str(out),
                        "--workers", "1", "--validation", "0.25")
    assert made.returncode == 0, made.stderr[-2000:]
    dump = tmp_path / "run"
    base = ["--job.config_file", RECIPE, "--job.dump_folder", str(dump), "--data.source", "megatron",
            "--validation.data.source", "megatron", "--validation.data.path", f"{out}-validation"]
    code, err = main_error(capsys, [*base, "--data.path", f"{out}*", "--data.tokenizer", tok_dir])
    assert code == 2 and "also takes in the held-out" in err and "\n" not in err, err
    other = tmp_path / "other_tokenizer"  # the test tokenizer with two ids swapped: same size, other meaning
    shutil.copytree(tok_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    code, err = main_error(capsys, [*base, "--data.path", f"{out}_*", "--data.tokenizer", str(other)])
    assert code == 2 and "was tokenized with" in err and "\n" not in err, err
    assert not dump.exists()
    # the right data: the start of the run says what it reads, and the epochs the schedule makes of it
    from hybridtitan.config_manager import ConfigError, parse_config, parse_overrides
    from hybridtitan.data.manifest import read
    from hybridtitan.preflight import preflight

    made = read(f"{out}.manifest.json")
    plan = preflight(parse_config([*base, "--data.path", f"{out}_*", "--data.tokenizer", tok_dir, "--training.steps",
                                   "10", "--training.seq_len", "64", "--training.global_batch_size", "8",
                                   "--training.local_batch_size", "8"]))
    epochs = 10 * 8 * 64 / (made["tokens"] + made["documents"])
    assert plan.data.reads == (f"data: 1 file(s), {made['documents']:,} documents, {made['tokens']:,} tokens; the run "
                          f"reads 5,120 tokens (10 steps x 8 x 64): {epochs:.2f} epochs")

    files = [str(p) for p in sorted(out.parent.glob("corpus_*"))]
    with pytest.raises(ConfigError, match="an unquoted glob the shell expanded into files"):
        parse_overrides(["--data.path", *files])


def test_prepare_data_bad_input(tmp_path, tok_dir, corpus):
    """Exit code 2 and one line naming this script's options (not the trainer's keys); the underscore spellings
    of the trainer and the other tools are accepted too. The three processes run side by side."""
    out = str(tmp_path / "out" / "train")
    cases = {
        "--dataset: no such file or folder": ["--dataset", str(tmp_path / "nope.jsonl"), "--tokenizer", tok_dir],
        "--text-field: no column 'body'": ["--dataset", corpus["train"], "--tokenizer", tok_dir,
                                           "--text_field", "body"],
        "--shard-size-tokens must be positive": ["--dataset", corpus["train"], "--tokenizer", tok_dir,
                                                 "--shard_size_tokens", "0"],
    }
    from helpers import start

    procs = {expected: start(prepare_data_argv(tmp_path / "hf", *argv, "--output", out))
             for expected, argv in cases.items()}
    for expected, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), stderr


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_input(tmp_path, tok, tok_dir, corpus, megatron_prefix):
    def error(cfg, **kw):
        with pytest.raises(ValueError) as e:
            build_dataloader(cfg, kw.pop("tokenizer", tok), seq_len=16, local_batch_size=2, dp_rank=0, dp_world_size=1,
                             seed=0, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error(Data(path=str(tmp_path / "nope.jsonl"))).startswith("data.path: no such file or folder")
    assert error(Data(path=str(tmp_path / "nothing_here/"))).startswith("data.path: no such file or folder")
    assert error(Data(source="webdataset")).startswith("data.source must be one of hf, megatron, mock")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("a.jsonl", "a.txt", "b.csv"):
        (mixed / name).write_text('{"text": "one"}\n')
    assert "names files of more than one type" in error(Data(path=str(mixed / "a.*")))
    assert error(Data(path=str(mixed / "b.*"))).startswith(f"data.path: cannot tell the file type of {mixed / 'b.csv'}")
    (tmp_path / "empty.jsonl").write_text("")
    empty = tmp_path / "empty.jsonl"
    assert error(Data(path=str(empty))) == f"data.path: {empty} is empty: no documents"
    assert error(Data(source="megatron", path=str(tmp_path / "missing"))).startswith("data.path: no Megatron dataset")
    assert error(Data(path=corpus["train"], text_field="content")).startswith("data.text_field: no column 'content'")
    msg = error(Data(path=corpus["train"]), vocab_size=100)
    assert msg == f"tokenizer vocabulary ({len(tok)}) is larger than the model's vocab_size (100)"
    with pytest.raises(ValueError, match="^data.tokenizer: no such folder"):
        build_tokenizer(str(tmp_path / "no_tokenizer"))
    (tmp_path / "empty_tok").mkdir()
    with pytest.raises(ValueError, match="^data.tokenizer: cannot load"):
        build_tokenizer(str(tmp_path / "empty_tok"))
    with pytest.raises(ValueError, match="^data.tokenizer: no such folder"):
        validate_data_config(Data(tokenizer=str(tmp_path / "no_tokenizer"), path=corpus["train"]))
    # a state from other data is refused with a hint, not silently misread
    state = loader_for("megatron", tok, corpus, megatron_prefix).state_dict()
    other = loader_for("mock", tok, corpus, megatron_prefix)
    other.load_state_dict(state)  # StatefulDataLoader applies it when the next iterator starts
    with pytest.raises(ValueError, match="other data"):
        next(iter(other))


def test_asset_scripts_help_writes_nothing():
    """build_corpus.py and build_tokenizer.py overwrite the shipped assets when run: --help must only print."""
    assets = [p for p in (REPO / "hybridtitan" / "assets").rglob("*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in assets}
    for script in ("build_corpus.py", "build_tokenizer.py"):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("usage:") and "hybridtitan/assets" in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in assets} == before


def test_recorded_tokenizer_path_survives_another_directory(tmp_path, monkeypatch):
    """job_config.json records a relative local tokenizer folder as absolute (export and eval may run elsewhere);
    the package's own path and hub names stay as given."""
    from hybridtitan.data.config import recorded_path, resolve_path

    (tmp_path / "mytok").mkdir()
    monkeypatch.chdir(tmp_path)
    assert recorded_path("mytok") == str(tmp_path / "mytok")
    assert recorded_path("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert recorded_path("hybridtitan/assets/tokenizer") == "hybridtitan/assets/tokenizer"
    assert os.path.isdir(resolve_path("hybridtitan/assets/tokenizer"))  # from any directory

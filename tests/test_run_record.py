"""The run record (hybridtitan.run_record: what a run keeps of its tokenizer and data, and a resume's comparison with
it) and what a model folder holds (hybridtitan.model_folder), on real folders: the shipped tokenizer and corpus, a
step folder as the trainer and an import leave it, a Llama saved by transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import ROOT, fake_step
from hybridtitan.data import Data, build_tokenizer
from hybridtitan.errors import CheckpointError, ConfigError, ConversionError
from hybridtitan.model_folder import DCP, HF, read_folder
from hybridtitan.models import get_flavor
from hybridtitan.run_record import check_data, check_tokenizer, record

TOKENIZER = ROOT / "hybridtitan" / "assets" / "tokenizer"
CORPUS = ROOT / "hybridtitan" / "assets" / "corpus" / "train.jsonl"


def other_tokenizer(folder):
    """The shipped tokenizer with two ids swapped: the same size, another vocabulary."""
    shutil.copytree(TOKENIZER, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def one_line(error) -> str:
    text = str(error.value)
    assert len(text.splitlines()) == 1, text
    return text


def test_record_then_compare_on_resume(tmp_path):
    """What the trainer writes into job_config.json is what a resume compares: the same tokenizer and data (a moved
    copy of the file too) pass; another tokenizer or other files are one line each, naming what differs."""
    tok = build_tokenizer(str(TOKENIZER))
    data = Data(tokenizer=str(TOKENIZER), path=str(CORPUS))
    saved = record(data, tok)
    assert saved["data_identity"] == [["train.jsonl", CORPUS.stat().st_size]]
    assert set(saved) == {"tokenizer_fingerprint", "data_identity"}
    assert "tokenizer_fingerprint" not in record(Data(source="mock"), None)  # a run without a tokenizer

    fake_step(tmp_path / "run", 4, "debug_hybrid")
    step = tmp_path / "run" / "checkpoint" / "step-4"
    (step / "job_config.json").write_text(json.dumps({"data": {"tokenizer": str(TOKENIZER)}, **saved}))
    check_data(str(step), data)
    check_tokenizer(str(step), data, tok)
    moved = tmp_path / "moved" / "train.jsonl"
    moved.parent.mkdir()
    shutil.copy(CORPUS, moved)
    check_data(str(step), Data(tokenizer=str(TOKENIZER), path=str(moved)))

    fewer = tmp_path / "fewer" / "train.jsonl"
    fewer.parent.mkdir()
    fewer.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(ConfigError) as e:
        check_data(str(step), Data(tokenizer=str(TOKENIZER), path=str(fewer)))
    assert f"cannot resume from {step}: data.path reads other data than the run it continues" in one_line(e)
    other = other_tokenizer(tmp_path / "other")
    with pytest.raises(ConfigError) as e:
        check_tokenizer(str(step), Data(tokenizer=str(other)), build_tokenizer(str(other)))
    assert f"{step} was trained with another tokenizer than data.tokenizer ({other})" in one_line(e)

    # a record without a fingerprint (a run on mock data) compares no tokenizer, one without data_identity no data
    (step / "job_config.json").write_text(json.dumps({"data": {"tokenizer": str(TOKENIZER)}}))
    check_tokenizer(str(step), Data(tokenizer=str(other)), build_tokenizer(str(other)))
    check_data(str(step), Data(tokenizer=str(TOKENIZER), path=str(fewer)))


def test_a_folder_without_a_record_is_compared_by_the_tokenizer_it_holds(tmp_path):
    """An import's step folder has no job_config.json: the tokenizer saved inside it is what it was made with."""
    fake_step(tmp_path / "run", 0, "debug_hybrid")
    step = tmp_path / "run" / "checkpoint" / "step-0"
    tok = build_tokenizer(str(TOKENIZER))
    check_tokenizer(str(step), Data(), tok)  # nothing inside: nothing to compare with
    other_tokenizer(step / "tokenizer")
    assert read_folder(str(step)).tokenizer == str(step / "tokenizer")
    with pytest.raises(ConfigError) as e:
        check_tokenizer(str(step), Data(), tok)
    assert "was trained with another tokenizer than data.tokenizer" in one_line(e)


def test_what_a_model_folder_holds(tmp_path):
    """One answer for a DCP step folder (reached from its dump folder too) and a Hugging Face folder: the kind, the
    model's arguments and the tokenizer; the refusals are one line."""
    from test_llama import make_llama

    fake_step(tmp_path / "run", 2, "debug_hybrid")
    fake_step(tmp_path / "run", 5, "debug_gdn")
    step = tmp_path / "run" / "checkpoint" / "step-5"
    (step / "job_config.json").write_text(json.dumps({"data": {"tokenizer": "hybridtitan/assets/tokenizer"}}))
    held = read_folder(str(tmp_path / "run"))
    assert (held.kind, held.path, held.args) == (DCP, str(step), get_flavor("debug_gdn"))
    assert held.source == f"DCP checkpoint {step}"
    assert held.tokenizer is not None and held.tokenizer.endswith("hybridtitan/assets/tokenizer")
    assert held.tokenizer_or("mine") == "mine"
    older = read_folder(str(tmp_path / "run"), step=2)
    assert older.args == get_flavor("debug_hybrid") and older.tokenizer is None
    with pytest.raises(ConversionError) as e:
        older.tokenizer_or(None)
    assert "names no tokenizer (no job_config.json); pass --tokenizer" in one_line(e)
    (step / "job_config.json").write_text("{damaged")
    with pytest.raises(CheckpointError) as e:
        read_folder(str(step))
    assert f"cannot read {step / 'job_config.json'}" in one_line(e)

    llama = tmp_path / "llama"
    make_llama(llama)
    held = read_folder(str(llama))
    assert (held.kind, held.model_type, held.args.pattern) == (HF, "llama", "*-" * 4)
    assert held.tokenizer is None and held.tokenizer_or(None) == str(llama)  # loading it says what is missing
    shutil.copytree(TOKENIZER, llama, dirs_exist_ok=True)
    assert read_folder(str(llama)).tokenizer == str(llama)
    with pytest.raises(ConversionError) as e:
        read_folder(str(llama), step=3)
    assert "is a Hugging Face folder, which holds one model (no steps)" in one_line(e)
    with pytest.raises(CheckpointError) as e:
        read_folder(str(tmp_path / "nowhere"))
    assert "checkpoint not found" in one_line(e)

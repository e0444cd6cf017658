"""A teacher read into FSDP2's shards (hybridtitan.model_loader.load_into_shards): on 2 CPU ranks each reads the
rows it holds, from a Llama's sharded safetensors (tied embeddings or not) and from a DCP checkpoint, and the model
gathered back equals the folder read whole in one process; no rank's host memory grows by the whole teacher while it
reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_ranks
from hybridtitan.checkpoint import save_model_checkpoint
from hybridtitan.hf.convert import model_from_state
from hybridtitan.model_loader import read_model

RANK_SCRIPT = str(Path(__file__).resolve().parent / "teacher_shards.py")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A Llama of ~75M parameters (300 MB in float32, no tensor over 9 MB) saved by transformers in 100 MB
    safetensors shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=768, intermediate_size=3072, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="100MB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder


def read_on_ranks(folder: Path, out: Path, nproc: int) -> tuple[dict, list[dict]]:
    out.mkdir()
    proc = run_ranks([RANK_SCRIPT, str(folder), str(out)], nproc, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return torch.load(out / "gathered.pt", weights_only=True), reports


def mib(tensor: torch.Tensor) -> float:
    return tensor.numel() * tensor.element_size() / 2**20


def test_a_tied_llama_read_in_shards_equals_it_read_whole(tmp_path):
    """Llama-3.2's shape of embeddings: the output layer tied to them, no lm_head tensor in the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path / "llama")
    _, expected, _ = read_model(str(tmp_path / "llama"))
    gathered, _ = read_on_ranks(tmp_path / "llama", tmp_path / "two", 2)
    assert set(gathered) == set(expected)
    assert all(torch.equal(gathered[k], t.float()) for k, t in expected.items())


@pytest.mark.parametrize("kind", ["safetensors", "dcp"])
def test_a_teacher_read_in_shards_equals_it_read_whole(llama, tmp_path, kind):
    folder = llama
    if kind == "dcp":
        args, state, _ = read_model(str(llama))
        folder = tmp_path / "step-0"
        save_model_checkpoint(model_from_state(args, state), str(folder))
    _, expected, _ = read_model(str(folder))
    gathered, reports = read_on_ranks(folder, tmp_path / "two", 2)
    assert set(gathered) >= set(expected)
    for key, tensor in expected.items():
        assert torch.equal(gathered[key], tensor.float()), key
    whole = sum(mib(t) for t in expected.values())
    # its half, and a tensor in flight (DCP's reader holds a stored tensor's bytes and the tensor made of them)
    most = whole / 2 + 3 * max(mib(t) for t in expected.values()) + 32
    for report in reports:
        assert report["peak_growth_mib"] < most < 0.8 * whole, (report, most, whole)

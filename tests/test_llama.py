"""Llama in the zoo: a LlamaForCausalLM folder made by transformers imports with transformers' logits, and a pure
grouped-query-attention model exports back to a LlamaForCausalLM folder that stock transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from hybridtitan.models import FLAVORS, get_flavor

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def make_llama(folder, *, tied=True, rope_scaling=LLAMA3_ROPE, seed=0, legacy_rope_keys=False, **sizes):
    """A tiny random Llama saved by transformers (the debug_llama shape unless ``sizes`` say otherwise); with
    ``legacy_rope_keys`` its config.json spells RoPE as Meta's folders do (rope_theta, rope_scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (saving draws one on stderr, which the one-line-error tests read)
    torch.manual_seed(seed)
    shape = dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5)
    shape.update(sizes)
    rope = {"rope_type": "default", "rope_theta": 500000.0} if rope_scaling is None else {
        **rope_scaling, "rope_theta": 500000.0}
    config = LlamaConfig(**shape, rope_parameters=rope, tie_word_embeddings=tied, max_position_embeddings=131072)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a weight read into the wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    if legacy_rope_keys:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params if params.get("rope_type") != "default" else None
        path.write_text(json.dumps(cfg))
    return model


def llama_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("variant", ["tied_llama3_rope", "untied_plain_rope", "meta_config_keys"])
def test_llama_imports_with_transformers_logits_and_exports_back(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    from hybridtitan.checkpoint import load_model, load_model_args
    from hybridtitan.export_hf import export
    from hybridtitan.import_hf import import_hf

    options = {"tied_llama3_rope": {}, "untied_plain_rope": dict(tied=False, rope_scaling=None),
               "meta_config_keys": dict(legacy_rope_keys=True)}[variant]
    reference = make_llama(tmp_path / "llama", **options)
    # positions past the original context's high-frequency band, so that the llama3 scaling matters
    ids = torch.randint(0, 8192, (2, 300))
    expected = llama_logits(reference, ids)

    step0 = tmp_path / "run" / "checkpoint" / "step-0"
    assert import_hf(str(tmp_path / "llama"), str(step0), tokenizer="hybridtitan/assets/tokenizer") == "llama"
    args = load_model_args(str(step0))
    assert args.attention == "gqa" and args.pattern == "*-" * 4 and args.tie_embeddings == options.get("tied", True)
    if variant == "tied_llama3_rope":
        assert args == get_flavor("debug_llama")  # the flavor is this shape
    model, _ = load_model(str(step0))
    with torch.no_grad():
        ours = model(ids)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)

    # and back: a LlamaForCausalLM folder, stock transformers (no remote code), the same logits
    assert export(str(step0), str(tmp_path / "export"), dtype="float32") == "llama"
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert not list((tmp_path / "export").glob("*.py"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(again).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(llama_logits(again, ids), expected, rtol=1e-4, atol=1e-4)


def test_llama_flavors_have_the_published_sizes():
    """Parameters of meta-llama/Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B, built with transformers' own
    LlamaForCausalLM from our exported config (on the meta device): the same count and the same tensor shapes."""
    from transformers import LlamaForCausalLM

    from hybridtitan.hf.llama import llama_config, to_llama_key
    from hybridtitan.models import build_model

    published = {"llama_1B": 1_235_814_400, "llama_3B": 3_212_749_824, "llama_8B": 8_030_261_248}
    for name, count in published.items():
        args = FLAVORS[name]
        ours = build_model(args, "meta")
        with torch.device("meta"):
            theirs = LlamaForCausalLM(llama_config(args, max_position_embeddings=131072))
        assert sum(p.numel() for p in ours.parameters()) == count
        shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
        for key, value in ours.state_dict().items():
            assert shapes[to_llama_key(key)] == tuple(value.shape), key


def test_llama_config_refusals(tmp_path, capsys):
    """A Llama with biases or another RoPE scaling is refused in one line, before anything is written."""
    from hybridtitan import import_hf

    make_llama(tmp_path / "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(SystemExit) as exc:
        import_hf.main(["--model", str(tmp_path / "llama"), "--output", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: config.json: RoPE scaling 'dynamic' is not supported (only Llama 3's 'llama3')"
    assert not (tmp_path / "out").exists()

    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=True)
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit):
        import_hf.main(["--model", str(tmp_path / "llama"), "--output", str(tmp_path / "out")])
    assert capsys.readouterr().err.strip() == ("error: config.json: attention_bias=True is not supported by "
                                               "hybridtitan's Llama")


def test_export_of_a_hybrid_is_not_a_llama(tmp_path):
    """--format llama names why a model with mixers cannot be a Llama folder."""
    from hybridtitan.checkpoint import save_model_checkpoint
    from hybridtitan.export_hf import export
    from hybridtitan.hf.convert import ConversionError
    from hybridtitan.models import build_model

    model = build_model(get_flavor("debug_llama_upcycled"), "cpu")
    model.init_weights()
    save_model_checkpoint(model, str(tmp_path / "step-0"))
    with pytest.raises(ConversionError, match=r"--format llama: a Llama folder holds grouped-query attention"):
        export(str(tmp_path / "step-0"), str(tmp_path / "out"), format="llama",
               tokenizer="hybridtitan/assets/tokenizer")

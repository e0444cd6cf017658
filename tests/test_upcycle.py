"""Upcycling a Llama: the linear algebra each initialisation claims, on real Llama folders made by transformers, and
the command line's refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_llama import make_llama

from hybridtitan.models import get_flavor
from hybridtitan.models.rope import apply_rope, plain_inv_freq, rope_cos_sin
from hybridtitan.upcycle import (
    gdn_from_attention,
    low_rank,
    mamba2_from_attention,
    mla_from_attention,
    repeat_heads,
    rope_rows,
)


def attention_weights(gqa, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, KV, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    return {"q_proj.weight": torch.randn(H * d, dim, generator=g),
            "k_proj.weight": torch.randn(KV * d, dim, generator=g),
            "v_proj.weight": torch.randn(KV * d, dim, generator=g),
            "o_proj.weight": torch.randn(dim, H * d, generator=g)}


@pytest.mark.parametrize("rank", [1, 7, 40, 64])
def test_low_rank_error_is_what_the_ranks_say(rank):
    w = torch.randn(96, 64) @ torch.diag(torch.logspace(0, -2, 64)) @ torch.randn(64, 64)
    up, down, kept = low_rank(w, rank, "W")
    measured = (torch.linalg.matrix_norm(w - up @ down) / torch.linalg.matrix_norm(w)).item()
    assert kept.rank == rank and kept.full_rank == 64
    assert measured == pytest.approx(kept.relative_error, abs=1e-4)
    assert (kept.relative_error < 1e-3) == (rank == 64)
    assert f"rank {rank} of 64" in str(kept)


def test_rope_rows_keep_the_llamas_rotation():
    """The MLA's RoPE over the chosen rows turns them as the Llama's RoPE turns them at every position: whole pairs
    whose frequency the MLA's (fewer) rope channels have."""
    d, r, theta = 32, 16, 500000.0
    rope, nope = rope_rows(d, r, 16)
    assert sorted(rope + nope) == list(range(d))
    q = torch.randn(1, 50, 3, d)
    positions = torch.arange(50).unsqueeze(0)
    llama = apply_rope(q, *rope_cos_sin(positions, plain_inv_freq(d, theta)))
    mla = apply_rope(q[..., rope], *rope_cos_sin(positions, plain_inv_freq(r, theta)))
    torch.testing.assert_close(mla, llama[..., rope], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must be even and divide"):
        rope_rows(32, 12, 16)


def test_mla_from_attention_factors_reproduce_the_projections():
    """At full ranks the MLA's factors give back W_Q (each head's rows, RoPE pairs last) and the GQA-expanded W_K
    no-RoPE rows and W_V exactly; at the released ranks, the errors the report gives. The shared RoPE key is the mean
    over key/value heads of W_K's RoPE rows."""
    llama = get_flavor("debug_llama")
    gqa, H, d = llama.gqa, llama.gqa.num_heads, llama.gqa.head_dim
    attn = attention_weights(gqa, llama.dim)
    mla = get_flavor("debug_llama_upcycled").mla
    rope, nope = rope_rows(d, mla.qk_rope_head_dim, mla.qk_nope_head_dim)
    wq = attn["q_proj.weight"].view(H, d, -1)[:, nope + rope].reshape(H * d, -1)
    wk = repeat_heads(attn["k_proj.weight"], gqa.num_kv_heads, d, H // gqa.num_kv_heads).view(H, d, -1)
    wv = repeat_heads(attn["v_proj.weight"], gqa.num_kv_heads, d, H // gqa.num_kv_heads)

    def parts(out):
        kv_rank = out["kv_up_proj.weight"].shape[1]
        kv = (out["kv_up_proj.weight"] @ out["kv_down_proj.weight"][:kv_rank]).view(H, len(nope) + d, -1)
        q = out["q_up_proj.weight"] @ out["q_down_proj.weight"]
        return q, kv[:, : len(nope)], kv[:, len(nope):].reshape(H * d, -1)

    full = dataclasses.replace(mla, q_lora_rank=llama.dim, kv_lora_rank=llama.dim)
    out, kept = mla_from_attention(attn, gqa, full)
    q, k_nope, v = parts(out)
    torch.testing.assert_close(q, wq, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_nope, wk[:, nope], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-4)
    fits = {k.name: k.relative_error for k in kept}
    assert all(fits[name] < 1e-3 for name in ("W_Q", "[W_K; W_V]", "W_K no-RoPE rows", "W_V"))
    rope_rows_of_wk = attn["k_proj.weight"].view(gqa.num_kv_heads, d, -1)[:, rope]
    shared = rope_rows_of_wk.mean(0)
    torch.testing.assert_close(out["kv_down_proj.weight"][llama.dim:], shared)
    shared_err = torch.linalg.vector_norm(rope_rows_of_wk - shared) / torch.linalg.vector_norm(rope_rows_of_wk)
    assert fits["shared RoPE key"] == pytest.approx(shared_err.item(), rel=1e-5) and 0.1 < shared_err < 1.5
    assert torch.equal(out["o_proj.weight"], attn["o_proj.weight"])

    out, kept = mla_from_attention(attn, gqa, mla)  # the flavor's ranks: 64 of 128 (q), 32 of 128 (kv)
    q, k_nope, v = parts(out)
    q_err = torch.linalg.matrix_norm(q - wq) / torch.linalg.matrix_norm(wq)
    assert q_err.item() == pytest.approx(kept[0].relative_error, abs=1e-4) and 0.1 < q_err < 1
    # the kv factors are the best rank-32 approximation of the stacked [W_K; W_V]: its value rows and no-RoPE key rows
    up, down, k = low_rank(torch.cat([wk.reshape(H * d, -1), wv]), mla.kv_lora_rank, "[W_K; W_V]")
    assert k.relative_error == pytest.approx(kept[1].relative_error) and 0.1 < k.relative_error < 1
    torch.testing.assert_close(v, (up @ down)[H * d:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_nope, (up @ down)[: H * d].view(H, d, -1)[:, nope], rtol=1e-4, atol=1e-4)
    # the report's error of each projection as kept: the key's no-RoPE rows and the values
    fits = {k.name: k.relative_error for k in kept}
    k_err = torch.linalg.vector_norm(k_nope - wk[:, nope]) / torch.linalg.vector_norm(wk[:, nope])
    v_err = torch.linalg.matrix_norm(v - wv) / torch.linalg.matrix_norm(wv)
    assert fits["W_K no-RoPE rows"] == pytest.approx(k_err.item(), rel=1e-4) and 0.05 < k_err < 1
    assert fits["W_V"] == pytest.approx(v_err.item(), rel=1e-4) and 0.05 < v_err < 1


def test_mamba2_and_gdn_take_the_attention_projections():
    llama = get_flavor("debug_llama")
    student = get_flavor("debug_llama_upcycled")
    gqa, H, KV, d = llama.gqa, llama.gqa.num_heads, llama.gqa.num_kv_heads, llama.gqa.head_dim
    attn = attention_weights(gqa, llama.dim)
    from hybridtitan.models import build_model

    model = build_model(dataclasses.replace(student, pattern="M-" * 4), "cpu")
    model.init_weights()
    fresh = {k.removeprefix("layers.0.mixer."): v for k, v in model.state_dict().items()
             if k.startswith("layers.0.mixer.")}
    out = mamba2_from_attention(attn, fresh, gqa, student.mamba2, student.dim)
    z, x, b, c, dt = out["in_proj.weight"].split([H * d, KV * d, KV * d, H * d, H])
    assert torch.equal(x, attn["v_proj.weight"]) and torch.equal(b, attn["k_proj.weight"])
    assert torch.equal(c, attn["q_proj.weight"]) and torch.equal(out["out_proj.weight"], attn["o_proj.weight"])
    fresh_z, *_, fresh_dt = fresh["in_proj.weight"].split([H * d, KV * d, KV * d, H * d, H])
    assert torch.equal(z, fresh_z) and torch.equal(dt, fresh_dt)
    for name in ("conv1d.weight", "A_log", "dt_bias", "D", "norm.weight"):
        assert torch.equal(out[name], fresh[name]), name

    model = build_model(dataclasses.replace(student, pattern="M-" * 4, mixer="gdn"), "cpu")
    model.init_weights()
    fresh = {k.removeprefix("layers.0.mixer."): v for k, v in model.state_dict().items()
             if k.startswith("layers.0.mixer.")}
    out = gdn_from_attention(attn, fresh, gqa)
    assert torch.equal(out["q_proj.weight"], attn["q_proj.weight"])
    for name in ("k_proj.weight", "v_proj.weight"):
        expanded = attn[name].view(KV, d, -1).repeat_interleave(H // KV, 0).reshape(H * d, -1)
        assert torch.equal(out[name], expanded), name
    assert torch.equal(out["o_proj.weight"], attn["o_proj.weight"])
    for name in ("a_proj.weight", "b_proj.weight", "g_proj.weight", "q_conv1d.weight", "A_log", "dt_bias"):
        assert torch.equal(out[name], fresh[name]), name


def test_an_mla_of_full_rank_computes_the_attention_it_came_from(tmp_path):
    """A multi-query Llama (one key/value head: the MLA's one shared RoPE key loses nothing) with plain RoPE,
    upcycled with every layer as MLA at full ranks, RoPE on every channel and no YaRN: the same logits as
    transformers' LlamaForCausalLM. Everything but the attention is copied, and the MLA is the attention."""
    from hybridtitan.model_loader import load
    from hybridtitan.upcycle import main

    reference = make_llama(tmp_path / "llama", num_key_value_heads=1, rope_scaling=None)
    main(["--model", str(tmp_path / "llama"), "--attention-layers", "all", "--output", str(tmp_path / "mla"),
          "--q-lora-rank", "128", "--kv-lora-rank", "64", "--qk-nope-head-dim", "0", "--qk-rope-head-dim", "32",
          "--tokenizer", "hybridtitan/assets/tokenizer"])
    model, _, _ = load(str(tmp_path / "mla"))
    assert model.args.pattern == "*-" * 4 and model.args.attention == "mla" and not model.args.mla.latent_norm
    ids = torch.randint(0, 8192, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits.float(), rtol=1e-3, atol=1e-3)


def test_upcycle_command_line(tmp_path, capsys):
    """The report says what each rank kept, the step folder holds the model of the named flavor, and bad input is
    one line with exit code 2, nothing written."""
    from hybridtitan.checkpoint import load_model_args
    from hybridtitan.upcycle import main

    make_llama(tmp_path / "llama")
    main(["--model", str(tmp_path / "llama"), "--mixer", "mamba2", "--attention-layers", "0", "--output",
          str(tmp_path / "run" / "checkpoint" / "step-0"), "--tokenizer", "hybridtitan/assets/tokenizer"])
    out = capsys.readouterr().out
    assert "layer 0: MLA: W_Q rank 64 of 128 keeps" in out and "[W_K; W_V] rank 32 of 128 keeps" in out
    assert "layer 1: Mamba2: x, B, C and out_proj from W_V, W_K, W_Q and W_O" in out
    assert "train it with: --model.flavor debug_llama_upcycled --model.pattern=*-M-M-M-" in out
    assert load_model_args(str(tmp_path / "run" / "checkpoint" / "step-0")) == get_flavor("debug_llama_upcycled")

    def refused(argv, message):
        with pytest.raises(SystemExit) as exc:
            main(["--model", str(tmp_path / "llama"), "--output", str(tmp_path / "new"), *argv])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert message in err, err
        assert not (tmp_path / "new").exists()

    refused(["--attention-layers", "0,4"], "--attention-layers: layer 4 is out of range: the Llama has 4 layers (0-3)")
    refused(["--attention-layers", "first"], "--attention-layers must be comma-separated layer indices")
    refused(["--mixer", "kda"], "--mixer 'kda': upcycling initialises mamba2 or gdn from attention")
    refused(["--qk-rope-head-dim", "12"], "qk_rope_head_dim 12 must be even and divide the attention's head_dim 32")
    refused(["--attention-layers", "0", "--q-lora-rank", "4096"], "W_Q: rank 4096 exceeds the 128 singular values")
    hybrid = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(hybrid), "--output", str(tmp_path / "new")])
    assert "is not a Llama" in capsys.readouterr().err and exc.value.code == 2
    with pytest.raises(SystemExit):  # an existing folder is not overwritten
        main(["--model", str(tmp_path / "llama"), "--output", str(tmp_path / "run" / "checkpoint" / "step-0")])
    assert "output folder exists" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "checkpoint" / "step-0" / "model_args.json").read_text())["mixer"] == "mamba2"


def test_students_assembled_and_layers_selected(tmp_path, capsys):
    """Zebra-Llama's second stage: the hybrid assembled from an all-MLA and an all-mixer student takes each chosen
    sublayer (with the MLP after it) from the one that has it, tensor for tensor, whatever the YaRN setting; select
    ranks every layer by the KL to the teacher with that layer as MLA and prints a pattern of --count of them."""
    from hybridtitan.model_loader import read_model
    from hybridtitan.upcycle import main

    make_llama(tmp_path / "llama")
    common = ["--model", str(tmp_path / "llama"), "--tokenizer", "hybridtitan/assets/tokenizer"]
    main([*common, "--attention-layers", "all", "--output", str(tmp_path / "mla")])
    main([*common, "--mixer", "gdn", "--attention-layers", "none", "--output", str(tmp_path / "gdn"), "--seed", "3"])
    main([*common, "--mixer", "gdn", "--attention-layers", "1,3", "--attention-from", str(tmp_path / "mla"),
          "--mixers-from", str(tmp_path / "gdn"), "--rope-scaling-factor", "4", "--output", str(tmp_path / "both")])
    out = capsys.readouterr().out
    assert "layer 1: MLA from the trained student" in out and "layer 0: gdn from the trained student" in out
    assert "--model.mla.rope_scaling_factor 4.0" in out
    args, both, _ = read_model(str(tmp_path / "both"))
    _, mla, _ = read_model(str(tmp_path / "mla"))
    _, gdn, _ = read_model(str(tmp_path / "gdn"))
    assert args.pattern == "M-*-M-*-" and args.mla.rope_scaling_factor == 4.0
    for key, value in both.items():
        if key.startswith("layers."):
            j = int(key.split(".")[1])
            source = mla if args.pattern[j - j % 2] == "*" else gdn
            assert torch.equal(value, source[key]), key
    # a long-context stage chained from this one (HyLo's 64K from its 8K): the hybrid is both students, taken
    # whole, with another YaRN extension
    main([*common, "--mixer", "gdn", "--attention-layers", "1,3", "--attention-from", str(tmp_path / "both"),
          "--mixers-from", str(tmp_path / "both"), "--rope-scaling-factor", "32", "--original-max-position-embeddings",
          "2048", "--output", str(tmp_path / "long")])
    long_args, long, _ = read_model(str(tmp_path / "long"))
    assert (long_args.mla.rope_scaling_factor, long_args.mla.original_max_position_embeddings) == (32.0, 2048)
    assert dataclasses.replace(long_args, mla=args.mla) == args
    assert set(long) == set(both) and all(torch.equal(long[k], both[k]) for k in both)
    with pytest.raises(SystemExit):  # a mixer student of another mixer holds other tensors
        main([*common, "--mixer", "mamba2", "--attention-layers", "1", "--mixers-from", str(tmp_path / "gdn"),
              "--output", str(tmp_path / "wrong")])
    assert "is not a student of this shape" in capsys.readouterr().err and not (tmp_path / "wrong").exists()

    main(["select", "--teacher", str(tmp_path / "llama"), "--student", str(tmp_path / "gdn"), "--attention-from",
          str(tmp_path / "mla"), "--data", "hybridtitan/assets/corpus/validation.jsonl", "--tokenizer",
          "hybridtitan/assets/tokenizer", "--count", "2", "--batches", "2", "--batch-size", "2", "--seq-len", "64",
          "--device", "cpu"])
    out = capsys.readouterr().out
    kl = {int(line.split()[1]): float(line.split("KL ")[1].split()[0]) for line in out.splitlines()
          if line.startswith("layer ") and " as MLA: KL " in line}
    assert sorted(kl) == [0, 1, 2, 3]
    ranked = [int(i) for i in out.split("as MLA first): ")[1].splitlines()[0].split(", ")]
    assert ranked == sorted(kl, key=kl.get)
    chosen = sorted(ranked[:2])
    assert f"chosen: --attention-layers {chosen[0]},{chosen[1]}" in out
    assert "".join("*-" if i in chosen else "M-" for i in range(4)) in out


def test_a_student_of_no_flavor_trains_from_its_checkpoint_with_flavor_checkpoint(tmp_path, capsys):
    """An upcycled student of sizes no flavor has (an MLP of width 320): upcycle's last line
    names model.flavor checkpoint; the trainer reads the model from checkpoint.initial_load_path and trains on; a
    recipe whose own [model] keys disagree with the checkpoint, or that names no checkpoint, is one line."""
    from helpers import QUICK, RECIPE, run_train
    from hybridtitan.checkpoint import load_model_args
    from hybridtitan.config_manager import model_args, parse_config
    from hybridtitan.errors import ConfigError
    from hybridtitan.upcycle import main

    make_llama(tmp_path / "llama", intermediate_size=320)  # an MLP width no flavor has
    step = tmp_path / "up" / "step-0"
    main(["--model", str(tmp_path / "llama"), "--mixer", "gdn", "--attention-layers", "0,2", "--output", str(step)])
    out = capsys.readouterr().out
    assert f"train it with: --model.flavor checkpoint --checkpoint.initial_load_path {step}" in out
    saved = load_model_args(str(step))
    argv = ["--job.config_file", RECIPE, "--model.flavor", "checkpoint", "--checkpoint.initial_load_path", str(step)]
    assert model_args(parse_config(argv)) == saved
    assert model_args(parse_config([*argv, "--model.dim", str(saved.dim), "--model.pattern", saved.pattern])) == saved
    with pytest.raises(ConfigError, match=rf"model.dim = {saved.dim * 2}, but DCP checkpoint .* holds a model with "
                                          rf"{saved.dim}: leave it out"):
        model_args(parse_config([*argv, "--model.dim", str(saved.dim * 2)]))
    with pytest.raises(ConfigError, match="model.gdn.num_heads = 7, but"):
        model_args(parse_config([*argv, "--model.gdn.num_heads", "7"]))
    with pytest.raises(ConfigError, match="give checkpoint.initial_load_path"):
        model_args(parse_config(["--job.config_file", RECIPE, "--model.flavor", "checkpoint"]))

    dump = tmp_path / "run"
    run_train(dump, *QUICK, "--model.flavor", "checkpoint", "--checkpoint.initial_load_path", str(step),
              "--training.steps", "2", "--checkpoint.interval", "2", nproc=1)
    assert load_model_args(str(dump / "checkpoint" / "step-2")) == saved

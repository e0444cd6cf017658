"""upcycle --init: each initialisation choice that differs from the papers' code changes exactly the tensors it
says, and nothing else; run as a script, the KL to the teacher at step 0 of a debug upcycle each way:

    python tests/test_upcycle_init.py [--teacher CHECKPOINT] [--seeds 3]

(without --teacher it first trains debug_llama for 300 steps on the shipped corpus in one thread, about a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_llama import make_llama  # noqa: E402

from hybridtitan.models import get_flavor  # noqa: E402
from hybridtitan.models.args import GDNArgs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "hybridtitan", "assets", "tokenizer")


def upcycled(tmp_path, name, *argv):
    from hybridtitan.model_loader import read_model
    from hybridtitan.upcycle import main

    main(["--model", str(tmp_path / "llama"), "--output", str(tmp_path / name), "--tokenizer", TOKENIZER, *argv])
    return read_model(str(tmp_path / name))[1]


def changed(a, b):
    assert set(a) == set(b)
    return {k for k in a if not torch.equal(a[k], b[k])}


def test_each_init_choice_changes_exactly_its_tensors(tmp_path, capsys):
    """*-M-M-M- from a Llama of transformers, seed 0 each way: mamba2_conv changes each Mamba2's conv1d weight and
    bias (to nn.Conv1d's uniform bound, 1 / sqrt(width)), mamba2_z_dt in_proj's z and dt rows alone (nn.Linear's
    bound 1 / sqrt(dim)), mla_rope the MLA's query up-projection (each head's first no-RoPE and last RoPE rows of
    W_Q), its key/value up-projection's key rows and the shared RoPE key (not the latent); amd all three;
    gdn_paired nothing where keys and values have one size. Bad --init is one line, exit code 2."""
    from hybridtitan.upcycle import rope_rows

    make_llama(tmp_path / "llama")
    common = ["--mixer", "mamba2", "--attention-layers", "0"]
    base = upcycled(tmp_path, "base", *common)
    student = get_flavor("debug_llama_upcycled")
    mixers = [f"layers.{2 * i}.mixer" for i in (1, 2, 3)]
    H, d, dim = student.mla.num_heads, get_flavor("debug_llama").gqa.head_dim, student.dim

    conv = upcycled(tmp_path, "conv", *common, "--init", "mamba2_conv")
    assert changed(base, conv) == {f"{m}.conv1d.{p}" for m in mixers for p in ("weight", "bias")}
    width = conv[f"{mixers[0]}.conv1d.weight"].shape[-1]
    for m in mixers:
        for p in ("weight", "bias"):
            t = conv[f"{m}.conv1d.{p}"]
            assert t.abs().max() <= width ** -0.5 and t.std() > 0.5 * width ** -0.5 / 3 ** 0.5, (m, p)

    zdt = upcycled(tmp_path, "zdt", *common, "--init", "mamba2_z_dt")
    assert changed(base, zdt) == {f"{m}.in_proj.weight" for m in mixers}
    inner, xbc = student.dim, 2 * student.mamba2.xb_heads * d + student.dim  # z rows; x, B and C rows
    for m in mixers:
        new, old = zdt[f"{m}.in_proj.weight"], base[f"{m}.in_proj.weight"]
        assert torch.equal(new[inner: inner + xbc], old[inner: inner + xbc])  # x, B, C: the attention's
        for rows in (slice(0, inner), slice(inner + xbc, None)):  # z, dt
            assert (new[rows] != old[rows]).all()
            assert new[rows].abs().max() <= dim ** -0.5 and new[rows].std() > 0.5 * dim ** -0.5 / 3 ** 0.5

    rope = upcycled(tmp_path, "rope", *common, "--init", "mla_rope")
    attn = "layers.0.attn"
    assert changed(base, rope) == {f"{attn}.{p}.weight" for p in ("q_up_proj", "kv_up_proj", "kv_down_proj")}
    mla = student.mla
    kv = mla.kv_lora_rank
    assert torch.equal(rope[f"{attn}.kv_down_proj.weight"][:kv], base[f"{attn}.kv_down_proj.weight"][:kv])
    n, r = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    up = rope[f"{attn}.kv_up_proj.weight"].view(H, n + d, -1)
    assert torch.equal(up[:, n:], base[f"{attn}.kv_up_proj.weight"].view(H, n + d, -1)[:, n:])  # values: the same
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "llama" / "model.safetensors"))
    u, s, vh = torch.linalg.svd(hf["model.layers.0.self_attn.q_proj.weight"].float(), full_matrices=False)
    approx = ((u[:, : mla.q_lora_rank] * s[: mla.q_lora_rank]) @ vh[: mla.q_lora_rank]).view(H, d, -1)
    q = (rope[f"{attn}.q_up_proj.weight"] @ rope[f"{attn}.q_down_proj.weight"]).view(H, n + r, -1)
    torch.testing.assert_close(q, approx[:, list(range(n)) + list(range(d - r, d))], rtol=1e-4, atol=1e-5)
    assert rope_rows(d, r, n, last=True) == (list(range(d - r, d)), list(range(n)))
    shared = hf["model.layers.0.self_attn.k_proj.weight"].float().view(-1, d, dim)[:, d - r:].mean(0)
    torch.testing.assert_close(rope[f"{attn}.kv_down_proj.weight"][kv:], shared)

    amd = upcycled(tmp_path, "amd", *common, "--init", "amd")
    assert changed(base, amd) == changed(base, conv) | changed(base, zdt) | changed(base, rope)
    out = capsys.readouterr().out
    assert "initialised the other way (--init): Mamba2's convolution weight and bias" in out

    gdn = upcycled(tmp_path, "gdn", "--mixer", "gdn", "--attention-layers", "0")
    assert not changed(gdn, upcycled(tmp_path, "gdn_paired", "--mixer", "gdn", "--attention-layers", "0",
                                     "--init", "gdn_paired"))

    from hybridtitan.upcycle import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path / "llama"), "--output", str(tmp_path / "new"), "--init", "amd,mla_pairs"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "new").exists()
    assert "--init 'amd,mla_pairs': give hybridtitan, amd or comma-separated choices of mamba2_conv" in err


def test_gdn_paired_gives_each_head_the_values_of_its_keys():
    """A GDN of HyLo's proportions (2 heads of keys 64 = 2 Llama heads, values 128 = 4): as is, head 0 takes the
    values of Llama heads 0-3 and head 1 none (fresh); paired, head h takes the values and W_O columns of the Llama
    heads of its keys (2h, 2h + 1) in its first 64 value rows, the other 64 fresh; q, k and the rest the same."""
    from hybridtitan.errors import ConversionError
    from hybridtitan.upcycle import gdn_from_attention, repeat_heads

    llama = get_flavor("debug_llama")
    gqa, H, KV, d = llama.gqa, llama.gqa.num_heads, llama.gqa.num_kv_heads, llama.gqa.head_dim
    g = torch.Generator().manual_seed(0)
    attn = {"q_proj.weight": torch.randn(H * d, llama.dim, generator=g),
            "k_proj.weight": torch.randn(KV * d, llama.dim, generator=g),
            "v_proj.weight": torch.randn(KV * d, llama.dim, generator=g),
            "o_proj.weight": torch.randn(llama.dim, H * d, generator=g)}
    shape = GDNArgs(num_heads=2, num_v_heads=2, head_dim=64, head_v_dim=128)
    fresh = {"q_proj.weight": torch.randn(128, llama.dim, generator=g),
             "k_proj.weight": torch.randn(128, llama.dim, generator=g),
             "v_proj.weight": torch.randn(256, llama.dim, generator=g),
             "o_proj.weight": torch.randn(llama.dim, 256, generator=g), "A_log": torch.randn(2, generator=g)}
    as_is, paired = gdn_from_attention(attn, fresh, gqa), gdn_from_attention(attn, fresh, gqa, shape)
    v = repeat_heads(attn["v_proj.weight"], KV, d, H // KV)
    assert changed(as_is, paired) == {"v_proj.weight", "o_proj.weight"}
    assert torch.equal(as_is["v_proj.weight"][:128], v)
    assert torch.equal(as_is["v_proj.weight"][128:], fresh["v_proj.weight"][128:])
    for h in range(2):
        assert torch.equal(paired["v_proj.weight"][128 * h: 128 * h + 64], v[64 * h: 64 * h + 64])
        assert torch.equal(paired["o_proj.weight"][:, 128 * h: 128 * h + 64],
                           attn["o_proj.weight"][:, 64 * h: 64 * h + 64])
        rest = slice(128 * h + 64, 128 * h + 128)
        assert torch.equal(paired["v_proj.weight"][rest], fresh["v_proj.weight"][rest])
        assert torch.equal(paired["o_proj.weight"][:, rest], fresh["o_proj.weight"][:, rest])
    with pytest.raises(ConversionError, match="needs num_v_heads = num_heads"):
        gdn_from_attention(attn, fresh, gqa, dataclasses.replace(shape, num_v_heads=4))


# ------------------------------------------------------------------------------------------------ the measurement


def text_batches(vocab_size, batch=4, seq_len=256):
    """One fixed batch of the shipped validation corpus, tokenized by the shipped tokenizer: documents joined by
    EOS, cut into rows; labels the next tokens."""
    import json

    from hybridtitan.data import build_tokenizer

    tok = build_tokenizer(TOKENIZER)
    ids = []
    with open(os.path.join(ROOT, "hybridtitan", "assets", "corpus", "validation.jsonl")) as f:
        for line in f:
            ids += tok.encode(json.loads(line)["text"], add_special_tokens=False) + [tok.eos_token_id]
            if len(ids) > batch * (seq_len + 1):
                break
    rows = torch.tensor(ids[: batch * (seq_len + 1)]).view(batch, seq_len + 1)
    assert rows.max() < vocab_size
    return [{"input_ids": rows[:, :-1], "labels": rows[:, 1:]}]


def measure(teacher_path: str, seeds: int) -> list[tuple[str, str, list[float], list[float]]]:
    """(student, choice, KLs as is per seed, KLs the other way per seed), each the mean KL(teacher || student) per
    token of upcycle select's kl_to_teacher (distill's linear_kl_div), at step 0."""
    from hybridtitan.model_loader import read_model
    from hybridtitan.models import build_model
    from hybridtitan.upcycle import kl_to_teacher, parse_init, student_args, upcycled_model

    llama, llama_state, _ = read_model(teacher_path)
    teacher = build_model(llama, "cpu")
    teacher.load_state_dict(llama_state)
    teacher.eval()
    batches = text_batches(llama.vocab_size)
    n = llama.n_layers // 2
    # a GDN of HyLo's proportions (its keys 2 heads wide, its values 4; HyLo's 1B: 4 and 8)
    hylo_like = GDNArgs(num_heads=2, num_v_heads=2, head_dim=2 * llama.gqa.head_dim, head_v_dim=4 * llama.gqa.head_dim)
    cases = [("*-M-M-M- (Mamba2)", "mamba2", [0], None, "mamba2_conv"),
             ("*-M-M-M- (Mamba2)", "mamba2", [0], None, "mamba2_z_dt"),
             ("*-*-*-*- (MLA)", "mamba2", list(range(n)), None, "mla_rope"),
             ("*-M-M-M- (Mamba2)", "mamba2", [0], None, "amd"),
             ("M-M-M-M- (GDN, HyLo's proportions)", "gdn", [], hylo_like, "gdn_paired")]
    rows = []
    for label, mixer, layers, gdn, choice in cases:
        args = student_args(llama, layers, mixer)
        if gdn is not None:
            args = dataclasses.replace(args, gdn=gdn)
        kls = {}
        for init in ("hybridtitan", choice):
            kls[init] = []
            for seed in range(seeds):
                student, _ = upcycled_model(llama, llama_state, args, seed, parse_init(init))
                kls[init].append(kl_to_teacher(student.eval(), teacher, batches))
        rows.append((label, choice, kls["hybridtitan"], kls[choice]))
    return rows


def train_teacher(folder: str) -> str:
    subprocess.run([sys.executable, "-m", "hybridtitan.train", "--job.config_file",
                    os.path.join(ROOT, "train_configs", "debug_hybrid.toml"), "--job.dump_folder", folder,
                    "--model.flavor", "debug_llama", "--training.steps", "300", "--checkpoint.interval", "300",
                    "--training.seq_len", "128", "--training.local_batch_size", "4", "--training.global_batch_size",
                    "4", "--metrics.log_freq", "100", "--metrics.enable_tensorboard", "false",
                    "--validation.enable", "false"], check=True, cwd=ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))  # one thread: the same teacher on any machine
    return os.path.join(folder, "checkpoint", "step-300")


def main() -> None:
    p = argparse.ArgumentParser(description="the step-0 KL to the teacher of each --init choice, both ways")
    p.add_argument("--teacher", default=None, help="a Llama (default: debug_llama trained here for 300 steps)")
    p.add_argument("--seeds", type=int, default=3, help="seeds of the fresh parameters, each way")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        teacher = a.teacher or train_teacher(tmp)
        rows = measure(teacher, a.seeds)

    def fmt(kls):
        mean = sum(kls) / len(kls)
        return f"{mean:.4f} ({min(kls):.4f}-{max(kls):.4f})"

    print(f"KL(teacher || student) per token at step 0, {a.seeds} seeds: mean (min-max)")
    print("| student | --init | hybridtitan's | the other way |")
    print("|---|---|---|---|")
    for label, choice, ours, theirs in rows:
        print(f"| {label} | `{choice}` | {fmt(ours)} | {fmt(theirs)} |")


if __name__ == "__main__":
    main()

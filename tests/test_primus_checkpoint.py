"""Importing a Primus (Megatron-LM) checkpoint (hybridtitan.primus_checkpoint, through import_hf): checkpoints
written here from debug hybrids of each mixer, in Megatron's names and layouts (``write_primus``: the inverse of the
import, stated independently of it), in the torch and fsdp_dtensor formats and split over two tensor-parallel
ranks, come back with the same logits; training resumes from the import; bad checkpoints are refused in one line,
exit 2, nothing written."""

from __future__ import annotations

import argparse
import enum
import io
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import ROOT, run_train
from hybridtitan.checkpoint import load_model
from hybridtitan.models import GDNArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs, build_model

TOKENIZER = str(ROOT / "hybridtitan" / "assets" / "tokenizer")
MLA = MLAArgs(num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
              rope_theta=10000.0)
BASE = dict(vocab_size=8192, dim=64, ffn_dim=128, norm_eps=1e-5)
CASES = {
    "mamba2_mla": ModelArgs(**BASE, n_layers=6, pattern="*-M-M-", mixer="mamba2", mla=MLA,
                            mamba2=Mamba2Args(d_state=16, head_dim=16, n_groups=2, expand=2)),
    "gdn_mla": ModelArgs(**BASE, n_layers=6, pattern="M-*-M-", mixer="gdn", mla=MLA,
                         gdn=GDNArgs(num_heads=2, num_v_heads=4, head_dim=16, head_v_dim=16)),
    "gdn": ModelArgs(**BASE, n_layers=4, pattern="M-M-", mixer="gdn",
                     gdn=GDNArgs(num_heads=2, num_v_heads=4, head_dim=16, head_v_dim=16)),
    "kda": ModelArgs(**BASE, n_layers=4, pattern="M-M-", mixer="kda", kda=KDAArgs(num_heads=2, head_dim=16,
                                                                                  head_v_dim=16)),
    # queries projected directly (q_lora_rank 0: linear_q_proj)
    "kda_mla": ModelArgs(**BASE, n_layers=6, pattern="*-M-M-", mixer="kda", kda=KDAArgs(num_heads=2, head_dim=16,
                                                                                        head_v_dim=16),
                         mla=MLAArgs(num_heads=4, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
                                     qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0)),
}


def make_model(name: str, tied: bool, seed: int = 0):
    """A debug hybrid with every weight random (norms and gates included, so that a weight put in the wrong place
    changes the logits)."""
    torch.manual_seed(seed)
    model = build_model(CASES[name].replace(tie_embeddings=tied), "cpu")
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# ------------------------------------------------------------------------------------------ Megatron's side


class ModelType(enum.Enum):  # pickled under Megatron's name (fake_megatron), as Megatron's args hold it
    encoder_or_decoder = 1


@contextmanager
def fake_megatron():
    """ModelType importable as megatron.core.enums.ModelType while a checkpoint is pickled (Megatron itself is not
    installed here, nor needed to read the checkpoint)."""
    module = types.ModuleType("megatron.core.enums")
    module.ModelType = ModelType
    saved = ModelType.__module__
    ModelType.__module__ = "megatron.core.enums"
    mods = {"megatron": types.ModuleType("megatron"), "megatron.core": types.ModuleType("megatron.core"),
            "megatron.core.enums": module}
    sys.modules.update(mods)
    try:
        yield
    finally:
        ModelType.__module__ = saved
        for name in mods:
            sys.modules.pop(name, None)


def megatron_args(a: ModelArgs, tp: int = 1, **changes) -> argparse.Namespace:
    """Megatron's args for the model, under Megatron's (and Primus's) names."""
    args = dict(num_layers=a.n_layers, hidden_size=a.dim, ffn_hidden_size=a.ffn_dim, padded_vocab_size=a.vocab_size,
                hybrid_override_pattern=a.pattern, hybrid_attention_ratio=0.0,
                untie_embeddings_and_output_weights=not a.tie_embeddings, layernorm_epsilon=a.norm_eps,
                norm_epsilon=1e-6, init_method_std=a.init_std, normalization="RMSNorm", swiglu=True,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, params_dtype=torch.bfloat16,
                model_type=ModelType.encoder_or_decoder, is_hybrid_model=True, seq_length=128,
                data_path=["/data/fineweb"], tokenizer_type="HuggingFaceTokenizer", tokenizer_model=TOKENIZER,
                multi_latent_attention="attention" in a.kinds, num_attention_heads=a.mla.num_heads,
                q_lora_rank=a.mla.q_lora_rank or None, kv_lora_rank=a.mla.kv_lora_rank,
                qk_head_dim=a.mla.qk_nope_head_dim, qk_pos_emb_head_dim=a.mla.qk_rope_head_dim,
                v_head_dim=a.mla.v_head_dim, rotary_base=a.mla.rope_theta, rotary_scaling_factor=1.0, mscale=1.0,
                mscale_all_dim=0.0, rope_type="yarn")
    if a.mixer == "mamba2":
        m = a.mamba2
        args.update(mamba_state_dim=m.d_state, mamba_head_dim=m.head_dim, mamba_num_groups=m.n_groups,
                    mamba_num_heads=None)
    else:
        m = getattr(a, a.mixer)
        args.update(linear_num_key_heads=m.num_heads, linear_num_value_heads=getattr(m, "num_v_heads", m.num_heads),
                    linear_key_head_dim=m.head_dim, linear_value_head_dim=m.head_v_dim,
                    linear_conv_kernel_dim=m.conv_size)
    args.update(changes)
    return argparse.Namespace(**args)


def interleave_rope(w: torch.Tensor, rope: int) -> torch.Tensor:
    """Megatron's order of the last ``rope`` rows: our rotate-half channels i and i + rope/2 become the adjacent
    pair 2i, 2i + 1 that Megatron's MLA rotates together."""
    head, tail = w[..., :-rope, :], w[..., -rope:, :]
    out = torch.empty_like(tail)
    out[..., 0::2, :], out[..., 1::2, :] = tail[..., : rope // 2, :], tail[..., rope // 2:, :]
    return torch.cat([head, out], dim=-2)


def twice_normed(down: torch.Tensor, norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """Primus's TE layout of one latent that hybridtitan normalises once (down projection rows, RMSNorm weight):
    the down projection, q_layernorm's weight a and the fused norm's weight b that Megatron's two norms in a row
    compute the same from. Stated from Megatron's side; checked by megatron_latent (test_twice_normed_latent)."""
    a = (0.5 + torch.rand(norm.shape, generator=torch.Generator().manual_seed(3))) * torch.tensor([1.0, -1.0]).repeat(
        norm.numel() // 2)
    root = (a.square() + eps).sqrt()
    return down * (eps ** 0.5 / root)[:, None], a, norm * root / a


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def megatron_latent(h, down, first, fused, eps):
    """What Megatron's MLA computes of a latent under Primus's TE specs: q_layernorm (a TENorm), then the norm fused
    into linear_q_up_proj (TELayerNormColumnParallelLinear); likewise kv_layernorm and linear_kv_up_proj's."""
    return rms(rms(h @ down.T, first, eps), fused, eps)


LAYOUTS = ("te", "te_fused", "no_te")


def megatron_state(model, layout: str = "te") -> dict[str, torch.Tensor]:
    """The model's weights under Megatron's names and layouts of Primus's specs: "te" (its TE hybrid specs at
    fd1eeabb: pre-norms fused into the projection after them as Transformer Engine's layer_norm_weight, each MLA
    latent normalised twice, by q_layernorm / kv_layernorm and by the norm fused into the up projection),
    "te_fused" (its earlier TE spec's MLA: the fused norm alone) or "no_te" (separate norms)."""
    assert layout in LAYOUTS
    te = layout != "no_te"
    a, sd = model.args, model.state_dict()
    out = {"embedding.word_embeddings.weight": sd["embeddings.weight"], "decoder.final_norm.weight": sd["norm.weight"]}
    if not a.tie_embeddings:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i, kind in enumerate(a.kinds):
        p, q = f"decoder.layers.{i}.", f"layers.{i}."
        norm = sd[q + "norm.weight"]
        if kind == "mlp":
            out[p + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")] = norm
            out[p + "mlp.linear_fc1.weight"] = torch.cat([sd[q + "mlp.gate_proj.weight"], sd[q + "mlp.up_proj.weight"]])
            out[p + "mlp.linear_fc2.weight"] = sd[q + "mlp.down_proj.weight"]
            if te:
                out[p + "mlp.linear_fc1._extra_state"] = io.BytesIO(b"te fp8 meta")
        elif kind == "attention":
            m, s, x = a.mla, p + "self_attention.", q + "attn."
            H, qk = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
            out[p + "input_layernorm.weight"] = norm
            kv_down = interleave_rope(sd[x + "kv_down_proj.weight"], m.qk_rope_head_dim)
            if m.q_lora_rank:
                if layout == "te":
                    (out[s + "linear_q_down_proj.weight"], out[s + "q_layernorm.weight"],
                     out[s + "linear_q_up_proj.layer_norm_weight"]) = twice_normed(
                        sd[x + "q_down_proj.weight"], sd[x + "q_norm.weight"], a.norm_eps)
                else:
                    out[s + "linear_q_down_proj.weight"] = sd[x + "q_down_proj.weight"]
                    q_norm = "linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight"
                    out[s + q_norm] = sd[x + "q_norm.weight"]
                out[s + "linear_q_up_proj.weight"] = interleave_rope(
                    sd[x + "q_up_proj.weight"].view(H, qk, -1), m.qk_rope_head_dim).reshape(H * qk, -1)
            else:
                out[s + "linear_q_proj.weight"] = interleave_rope(
                    sd[x + "q_proj.weight"].view(H, qk, -1), m.qk_rope_head_dim).reshape(H * qk, -1)
            if layout == "te":
                r = m.kv_lora_rank
                latent, out[s + "kv_layernorm.weight"], out[s + "linear_kv_up_proj.layer_norm_weight"] = twice_normed(
                    kv_down[:r], sd[x + "kv_norm.weight"], a.norm_eps)
                kv_down = torch.cat([latent, kv_down[r:]])
            else:
                kv_norm = "linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"
                out[s + kv_norm] = sd[x + "kv_norm.weight"]
            out[s + "linear_kv_down_proj.weight"] = kv_down
            out[s + "linear_kv_up_proj.weight"] = sd[x + "kv_up_proj.weight"]
            out[s + "linear_proj.weight"] = sd[x + "o_proj.weight"]
            out[s + "core_attention._extra_state"] = None
            if te:
                out[s + "linear_q_up_proj._extra_state"] = io.BytesIO(b"te fp8 meta")
        else:
            x, mx = q + "mixer.", p + "mixer."
            if a.mixer == "mamba2":  # Primus's Mamba2 sublayers normalise only through TE's fused norm
                out[mx + "in_proj.layer_norm_weight"] = norm
                for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight",
                             "out_proj.weight"):
                    out[mx + name] = sd[x + name]
                continue
            out[mx + "in_proj.layer_norm_weight" if te else p + "norm.weight"] = norm
            out[mx + "conv1d.weight"] = torch.cat([sd[x + f"{c}_conv1d.weight"] for c in "qkv"])
            out[mx + "dt_bias"] = sd[x + "dt_bias"]
            out[mx + "out_norm.weight"] = sd[x + "o_norm.weight"]
            out[mx + "out_proj.weight"] = sd[x + "o_proj.weight"]
            if a.mixer == "gdn":
                out[mx + "in_proj.weight"] = torch.cat([sd[x + f"{c}_proj.weight"] for c in "qkvgba"])
                out[mx + "A_log"] = sd[x + "A_log"]
            else:
                out[mx + "in_proj.weight"] = torch.cat([sd[x + n] for n in ("q_proj.weight", "k_proj.weight",
                                                                            "v_proj.weight", "f_proj.0.weight",
                                                                            "g_proj.0.weight", "b_proj.weight")])
                out[mx + "f_b_proj.weight"] = sd[x + "f_proj.1.weight"]
                out[mx + "g_b_proj.weight"] = sd[x + "g_proj.1.weight"]
                out[mx + "g_b_proj.bias"] = sd[x + "g_proj.1.bias"]
                out[mx + "A_log"] = sd[x + "A_log"].view(1, 1, -1, 1)
                if te:
                    out[mx + "gate_norm.weight"] = torch.ones(a.dim)  # built by Primus, never applied
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def tp_split(state: dict, a: ModelArgs, tp: int) -> list[dict]:
    """Each tensor-parallel rank's share, as Megatron holds it: column-parallel weights split along their rows (each
    fused block split on its own), row-parallel ones along their columns, the rest replicated."""
    blocks = {}
    if a.mixer == "mamba2":
        m = a.mamba2
        d_inner, gn = a.dim * m.expand, m.n_groups * m.d_state
        blocks = {"mixer.in_proj.weight": [d_inner, d_inner, gn, gn, d_inner // m.head_dim],
                  "mixer.conv1d.weight": [d_inner, gn, gn], "mixer.conv1d.bias": [d_inner, gn, gn]}
    elif a.mixer == "gdn":
        g = a.gdn
        qk, v = g.num_heads * g.head_dim, g.num_v_heads * g.head_v_dim
        blocks = {"mixer.in_proj.weight": [qk, qk, v, v, g.num_v_heads, g.num_v_heads],
                  "mixer.conv1d.weight": [qk, qk, v]}
    blocks["mlp.linear_fc1.weight"] = [a.ffn_dim, a.ffn_dim]
    rows = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_q_up_proj.weight",
            "linear_q_proj.weight", "linear_kv_up_proj.weight", "mixer.A_log", "mixer.D", "mixer.dt_bias",
            "mixer.norm.weight")
    cols = ("linear_proj.weight", "mixer.out_proj.weight", "mlp.linear_fc2.weight")
    ranks = [{} for _ in range(tp)]
    for name, t in state.items():
        rule = next((b for k, b in blocks.items() if name.endswith(k)), None)
        dim = 0 if rule or name.endswith(rows) else 1 if name.endswith(cols) else None
        for r in range(tp):
            if dim is None:
                ranks[r][name] = t
                continue
            parts = t.split(rule or [t.shape[dim]], dim=dim)
            ranks[r][name] = torch.cat([c.chunk(tp, dim=dim)[r] for c in parts], dim=dim).clone()
    return ranks


def pp_split(state: dict, a: ModelArgs, pp: int) -> list[dict]:
    """Each pipeline stage's share, as Megatron's torch format holds it: num_layers / pp consecutive layers numbered
    from 0 on each stage (Primus's HybridStack split), the embedding on the first stage, the final norm and the
    output layer on the last (tied embeddings: there a copy of the embedding, as Megatron keeps one)."""
    per = a.n_layers // pp
    stages = [{} for _ in range(pp)]
    for name, t in state.items():
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            stages[int(i) // per][f"decoder.layers.{int(i) % per}.{rest}"] = t
        else:
            stages[0 if name.startswith("embedding.") else -1][name] = t
    if a.tie_embeddings:
        stages[-1]["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    return stages


def write_primus(model, run: Path, iteration: int = 20, fmt: str = "torch", tp: int = 1, layout: str = "te",
                 args: argparse.Namespace | None = None, state: dict | None = None, latest: bool = True,
                 pp: int = 1) -> Path:
    """A Primus checkpoint of ``model`` in ``run`` (a run's checkpoint folder): iter_N in the torch format
    (mp_rank_XX/model_optim_rng.pt per tensor-parallel rank, mp_rank_XX_YYY with pipeline stages) or fsdp_dtensor
    (DCP, model.module., fc1 halves); beside it latest_checkpointed_iteration.txt. Returns the iter_N folder."""
    a = model.args
    args = args if args is not None else megatron_args(a, tp, pipeline_model_parallel_size=pp)
    state = state if state is not None else megatron_state(model, layout)
    folder = run / f"iter_{iteration:07d}"
    with fake_megatron():
        if fmt == "torch":
            for (stage, part), r in ((sp, r) for sp in enumerate(pp_split(state, a, pp) if pp > 1 else [state])
                                     for r in range(tp)):
                shard = tp_split(part, a, tp)[r] if tp > 1 else part
                rank = f"mp_rank_{r:02d}" + (f"_{stage:03d}" if pp > 1 else "")
                (folder / rank).mkdir(parents=True)
                ckpt = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": shard,
                        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-4}]},
                        "opt_param_scheduler": {"num_steps": iteration * 8},
                        "rng_state": [{"random_rng_state": __import__("random").getstate(),
                                       "np_rng_state": np.random.get_state(),
                                       "torch_rng_state": torch.get_rng_state()}]}
                if args is False:
                    del ckpt["args"]
                torch.save(ckpt, folder / rank / "model_optim_rng.pt")
        else:
            flat = {}
            for k, v in state.items():
                if not isinstance(v, torch.Tensor):
                    continue
                if k.endswith("mlp.linear_fc1.weight"):
                    w, v2 = v.chunk(2)
                    flat["model.module." + k[: -len(".weight")] + ".weight_w"] = w.clone()
                    flat["model.module." + k[: -len(".weight")] + ".weight_v"] = v2.clone()
                else:
                    flat["model.module." + k] = v
            flat["optimizer.state.exp_avg.decoder.final_norm.weight"] = torch.zeros(a.dim)
            flat["iteration"] = iteration
            if args is not False:
                flat["args"] = args
            dcp.save(flat, checkpoint_id=str(folder), no_dist=True)
    if latest:
        (run / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return folder


def write_example_run(run: Path):
    """The run docs/primus.md's block imports (tests/test_docs.py writes it first): the debug_hybrid recipe's model
    saved as Primus's TE hybrid spec saves it, over 2 pipeline stages. Returns the model."""
    from hybridtitan.models import get_flavor

    torch.manual_seed(0)
    model = build_model(get_flavor("debug_hybrid"), "cpu")
    model.init_weights()
    write_primus(model.eval(), run, pp=2)
    return model


# ------------------------------------------------------------------------------------------ the tests


def import_cli(model: Path, out: Path, *extra: str):
    from hybridtitan.import_hf import main

    main(["--model", str(model), "--output", str(out), *extra])


def same_logits(step: Path, model) -> None:
    x = torch.randint(0, model.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    back, _ = load_model(str(step))
    assert back.args == model.args
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,tied,fmt,tp,pp,layout", [
    # Zebra-Llama's hybrid_stack_spec (Mamba2 + MLA, TE), its GDN and KDA hybrids' TE specs, tied and untied
    ("mamba2_mla", True, "torch", 1, 1, "te"),
    ("mamba2_mla", False, "torch", 2, 1, "te"),
    ("mamba2_mla", False, "fsdp_dtensor", 1, 1, "te"),
    ("gdn_mla", True, "torch", 1, 1, "te"),
    ("gdn_mla", False, "torch", 1, 1, "te_fused"),
    ("kda_mla", True, "torch", 1, 1, "te"),
    ("gdn_mla", False, "fsdp_dtensor", 1, 1, "no_te"),
    ("gdn_mla", True, "torch", 2, 1, "no_te"),
    ("gdn", True, "torch", 1, 1, "te"),
    ("kda", True, "fsdp_dtensor", 1, 1, "te"),
    ("kda_mla", False, "torch", 1, 1, "no_te"),
    # pipeline stages (mp_rank_XX_YYY), alone and with tensor-parallel ranks
    ("mamba2_mla", True, "torch", 1, 2, "te"),
    ("mamba2_mla", False, "torch", 2, 2, "te"),
    ("gdn_mla", False, "torch", 1, 3, "no_te"),
    ("kda_mla", True, "torch", 1, 2, "te"),
])
def test_import_gives_the_same_logits(tmp_path, capsys, name, tied, fmt, tp, pp, layout):
    model = make_model(name, tied)
    run = tmp_path / "checkpoints"
    folder = write_primus(model, run, fmt=fmt, tp=tp, pp=pp, layout=layout)
    if pp > 1:
        assert (folder / f"mp_rank_00_{pp - 1:03d}").is_dir() and not (folder / "mp_rank_00").exists()
    out = tmp_path / "ft" / "checkpoint" / "step-0"
    import_cli(run, out)
    printed = capsys.readouterr().out
    assert f"Primus {fmt} format, iteration 20" in printed and "model only" in printed
    assert ("2 tensor-parallel ranks merged" in printed) == (tp == 2)
    assert (f"{pp} pipeline stages joined" in printed) == (pp > 1)
    same_logits(out, model)
    # the tokenizer named by args.tokenizer_model is saved inside, where export and evaluation find it
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    from hybridtitan.checkpoint import is_model_only

    assert is_model_only(str(out))


def test_twice_normed_latent():
    """The "te" layout is Primus's TE spec of the same model: Megatron's two norms in a row over its tensors (the
    latent's rows of the down projection, q_layernorm / kv_layernorm, then the up projection's fused norm) give the
    latent hybridtitan's single norm gives, for the query and the key/value latent; an eps other than the model's
    does not."""
    model = make_model("mamba2_mla", True)
    m, eps = model.args.mla, model.args.norm_eps
    state = megatron_state(model, "te")
    attn, s = model.layers[0].attn, "decoder.layers.0.self_attention."
    h = torch.randn(5, model.args.dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours_q = attn.q_norm(attn.q_down_proj(h))
        ours_kv = attn.kv_norm(attn.kv_down_proj(h)[:, : m.kv_lora_rank])
        theirs_q = megatron_latent(h, state[s + "linear_q_down_proj.weight"], state[s + "q_layernorm.weight"],
                                   state[s + "linear_q_up_proj.layer_norm_weight"], eps)
        theirs_kv = megatron_latent(h, state[s + "linear_kv_down_proj.weight"][: m.kv_lora_rank],
                                    state[s + "kv_layernorm.weight"], state[s + "linear_kv_up_proj.layer_norm_weight"],
                                    eps)
        torch.testing.assert_close(theirs_q, ours_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(theirs_kv, ours_kv, atol=1e-5, rtol=1e-5)
        off = megatron_latent(h, state[s + "linear_q_down_proj.weight"], state[s + "q_layernorm.weight"],
                              state[s + "linear_q_up_proj.layer_norm_weight"], 1e-3)
        assert (off - ours_q).abs().max() > 1e-3


def test_iteration_chosen(tmp_path, capsys):
    """A run folder gives the iteration latest_checkpointed_iteration.txt names (else its highest iter_N); an
    iter_N folder gives itself."""
    old, new = make_model("gdn", True, seed=1), make_model("gdn", True, seed=2)
    run = tmp_path / "run"
    write_primus(new, run, iteration=30)
    write_primus(old, run, iteration=10, latest=False)
    import_cli(run, tmp_path / "a")
    same_logits(tmp_path / "a", new)
    import_cli(run / "iter_0000010", tmp_path / "b")
    same_logits(tmp_path / "b", old)
    (run / "latest_checkpointed_iteration.txt").write_text("10\n")
    import_cli(run, tmp_path / "c")
    same_logits(tmp_path / "c", old)
    (run / "latest_checkpointed_iteration.txt").unlink()
    import_cli(run, tmp_path / "d")
    same_logits(tmp_path / "d", new)
    assert "iteration 30" in capsys.readouterr().out
    # args that name no tokenizer: the model is imported, and the output says none was saved
    write_primus(old, tmp_path / "untok", args=megatron_args(old.args, tokenizer_model=None))
    import_cli(tmp_path / "untok", tmp_path / "e")
    assert "no tokenizer saved (args name no tokenizer_model; give --tokenizer)" in capsys.readouterr().out
    assert not (tmp_path / "e" / "tokenizer").exists()


def test_pattern_from_the_ratio_and_export(tmp_path, capsys):
    """Without an explicit pattern, args' hybrid_attention_ratio places the layers by Primus's rule; the import
    exports to a Hugging Face folder with the same logits."""
    from hybridtitan.export_hf import export
    from hybridtitan.hf.convert import load_hf_model

    model = make_model("mamba2_mla", False)
    args = megatron_args(model.args, hybrid_override_pattern=None, hybrid_attention_ratio=0.34)  # 1 of 3 pairs
    write_primus(model, tmp_path / "run", args=args)
    import_cli(tmp_path / "run", tmp_path / "step-0")
    back, _ = load_model(str(tmp_path / "step-0"))
    assert back.args == model.args.replace(hybrid_attention_ratio=0.34) and back.args.pattern == "*-M-M-"
    assert export(str(tmp_path / "step-0"), str(tmp_path / "hf"), dtype="float32") == "hybridtitan"
    x = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(str(tmp_path / "hf"))(x), model(x), atol=1e-5, rtol=0)


def test_training_resumes_from_the_import(tmp_path):
    """The import of a Primus checkpoint of the debug_hybrid recipe's model is the step-0 its run starts from."""
    from hybridtitan.models import get_flavor

    torch.manual_seed(0)
    model = build_model(get_flavor("debug_hybrid"), "cpu")
    model.init_weights()
    write_primus(model.eval(), tmp_path / "primus", args=megatron_args(model.args, tokenizer_model="meta-llama/x"))
    dump = tmp_path / "run"
    step0 = dump / "checkpoint" / "step-0"
    import_cli(tmp_path / "primus", step0, "--tokenizer", TOKENIZER)
    proc = run_train(dump, "--training.steps", "2", "--checkpoint.interval", "2", "--training.seq_len", "64",
                     "--training.local_batch_size", "2", "--training.global_batch_size", "2", "--metrics.log_freq",
                     "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false", nproc=1)
    log = proc.stdout + proc.stderr
    assert "step-0" in log, log[-2000:]
    step2, _ = load_model(str(dump / "checkpoint" / "step-2"))
    before = model.state_dict()
    moved = [k for k, v in step2.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and all(torch.allclose(v, before[k], atol=0.1) for k, v in step2.state_dict().items())


def expect_refusal(capsys, model: Path, out: Path, needle: str) -> None:
    from hybridtitan.import_hf import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(model), "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert needle in err, err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_bad_checkpoints_refused(tmp_path, capsys):
    model = make_model("mamba2_mla", True)
    a = model.args
    out = tmp_path / "out" / "step-0"
    out.parent.mkdir()
    n = iter(range(100))

    def run_with(**kw) -> Path:
        return write_primus(model, tmp_path / f"run{next(n)}", **kw).parent

    # truncated files, in both formats
    run = run_with()
    path = run / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    expect_refusal(capsys, run, out, "cannot read")
    run = run_with(fmt="fsdp_dtensor")
    shard = next((run / "iter_0000020").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    expect_refusal(capsys, run, out, "cannot read the tensors")
    run = run_with(fmt="fsdp_dtensor")
    (run / "iter_0000020" / ".metadata").write_bytes(b"garbage")
    expect_refusal(capsys, run, out, "cannot read the DCP metadata")
    # DCP files of another layout (Megatron's torch_dist: no model.module. names)
    run = tmp_path / "dist" / "iter_0000005"
    dcp.save({"decoder.final_norm.weight": torch.ones(a.dim)}, checkpoint_id=str(run), no_dist=True)
    expect_refusal(capsys, run, out, "no model tensors under 'model.module.'")
    (run / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    expect_refusal(capsys, run, out, "is in Megatron's torch_dist format, which is not read: convert it to the "
                   "torch format with Megatron's --ckpt-convert-format torch")
    # a latest file that names a missing iteration; a missing rank file
    run = run_with()
    (run / "latest_checkpointed_iteration.txt").write_text("40")
    expect_refusal(capsys, run, out, "names iteration 40")
    run = run_with()
    (run / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt").unlink()
    expect_refusal(capsys, run, out, "model_optim_rng.pt is missing")

    # no args, in both formats
    expect_refusal(capsys, run_with(args=False), out, "holds no args")
    expect_refusal(capsys, run_with(args=False, fmt="fsdp_dtensor"), out, "holds no args")

    # a type outside the allow-list is refused, never unpickled (its reduce would have run a command)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    for fmt in ("torch", "fsdp_dtensor"):
        run = run_with(fmt=fmt, args=megatron_args(a, hook=Payload()))
        expect_refusal(capsys, run, out, "system, which is not among the types")
        assert not marker.exists()

    # an unknown layer type: in the pattern, and in the tensors (a mixture of experts where an MLP should be)
    expect_refusal(capsys, run_with(args=megatron_args(a, hybrid_override_pattern="*-M-ME")), out,
                   "layer type 'E' (MoE) at position 5")
    state = megatron_state(model)
    state = {k: v for k, v in state.items() if not k.startswith("decoder.layers.5.")}
    state["decoder.layers.5.mlp.router.weight"] = torch.zeros(4, a.dim)
    expect_refusal(capsys, run_with(state=state), out, "decoder.layers.5 holds a mixture of experts")

    # a pattern that disagrees with the tensors; more layers than the pattern has
    expect_refusal(capsys, run_with(args=megatron_args(a, hybrid_override_pattern="M-*-M-")), out,
                   "says mixer ('M') at position 0, but decoder.layers.0 holds MLA tensors")
    expect_refusal(capsys, run_with(args=megatron_args(a, hybrid_override_pattern="*-M-", num_layers=4)), out,
                   "decoder.layers.5, past the 4 layers")
    # sizes in args that the tensors do not have, or none
    expect_refusal(capsys, run_with(args=megatron_args(a, hidden_size=None)), out, "args lack hidden_size")
    expect_refusal(capsys, run_with(args=megatron_args(a, ffn_hidden_size=96)), out,
                   "tensor decoder.layers.1.mlp.linear_fc1.weight has shape (256, 64), but the checkpoint's args "
                   "imply (192, 64)")
    # what the model cannot reproduce: LayerNorm, a bias, a Mamba2 sublayer without a pre-norm, a doubly normed latent
    expect_refusal(capsys, run_with(args=megatron_args(a, normalization="LayerNorm")), out, "normalization is")
    expect_refusal(capsys, run_with(args=megatron_args(a, apply_layernorm_1p=True)), out, "apply_layernorm_1p is true")
    # a layer the pattern has and the tensors do not (a checkpoint cut short)
    state = {k: v for k, v in megatron_state(model).items() if not k.startswith("decoder.layers.3.")}
    expect_refusal(capsys, run_with(state=state), out, "has no tensors of decoder.layers.3")
    state = megatron_state(model)
    state["decoder.layers.1.mlp.linear_fc2.bias"] = torch.zeros(a.dim)
    expect_refusal(capsys, run_with(state=state), out, "tensor decoder.layers.1.mlp.linear_fc2.bias")
    state = megatron_state(model)
    del state["decoder.layers.2.mixer.in_proj.layer_norm_weight"]
    expect_refusal(capsys, run_with(state=state), out, "decoder.layers.2 (Mamba2) has no pre-norm")
    state = megatron_state(model)  # Primus's earlier TE MLP: a TENorm before the fc1 with its fused norm
    state["decoder.layers.1.pre_mlp_layernorm.weight"] = torch.ones(a.dim)
    expect_refusal(capsys, run_with(state=state), out, "two norms in a row")
    # pipeline stages: args that say another count, a stage missing, both names of ranks, a stage not from 0
    expect_refusal(capsys, run_with(pp=2, args=megatron_args(a)), out,
                   "holds 2 pipeline stages, but args say pipeline_model_parallel_size 1")
    expect_refusal(capsys, run_with(args=megatron_args(a, pipeline_model_parallel_size=2)), out,
                   "holds 1 pipeline stage, but args say pipeline_model_parallel_size 2")
    run = run_with(pp=3)
    import shutil

    shutil.rmtree(run / "iter_0000020" / "mp_rank_00_001")
    expect_refusal(capsys, run, out, "are not every tensor-parallel rank")
    run = run_with(pp=2)
    (run / "iter_0000020" / "mp_rank_00").mkdir()
    expect_refusal(capsys, run, out, "holds both mp_rank_00 and mp_rank_00_000")
    stages = pp_split(megatron_state(model), a, 2)
    run = run_with(pp=2)
    with fake_megatron():
        path = run / "iter_0000020" / "mp_rank_00_001" / "model_optim_rng.pt"
        ckpt = torch.load(path, weights_only=False)
        ckpt["model"] = {k.replace("decoder.layers.0.", "decoder.layers.3."): v for k, v in stages[1].items()}
        torch.save(ckpt, path)
    expect_refusal(capsys, run, out, "are not numbered from 0 without a gap")
    # tensor-parallel ranks that disagree with args
    run = write_primus(model, tmp_path / "tp", tp=2, args=megatron_args(a, tp=4)).parent
    expect_refusal(capsys, run, out, "2 tensor-parallel ranks, but args say tensor_model_parallel_size 4")

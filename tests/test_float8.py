"""Float8 training with torchao (hybridtitan.float8): which linears convert, the refusals, plain checkpoints, and
emulated float8 numerics on CPU."""

import copy
import dataclasses
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtitan.float8 import (
    AUTO_FILTER_FLAG,
    TORCHAO_INSTALL,
    Float8Conversion,
    Float8Settings,
    convert_to_float8,
    float8_refusal,
    float8_refusal_here,
    float8_warnings,
    plan_float8,
    precompute_float8_scales,
    too_small_for_float8,
    torchao_installed,
)
from hybridtitan.models import build_model, get_flavor

torchao_float8 = pytest.importorskip("torchao.float8", reason=f"torchao is not installed ({TORCHAO_INSTALL})")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def kinds(names) -> set[str]:
    """Names with the sublayer index dropped: layers.3.mixer.o_proj -> mixer.o_proj."""
    return {name.split(".", 2)[2] if name.startswith("layers.") else name for name in names}


def test_debug_hybrid_converts_nothing_at_its_toy_sizes_and_all_but_the_gates_without_the_size_filter():
    model = build_model(get_flavor("debug_hybrid"))
    plan = plan_float8(model, Float8Settings())
    assert plan.converted == []  # dim 256: every GEMM under torchao's thresholds
    assert "too small" in plan.kept["layers.0.attn.o_proj"]
    plan = plan_float8(model, Float8Settings(), size_filter=False)
    assert kinds(plan.converted) == {"attn.q_down_proj", "attn.q_up_proj", "attn.kv_down_proj", "attn.kv_up_proj",
                                     "attn.o_proj", "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.g_proj",
                                     "mixer.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    for name in ("layers.2.mixer.a_proj", "layers.2.mixer.b_proj"):  # 4 heads: 4 outputs
        assert "divisible by 16" in plan.kept[name]
    assert len(plan.converted) + len(plan.kept) == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert plan.summary()[0].startswith("float8 (tensorwise): 32 of 36 linear layers converted, ")


@pytest.mark.parametrize("recipe, expected", [
    ("tensorwise", {"attn.q_down_proj", "attn.q_up_proj", "attn.kv_up_proj", "attn.o_proj", "mixer.in_proj",
                    "mixer.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
    # rowwise pays from larger GEMMs: N > 2048 and K > 1024 at least
    ("rowwise", {"mixer.in_proj", "mlp.gate_proj", "mlp.up_proj"}),
    ("rowwise_with_gw_hp", {"mixer.in_proj", "mlp.gate_proj", "mlp.up_proj"}),
])
def test_zebra_llama_1B_on_meta(recipe, expected):
    model = build_model(get_flavor("zebra_llama_1B"))
    conversion = convert_to_float8(model, Float8Settings(recipe_name=recipe), fsdp_sharded=False)
    assert kinds(conversion.converted) == expected
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(conversion.converted)
    assert all(p.is_meta for p in model.parameters())
    assert "too small" in conversion.kept["layers.0.attn.kv_down_proj"]  # 2048 -> 128 + 64: the kv latent


def test_gdn_and_kda_1B_keep_the_per_head_gates_and_convert_the_output_projection():
    for flavor in ("gdn_1B", "kda_1B"):
        plan = plan_float8(build_model(get_flavor(flavor)), Float8Settings())
        assert kinds(plan.converted) == {"mixer.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}, flavor
        assert "too small" in plan.kept["layers.0.mixer.b_proj"]
    plan = plan_float8(build_model(get_flavor("kda_1B")), Float8Settings())
    assert "too small" in plan.kept["layers.0.mixer.f_proj.1"]  # low-rank decay, K = 64


def test_untied_output_layer_stays():
    plan = plan_float8(build_model(get_flavor("llama_8B")), Float8Settings())
    assert plan.kept["lm_head"].startswith("output layer")
    assert kinds(plan.converted) == {"attn.q_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def test_filter_fqns():
    model = build_model(get_flavor("zebra_llama_1B"))
    plan = plan_float8(model, Float8Settings(filter_fqns=["mixer.in_proj", "layers.0.", AUTO_FILTER_FLAG]))
    assert kinds(plan.converted) == {"attn.q_down_proj", "attn.q_up_proj", "attn.kv_up_proj", "attn.o_proj",
                                     "mixer.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert plan.kept["layers.2.mixer.in_proj"] == "matches filter_fqns entry 'mixer.in_proj'"
    assert plan.kept["layers.0.attn.o_proj"] == "matches filter_fqns entry 'layers.0.'"
    assert "layers.10.attn.o_proj" not in plan.kept  # a substring, as torchtitan matches: "layers.0." is not "10."


def test_size_thresholds_are_torchaos():
    from torchao.float8 import _auto_filter_for_recipe

    sizes = [16, 64, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for recipe in ("tensorwise", "rowwise"):
        torchao_filter = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for N in sizes:
            for K in sizes:
                with torch.device("meta"):
                    linear = nn.Linear(K, N, bias=False)
                assert torchao_filter(linear, "x") == (not too_small_for_float8(recipe, N, K)), (recipe, N, K)


def ids_and_labels(vocab_size: int, B: int = 2, T: int = 32):
    ids = torch.randint(0, vocab_size, (B, T))
    return ids, torch.roll(ids, -1, dims=1)


@pytest.mark.parametrize("flavor, change", [
    ("debug_hybrid", {}),  # MLA with a query latent, GDN, MLP
    ("debug_kda", {}),
    ("debug_mamba2", {}),
    ("debug_llama", {}),  # grouped-query attention
    ("debug_hybrid", {"q_lora_rank": 0}),  # MLA with a plain query projection
])
def test_every_converted_linear_runs(flavor, change):
    """A converted linear computes its product itself, forward and backward: the fused products of the models
    (several projections of one input, the SwiGLU's down projection) step aside for it, and the loss stays the
    plain model's within float8's rounding."""
    args = get_flavor(flavor)
    args.mla = dataclasses.replace(args.mla, **change)
    model = build_model(args, "cpu")
    model.init_weights()
    plain = copy.deepcopy(model)
    conversion = convert_to_float8(model, Float8Settings(emulate=True), fsdp_sharded=False, size_filter=False)
    assert any(".mlp." in name for name in conversion.converted)
    ran = set()
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            module.register_forward_hook(lambda m, i, o, name=name: ran.add(name))
    ids, labels = ids_and_labels(args.vocab_size, T=16)
    loss = model(ids, labels=labels)
    loss.backward()
    assert ran == set(conversion.converted)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert loss.item() == pytest.approx(plain(ids, labels=labels).item(), rel=1e-2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulated_float8_trains_close_to_float32(recipe):
    args = get_flavor("debug_hybrid")
    model = build_model(args, "cpu")
    model.init_weights()
    ids, labels = ids_and_labels(args.vocab_size)
    converted = copy.deepcopy(model)
    conversion = convert_to_float8(converted, Float8Settings(recipe_name=recipe, emulate=True), fsdp_sharded=False,
                                   size_filter=False)
    assert len(conversion.converted) == 32
    losses, grads = [], []
    for m in (model, converted):
        loss = m(ids, labels=labels)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert losses[1] != losses[0]  # float8 casts did run
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    # float8 e4m3 keeps 3 mantissa bits: with 32 of the 36 linears converted, the whole gradient's cosine with
    # float32's measured 0.980-0.986 and the least of any parameter's 0.93-0.96 (2026-12-02, seed 0)
    flat = [torch.cat([g[name].flatten() for name in grads[0]]) for g in grads]
    assert F.cosine_similarity(flat[0], flat[1], dim=0) > 0.97
    for name, grad in grads[0].items():
        assert F.cosine_similarity(grad.flatten(), grads[1][name].flatten(), dim=0) > 0.9, name


def state_dict_layout(model: nn.Module) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fsdp_sharded", [False, True], ids=["plain", "float8_all_gather_weights"])
def test_checkpoints_hold_plain_weights(fsdp_sharded, tmp_path):
    import torch.distributed.checkpoint as dcp

    args = get_flavor("debug_hybrid")
    plain = build_model(args, "cpu")
    plain.init_weights()
    converted = copy.deepcopy(plain)
    settings = Float8Settings(enable_fsdp_float8_all_gather=True, emulate=True)
    conversion = convert_to_float8(converted, settings, fsdp_sharded=fsdp_sharded, size_filter=False)
    assert conversion.float8_all_gather == fsdp_sharded
    assert state_dict_layout(converted) == state_dict_layout(plain)
    for key, value in converted.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key

    other = build_model(args, "cpu")  # a plain state dict into a converted model and back
    other.init_weights()
    converted.load_state_dict(other.state_dict())
    fresh = build_model(args, "cpu")
    fresh.load_state_dict(converted.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    dcp.save(converted.state_dict(), checkpoint_id=tmp_path / "step")  # the trainer's format (one process)
    loaded = build_model(args, "cpu").state_dict()
    dcp.load(loaded, checkpoint_id=tmp_path / "step")
    for key, value in other.state_dict().items():
        assert torch.equal(loaded[key], value), key
        assert type(loaded[key]) is torch.Tensor


def test_real_flavor_state_dict_layout_unchanged():
    plain = build_model(get_flavor("zebra_llama_1B"))
    converted = build_model(get_flavor("zebra_llama_1B"))
    convert_to_float8(converted, Float8Settings(), fsdp_sharded=False)
    assert state_dict_layout(converted) == state_dict_layout(plain)


def test_precompute_runs_only_with_float8_all_gather(monkeypatch):
    calls = []
    monkeypatch.setattr(torchao_float8, "precompute_float8_dynamic_scale_for_fsdp", calls.append)
    model = nn.Linear(16, 16)
    precompute_float8_scales(model, Float8Conversion("tensorwise", [], {}, float8_all_gather=True))
    assert calls == []
    precompute_float8_scales([model, model], Float8Conversion("tensorwise", [], {}, True, precompute_scales=True))
    assert calls == [model, model]

    settings = Float8Settings(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    assert not convert_to_float8(nn.Sequential(), settings, fsdp_sharded=False).precompute_scales
    assert convert_to_float8(nn.Sequential(), settings, fsdp_sharded=True).precompute_scales


def test_precompute_on_an_unsharded_model_changes_nothing():
    """torchao's precompute looks only at FSDP-sharded (DTensor) float8 weights: a no-op without FSDP."""
    model = build_model(get_flavor("debug_hybrid"), "cpu")
    model.init_weights()
    settings = Float8Settings(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True,
                              emulate=True)
    conversion = convert_to_float8(model, settings, fsdp_sharded=True, size_filter=False)
    before = copy.deepcopy(model.state_dict())
    precompute_float8_scales(model, conversion)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


H200, A100 = (9, 0), (8, 0)


@pytest.mark.parametrize("settings, kwargs, expected", [
    (Float8Settings(), {"device_type": "cuda", "capability": H200}, None),
    (Float8Settings(), {"device_type": "cuda", "capability": (8, 9)}, None),  # Ada, L40S
    (Float8Settings(recipe_name="rowwise"), {"device_type": "cuda", "capability": (10, 0)}, None),
    (Float8Settings(), {"device_type": "cuda", "capability": A100}, "sm_80: float8 matrix products need"),
    (Float8Settings(), {"device_type": "cpu"}, "on CPU only quantize.linear.float8.emulate = true runs"),
    (Float8Settings(), {"device_type": "mps"}, "not on mps"),
    (Float8Settings(emulate=True), {"device_type": "cpu"}, None),
    (Float8Settings(emulate=True), {"device_type": "cuda", "capability": A100}, None),
    (Float8Settings(emulate=True), {"device_type": "cpu", "compiled": True}, "emulate runs in eager mode only"),
    (Float8Settings(), {"device_type": "cuda", "gcn_arch": "gfx942:sramecc+:xnack-"}, None),  # MI300X
    (Float8Settings(), {"device_type": "cuda", "gcn_arch": "gfx950"}, None),  # MI355X
    (Float8Settings(), {"device_type": "cuda", "gcn_arch": "gfx90a:sramecc+:xnack-"},
     "this AMD GPU (gfx90a) has no float8 matrix cores; float8 training needs MI300X/MI325X (FP8 e4m3fnuz) gfx942"),
    (Float8Settings(), {"device_type": "cuda", "gcn_arch": "gfx1100"}, "(gfx1100) has no float8"),
    (Float8Settings(recipe_name="rowwise", enable_fsdp_float8_all_gather=True),
     {"device_type": "cuda", "capability": H200}, "enable_fsdp_float8_all_gather needs the tensorwise recipe"),
    (Float8Settings(recipe_name="tensorwise", enable_fsdp_float8_all_gather=True,
                    precompute_float8_dynamic_scale_for_fsdp=True), {"device_type": "cuda", "capability": H200}, None),
    (Float8Settings(precompute_float8_dynamic_scale_for_fsdp=True), {"device_type": "cuda", "capability": H200},
     "needs quantize.linear.float8.enable_fsdp_float8_all_gather = true"),
    (Float8Settings(recipe_name="blockwise"), {"device_type": "cuda", "capability": H200}, "got 'blockwise'"),
    (Float8Settings(recipe_name="rowwise"), {"device_type": "cuda", "capability": H200, "compiled": False}, None),
])
def test_refusals(settings, kwargs, expected):
    line = float8_refusal(settings, **kwargs)
    if expected is None:
        assert line is None
    else:
        assert expected in line and "\n" not in line


def test_refusal_without_torchao(monkeypatch):
    assert torchao_installed()
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import raises ImportError
    assert not torchao_installed()
    line = float8_refusal(Float8Settings(), device_type="cuda", capability=H200)
    assert line == "float8 training (quantize.linear.float8 in model.converters) needs torchao: " + TORCHAO_INSTALL
    # the hardware comes first: no point installing torchao for a CPU run
    assert "on CPU" in float8_refusal(Float8Settings(), device_type="cpu")
    assert plan_float8(build_model(get_flavor("gdn_1B")), Float8Settings()).converted  # describe needs no torchao


def test_refusal_here_on_this_cpu():
    assert "on CPU" in float8_refusal_here(Float8Settings(), torch.device("cpu"), compiled=False)
    assert float8_refusal_here(Float8Settings(emulate=True), torch.device("cpu"), compiled=False) is None


def test_warnings():
    assert float8_warnings(Float8Settings(), compiled=True, fsdp_sharded=True) == []
    (eager,) = float8_warnings(Float8Settings(recipe_name="rowwise"), compiled=False, fsdp_sharded=True)
    assert "without torch.compile" in eager and "rowwise especially" in eager
    assert float8_warnings(Float8Settings(emulate=True), compiled=False, fsdp_sharded=True) == []
    (unsharded,) = float8_warnings(Float8Settings(enable_fsdp_float8_all_gather=True), compiled=True,
                                   fsdp_sharded=False)
    assert "off for this run" in unsharded


# ---- the trainer and describe


def test_the_trainer_refuses_float8_where_it_cannot_run(capsys, tmp_path):
    """One line, exit code 2, before the run's folder exists: float8 on this CPU, an unknown converter."""
    from helpers import QUICK, RECIPE, main_error

    dump = tmp_path / "run"
    base = ["--job.config_file", RECIPE, "--job.dump_folder", str(dump), *QUICK]
    code, err = main_error(capsys, [*base, "--model.converters", "quantize.linear.float8"])
    assert code == 2 and err.startswith("error: float8 training needs a GPU") and "\n" not in err
    code, err = main_error(capsys, [*base, "--model.converters", "quantize.linear.int4"])
    assert code == 2 and err == ("error: model.converters: unknown converter(s) quantize.linear.int4; hybridtitan has "
                                 "quantize.linear.float8 (float8 training of the linear layers)")
    code, err = main_error(capsys, [*base, "--model.converters", "quantize.linear.float8",
                                    "--quantize.linear.float8.recipe_name", "rowwise",
                                    "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true"])
    assert code == 2 and "enable_fsdp_float8_all_gather needs the tensorwise recipe" in err
    assert not dump.exists()


def test_an_emulated_float8_run_saves_plain_weights_that_train_on_without_float8(tmp_path):
    """2 ranks of FSDP2 with float8 all-gather (emulated): the log names the converted linears, the checkpoint
    holds plain tensors (model and optimizer) and loads into a plain model, a resume without float8 goes on from
    it, and one with float8 from that run's checkpoint."""
    from helpers import QUICK, losses, run_train, state

    dump = tmp_path / "run"
    float8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", "true",
              "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
              "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
              "--model.ffn_dim", "2048"]  # gate and up projections 2048 x 256: above torchao's size thresholds
    common = [*QUICK, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--compile.enable", "false"]
    proc = run_train(dump, *common, *float8, "--training.steps", "2")
    log = proc.stdout + proc.stderr
    assert "float8 (tensorwise): 8 of 36 linear layers converted" in log, log[-3000:]
    assert "float8  layers.*.mlp.gate_proj (x4)" in log and "float8  layers.*.mlp.up_proj (x4)" in log
    weights = state(dump, 2)
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in weights.values())
    for shard in (dump / "checkpoint" / "step-2").glob("*.distcp"):  # no torchao class pickled in, optimizer too
        assert b"torchao" not in shard.read_bytes(), shard
    run_train(dump, *common, "--model.ffn_dim", "2048", "--training.steps", "3")
    assert sorted(losses(dump)) == [1, 2, 3]
    run_train(dump, *common, *float8, "--training.steps", "4")  # and back to float8, from a plain run's step
    assert sorted(losses(dump)) == [1, 2, 3, 4]


def test_describe_lists_the_float8_conversion():
    import json
    import subprocess

    from helpers import ROOT, env

    proc = subprocess.run([sys.executable, "-m", "hybridtitan.describe", "--job.config_file",
                           "train_configs/zebra_llama_1B.toml", "--model.converters", "quantize.linear.float8",
                           "--json"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)["float8"]
    expected = plan_float8(build_model(get_flavor("zebra_llama_1B")), Float8Settings())
    assert d["converted"] == expected.converted and d["recipe"] == "tensorwise"
    assert d["summary"][0].startswith("float8 (tensorwise): 88 of 92 linear layers converted")

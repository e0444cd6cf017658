"""python -m hybridtitan.from_primus: a Primus experiment YAML becomes a recipe that hybridtitan's own parser reads
and describe plans; each released configuration that a recipe of train_configs/ follows gives that recipe, or the
difference is named; every key is mapped or listed with its reason; bad input is one line, exit code 2.

The experiments under tests/assets/primus are written in Primus's schema (the layout of a Primus checkout:
examples/megatron/configs/MI300X/, primus/configs/{models,modules}/megatron/) with the values of the released
configurations at AMD-AGI/Primus fd1eeabb that the recipes' headers cite."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtitan.config_manager import model_args, parse_config
from hybridtitan.describe import describe
from hybridtitan.from_primus import MAPPED, convert, key_tables, main, map_experiment, read_experiment

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets" / "primus"
EXPERIMENTS = ASSETS / "examples" / "megatron" / "configs" / "MI300X"

# the TE-spec hybrids with MLA sublayers (the GDN and KDA ones without attention have none; the no-TE specs norm
# each latent once)
TWICE_NORMED = {"zebra_llama_1B", "zebra_llama_3B", "zebra_llama_8B", "zebra_llama_1B_kda"}
BENCHMARK_RUN = {"training.steps"}  # train_iters 50 of the YAML against the recipe's full schedule
BENCHMARK_BATCH = {"training.local_batch_size", "training.global_batch_size"}
# experiment -> (the recipe that follows it, what differs from that recipe: the YAMLs' benchmark settings, which
# each recipe's header explains)
RELEASED = {
    "zebra_llama_300M_gdn_pure": ("gdn_300M", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_300M_kda_pure": ("kda_300M", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_300M_gdn_hybrid": ("zebra_gdn_300M", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_300M_mamba_hybrid": ("zebra_mamba2_300M", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_1B_gdn_pure_100B": ("gdn_1B", BENCHMARK_RUN | {"training.local_batch_size"}),
    "zebra_llama_1B_gdn_pure": ("gdn_1B_10B", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_1B_gdn": ("gdn_1B_8k", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_1B_kda_pure": ("kda_1B", BENCHMARK_RUN | BENCHMARK_BATCH),
    "zebra_llama_1B": ("zebra_llama_1B", BENCHMARK_RUN),
    # the hybrid's preset (zebra_llama_1B.yaml) sets no KDA sizes: Megatron's defaults, where the recipe takes the
    # pure KDA 1B preset's
    "zebra_llama_1B_kda": ("zebra_kda_1B", BENCHMARK_RUN | BENCHMARK_BATCH | {"model.kda.head_dim",
                                                                           "model.kda.head_v_dim"}),
    "zebra_llama_3B": ("zebra_llama_3B", BENCHMARK_RUN),
    "zebra_llama_8B": ("zebra_llama_8B", BENCHMARK_RUN),
    # 50-step benchmark whose warm-up and decay are Megatron's example sample counts read as iterations
    "mamba_370M": ("mamba_370M", BENCHMARK_RUN | BENCHMARK_BATCH | {"lr_scheduler.warmup_steps",
                                                                   "lr_scheduler.total_steps"}),
}

TRAINING_KEYS = ("training.local_batch_size", "training.global_batch_size", "training.steps", "training.seq_len",
                 "training.max_norm", "training.eod_mask_loss", "training.mixed_precision_param", "optimizer.name",
                 "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
                 "lr_scheduler.warmup_steps", "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor",
                 "lr_scheduler.decay_ratio", "data.tokenizer", "debug.seed")


def _leaves(d: dict, prefix: str) -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def what_differs(ours, theirs) -> set[str]:
    """The keys of two parsed recipes that differ: the model's arguments in full (the sizes of the sublayer kinds
    its pattern has), the batch, the schedule (its length as it runs), the optimizer, EOD mask, sequence length."""
    a, b = model_args(ours), model_args(theirs)
    kinds = {"M": a.mixer, "*": a.attention}
    skip = {"hybrid_attention_ratio"} | {s for s in ("gdn", "kda", "mamba2", "mla", "gqa")
                                        if s not in {kinds[k] for k in kinds if k in a.pattern}}
    if "-" not in a.pattern:
        skip.add("ffn_dim")
    da = {k: v for k, v in dataclasses.asdict(a).items() if k not in skip}
    db = {k: v for k, v in dataclasses.asdict(b).items() if k not in skip}
    la, lb = _leaves(da, "model."), _leaves(db, "model.")
    diff = {k for k in la.keys() | lb.keys() if la.get(k) != lb.get(k)}
    for key in TRAINING_KEYS:
        section, name = key.split(".")
        x, y = getattr(getattr(ours, section), name), getattr(getattr(theirs, section), name)
        if isinstance(x, float) and isinstance(y, float):
            same = abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1.0)
        else:
            same = x == y
        if not same:
            diff.add(key)
    if (ours.lr_scheduler.total_steps or ours.training.steps) != (theirs.lr_scheduler.total_steps
                                                                  or theirs.training.steps):
        diff.add("lr_scheduler.total_steps")
    return diff


def _parse(text: str, tmp_path: Path, name: str = "recipe.toml"):
    path = tmp_path / name
    path.write_text(text)
    return parse_config(["--job.config_file", str(path)], check_data=False)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_each_released_configuration_gives_its_recipe(name, tmp_path):
    recipe, expected = RELEASED[name]
    text, report = convert(str(EXPERIMENTS / f"{name}-pretrain.yaml"))
    ours = _parse(text, tmp_path)
    theirs = parse_config(["--job.config_file", str(REPO / "train_configs" / f"{recipe}.toml")], check_data=False)
    assert what_differs(ours, theirs) == expected
    # the same model as the recipe's, built and counted by describe, wherever the sizes agree
    mine, shipped = describe(ours), describe(theirs)
    assert mine["params_total"] > 0 and mine["memory_estimate_gib"]["total"] > 0
    if not any(k.startswith("model.") for k in expected):
        assert ours.model.flavor == theirs.model.flavor
        assert mine["params_total"] == shipped["params_total"]
        assert dataclasses.asdict(model_args(ours)) | {"hybrid_attention_ratio": 0} == \
            dataclasses.asdict(model_args(theirs)) | {"hybrid_attention_ratio": 0}
    # each difference is named in the report, and in the recipe's own comments
    shipped_lines = [line for line in report if line.startswith("shipped: ")]
    assert f"train_configs/{recipe}.toml" in shipped_lines[0]
    for key in expected:
        assert any(line.startswith(f"shipped: - {key}: ") for line in shipped_lines), (key, shipped_lines)
        assert f"# - {key}: " in text
    # a TE spec's twice-normed MLA latents (hybridtitan norms them once) are named where the model has MLA
    twice = any(line.startswith("difference: spec = ") and "normalises each latent twice" in line for line in report)
    assert twice == (name in TWICE_NORMED), report
    # the benchmark run is explained, with the full run's length
    decay = ours.lr_scheduler.total_steps
    assert any(line.startswith("difference: train_iters = 50 ") and f"--training.steps {decay}" in line
               for line in report), report


def test_bases_is_not_followed_and_extends_is(tmp_path):
    """A preset's bases: is not read (Primus's loader follows extends: only), and the output says so; the values
    come from where Primus's run takes them: Megatron's defaults there, language_model.yaml through extends."""
    _, report = convert(str(EXPERIMENTS / "zebra_llama_1B-pretrain.yaml"))
    assert any(line.startswith("not followed: primus/configs/models/megatron/zebra_llama_1B.yaml says bases: "
                               "['mamba_base.yaml']") for line in report)
    assert "difference: normalization = LayerNorm (Megatron's default): hybridtitan's norms are RMSNorm " \
           "(eps layernorm_epsilon)" in report
    assert any(line.startswith("difference: hidden_dropout = 0.1 (Megatron's default)") for line in report)
    assert "read: primus/configs/models/megatron/mamba_base.yaml" not in report
    _, report = convert(str(EXPERIMENTS / "zebra_llama_1B_gdn-pretrain.yaml"))  # extends: mamba_base.yaml
    assert not any(line.startswith("not followed") for line in report)
    assert "read: primus/configs/models/megatron/mamba_base.yaml" in report
    assert "read: primus/configs/models/megatron/language_model.yaml" in report
    assert any(line.startswith("difference: normalization = LayerNorm (language_model.yaml)") for line in report)
    assert not any(line.startswith("difference: hidden_dropout") for line in report)  # mamba_base.yaml's 0.0


def test_module_config_wins_over_the_model_preset(tmp_path):
    """Primus adds a model preset's key only where the module config does not set it; overrides win over both."""
    root = _checkout(tmp_path, model_extra="seed: 7\nlog_interval: 3\n",
                     overrides="log_interval: 5\n")
    exp = read_experiment(str(root / "exp.yaml"))
    assert exp.get("seed") == 1234 and exp.where("seed") == "trainer_base.yaml"
    assert exp.get("log_interval") == 5 and exp.where("log_interval") == "exp.yaml"


@functools.lru_cache(maxsize=1)
def released_read() -> frozenset:
    """The keys the mapping reads over all the released configurations."""
    read = set()
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        m, _ = map_experiment(read_experiment(str(path)))
        read |= m.read
    return frozenset(read)


def test_every_key_is_mapped_or_listed_with_a_reason():
    """No key of the experiment is dropped silently: each is read into the recipe or listed, one line each, with
    its reason; the keys the code reads are the table's mapped keys."""
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        exp = read_experiment(str(path))
        m, _ = map_experiment(exp)
        _, report = convert(str(path))
        listed = {re.match(r"not mapped: (\S+) = ", line).group(1) for line in report
                  if line.startswith("not mapped: ")}
        assert listed | m.read >= set(exp.values), set(exp.values) - listed - m.read
        assert not listed & m.read
        assert all(re.match(r"not mapped: \S+ = .* \(.+\): .+", line) for line in report
                   if line.startswith("not mapped: "))
    assert released_read() <= MAPPED


MODULE = """extends:
  - trainer_base.yaml
lr: 2.0e-05
"""
BASE = """seed: 1234
log_interval: 100
optimizer: adam
bf16: true
adam_eps: 1.0e-8
"""


def _checkout(tmp, model_extra="", overrides="", model_name="m", spec="gdn_hybrid_stack_spec", exp_extra=""):
    """A small Primus checkout: an experiment, its module config and a GDN model preset."""
    models, modules = tmp / "primus/configs/models/megatron", tmp / "primus/configs/modules/megatron"
    models.mkdir(parents=True, exist_ok=True)
    modules.mkdir(parents=True, exist_ok=True)
    (modules / "pre_trainer.yaml").write_text(MODULE)
    (modules / "trainer_base.yaml").write_text(BASE)
    (models / "m.yaml").write_text("""num_layers: 4
hidden_size: 128
ffn_hidden_size: 384
is_hybrid_model: true
swiglu: true
normalization: RMSNorm
hidden_dropout: 0.0
attention_dropout: 0.0
add_bias_linear: false
position_embedding_type: none
linear_num_key_heads: 2
linear_num_value_heads: 4
linear_key_head_dim: 32
linear_value_head_dim: 32
tokenizer_model: meta-llama/Llama-3.2-1B
""" + model_extra)
    body = "\n".join("      " + line for line in overrides.strip().splitlines())
    (tmp / "exp.yaml").write_text(f"""work_group: amd
exp_name: ${{PRIMUS_EXP_NAME:tiny}}
{exp_extra}
modules:
  pre_trainer:
    framework: megatron
    config: pre_trainer.yaml
    model: {model_name}.yaml
    overrides:
      spec: ['x', '{spec}']
      train_iters: 10
      micro_batch_size: 2
      global_batch_size: 4
      seq_length: 128
      lr: 1.0e-3
      min_lr: 1.0e-4
      mock_data: true
{body}
""")
    return tmp


def test_other_keys(tmp_path, monkeypatch):
    """Keys the released configurations leave unset: samples, warm-up fraction, data prefixes, an explicit
    pattern with MLA, recompute, a save folder, constant decay, tensor parallelism, an unknown key."""
    root = _checkout(tmp_path, exp_extra="platform:\n  config: platform_azure.yaml",
                     model_extra="""hybrid_layer_pattern: "*-M-"
multi_latent_attention: true
num_attention_heads: 4
q_lora_rank: 64
kv_lora_rank: 32
qk_head_dim: 16
qk_pos_emb_head_dim: 16
v_head_dim: 32
rotary_base: 500000
rotary_scaling_factor: 1.0
mscale: 1.0
mscale_all_dim: 1.0
""", overrides="""num_layers: 4
train_iters: null
train_samples: 400
lr_decay_samples: 800
lr_warmup_fraction: 0.25
lr_decay_style: constant
mock_data: false
data_path: "0.7 /d/a_text_document 0.3 /d/b_text_document"
recompute_granularity: full
tensor_model_parallel_size: 2
save: /ckpt/run
save_interval: 50
reset_position_ids: true
original_max_position_embeddings: 128
tokenizer_model: my/tokenizer
vocab_size: 1000
my_custom_knob: 3
""")
    monkeypatch.setenv("PRIMUS_EXP_NAME", "from_env")
    text, report = convert(str(root / "exp.yaml"))
    m, _ = map_experiment(read_experiment(str(root / "exp.yaml")))
    # with the released configurations, every key the table marks mapped is read by the mapping
    assert MAPPED - released_read() <= m.read, sorted(MAPPED - released_read() - m.read)
    cfg = _parse(text, tmp_path, "r.toml")
    assert cfg.training.steps == 100 and cfg.lr_scheduler.total_steps == 200
    assert cfg.lr_scheduler.warmup_steps == 50 and cfg.lr_scheduler.decay_ratio == 0.0
    assert cfg.data.source == "megatron" and cfg.data.path == "/d/a_text_document,/d/b_text_document"
    assert cfg.data.document_boundaries and cfg.activation_checkpoint.mode == "full"
    assert cfg.checkpoint.enable and cfg.checkpoint.interval == 50 and cfg.job.dump_folder == "/ckpt/run"
    args = model_args(cfg)
    assert args.pattern == "*-M-" and args.mla.q_lora_rank == 64 and args.mla.original_max_position_embeddings == 128
    assert args.gdn.num_heads == 2 and args.gdn.num_v_heads == 4
    assert args.vocab_size == 1024 and cfg.data.tokenizer == "my/tokenizer"  # padded to a multiple of 128
    assert any(line.startswith("difference: tensor_model_parallel_size = 2 ") for line in report)
    assert any(line.startswith("note: data: Megatron's blend weights") for line in report)
    assert "not mapped: my_custom_knob = 3 (exp.yaml): not a key from_primus knows: no hybridtitan equivalent " \
           "known" in report
    assert "environment: PRIMUS_EXP_NAME (in " + str(root / "exp.yaml") + ")" in report
    assert "#   my_custom_knob = 3 (exp.yaml): not a key from_primus knows" in text
    assert "not mapped: platform = {'config': 'platform_azure.yaml'} (exp.yaml): not a key from_primus knows: no " \
           "hybridtitan equivalent known" in report  # the experiment's own keys too
    describe(cfg)


def test_cli_writes_a_recipe_that_describe_plans(tmp_path, capsys):
    out = tmp_path / "z.toml"
    main([str(EXPERIMENTS / "zebra_llama_8B-pretrain.yaml"), "--output", str(out)])
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "not mapped: " in printed
    from hybridtitan.describe import main as describe_main

    describe_main(["--job.config_file", str(out), "--json"])
    assert '"params_total"' in capsys.readouterr().out
    main([str(EXPERIMENTS / "zebra_llama_8B-pretrain.yaml")])  # no --output: the recipe on stdout
    captured = capsys.readouterr()
    assert captured.out == out.read_text() and "not mapped: " in captured.err


def _bad_cases(tmp):
    cases = {"no experiment": ([], "give a Primus experiment YAML")}
    cases["missing file"] = ([str(tmp / "nope.yaml")], "no such file: ")
    a, b = tmp / "cyc" / "a.yaml", tmp / "cyc" / "b.yaml"
    a.parent.mkdir()
    a.write_text("extends: b.yaml\nx: 1\n")
    b.write_text("extends:\n  - a.yaml\n")
    cases["cycle"] = ([str(a)], "a cycle of extends: a.yaml -> b.yaml -> a.yaml")
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    cases["not a mapping"] = ([str(tmp / "list.yaml")], "the file is list, not a mapping")
    (tmp / "bad.yaml").write_text("a: [1, 2\n")
    cases["not YAML"] = ([str(tmp / "bad.yaml")], "not valid YAML")
    root = _checkout(tmp / "unknown_model", model_name="zebra_llama_99B")
    cases["unknown model"] = ([str(root / "exp.yaml")], "unknown model preset 'zebra_llama_99B.yaml'")
    root = _checkout(tmp / "unknown_spec", spec="moe_stack_spec")
    cases["unknown spec"] = ([str(root / "exp.yaml")], "an unknown layer spec")
    root = _checkout(tmp / "moe", model_extra='hybrid_override_pattern: "M-E-"\n')
    cases["MoE pattern"] = ([str(root / "exp.yaml")], "no MoE 'E'")
    root = _checkout(tmp / "nomodules", exp_extra="")
    (root / "exp.yaml").write_text("exp_name: x\n")
    cases["no modules"] = ([str(root / "exp.yaml")], "no modules:")
    root = _checkout(tmp / "extends_missing", exp_extra="extends: base_exp.yaml")
    cases["extends a missing file"] = ([str(root / "exp.yaml")], "base_exp.yaml (extended by ")
    root = _checkout(tmp / "no_output_folder")
    cases["no output folder"] = ([str(root / "exp.yaml"), "--output", str(tmp / "nowhere" / "r.toml")], "no folder")
    return cases


def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    for name, (argv, expected) in _bad_cases(tmp_path).items():
        out = tmp_path / f"{name.replace(' ', '_')}.toml"
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--output", str(out)] if "--output" not in argv else argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, name
        assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, (name, err)
        assert not out.exists(), name


def test_bad_input_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridtitan.from_primus", str(tmp_path / "none.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"error: no such file: {tmp_path / 'none.yaml'}"


def test_docs_key_tables_are_the_codes():
    """docs/primus.md's key tables are KEY_TABLE's (python -m hybridtitan.from_primus --key-tables)."""
    text = (REPO / "docs" / "primus.md").read_text()
    begin, end = "<!-- key tables: python -m hybridtitan.from_primus --key-tables -->\n", "<!-- end of key tables -->"
    assert begin in text and end in text
    assert text.split(begin, 1)[1].split(end, 1)[0] == key_tables()
    assert text.index("From a Primus experiment to a recipe") < text.index(begin)

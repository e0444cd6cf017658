"""The recipe and its overrides: every mistake is one line on stderr and exit code 2, before anything is written;
--help lists the keys hybridtitan reads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from helpers import RECIPE, ROOT, env, main_error
from hybridtitan import train

BAD_TOML = {
    "syntax": "[training\nsteps = 3\n",
    "unknown_section": "[trainingg]\nsteps = 3\n",
    "unknown_key": "[training]\nstepz = 3\n",
    "wrong_type": '[training]\nsteps = "many"\n',
    "not_a_choice": '[checkpoint]\nasync_mode = "async_with_pinned_mem"\n',
    "not_choices": '[compile]\ncomponents = ["loss", "nrom"]\n',
}

@pytest.mark.parametrize("case", sorted(BAD_TOML))
def test_bad_toml(tmp_path, capsys, case):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(BAD_TOML[case])
    code, err = main_error(capsys, ["--job.config_file", str(recipe), "--job.dump_folder", str(tmp_path / "d")])
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err, err
    assert {"syntax": "TOML syntax error", "unknown_section": "unknown section 'trainingg'",
            "unknown_key": "unknown key 'training.stepz' in section [training] (did you mean 'training.steps'?)",
            "wrong_type": "training.steps must be int",
            "not_a_choice": "checkpoint.async_mode must be disabled or async, got 'async_with_pinned_mem'",
            "not_choices": "compile.components must be a list of model, loss, norm or swiglu, got ['loss', 'nrom']",
            }[case] in err
    assert not (tmp_path / "d").exists()

BAD_CLI = {
    "cli_wrong_type": (["--training.steps", "many"], "training.steps"),
    "cli_unknown_key": (["--training.stepz", "3"], "unknown option --training.stepz"),
    "missing_data": (["--data.path", "/nonexistent/corpus.jsonl"], "data.path"),
    "vocab_too_small": (["--model.vocab_size", "1000"], "larger than the model's vocab_size (1000)"),
    "seq_len_zero": (["--training.seq_len", "0"], "training.seq_len must be positive"),
    "steps_negative": (["--training.steps", "-5"], "training.steps must be positive"),
    "batch_not_divisible": (["--training.local_batch_size", "3", "--training.global_batch_size", "8"],
                            "not divisible"),
    "bad_pattern": (["--model.pattern", "*-M-X-"], "position 4"),
    # the key as the user wrote it, without tyro's dashes and trailing "Argument helptext:"
    "cli_not_an_int": (["--training.seq_len", "abc"], "--training.seq_len must be an integer, got 'abc'"),
    "cli_not_a_bool": (["--checkpoint.enable", "maybe"], "--checkpoint.enable must be true or false, got 'maybe'"),
    "tokenizer_not_found": (["--data.tokenizer", "no_such_tokenizer_folder"],
                            "no_such_tokenizer_folder: no such local folder, and from the Hugging Face Hub:"),
}

@pytest.mark.parametrize("case", sorted(BAD_CLI))
def test_bad_cli(tmp_path, capsys, case):
    """Each problem: one line on stderr, exit code 2, and the existing checkpoint untouched."""
    dump = tmp_path / "d"
    ckpt = dump / "checkpoint" / "step-5"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_text("x")
    before = {p: p.stat().st_mtime_ns for p in dump.rglob("*")}
    argv, expected = BAD_CLI[case]
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(dump), *argv])
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and expected in err and "helptext" not in err, err
    assert {p: p.stat().st_mtime_ns for p in dump.rglob("*")} == before

BAD_SLICES = {
    "reversed": (["--data.document_slice", "0.5,0.2"],
                 "data.document_slice must be [start, end] with 0 <= start < end <= 1, got [0.5, 0.2]"),
    "empty": (["--data.document_slice", "0.3,0.3"], "0 <= start < end <= 1, got [0.3, 0.3]"),
    "past_one": (["--data.document_slice", "0,1.5"], "0 <= start < end <= 1, got [0.0, 1.5]"),
    "negative": (["--data.document_slice=-0.1,0.5"], "0 <= start < end <= 1, got [-0.1, 0.5]"),
    "one_number": (["--data.document_slice", "0.2"],
                   "data.document_slice must be two fractions [start, end], got [0.2]"),
    "three_numbers": (["--data.document_slice", "0,0.2,1"], "must be two fractions [start, end], got [0.0, 0.2, 1.0]"),
    "not_a_number": (["--data.document_slice", "0.2,end"],
                     "--data.document_slice must be comma-separated numbers, got '0.2,end'"),
    "nan": (["--data.document_slice", "nan,0.5"], "must be two fractions [start, end], got [nan, 0.5]"),
    "seed": (["--data.document_slice_seed", "-1"], "data.document_slice_seed must be an integer >= 0, got -1"),
    "streaming": (["--data.streaming", "--data.document_slice", "0,0.2"],
                  "data.document_slice [0.0, 0.2]: a slice needs random access"),
}

@pytest.mark.parametrize("case", sorted(BAD_SLICES))
def test_bad_document_slice(tmp_path, capsys, case):
    """A slice that is not 0 <= start < end <= 1 (or a stream's): one line, exit 2, nothing written."""
    argv, expected = BAD_SLICES[case]
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(tmp_path / "d"), *argv])
    assert code == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err
    assert not (tmp_path / "d").exists()

@pytest.mark.parametrize("value,expected", [("[0.3, 0.1]", "0 <= start < end <= 1, got [0.3, 0.1]"),
                                            ('"0.2,1.0"', "data.document_slice must be list"),
                                            ('["a", "b"]', "data.document_slice must be list")])
def test_bad_document_slice_in_a_recipe(tmp_path, capsys, value, expected):
    recipe = tmp_path / "sliced.toml"
    recipe.write_text(open(RECIPE).read().replace("[data]\n", f"[data]\ndocument_slice = {value}\n", 1))
    code, err = main_error(capsys, ["--job.config_file", str(recipe), "--job.dump_folder", str(tmp_path / "d")])
    assert code == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err

def test_document_slice_from_a_recipe_and_the_command_line(tmp_path):
    from hybridtitan.config_manager import parse_config

    assert parse_config(["--job.config_file", RECIPE]).data.document_slice == [0.0, 1.0]
    assert parse_config(["--job.config_file", RECIPE]).data.document_slice_seed == 42
    recipe = tmp_path / "sliced.toml"
    recipe.write_text(open(RECIPE).read().replace("[data]\n", "[data]\ndocument_slice = [0, 0.2]\n", 1))
    cfg = parse_config(["--job.config_file", str(recipe)])
    assert cfg.data.document_slice == [0, 0.2] and cfg.data.sliced()
    cfg = parse_config(["--job.config_file", str(recipe), "--data.document_slice", "0.2,1.0",
                        "--data.document_slice_seed", "7"])
    assert cfg.data.document_slice == [0.2, 1.0] and cfg.data.document_slice_seed == 7
    assert not parse_config(["--job.config_file", RECIPE, "--data.document_slice", "0,1"]).data.sliced()

def test_no_arguments_prints_the_usage(capsys):
    code, err = main_error(capsys, [])
    assert code == 2 and err.startswith("usage: python -m hybridtitan.train --job.config_file RECIPE.toml"), err
    assert err.splitlines()[-1].startswith("error: give a recipe"), err

@pytest.mark.parametrize("argv,expected", [
    (["--model.n_layers", "12"], "hand-written pattern"),  # debug_hybrid's pattern is not the ratio's
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
     "selective_ac_option must be an integer N >= 1"),
    (["--data.text_field", "nope"], "data.text_field"),
    (["--checkpoint.async_mode", "async_with_pinned_mem"], "checkpoint.async_mode"),
    (["--compile.enable", "true", "--compile.components", "loss,nrom"],
     "--compile.components must be a comma-separated list of model, loss, norm or swiglu, got 'loss,nrom'"),
    (["--parallelism.fsdp_reshard_after_forward", "sometimes"],
     "--parallelism.fsdp_reshard_after_forward must be default, always or never, got 'sometimes'"),
    (["--training.gc_freq", "0"], "training.gc_freq must be 1 or more"),
    (["--training.max_norm", "-1"], "training.max_norm must be a positive number"),
    (["--optimizer.lr", "nan"], "optimizer.lr must be a positive number"),
    (["--optimizer.beta1", "1.5"], "optimizer.beta1 must be in [0, 1)"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay must be 0 or more"),
    (["--lr_scheduler.min_lr_factor", "2"], "lr_scheduler.min_lr_factor must be in [0, 1]"),
    (["--debug.seed", "-1"], "debug.seed must be in [0, 2**32)"),
    (["--profiling.enable_profiling", "--profiling.profiler_active", "0"], "profiling.profiler_active"),
    # in the keys and words the user typed; every key's choices from its type (job_config)
    (["--lr_scheduler.decay_type", "cosin"], "--lr_scheduler.decay_type must be linear, sqrt or cosine, got 'cosin'"),
    (["--checkpoint.async_mode", "async_with_pinned_mem"],
     "--checkpoint.async_mode must be disabled or async, got 'async_with_pinned_mem'"),
    (["--optimizer.name", "SGD"], "--optimizer.name must be AdamW or Adam, got 'SGD'"),
    (["--activation_checkpoint.mode", "selectiv"],
     "--activation_checkpoint.mode must be none, selective or full, got 'selectiv'"),
    (["--training.steps", "four"], "--training.steps must be an integer, got 'four'"),
    (["--optimizer.lr", "abc"], "--optimizer.lr must be a number, got 'abc'"),
    (["--training.steps"], "--training.steps needs a value"),
    (["--model.dim", "x"], "--model.dim must be an integer (or None), got 'x'"),
    (["--model.mamba2.d_state"], "--model.mamba2.d_state needs a value"),
    pytest.param(["--metrics.enable_wandb", "true"], "metrics.enable_wandb needs the wandb package",
                 marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb installed")),
])
def test_more_bad_input(tmp_path, capsys, argv, expected):
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(tmp_path / "d"), *argv])
    assert code == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err
    assert not (tmp_path / "d").exists()

def test_bad_input_subprocess_no_traceback(tmp_path):
    """The real command line: exit code 2, one stderr line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybridtitan.train", "--job.config_file", RECIPE, "--training.steps", "0",
         "--job.dump_folder", str(tmp_path / "d")], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: training.steps must be positive, got 0"], proc.stderr
    assert not (tmp_path / "d").exists()

def test_help_lists_the_supported_keys(capsys):
    """--help: hybridtitan's keys with their own descriptions, torchtitan's refused options left out."""
    from hybridtitan import describe
    from hybridtitan.config_manager import known_keys

    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    listed = {line.split()[0][2:] for line in out.splitlines() if line.startswith("  --")}
    model_sizes = {k for k in known_keys() if k.count(".") == 2 and k.startswith("model.")}
    assert listed == set(known_keys())  # every key the parser knows, and only those
    assert model_sizes and model_sizes <= listed
    assert {"training.loss_chunk_size", "data.document_boundaries", "model.pattern", "model.mla.kv_lora_rank",
            "checkpoint.last_save_model_only"} <= listed
    assert not {"parallelism.tensor_parallel_degree", "training.dataset", "job.custom_config_module"} & listed
    assert not any(key.startswith(("quantize.linear.mx.", "quantize.grouped_mm.", "fault_tolerance."))
                   for key in listed)
    assert "quantize.linear.float8.recipe_name" in listed
    assert {"validation.enable", "validation.freq", "validation.data.path", "eval.tasks"} <= listed
    assert "Tokens per chunk of the fused linear cross-entropy" in out  # the docstring of a merged-in key
    assert "--checkpoint.async_mode (disabled or async;" in out  # not torchtitan's async_with_pinned_mem
    with pytest.raises(SystemExit) as exc:
        describe.main(["--help"])
    assert exc.value.code == 0 and "python -m hybridtitan.describe --list" in capsys.readouterr().out


def test_schema_keeps_torchtitans_names_types_and_defaults():
    """The recipe schema is hybridtitan's own (hybridtitan.job_config), with torchtitan 0.2.2's sections, and its
    names, types and defaults where torchtitan has the key; every other key of torchtitan's is in TITAN_OPTIONS
    with torchtitan's type and default (refused when set to anything else)."""
    import typing
    from dataclasses import fields, is_dataclass

    from torchtitan.config import JobConfig as TitanJobConfig

    from hybridtitan.job_config import TITAN_OPTIONS, JobConfig

    def keys(cls, prefix=""):
        out, defaults, hints = {}, cls(), typing.get_type_hints(cls)
        for f in fields(cls):
            tp = hints[f.name]
            if is_dataclass(tp):
                out.update(keys(tp, f"{prefix}{f.name}."))
            else:
                out[f"{prefix}{f.name}"] = (tp, getattr(defaults, f.name))
        return out

    ours, theirs = keys(JobConfig), keys(TitanJobConfig)
    shared = set(ours) & set(theirs)
    assert len(shared) == 70, sorted(shared)  # torchtitan's keys the trainer reads
    # hybridtitan's own meaning and default
    overridden = {"model.name", "model.flavor", "validation.enable", "validation.freq", "validation.steps",
                  "validation.local_batch_size", "validation.seq_len", "checkpoint.last_save_model_only"}
    # the values hybridtitan implements, of those torchtitan's type admits: the same default, fewer choices
    narrowed = {"activation_checkpoint.mode", "checkpoint.async_mode", "compile.components", "optimizer.name"}

    def choices(tp):
        tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        return set(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else None

    for key in narrowed:
        (ours_tp, ours_default), (theirs_tp, theirs_default) = ours[key], theirs[key]
        assert ours_default == theirs_default and choices(ours_tp), key
        assert choices(theirs_tp) is None or choices(ours_tp) < choices(theirs_tp), key
    for key in shared - overridden - narrowed:
        assert ours[key] == theirs[key], key
    assert TITAN_OPTIONS == {key: value for key, value in theirs.items() if key not in ours}


def test_config_reference_is_current():
    """docs/config-reference.md is generated from the configuration's dataclasses: regenerate it (python -m
    hybridtitan.describe --config-reference > docs/config-reference.md) when a key changes."""
    from hybridtitan.config_manager import config_reference, known_keys

    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page.strip() == config_reference().strip()
    # every key the parser knows and hybridtitan reads has its row
    for key in ("training.eod_mask_loss", "validation.data.path", "eval.tasks", "model.mla.kv_lora_rank",
                "comm.train_timeout_seconds"):
        assert key in known_keys() and f"| `{key}` |" in page, key

def test_upcycling_stages_read_disjoint_slices():
    """The stage-1 recipes read [0.0, 0.2) of the data, the stage-2 ones [0.2, 1.0) of the same data in the same
    order (one path, one document_slice_seed): AMD's split of its SFT data, no document read by both stages."""
    from hybridtitan.config_manager import parse_config

    folder = ROOT / "train_configs" / "upcycle"
    stage1 = tuple(f"zebra_llama_{size}_ild_{kind}" for size in ("1B", "3B", "8B") for kind in ("mamba2", "mla")) + (
        "hylo_1B_ild_gdn",)
    stage2 = ("zebra_llama_1B_kl", "zebra_llama_3B_kl", "zebra_llama_8B_kl", "hylo_1B_kl_8k", "hylo_1B_kl_64k")
    stage3 = ("zebra_llama_1B_dpo",)  # DPO reads preference pairs (dpo.path), not [data]
    assert {p.stem for p in folder.glob("*.toml")} == set(stage1 + stage2 + stage3)
    data = {name: parse_config(["--job.config_file", str(folder / f"{name}.toml")], check_data=False).data
            for name in stage1 + stage2}
    for name in stage1:
        assert data[name].document_slice == [0.0, 0.2], name
    for name in stage2:
        assert data[name].document_slice == [0.2, 1.0], name
    assert len({(d.path, d.source, d.document_slice_seed) for d in data.values()}) == 1


def test_each_range_rule_lives_on_its_key_and_refuses_from_there():
    """Every key job_config gives a range rule (``ruled``): its default passes the rule, and a value outside it
    (-7 for a number, '' or 'x' for a string) is refused by parse_config in one line naming the rule's range."""
    import dataclasses

    from hybridtitan.config_manager import parse_config
    from hybridtitan.errors import ConfigError
    from hybridtitan.job_config import JobConfig

    ruled = [(section.name, f) for section in dataclasses.fields(JobConfig) if dataclasses.is_dataclass(section.type)
             for f in dataclasses.fields(section.type) if "rule" in f.metadata]
    assert len(ruled) >= 35
    for section, f in ruled:
        wanted, holds = f.metadata["rule"]
        assert holds(f.default), (section, f.name)
        bad = "-7" if f.type is not str else ("x" if holds("") else "")
        with pytest.raises(ConfigError) as refused:
            parse_config(["--job.config_file", RECIPE, f"--{section}.{f.name}", bad])
        assert str(refused.value).startswith(f"{section}.{f.name} must be {wanted}, got "), refused.value

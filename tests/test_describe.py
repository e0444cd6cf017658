"""python -m hybridtitan.describe: what a recipe builds, without building it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtitan import describe as describe_mod
from hybridtitan.models import build_model, get_flavor

ROOT = Path(__file__).resolve().parents[1]


def _json(capsys, argv):
    describe_mod.main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_json_counts_match_the_built_model(tmp_path, capsys):
    recipe = tmp_path / "m.toml"
    recipe.write_text('[model]\nflavor = "zebra_gdn_300M"\n')
    d = _json(capsys, ["--job.config_file", str(recipe)])
    model = build_model(get_flavor("zebra_gdn_300M"))  # meta device
    assert d["params_total"] == sum(p.numel() for p in model.parameters()) == 309280624
    assert d["params_non_embedding"] == d["params_total"] - model.embeddings.weight.numel()
    assert d["pattern"] == "*-M-M-M-*-M-M-M-*-M-M-M-"
    assert [layer["kind"] for layer in d["layers"]][:4] == ["attention", "mlp", "mixer", "mlp"]
    assert d["flops_per_token"] == pytest.approx(sum(layer["flops_per_token"] for layer in d["layers"])
                                                 + d["flops_per_token_output_layer"])
    assert d["flops_per_token"] > 6 * d["params_total"]  # weights plus attention and recurrence
    assert d["memory_estimate_gib"]["total"] > d["memory_estimate_gib"]["params_grads_optimizer"] > 0


def test_flavor_and_pattern_overrides(capsys):
    recipe = str(ROOT / "train_configs" / "debug_hybrid.toml")
    a = _json(capsys, ["--job.config_file", recipe, "--model.flavor", "gdn_300M"])
    assert a["params_total"] == 307767232 and a["pattern"] == "M-" * 12
    b = _json(capsys, ["--job.config_file", recipe, "--model.pattern", "*-M-"])
    assert b["pattern"] == "*-M-" and b["n_layers"] == 4
    # a deeper zebra keeps its attention: the pattern is rebuilt with the flavor's attention ratio
    c = _json(capsys, ["--job.config_file", recipe, "--model.flavor", "zebra_gdn_300M", "--model.n_layers", "32"])
    assert c["pattern"] == "*-M-M-M-" * 4
    # attention is quadratic in the sequence, the mixers linear: a longer sequence costs the attention more
    short = _json(capsys, ["--job.config_file", recipe, "--training.seq_len", "512"])
    long = _json(capsys, ["--job.config_file", recipe, "--training.seq_len", "4096"])
    for s, lg in zip(short["layers"], long["layers"]):
        if s["kind"] == "attention":
            assert lg["flops_per_token"] > s["flops_per_token"]
        else:
            assert lg["flops_per_token"] == s["flops_per_token"]


def test_table_output(capsys):
    describe_mod.main(["--model.flavor", "debug_kda"])
    out = capsys.readouterr().out
    assert "pattern M-M-" in out and "memory estimate" in out and "GFLOP/token" in out


@pytest.mark.parametrize("argv,expected", [
    (["--model.flavor", "nope"], "model.flavor 'nope' is unknown"),
    (["--model.pattern", "*-Q-"], "position 2"),
    (["--model.mixer", "rwkv"], "model.mixer 'rwkv'"),
])
def test_bad_input_one_line_exit_2(argv, expected):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "hybridtitan.describe", *argv, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("argv,expected", [
    # a sublayer kind the flavor lacks would get the 300M defaults at another width: refused unless sized
    (["--model.flavor", "gdn_1B", "--model.pattern=*-M-M-M-"], "'gdn_1B' has no attention, so model.mla.*"),
    (["--model.flavor", "debug_gdn", "--model.mixer", "kda"], "'debug_gdn' has no kda mixers, so model.kda.*"),
    (["--model.pattern=--------"], "has no attention ('*') or mixer ('M') sublayer"),
    (["--model.pattern="], "model.pattern is empty"),
    (["--model.pattern", "-M-M"], "give it as --model.pattern=-M-M"),
])
def test_bad_model_shapes_in_process(capsys, argv, expected):
    with pytest.raises(SystemExit) as exc:
        describe_mod.main(["--model.flavor", "debug_hybrid", *argv, "--json"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err


def test_a_flavor_given_the_sizes_of_a_kind_it_lacks(capsys):
    """With some of the section's keys given, the new kind is built as asked (and at dim 1024 the defaults fit)."""
    d = _json(capsys, ["--model.flavor", "gdn_1B", "--model.mixer", "kda", "--model.kda.num_heads", "16"])
    assert d["params_total"] == _json(capsys, ["--model.flavor", "kda_1B"])["params_total"]  # the same shapes
    z = _json(capsys, ["--model.flavor", "gdn_300M", "--model.pattern=*-M-M-M-*-M-M-M-*-M-M-M-"])
    assert z["params_total"] == _json(capsys, ["--model.flavor", "zebra_gdn_300M"])["params_total"]


def test_loss_chunk_estimate_follows_the_chunk_kernel(capsys):
    """One chunk of bf16 logits: overwritten by its gradient in our GPU kernel (the recipes), a second chunk for
    the gradient when the chunks are compiled, a float32 copy on top when they run eagerly (float32 runs)."""
    recipe = str(ROOT / "train_configs" / "gdn_300M.toml")
    chunk = 4096 * 128256 / 2**30

    def loss_gib(*overrides):
        return _json(capsys, ["--job.config_file", recipe, *overrides])["memory_estimate_gib"]["loss_chunk"]

    assert loss_gib() == pytest.approx(2 * chunk)
    assert loss_gib("--compile.components", "loss,norm") == pytest.approx(4 * chunk)
    assert loss_gib("--training.mixed_precision_param", "float32") == pytest.approx(8 * chunk)


def test_context_parallel_estimate_holds_a_ranks_part(capsys):
    """Under context parallelism a rank holds seq_len / degree tokens of each row, and FSDP shards the states over
    the data and context ranks together: at degree 4 the activations are a quarter and the states are sharded 4
    times as wide as at degree 1; the assumptions say so."""
    recipe = str(ROOT / "train_configs" / "gdn_1B.toml")
    base = ["--job.config_file", recipe, "--parallelism.data_parallel_shard_degree", "2"]
    one = _json(capsys, base)["memory_estimate_gib"]
    four = _json(capsys, [*base, "--parallelism.context_parallel_degree", "4"])["memory_estimate_gib"]
    assert four["activations"] == pytest.approx(one["activations"] / 4)
    assert four["params_grads_optimizer"] == pytest.approx(one["params_grads_optimizer"] / 4)
    assert "sharded over 8 rank(s)" in four["assumes"] and "context parallel 4: 512 tokens" in four["assumes"]
    assert "context parallel" not in one["assumes"]


def test_no_arguments_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        describe_mod.main([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: python -m hybridtitan.describe"), err
    assert err.splitlines()[-1] == "error: give a recipe (train_configs/*.toml) or --list"


@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("train_configs/**/*.toml")))
def test_every_recipe_describes(recipe):
    """Every shipped recipe parses and builds its model's plan (the upcycling recipes' teachers and data are not
    here: describe leaves the teacher out and says so)."""
    from hybridtitan.config_manager import parse_config
    from hybridtitan.describe import describe

    d = describe(parse_config(["--job.config_file", str(ROOT / recipe)], check_data=False))
    assert d["params_total"] > 0 and d["memory_estimate_gib"]["total"] > 0
    if "upcycle/" in recipe:
        assert "is left out" in d["memory_estimate_gib"]["assumes"]


def _launch_commands() -> list[tuple[str, int, list[str]]]:
    """(where, ranks, trainer arguments) of every torchrun and sbatch line of README.md and docs/ that names a
    recipe: torchrun's --nproc_per_node x --nnodes, sbatch's --nodes (train.sbatch's 2 by default) x 8 GPUs."""
    import re
    import shlex

    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # continued lines joined
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#")[0].strip().strip("`")
            if "--job.config_file" not in line and "train.sbatch" not in line:
                continue
            words = shlex.split(line)
            if "torchrun" in words and "hybridtitan.train" in words:
                opts = dict(zip(words, words[1:]))
                ranks = int(opts.get("--nproc_per_node", opts.get("--nproc-per-node", 1))) * int(
                    opts.get("--nnodes", 1))
                args = words[words.index("hybridtitan.train") + 1:]
            elif "sbatch" in words and "scripts/slurm/train.sbatch" in words:
                at = words.index("scripts/slurm/train.sbatch")
                opts = dict(zip(words[:at], words[1:at]))
                ranks = int(opts.get("--nodes", 2)) * 8
                args = ["--job.config_file", *words[at + 1:]]
            else:
                continue
            if "--job.config_file" in args and "RECIPE" not in " ".join(args) and "PATH" not in " ".join(args):
                found.append((f"{path.name}:{n}", ranks, args))
    return found


def test_every_launch_line_of_the_docs_plans_for_its_gpus():
    """Each torchrun or sbatch line of the README and the docs that names a recipe and a number of GPUs has batch
    arithmetic that holds on them (the global batch divides into local batches of every rank): a line that fails
    after the queue wait, as Slurm's used to, cannot be published."""
    from hybridtitan.config_manager import parse_config
    from hybridtitan.describe import batch_plan

    commands = _launch_commands()
    assert any(where.startswith("README.md") and ranks == 32 for where, ranks, _ in commands), commands
    for where, ranks, args in commands:
        cfg = parse_config(args, check_data=False)
        plan = batch_plan(cfg, ranks)
        assert plan["ok"], (where, ranks, plan)


def test_plan_for_gpus_and_check(capsys):
    """describe --nodes / --world-size plans the run: the layout, the arithmetic and the local batch that would
    work; --check exits with code 2 where the plan does not hold (train.sbatch runs it before any rank)."""
    from hybridtitan.describe import main

    recipe = str(ROOT / "train_configs" / "zebra_llama_3B.toml")
    MOCK = ["--data.source", "mock", "--validation.enable", "false"]
    with pytest.raises(SystemExit) as exc:
        main(["--job.config_file", recipe, "--nodes", "4", "--check", *MOCK])
    out = capsys.readouterr()
    assert exc.value.code == 2 and "the plan for 32 GPUs does not hold" in out.err
    assert "plan for 32 GPUs (4 nodes x 8): data parallel replicate 1 x shard 32" in out.out
    assert "use --training.local_batch_size 1 (gradient accumulation 1)" in out.out
    assert "memory estimate per device, local batch 1 x 8192" in out.out  # at the batch that would run, 32 shards
    main(["--job.config_file", recipe, "--nodes", "4", "--check", *MOCK, "--training.local_batch_size", "1"])
    assert "local batch 1, gradient accumulation 1: OK" in capsys.readouterr().out
    main(["--job.config_file", recipe, "--world-size", "4", *MOCK])
    assert "local batch 4, gradient accumulation 2: OK" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--job.config_file", recipe, "--world-size", "64", "--check", *MOCK])
    assert "the global batch is smaller than the 64 data-parallel ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the data, as the trainer checks it
        main(["--job.config_file", recipe, "--world-size", "8", "--check"])
    assert "data: data.path: no Megatron .idx file matches" in capsys.readouterr().out


def test_an_8B_teacher_on_a_node_of_eight_is_read_an_eighth_a_rank(tmp_path, capsys):
    """The host memory a rank holds while it reads a teacher (model_loader.load_into_shards): its shard and a
    tensor in flight, not the whole 8B (a folder of config.json alone: describe reads no weights)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    recipe = str(ROOT / "train_configs" / "upcycle" / "zebra_llama_1B_kl.toml")
    shards = {}
    for n in (1, 8):
        shards[n] = _json(capsys, ["--job.config_file", recipe, "--distill.teacher", str(tmp_path),
                                   "--parallelism.data_parallel_shard_degree", str(n)])["memory_estimate_gib"]
    whole = 8_030_261_248 * 2 / 2**30
    assert shards[8]["teacher_whole"] == pytest.approx(whole)
    embedding = 2 * 128256 * 4096 * 2 / 2**30
    assert shards[8]["teacher_host_while_loading"] == pytest.approx(whole / 8 + embedding)
    assert shards[1]["teacher_host_while_loading"] == pytest.approx(whole + embedding)

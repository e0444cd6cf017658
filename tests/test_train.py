"""The trainer, for real: torchrun with 2 processes over gloo, FSDP2, DCP folders, resume, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridtitan import train as train_mod
from hybridtitan.checkpoint import complete_steps, load_model

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "train_configs" / "debug_hybrid.toml")
# small and quick: 2 x 128 tokens per rank and step
QUICK = ["--training.seq_len", "128", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_train(dump: Path, *extra: str, nproc: int = 2, check: bool = True, timeout: int = 600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "hybridtitan.train", "--job.config_file", RECIPE, "--job.dump_folder", str(dump), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def losses(dump: Path) -> dict[int, float]:
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def state(dump: Path, step: int) -> dict[str, torch.Tensor]:
    model, _ = load_model(str(dump / "checkpoint" / f"step-{step}"))
    return model.state_dict()


def test_debug_recipe_trains(tmp_path):
    """The recipe as shipped, on 2 processes: the loss it reports after 200 steps (the mean over its last log
    window, steps 191-200) is below 60% of the first step's loss."""
    dump = tmp_path / "run"
    run_train(dump, "--checkpoint.enable", "false", timeout=1800)
    loss = losses(dump)
    assert min(loss) == 1 and max(loss) == 200
    assert loss[200] < 0.6 * loss[1], (loss[1], loss[200])


def test_exact_resume_and_reshard(tmp_path):
    """20 steps straight == 10 steps, stop, resume to 20 (bitwise: every loss of steps 11-20 and the weights).
    A checkpoint saved on 2 ranks then resumes on 1 rank and the loss carries on."""
    straight, resumed2 = tmp_path / "straight", tmp_path / "resumed"
    common = [*QUICK, "--checkpoint.enable", "true", "--checkpoint.interval", "10", "--lr_scheduler.total_steps", "20"]
    run_train(straight, *common, "--training.steps", "20")
    # the resumed run: first 10 steps, a stop, then a second launch from the step-10 checkpoint
    run_train(resumed2, *common, "--training.steps", "10")
    assert complete_steps(str(resumed2 / "checkpoint")) == [10]
    run_train(resumed2, *common, "--training.steps", "20")
    a, b = losses(straight), losses(resumed2)
    for step in range(11, 21):
        assert a[step] == b[step], (step, a[step], b[step])
    sa, sb = state(straight, 20), state(resumed2, 20)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key

    # 2 ranks -> 1 rank: runs, continues the curve (not bitwise)
    one = tmp_path / "one_rank"
    os.makedirs(one / "checkpoint")
    os.symlink(straight / "checkpoint" / "step-20", one / "checkpoint" / "step-20")
    run_train(one, *QUICK, "--training.global_batch_size", "4", "--training.steps", "26",
              "--checkpoint.enable", "true", "--checkpoint.interval", "100", nproc=1)
    after = losses(one)
    assert min(after) == 21 and max(after) == 26
    assert all(v == v and v < a[1] for v in after.values())  # finite and below the initial loss
    assert abs(after[21] - a[20]) < 0.5 * a[20]


def test_keep_latest_k_and_partial_save_ignored(tmp_path):
    dump = tmp_path / "run"
    run_train(dump, *QUICK, "--training.steps", "8", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "2", nproc=1)
    ckpt = dump / "checkpoint"
    assert complete_steps(str(ckpt)) == [6, 8]
    assert (ckpt / "latest").read_text().strip() == "step-8"
    assert (ckpt / "step-8" / "model_args.json").is_file()
    # an interrupted save leaves a .partial folder: resume ignores it and takes step 8; the next save clears it
    (ckpt / "step-10.partial").mkdir()
    proc = run_train(dump, *QUICK, "--training.steps", "9", "--checkpoint.enable", "true",
                     "--checkpoint.interval", "100", "--optimizer.lr", "0.0123", nproc=1)
    assert "resumed from" in proc.stdout and "step-8" in proc.stdout
    assert max(losses(dump)) == 9
    assert complete_steps(str(ckpt)) == [8, 9] and not list(ckpt.glob("*.partial"))
    assert "optimizer.lr 0.0123 differs from the resumed schedule's" in proc.stdout + proc.stderr
    # a resume onto other data: one line, exit code 2
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"another corpus, document {i}. " * 8}) + "\n" for i in range(30)))
    proc = subprocess.run([sys.executable, "-m", "hybridtitan.train", "--job.config_file", RECIPE, "--job.dump_folder",
                           str(dump), *QUICK, "--training.steps", "10", "--checkpoint.enable", "true", "--data.path",
                           str(other)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "cannot resume from the checkpoint" in errors[0] and "other data" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_resumed_run_sets_aside_the_metrics_of_steps_it_trains_again(tmp_path):
    """A run killed after step 12 whose last checkpoint is step 8 trains steps 9-12 again: their first records (and
    a line the kill cut short) move to metrics.superseded.jsonl, so metrics.jsonl holds each step once."""
    from hybridtitan.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 13)) + '{"step": 1')
    logger = MetricsLogger(str(tmp_path), rank=0, total_steps=20, flops_per_token=1.0, device=torch.device("cpu"),
                           enable_tensorboard=False, tb_folder="tb", enable_wandb=False, start_step=8)
    logger.log(9, loss=0.5, grad_norm=1.0, lr=1e-3, tokens_per_step=8, window_steps=1, window_time=1.0,
               tokens_seen=72, skipped_steps=0)
    logger.close()
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in kept] == [*range(1, 10)] and kept[-1]["loss"] == 0.5
    superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:4]] == [9, 10, 11, 12]
    assert superseded[4:] == ['{"step": 1']
    # a resume that trains nothing again leaves the file as it is
    before = path.read_text()
    MetricsLogger(str(tmp_path), rank=0, total_steps=20, flops_per_token=1.0, device=torch.device("cpu"),
                  enable_tensorboard=False, tb_folder="tb", enable_wandb=False, start_step=9).close()
    assert path.read_text() == before and len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 5


def test_resumed_run_hides_the_tensorboard_events_of_steps_it_trains_again(tmp_path):
    """TensorBoard, as metrics.jsonl: after a resume from step 8 of a run that logged steps 1-12, each step shows
    once, steps 9-10 with the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridtitan.metrics import MetricsLogger

    def run(start_step, steps, loss):
        logger = MetricsLogger(str(tmp_path), rank=0, total_steps=20, flops_per_token=1.0, device=torch.device("cpu"),
                               enable_tensorboard=True, tb_folder="tb", enable_wandb=False, start_step=start_step)
        for s in steps:
            logger.log(s, loss=loss(s), grad_norm=1.0, lr=1e-3, tokens_per_step=8, window_steps=1, window_time=1.0,
                       tokens_seen=8 * s, skipped_steps=0)
        logger.close()

    run(0, range(1, 13), lambda s: 10.0 - s)
    run(8, range(9, 11), lambda s: 100.0 + s)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    shown = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(shown) == [*range(1, 11)], shown
    assert shown[8] == 2.0 and shown[9] == 109.0 and shown[10] == 110.0


def test_async_checkpoints_complete_and_resume(tmp_path):
    """checkpoint.async_mode = async: saves finish in the background, are renamed once complete, and resume."""
    dump = tmp_path / "run"
    common = [*QUICK, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.async_mode",
              "async", "--checkpoint.keep_latest_k", "0"]
    run_train(dump, *common, "--training.steps", "6", "--checkpoint.enable_first_step_checkpoint", "true")
    assert complete_steps(str(dump / "checkpoint")) == [1, 2, 4, 6]
    assert not list((dump / "checkpoint").glob("*.partial"))
    # resumes from step 6; the data loader's position is left out on request (the data restarts)
    proc = run_train(dump, *common, "--training.steps", "8", "--checkpoint.exclude_from_loading", "dataloader")
    assert "step-6" in proc.stdout and max(losses(dump)) == 8


def test_async_checkpoint_is_complete_as_soon_as_it_is_written(tmp_path):
    """A background save renames its step folder (and names it in `latest`) when its write ends, not at the next
    save or at the end of the run: a crash in between would otherwise lose it."""
    from hybridtitan.checkpoint import CheckpointManager
    from hybridtitan.models import build_model, get_flavor

    args = get_flavor("debug_gdn")
    model = build_model(args, "cpu")
    with torch.no_grad():
        model.init_weights()
    folder = tmp_path / "checkpoint"
    ckpt = CheckpointManager(str(folder), model=model, optimizer=None, lr_scheduler=None, dataloader=None,
                             train_state=None, dp_rank=0, dp_world_size=1, model_args=args, job_config={},
                             interval=2, async_mode="async")
    ckpt.save(2, model_only=True)
    deadline = time.monotonic() + 120
    while complete_steps(str(folder)) != [2] and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert complete_steps(str(folder)) == [2], os.listdir(folder)
        assert (folder / "latest").read_text().strip() == "step-2"
        assert ckpt._pending is not None  # nobody waited for it
    finally:
        ckpt.close()
    loaded, _ = load_model(str(folder / "step-2"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_gradient_accumulation_matches_larger_batch(tmp_path):
    """local batch 2 x 2 accumulation steps == local batch 4 (same data, same update, up to rounding)."""
    big, acc = tmp_path / "big", tmp_path / "acc"
    base = [*QUICK, "--training.steps", "3", "--checkpoint.enable", "false"]
    run_train(big, *base, "--training.local_batch_size", "4", "--training.global_batch_size", "4", nproc=1)
    run_train(acc, *base, "--training.local_batch_size", "2", "--training.global_batch_size", "4", nproc=1)
    lb, la = losses(big), losses(acc)
    for step in (1, 2, 3):
        assert abs(lb[step] - la[step]) < 1e-4 * lb[step], (step, lb[step], la[step])


def test_hsdp_replicate_mesh(tmp_path):
    dump = tmp_path / "hsdp"
    proc = run_train(dump, *QUICK, "--training.steps", "3", "--checkpoint.enable", "true",
                     "--checkpoint.interval", "3", "--parallelism.data_parallel_replicate_degree", "2")
    assert "replicate 2 x shard 1" in proc.stdout
    assert complete_steps(str(dump / "checkpoint")) == [3]


# Loaded at the start of every Python process of a run (PYTHONPATH): the training loss becomes NaN at the
# listed forward calls of each rank, so those steps' gradients are not finite.
_NAN_INJECTOR = """
import os
_steps = {int(s) for s in os.environ["HT_TEST_NAN_CALLS"].split(",")}
from hybridtitan.models import model as _m
_forward, _calls = _m.HybridLM.forward, [0]
def _forward_with_nan(self, *args, **kwargs):
    out = _forward(self, *args, **kwargs)
    if kwargs.get("labels") is not None:
        _calls[0] += 1
        if _calls[0] in _steps:
            out = out * float("nan")
    return out
_m.HybridLM.forward = _forward_with_nan
"""


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_nonfinite_gradients_skip_the_update(tmp_path, monkeypatch, implementation):
    """Steps 3 and 4 get NaN gradients: neither changes the weights (step 4's checkpoint equals step 2's), each
    is logged and counted, and training carries on with finite losses. "fused" skips on the device (the fused
    AdamW's found_inf; the host learns of it a step later), "foreach" on the host."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_NAN_INJECTOR)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(inject), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HT_TEST_NAN_CALLS", "3,4")
    dump = tmp_path / "run"
    proc = run_train(dump, *QUICK, "--training.steps", "6", "--checkpoint.enable", "true",
                     "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
                     "--optimizer.implementation", implementation)
    assert "step 3: non-finite gradient norm nan, update skipped" in proc.stdout
    assert "step 4: non-finite gradient norm nan, update skipped" in proc.stdout
    records = {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [1, 2, 5, 6]  # a window whose every update was skipped logs nothing
    assert records[2]["skipped_steps"] == 0 and records[6]["skipped_steps"] == 2
    assert all(r["loss"] == r["loss"] for r in records.values())  # finite: the skipped steps are not averaged in
    s2, s4, s6 = state(dump, 2), state(dump, 4), state(dump, 6)
    assert all(torch.equal(s2[k], s4[k]) for k in s2)
    assert not all(torch.equal(s4[k], s6[k]) for k in s4)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_sigterm_to_one_rank_saves_and_stops_all(tmp_path):
    """A signal reaches one worker of two: both agree to stop after the same step, save it and exit cleanly."""
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "hybridtitan.train", "--job.config_file", RECIPE, "--job.dump_folder", str(dump), *QUICK,
           "--training.steps", "100000", "--checkpoint.enable", "true", "--checkpoint.interval", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not (dump / "metrics.jsonl").exists() or len((dump / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.5)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGTERM)  # one rank only
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    steps = complete_steps(str(dump / "checkpoint"))
    assert len(steps) == 1 and steps[0] == max(losses(dump)) >= 3
    assert out.count("stopped at step") == 2  # both ranks, one line each


def test_sigterm_to_the_process_group_with_loader_workers_saves(tmp_path):
    """SIGTERM to the whole process group (job control, `kill -- -PGID`) with data.num_workers > 0: the loader's
    workers, in process groups of their own, do not die of it first, so the run saves and stops cleanly."""
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridtitan.train", "--job.config_file", RECIPE, "--job.dump_folder", str(dump),
           *QUICK, "--training.local_batch_size", "4", "--training.steps", "100000", "--checkpoint.enable", "true",
           "--checkpoint.interval", "100000", "--data.num_workers", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (dump / "metrics.jsonl").exists() or len((dump / "metrics.jsonl").read_text().splitlines()) < 3:
            assert time.time() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # never leave a 100000-step run behind
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert complete_steps(str(dump / "checkpoint")) == [max(losses(dump))]


# ----------------------------------------------------------------------------------------------- bad input

BAD_TOML = {
    "syntax": "[training\nsteps = 3\n",
    "unknown_section": "[trainingg]\nsteps = 3\n",
    "unknown_key": "[training]\nstepz = 3\n",
    "wrong_type": '[training]\nsteps = "many"\n',
}


def _main_error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        train_mod.main(argv)
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


@pytest.mark.parametrize("case", sorted(BAD_TOML))
def test_bad_toml(tmp_path, capsys, case):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(BAD_TOML[case])
    code, err = _main_error(capsys, ["--job.config_file", str(recipe), "--job.dump_folder", str(tmp_path / "d")])
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err, err
    assert {"syntax": "TOML syntax error", "unknown_section": "unknown section 'trainingg'",
            "unknown_key": "unknown key 'training.stepz' in section [training] (did you mean 'training.steps'?)",
            "wrong_type": "training.steps must be int"}[case] in err
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
    code, err = _main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(dump), *argv])
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and expected in err and "helptext" not in err, err
    assert {p: p.stat().st_mtime_ns for p in dump.rglob("*")} == before


def test_no_arguments_prints_the_usage(capsys):
    code, err = _main_error(capsys, [])
    assert code == 2 and err.startswith("usage: python -m hybridtitan.train --job.config_file RECIPE.toml"), err
    assert err.splitlines()[-1].startswith("error: give a recipe"), err


def _fake_step(folder: Path, step: int, flavor: str) -> None:
    """A step folder whose model_args.json says ``flavor`` (enough for the checks before training)."""
    from hybridtitan.checkpoint import model_args_to_dict
    from hybridtitan.models import get_flavor

    d = folder / "checkpoint" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    (d / "model_args.json").write_text(json.dumps(model_args_to_dict(get_flavor(flavor))))


def test_checkpoint_checks_before_training(tmp_path, capsys):
    base = ["--job.config_file", RECIPE, "--checkpoint.enable", "true"]
    # the checkpoint a run would resume from holds another model
    other = tmp_path / "other"
    _fake_step(other, 5, "debug_gdn")
    code, err = _main_error(capsys, [*base, "--job.dump_folder", str(other)])
    assert code == 2 and "holds a different model than the recipe" in err and "\n" not in err
    # rewinding with load_step while newer checkpoints exist
    rewind = tmp_path / "rewind"
    _fake_step(rewind, 5, "debug_hybrid")
    _fake_step(rewind, 7, "debug_hybrid")
    code, err = _main_error(capsys, [*base, "--job.dump_folder", str(rewind), "--checkpoint.load_step", "5"])
    assert code == 2 and "older than step(s) 7" in err
    code, err = _main_error(capsys, [*base, "--job.dump_folder", str(rewind), "--checkpoint.load_step", "6"])
    assert code == 2 and "step 6 not found" in err


def test_model_only_last_checkpoint_is_not_resumed(tmp_path, capsys):
    """A model-only step after full ones (checkpoint.last_save_model_only) ends a run: resuming from it would
    restart at step 0 below the full checkpoints. Refused before anything is touched."""
    import torch.distributed.checkpoint as dcp

    from hybridtitan.checkpoint import model_args_to_dict
    from hybridtitan.models import get_flavor

    dump = tmp_path / "run"
    step = dump / "checkpoint" / "step-4"
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(step), no_dist=True)
    (step / "model_args.json").write_text(json.dumps(model_args_to_dict(get_flavor("debug_hybrid"))))
    before = {p: p.stat().st_mtime_ns for p in dump.rglob("*")}
    code, err = _main_error(capsys, ["--job.config_file", RECIPE, "--checkpoint.enable", "true",
                                     "--job.dump_folder", str(dump)])
    assert code == 2 and "holds only the model" in err and "initial_load_path" in err and "\n" not in err, err
    assert {p: p.stat().st_mtime_ns for p in dump.rglob("*")} == before


@pytest.mark.parametrize("argv,expected", [
    (["--model.n_layers", "12"], "hand-written pattern"),  # debug_hybrid's pattern is not the ratio's
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
     "selective_ac_option must be an integer N >= 1"),
    (["--data.text_field", "nope"], "data.text_field"),
    (["--checkpoint.async_mode", "async_with_pinned_mem"], "checkpoint.async_mode"),
    (["--compile.enable", "true", "--compile.components", "loss,nrom"],
     "must name some of model, loss, norm and swiglu"),
    (["--parallelism.fsdp_reshard_after_forward", "sometimes"], "invalid choice 'sometimes'"),
    (["--training.gc_freq", "0"], "training.gc_freq must be 1 or more"),
    (["--training.max_norm", "-1"], "training.max_norm must be a positive number"),
    (["--optimizer.lr", "nan"], "optimizer.lr must be a positive number"),
    (["--optimizer.beta1", "1.5"], "optimizer.beta1 must be in [0, 1)"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay must be 0 or more"),
    (["--lr_scheduler.min_lr_factor", "2"], "lr_scheduler.min_lr_factor must be in [0, 1]"),
    (["--debug.seed", "-1"], "debug.seed must be in [0, 2**32)"),
    (["--profiling.enable_profiling", "--profiling.profiler_active", "0"], "profiling.profiler_active"),
    # tyro's messages, in the keys and words the user typed
    (["--lr_scheduler.decay_type", "cosin"], "invalid choice 'cosin' for argument '--lr_scheduler.decay_type'"),
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
    code, err = _main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(tmp_path / "d"), *argv])
    assert code == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err
    assert not (tmp_path / "d").exists()


def test_bad_input_subprocess_no_traceback(tmp_path):
    """The real command line: exit code 2, one stderr line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybridtitan.train", "--job.config_file", RECIPE, "--training.steps", "0",
         "--job.dump_folder", str(tmp_path / "d")], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: training.steps must be positive, got 0"], proc.stderr
    assert not (tmp_path / "d").exists()


def test_help_lists_the_supported_keys(capsys):
    """--help: hybridtitan's keys with their own descriptions, torchtitan's refused options left out."""
    from hybridtitan import describe
    from hybridtitan.config import SUPPORTED_TITAN_KEYS, _check_cli

    with pytest.raises(SystemExit) as exc:
        train_mod.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    listed = {line.split()[0][2:] for line in out.splitlines() if line.startswith("  --")}
    _check_cli([f"--{key}" for key in listed])  # every key listed is one the parser knows
    for section, keys in SUPPORTED_TITAN_KEYS.items():
        assert {f"{section}.{k}" for k in keys} <= listed
    assert {"training.loss_chunk_size", "data.document_boundaries", "model.pattern", "model.mla.kv_lora_rank",
            "checkpoint.last_save_model_only"} <= listed
    assert not {"parallelism.tensor_parallel_degree", "training.dataset", "job.custom_config_module"} & listed
    assert not any(key.startswith(("quantize.", "validation.", "fault_tolerance.")) for key in listed)
    assert "Tokens per chunk of the fused linear cross-entropy" in out  # the docstring of a merged-in key
    assert "--checkpoint.async_mode (disabled or async;" in out  # not torchtitan's async_with_pinned_mem
    with pytest.raises(SystemExit) as exc:
        describe.main(["--help"])
    assert exc.value.code == 0 and "python -m hybridtitan.describe --list" in capsys.readouterr().out


def test_lr_schedule_held_at_its_floor_past_its_end():
    """Past lr_scheduler.total_steps torchtitan's decay goes on below lr * min_lr_factor, to negative rates; ours
    holds the floor there and is torchtitan's schedule everywhere else (warm-up included)."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    from hybridtitan.config import parse_config
    from hybridtitan.optim import build_lr_scheduler

    cfg = parse_config(["--job.config_file", RECIPE, "--training.steps", "30", "--lr_scheduler.total_steps", "12",
                        "--lr_scheduler.warmup_steps", "4", "--lr_scheduler.min_lr_factor", "0.1",
                        "--lr_scheduler.decay_type", "linear"], check_data=False)

    def rates(build):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = build(opt)
        out = []
        for _ in range(30):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out, sched

    ours, sched = rates(lambda opt: build_lr_scheduler(opt, cfg))
    titan, _ = rates(lambda opt: build_lr_schedulers([opt], cfg.lr_scheduler, cfg.training.steps))
    assert min(titan) < 0  # what is fixed
    assert ours[:12] == titan[:12] and ours[0] == pytest.approx(0.25)  # warm-up from lr/4, decay as torchtitan's
    assert ours[12:] == [pytest.approx(0.1)] * 18
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{}]  # nothing of the wrapper in checkpoints
    # a schedule left no decay steps (a warm-up as long as the schedule): flat past its end, where torchtitan's
    # fails an assertion
    flat = parse_config(["--job.config_file", RECIPE, "--training.steps", "30", "--lr_scheduler.total_steps", "12",
                         "--lr_scheduler.warmup_steps", "12"], check_data=False)
    ours, _ = rates(lambda opt: build_lr_scheduler(opt, flat))
    assert ours[11:] == [pytest.approx(1.0)] * 19
    with pytest.raises(AssertionError):
        rates(lambda opt: build_lr_schedulers([opt], flat.lr_scheduler, flat.training.steps))


def test_resume_keeps_the_checkpoints_schedule_when_the_run_grows(tmp_path):
    """A schedule that follows training.steps, resumed with more steps: the checkpoint's schedule goes on (held at
    its floor past its end), said in a warning, and the job config of the next checkpoints records the shape in
    force. Rebuilt from the new length instead, the rate would jump from the floor back to its peak."""
    dump = tmp_path / "run"
    args = [*QUICK, "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.min_lr_factor", "0.1", "--checkpoint.enable",
            "true", "--checkpoint.interval", "100"]
    run_train(dump, *args, "--training.steps", "4", nproc=1)
    proc = run_train(dump, *args, "--training.steps", "7", nproc=1)
    assert "lr_scheduler: total_steps 7 (checkpoint: 4): the checkpoint's schedule goes on" in proc.stdout + proc.stderr
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}
    peak = lrs[2]
    assert [lrs[5], lrs[6], lrs[7]] == [pytest.approx(0.1 * peak)] * 3  # rebuilt for 7 steps: the peak again
    saved = json.loads((dump / "checkpoint" / "step-7" / "job_config.json").read_text())["lr_scheduler"]
    assert saved["total_steps"] == 4
    # the same resume with an unchanged shape says nothing about the schedule
    proc = run_train(dump, *args, "--training.steps", "8", "--lr_scheduler.total_steps", "4", nproc=1)
    assert "lr_scheduler:" not in proc.stdout + proc.stderr


def test_resume_with_parts_left_out_steps_at_the_schedules_rate(tmp_path):
    """checkpoint.exclude_from_loading: a new schedule on a resumed optimizer starts at its own first rate, and a
    fresh optimizer on a resumed schedule takes the schedule's rate (neither the other part's); a checkpoint of
    another data.num_workers, and one put directly in checkpoint/ (not in a step-N folder), are refused in a line."""
    import shutil

    def lrs(dump):
        return {r["step"]: r["lr"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}

    args = [*QUICK, "--lr_scheduler.warmup_steps", "3", "--checkpoint.enable", "true", "--checkpoint.interval", "4",
            "--training.steps", "6"]
    straight = tmp_path / "straight"
    run_train(straight, *args, nproc=1)
    ref = lrs(straight)
    assert len({ref[1], ref[2], ref[5]}) == 3

    def resumed(name: str, *extra: str, check: bool = True):
        dump = tmp_path / name
        shutil.copytree(straight / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
        return dump, run_train(dump, *args, *extra, nproc=1, check=check)

    dump, _ = resumed("new_schedule", "--checkpoint.exclude_from_loading", "lr_scheduler")
    assert [lrs(dump)[5], lrs(dump)[6]] == [pytest.approx(ref[1]), pytest.approx(ref[2])]
    dump, _ = resumed("new_optimizer", "--checkpoint.exclude_from_loading", "optimizer")
    assert [lrs(dump)[5], lrs(dump)[6]] == [pytest.approx(ref[5]), pytest.approx(ref[6])]
    _, proc = resumed("restart", "--checkpoint.exclude_from_loading", "train_state", check=False)
    assert proc.returncode != 0 and "train_state restarts the step count at 0" in proc.stderr, proc.stderr[-2000:]
    _, proc = resumed("workers", "--data.num_workers", "1", check=False)
    assert proc.returncode != 0  # torchrun's own code: the rank's is 2
    assert "the checkpoint's data.num_workers is 0, this run's 1" in proc.stderr, proc.stderr[-2000:]
    # a changed data order does not reach a resumed data loader: said, not silent
    _, proc = resumed("reseeded", "--debug.seed", "7", "--data.shuffle", "false")
    log = proc.stdout + proc.stderr
    assert "debug.seed 7 (checkpoint:" in log and "data.shuffle False (checkpoint: True)" in log, log
    # the run's own checkpoint comes before an initial_load_path, and the log says so
    _, proc = resumed("own_first", "--checkpoint.initial_load_path", str(straight / "checkpoint"))
    log = proc.stdout + proc.stderr
    assert "is ignored: the run's own checkpoint folder holds step 4" in log and "resumed from" in log, log
    flat = tmp_path / "flat"
    shutil.copytree(straight / "checkpoint" / "step-4", flat / "checkpoint")
    proc = run_train(flat, *args, nproc=1, check=False)
    assert proc.returncode != 0 and "holds a checkpoint itself, not in a step-N folder" in proc.stderr
    # as the message says, it can be named as the starting point instead
    proc = run_train(flat, *args, "--checkpoint.initial_load_path", str(flat / "checkpoint"), nproc=1)
    assert "initialised from" in proc.stdout + proc.stderr


def test_error_on_one_rank_with_a_background_save_ends_the_run_at_once(tmp_path):
    """A rank that meets bad data mid-run while an async save is in flight: its save completes without a barrier
    the other rank never reaches, and the run ends in seconds with the saves made so far, not at the timeout."""
    words = "the quick brown fox jumps over the lazy dog and keeps on running through the field " * 3
    texts = [words] * 300
    texts[201] = 7  # rank 1's 101st document (positions 1, 3, 5, ...): past its first block of 64
    data = tmp_path / "late.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    t0 = time.monotonic()
    proc = run_train(tmp_path / "run", *QUICK, "--training.steps", "200", "--data.path", str(data), "--data.shuffle",
                     "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.async_mode",
                     "async", "--comm.init_timeout_seconds", "240", check=False, timeout=600)
    assert proc.returncode != 0
    assert "error: data: document 201: 'text' holds int 7, not text" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert time.monotonic() - t0 < 180, "waited for the collective timeout"
    assert len(complete_steps(str(tmp_path / "run" / "checkpoint"))) >= 2


def test_error_on_one_rank_ends_the_run_at_once(tmp_path):
    """A rank that fails (here: its shard of the data holds only empty documents) exits with its own error; the
    others are stopped by torchrun instead of waiting out the collective timeout in a final barrier."""
    data = tmp_path / "odd.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} has some words in it. " * 5 if i % 2 == 0 else ""})
                            + "\n" for i in range(40)))
    t0 = time.monotonic()
    proc = run_train(tmp_path / "run", *QUICK, "--training.steps", "4", "--data.path", str(data), "--data.shuffle",
                     "false", "--comm.init_timeout_seconds", "240", check=False, timeout=600)
    assert proc.returncode != 0
    # the failing rank says it in one line, as for other bad input, not in a traceback of the data pipeline
    assert "error: data: shard 1 of 2 holds only empty documents" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "raise DataError" not in proc.stdout + proc.stderr
    # ~15 s here; a rank waiting in the barrier would add the 240 s timeout
    assert time.monotonic() - t0 < 180, "waited for the collective timeout"

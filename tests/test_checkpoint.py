"""Checkpoints for real: DCP folders written by the trainer on 2 gloo processes, exact resume, resharded resume,
async saves, keep_latest_k, interrupted saves, what a resume keeps and what it refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import QUICK, RECIPE, ROOT, env, fake_step, losses, main_error, run_train, state
from hybridtitan.checkpoint import complete_steps, load_model


def test_exact_resume_and_reshard(tmp_path):
    """10 steps straight == 5 steps, stop, resume to 10 (bitwise: every loss of steps 6-10 and the weights).
    A checkpoint saved on 2 ranks then resumes on 1 rank and the loss carries on."""
    straight, resumed2 = tmp_path / "straight", tmp_path / "resumed"
    common = [*QUICK, "--checkpoint.enable", "true", "--checkpoint.interval", "5", "--lr_scheduler.total_steps", "10"]
    run_train(straight, *common, "--training.steps", "10")
    # the resumed run: first 5 steps, a stop, then a second launch from the step-5 checkpoint
    run_train(resumed2, *common, "--training.steps", "5")
    assert complete_steps(str(resumed2 / "checkpoint")) == [5]
    run_train(resumed2, *common, "--training.steps", "10")
    a, b = losses(straight), losses(resumed2)
    for step in range(6, 11):
        assert a[step] == b[step], (step, a[step], b[step])
    sa, sb = state(straight, 10), state(resumed2, 10)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key

    # 2 ranks -> 1 rank: runs, continues the curve (not bitwise)
    one = tmp_path / "one_rank"
    os.makedirs(one / "checkpoint")
    os.symlink(straight / "checkpoint" / "step-10", one / "checkpoint" / "step-10")
    run_train(one, *QUICK, "--training.global_batch_size", "4", "--training.steps", "14",
              "--checkpoint.enable", "true", "--checkpoint.interval", "100", nproc=1)
    after = losses(one)
    assert min(after) == 11 and max(after) == 14
    assert all(v == v and v < a[1] for v in after.values())  # finite and below the initial loss
    assert abs(after[11] - a[10]) < 0.5 * a[10]

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
                           str(other)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "cannot resume from" in errors[0] and "other data" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]

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

def test_resume_with_parts_left_out_steps_at_the_schedules_rate(tmp_path, capsys):
    """checkpoint.exclude_from_loading: a new schedule on a resumed optimizer starts at its own first rate, and a
    fresh optimizer on a resumed schedule takes the schedule's rate (neither the other part's); a checkpoint of
    another data.num_workers, and one put directly in checkpoint/ (not in a step-N folder), are refused in a line."""

    def lrs(dump):
        return {r["step"]: r["lr"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}

    args = [*QUICK, "--lr_scheduler.warmup_steps", "3", "--checkpoint.enable", "true", "--checkpoint.interval", "4",
            "--training.steps", "6"]
    straight = tmp_path / "straight"
    run_train(straight, *args, nproc=1)
    ref = lrs(straight)
    assert len({ref[1], ref[2], ref[5]}) == 3

    def from_step_4(name: str) -> Path:
        """A new dump folder holding the straight run's step-4 checkpoint."""
        dump = tmp_path / name
        shutil.copytree(straight / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
        return dump

    def resumed(name: str, *extra: str, check: bool = True):
        dump = from_step_4(name)
        return dump, run_train(dump, *args, *extra, nproc=1, check=check)

    dump, _ = resumed("new_schedule", "--checkpoint.exclude_from_loading", "lr_scheduler")
    assert [lrs(dump)[5], lrs(dump)[6]] == [pytest.approx(ref[1]), pytest.approx(ref[2])]
    dump, _ = resumed("new_optimizer", "--checkpoint.exclude_from_loading", "optimizer")
    assert [lrs(dump)[5], lrs(dump)[6]] == [pytest.approx(ref[5]), pytest.approx(ref[6])]
    # the refusals, by the trainer's entry point in this process (they come before any training)
    def refused(name: str, *extra: str) -> str:
        code, err = main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(from_step_4(name)),
                                        *args, *extra])
        assert code == 2 and len(err.splitlines()) == 1, err
        return err

    assert "train_state restarts the step count at 0" in refused("restart", "--checkpoint.exclude_from_loading",
                                                                  "train_state")
    assert "the checkpoint's data.num_workers is 0, this run's 1" in refused("workers", "--data.num_workers", "1")
    # another tokenizer (the shipped one with two ids swapped) or other data: refused unless said explicitly
    other_tok = tmp_path / "other_tokenizer"
    shutil.copytree(ROOT / "hybridtitan" / "assets" / "tokenizer", other_tok)
    spec = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_tok / "tokenizer.json").write_text(json.dumps(spec))
    assert "was trained with another tokenizer than data.tokenizer" in refused(
        "tokenizer", "--data.tokenizer", str(other_tok))
    corpus = ROOT / "hybridtitan" / "assets" / "corpus" / "train.jsonl"
    fewer = tmp_path / "fewer" / "train.jsonl"
    fewer.parent.mkdir()
    fewer.write_text("".join(corpus.read_text().splitlines(keepends=True)[:-1]))
    assert "reads other data than the run it continues" in refused("data", "--data.path", str(fewer))
    moved = tmp_path / "moved" / "train.jsonl"  # the same file elsewhere is the same data
    moved.parent.mkdir()
    shutil.copy(corpus, moved)
    from hybridtitan.config_manager import parse_config
    from hybridtitan.preflight import preflight

    def starts(name: str, *extra: str) -> bool:
        cfg = parse_config(["--job.config_file", RECIPE, "--job.dump_folder", str(from_step_4(name)), *args, *extra])
        return preflight(cfg).start.checkpoint is not None

    assert starts("moved", "--data.path", str(moved))
    assert starts("new_data", "--data.path", str(fewer), "--checkpoint.exclude_from_loading", "dataloader")
    assert starts("new_tokenizer", "--data.tokenizer", str(other_tok), "--checkpoint.allow_tokenizer_change", "true")
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
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(flat), *args])
    assert code == 2 and "holds a checkpoint itself, not in a step-N folder" in err, err
    # as the message says, it can be named as the starting point instead
    proc = run_train(flat, *args, "--checkpoint.initial_load_path", str(flat / "checkpoint"), nproc=1)
    assert "initialised from" in proc.stdout + proc.stderr

def test_checkpoint_checks_before_training(tmp_path, capsys):
    base = ["--job.config_file", RECIPE, "--checkpoint.enable", "true"]
    # the checkpoint a run would resume from holds another model
    other = tmp_path / "other"
    fake_step(other, 5, "debug_gdn")
    code, err = main_error(capsys, [*base, "--job.dump_folder", str(other)])
    assert code == 2 and "holds a different model than the recipe" in err and "\n" not in err
    # rewinding with load_step while newer checkpoints exist
    rewind = tmp_path / "rewind"
    fake_step(rewind, 5, "debug_hybrid")
    fake_step(rewind, 7, "debug_hybrid")
    code, err = main_error(capsys, [*base, "--job.dump_folder", str(rewind), "--checkpoint.load_step", "5"])
    assert code == 2 and "older than step(s) 7" in err
    code, err = main_error(capsys, [*base, "--job.dump_folder", str(rewind), "--checkpoint.load_step", "6"])
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
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--checkpoint.enable", "true",
                                     "--job.dump_folder", str(dump)])
    assert code == 2 and "holds only the model" in err and "initial_load_path" in err and "\n" not in err, err
    assert {p: p.stat().st_mtime_ns for p in dump.rglob("*")} == before

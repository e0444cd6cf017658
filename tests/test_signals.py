"""Stopping on a signal: SIGTERM to one rank, or to the whole process group, saves a checkpoint and stops every
rank cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import QUICK, RECIPE, ROOT, env, losses
from hybridtitan.checkpoint import complete_steps


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]

def test_sigterm_to_one_rank_saves_and_stops_all(tmp_path):
    """A signal reaches one worker of two: both agree to stop after the same step, save it and exit cleanly."""
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "hybridtitan.train", "--job.config_file", RECIPE, "--job.dump_folder", str(dump), *QUICK,
           "--training.steps", "100000", "--checkpoint.enable", "true", "--checkpoint.interval", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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

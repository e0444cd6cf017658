"""scripts/slurm/train.sbatch on a real Slurm (slurmctld + slurmd + munged, one node on localhost, started by
tests/slurm/start.sh in a temporary folder): a job preempted by SIGTERM to its batch shell (what
``#SBATCH --signal=B:TERM@120`` sends near the time limit) saves, requeues itself and resumes, and its losses are
those of an uninterrupted run.

Needs root (the test cluster runs as SlurmUser=root). Slurm and munge are installed with apt-get when absent
(tests/slurm/install.sh); without root or apt the test is skipped and says why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import QUICK, RECIPE, ROOT, env, losses, run_train
from hybridtitan.checkpoint import complete_steps

SLURM = ROOT / "tests" / "slurm"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict:
    """A one-node cluster for this module: the environment its clients need (SLURM_CONF). Stopped afterwards, on
    failure too."""
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs as SlurmUser=root, and installing Slurm needs root: not root")
    if not all(shutil.which(b) for b in BINARIES):
        if not shutil.which("apt-get"):
            pytest.skip("Slurm is not installed and there is no apt-get to install it (slurmctld slurmd "
                        "slurm-client munge)")
        proc = subprocess.run(["bash", str(SLURM / "install.sh")], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not all(shutil.which(b) for b in BINARIES):
            pytest.skip(f"apt-get could not install Slurm (exit code {proc.returncode}): "
                        f"{(proc.stdout + proc.stderr).strip()[-500:]}")
    folder = tmp_path_factory.mktemp("slurm")
    try:
        proc = subprocess.run(["bash", str(SLURM / "start.sh"), str(folder)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"the test cluster did not start:\n{proc.stderr[-4000:]}"
        yield {"SLURM_CONF": str(folder / "etc" / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SLURM / "stop.sh"), str(folder)], capture_output=True, timeout=120)


def slurm_cmd(environ: dict, *cmd: str) -> str:
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"
    return proc.stdout.strip()


def test_preempted_job_saves_requeues_itself_and_resumes_exactly(slurm, tmp_path):
    """One node, one torchrun of 2 ranks (the test cluster's node has 2 CPUs and 2 stand-in GPUs). SIGTERM reaches
    the batch shell only (scancel --batch, as B:TERM does); its trap signals the ranks, which save and exit; the
    script requeues the job (same id, same log, same dump folder), and the second run resumes from the saved step
    to the end. Every loss equals the uninterrupted run's, bit for bit."""
    args = [*QUICK, "--validation.enable", "false", "--training.steps", "20", "--checkpoint.interval", "5",
            "--checkpoint.keep_latest_k", "0"]
    straight = tmp_path / "straight"
    run_train(straight, *args)

    outputs, logs = tmp_path / "outputs", tmp_path / "logs"
    logs.mkdir()
    job_env = {**env(), **slurm, "OUTPUT_ROOT": str(outputs), "PYTHON": sys.executable}
    job = slurm_cmd(job_env, "sbatch", "--parsable", "--job-name", "preempted", "--nodes", "1",
                    "--gpus-per-node", "2", "--cpus-per-task", "2", "--time", "10", f"--output={logs}/%x-%j.out",
                    str(SBATCH), RECIPE, *args)
    dump, log = outputs / "preempted", logs / f"preempted-{job}.out"
    metrics = dump / "metrics.jsonl"

    def log_text() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    def wait_for(condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"no {what} after {timeout} s; job log:\n{log_text()[-4000:]}"
            time.sleep(0.2)

    # the first run passes its first checkpoint, then the "preemption"
    wait_for(lambda: 5 in complete_steps(str(dump / "checkpoint")) and metrics.exists()
             and len(metrics.read_text().splitlines()) >= 7, "step 7", timeout=180)
    slurm_cmd(job_env, "scancel", "--batch", "--signal=TERM", job)
    wait_for(lambda: not slurm_cmd(job_env, "squeue", "-h", "-j", job), "end of the job", timeout=240)

    out = log_text()
    stopped = sorted({int(s) for s in re.findall(r"stopped at step (\d+) on request", out)})
    assert len(stopped) == 1 and out.count("stopped at step") == 2, out[-4000:]  # both ranks, the same step
    step = stopped[0]
    assert f"checkpoint step {step}: saved" in out and "SIGTERM: the ranks save a checkpoint" in out, out[-4000:]
    assert "training step ended with exit code 0" in out and f"requeueing job {job}" in out, out[-4000:]
    assert f"job {job} (run 2)" in out and f"resumed from {dump}/checkpoint/step-{step} (step {step})" in out
    assert complete_steps(str(dump / "checkpoint")) == sorted({5, step, 10, 15, 20})
    jobcomp = (Path(slurm["SLURM_CONF"]).parents[1] / "log" / "jobcomp.log").read_text()
    states = re.findall(rf"JobId={job} .*?JobState=(\S+)", jobcomp)
    assert states == ["PENDING", "COMPLETED"], jobcomp  # requeued once, then finished
    assert losses(dump) == losses(straight)
    assert not (dump / "metrics.superseded.jsonl").exists()  # resumed at the step it stopped: nothing trained twice

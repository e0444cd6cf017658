"""What the tests of the trainer share: running it for real (its ranks in subprocesses, FSDP2 over gloo), reading
what a run wrote, and calling its entry point in-process for the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "train_configs" / "debug_hybrid.toml")
# small and quick: 2 x 128 tokens per rank and step
QUICK = ["--training.seq_len", "128", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]


def env() -> dict:
    """The environment of a trainer subprocess: offline, one thread, this checkout first on the path."""
    out = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def run_train(dump: Path, *extra: str, nproc: int = 2, check: bool = True, timeout: int = 600,
              recipe: str = RECIPE, torchrun: bool = False):
    """``python -m hybridtitan.train`` on the debug recipe: in ``nproc`` ranks (run_ranks), or alone for nproc=1 (no
    process group). ``torchrun=True`` runs it under ``torchrun --standalone`` instead, for the tests of what
    torchrun itself does (the docs, cluster, signal and Slurm tests use it too)."""
    args = ["-m", "hybridtitan.train", "--job.config_file", recipe, "--job.dump_folder", str(dump), *extra]
    if torchrun:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", *args], cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=timeout)
    elif nproc == 1:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=timeout)
    else:
        proc = run_ranks(args, nproc, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_ranks(args: list[str], nproc: int, *, timeout: float = 600, environ: dict | None = None):
    """``python ARGS`` in ``nproc`` processes, started as torchrun starts them, without its agent process: the
    store the ranks meet at is served from this process (as torchrun's agent serves it: bound before the ranks
    start, so no port is picked and raced for), RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/PORT are in their
    environment. A process fewer per run: the agent's start and rendezvous cost ~2 s of CPU and of wall time, and
    the ranks read nothing else of it. As torchrun does, the first rank to fail stops the others (they would wait
    for it in their next collective). Returns a CompletedProcess: the exit code of the first rank that failed (else
    0), the ranks' output in rank order."""
    import torch.distributed as dist

    cmd = [sys.executable, *args]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(env(), **(environ or {}), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), GROUP_RANK="0",
                TORCHELASTIC_USE_AGENT_STORE="True")
    outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nproc)]
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=out, stderr=err,
                              text=True) for r, (out, err) in enumerate(outs)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in ranks) and not any(p.returncode for p in ranks):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        failed = next((p.returncode for p in ranks if p.returncode), 0)
        if failed and any(p.poll() is None for p in ranks):
            time.sleep(1)  # the others' own error lines first, where they have one
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
        del store
    return subprocess.CompletedProcess(cmd, failed, "".join(_read(out) for out, _ in outs),
                                       "".join(_read(err) for _, err in outs))


def _read(file) -> str:
    with file:
        file.seek(0)
        return file.read()


def records(dump: Path, kind: str = "loss") -> dict[int, dict]:
    """metrics.jsonl's records holding ``kind`` ("loss": training; "validation/loss"), by step."""
    every = map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in every if kind in r}


def losses(dump: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in records(dump).items()}


def state(dump: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of a run's checkpoint step-``step``."""
    from hybridtitan.checkpoint import load_model

    model, _ = load_model(str(dump / "checkpoint" / f"step-{step}"))
    return model.state_dict()


def main_error(capsys, argv) -> tuple[int, str]:
    """(exit code, stderr) of the trainer's entry point on ``argv``, in this process."""
    from hybridtitan import train

    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    return exc.value.code, capsys.readouterr().err.strip()


def fake_step(folder: Path, step: int, flavor: str) -> None:
    """A step folder whose model_args.json says ``flavor`` (enough for the checks before training)."""
    from hybridtitan.checkpoint import model_args_to_dict
    from hybridtitan.models import get_flavor

    d = folder / "checkpoint" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    (d / "model_args.json").write_text(json.dumps(model_args_to_dict(get_flavor(flavor))))

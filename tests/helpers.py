"""What the tests of the trainer share: running it for real (torchrun over gloo, in subprocesses), reading what a
run wrote, and calling its entry point in-process for the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
              recipe: str = RECIPE):
    """``python -m hybridtitan.train`` on the debug recipe: under torchrun --standalone with ``nproc`` processes,
    or alone for nproc=1 (one process fewer to start: torchrun's agent)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launcher, "-m", "hybridtitan.train", "--job.config_file", recipe, "--job.dump_folder",
           str(dump), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


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

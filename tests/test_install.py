"""Installs as a user makes them, in a fresh virtual environment: a plain `pip install hybridtitan` (the CPU build
of torch, no Triton) runs every tool on a CPU: describe, the trainer, export, import, evaluation, generation and
plots (the suite's own environment is the [cpu] one, with Triton: every other test trains in it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_export_hf import train_debug_checkpoints
from venvs import make_venv, pip_install

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A fresh venv: torch 2.13.0 (the CPU build, this environment's: tests/venvs.py), then `pip install .` at the
    tested versions, no extra."""
    python = make_venv(tmp_path_factory.mktemp("install") / "venv")
    pip_install(python, "-c", "constraints-cpu.txt", ".")
    return python


def _run(python: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # bytecode written (the venv was installed --no-compile): the first tool compiles what it imports, the others
    # read it (with PYTHONDONTWRITEBYTECODE set, each of them compiled torch's Python files again: ~4 s a tool)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=900, cwd=cwd, env=env)


def test_plain_install_runs_every_cpu_tool(plain, tmp_path, tmp_path_factory):
    """No Triton in the environment; the installed package (not this checkout: run from another folder) describes a
    recipe, trains two steps of it, and exports, imports, evaluates, generates and plots a checkpoint."""
    assert _run(plain, "-c", "import importlib.util as u; assert u.find_spec('triton') is None").returncode == 0
    where = _run(plain, "-c", "import hybridtitan; print(hybridtitan.__file__)", cwd=tmp_path)
    assert "site-packages" in where.stdout, where.stdout + where.stderr
    dump = train_debug_checkpoints(tmp_path_factory)["debug_hybrid"]
    checks = {
        "export": ["-m", "hybridtitan.export_hf", "--checkpoint", str(dump), "--output", str(tmp_path / "hf")],
        "import": ["-m", "hybridtitan.import_hf", "--model", str(tmp_path / "hf"), "--output",
                   str(tmp_path / "imported" / "checkpoint" / "step-0")],
        "eval": ["-m", "hybridtitan.eval", "--checkpoint", str(dump), "--tasks", "stdlib_mc", "--include_path",
                 str(REPO / "tests" / "assets" / "tasks"), "--limit", "4"],
        "generate": ["-m", "hybridtitan.generate", "--checkpoint", str(tmp_path / "hf"), "--prompt", "def",
                     "--max_new_tokens", "4", "--temperature", "0"],
        "plot": ["-m", "hybridtitan.plot", str(dump), "--output", str(tmp_path / "curves.png")],
    }
    for name, args in checks.items():
        proc = _run(plain, *args, cwd=tmp_path)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    recipe = str(REPO / "train_configs" / "debug_hybrid.toml")
    proc = _run(plain, "-m", "hybridtitan.describe", "--job.config_file", recipe, cwd=tmp_path)
    assert proc.returncode == 0 and "parameters: 4,878,864 total" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    proc = _run(plain, "-m", "hybridtitan.train", "--job.config_file", recipe, "--job.dump_folder",
                str(tmp_path / "run"), "--training.steps", "2", "--training.seq_len", "128", "--validation.enable",
                "false", "--metrics.enable_tensorboard", "false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint" / "step-2" / ".metadata").is_file()

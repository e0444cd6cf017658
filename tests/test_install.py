"""Installs as a user makes them, in a fresh virtual environment: a plain `pip install hybridtitan` (the CPU build
of torch, no Triton) runs export, import, evaluation, generation and plots, and the trainer stops with one line
naming the extra to add (the suite's own environment is the [cpu] one: every other test trains in it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_export_hf import train_debug_checkpoints

REPO = Path(__file__).resolve().parents[1]


def _pip(python: Path, *args: str) -> None:
    # --no-compile: no bytecode for all of torch at install time (only what runs gets compiled, on import)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                           *args], capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A fresh venv: torch==2.13.0 (the CPU build), then `pip install .` at the tested versions, no extra."""
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    _pip(python, "torch==2.13.0")
    _pip(python, "-c", "constraints-cpu.txt", ".")
    return python


def _run(python: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=900, cwd=cwd, env=env)


def test_plain_install_runs_every_cpu_tool_but_the_trainer(plain, tmp_path, tmp_path_factory):
    """No Triton in the environment; the installed package (not this checkout: run from another folder) exports,
    imports, evaluates, generates and plots a checkpoint; the trainer and describe say in one line which extra to
    add."""
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
    for module in ("hybridtitan.train", "hybridtitan.describe"):
        proc = _run(plain, "-m", module, "--job.config_file", recipe, cwd=tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("error: the trainer needs Triton") and "hybridtitan[cpu]" in lines[0]

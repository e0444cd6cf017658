"""Fresh virtual environments for the tests of installs (test_install, test_export_standalone): made with
``python -m venv`` and holding this environment's torch, to which each test adds what it installs with pip
(``pip_install``).

torch is the CPU build scripts/setup_cpu.sh installed with ``pip install torch==2.13.0``; its files come over as hard
links (a copy on another file system), its metadata with them, so pip counts it installed as after that command
and installs its dependencies where what it installs names torch. The same wheel installed again wrote ~700 MB and
cost ~9 s of CPU, and the new environment's first process then compiled torch's modules again: the bytecode this
environment's processes wrote comes along (test_install: 103 -> 84 s of CPU; test_export_standalone's test in a
fresh environment: 49 -> 40 s; `pytest -n 0` on each alone, 2026-12-04)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def make_venv(path: Path) -> Path:
    """A venv at ``path`` with this environment's torch; returns its python."""
    assert torch.version.cuda is None and torch.version.hip is None, "the suite runs in the CPU build's environment"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    torch_dist = importlib.metadata.distribution("torch")
    source = Path(torch_dist.locate_file(""))  # this environment's site-packages
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    # torch, functorch, torchgen and torch's .dist-info (not its scripts in bin/, which RECORD names as ../../..)
    tops = {file.parts[0] for file in torch_dist.files if file.parts[0] != ".."}
    for top in sorted(tops):
        shutil.copytree(source / top, target / top, copy_function=_link_or_copy)
    return python


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def pip_install(python: Path, *args: str, timeout: int = 1800) -> None:
    """``python -m pip install ARGS`` in the repository's folder (relative paths are the checkout's)."""
    # --no-compile: no bytecode for every module of transformers, lm-eval, ... at install time (only what runs gets
    # compiled, on import)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"

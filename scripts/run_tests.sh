#!/usr/bin/env bash
# Sets up .venv if needed and runs the test suite (CPU only; real FSDP2 over 2 gloo processes, real DCP
# folders, real safetensors, real lm-eval runs). Extra arguments go to pytest.
# Two pytest-xdist workers, the longest tests started first (tests/conftest.py); the suite keeps both cores busy.
# The trainer runs (single processes and the ranks of multi-process runs) and the command lines of most tests are
# forked from a server per worker that has imported torch, DTensor, transformers, datasets, lm-eval and the package
# once (tests/forked.py): a fresh interpreter spends ~4 s of CPU importing them (the tests of the docs, torchrun,
# Slurm, installs and stock lm-eval start fresh ones). A test failed by a forked process's fatal signal runs once
# more in fresh processes (pytest-rerunfailures; tests/README.md). `-n 0` runs the tests in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cpu.sh
# The suite starts hundreds of Python processes: let them keep the bytecode of the package and the tests (some
# machines set PYTHONDONTWRITEBYTECODE, and every process then compiled them again)
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q -n 2 --dist worksteal tests "$@"

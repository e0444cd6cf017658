#!/usr/bin/env bash
# Sets up .venv if needed and runs the test suite (CPU only; real FSDP2 over 2 gloo processes, real DCP
# folders, real safetensors, real lm-eval runs). Extra arguments go to pytest.
# Two pytest-xdist workers, the longest tests started first (tests/conftest.py): most of the suite's time is Python
# processes starting (torch, DTensor, transformers, datasets: ~5 s of CPU a trainer rank), which keeps both cores
# busy. `-n 0` runs the tests in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cpu.sh
# The suite starts ~340 Python processes: let them keep the bytecode of the package and the tests (some machines set
# PYTHONDONTWRITEBYTECODE, and every process then compiled them again)
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q -n 2 --dist worksteal tests "$@"

#!/usr/bin/env bash
# Sets up .venv if needed and runs the test suite (CPU only; real FSDP2 over 2 gloo processes, real DCP
# folders, real safetensors, real lm-eval runs). Extra arguments go to pytest.
# Two pytest-xdist workers: most tests are single-process (imports, file I/O), so alone they leave a core idle;
# beside them, the longest tests (tests/conftest.py starts them first) run on the other. ~10 instead of ~12.5
# minutes of pytest on 2 cores. `-n 0` runs them in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cpu.sh
# The suite starts ~400 Python processes: let them keep the bytecode of the package and the tests (some machines set
# PYTHONDONTWRITEBYTECODE, and every process then compiled them again)
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q -n 2 --dist worksteal tests "$@"

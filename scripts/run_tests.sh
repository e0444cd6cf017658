#!/usr/bin/env bash
# Sets up .venv if needed and runs the test suite (CPU only; real FSDP2 over 2 gloo processes, real DCP
# folders, real safetensors, real lm-eval runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cpu.sh
python -m pytest -q tests "$@"

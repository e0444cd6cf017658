#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch 2.13.0 and hybridtitan, at the tested versions.
# Sourced by quickstart.sh and run_tests.sh. torch is installed first and pinned: a range that admits a newer
# release would pull a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
# (installed = found on the path: importing them all, lm_eval's ~5,000 modules included, took ~9 s each time)
if ! python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
    ('hybridtitan', 'torch', 'fla', 'lm_eval', 'xdist', 'pytest_rerunfailures', 'matplotlib', 'accelerate',
    'torchao')))" 2>/dev/null \
    || ! python -m ruff --version >/dev/null 2>&1; then
  echo "setting up .venv (torch 2.13.0 CPU + hybridtitan and its dependencies)..."
  # --no-compile: Python compiles a module's bytecode when it is first imported, so only what runs is compiled
  # (pip compiling every file of torch, transformers and lm-eval up front doubled the setup's CPU time: 88 vs 44 s).
  # The grep drops pip's notes about package-index folders this machine's pip.conf names but lacks.
  python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 \
    2> >(grep -v "is ignored: it is neither" >&2)
  python -m pip install -q --disable-pip-version-check --no-compile -c constraints-cpu.txt -e ".[cpu,test]" \
    2> >(grep -v "is ignored: it is neither" >&2)
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

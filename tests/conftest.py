"""Shared test setup: offline Hugging Face, quiet FLA on CPU, one thread (here and in every process a test starts), a
fixed seed for every test; a runner for scripts under Triton's interpreter."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# One OpenMP thread in every process a test starts (the docs' commands, the GPU and ROCm scripts' dry runs, ...), as
# torchrun gives its ranks: with the other pytest worker busy on the second core, a process's second OpenMP thread
# spins waiting for the core (docs/data.md's commands beside a busy core: 53.6 CPU-s with 2 threads, 25.9 CPU-s with 1;
# /usr/bin/time on its test, 2026-12-04).
os.environ["OMP_NUM_THREADS"] = "1"
# Building a local dataset's cache (the first load on a fresh machine) draws progress bars on stderr, which the
# one-line-error tests capture: off in the tests and their subprocesses.
os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"

# FLA warns once at import that Triton has no GPU here and it "rolls back to CPU": expected on a CPU machine.
warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: the tests use small tensors, where OpenMP workers cost more than they save, and on a
# shared 2-core machine spinning workers made the suite ~5x slower in CPU time (measured: 31 s vs 5 s in calls).
torch.set_num_threads(1)


def pytest_configure(config):
    # pytest resets the warning filters around collection and each test: register the same two there too
    # (FLA's CPU fallback notice, and torch.jit deprecations raised by FLA's imports, not by this project).
    config.addinivalue_line("filterwarnings", "ignore:Triton is not supported on current platform:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# The longest tests (minutes, each a multi-process training run), started first: with `-n 2` (run_tests.sh,
# pytest-xdist) the short tests then run beside them instead of after them.
LONGEST_FIRST = ("test_docs.py::test_shell_blocks_run[docs/getting-started.md]",
                 "test_docs.py::test_shell_blocks_run[README.md]",
                 "test_train.py::test_debug_recipe_trains_validates_and_evaluates",
                 "test_checkpoint.py::test_exact_resume_and_reshard",
                 "test_cluster.py::test_two_nodes_equal_one_node_and_checkpoints_change_layout",
                 "test_slurm.py::test_preempted_job_saves_requeues_itself_and_resumes_exactly",
                 "test_install.py::test_plain_install_runs_every_cpu_tool")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(item.nodeid.endswith(name) for name in LONGEST_FIRST))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def run_in_triton_interpreter():
    """run(script): the script in a fresh process under Triton's interpreter (TRITON_INTERPRET=1 must be set
    before a kernel is defined, hence the process), where our kernels run on a CPU; it must exit cleanly and
    print OK last."""
    repo = Path(__file__).resolve().parents[1]

    def run(script: str, timeout: int = 300) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
        proc = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]

    return run

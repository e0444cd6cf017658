"""Shared test setup: offline Hugging Face, quiet FLA on CPU, one thread, a fixed seed for every test."""

import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

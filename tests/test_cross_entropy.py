"""Chunked fused linear cross-entropy: exact against F.cross_entropy over materialised logits, and it never holds
more than a chunk of logits."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridtitan.ops import linear_cross_entropy


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


REPO = Path(__file__).resolve().parents[1]


def _inputs(N=300, D=24, V=1000, n_ignored=37):
    hidden = torch.randn(N, D)
    weight = torch.randn(V, D) * 0.2
    targets = torch.randint(0, V, (N,))
    targets[torch.randperm(N)[:n_ignored]] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [7, 64, 4096])  # 300 tokens: chunks that do not divide N, and one chunk
def test_matches_cross_entropy(chunk_size):
    hidden, weight, targets = _inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    loss_sum, count = linear_cross_entropy(h1, w1, targets, ignore_index=-100, chunk_size=chunk_size)
    ref = F.cross_entropy(h2 @ w2.t(), targets, reduction="sum", ignore_index=-100)
    assert count.item() == 300 - 37
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=0)

    # a non-trivial upstream gradient (the mean divides by the count)
    (loss_sum / count).backward()
    (ref / count).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)
    assert rel_err(h1.grad, h2.grad) < 1e-5 and rel_err(w1.grad, w2.grad) < 1e-5
    # ignored tokens get no gradient
    assert (h1.grad[targets == -100] == 0).all()


def test_batched_shapes_and_other_ignore_index():
    """hidden [B, T, D] and targets [B, T] are flattened; a custom ignore_index is honoured."""
    hidden, weight, targets = _inputs(N=2 * 45, V=50, n_ignored=10)
    targets = torch.where(targets == -100, torch.full_like(targets, -1), targets)
    h = hidden.view(2, 45, -1).requires_grad_()
    loss_sum, count = linear_cross_entropy(h, weight, targets.view(2, 45), ignore_index=-1, chunk_size=16)
    ref = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum", ignore_index=-1)
    assert count.item() == 80
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=0)
    loss_sum.backward()
    assert h.grad.shape == (2, 45, hidden.shape[-1])


def test_all_ignored_gives_zero():
    hidden, weight, _ = _inputs(N=20, V=30)
    h = hidden.clone().requires_grad_()
    loss_sum, count = linear_cross_entropy(h, weight, torch.full((20,), -100), chunk_size=8)
    assert loss_sum.item() == 0.0 and count.item() == 0
    loss_sum.backward()
    assert (h.grad == 0).all()


def test_no_grad_path():
    hidden, weight, targets = _inputs(N=50, V=40, n_ignored=5)
    with torch.no_grad():
        loss_sum, _ = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    ref = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=0)


def test_mismatched_targets_rejected():
    with pytest.raises(ValueError, match="hidden states"):
        linear_cross_entropy(torch.randn(5, 4), torch.randn(10, 4), torch.zeros(6, dtype=torch.long))


def _saved_bytes(fn):
    """Bytes of the tensors autograd keeps between forward and backward (distinct storages only)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def test_saved_for_backward_is_not_the_logits():
    """Deterministic part of the memory check: what autograd keeps until backward. Materialised logits keep at
    least N x V floats; the fused op keeps only the gradients of hidden and weight (N x D + V x D)."""
    N, D, V = 512, 16, 4096
    hidden = torch.randn(N, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    logits_bytes = N * V * 4

    _, full = _saved_bytes(lambda: F.cross_entropy(hidden @ weight.t(), targets, reduction="sum"))
    loss, fused = _saved_bytes(lambda: linear_cross_entropy(hidden, weight, targets, chunk_size=128)[0])
    assert full >= logits_bytes
    assert fused <= (N * D + V * D) * 4 + 1024
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None


# The peak memory of forward + backward, measured in a fresh process. There is no allocator statistic for CPU
# tensors, so the child reads the kernel's own count: VmHWM ("high water mark" of the resident set) in
# /proc/self/status. glibc's malloc is told to mmap every allocation above 1 MiB (MALLOC_MMAP_THRESHOLD_, which
# also turns off its adaptive threshold), so every large tensor is mapped when created and unmapped when freed:
# the peak RSS is the peak of live tensors, not of malloc's caches. The chunked loss runs first (so the high
# water mark it reaches is its own), then the loss over the full logits; both growths are measured from the same
# baseline, taken after the inputs exist and both code paths were warmed up on tiny inputs.
_MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    from hybridtitan.ops import linear_cross_entropy

    torch.set_num_threads(1)

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    N, D, V, CHUNK = 4096, 32, 8192, 128
    torch.manual_seed(0)
    for n, v in ((8, 16), (N, V)):  # warm-up on tiny inputs, then the real inputs (pages touched)
        hidden = torch.randn(n, D, requires_grad=True)
        weight = (torch.randn(v, D) * 0.02).requires_grad_()
        targets = torch.randint(0, v, (n,))
        if n == 8:
            linear_cross_entropy(hidden, weight, targets, chunk_size=4)[0].backward()
            F.cross_entropy(hidden @ weight.t(), targets, reduction="sum").backward()
    base = status("VmRSS")

    loss, _ = linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK)
    loss.backward()
    chunked_peak = status("VmHWM") - base
    chunked_loss = loss.item()
    hidden.grad = weight.grad = None

    ref = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    ref.backward()
    full_peak = status("VmHWM") - base
    json.dump(dict(chunked=chunked_peak, full=full_peak, logits=N * V * 4, chunk_logits=CHUNK * V * 4,
                   loss=chunked_loss, ref=ref.item()), sys.stdout)
    """
)


def test_peak_memory_is_a_chunk_not_the_logits():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _MEMORY_CHILD], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(m["loss"] - m["ref"]) <= 1e-4 * abs(m["ref"])
    # the measurement sees the materialised logits (4096 x 8192 floats = 128 MiB; ~390 MiB measured) ...
    assert m["full"] >= m["logits"], m
    # ... and the chunked loss needs a small fraction of them (~14 MiB measured): a chunk of logits (4 MiB) and
    # a temporary or two of its size, the float32 gradients of the weight (1 MiB each) and of the hidden states
    assert m["chunked"] < 0.25 * m["logits"], m


def test_compiled_chunks_equal_eager():
    """compile.components = ["loss"]: torch.compile fuses each chunk's softmax and gradient; same numbers."""
    from hybridtitan.ops import cross_entropy as ce

    torch.manual_seed(0)
    h = torch.randn(300, 32, requires_grad=True)
    w = torch.randn(500, 32, requires_grad=True)
    t = torch.randint(0, 500, (300,))
    t[::7] = -100
    results = []
    for chunk_fn in (ce.chunk_loss_and_grad, ce.compiled_chunk_loss_and_grad()):
        loss, count = ce.linear_cross_entropy(h, w, t, chunk_size=128, chunk_fn=chunk_fn)
        results.append((loss, *torch.autograd.grad(loss, (h, w))))
    for eager, fused in zip(*results):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


def test_weight_gradient_added_in_the_gemm_and_its_fallback(monkeypatch):
    """Where the backend has a float32-output GEMM, each chunk's weight gradient is added inside it (float32
    products, no bf16 rounding); where it lacks one (this CPU), the bf16 product is added instead."""
    from hybridtitan.ops import cross_entropy as ce

    gen = torch.Generator().manual_seed(0)
    probs, h = (torch.randn(64, 48, generator=gen).bfloat16(), torch.randn(64, 32, generator=gen).bfloat16())
    weight = torch.randn(48, 32, generator=gen).bfloat16()
    exact = probs.float().t() @ h.float()

    def accumulate():
        grad_hidden, grad_weight = torch.empty(64, 32, dtype=torch.bfloat16), torch.ones(48, 32)
        ce._accumulate(grad_hidden, grad_weight, probs, h, weight, 0)
        return grad_weight - 1

    ce._fp32_out_gemm_supported.cache_clear()
    assert not ce._fp32_out_gemm_supported("cpu", torch.bfloat16)
    fallback = accumulate()
    torch.testing.assert_close(fallback, (probs.t() @ h).float())  # the bf16-rounded product

    def addmm_fp32_out(acc, a, b, *, out_dtype=None, out=None):  # what CUDA's addmm.dtype_out computes
        assert out_dtype == torch.float32 and out is acc
        return out.add_(a.float() @ b.float())

    monkeypatch.setattr(torch, "addmm", addmm_fp32_out)
    ce._fp32_out_gemm_supported.cache_clear()
    try:
        assert ce._fp32_out_gemm_supported("cpu", torch.bfloat16)
        in_gemm = accumulate()
    finally:
        ce._fp32_out_gemm_supported.cache_clear()
    torch.testing.assert_close(in_gemm, exact, rtol=1e-6, atol=1e-5)
    assert (in_gemm - exact).abs().max() < (fallback - exact).abs().max()

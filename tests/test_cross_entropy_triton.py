"""The cross-entropy chunks' Triton kernel (ops.cross_entropy_triton), run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1, set before the kernel is defined: hence a subprocess), against the eager chunk function:
loss, gradient written over the logits, ignored tokens, rows shared by fewer programs, a vocabulary that is no
multiple of the block, and the whole fused linear cross-entropy through the op's chunk loop."""

from __future__ import annotations

import torch

from hybridtitan import ops

SCRIPT = r"""
import torch
from hybridtitan.ops import cross_entropy as ce
from hybridtitan.ops import cross_entropy_triton as tce

torch.manual_seed(0)
for rows, vocab, block, programs in [(7, 1000, 256, None), (9, 1024, 256, 4), (5, 300, 512, 2), (3, 64, 64, None)]:
    logits = (torch.randn(rows, vocab) * 4).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows, 1))
    valid = torch.rand(rows) > 0.3
    valid[0], valid[-1] = True, False
    ref_loss, ref_grad = ce.chunk_loss_and_grad(logits.clone(), target, valid)
    buffer = logits.clone()
    loss, grad = tce.chunk_loss_and_grad(buffer, target, valid, block=block, num_warps=4, programs=programs)
    assert grad.data_ptr() == buffer.data_ptr() and grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), (loss, ref_loss)
    diff = (grad.float() - ref_grad.float()).abs()
    # one bf16 rounding apart at most (exp2 in the kernel, exp in the reference): half a unit at 1.0
    assert diff.max().item() <= 2 ** -8, diff.max()
    assert (grad[~valid] == 0).all()
    rows_sum = grad[valid].float().sum(1)  # softmax - onehot sums to zero
    assert rows_sum.abs().max().item() < 0.05, rows_sum

# the whole op, with the kernel as its chunk function, against the eager op: loss and both gradients
hidden = torch.randn(300, 32, dtype=torch.bfloat16)
weight = (torch.randn(500, 32) * 0.3).to(torch.bfloat16)
targets = torch.randint(0, 500, (300,))
targets[::7] = -100
results = []
for chunk_fn in (ce.chunk_loss_and_grad, lambda l, t, v: tce.chunk_loss_and_grad(l, t, v, block=128, num_warps=4)):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = ce._LinearCrossEntropy.apply(h, w, targets, -100, 128, chunk_fn)
    loss.backward()
    results.append((loss.item(), h.grad.float(), w.grad.float()))
(l0, gh0, gw0), (l1, gh1, gw1) = results
assert abs(l0 - l1) <= 1e-5 * abs(l0), (l0, l1)
assert (gh0 - gh1).norm() <= 1e-2 * gh0.norm() and (gw0 - gw1).norm() <= 1e-2 * gw0.norm()
print("OK")
"""


def test_kernel_in_triton_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(SCRIPT)


def test_kernel_choice(monkeypatch):
    """The Triton kernel is the GPUs' default; CPU tensors get the eager chunks however it is set, and
    compiled_loss takes precedence on every device."""
    from hybridtitan.ops import cross_entropy as ce

    chosen = []
    monkeypatch.setattr(ce, "linear_cross_entropy", lambda *a, chunk_fn, **k: chosen.append(chunk_fn))
    cpu = torch.empty(1)
    gpu_like = type("GpuLike", (), {"is_cuda": True})()
    configs = [ops.KernelConfig(), ops.KernelConfig(triton_loss=False), ops.KernelConfig(compiled_loss=True)]
    for config in configs:
        for hidden in (cpu, gpu_like):
            ops.Kernels(config).linear_cross_entropy(hidden, None, None)
    default_cpu, default_gpu, eager_cpu, eager_gpu, compiled_cpu, compiled_gpu = chosen
    assert default_cpu is ce.chunk_loss_and_grad and eager_cpu is ce.chunk_loss_and_grad
    assert default_gpu.__module__ == "hybridtitan.ops.cross_entropy_triton"
    assert eager_gpu is ce.chunk_loss_and_grad
    assert compiled_cpu is compiled_gpu is ce.compiled_chunk_loss_and_grad()

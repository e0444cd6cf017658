"""The short convolution's Triton kernels (ops.conv_triton), run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1, set before the kernels are defined: hence a subprocess), against the PyTorch reference:
outputs, input / weight / bias gradients, with and without SiLU and bias, a strided input (a column block of a
wider projection, as the mixers pass it), several output blocks, lengths and widths that are no multiple of the
program's block, an output block left out of the loss, and bf16; under each of the kernels' tuning
configurations."""

from __future__ import annotations

import torch

from hybridtitan import ops

SCRIPT = r"""
import torch
from hybridtitan.ops import conv_triton, reference

torch.manual_seed(0)


def run(fn, base, w0, b0, grads, dtype, D):
    x = base.to(dtype).clone().requires_grad_()
    w = w0.to(dtype).clone().requires_grad_()
    b = b0.to(dtype).clone().requires_grad_() if b0 is not None else None
    outs = fn(x[..., :D], w, b)  # the first D channels of more: rows strided, as a projection's column block
    sum((o.float() * g).sum() for o, g in zip(outs, grads) if g is not None).backward()
    got = [torch.cat([o.float() for o in outs], -1), x.grad.float(), w.grad.float()]
    return got + ([b.grad.float()] if b is not None else []), outs


cases = [  # B, T, sizes, W, bias, silu, dtype, the outputs' gradients given (None: left out of the loss)
    (2, 70, (8, 8, 16), 4, False, True, torch.float32, (1, 1, 1)),
    (1, 5, (130,), 4, True, True, torch.float32, (1,)),
    (2, 33, (40, 24), 3, True, False, torch.float32, (1, 1)),
    (2, 130, (16, 16, 32), 4, False, True, torch.bfloat16, (1, 1, 1)),
    (1, 66, (24, 8), 4, True, True, torch.float32, (1, None)),
]
# each tuning configuration in turn (the interpreter cannot time them: one at a time, the autotuner only runs it)
for config, (B, T, sizes, W, bias, silu, dtype, given) in [(c, case) for c in conv_triton._CONFIGS for case in cases]:
    for kernel in (conv_triton._short_conv_fwd, conv_triton._short_conv_bwd_pre, conv_triton._short_conv_bwd_x):
        kernel.configs, kernel.cache = [config], {}
    D = sum(sizes)
    base = torch.randn(B, T, D + (8 if B == 1 else 5))  # rows 8-aligned (as KDA's projection) or odd
    w0, b0 = torch.randn(D, W) * 0.4, (torch.randn(D) * 0.1 if bias else None)
    grads = [torch.randn(B, T, n) if g else None for n, g in zip(sizes, given)]
    act = "silu" if silu else None
    ref, _ = run(lambda x, w, b: reference.causal_conv1d(x.float(), w.float(), None if b is None else b.float(),
                                                         act)[0].split(sizes, -1), base, w0, b0, grads, dtype, D)
    got, outs = run(lambda x, w, b: conv_triton.short_conv(x, w, b, silu, sizes), base, w0, b0, grads, dtype, D)
    assert all(o.is_contiguous() and o.dtype == dtype for o in outs)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        err = ((g - r).norm() / r.norm()).item()
        assert err < tol, (config, B, T, sizes, W, bias, silu, dtype, name, err)
print("OK")
"""


def test_kernels_in_triton_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(SCRIPT)


def test_short_conv_blocks_on_cpu():
    """Off the GPU, ops.short_conv is the reference convolution cut into blocks: views of one output, with the
    decoding state when asked for."""
    x, w = torch.randn(2, 9, 12), torch.randn(12, 4)
    ys, state = ops.short_conv(x, w, None, "silu", [4, 8], output_final_state=True)
    full, ref_state = ops.causal_conv1d(x, w, None, "silu", output_final_state=True)
    assert [y.shape[-1] for y in ys] == [4, 8]
    assert torch.equal(torch.cat(ys, -1), full) and torch.equal(state, ref_state)

"""The mixers' short convolution alone, forward + backward: our kernels (ops/conv_triton.py) against FLA's.

As the mixers call it: the input is the q, k, v (or x, B, C) column block of the fused input projection, and
each output block goes on as a contiguous tensor (FLA's recurrent kernels copy a strided view into one, so the
FLA row includes those copies). Prints microseconds per forward + backward and the configs the autotuner chose.

    python scripts/bench_short_conv.py [--batch 32] [--seq 2048] [--reps 20]
"""

from __future__ import annotations

import argparse

import torch
from _gpu_common import Timer

# (name, the fused projection's width, the convolved blocks): the 300M flavors
CASES = (("gdn_300M", 1552, (256, 256, 512)), ("kda_300M", 1160, (256, 256, 512)),
         ("zebra_mamba2_300M xBC", 5152, (3072,)))


def time_conv(width: int, sizes: tuple[int, ...], ours: bool, batch: int, seq: int, reps: int, device) -> float:
    """Microseconds per forward + backward."""
    from hybridtitan import ops

    D = sum(sizes)
    proj = torch.randn(batch, seq, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(D, 4, device=device) * 0.3).to(torch.bfloat16).requires_grad_()
    grads = [torch.randn(batch, seq, n, device=device, dtype=torch.bfloat16) for n in sizes]
    previous = ops.use_triton_conv(ours)
    try:
        def step():
            outputs, _ = ops.short_conv(proj[..., :D], weight, None, "silu", sizes)
            torch.autograd.backward([o.contiguous() for o in outputs], grads)

        for _ in range(3):  # autotune, compile
            step()
        with Timer(device) as timer:
            for _ in range(reps):
                step()
        return timer.seconds / reps * 1e6
    finally:
        ops.use_triton_conv(previous)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a dry run (both rows run the PyTorch reference)")
    args = p.parse_args()
    device = torch.device(args.device)
    for name, width, sizes in CASES:
        fla = time_conv(width, sizes, False, args.batch, args.seq, args.reps, device)
        ours = time_conv(width, sizes, True, args.batch, args.seq, args.reps, device)
        print(f"{name}: FLA {fla:.0f} us, ours {ours:.0f} us per forward + backward "
              f"({args.batch} x {args.seq} tokens, projection width {width}, blocks {sizes})")
    if device.type == "cuda":
        from hybridtitan.ops import conv_triton

        for kernel in (conv_triton._short_conv_fwd, conv_triton._short_conv_bwd_pre, conv_triton._short_conv_bwd_x):
            chosen = sorted({str(config) for config in kernel.cache.values()})
            print(f"{kernel.fn.__name__}: {'; '.join(chosen)}")


if __name__ == "__main__":
    main()

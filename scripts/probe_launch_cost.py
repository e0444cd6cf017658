"""How much host (CPU) time one call of each recurrent mixer's GPU op costs, forward and backward.

At small micro-batches the training step is set by how fast the host launches kernels (docs/benchmarks.md,
eighth measurement: what training.cuda_graphs removes). This measures the host side alone: at tiny shapes the
GPU finishes each kernel long before the next is launched, so the wall time per call is the host's cost of the
call (Python, autograd, Triton's launcher). Then cProfile says where in the call that time goes.

    python scripts/probe_launch_cost.py [--calls 200] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def make_inputs(op: str, device, B=1, T=64):
    from hybridtitan.models.common import init_dt_bias, init_log_uniform_A

    H, HV, K, V = (4, 8, 64, 64) if op == "gated_delta_rule" else (8, 8, 32, 64)  # gdn_300M / kda_300M heads
    decay = (HV,) if op == "gated_delta_rule" else (HV, K)
    A_log, dt_bias = torch.empty(HV, device=device), torch.empty(int(torch.tensor(decay).prod()), device=device)
    init_log_uniform_A(A_log)
    init_dt_bias(dt_bias)
    t = [torch.randn(B, T, H, K, device=device), torch.randn(B, T, H, K, device=device),
         torch.randn(B, T, HV, V, device=device), torch.randn(B, T, *decay, device=device),
         torch.randn(B, T, HV, device=device), A_log, dt_bias]
    return [x.to(torch.bfloat16).requires_grad_() for x in t]


def one_call(fn, inputs):
    out, _ = fn(*inputs)
    out.sum().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the PyTorch reference ops)")
    args = p.parse_args()
    from hybridtitan import ops

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name in ("gated_delta_rule", "kda"):
        fn = getattr(ops, name)
        inputs = make_inputs(name, device)
        for _ in range(5):  # compile and autotune
            one_call(fn, inputs)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            one_call(fn, inputs)
        sync()
        per_call = (time.perf_counter() - t0) / args.calls * 1e3
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn(*inputs)
        sync()
        fwd = (time.perf_counter() - t0) / args.calls * 1e3
        print(f"{name}: {per_call:.3f} ms of host time per forward + backward call ({fwd:.3f} ms the forward "
              f"alone, with autograd recording), B=1 T=64")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls // 4):
            one_call(fn, inputs)
        sync()
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()

"""Attention under context parallelism on one GPU: one rank's queries against the whole sequence's keys
(``hybridtitan.ops.context_parallel.cp_attention``), the GPU kernel against the PyTorch reference.

    python gpu_harness/benchmarks/cp_attention.py --json $OUT/cp_attention.json     # on the GPU machine
    python gpu_harness/benchmarks/cp_attention.py --device cpu --seq-len 1024       # a CPU dry run

One row of T tokens (default 131,072, one document) split over W ranks in the zigzag layout; rank 0's share
(T / W tokens: chunks 0 and 2W - 1, so its late chunk sees every key). Per W (default 4 and 2: 32,768 and 65,536
queries) and head shape (Llama-3.2-1B's grouped-query attention, 32 query heads over 8 key/value heads of 64;
MLA_1B's, 32 heads of 64 with keys per head), each kernel runs forward and backward: ``fused`` (``Kernels()``:
SDPA's flash kernel with its bottom-right causal alignment) and ``reference`` (``KernelConfig(reference=True)``:
SDPA with an explicit [T / W, S] mask). Reported: milliseconds per forward + backward (median of --repeats after
one warm-up), the peak memory above the inputs, and the fused kernel's output and gradients against the reference
(||a - b|| / ||b||), or the reference's out-of-memory error. Inputs in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

import torch  # noqa: E402

from common import Timer, is_oom, rel_err  # noqa: E402  (puts the checkout on sys.path)
from hybridtitan.ops import KernelConfig, Kernels  # noqa: E402
from hybridtitan.ops import context_parallel as cp  # noqa: E402

SHAPES = {"gqa": (32, 8, 64, 64), "mla": (32, 32, 64, 64)}  # query heads, key/value heads, Dk, Dv


def run(kernels, shard, q, k, v, cotangent):
    """Forward and backward once: (output, (dq, dk, dv))."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = cp.cp_attention(kernels, shard, *leaves, q.shape[-1] ** -0.5)
    out.backward(cotangent)
    return out.detach(), tuple(x.grad for x in leaves)


def measure(kernels, shard, q, k, v, cotangent, repeats: int, device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out, grads = run(kernels, shard, q, k, v, cotangent)  # the warm-up
    times = []
    for _ in range(repeats):
        with Timer(device) as timer:
            run(kernels, shard, q, k, v, cotangent)
        times.append(1e3 * timer.seconds)
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30 if cuda else None
    return {"ms": statistics.median(times), "peak_gib": peak, "out": out, "grads": grads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--degrees", default="4,2")
    p.add_argument("--shapes", default="gqa,mla")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    T = args.seq_len
    print(f"cp_attention, rank 0 of W (zigzag), T = {T}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    print(f"{'shape':<5} {'W':>2} {'queries':>8} {'kernel':<10} {'ms fwd+bwd':>11} {'peak GiB':>9}  vs reference")
    rows = []
    for name in args.shapes.split(","):
        H, Hk, Dk, Dv = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        k = torch.randn(1, T, Hk, Dk, generator=g).to(device, torch.bfloat16)
        v = torch.randn(1, T, Hk, Dv, generator=g).to(device, torch.bfloat16)
        for W in map(int, args.degrees.split(",")):
            shard = cp.shard_for(None, T, None, "zigzag", rank=0, degree=W, device=device)
            q = shard.split(torch.randn(1, T, H, Dk, generator=g).to(device, torch.bfloat16))
            cotangent = torch.randn(1, shard.local_len, H, Dv, generator=g).to(device, torch.bfloat16)
            results = {}
            for kernel, config in (("fused", KernelConfig()), ("reference", KernelConfig(reference=True))):
                try:
                    results[kernel] = measure(Kernels(config), shard, q, k, v, cotangent, args.repeats, device)
                except Exception as e:  # the reference's [T / W, S] mask may not fit
                    if not is_oom(e):
                        raise
                    results[kernel] = {"error": "out of memory"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            fused, ref = results["fused"], results["reference"]
            errors = None
            if "out" in fused and "out" in ref:
                errors = {"output": rel_err(fused["out"], ref["out"]),
                          **{f"d{n}": rel_err(a, b) for n, a, b in zip("qkv", fused["grads"], ref["grads"])}}
            for kernel, r in results.items():
                row = {"shape": name, "degree": W, "queries": shard.local_len, "kernel": kernel,
                       "ms": r.get("ms"), "peak_gib": r.get("peak_gib"), "error": r.get("error")}
                if kernel == "fused":
                    row["vs_reference"] = errors
                rows.append(row)
                text = (r["error"] if "error" in r else
                        f"{r['ms']:>11.1f} {r['peak_gib'] if r['peak_gib'] is not None else float('nan'):>9.2f}")
                detail = ", ".join(f"{n} {e:.1e}" for n, e in errors.items()) if kernel == "fused" and errors else ""
                print(f"{name:<5} {W:>2} {shard.local_len:>8} {kernel:<10} {text}  {detail}", flush=True)
            del results, fused, ref
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"seq_len": T, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

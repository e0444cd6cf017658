"""The gated delta rule's A_log / dt_bias gradients on the GPU, over seeds: bf16 rounding or a kernel fault?

    python scripts/probe_gate_grads.py                       # on the GPU: gpu_check's dense case, seeds 0-5
    python scripts/probe_gate_grads.py --device cpu --tiny   # a dry run on the reference kernels

gpu_check's dense gated-delta-rule case (gdn_300M's heads, two rows of 2,048 tokens, the models' A_log /
dt_bias initialisation) gave A_log and dt_bias gradients 1.19e-2 from the float32 reference, over the 1e-2 bar,
while every other input's gradient stayed under 6e-3 (docs/benchmarks.md). Each of the two is 8 numbers, a sum
over 4,096 tokens of per-token gate gradients. For each seed this prints the relative error of every gradient
twice: with A_log / dt_bias in bf16 (as gpu_check and the models' bf16 compute pass them) and in float32, and
the error that storing the reference's own dt_bias gradient in bf16 would make. Then, from the reference run
again with the two parameters given per token, how much the sums cancel (the norm of the summed magnitudes of
the per-token terms over the norm of their sum) and the error measured against those summed magnitudes, which
is what a sum's rounding error scales with. Errors that move with the seed, do not fall with float32
parameters, and are small against the summed magnitudes are the kernel's bf16 rounding of the per-token terms,
magnified by the cancellation; one seed far off, or NaN, is a fault.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _gpu_common import rel_err  # noqa: E402

import gpu_check  # noqa: E402
from hybridtitan import ops  # noqa: E402

INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias")


def run(make, call, seed: int, fp32_params: bool, device) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tensors, kwargs = make(gen)
    fast = {k: gpu_check._leaf(v, torch.float32 if fp32_params and k in ("A_log", "dt_bias") else None)
            for k, v in tensors.items()}
    ref = {k: gpu_check._leaf(v, torch.float32) for k, v in tensors.items()}
    out = call(**fast, **kwargs)
    with ops.use_reference_kernels():
        out_ref = call(**ref, **kwargs)
    grad_out = torch.randn(out_ref.shape, generator=gen).to(device)
    (out.float() * grad_out).sum().backward()
    with ops.use_reference_kernels():
        (out_ref.float() * grad_out).sum().backward()
    row = {"out": rel_err(out, out_ref), **{k: rel_err(fast[k].grad, ref[k].grad) for k in INPUTS}}
    row["dt_bias bf16 storage"] = rel_err(ref["dt_bias"].grad.to(torch.bfloat16), ref["dt_bias"].grad)
    # The reference once more with A_log / dt_bias given per token (expanded like a): their gradients are then
    # the per-token terms whose sums over the tokens are the parameters' gradients
    per_token = {k: ref[k].detach().expand(ref["a"].shape).clone().requires_grad_() for k in ("A_log", "dt_bias")}
    with ops.use_reference_kernels():
        out_terms = call(**{**{k: v.detach() for k, v in ref.items()}, **per_token}, **kwargs)
        (out_terms.float() * grad_out).sum().backward()
    for k, leaf in per_token.items():
        terms = leaf.grad.flatten(0, 1).double()  # [tokens, heads]
        summed, magnitudes = terms.sum(0), terms.abs().sum(0)
        assert torch.allclose(summed, ref[k].grad.double(), rtol=1e-3, atol=1e-6 * magnitudes.max().item())
        # cancellation: how much smaller the sum is than its terms' magnitudes (1: no cancellation)
        row[f"{k} cancellation"] = (magnitudes.norm() / summed.norm()).item()
        # the error against what a sum's rounding scales with: the summed magnitudes of its terms
        row[f"{k} err / summed magnitudes"] = ((fast[k].grad.double() - summed).norm() / magnitudes.norm()).item()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="gpu_check's small shapes")
    p.add_argument("--seeds", type=int, default=6)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cases = {(op, case): (make, call) for op, case, make, call, _ in gpu_check.op_cases(gpu_check.Shapes(args.tiny),
                                                                                         device)}
    make, call = cases[("gated_delta_rule", "dense B=2")]
    columns = ["out", *INPUTS, "dt_bias bf16 storage", "A_log cancellation", "dt_bias cancellation",
               "A_log err / summed magnitudes", "dt_bias err / summed magnitudes"]
    print("| seed | A_log, dt_bias | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    worst, worst_scaled, finite = 0.0, 0.0, True
    for seed in range(args.seeds):
        for fp32_params in (False, True):
            row = run(make, call, seed, fp32_params, device)
            worst = max(worst, row["A_log"], row["dt_bias"])
            worst_scaled = max(worst_scaled, *(row[f"{k} err / summed magnitudes"] for k in ("A_log", "dt_bias")))
            finite = finite and all(math.isfinite(v) for v in row.values())
            print(f"| {seed} | {'float32' if fp32_params else 'bf16'} | "
                  + " | ".join(f"{row[c]:.2e}" for c in columns) + " |", flush=True)
    print(f"largest A_log / dt_bias gradient error: {worst:.2e}; against the summed magnitudes of the per-token "
          f"terms: {worst_scaled:.2e}" + ("" if finite else "; NON-FINITE errors"))
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())

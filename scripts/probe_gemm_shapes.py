"""How fast each matrix product of a training step runs on its own, per BLAS library.

The GEMMs are most of a 300M model's step (docs/benchmarks.md: ~171 of ~260 ms for gdn_300M). This lists every
projection's products in one step of a flavor (forward, input gradient, weight gradient; the output layer by
chunks, its weight gradient accumulated in float32 in the GEMM, as ``ops.linear_cross_entropy`` does; not the
products inside the recurrent kernels or attention), times each shape alone, and sums them with their counts:
what the step's GEMMs would cost at those speeds, under each library torch can use
(``torch.backends.cuda.preferred_blas_library``).

``--layouts`` times each product a second way that costs only a copy of a weight-sized matrix: the forward
product against the weight stored transposed ("nt" -> "nn"), the input gradient against it ("nn" -> "nt"), the
weight gradient as its transpose (dW^T = x^T dY, then a transposed copy: "tn" with M and N swapped); it sums the
step with the faster of the two per shape, and prints what the copies would cost.

    python scripts/probe_gemm_shapes.py [--flavor gdn_300M] [--tokens 65536] [--libs cublas,cublaslt] [--layouts]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from _gpu_common import Timer


def step_gemms(flavor: str, tokens: int, loss_chunk: int) -> Counter:
    """(M, N, K, layout, float32-accumulating) -> how many times per step, for y[M, N] = a[M, K] @ b[K, N];
    layout: how a and b lie in memory ("nt": b is a weight [N, K] used transposed, as in a forward pass; "nn":
    an input gradient; "tn": a weight gradient, a is a [K, M] activation gradient used transposed)."""
    from hybridtitan.models import HybridLM, get_flavor

    with torch.device("meta"):
        model = HybridLM(get_flavor(flavor))
    shapes: Counter = Counter()

    def linear(n_out: int, n_in: int, t: int = tokens) -> None:
        shapes[(t, n_out, n_in, "nt", False)] += 1  # forward
        shapes[(t, n_in, n_out, "nn", False)] += 1  # input gradient
        shapes[(n_out, n_in, t, "tn", False)] += 1  # weight gradient

    for layer in model.layers:
        body = layer.body
        fused_in = [m for n, m in body.named_children() if isinstance(m, torch.nn.Linear)
                    and n in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "in_proj")]
        for n, m in body.named_children():  # low-rank pairs (KDA): the first half joins the fused product
            if isinstance(m, torch.nn.Sequential):
                fused_in.append(m[0])
                linear(m[1].out_features, m[1].in_features)
        if fused_in:  # models/common.py fused_linear: one product over the concatenated weights
            linear(sum(m.out_features for m in fused_in), fused_in[0].in_features)
        for n, m in body.named_children():
            if isinstance(m, torch.nn.Linear) and m not in fused_in:
                linear(m.out_features, m.in_features)
    vocab, dim = model.output_weight.shape
    for start in range(0, tokens, loss_chunk):
        t = min(loss_chunk, tokens - start)
        shapes[(t, vocab, dim, "nt", False)] += 1  # logits
        shapes[(t, dim, vocab, "nn", False)] += 1  # hidden gradient
        shapes[(vocab, dim, t, "tn", True)] += 1  # weight gradient, added in float32
    return shapes


def time_gemm(m: int, n: int, k: int, layout: str, fp32_acc: bool, reps: int) -> float:
    def operand(rows, cols, transposed):
        x = torch.randn(cols, rows, device="cuda", dtype=torch.bfloat16) if transposed else \
            torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        return x.t() if transposed else x

    a, b = operand(m, k, layout[0] == "t"), operand(k, n, layout[1] == "t")
    acc = torch.zeros(m, n, device="cuda", dtype=torch.float32) if fp32_acc else None

    def run():
        if fp32_acc:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            a @ b

    for _ in range(3):
        run()
    with Timer(a.device) as timer:
        for _ in range(reps):
            run()
    return timer.seconds * 1e3 / reps


def time_alternative(m: int, n: int, k: int, layout: str, fp32_acc: bool, reps: int) -> float:
    """The same product laid out the other way (module docstring, ``--layouts``); the copies are not in it."""
    if layout == "nt":  # forward against a transposed copy of the weight [N, K] -> [K, N]
        return time_gemm(m, n, k, "nn", fp32_acc, reps)
    if layout == "nn":  # input gradient against the transposed copy (made in the forward pass)
        return time_gemm(m, n, k, "nt", fp32_acc, reps)
    return time_gemm(n, m, k, "tn", fp32_acc, reps)  # weight gradient [M, N] as its transpose [N, M] = b^T a^T


def transpose_copy_ms(rows: int, cols: int, reps: int, dtype: torch.dtype = torch.bfloat16) -> float:
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    with Timer(x.device) as timer:
        for _ in range(reps):
            x.t().contiguous()
    return timer.seconds * 1e3 / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="gdn_300M")
    p.add_argument("--tokens", type=int, default=32 * 2048)
    p.add_argument("--loss-chunk", type=int, default=None, help="default: the trainer's training.loss_chunk_size")
    p.add_argument("--libs", default="cublas,cublaslt")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layouts", action="store_true", help="also each product's alternative layout (above)")
    args = p.parse_args()
    from hybridtitan.config import Training

    shapes = step_gemms(args.flavor, args.tokens, args.loss_chunk or Training.loss_chunk_size)
    libs = args.libs.split(",")
    totals = dict.fromkeys(libs, 0.0)
    print(f"{args.flavor}, {args.tokens} tokens: {sum(shapes.values())} products per step of {len(shapes)} shapes")
    best = dict.fromkeys(libs, 0.0)
    print(f"{'M x N x K':>26} {'layout':>6} {'fp32 acc':>8} {'count':>5} "
          + " ".join(f"{lib + ' TFLOP/s':>17}" + (f"{'alternative':>17}" if args.layouts else "") for lib in libs))
    for (m, n, k, layout, acc), count in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1]):
        row = []
        for lib in libs:
            torch.backends.cuda.preferred_blas_library(lib)
            ms = time_gemm(m, n, k, layout, acc, args.reps)
            totals[lib] += ms * count
            row.append(f"{2 * m * n * k / ms / 1e9:17.1f}")
            if args.layouts:
                alt = time_alternative(m, n, k, layout, acc, args.reps)
                best[lib] += min(ms, alt) * count
                row.append(f"{2 * m * n * k / alt / 1e9:17.1f}")
        print(f"{f'{m} x {n} x {k}':>26} {layout:>6} {str(acc):>8} {count:5d} " + " ".join(row))
    if args.layouts:
        # one transposed copy per weight and step (the output layer's chunks share theirs), and of each weight
        # gradient (the output layer's float32 sum once); an upper bound: only shapes faster the other way need it
        vocab = max(n for (_, n, _, layout, _) in shapes if layout == "nt")
        copies = sum((1 if n == vocab else count) * transpose_copy_ms(n, k, args.reps)
                     for (_, n, k, layout, _), count in shapes.items() if layout == "nt")
        copies += sum((1 if acc else count) * transpose_copy_ms(n, m, args.reps, torch.float32 if acc else
                                                                torch.bfloat16)
                      for (m, n, _, layout, acc), count in shapes.items() if layout == "tn")
        print(f"transposed copies of every weight and weight gradient: {copies:.1f} ms per step")
    flops = sum(2 * m * n * k * c for (m, n, k, _, _), c in shapes.items())
    for lib in libs:
        print(f"{lib}: the step's GEMMs {totals[lib]:.1f} ms, {flops / totals[lib] / 1e9:.1f} TFLOP/s"
              + (f"; the faster layout of each: {best[lib]:.1f} ms" if args.layouts else ""))


if __name__ == "__main__":
    main()

"""Find which kernel of a Mamba2 sublayer fails with packed documents on a GPU: each piece at the shapes of the
end-to-end parity case (debug_mamba2, two rows of 512 flattened, documents [0, 100, 512, 700, 1024]), forward and
backward, each in its own process under CUDA_LAUNCH_BLOCKING=1 (an illegal memory access ends the CUDA context,
so one process per case names the culprit).

    python scripts/probe_mamba2_packed.py            # the table of cases
    python scripts/probe_mamba2_packed.py CASE       # one case, in this process
    PROBE_DEVICE=cpu python scripts/probe_mamba2_packed.py   # a dry run on the reference kernels
    PROBE_CASES="Mamba2 layer packed;simple_gla dense B=2" PROBE_CASE_S=300 python scripts/probe_mamba2_packed.py

PROBE_CASES: exact case names separated by ";" (default all); PROBE_CASE_S: seconds per case (default 150; a
shape the Triton cache has not seen autotunes for minutes); PROBE_TOL: the relative gradient error above which a
case fails (default 5e-2). What it found on the H200 (2026-11-30): FLA's
packed simple-GLA backward at key dim 16 (docs/benchmarks.md), hence the padding in hybridtitan.ops.fla_backend
(since widened to value dims below 64 as well, after gpu_check's packed case at key 64 / value 32 faulted).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CU = [0, 100, 512, 700, 1024]
DEV = os.environ.get("PROBE_DEVICE", "cuda")  # "cpu": a dry run of the cases on the reference kernels
# relative error of a gradient vs float32 above which a case fails; bf16 rounding alone gives up to ~2e-2
TOL = float(os.environ.get("PROBE_TOL", "5e-2"))


def _cu(dtype_name: str = "long"):
    import torch

    return torch.tensor(CU, dtype=getattr(torch, dtype_name), device=DEV)


def _layer(seed: int = 0):
    import torch

    from hybridtitan.models.flavors import get_flavor
    from hybridtitan.models.mamba2 import Mamba2
    from hybridtitan.models.model import init_module

    args = get_flavor("debug_mamba2")
    torch.manual_seed(seed)
    layer = Mamba2(args.dim, args.mamba2, args.norm_eps)
    for m in layer.modules():
        init_module(m, 0.02)
    return args, layer.to(DEV, torch.bfloat16)


def _report(name, fn, inputs):
    """fn(*inputs) -> output; forward + backward on the fast path and on the reference kernels in float32; prints
    whether every gradient is finite and its relative error."""
    import torch
    from _gpu_common import rel_err

    from hybridtitan import ops

    def run(cast, reference):
        xs = [x.detach().to(cast).requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
        if reference:
            with ops.use_reference_kernels():
                out = fn(*xs)
        else:
            out = fn(*xs)
        out.float().pow(2).sum().backward()
        return out.detach().float(), [x.grad.float() if x.requires_grad else None for x in xs]

    out, grads = run(torch.bfloat16, False)
    ref, ref_grads = run(torch.float32, True)
    errs = [rel_err(g, r) for g, r in zip(grads, ref_grads) if g is not None]
    finite = [bool(torch.isfinite(g).all()) for g in grads if g is not None]
    print(f"RESULT {name}: out err {rel_err(out, ref):.2e}; grads finite {finite}; "
          f"grad errs {[f'{e:.1e}' for e in errs]}", flush=True)
    if not all(finite) or max(errs) > TOL:  # the process exits 1: the case is reported as FAIL
        raise SystemExit(f"gradients not finite or off by more than {TOL:g}")


def case_simple_gla(rows: int = 1, K: int = 16, V: int = 32, raw: bool = False):
    """raw: FLA's chunk_simple_gla called directly, without hybridtitan.ops (which pads small head dims)."""
    import torch

    from hybridtitan import ops

    T, H = 1024 // rows, 8
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k = (torch.randn(rows, T, H, K, device=DEV, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(rows, T, H, V, device=DEV, generator=g).requires_grad_()
    gate = (-torch.rand(rows, T, H, device=DEV, generator=g) * 0.5).requires_grad_()
    cu = _cu() if rows == 1 else None

    def fn(q, k, v, gate):
        if raw and q.dtype != torch.float32:  # the reference run (float32) goes through ops
            from fla.ops.simple_gla import chunk_simple_gla

            return chunk_simple_gla(q, k, v, gate.float(), scale=1.0, cu_seqlens=cu)[0]
        return ops.simple_gla(q, k, v, gate.float(), scale=1.0, cu_seqlens=cu)[0]

    _report(f"simple_gla rows={rows} K={K} V={V}{' (FLA directly)' if raw else ''}", fn, [q, k, v, gate])


def case_conv(strided: bool = True):
    import torch

    from hybridtitan import ops

    g = torch.Generator(device=DEV).manual_seed(0)
    full = torch.randn(1, 1024, 584, device=DEV, generator=g).requires_grad_()
    w = (torch.randn(320, 4, device=DEV, generator=g) * 0.3).requires_grad_()
    b = torch.randn(320, device=DEV, generator=g).requires_grad_()
    cu = _cu()
    # the in_proj's [x | B | C] columns, as Mamba2 passes them (a view), or a copy
    take = (lambda f: f[..., 256:576]) if strided else (lambda f: f[..., 256:576].contiguous())
    _report(f"conv packed, {'strided' if strided else 'contiguous'} input",
            lambda f, w, b: ops.causal_conv1d(take(f), w, b, "silu", cu_seqlens=cu)[0], [full, w, b])


def case_group_norm():
    import torch

    from hybridtitan import ops

    g = torch.Generator(device=DEV).manual_seed(0)
    full = torch.randn(1, 1024, 584, device=DEV, generator=g).requires_grad_()
    x = torch.randn(1, 1024, 256, device=DEV, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(256, device=DEV, generator=g)).requires_grad_()
    _report("grouped gated norm", lambda x, f, w: ops.gated_rms_norm(x, f[..., :256], w, 1e-6, "swish", False, 128),
            [x, full, w])


def case_layer(rows: int = 1):
    import torch

    args, layer = _layer()
    layer = layer.float()
    T = 1024 // rows
    u = torch.randn(rows, T, args.dim, device=DEV).requires_grad_()
    cu = _cu() if rows == 1 else None
    params = dict(layer.named_parameters())

    def fn(u, *ps):
        return torch.func.functional_call(layer, dict(zip(params, ps)), (u,), {"cu_seqlens": cu})

    _report(f"Mamba2 layer rows={rows}{' packed' if cu is not None else ''} (grads: u, " + ", ".join(params) + ")",
            fn, [u, *[p.detach().requires_grad_() for p in params.values()]])


def case_model_anomaly():
    """The whole model, packed, under autograd anomaly detection: names the backward that first makes a NaN."""
    import torch

    from hybridtitan.models import build_model
    from hybridtitan.models.flavors import get_flavor

    args = get_flavor("debug_mamba2")
    torch.manual_seed(0)
    model = build_model(args, "cpu")
    model.init_weights()
    model = model.to(DEV, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 512), generator=gen).to(DEV)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100, device=DEV)], 1)
    with torch.autograd.set_detect_anomaly(True):
        try:
            model(ids, labels=labels, cu_seqlens=_cu("int32")).backward()
            anomaly = None
            print("RESULT model packed: backward ran without NaN", flush=True)
        except RuntimeError as e:
            anomaly = str(e).splitlines()[0][:300]
            print("RESULT model packed, anomaly:", anomaly, flush=True)
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    print(f"RESULT model packed: parameters with non-finite gradients: {bad}", flush=True)
    if anomaly or bad:
        raise SystemExit("non-finite gradients")


CASES = {
    "simple_gla packed K=16 V=32": case_simple_gla,
    "simple_gla packed K=16 V=32, FLA directly": lambda: case_simple_gla(raw=True),
    "simple_gla packed K=32 V=64, FLA directly": lambda: case_simple_gla(K=32, V=64, raw=True),
    "simple_gla packed K=64 V=64, FLA directly": lambda: case_simple_gla(K=64, V=64, raw=True),
    "simple_gla packed K=128 V=128, FLA directly": lambda: case_simple_gla(K=128, V=128, raw=True),
    "simple_gla dense B=2": lambda: case_simple_gla(rows=2),
    "conv packed, strided input": lambda: case_conv(True),
    "conv packed, contiguous input": lambda: case_conv(False),
    "grouped gated norm": case_group_norm,
    "Mamba2 layer packed": case_layer,
    "Mamba2 layer dense B=2": lambda: case_layer(rows=2),
    "model packed, anomaly detection": case_model_anomaly,
}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] not in CASES:
        print(f"unknown case {sys.argv[1]!r}; the cases are: {list(CASES)}", file=sys.stderr)
        return 2
    if len(sys.argv) > 1:
        import torch

        CASES[sys.argv[1]]()
        if DEV == "cuda":
            torch.cuda.synchronize()
        print("OK")
        return 0
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONWARNINGS": "ignore"}
    failures = 0
    only = [c for c in os.environ.get("PROBE_CASES", "").split(";") if c]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; the cases are: {list(CASES)}", file=sys.stderr)
        return 2
    for name in [n for n in CASES if not only or n in only]:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True,
                                  timeout=float(os.environ.get("PROBE_CASE_S", "150")))
            ok = proc.returncode == 0
            tail = "" if ok else (proc.stderr.strip().splitlines() or ["(no output)"])
        except subprocess.TimeoutExpired:
            ok, tail = False, ["timed out"]
        failures += not ok
        print(f"{'OK  ' if ok else 'FAIL'} {time.perf_counter() - t0:6.1f}s  {name}", flush=True)
        if tail != ["timed out"]:
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT"):
                    print("        " + line[7:], flush=True)
        if not ok:
            frames = [line for line in proc.stderr.splitlines() if line.strip().startswith("File ")] \
                if tail != ["timed out"] else []
            for line in frames[-8:] + tail[-3:]:
                print("        " + line.strip()[:220], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU parity: FLA's Triton path against the PyTorch reference kernels, op by op, end to end, replayed from CUDA
graphs, and against FLA's own Hugging Face classes.

    python gpu_harness/checks/gpu_check.py                       # on the GPU: every check, about 1-3 minutes warm
    python gpu_harness/checks/gpu_check.py --only ops,fla --json $OUT/gpu_check.json
    python gpu_harness/checks/gpu_check.py --only ops,e2e --ops simple_gla,conv --e2e-flavors debug_mamba2
    python gpu_harness/checks/gpu_check.py --device cpu --tiny   # dry run on a CPU: the same code paths, small shapes

ops  every op of ``hybridtitan.ops.Kernels`` with bf16 inputs on the GPU, under the kernel configuration the
     case names (the default: FLA's and our Triton kernels; or with torch.compile of the norms, SwiGLU or the
     loss chunks), against the same values upcast to float32 under ``KernelConfig(reference=True)`` (the
     chunked PyTorch reference, on the same device); the output and the gradient of every input, relative
     error ||a - b|| / ||b|| < 1e-2; dense batches and packed documents (cu_seqlens, a batch of one). Shapes of
     the 300M models.
e2e  each debug flavor, same weights and batch (also packed): the loss of a model built with the reference
     kernels, in float32 on the CPU, against the same weights in a model built with the trainer's GPU kernels
     (the fused residual adds included), in bf16 on the GPU: loss and gradient norm within 1e-2. The whole
     gradient's relative error and the loss of the bf16 weights under the reference kernels are shown to tell
     a kernel difference from bf16 rounding.
graphs  the recurrent mixers' ops and the debug GDN / KDA / Mamba2 models under ``KernelConfig(cuda_graphs=True)``
     against the same calls run eagerly: the graphs captured on one input, then replayed on another, must give
     that input's eager output and gradients (relative error < 1e-5). GPU only.
fla  pure GDN / KDA models against FLA's GatedDeltaNetForCausalLM / KDAForCausalLM holding the same weights:
     logits on the GPU within 1e-2, dense and packed, in float32 and in bf16. In bf16 two kernels that round
     in another order can differ by more while each is as far from the truth (KDA in our chunks of 32 against
     FLA's 64, at the 300M shapes): a bf16 case also passes when our logits are no further (x1.1) from the
     float32 CPU reference than FLA's and the two differ by less than 3x the bar. Weights go through
     hybridtitan's exporter (python -m hybridtitan.export_hf) when it exists, checked tensor by tensor against
     this script's own name mapping, which is used otherwise (and alone in float32: the exporter writes bf16
     weights).

On a CPU (--device cpu) the "fast" side is the reference in bf16 (no FLA kernels run there; torch.compile and
the fused residual adds do), and FLA's HF models are built, loaded and compared weight by weight but not run.
Every case prints PASS, FAIL (with the one-line error) or SKIP and the run goes on; the exit code is 1 if any
case failed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import (  # noqa: E402
    REPO,
    build_with_kernels,
    fla_config,
    fla_model_class,
    fmt,
    format_table,
    kernel_config_arguments,
    load_into_fla,
    one_line,
    record_kernel_configs,
    rel_diff,
    rel_err,
    run_exporter,
    to_fla_state_dict,
    use_kernel_configs,
    versions,
    write_json,
)
from hybridtitan.models import get_flavor  # noqa: E402
from hybridtitan.models.modules import init_dt_bias, init_log_uniform_A  # noqa: E402
from hybridtitan.ops import KernelConfig, Kernels  # noqa: E402

TOL = 1e-2
# fla, bf16: ours may be at most this much further from float32 than FLA's class when the two differ by more
# than the bar
BF16_AS_CLOSE = 1.1
BF16_AS_CLOSE_BOUND = 3  # ... and then they may differ by at most 3x the bar
E2E_FLAVORS = ("debug_gdn", "debug_kda", "debug_mamba2", "debug_hybrid")

# the yardstick of every comparison: the chunked PyTorch reference, whatever the device
REFERENCE = KernelConfig(reference=True)
# the trainer's kernels on a GPU with compile off (hybridtitan.train.kernel_config); the residual adds are fused
# on a CPU too, so that the dry run takes the GPU's code path
GPU_KERNELS = KernelConfig(fused_residual=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="small shapes (sequence 256, vocabulary 8192): a dry run")
    p.add_argument("--only", default="ops,e2e,graphs,fla", help="comma-separated subset of: ops, e2e, graphs, fla")
    p.add_argument("--json", default=None, help="write every result to this file (rewritten after each)")
    p.add_argument("--tol", type=float, default=TOL, help="relative error threshold (default 1e-2)")
    p.add_argument("--ops", default=None, metavar="NAMES",
                   help="ops section: only the cases whose op name contains one of these comma-separated words")
    p.add_argument("--e2e-flavors", default=",".join(E2E_FLAVORS))
    p.add_argument("--fla-models", default=None,
                   help="pure GDN/KDA configs for the FLA check (default: debug_gdn,debug_kda and, unless --tiny, "
                        "gdn_300M:4,kda_300M:4 = the 300M shapes with 4 sublayers)")
    p.add_argument("--exporter", default="hybridtitan.export_hf",
                   help="the exporter for the FLA check, if it exists: a module whose main(argv) takes "
                        "`--checkpoint DCP --output DIR` as `python -m MODULE` does, run in this process "
                        "('none': use this script's name mapping only)")
    p.add_argument("--exporter-args", default=f"--tokenizer {os.path.join(REPO, 'hybridtitan', 'assets', 'tokenizer')}",
                   help="extra arguments for the exporter (default: the tokenizer the repo ships, since a "
                        "model-only checkpoint names none)")
    p.add_argument("--seed", type=int, default=0)
    kernel_config_arguments(p)
    p.add_argument("--verbose", action="store_true", help="print the traceback of a failing case")
    args = p.parse_args(argv)
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = args.only - {"ops", "e2e", "graphs", "fla"}
    if unknown:
        p.error(f"--only: unknown section(s) {sorted(unknown)}; choose from ops, e2e, graphs, fla")
    return args


class Results:
    """Collects rows, prints each as it comes, and keeps going past failures. With ``json_path`` the rows so far
    are written after each one, so a run stopped by its time box keeps what it measured."""

    def __init__(self, verbose: bool, json_path: str | None = None, header: dict | None = None):
        self.rows: list[dict] = []
        self.verbose = verbose
        self.json_path, self.header = json_path, header or {}

    def write(self) -> None:
        if self.json_path:
            write_json(self.json_path, {**self.header, "results": self.rows})

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.write()
        status = row["status"]
        extra = f"  {row.get('error', '')}" if status != "PASS" else ""
        extra += f"  ({row['detail']})" if row.get("detail") else ""
        print(f"  [{status}] {row['section']}: {row['name']} / {row['case']}{extra}", flush=True)
        return row

    def fail(self, section: str, name: str, case: str, exc: BaseException) -> dict:
        if self.verbose:
            traceback.print_exc()
        return self.add({"section": section, "name": name, "case": case, "status": "FAIL", "error": one_line(exc)})

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "FAIL"]


# ================================================================================================ ops


class Shapes:
    def __init__(self, tiny: bool):
        self.T = 256 if tiny else 2048
        self.B = 2
        # four documents of uneven lengths (one of 5 tokens) over a batch of one; a rows=2 variant for MLA
        self.cu = [0, 37, 42, 180, 256] if tiny else [0, 317, 322, 1500, 2048]
        self.cu_rows = [0, 60, 128, 200, 256] if tiny else [0, 300, 1024, 1500, 2048]
        self.vocab = 8192 if tiny else 128256
        self.ce_tokens = 700 if tiny else 5000  # not a multiple of the chunk: two chunks, the last one short
        self.ce_chunk = 256 if tiny else 4096


def _randn(gen, *shape, device, scale=1.0):
    return torch.randn(*shape, generator=gen, device="cpu").mul_(scale).to(device)


def _seeded_init(gen, init, n, device):
    """A parameter initialised as the models do, from the case's generator (the inits draw from the global RNG)."""
    t = torch.empty(n)
    with torch.random.fork_rng(devices=[]):  # restores the CPU generator, the only one reseeded
        torch.default_generator.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        init(t)
    return t.to(device)


def _A_log(gen, n, device):
    return _seeded_init(gen, init_log_uniform_A, n, device)


def _dt_bias(gen, n, device):
    return _seeded_init(gen, init_dt_bias, n, device)


class OpCase:
    """One op case: ``make(gen)`` -> (tensors, kwargs); ``call(kernels, **tensors, **kwargs)`` -> the output, run
    under ``config`` on the fast side and under the reference on the other, or ``ref_call(**tensors, **kwargs)``
    there when given (an independent formula)."""

    def __init__(self, op: str, case: str, make, call, ref_call=None, config: KernelConfig | None = None):
        self.op, self.case, self.make, self.call, self.ref_call = op, case, make, call, ref_call
        self.kernels = Kernels(config or KernelConfig())


# the recipes' torch.compile components, one kernel choice each (compile.components "norm", "swiglu", "loss")
COMPILED_NORMS = KernelConfig(compiled_norms=True)
COMPILED_SWIGLU = KernelConfig(compiled_swiglu=True)
COMPILED_LOSS = KernelConfig(compiled_loss=True)
EAGER_LOSS = KernelConfig(triton_loss=False)


def op_cases(sh: Shapes, device: torch.device) -> list[OpCase]:
    bf16 = torch.bfloat16
    cu = torch.tensor(sh.cu, dtype=torch.int32, device=device)  # int32, as the data loader gives
    cu_rows = torch.tensor(sh.cu_rows, dtype=torch.int32, device=device)
    layouts = [("dense B=2", sh.B, None), (f"packed {len(sh.cu) - 1} docs", 1, cu)]
    cases = []

    def add(op, case, make, call, ref_call=None, config=None):
        cases.append(OpCase(op, case, make, call, ref_call, config))

    # --- Gated DeltaNet (gdn_300M: H=4 key heads, HV=8 value heads, K=V=64, one decay per value head) and KDA
    # (kda_300M: H=HV=8, K=32, V=64, one decay per key channel)
    for op, (H, HV, K, V), per_channel in (("gated_delta_rule", (4, 8, 64, 64), False), ("kda", (8, 8, 32, 64), True)):
        for case, B, c in layouts:
            def make(gen, B=B, c=c, H=H, HV=HV, K=K, V=V, decay=(HV, K) if per_channel else (HV,)):
                t = {"q": _randn(gen, B, sh.T, H, K, device=device), "k": _randn(gen, B, sh.T, H, K, device=device),
                     "v": _randn(gen, B, sh.T, HV, V, device=device), "a": _randn(gen, B, sh.T, *decay, device=device),
                     "b": _randn(gen, B, sh.T, HV, device=device), "A_log": _A_log(gen, HV, device),
                     "dt_bias": _dt_bias(gen, math.prod(decay), device)}
                return {k: v.to(bf16) for k, v in t.items()}, {"cu_seqlens": c}
            add(op, case, make,
                lambda kn, q, k, v, a, b, A_log, dt_bias, cu_seqlens, op=op: getattr(kn, op)(
                    q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu_seqlens)[0])

    # --- simple GLA as Mamba2's SSD, scale 1, g = A * dt (float32): zebra_mamba2_300M's H=32, K=d_state=64,
    # V=head_dim=64, and debug_mamba2's H=8, K=16, V=32 (head dims FLA's backward gets wrong unpadded, see
    # fla_backend)
    for op, (H, K, V) in (("simple_gla", (32, 64, 64)), ("simple_gla K=16 (debug_mamba2)", (8, 16, 32))):
        for case, B, c in layouts:
            def make(gen, B=B, c=c, H=H, K=K, V=V):
                dt = F.softplus(_randn(gen, B, sh.T, H, device=device, scale=0.5) + _dt_bias(gen, H, device))
                A = -_A_log(gen, H, device).exp()
                t = {"q": _randn(gen, B, sh.T, H, K, device=device).to(bf16),
                     "k": _randn(gen, B, sh.T, H, K, device=device).to(bf16),
                     "v": (_randn(gen, B, sh.T, H, V, device=device) * dt.unsqueeze(-1)).to(bf16),
                     "g": (A * dt).float()}
                return t, {"cu_seqlens": c}
            add(op, case, make,
                lambda kn, q, k, v, g, cu_seqlens: kn.simple_gla(q, k, v, g, scale=1.0, cu_seqlens=cu_seqlens)[0])

    # --- short convolution: GDN's value conv (512 channels, no bias) and Mamba2's (3072 channels, bias)
    for D, bias in ((512, False), (3072, True)):
        for case, B, c in layouts:
            def make(gen, B=B, c=c, D=D, bias=bias):
                t = {"x": _randn(gen, B, sh.T, D, device=device), "weight": _randn(gen, D, 4, device=device, scale=0.3)}
                if bias:
                    t["bias"] = _randn(gen, D, device=device, scale=0.1)
                return {k: v.to(bf16) for k, v in t.items()}, {"cu_seqlens": c}
            add(f"causal_conv1d D={D}{' +bias' if bias else ''}", case, make,
                lambda kn, x, weight, cu_seqlens, bias=None: kn.causal_conv1d(
                    x, weight, bias, "silu", cu_seqlens=cu_seqlens)[0])

    # whole sequences in our kernels (KernelConfig.triton_conv, the default on GPUs): GDN's q, k, v blocks (a
    # strided column block of the projection, as the mixer passes it), and Mamba2's one block with a bias
    for sizes, bias in (((256, 256, 512), False), ((3072,), True)):
        def make(gen, sizes=sizes, bias=bias):
            D = sum(sizes)
            t = {"x": _randn(gen, sh.B, sh.T, D + 16, device=device),
                 "weight": _randn(gen, D, 4, device=device, scale=0.3)}
            if bias:
                t["bias"] = _randn(gen, D, device=device, scale=0.1)
            return {k: v.to(bf16) for k, v in t.items()}, {}
        add(f"short_conv D={sum(sizes)}{' +bias' if bias else ''}", "dense B=2", make,
            lambda kn, x, weight, bias=None, sizes=sizes: torch.cat(kn.short_conv(
                x[..., :sum(sizes)], weight, bias, "silu", sizes)[0], dim=-1))

    # --- norms and SwiGLU (no sequence mixing: dense only)
    def make_gnorm(gen, HV=8, V=64):
        t = {"x": _randn(gen, sh.B, sh.T, HV, V, device=device), "gate": _randn(gen, sh.B, sh.T, HV, V, device=device),
             "weight": 1 + _randn(gen, V, device=device, scale=0.1)}
        return {k: v.to(bf16) for k, v in t.items()}, {}
    add("gated_rms_norm swish (GDN)", "dense B=2", make_gnorm,
        lambda kn, x, gate, weight: kn.gated_rms_norm(x, gate, weight, 1e-6, "swish"))
    add("gated_rms_norm sigmoid (KDA)", "dense B=2", make_gnorm,
        lambda kn, x, gate, weight: kn.gated_rms_norm(x, gate, weight, 1e-6, "sigmoid"))

    def make_gnorm_m2(gen, D=2048):
        t = {"x": _randn(gen, sh.B, sh.T, D, device=device), "gate": _randn(gen, sh.B, sh.T, D, device=device),
             "weight": 1 + _randn(gen, D, device=device, scale=0.1)}
        return {k: v.to(bf16) for k, v in t.items()}, {}
    add("gated_rms_norm grouped (Mamba2)", "dense B=2", make_gnorm_m2,
        lambda kn, x, gate, weight: kn.gated_rms_norm(x, gate, weight, 1e-6, "swish", norm_before_gate=False,
                                                      group_size=256))

    def make_rms(gen, D=1024):
        t = {"x": _randn(gen, sh.B, sh.T, D, device=device), "weight": 1 + _randn(gen, D, device=device, scale=0.1)}
        return {k: v.to(bf16) for k, v in t.items()}, {}

    def make_add_rms(gen, D=1024):
        t, _ = make_rms(gen, D)
        return {**t, "residual": _randn(gen, sh.B, sh.T, D, device=device).to(bf16)}, {}

    def rms(kn, x, weight):
        return kn.rms_norm(x, weight, 1e-6)

    def add_rms(kn, x, residual, weight):
        # both outputs side by side, so that the backward gets the sum's own gradient too (the fused add's path)
        return torch.cat(kn.add_rms_norm(x, residual, weight, 1e-6), dim=-1)

    add("rms_norm", "dense B=2", make_rms, rms)
    add("add_rms_norm (residual add + norm)", "dense B=2", make_add_rms, add_rms)
    # the same through torch.compile (compile.components = ["norm"], in the GPU recipes)
    add("rms_norm compiled", "dense B=2", make_rms, rms, config=COMPILED_NORMS)
    add("add_rms_norm compiled", "dense B=2", make_add_rms, add_rms, config=COMPILED_NORMS)

    def make_swiglu_linear(gen, D=4096, dim=1024):
        t = {"gate": _randn(gen, sh.B, sh.T, D, device=device), "up": _randn(gen, sh.B, sh.T, D, device=device),
             "weight": _randn(gen, dim, D, device=device, scale=D ** -0.5)}
        return {k: v.to(bf16) for k, v in t.items()}, {}

    def swiglu(kn, gate, up, weight):
        return kn.swiglu_linear(gate, up, weight)

    add("swiglu_linear (MLP)", "dense B=2", make_swiglu_linear, swiglu)
    add("swiglu_linear compiled", "dense B=2", make_swiglu_linear, swiglu, config=COMPILED_SWIGLU)

    # --- MLA attention: 16 heads, qk 64 (32 nope + 32 rope), v 64
    attn_layouts = layouts + [(f"packed rows=2 {len(sh.cu_rows) - 1} docs", 1, cu_rows)]
    for case, B, c in attn_layouts:
        rows = 2 if "rows=2" in case else 1

        def make(gen, B=B, c=c, rows=rows):
            t = {"q": _randn(gen, B, sh.T, 16, 64, device=device), "k": _randn(gen, B, sh.T, 16, 64, device=device),
                 "v": _randn(gen, B, sh.T, 16, 64, device=device)}
            return {k: v.to(bf16) for k, v in t.items()}, {"cu_seqlens": c, "rows": rows}
        add("attention (MLA)", case, make,
            lambda kn, q, k, v, cu_seqlens, rows: kn.attention(q, k, v, 64 ** -0.5, cu_seqlens=cu_seqlens, rows=rows))

    # --- chunked fused linear cross-entropy against F.cross_entropy in fp32
    def make_ce(gen, D=1024):
        N, V = sh.ce_tokens, sh.vocab
        targets = torch.randint(0, V, (N,), generator=gen)
        targets[torch.rand(N, generator=gen) < 0.05] = -100
        t = {"hidden": _randn(gen, N, D, device=device).to(bf16),
             "weight": _randn(gen, V, D, device=device, scale=0.05).to(bf16)}
        return t, {"targets": targets.to(device)}

    def ce(kn, hidden, weight, targets):
        return kn.linear_cross_entropy(hidden, weight, targets, chunk_size=sh.ce_chunk)[0]

    def ce_ref(hidden, weight, targets):
        return F.cross_entropy(hidden.float() @ weight.float().t(), targets, ignore_index=-100, reduction="sum")

    ce_case = f"{sh.ce_tokens} tok, V={sh.vocab}, 5% ignored"
    # the op as the models call it: on GPUs our Triton kernel does each chunk's softmax
    add("linear_cross_entropy", ce_case, make_ce, ce, ce_ref)
    add("linear_cross_entropy compiled", ce_case, make_ce, ce, ce_ref, config=COMPILED_LOSS)  # components ["loss"]
    add("linear_cross_entropy eager", ce_case, make_ce, ce, ce_ref, config=EAGER_LOSS)
    return cases


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    t = t.detach().clone() if dtype is None else t.detach().to(dtype).clone()
    return t.requires_grad_(t.is_floating_point())


def _backend(c: OpCase, x: torch.Tensor, kwargs: dict) -> str:
    """Which implementation ran the fast side, for the report."""
    backend = c.kernels.backend_for(x)
    if c.op.startswith("linear_cross_entropy"):  # chunked PyTorch, each chunk's softmax in our kernel on GPUs
        triton = c.kernels.config.triton_loss and not c.kernels.config.compiled_loss and backend == "fla"
        return "triton (chunked)" if triton else "torch (chunked)"
    if c.op.startswith("attention") and kwargs.get("cu_seqlens") is None and backend == "fla":
        return "sdpa"  # fla_backend.attention without documents
    return backend


def run_op_case(res: Results, c: OpCase, device, seed, tol) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors, kwargs = c.make(gen)
    fast = {k: _leaf(v) for k, v in tensors.items()}
    ref = {k: _leaf(v, torch.float32) for k, v in tensors.items()}
    t0 = time.perf_counter()
    out = c.call(c.kernels, **fast, **kwargs)
    out_ref = c.ref_call(**ref, **kwargs) if c.ref_call else c.call(Kernels(REFERENCE), **ref, **kwargs)
    grad_out = torch.randn(out_ref.shape, generator=gen).to(device)
    (out.float() * grad_out).sum().backward()
    (out_ref.float() * grad_out).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out_err = rel_err(out, out_ref)
    grad_errs = {}
    for name in fast:
        g, g_ref = fast[name].grad, ref[name].grad
        if g_ref is None:
            continue
        if g is None:
            raise RuntimeError(f"no gradient for {name} on the fast path")
        grad_errs[name] = rel_err(g, g_ref)
    worst = max(grad_errs, key=grad_errs.get) if grad_errs else None
    finite = torch.isfinite(out.float()).all().item() and all(math.isfinite(v) for v in grad_errs.values())
    ok = finite and out_err < tol and all(v < tol for v in grad_errs.values())
    res.add({"section": "ops", "name": c.op, "case": c.case, "backend": _backend(c, next(iter(fast.values())), kwargs),
             "status": "PASS" if ok else "FAIL", "out_err": out_err,
             "worst_grad": worst, "worst_grad_err": grad_errs.get(worst) if worst else None,
             "grad_errs": grad_errs, "seconds": time.perf_counter() - t0,
             "detail": f"out {out_err:.2e}" + (f", worst d{worst} {grad_errs[worst]:.2e}" if worst else ""),
             **({} if ok else {"error": "non-finite values" if not finite else
                                f"relative error over {tol:g}"})})


def check_ops(res: Results, args, device) -> None:
    print(f"\n== ops: {device} bf16 ({'FLA' if device.type == 'cuda' else 'reference'} kernels) vs float32 "
          "reference kernels", flush=True)
    sh = Shapes(args.tiny)
    words = [w.strip() for w in args.ops.split(",") if w.strip()] if args.ops else None
    for n, c in enumerate(op_cases(sh, device)):
        if words and not any(w in c.op for w in words):
            continue  # the seed stays the case's own: n counts every case
        try:
            run_op_case(res, c, device, args.seed + n, args.tol)
        except Exception as e:  # noqa: BLE001 - report and go on
            res.fail("ops", c.op, c.case, e)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ================================================================================================ end to end


def e2e_batch(vocab: int, tiny: bool, seed: int):
    B, T = 2, (128 if tiny else 512)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    # documents over the flattened B * T tokens, the row boundary included
    cu = [0, 30, T, T + 42, 2 * T] if tiny else [0, 100, T, T + 188, 2 * T]
    return ids, labels, torch.tensor(cu, dtype=torch.int32)


def _grads(model) -> dict:
    return {n: (p.grad.detach().float().cpu() if p.grad is not None else torch.zeros(p.shape))
            for n, p in model.named_parameters()}


def check_e2e(res: Results, args, device) -> None:
    print(f"\n== e2e: float32 on the CPU (reference kernels) vs bf16 on {device} (the trainer's kernels)", flush=True)
    for flavor in [f for f in args.e2e_flavors.split(",") if f]:
        try:
            margs = get_flavor(flavor)
            torch.manual_seed(args.seed)
            model = build_with_kernels(margs, "cpu", REFERENCE)
            model.train()
            ids, labels, cu = e2e_batch(margs.vocab_size, args.tiny, args.seed + 1)
        except Exception as e:  # noqa: BLE001
            res.fail("e2e", flavor, "build", e)
            continue
        for case, cu_seqlens in (("dense B=2", None), ("packed B=2 (cu_seqlens)", cu)):
            try:
                t0 = time.perf_counter()
                model.zero_grad(set_to_none=True)
                loss_ref = model(ids, labels=labels, cu_seqlens=cu_seqlens)
                loss_ref.backward()
                g_ref = _grads(model)
                model.zero_grad(set_to_none=True)

                fast = build_with_kernels(margs, device, GPU_KERNELS, model.state_dict(), torch.bfloat16).train()
                dev_cu = cu_seqlens.to(device) if cu_seqlens is not None else None
                loss = fast(ids.to(device), labels=labels.to(device), cu_seqlens=dev_cu)
                loss.backward()
                g = _grads(fast)
                # the same bf16 weights under the reference kernels: what bf16 rounding alone does
                rounded = build_with_kernels(margs, device, REFERENCE, fast.state_dict(), torch.bfloat16).train()
                del fast
                with torch.no_grad():
                    loss_bf16_ref = rounded(ids.to(device), labels=labels.to(device), cu_seqlens=dev_cu).item()
                del rounded
                gn_ref = math.sqrt(sum(v.pow(2).sum().item() for v in g_ref.values()))
                gn = math.sqrt(sum(v.pow(2).sum().item() for v in g.values()))
                gdiff = math.sqrt(sum((g[n] - g_ref[n]).pow(2).sum().item() for n in g_ref))
                loss_d = rel_diff(loss.item(), loss_ref.item())
                gn_d = rel_diff(gn, gn_ref)
                ok = math.isfinite(loss.item()) and loss_d < args.tol and gn_d < args.tol
                res.add({"section": "e2e", "name": flavor, "case": case, "status": "PASS" if ok else "FAIL",
                         "loss_ref_fp32": loss_ref.item(), "loss": loss.item(), "loss_rel": loss_d,
                         "loss_bf16_ref_kernels": loss_bf16_ref,
                         "loss_rel_vs_bf16_ref_kernels": rel_diff(loss.item(), loss_bf16_ref),
                         "grad_norm_ref": gn_ref, "grad_norm": gn, "grad_norm_rel": gn_d,
                         "grad_rel_err": gdiff / gn_ref if gn_ref else float("inf"),
                         "seconds": time.perf_counter() - t0,
                         **({} if ok else {"error": f"loss or gradient norm differ by more than {args.tol:g}"})})
            except Exception as e:  # noqa: BLE001
                res.fail("e2e", flavor, case, e)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()


# ================================================================================================ CUDA graphs

GRAPH_TOL = 1e-5
GRAPHS = dataclasses.replace(GPU_KERNELS, cuda_graphs=True)
# (kernels, site, **inputs) -> output: a site stands for the calling layer, whose graphs live as long as it does
GRAPHED_OPS = {
    "gated_delta_rule": lambda kn, site, q, k, v, a, b, A_log, dt_bias: kn.gated_delta_rule(
        q, k, v, a, b, A_log, dt_bias, site=site)[0],
    "kda": lambda kn, site, q, k, v, a, b, A_log, dt_bias: kn.kda(q, k, v, a, b, A_log, dt_bias, site=site)[0],
    "simple_gla": lambda kn, site, q, k, v, g: kn.simple_gla(q, k, v, g, scale=1.0, site=site)[0],
}


def _output_and_grads(fn, tensors: dict, grad_seed: int):
    leaves = {k: _leaf(v) for k, v in tensors.items()}
    out = fn(**leaves)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    (out.float() * grad_out.float()).sum().backward()
    return out.detach().clone(), {k: v.grad.clone() for k, v in leaves.items() if v.grad is not None}


def _graph_row(name: str, case: str, pairs: dict, t0: float) -> dict:
    errs = {k: rel_err(a, b) for k, (a, b) in pairs.items()}
    worst = max(errs, key=errs.get)
    ok = all(math.isfinite(e) and e < GRAPH_TOL for e in errs.values())
    return {"section": "graphs", "name": name, "case": case, "status": "PASS" if ok else "FAIL", "errs": errs,
            "worst": worst, "worst_err": errs[worst], "seconds": time.perf_counter() - t0,
            **({} if ok else {"error": f"{worst}: graphed differs from eager by {errs[worst]:.2e}"})}


def check_graphs(res: Results, args, device) -> None:
    print("\n== graphs: CUDA-graph replays against eager calls", flush=True)
    if device.type != "cuda":
        res.add({"section": "graphs", "name": "(all)", "case": "-", "status": "SKIP", "error": "needs a GPU"})
        return
    sh = Shapes(args.tiny)
    makes = {c.op: c.make for c in op_cases(sh, device) if c.op in GRAPHED_OPS and c.case.startswith("dense")}
    graphs, eager_kernels = Kernels(GRAPHS), Kernels(GPU_KERNELS)
    for n, (op, make) in enumerate(makes.items()):
        try:
            t0 = time.perf_counter()
            first, second = (make(torch.Generator().manual_seed(args.seed + n + i))[0] for i in (0, 1))
            site = torch.nn.Module()
            fn = GRAPHED_OPS[op]
            _output_and_grads(functools.partial(fn, graphs, site), first, 1)  # captures
            graphed = _output_and_grads(functools.partial(fn, graphs, site), second, 2)
            eager = _output_and_grads(functools.partial(fn, eager_kernels, None), second, 2)
            pairs = {"out": (graphed[0], eager[0]), **{f"d{k}": (graphed[1][k], eager[1][k]) for k in eager[1]}}
            res.add(_graph_row(op, "captured on one input, replayed on another", pairs, t0))
        except Exception as e:  # noqa: BLE001
            res.fail("graphs", op, "replay", e)
    for flavor in ("debug_gdn", "debug_kda", "debug_mamba2"):
        try:
            t0 = time.perf_counter()
            margs = get_flavor(flavor)
            torch.manual_seed(args.seed)
            eager = build_with_kernels(margs, device, GPU_KERNELS, dtype=torch.bfloat16).train()
            graphed = build_with_kernels(margs, device, GRAPHS, eager.state_dict(), torch.bfloat16).train()
            batches = [e2e_batch(margs.vocab_size, args.tiny, args.seed + i)[:2] for i in (1, 2)]
            batches = [(ids.to(device), labels.to(device)) for ids, labels in batches]

            def loss_and_grads(model, batches=batches):
                for ids, labels in batches:  # the last batch's; with graphs, captured on the first
                    model.zero_grad(set_to_none=True)
                    loss = model(ids, labels=labels)
                    loss.backward()
                return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}

            loss_g, grads_g = loss_and_grads(graphed)
            loss_e, grads_e = loss_and_grads(eager)
            pairs = {"loss": (loss_g, loss_e), **{n: (grads_g[n], grads_e[n]) for n in grads_e}}
            res.add(_graph_row(flavor, "model, two batches, eager vs graphed", pairs, t0))
            del eager, graphed
        except Exception as e:  # noqa: BLE001
            res.fail("graphs", flavor, "model", e)
        finally:
            torch.cuda.empty_cache()


# ================================================================================================ FLA HF classes


def fla_model_list(args) -> list[str]:
    if args.fla_models:
        return [m for m in args.fla_models.split(",") if m]
    return ["debug_gdn", "debug_kda"] + ([] if args.tiny else ["gdn_300M:4", "kda_300M:4"])


def model_args_for(spec: str):
    """'flavor' or 'flavor:N' (the flavor cut to N sublayers, a pure mixer/MLP stack)."""
    name, _, n = spec.partition(":")
    margs = get_flavor(name)
    if n:
        margs = margs.replace(n_layers=int(n), pattern="M-" * (int(n) // 2))
    return margs


def exporter_available(module: str) -> bool:
    if module == "none":
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # noqa: BLE001 - a parent package that is missing
        return False


def export_with_hybridtitan(model, folder: str, module: str, extra: str = ""):
    """save_model_checkpoint -> the exporter's command line in this process (common.run_exporter) ->
    AutoModelForCausalLM (its dtype, CPU)."""
    import fla  # noqa: F401 - registers FLA's model types with transformers
    from transformers import AutoModelForCausalLM

    from hybridtitan.checkpoint import save_model_checkpoint

    step_dir, out_dir = os.path.join(folder, "step-0"), os.path.join(folder, "hf")
    save_model_checkpoint(model, step_dir)
    run_exporter(module, ["--checkpoint", step_dir, "--output", out_dir, *shlex.split(extra)])
    try:
        return AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto")  # as written (bf16 by default)
    except TypeError:  # older transformers
        return AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype="auto")


def _unique_numel(module) -> int:
    seen, n = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def check_fla(res: Results, args, device) -> None:
    print(f"\n== fla: hybridtitan vs FLA's HF classes (same weights), logits in bf16 and float32 on {device}",
          flush=True)
    try:
        import fla  # noqa: F401
    except Exception as e:  # noqa: BLE001
        res.fail("fla", "import fla", "-", e)
        return
    use_exporter = exporter_available(args.exporter)
    print(f"  weights: {args.exporter + ' (checked against the script mapping) and ' if use_exporter else ''}the "
          f"script's name mapping{'' if use_exporter or args.exporter == 'none' else f' ({args.exporter} not found)'}",
          flush=True)
    for spec in fla_model_list(args):
        try:
            margs = model_args_for(spec)
            torch.manual_seed(args.seed)
            ours = build_with_kernels(margs, "cpu", REFERENCE).eval()
            with torch.device("cpu"):
                theirs = fla_model_class(margs)(fla_config(margs))
            load_into_fla(theirs, ours.state_dict(), margs)
            theirs.eval()
            n_ours, n_fla = _unique_numel(ours), _unique_numel(theirs)
            if n_ours != n_fla:
                raise RuntimeError(f"parameter counts differ: hybridtitan {n_ours:,} vs FLA {n_fla:,}")
            res.add({"section": "fla", "name": spec, "case": f"load ({type(theirs).__name__}, {n_fla:,} params)",
                     "status": "PASS"})
        except Exception as e:  # noqa: BLE001
            res.fail("fla", spec, "build/load", e)
            continue

        candidates = [("mapping", theirs)]
        if use_exporter:
            tmp = tempfile.mkdtemp(prefix="gpu-check-export-")
            try:
                exported = export_with_hybridtitan(ours, tmp, args.exporter, args.exporter_args)
                exported.eval()
                want = to_fla_state_dict(ours.state_dict(), margs)
                got = exported.state_dict()
                # the exporter writes bf16 by default (transformers may load some tensors back in float32):
                # each tensor must equal ours, or ours rounded to bf16
                bad = [k for k, v in want.items() if k not in got or got[k].shape != v.shape
                       or not (torch.equal(got[k], v.to(got[k].dtype))
                               or torch.equal(got[k], v.to(torch.bfloat16).to(got[k].dtype)))]
                if type(exported).__name__ != type(theirs).__name__:
                    bad.insert(0, f"class {type(exported).__name__} != {type(theirs).__name__}")
                ok = not bad
                res.add({"section": "fla", "name": spec, "case": "export_hf == script mapping",
                         "status": "PASS" if ok else "FAIL", "exported_class": type(exported).__name__,
                         **({} if ok else {"error": f"{len(bad)} tensors differ, e.g. {bad[:3]}"})})
                candidates.append(("export_hf", exported))
            except Exception as e:  # noqa: BLE001
                res.fail("fla", spec, "export_hf", e)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        ids, _, cu = e2e_batch(margs.vocab_size, args.tiny, args.seed + 2)
        packed = ids.reshape(1, -1)
        for case, inp, c in (("dense B=2", ids, None), ("packed B=1 (cu_seqlens)", packed, cu)):
            try:
                with torch.no_grad():
                    ref = ours(inp, cu_seqlens=c)  # float32 on the CPU, reference kernels: the yardstick for both
                if device.type != "cuda":
                    for label, _ in candidates:
                        res.add({"section": "fla", "name": spec, "case": f"{case} logits [{label}]", "status": "SKIP",
                                 "error": "FLA's HF models need a GPU"})
                    continue
                for dtype in (torch.bfloat16, torch.float32):
                    dname = str(dtype).removeprefix("torch.")
                    ours_gpu = build_with_kernels(margs, device, GPU_KERNELS, ours.state_dict(), dtype).eval()
                    dev_inp, dev_cu = inp.to(device), (c.to(device) if c is not None else None)
                    with torch.no_grad():
                        lo = ours_gpu(dev_inp, cu_seqlens=dev_cu).float()
                    del ours_gpu
                    # the exporter writes bf16 weights: in float32 only the mapping holds the same weights as ours
                    # (the exporter's tensors were checked against the mapping's above)
                    for label, hf in candidates if dtype == torch.bfloat16 else candidates[:1]:
                        hf_gpu = copy.deepcopy(hf).to(device, dtype)  # FLA's class: its kernels are its own
                        kw = {"cu_seqlens": dev_cu} if dev_cu is not None else {}
                        with torch.no_grad():
                            lf = hf_gpu(input_ids=dev_inp, **kw).logits.float()
                        del hf_gpu
                        err, ours_err, fla_err = rel_err(lf, lo), rel_err(lo, ref), rel_err(lf, ref)
                        # in bf16 two kernels that round in another order (KDA's chunks of 32 against FLA's 64)
                        # can differ by more than the bar while each is as far from float32: then ours must be
                        # no further from float32 than FLA's own class (float32 checks the weights themselves)
                        as_close = (dtype == torch.bfloat16 and ours_err <= BF16_AS_CLOSE * fla_err
                                    and err < BF16_AS_CLOSE_BOUND * args.tol)
                        ok = math.isfinite(err) and (err < args.tol or as_close)
                        res.add({"section": "fla", "name": spec, "case": f"{case} logits [{label}, {dname}]",
                                 "status": "PASS" if ok else "FAIL", "logits_err": err,
                                 "ours_vs_fp32": ours_err, "fla_vs_fp32": fla_err,
                                 "detail": f"FLA vs ours {err:.2e}, against float32 on the CPU: ours {ours_err:.2e}, "
                                           f"FLA {fla_err:.2e}",
                                 **({} if ok else {"error": f"logits differ by {err:.3e} > {args.tol:g}"})})
                        torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                res.fail("fla", spec, case, e)


# ================================================================================================ report


def _status(r: dict, limit: int = 100) -> str:
    err = r.get("error")
    if r["status"] == "PASS" or not err:
        return r["status"]
    text = f"{r['status']}: {err}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_report(res: Results) -> None:
    ops_rows = [r for r in res.rows if r["section"] == "ops"]
    if ops_rows:
        print("\n" + format_table(
            ["op", "case", "backend", "output err", "worst grad err (input)", "status"],
            [[r["name"], r["case"], r.get("backend"), fmt(r.get("out_err")),
              (f"{fmt(r['worst_grad_err'])} ({r['worst_grad']})" if r.get("worst_grad") else None),
              _status(r)] for r in ops_rows]))
    e2e_rows = [r for r in res.rows if r["section"] == "e2e"]
    if e2e_rows:
        print("\n" + format_table(
            ["flavor", "case", "loss fp32 CPU", "loss bf16 dev", "loss rel", "vs bf16+ref kernels",
             "grad norm rel", "grad rel err", "status"],
            [[r["name"], r["case"], fmt(r.get("loss_ref_fp32"), 5) if "loss" in r else None,
              fmt(r.get("loss"), 5) if "loss" in r else None, fmt(r.get("loss_rel")),
              fmt(r.get("loss_rel_vs_bf16_ref_kernels")), fmt(r.get("grad_norm_rel")), fmt(r.get("grad_rel_err")),
              _status(r)] for r in e2e_rows]))
    fla_rows = [r for r in res.rows if r["section"] == "fla"]
    if fla_rows:
        print("\n" + format_table(
            ["model", "case", "logits err (FLA vs ours)", "ours vs fp32 CPU", "FLA vs fp32 CPU", "status"],
            [[r["name"], r["case"], fmt(r.get("logits_err")), fmt(r.get("ours_vs_fp32")), fmt(r.get("fla_vs_fp32")),
              _status(r)] for r in fla_rows]))
    counts = {s: sum(r["status"] == s for r in res.rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but no GPU is visible", file=sys.stderr)
            return 2
        torch.cuda.set_device(device.index or 0) if device.type == "cuda" else None
    # a float32 reference means float32: no TF32 in the reference matmuls
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    use_kernel_configs(args.kernel_configs, device)  # before FLA is imported
    info = versions(device)
    print(f"gpu_check: device {device} ({info.get('gpu') or info.get('cpu')}), torch {info['torch']}, triton "
          f"{info['triton']}, fla {info['fla']}, transformers {info['transformers']}; tol {args.tol:g}"
          f"{' [tiny]' if args.tiny else ''}", flush=True)
    res = Results(args.verbose, args.json, {"versions": info, "argv": sys.argv, "tol": args.tol, "tiny": args.tiny})
    t0 = time.perf_counter()
    for section, fn in (("ops", check_ops), ("e2e", check_e2e), ("graphs", check_graphs), ("fla", check_fla)):
        if section in args.only:
            t1 = time.perf_counter()
            try:
                fn(res, args, device)
            except Exception as e:  # noqa: BLE001 - a whole section breaking is one failure, not the end
                res.fail(section, "(section)", "-", e)
            print(f"  ({section}: {time.perf_counter() - t1:.1f} s)", flush=True)
    print_report(res)
    print(f"total {time.perf_counter() - t0:.1f} s")
    record_kernel_configs(args.record_kernel_configs, device, "gpu_check")
    if args.json:
        res.write()
        print(f"wrote {args.json}")
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())

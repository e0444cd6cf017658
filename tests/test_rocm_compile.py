"""ROCm readiness at the compile level (docs/rocm.md): the recorded Triton kernels compile for MI300X (gfx942)
and MI355X (gfx950), with sm_90 as the control, on this CPU machine; and the recorder that writes the manifest
captures what Triton compiles.

The suite compiles a deterministic subset of the manifest (one record per kernel, spread over it: see
``SUITE_RECORDS``); ``python gpu_harness/rocm/rocm_compile_check.py`` compiles all of it.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "gpu_harness" / "rocm"
sys.path.insert(0, str(HARNESS))  # the recorder, as the harness's scripts import it
try:
    from triton_recorder import TARGETS, compile_args, load_manifest, record_triton_kernels, save_manifest
finally:
    sys.path.remove(str(HARNESS))

SCRIPT = HARNESS / "rocm_compile_check.py"
MANIFEST = REPO / "tests" / "assets" / "triton_kernels.json"
ALL_TARGETS = ("gfx942", "gfx950", "sm_90")
# A compile takes 0.3-6 s on one core for each of 3 targets: the whole manifest (hundreds of records, mostly recorded
# on the H200) takes minutes on 2 cores. The suite checks 6 records, one per kernel, spread evenly over the manifest;
# the script checks all of them by default.
SUITE_RECORDS = 6
# The check runs with --jobs 1: each worker process imports torch, Triton and FLA for its target (~4 s), which is
# most of its CPU time at the suite's few records; a second worker per target cost more than it saved beside the
# suite's other tests (41 vs 26 s of CPU for the 6 records x 3 targets, 2026-12-03: `python
# gpu_harness/rocm/rocm_compile_check.py --targets gfx942,gfx950,sm_90 --one-per-kernel --max-kernels 6 --jobs 2|1`).


def _check_module():
    spec = importlib.util.spec_from_file_location("rocm_compile_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_check(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


# ------------------------------------------------------------------------------------------ recorder, on CPU

@triton.jit
def _scale_kernel(x, y, n, alpha, BLOCK: tl.constexpr, ACT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask) * alpha
    if ACT == "relu":
        v = tl.maximum(v, 0.0)
    tl.store(y + offs, v, mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 128}, num_warps=2), triton.Config({"BLOCK": 256}, num_warps=4)],
                 key=["n"])
@triton.jit
def _tuned_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)


def _launch(n=1024):
    x = torch.randn(n)
    y = torch.empty_like(x)
    _scale_kernel[(n // 256,)](x, y, n, 0.5, BLOCK=256, ACT="relu")
    _tuned_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)


def test_dry_run_records_what_triton_would_compile(tmp_path):
    """Through the real JITFunction.run (binder, specialisation, autotuner) on CPU tensors, for gfx942."""
    with record_triton_kernels(dry_run="gfx942", keep_candidates=True) as rec:
        _launch()
    assert not rec.skipped
    by_name = {}
    for r in rec.kernels:
        by_name.setdefault(r["name"], []).append(r)
    scale, = by_name["_scale_kernel"]
    assert scale["module"] == __name__
    assert scale["signature"] == {"x": "*fp32", "y": "*fp32", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr",
                                  "ACT": "constexpr"}
    assert scale["constexprs"] == {"BLOCK": 256, "ACT": "relu"}
    # HIP's binder: 16-byte alignment, and buffer-op pointer ranges for tensors under 2 GiB
    assert scale["attrs"]["x"] == [["tt.divisibility", 16], ["tt.pointer_range", 32]]
    assert scale["attrs"]["n"] == [["tt.divisibility", 16]]
    assert scale["options"]["num_warps"] == 4 and scale["options"]["num_stages"] == 2  # HIP's default stages
    assert scale["recorded_target"] == {"backend": "hip", "arch": "gfx942", "warp_size": 64}
    assert scale["autotune"] is None
    tuned = sorted(by_name["_tuned_kernel"], key=lambda r: r["constexprs"]["BLOCK"])
    assert [r["autotune"]["role"] for r in tuned] == ["chosen", "candidate"]  # equal timings: the first config
    assert [(r["constexprs"]["BLOCK"], r["options"]["num_warps"]) for r in tuned] == [(128, 2), (256, 4)]

    with record_triton_kernels(dry_run="gfx942") as rec:
        _launch()
    assert sorted(r["name"] for r in rec.kernels) == ["_scale_kernel", "_tuned_kernel"]  # candidates dropped

    # the manifest round trip, then the compile the check script does
    path = tmp_path / "m.json"
    save_manifest(path, rec.kernels + rec.kernels)
    manifest = load_manifest(path)
    assert len(manifest["kernels"]) == 2 and manifest["triton"] == triton.__version__
    for record in manifest["kernels"]:
        for name in ("gfx942", "sm_90"):
            target = TARGETS[name]["target"]
            ca = compile_args(record, target)
            kernel = triton.compile(ca.source(), target=target, options=ca.options)
            assert {"hip": "hsaco", "cuda": "cubin"}[target.backend] in kernel.asm
            assert kernel.metadata.num_warps == record["options"]["num_warps"]
            has_range = any(a[0] == "tt.pointer_range" for a in ca.attrs.get((0,), []))
            assert has_range == (target.backend == "hip")


def test_post_compile_hook_records_and_chains():
    """The GPU mode: record_triton_kernels() installs knobs.runtime.jit_post_compile_hook, keeps a hook that was
    there, and restores it. The hook is called as JITFunction._do_compile calls it after a compile on an H200."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    seen = []

    def previous(**kwargs):
        seen.append(kwargs["fn"].name)

    original = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = previous
    try:
        with record_triton_kernels() as rec:
            hook = knobs.runtime.jit_post_compile_hook
            assert hook is not previous
            # JITFunction.run up to the compile, for an H200 (triton/runtime/jit.py)
            fn, target = _scale_kernel, GPUTarget("cuda", 90, 32)
            backend = make_backend(target)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            x = torch.randn(1024)
            kwargs = {"BLOCK": 128, "ACT": "none", "debug": False, "instrumentation_mode": "", "num_warps": 8}
            bound_args, specialization, options = binder(x, torch.empty_like(x), 1000, 2.0, **kwargs)
            key = compute_cache_key({}, specialization, options)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization,
                                                                  options)
            fn._call_hook(hook, key, signature, target, 0, constexprs, options, [attrs], False)
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = original
    assert seen == ["_scale_kernel"]
    record, = rec.kernels
    assert record["constexprs"] == {"BLOCK": 128, "ACT": "none"}
    assert "n" not in record["attrs"]  # 1000 is not a multiple of 16
    assert record["attrs"]["x"] == [["tt.divisibility", 16]]
    assert record["options"]["num_warps"] == 8 and record["options"]["num_stages"] == 3  # CUDA's default
    assert record["recorded_target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}


# ------------------------------------------------------------------------------------------ the check script

def test_manifest_is_complete():
    manifest = load_manifest(MANIFEST)
    assert manifest["kernels"], "empty manifest"
    for key in ("triton", "fla", "torch", "device"):
        assert manifest[key], key
    for r in manifest["kernels"]:
        assert set(r) >= {"kernel", "module", "name", "signature", "constexprs", "attrs", "options", "id"}, r["id"]
        assert set(r["constexprs"]) <= {k for k, v in r["signature"].items() if v == "constexpr"}, r["kernel"]


def test_manifest_is_recorded_on_a_gpu_and_covers_every_op():
    """The shipped manifest comes from training steps on a GPU, and holds kernels of every FLA op the models
    call (each mixer dense and with packed documents, the convolution, the norms, SwiGLU + linear, attention)
    and our own kernels (the cross-entropy chunks, the short convolution of whole sequences)."""
    manifest = load_manifest(MANIFEST)
    assert not manifest.get("provisional")
    assert "H200" in manifest["device"]
    gpu = [r for r in manifest["kernels"] if r.get("origin") == manifest["device"]]
    assert len(gpu) > len(manifest["kernels"]) // 2
    modules = {part for r in manifest["kernels"] for part in r["module"].split(".")}
    assert modules >= {"gated_delta_rule", "kda", "attn", "common", "activations", "causal_conv1d",
                       "fused_norm_gate", "layernorm", "layernorm_gated", "l2norm"}, modules
    varlen = {r["constexprs"].get("IS_VARLEN") for r in gpu if "IS_VARLEN" in r["constexprs"]}
    assert varlen == {True, False}  # dense and packed steps were both recorded
    # SwiGLU fused with the down projection: its backward recomputes the product for the weight gradient
    assert any(r["name"] == "swiglu_fwdbwd_kernel" and r["constexprs"].get("HAS_WEIGHT") for r in gpu)
    # our own kernels: the cross-entropy chunks' softmax and gradient, the short convolution's three
    ours = {r["kernel"].split(":")[1] for r in gpu if r["kernel"].startswith("hybridtitan.ops.")}
    assert ours >= {"_softmax_cross_entropy_rows", "_short_conv_fwd", "_short_conv_bwd_pre", "_short_conv_bwd_x"}
    # the short convolution with and without a bias (Mamba2 / the delta rules), and with the rows of a column
    # block only 8-aligned (KDA's projection is 1160 wide)
    conv = [r["constexprs"] for r in gpu if r["name"] == "_short_conv_bwd_pre"]
    assert {c["HAS_BIAS"] for c in conv} == {True, False} and {c["ALIGN"] for c in conv} >= {8, 16}


def test_manifest_compiles_for_amd(tmp_path):
    check = _check_module()
    manifest = load_manifest(MANIFEST)
    chosen = check.select(manifest["kernels"], None, True, SUITE_RECORDS)
    out = tmp_path / "results.json"
    proc = _run_check("--targets", ",".join(ALL_TARGETS), "--one-per-kernel", "--max-kernels", SUITE_RECORDS,
                      "--jobs", 1, "--json", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert len(results) == len(chosen) * len(ALL_TARGETS)
    table = proc.stdout.splitlines()
    for r in chosen:
        for target in ALL_TARGETS:
            res, = [x for x in results if x["id"] == r["id"] and x["target"] == target]
            assert res["status"] == "ok", res
            assert any(line.split()[:5] == [r["name"], r["id"], target, "recorded", "ok"] for line in table), \
                (r["name"], target)
    assert "all ok" in proc.stdout


def test_broken_entry_fails(tmp_path):
    """A record whose signature is wrong (a pointer declared i32), and one whose kernel does not exist, are
    reported as errors and make the script exit 1; the good record stays ok."""
    manifest = load_manifest(MANIFEST)
    good = min(manifest["kernels"], key=lambda r: len(json.dumps(r)))  # a small kernel: a fast compile
    broken = json.loads(json.dumps(good))
    pointer = next(k for k, v in broken["signature"].items() if isinstance(v, str) and v.startswith("*"))
    broken["signature"][pointer] = "i32"
    broken["id"] = "broken000000"
    missing = dict(json.loads(json.dumps(good)), module="hybridtitan.no_such_module", id="missing00000")
    missing["kernel"] = "hybridtitan.no_such_module:" + good["name"]
    path = tmp_path / "manifest.json"
    save_manifest(path, [good, broken, missing], device="test")
    out = tmp_path / "results.json"
    proc = _run_check("--manifest", path, "--targets", "gfx942", "--jobs", 1, "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = {r["id"]: r for r in json.loads(out.read_text())["results"]}
    assert results[good["id"]]["status"] == "ok"
    assert results["broken000000"]["status"] == "error" and results["broken000000"]["failed"]
    assert results["missing00000"]["status"] == "error" and "ModuleNotFoundError" in results["missing00000"]["reason"]
    table = {line.split()[1]: line for line in proc.stdout.splitlines() if len(line.split()) > 4}
    assert "error FAIL" in table["broken000000"] and "error FAIL" in table["missing00000"]
    assert "FAILED: " in proc.stdout


def test_amd_autotune_configs_replace_an_h200_pick_that_does_not_fit(tmp_path):
    """An H200 autotune pick from FLA's NVIDIA list (causal_conv1d: 32 warps) cannot launch on gfx942 (32 x 64
    lanes > 1024 threads): it is out of resources there, not a failure, and the configs FLA builds when it detects
    an AMD GPU ([2, 4, 8, 16] warps) are compiled in its place."""
    manifest = load_manifest(MANIFEST)
    conv = [r for r in manifest["kernels"] if r["name"] == "causal_conv1d_fwd_kernel"]
    if not conv:
        pytest.skip("no causal_conv1d_fwd_kernel in the manifest")
    record = dict(json.loads(json.dumps(conv[0])), id="conv32warps0")
    record["options"]["num_warps"] = 32
    path, out = tmp_path / "manifest.json", tmp_path / "results.json"
    save_manifest(path, [record], device="test")
    proc = _run_check("--manifest", path, "--targets", "gfx942", "--jobs", 1, "--json", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    recorded, = [r for r in results if not r["variant"]]
    assert recorded["status"] == "oor" and not recorded["failed"] and "2048 threads" in recorded["reason"]
    variants = [r for r in results if r["variant"]]
    assert {r["num_warps"] for r in variants} == {2, 4, 8, 16}
    assert len(variants) >= 12 and all(r["status"] == "ok" for r in variants)


def test_amd_configs_flag_adds_hip_defaults(tmp_path):
    """--amd-configs also compiles a kernel launched without num_stages with HIP's default (2; CUDA's is 3)."""
    manifest = load_manifest(MANIFEST)
    fixed = [r for r in manifest["kernels"] if not r.get("autotune") and r["options"].get("num_stages") == 3]
    if not fixed:
        pytest.skip("no kernel without autotuning at num_stages=3 in the manifest")
    record = min(fixed, key=lambda r: len(json.dumps(r)))
    out = tmp_path / "results.json"
    proc = _run_check("--kernels", re.escape(record["kernel"]) + "$", "--amd-configs", "--targets", "gfx950",
                      "--jobs", 1, "--json", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = [r for r in json.loads(out.read_text())["results"] if r["id"] == record["id"]]
    assert {(r["config"], r["num_stages"]) for r in results} >= {("recorded", 3), ("hip-default num_stages=2", 2)}

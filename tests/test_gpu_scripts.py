"""The GPU scripts' CPU dry runs: the same code paths as on the H200 (model building, FSDP wrapping, the parity
comparisons, the benchmark's variants and tables), with debug flavors and small shapes, so that the scripts do
not rot between GPU sessions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run(["scripts/gpu_check.py", "--device", "cpu", "--tiny", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    by_status = {r["status"] for r in results}
    assert "FAIL" not in by_status
    ops = {r["name"] for r in results if r["section"] == "ops" and r["status"] == "PASS"}
    # every op the models call has a parity case, the fused MLP and the compiled loss included
    for op in ("gated_delta_rule", "kda", "simple_gla", "swiglu_linear (MLP)", "linear_cross_entropy compiled",
               "linear_cross_entropy eager",
               "attention (MLA)", "rms_norm", "add_rms_norm (residual add + norm)", "rms_norm compiled",
               "add_rms_norm compiled", "swiglu_linear compiled", "short_conv D=1024"):
        assert op in ops, op
    e2e = [r for r in results if r["section"] == "e2e"]
    assert {r["name"] for r in e2e} >= {"debug_gdn", "debug_kda", "debug_mamba2", "debug_hybrid"}
    assert all(r["status"] == "PASS" for r in e2e)


def test_bench_dry_run_variants(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["scripts/bench_throughput.py", "--device", "cpu", "--tiny", "--models", "gdn_300M",
                 "--impls", "hybridtitan,hybridtitan-r3,hybridtitan-fla-norm,hybridtitan-compiled-loss",
                 "--extra", "gdn_300M:hybridtitan-eager", "--loss-chunk", "100",
                 "--json", str(out),
                 "--markdown", str(tmp_path / "bench.md")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == {"hybridtitan", "hybridtitan-r3", "hybridtitan-fla-norm", "hybridtitan-compiled-loss",
                         "hybridtitan-eager"}
    assert all(r["status"] == "OK" and r["tokens_per_s"] > 0 for r in rows.values())
    assert all(r["loss_chunk"] == 100 for r in rows.values())  # the output layer in chunks of 100 tokens
    # every case starts from the same weights: compiled norms, the previous version (separate residual adds) and
    # the eager model give the same loss
    first = rows["hybridtitan"]["loss_first"]
    for impl in ("hybridtitan-r3", "hybridtitan-fla-norm", "hybridtitan-compiled-loss", "hybridtitan-eager"):
        assert abs(rows[impl]["loss_first"] - first) < 1e-5 * first, rows[impl]
    ce = {r["impl"]: r for r in result["cross_entropy"]}
    # the candidates, our kernel and the eager op give the loss and gradients of the compiled chunks (the first row)
    assert next(iter(ce)) == 'hybridtitan, chunks compiled (compile.components = ["loss"])'
    others = [impl for impl in ce if impl.startswith(("candidate:", "hybridtitan ops", "hybridtitan, our Triton"))]
    assert len(others) == 7, list(ce)
    for impl in others:
        row = ce[impl]
        if "Triton" in impl:  # a GPU's (tests/test_cross_entropy_triton.py runs it in Triton's interpreter)
            assert row["status"] == "SKIP", row
            continue
        assert row["status"] == "OK", row
        assert row["loss_rel_vs_first"] < 1e-5, row
        assert row["grad_hidden_err_vs_first"] < 1e-4 and row["grad_weight_err_vs_first"] < 1e-4, row
    assert re.search(r"\| gdn_300M \(debug_gdn\) +\| hybridtitan-eager +\|", (tmp_path / "bench.md").read_text())


def test_bench_refuses_unknown_variant():
    proc = _run(["scripts/bench_throughput.py", "--device", "cpu", "--tiny", "--extra", "gdn_300M:hybridtitan-fast"])
    assert proc.returncode == 2
    assert "unknown" in proc.stderr and "hybridtitan-fast" in proc.stderr
    proc = _run(["scripts/bench_throughput.py", "--device", "cpu", "--tiny", "--loss-chunk", "0"])
    assert proc.returncode == 2 and "--loss-chunk must be at least 1, got 0" in proc.stderr


def test_mamba2_packed_probe_dry_run():
    """The probe's cases run (on the reference kernels here) and pass: finite gradients close to float32 (a case
    whose gradients are not exits 1 and is reported FAIL). Unknown case names are refused."""
    cases = "simple_gla packed K=16 V=32;Mamba2 layer packed;model packed, anomaly detection"
    env = {**ENV, "PROBE_DEVICE": "cpu", "PROBE_CASES": cases}
    proc = subprocess.run([sys.executable, "scripts/probe_mamba2_packed.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("\nOK") + proc.stdout.startswith("OK") == 3, proc.stdout
    assert "grads finite [True, True, True, True]" in proc.stdout
    assert "backward ran without NaN" in proc.stdout
    bad = subprocess.run([sys.executable, "scripts/probe_mamba2_packed.py"], cwd=REPO, capture_output=True,
                         text=True, env={**env, "PROBE_CASES": "no such case"}, timeout=120)
    assert bad.returncode == 2 and "unknown cases" in bad.stderr
    strict = subprocess.run([sys.executable, "scripts/probe_mamba2_packed.py"], cwd=REPO, capture_output=True,
                            text=True, env={**env, "PROBE_CASES": "simple_gla packed K=16 V=32", "PROBE_TOL": "1e-9"},
                            timeout=120)
    assert strict.returncode == 1 and strict.stdout.startswith("FAIL"), strict.stdout  # bf16 is not that close
    for argv, code, stream, text in ((["--help"], 0, "stdout", "PROBE_CASES"),
                                     (["no such case"], 2, "stderr", "unknown case")):
        proc = subprocess.run([sys.executable, "scripts/probe_mamba2_packed.py", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == code and text in getattr(proc, stream), proc.stdout + proc.stderr


def test_manifest_recorder_merges_into_the_existing_manifest(tmp_path):
    """A run that records some flavors adds them to --out instead of overwriting it: earlier records, the list
    of recordings and other fields stay; a record seen again replaces its old copy."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from record_triton_manifest import merge
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from hybridtitan.tools.triton_recorder import load_manifest, save_manifest

    def record(i, **extra):
        return {"id": f"id{i}", "kernel": f"mod:k{i}", **extra}

    out, work = tmp_path / "manifest.json", tmp_path / "work"
    work.mkdir()
    save_manifest(out, [record(1, origin="H200"), record(2, origin="cpu dry run")], device="H200",
                  recorded=["a, document_boundaries false"], supplemented="two old records")
    save_manifest(work / "b_true.json", [record(2), record(3)], device="H200", recorded="b, document_boundaries true")
    manifest, failed, skipped = merge(str(out), str(work), {("b", "true"): 0}, load_manifest(out))
    assert (failed, skipped) == ([], [])
    assert load_manifest(out) == manifest
    assert {r["id"]: r["origin"] for r in manifest["kernels"]} == {"id1": "H200", "id2": "H200", "id3": "H200"}
    assert manifest["recorded"] == ["a, document_boundaries false", "b, document_boundaries true"]
    assert manifest["supplemented"] == "two old records"


def test_gate_grad_probe_dry_run():
    """The probe runs its seeds (reference kernels here) and prints a row per seed and parameter precision."""
    proc = _run(["scripts/probe_gate_grads.py", "--device", "cpu", "--tiny", "--seeds", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 4 and all(len(r.split("|")) == 17 for r in rows), proc.stdout
    # the sums over tokens cancel (the summed magnitudes of their terms exceed the sums' size), and the error
    # measured against those magnitudes is the smaller one
    for row in rows:
        cells = [float(c) for c in row.split("|")[3:-1]]
        err_a_log, err_dt, kappa_a_log, kappa_dt, scaled_a_log, scaled_dt = cells[6], cells[7], *cells[9:13]
        assert kappa_a_log > 1 and kappa_dt > 1, row
        assert scaled_a_log < err_a_log and scaled_dt < err_dt, row


def test_launch_cost_probe_dry_run():
    """The probe times both mixers' calls and profiles them (reference kernels on a CPU here)."""
    proc = _run(["scripts/probe_launch_cost.py", "--device", "cpu", "--calls", "4", "--top", "5"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for op in ("gated_delta_rule", "kda"):
        line = next(l for l in proc.stdout.splitlines() if l.startswith(f"{op}: "))
        assert float(line.split()[1]) > 0 and "ms of host time per forward + backward call" in line
    assert proc.stdout.count("Ordered by: internal time") == 2


def test_gpu_timeline_from_a_trace(tmp_path):
    """The profile's GPU timeline: busy time is the union of overlapping kernels, gaps are idle, and a gap whose
    next kernel was launched just before it began counts as waiting for the CPU."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_throughput import gpu_timeline
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    events = [kernel("a", 0, 10, 1), kernel("b", 5, 15, 2), kernel("c", 30, 10, 3), kernel("d", 100, 10, 4),
              launch(-5, 2, 1), launch(-3, 2, 2), launch(25, 4, 3), launch(40, 10, 4),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    t = gpu_timeline(str(trace), wall_ms=0.3, steps=1)
    assert abs(t["busy_ms_per_step"] - 0.040) < 1e-9  # [0, 20] + [30, 40] + [100, 110]
    assert abs(t["idle_ms_per_step"] - 0.070) < 1e-9  # gaps of 10 and 60
    assert abs(t["launch_wait_ms_per_step"] - 0.010) < 1e-9  # c launched 1 us before it began; d 50 us before
    assert "b -> c" in t["summary"] and "c -> d" in t["summary"]
    # every kernel's total, largest first: the union above does not apply there (a and b overlap)
    rows = t["kernels"].splitlines()[1:]
    assert [r.split("|")[-1].strip() for r in rows] == ["b", "a", "c", "d"]
    assert float(rows[0].split("|")[0]) == 0.015


def test_gemm_probe_lists_every_product():
    """scripts/probe_gemm_shapes.py's list of a step's matrix products: the forward products cover every
    projection weight once per token (the output layer over its chunks, the fused input projections as one),
    and the input- and weight-gradient products as many FLOPs again."""
    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import probe_gemm_shapes
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from hybridtitan.models import HybridLM, get_flavor

    tokens = 3 * 4096 + 100  # a last, shorter loss chunk
    for flavor in ("gdn_300M", "kda_300M"):
        shapes = probe_gemm_shapes.step_gemms(flavor, tokens, 4096)
        with torch.device("meta"):
            model = HybridLM(get_flavor(flavor))
        weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        weights += model.output_weight.numel() if model.lm_head is None else 0
        flops = {layout: sum(2 * m * n * k * c for (m, n, k, lay, _), c in shapes.items() if lay == layout)
                 for layout in ("nt", "nn", "tn")}
        assert flops["nt"] == flops["nn"] == flops["tn"] == 2 * tokens * weights, (flavor, flops, weights)
        # the output layer's weight gradient accumulates in float32, once per chunk
        assert sum(c for (*_, acc), c in shapes.items() if acc) == 4


def test_short_conv_bench_dry_run():
    """The convolution benchmark runs its three cases, both rows (the PyTorch reference on a CPU)."""
    proc = _run(["scripts/bench_short_conv.py", "--device", "cpu", "--batch", "1", "--seq", "16", "--reps", "1"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [l for l in proc.stdout.splitlines() if " us per forward + backward" in l]
    assert [r.split(":")[0] for r in rows] == ["gdn_300M", "kda_300M", "zebra_mamba2_300M xBC"], proc.stdout


def test_step_host_probe_dry_run():
    """The probe times torch's clipping and AdamW against the trainer's on FSDP's DTensors, and checks that both
    give the same norm and update (narrow gdn_300M on a CPU here)."""
    proc = _run(["scripts/probe_step_host.py", "--device", "cpu", "--tiny", "--calls", "3"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "gdn_300M (tiny) on cpu: 218 parameters" in proc.stdout
    assert len(re.findall(r"ms host, [0-9.]+ ms wall per call", proc.stdout)) == 4
    assert "same norm and same first update both ways" in proc.stdout

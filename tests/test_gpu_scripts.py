"""The GPU harness's CPU dry runs (gpu_harness/): the same code paths as on a GPU (model building under each kernel
configuration, FSDP wrapping, the parity comparisons, the benchmark's variants and tables, the trainer's speed
read from its metrics), with debug flavors and small shapes, so that the scripts keep working between GPU runs."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env, run_processes

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "gpu_harness"


# a guard against a hang only: the dry runs take 20-90 s on 2 loaded cores
def _run(args: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    """``python SCRIPT ...`` in the repository's folder (forked from the tests' preloaded server: helpers.start)."""
    return run_processes(args, [env()], timeout=timeout)


def _import(name: str, kind: str):
    """A harness module of gpu_harness/KIND/, imported as its scripts import each other (their folder and
    gpu_harness/, common.py's, on sys.path)."""
    paths = [str(HARNESS / kind), str(HARNESS)]
    sys.path[:0] = paths
    try:
        return __import__(name)
    finally:
        for path in paths:
            sys.path.remove(path)


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run(["gpu_harness/checks/gpu_check.py", "--device", "cpu", "--tiny", "--json", str(out)])
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


def test_source_corpus_is_the_installed_sources_in_hash_order(tmp_path):
    """float8_check.sh's corpus: JSON lines of this interpreter's site-packages sources, every document once, in
    the order of their hashes, validation apart, within the size asked for; a second run writes the same files."""
    import hashlib

    for out in (tmp_path / "a", tmp_path / "b"):
        proc = _run(["gpu_harness/source_corpus.py", str(out), "--megabytes", "2"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [json.loads(line)["text"] for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    validation = [json.loads(line)["text"] for line in (tmp_path / "a" / "validation.jsonl").read_text().splitlines()]
    digests = [hashlib.sha256(t.encode()).hexdigest() for t in train]
    assert len(train) > 10 and digests == sorted(set(digests))
    assert not set(train) & set(validation)
    assert 1e6 < sum(len(t.encode()) for t in train + validation) <= 2e6
    assert all(int(hashlib.sha256(t.encode()).hexdigest(), 16) % 100 == 0 for t in validation)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_float8_loss_table_places_float8_against_the_bf16_seeds(tmp_path):
    """float8_losses.py: the mean of each run's last 50 losses; a float8 run inside the bf16 seeds' range, or its
    distance from the nearer end; a run short of its steps is incomplete; a line cut short is passed over."""
    report = _import("float8_losses", "checks").report

    def write(run, final):
        with open(tmp_path / f"float8_loss_{run}.jsonl", "w") as f:
            for step in range(1, 301 if run != "rowwise:1" else 120):
                f.write(json.dumps({"step": step, "loss": 10.0 if step <= 250 else final}) + "\n")
            f.write('{"step": 301, "lo')  # a line cut short by the run's time box

    for run, final in (("bf16:1", 2.0), ("bf16:2", 2.2), ("tensorwise:1", 2.31), ("rowwise:1", 2.1)):
        write(run, final)
    lines = report(str(tmp_path), 300, ["bf16:1", "bf16:2", "tensorwise:1", "rowwise:1"])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert "range 2.0000-2.2000" in rows["bf16:1"]
    assert "| 2.3100 | +5.00% outside the range |" in rows["tensorwise:1"]
    assert "incomplete" in rows["rowwise:1"]


def test_gpu_check_runs_the_op_cases_asked_for(tmp_path):
    """--ops picks op cases by a word of their name (a GPU call spent on the changed ops only)."""
    out = tmp_path / "gpu_check.json"
    proc = _run(["gpu_harness/checks/gpu_check.py", "--device", "cpu", "--tiny", "--only", "ops", "--ops",
                 "rms_norm compiled", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted((r["name"], r["status"]) for r in results) == [
        ("add_rms_norm compiled", "PASS"), ("rms_norm compiled", "PASS")]


def test_export_check_dry_run(tmp_path):
    """The exports' GPU check on a CPU (both sides the PyTorch forms): an export made, loaded through transformers,
    its logits, greedy decoding of a left-padded batch and bfloat16 checked."""
    out = tmp_path / "export_check.json"
    proc = _run(["gpu_harness/checks/export_check.py", "--device", "cpu", "--flavors", "debug_hybrid", "--json",
                 str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["case"], r["ok"]) for r in results] == [("logits", True), ("greedy", True), ("bf16", True)]


def test_cp_check_dry_run(tmp_path):
    """Context parallelism's GPU check on a CPU: two gloo ranks, every op and case within the bar, the report
    naming each op's output and gradients."""
    out = tmp_path / "cp_check.json"
    proc = _run(["gpu_harness/checks/cp_check.py", "--device", "cpu", "--seq-len", "64", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = result["cases"]
    assert result["not_run"] == 0 and len(cases) == 6 * 2 * 2 and all(c["ok"] for c in cases.values()), cases
    assert set(cases["gated_delta_rule zigzag packed"]["worst"]) == {
        "output", "dq", "dk", "dv", "da", "db", "dA_log (summed)", "ddt_bias (summed)"}
    assert all(0 <= e <= 2e-2 for c in cases.values() for e in c["worst"].values()), cases


def test_cp_train_check_dry_run(tmp_path):
    """The trainer's CP check on a CPU: the one-process, CP and resumed runs made and compared, every measure
    within the bar and written."""
    out = tmp_path / "cp_train.json"
    proc = _run(["gpu_harness/checks/cp_train_check.py", "--flavor", "debug_hybrid", "--seq-len", "128", "--steps",
                 "4", "--folder", str(tmp_path / "runs"), "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(result["losses"]) == ["1", "2", "3", "4"]
    assert [result["losses"][s]["resumed"] is None for s in "1234"] == [True, True, False, False]
    for key in ("loss_error", "weight_change_error", "resumed_loss_error", "resumed_weight_change_error"):
        assert 0 <= result[key] <= result["bar"], (key, result[key])


def test_cp_attention_dry_run(tmp_path):
    """The CP attention benchmark on a CPU (both kernels the reference there): a row per shape, degree and kernel,
    the fused one compared."""
    out = tmp_path / "cp_attention.json"
    proc = _run(["gpu_harness/benchmarks/cp_attention.py", "--device", "cpu", "--seq-len", "256", "--repeats", "1",
                 "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["degree"], r["kernel"]) for r in rows] == [
        (shape, w, kernel) for shape in ("gqa", "mla") for w in (4, 2) for kernel in ("fused", "reference")]
    assert all(e == 0 for r in rows if r["kernel"] == "fused" for e in r["vs_reference"].values())


def test_bench_dry_run_variants(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["gpu_harness/benchmarks/bench_throughput.py", "--device", "cpu", "--tiny", "--models", "gdn_300M",
                 "--impls", "hybridtitan,hybridtitan-unfused-residual,hybridtitan-fla-norm,hybridtitan-compiled-loss",
                 "--extra", "gdn_300M:hybridtitan-eager", "--loss-chunk", "100",
                 "--json", str(out),
                 "--markdown", str(tmp_path / "bench.md")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == {"hybridtitan", "hybridtitan-unfused-residual", "hybridtitan-fla-norm",
                         "hybridtitan-compiled-loss", "hybridtitan-eager"}
    assert all(r["status"] == "OK" and r["tokens_per_s"] > 0 for r in rows.values())
    assert all(r["loss_chunk"] == 100 for r in rows.values())  # the output layer in chunks of 100 tokens
    # every case starts from the same weights: compiled norms, separate residual adds and the eager model give the
    # same loss
    first = rows["hybridtitan"]["loss_first"]
    for impl in ("hybridtitan-unfused-residual", "hybridtitan-fla-norm", "hybridtitan-compiled-loss",
                 "hybridtitan-eager"):
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
    proc = _run(["gpu_harness/benchmarks/bench_throughput.py", "--device", "cpu", "--tiny", "--extra",
                 "gdn_300M:hybridtitan-fast"])
    assert proc.returncode == 2
    assert "unknown" in proc.stderr and "hybridtitan-fast" in proc.stderr
    proc = _run(["gpu_harness/benchmarks/bench_throughput.py", "--device", "cpu", "--tiny", "--loss-chunk", "0"])
    assert proc.returncode == 2 and "--loss-chunk must be at least 1, got 0" in proc.stderr


def test_manifest_recorder_merges_into_the_existing_manifest(tmp_path):
    """A run that records some flavors adds them to --out instead of overwriting it: earlier records, the list
    of recordings and other fields stay; a record seen again replaces its old copy."""
    merge = _import("record_triton_manifest", "rocm").merge
    recorder = _import("triton_recorder", "rocm")
    load_manifest, save_manifest = recorder.load_manifest, recorder.save_manifest

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


def test_gpu_timeline_from_a_trace(tmp_path):
    """The profile's GPU timeline: busy time is the union of overlapping kernels, gaps are idle, and a gap whose
    next kernel was launched just before it began counts as waiting for the CPU."""
    gpu_timeline = _import("bench_throughput", "benchmarks").gpu_timeline

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


def test_trainer_speed_cases():
    """A case is FLAVOR[:key=value,...], and a comma starts a new pair only where a key= follows it."""
    parse_case = _import("trainer_speed", "benchmarks").parse_case
    case = parse_case("gdn_300M:compile.components=norm,swiglu,training.seq_len=8192")
    assert case.flavor == "gdn_300M"
    assert case.overrides == {"compile.components": "norm,swiglu", "training.seq_len": "8192"}
    with pytest.raises(ValueError, match="not key=value"):
        _import("trainer_speed", "benchmarks").parse_case("gdn_300M:training.seq_len")


def test_trainer_speed_runs_the_recipes_flavor():
    """A case names a recipe: one named for its length (gdn_1B_8k.toml, flavor gdn_1B) runs the flavor it names,
    or its debug stand-in on a CPU; a case's model.flavor and --recipe's case name come first."""
    speed = _import("trainer_speed", "benchmarks")

    def flavor(spec, device="cuda", recipe=None):
        args = argparse.Namespace(device=device, recipe=recipe, log_freq=None, steps=3)
        case = speed.parse_case(spec)
        path = speed.recipe_for(args, case, str(REPO))
        return speed.trainer_settings(args, case, 1, "/tmp/dump", path)["model.flavor"]

    assert flavor("gdn_1B_8k") == "gdn_1B"
    assert flavor("gdn_1B_8k", device="cpu") == "debug_gdn"
    assert flavor("gdn_1B_8k:model.flavor=gdn_300M") == "gdn_300M"
    assert flavor("kda_300M", recipe=str(REPO / "train_configs" / "gdn_300M.toml")) == "kda_300M"


def test_trainer_speed_dry_run(tmp_path):
    """The trainer itself on a CPU, from this checkout and (--tree) from the same checkout again: a row per run with
    the speed it logged over the steps after the warm-up, describe's FLOPs per token and memory estimate, and the
    two trees side by side; with --fit a run that runs out of memory (simulated above a batch of 1) is retried at
    half the local batch, on each tree."""
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    proc = _run(["gpu_harness/benchmarks/trainer_speed.py", "debug_hybrid", "--device", "cpu", "--steps", "3",
                 "--warmup", "1",
                 "--tree", str(REPO), "--fit", "--simulate-oom-above", "1", "--workdir", str(tmp_path / "runs"),
                 "--json", str(out), "--markdown", str(md)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [r["tree_path"] for r in rows] == [str(REPO), str(REPO)]
    assert [r["tree"].split("@")[0] for r in rows] == ["this", REPO.name]
    for r in rows:
        assert r["status"] == "OK", r
        assert r["oom_at"] == [2] and r["local_batch"] == r["global_batch"] == 1, r
        assert r["flavor"] == "debug_hybrid" and r["seq_len"] == 128
        assert r["steps_measured"] == 2 and r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["tflops_per_gpu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12)
        assert r["memory_estimate_gib"] > 0
        assert r["memory_gib"] is None and r["mfu_logged"] is None and "mfu_matmul" not in r  # a CPU logs none
        records = [json.loads(line) for line in (Path(r["log"]).parent / "dump" / "metrics.jsonl").open()]
        assert [rec["step"] for rec in records] == [1, 3]  # the recipe's log every 10 steps: the first and last
    first, second = result["summary"]
    assert second["vs_first_tree"] == pytest.approx(second["tokens_per_s"] / first["tokens_per_s"])
    report = md.read_text()
    assert re.search(r"\| debug_hybrid +\| this@\w+\+? +\| 1 +\| 1 +\|", report), report
    assert "OK (OOM at 2)" in report and "vs first tree" in report

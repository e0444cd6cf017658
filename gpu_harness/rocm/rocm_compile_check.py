"""Compile every Triton kernel of a training step for AMD MI300X (gfx942) and MI355X (gfx950), on a CPU machine.

    python gpu_harness/rocm/rocm_compile_check.py                         # the manifest, gfx942 + gfx950 + sm_90
    python gpu_harness/rocm/rocm_compile_check.py --amd-configs --jobs 8  # also FLA's AMD autotune configs
    python gpu_harness/rocm/rocm_compile_check.py --targets gfx942 --kernels 'kda' --json out.json

Reads the kernel manifest (tests/assets/triton_kernels.json, written by gpu_harness/rocm/record_triton_manifest.py
through triton_recorder.py on a GPU), imports each kernel's ``@triton.jit`` function again and runs
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`` for every target:
Triton compiles ahead of time for a GPU it does not run on. sm_90 is the control (the GPU the manifest was
recorded on). A compile is ``ok`` when it yields the
target's binary (AMD: ``amdgcn`` + ``hsaco``; NVIDIA: ``ptx`` + ``cubin``, ptxas ships in Triton's wheel) and the
kernel would pass Triton's load-time checks on that GPU (shared memory / LDS per block, threads per block);
``oor`` when it compiles but would be refused at load for resources (a failure, except for an autotune config:
Triton's autotuner skips those on the device); ``error`` when it does not compile. Exit status 1 on any failure.

Each target compiles in its own worker processes. For an AMD target the workers make Triton's active driver a
target-only one for that GPU before FLA is imported, so FLA's ``fla.utils`` detects the AMD GPU (IS_AMD, its LDS
size for ``check_shared_mem``): the module-level choices FLA makes on import (autotune lists, dot precisions
such as tf32 vs ieee) are those it makes on that GPU. ``--amd-configs`` then compiles every autotuned kernel with
every config of its autotuner as FLA built it there. docs/rocm.md says what this proves and what it does not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
import traceback

HARNESS = os.path.dirname(os.path.abspath(__file__))  # gpu_harness/rocm/
REPO = os.path.dirname(os.path.dirname(HARNESS))
for _path in (REPO, HARNESS):  # run from a checkout: the kernels' modules and the recorder beside this script
    if _path not in sys.path:
        sys.path.insert(0, _path)

from triton_recorder import load_manifest, target_info  # noqa: E402

DEFAULT_MANIFEST = os.path.join(REPO, "tests", "assets", "triton_kernels.json")
DEFAULT_TARGETS = "gfx942,gfx950,sm_90"
EXPECTED_ASM = {"hip": ("amdgcn", "hsaco"), "cuda": ("ptx", "cubin")}

# ------------------------------------------------------------------------------------------ worker side
_STATE: dict = {}


def _init_worker(target_name: str, cache_dir: str) -> None:
    """Set up a worker for one target; runs before anything imports FLA."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.path[:0] = [REPO, HARNESS]
    from triton import knobs

    knobs.cache.dir = cache_dir
    info = target_info(target_name)
    if info["target"].backend == "hip":
        from triton_recorder import emulate_target_process

        # FLA then sees this AMD GPU when it is imported (IS_AMD, its LDS size, its CU count).
        emulate_target_process(target_name)
    _STATE.update(target_name=target_name, info=info)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # Triton's CompilationError puts the source excerpt first and the reason last.
    line = lines[-1] if lines and type(e).__name__ == "CompilationError" else (lines[0] if lines else text)
    if type(e).__name__ == "CompilationError" and not line.startswith(type(e).__name__):
        line = f"CompilationError: {line}"
    return line[:200]


def _amd_variants(record: dict) -> list[dict]:
    """The configs FLA's autotuner for this kernel holds in this worker (i.e. on this target), as overrides of
    the recorded constexprs and options. Inner @triton.heuristics whose values depend on a tuned parameter are
    evaluated again; the autotuner's early_config_prune (none of the kernels we use has one) is not applied."""
    from triton_recorder import encode_value, find_autotuner, kernel_wrappers, resolve_kernel

    fn = resolve_kernel(record["module"], record["name"])
    wrappers = kernel_wrappers(fn)
    tuner = find_autotuner(fn)
    if tuner is None:
        # Not autotuned: the launch's num_stages is Triton's default unless given; CUDA's is 3, HIP's 2.
        if _STATE["info"]["target"].backend == "hip" and record["options"].get("num_stages") == 3:
            return [{"label": "hip-default num_stages=2", "constexprs": {}, "options": {"num_stages": 2}}]
        return []
    inner = wrappers[wrappers.index(tuner) + 1:]
    variants = []
    for config in tuner.configs:
        constexprs = {k: encode_value(v) for k, v in config.kwargs.items()}
        args = {**record["constexprs"], **config.kwargs}
        for heur in inner:
            for name, f in heur.values.items():
                try:
                    args[name] = f(args)
                    constexprs[name] = encode_value(args[name])
                except Exception:
                    pass  # depends on a tensor argument: the recorded value stands
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages, "num_ctas": config.num_ctas}
        if getattr(config, "maxnreg", None) is not None:
            options["maxnreg"] = config.maxnreg
        label = ",".join(f"{k}={v}" for k, v in config.kwargs.items())
        label = f"amd:{label}{',' if label else ''}w{config.num_warps},s{config.num_stages}"
        variants.append({"label": label, "constexprs": constexprs, "options": options})
    return variants


def _plan(args: tuple) -> tuple[int, list[dict] | str]:
    index, record = args
    try:
        return index, _amd_variants(record)
    except Exception as e:
        return index, _first_line(e)


def _compile(task: dict) -> dict:
    import triton
    from triton_recorder import compile_args, decode_value, str_to_path

    info = _STATE["info"]
    target = info["target"]
    record = task["record"]
    result = {"kernel": record["kernel"], "name": record["name"], "id": record["id"], "target": task["target"],
              "config": task["label"], "role": (record.get("autotune") or {}).get("role", "fixed"),
              "variant": task["variant"]}
    start = None
    try:
        ca = compile_args(record, target)  # imports the kernel's module: not part of the compile time
        for key, value in task["constexprs"].items():
            ca.constexprs[str_to_path(key, ca.fn.arg_names)] = decode_value(value)
        ca.options.update(task["options"])
        start = time.perf_counter()
        kernel = triton.compile(ca.source(), target=target, options=ca.options)
    except Exception as e:
        seconds = time.perf_counter() - start if start is not None else 0.0
        result.update(status="error", reason=_first_line(e), seconds=seconds)
        if os.environ.get("ROCM_CHECK_TRACEBACK"):
            traceback.print_exc()
        return result
    seconds = time.perf_counter() - start
    md = kernel.metadata
    missing = [k for k in EXPECTED_ASM[target.backend] if not kernel.asm.get(k)]
    threads = md.num_warps * target.warp_size
    if missing:
        result.update(status="error", reason=f"no {'/'.join(missing)} in the compiled kernel")
    elif md.shared > info["max_shared_mem"]:
        result.update(status="oor", reason=f"shared memory {md.shared} B > {info['max_shared_mem']} B per block")
    elif threads > info["max_threads"]:
        result.update(status="oor", reason=f"{md.num_warps} warps x {target.warp_size} = {threads} threads > "
                                           f"{info['max_threads']} per block")
    else:
        result.update(status="ok", reason="")
    result.update(seconds=seconds, shared=md.shared, num_warps=md.num_warps, num_stages=md.num_stages)
    return result


# ------------------------------------------------------------------------------------------ driver side

def select(kernels: list[dict], pattern: str | None, one_per_kernel: bool, max_kernels: int | None) -> list[dict]:
    """A deterministic subset, in (module:name, id) order: the records matching ``pattern``; with
    ``one_per_kernel`` the first record of each @triton.jit function; at most ``max_kernels`` of them, spread
    evenly over that order (so a subset spans FLA's modules rather than taking the first few)."""
    out = sorted(kernels, key=lambda r: (r["kernel"], r["id"]))
    if pattern:
        out = [r for r in out if re.search(pattern, r["kernel"])]
    if one_per_kernel:
        seen: set[str] = set()
        out = [r for r in out if not (r["kernel"] in seen or seen.add(r["kernel"]))]
    if max_kernels and len(out) > max_kernels:
        step = len(out) / max_kernels
        out = [out[int(i * step)] for i in range(max_kernels)]
    return out


def _task_key(record: dict, constexprs: dict, options: dict) -> str:
    """What a compile depends on, to compile each distinct kernel once per target."""
    return json.dumps([record["kernel"], record["signature"], {**record["constexprs"], **constexprs},
                       record["attrs"], {**record["options"], **options}], sort_keys=True)


def run_target(target_name: str, records: list[dict], *, amd_configs: bool, jobs: int, cache_dir: str,
               progress: bool) -> tuple[list[dict], float]:
    """Compile ``records`` for one target, in ``jobs`` fresh worker processes set up for it.

    On an AMD target, the autotune configs FLA builds there are compiled too: for every autotuned record with
    ``amd_configs``; otherwise only for the kernels whose recorded config came out of resources there (a config
    picked on the H200 that the AMD autotuner, with its own list, would never run)."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: FLA must be imported after the driver is set
    start = time.perf_counter()
    is_amd = target_info(target_name)["target"].backend == "hip"
    planned = {_task_key(r, {}, {}) for r in records}
    results: list[dict] = []

    def compile_all(tasks: list[dict]) -> None:
        done = 0
        for result in pool.imap_unordered(_compile, tasks):
            results.append(result)
            done += 1
            if progress:
                print(f"  [{target_name}] {done}/{len(tasks)} {result['name']} {result['config']}: "
                      f"{result['status']}", file=sys.stderr, flush=True)

    def variant_tasks(chosen: list[dict]) -> list[dict]:
        tasks = []
        for index, plan in pool.imap_unordered(_plan, list(enumerate(chosen))):
            record = chosen[index]
            if isinstance(plan, str):
                results.append({"kernel": record["kernel"], "name": record["name"], "id": record["id"],
                                "target": target_name, "config": "amd-configs", "role": "plan", "variant": True,
                                "status": "error", "reason": plan, "seconds": 0.0})
                continue
            for v in plan:
                key = _task_key(record, v["constexprs"], v["options"])
                if key in planned:
                    continue  # a recorded config, or a variant already planned from another record
                planned.add(key)
                tasks.append(dict(record=record, target=target_name, label=v["label"], variant=True,
                                  constexprs=v["constexprs"], options=v["options"]))
        return tasks

    recorded = [dict(record=r, target=target_name, label="recorded", variant=False, constexprs={}, options={})
                for r in records]
    with ctx.Pool(jobs, initializer=_init_worker, initargs=(target_name, cache_dir)) as pool:
        if is_amd and amd_configs:
            compile_all(recorded + variant_tasks(records))
        else:
            compile_all(recorded)
            if is_amd:
                ok = {r["kernel"] for r in results if r["status"] == "ok"}
                oor = {r["id"] for r in results if r["status"] == "oor" and r["role"] in ("chosen", "candidate")}
                retry = [r for r in records if r["id"] in oor and r["kernel"] not in ok]
                if retry:
                    compile_all(variant_tasks(retry))
    return results, time.perf_counter() - start


def judge(results: list[dict]) -> list[dict]:
    """Mark each result ``failed``. ``error`` always fails. ``oor`` fails for a kernel that is not autotuned;
    an autotune config out of resources is skipped by the autotuner on the device, so it fails only when no
    config of that @triton.jit function compiled ``ok`` for that target."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["kernel"], r["target"]), []).append(r)
    for group in groups.values():
        any_ok = any(r["status"] == "ok" for r in group)
        for r in group:
            tuned = r["role"] in ("chosen", "candidate") or r["variant"]
            r["failed"] = r["status"] == "error" or (r["status"] == "oor" and not (tuned and any_ok))
    return results


def print_table(results: list[dict], out=sys.stdout) -> None:
    rows = [("kernel", "id", "target", "config", "result", "s", "reason")]
    for r in sorted(results, key=lambda r: (r["name"], r["id"], r["target"], r["variant"], r["config"])):
        status = r["status"] if not r.get("failed") else f"{r['status']} FAIL"
        if r["status"] == "oor" and not r.get("failed"):
            status = "oor (skipped by autotuner)"
        rows.append((r["name"], r["id"], r["target"], r["config"], status, f"{r['seconds']:.1f}", r["reason"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", default=DEFAULT_MANIFEST)
    p.add_argument("--targets", default=DEFAULT_TARGETS, help="comma-separated: gfx942, gfx950, sm_90")
    p.add_argument("--amd-configs", action="store_true",
                   help="also compile every autotuned kernel with each config of FLA's autotune list on that AMD "
                        "target (and non-autotuned ones with HIP's default num_stages)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes per target")
    p.add_argument("--kernels", default=None, help="only records whose module:name matches this regex")
    p.add_argument("--one-per-kernel", action="store_true", help="one record per @triton.jit function")
    p.add_argument("--max-kernels", type=int, default=None, help="at most this many records (deterministic)")
    p.add_argument("--json", default=None, help="write every result (and timings) to this file")
    p.add_argument("--use-cache", action="store_true",
                   help="use Triton's on-disk cache (default: a fresh one, so that every kernel really compiles)")
    p.add_argument("--progress", action="store_true", help="a line on stderr per compile")
    p.add_argument("--failures-only", action="store_true", help="leave the ok compiles out of the table")
    args = p.parse_args(argv)

    manifest = load_manifest(args.manifest)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        target_info(t)
    records = select(manifest["kernels"], args.kernels, args.one_per_kernel, args.max_kernels)
    if not records:
        print("no kernel selected", file=sys.stderr)
        return 2
    import triton

    print(f"manifest {os.path.relpath(args.manifest)}: {len(manifest['kernels'])} kernel records "
          f"(recorded on {manifest.get('device')}, triton {manifest.get('triton')}, fla {manifest.get('fla')}"
          f"{', PROVISIONAL' if manifest.get('provisional') else ''}); checking {len(records)} with triton "
          f"{triton.__version__} on {', '.join(targets)}, {args.jobs} jobs per target")

    all_results, timings = [], {}
    with tempfile.TemporaryDirectory(prefix="rocm-compile-check-") as tmp:
        cache_dir = os.environ.get("TRITON_CACHE_DIR", "") if args.use_cache else tmp
        for t in targets:
            results, seconds = run_target(t, records, amd_configs=args.amd_configs, jobs=args.jobs,
                                          cache_dir=cache_dir or tmp, progress=args.progress)
            all_results += results
            compile_s = [r["seconds"] for r in results if r["seconds"]]
            timings[t] = {"wall_s": round(seconds, 2), "compiles": len(results),
                          "compile_s_total": round(sum(compile_s), 2),
                          "compile_s_mean": round(sum(compile_s) / max(1, len(compile_s)), 3),
                          "compile_s_max": round(max(compile_s, default=0.0), 3)}
    judge(all_results)
    print_table([r for r in all_results if r["status"] != "ok"] if args.failures_only else all_results)

    failed = [r for r in all_results if r["failed"]]
    print()
    for t in targets:
        rs = [r for r in all_results if r["target"] == t]
        counts = {s: sum(r["status"] == s for r in rs) for s in ("ok", "oor", "error")}
        tm = timings[t]
        print(f"{t}: {counts['ok']} ok, {counts['oor']} oor, {counts['error']} error, "
              f"{sum(r['failed'] for r in rs)} failed; {tm['compiles']} compiles in {tm['wall_s']:.1f} s wall "
              f"({tm['compile_s_mean']:.2f} s mean, {tm['compile_s_max']:.2f} s max per compile)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"manifest": os.path.abspath(args.manifest), "triton": triton.__version__,
                       "targets": targets, "jobs": args.jobs, "amd_configs": args.amd_configs,
                       "timings": timings, "results": all_results}, f, indent=1)
    print("FAILED: " + ", ".join(sorted({f"{r['name']}@{r['target']}" for r in failed})) if failed else "all ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The trainer's own speed: ``python -m hybridtitan.train`` on mock data, one process per case, read back from the
metrics it logs.

    python gpu_harness/benchmarks/trainer_speed.py gdn_300M kda_300M
    python gpu_harness/benchmarks/trainer_speed.py zebra_llama_1B:training.seq_len=8192,training.local_batch_size=4 \
        --fit
    python gpu_harness/benchmarks/trainer_speed.py gdn_300M --tree ../before --repeat 3 --markdown $OUT/speed.md \
        --json $OUT/s.json
    python gpu_harness/benchmarks/trainer_speed.py debug_hybrid --device cpu --steps 3 --warmup 1   # dry run on a CPU

A case is NAME[:key=value,...]: the recipe train_configs/NAME.toml and the flavor it names (or --recipe with the
flavor NAME) with the trainer's keys overridden (``training.seq_len=8192``; a value may hold commas:
``compile.components=norm,swiglu``). Each run is the trainer itself, torchrun --standalone --nproc_per_node 1
(or plain python), on one GPU, with --data.source mock (no data work: the step alone; a case may name another
source and its keys), --steps steps logged at the recipe's metrics.log_freq (or --log-freq), no checkpoints, no
TensorBoard, and one micro-batch per step (the global batch is the local one, unless the case sets
training.global_batch_size). Everything else is the recipe's: kernels, torch.compile, activation checkpointing,
precision.

From DUMP/metrics.jsonl, over the log windows after --warmup (compilation and autotuning come first): the median
tokens/s per device and step time, the peak memory (allocated and reserved), the MFU the trainer logs (against
the datasheet's peak), TFLOP/s per GPU (``python -m hybridtitan.describe --json``'s FLOPs per token for the same
overrides x tokens/s), MFU against a bf16 matmul rate measured at the start of this run (--matmul-size^3,
CUDA events, in a process of its own so that no CUDA context of this script is left on the GPU while the
trainer runs), and describe's memory estimate beside the measured peak.

--tree PATH runs another checkout's trainer too (PYTHONPATH=PATH, run from PATH, its own train_configs/), for a
before / after in one run; --repeat R runs every case on every tree R times, alternating, so that a drift of the
machine spreads over all of them. A run that runs out of memory is reported OOM; with --fit it is retried at half
the local batch until it fits. --json and --markdown are rewritten after every run, so a run cut short keeps its
results. --device cpu is a dry run of the same flow on a CPU (the trainer gets CUDA_VISIBLE_DEVICES=): each
flavor's debug stand-in of the same kind, sequences of 128, at most 2 per micro-batch, nothing compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(HARNESS)
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

from common import format_table, write_json  # noqa: E402

# --device cpu: the debug flavor of the same kind stands in for each model
TINY_FLAVOR = {"llama_1B": "debug_llama", "llama_8B": "debug_llama", "zebra_llama_1B_upcycled": "debug_llama_upcycled",
               "hylo_1B_upcycled": "debug_llama_upcycled", "gdn_300M": "debug_gdn", "gdn_1B": "debug_gdn",
               "kda_300M": "debug_kda", "kda_1B": "debug_kda",
               "zebra_gdn_300M": "debug_hybrid", "zebra_kda_1B": "debug_kda", "zebra_mamba2_300M": "debug_mamba2",
               "zebra_llama_1B": "debug_mamba2", "zebra_llama_3B": "debug_mamba2", "zebra_llama_8B": "debug_mamba2"}
CPU_SETTINGS = {"training.seq_len": "128", "compile.enable": "false"}
CPU_MAX_BATCH = 2
OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


# ================================================================================================ arguments


@dataclasses.dataclass(frozen=True)
class Case:
    spec: str
    flavor: str
    overrides: dict  # trainer key (without the leading --) -> value


def parse_case(spec: str) -> Case:
    """FLAVOR[:key=value,...]; a comma starts a new pair only where a key= follows it."""
    flavor, _, rest = spec.partition(":")
    if not flavor:
        raise ValueError(f"case {spec!r}: no flavor")
    overrides = {}
    for pair in re.split(r",(?=[A-Za-z_][\w.]*=)", rest) if rest else []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"case {spec!r}: {pair!r} is not key=value")
        overrides[key.removeprefix("--")] = value
    return Case(spec, flavor, overrides)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", help="FLAVOR[:key=value,...]")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (default 10)")
    p.add_argument("--log-freq", dest="log_freq", type=int, default=None,
                   help="metrics.log_freq of the runs (default: the recipe's; a log step waits for the GPU, so "
                        "logging every step measures less than a user gets)")
    p.add_argument("--recipe", default=None, help="the recipe of every case (default: TREE/train_configs/FLAVOR.toml)")
    p.add_argument("--tree", action="append", default=[], metavar="PATH",
                   help="another checkout whose trainer runs the same cases (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="run every case on every tree this many times, alternating")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run of the trainer (default 900)")
    p.add_argument("--fit", action="store_true", help="retry a run that runs out of memory at half the local batch")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--launcher", choices=("torchrun", "python"), default=None,
                   help="torchrun --standalone --nproc_per_node 1, or python -m (default: torchrun on a GPU)")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--fresh-triton-cache", action="store_true",
                   help="each run with empty Triton and TorchInductor caches of its own (a cold start: the first "
                        "step's time is compiling, and autotuning where no kernel configurations apply)")
    p.add_argument("--workdir", default=None, help="dump folders and logs of the runs (default: a new temp folder)")
    p.add_argument("--markdown", default=None, help="write the report here (rewritten after every run)")
    p.add_argument("--json", default=None, help="write every result here (rewritten after every run)")
    p.add_argument("--matmul-child", type=int, default=None, help=argparse.SUPPRESS)  # the matmul's own process
    p.add_argument("--simulate-oom-above", type=int, default=None, help=argparse.SUPPRESS)  # CPU test of --fit
    args = p.parse_args(argv)
    if args.matmul_child is not None:
        return args
    if not args.cases:
        p.error("give at least one case, FLAVOR[:key=value,...]")
    if args.steps < 1 or not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be below --steps (got --warmup {args.warmup}, --steps {args.steps})")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        args.cases = [parse_case(c) for c in args.cases]
    except ValueError as e:
        p.error(str(e))
    args.trees = [REPO] + [os.path.abspath(t) for t in args.tree]
    for tree in args.trees[1:]:
        if not os.path.isdir(os.path.join(tree, "hybridtitan")):
            p.error(f"--tree {tree}: no hybridtitan package there")
    if args.recipe:
        args.recipe = os.path.abspath(args.recipe)
    args.launcher = args.launcher or ("torchrun" if args.device == "cuda" else "python")
    return args


# ================================================================================================ the matmul rate


def matmul_child(n: int) -> int:
    """In a process of its own: the bf16 matmul rate of this GPU, as one JSON line."""
    import torch

    from common import matmul_rate

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no GPU visible"}))
        return 1
    device = torch.device("cuda", 0)
    print(json.dumps({"matmul_flops": matmul_rate(device, n), "gpu": torch.cuda.get_device_name(device),
                      "torch": torch.__version__}))
    return 0


def measure_matmul(n: int) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--matmul-child", str(n)], capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the matmul process exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


# ================================================================================================ one run


def tree_label(tree: str, own: bool) -> str:
    """this / the folder's name, with its commit (+ where it has uncommitted changes)."""
    name = "this" if own else os.path.basename(tree.rstrip(os.sep))
    try:
        commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return name
    return f"{name}@{commit}{'+' if dirty else ''}" if commit else name


def recipe_for(args, case: Case, tree: str) -> str:
    return args.recipe or os.path.join(tree, "train_configs", f"{case.flavor}.toml")


def read_recipe(recipe: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(recipe, "rb") as f:
        return tomllib.load(f)


def recipe_local_batch(recipe: str) -> int | None:
    value = read_recipe(recipe).get("training", {}).get("local_batch_size")
    return int(value) if value is not None else None


def start_batch(args, case: Case, recipe: str) -> int:
    """The case's local batch, else the recipe's (capped on a CPU dry run)."""
    batch = case.overrides.get("training.local_batch_size") or recipe_local_batch(recipe)
    if batch is None:
        raise ValueError(f"{recipe}: no training.local_batch_size; give it in the case")
    batch = int(batch)
    return min(batch, CPU_MAX_BATCH) if args.device == "cpu" else batch


def trainer_settings(args, case: Case, batch: int, dump: str, recipe: str) -> dict:
    """The trainer's overrides for one run: the case's over mock data, then what the measurement needs (the
    step alone: no validation or evaluation, switched off only where the recipe has them, so that a tree from
    before those sections takes the same command)."""
    settings = {"data.source": "mock"}
    sections = read_recipe(recipe)
    if "validation" in sections:
        settings["validation.enable"] = "false"
    if "eval" in sections:
        settings["eval.tasks"] = ""  # a comma-separated list: empty is none
    settings.update(case.overrides)
    # a recipe named for its data or length (gdn_1B_8k) runs the flavor it names; --recipe runs the case's
    flavor = case.overrides.get("model.flavor") or (case.flavor if args.recipe else None)
    flavor = flavor or sections.get("model", {}).get("flavor") or case.flavor
    settings["model.flavor"] = TINY_FLAVOR.get(flavor, flavor) if args.device == "cpu" else flavor
    if args.device == "cpu":
        settings.update(CPU_SETTINGS)
    settings["training.local_batch_size"] = str(batch)
    settings.setdefault("training.global_batch_size", str(batch))
    if args.log_freq is not None:
        settings["metrics.log_freq"] = str(args.log_freq)
    settings.update({"training.steps": str(args.steps), "checkpoint.enable": "false",
                     "metrics.enable_tensorboard": "false", "job.dump_folder": dump})
    return settings


def as_argv(recipe: str, settings: dict) -> list[str]:
    argv = ["--job.config_file", recipe]
    for key, value in settings.items():
        argv += [f"--{key}", value]
    return argv


def child_env(args, tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if args.fresh_triton_cache:  # a cold start: Triton and TorchInductor compile everything again
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-", dir=args.workdir)
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-", dir=args.workdir)
    return env


def start_describe(args, tree: str, argv: list[str]) -> subprocess.Popen:
    """describe --json of the same settings, started beside the trainer: it only reads the recipe, and its few
    seconds of CPU are over while the trainer still starts up, long before the steps that are measured."""
    return subprocess.Popen([sys.executable, "-m", "hybridtitan.describe", *argv, "--json"], cwd=tree,
                            env=child_env(args, tree), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_describe(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "describe timed out"}
    if proc.returncode != 0:
        return {"error": f"describe exited {proc.returncode}: {(err.strip().splitlines() or [''])[-1]}"}
    return json.loads(out.strip().splitlines()[-1])


def run_trainer(args, tree: str, argv: list[str], log_path: str) -> tuple[int | None, float]:
    """The trainer in a session of its own (torchrun's workers included), killed whole past --timeout.
    Returns (exit code, or None on a timeout; wall seconds)."""
    trainer = ["-m", "hybridtitan.train", *argv]
    if args.launcher == "torchrun":
        trainer = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *trainer]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *trainer], cwd=tree, env=child_env(args, tree), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop_session(proc)
            code = None
    return code, time.perf_counter() - t0


def stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (the trainer saves nothing here and stops), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def error_line(log_text: str, first_choice: str = r"^error: ") -> str:
    """The last line matching ``first_choice`` (default: the trainer's one-line error), else the last exception
    named (torchrun's own come after the worker's), else the last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for pattern in (first_choice, r"\b\w+(Error|Exception)\b"):
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[-1][:240]
    return lines[-1][:240] if lines else "no output"


def read_metrics(dump: str) -> list[dict]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _max(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def measures(records: list[dict], warmup: int, described: dict, matmul_flops: float | None) -> dict:
    """What a finished run measured, over the steps after the warm-up."""
    # a record is the mean of the steps since the previous one (its log window): those windows wholly past the
    # warm-up count
    windows = [(r, r["step"] - previous["step"]) for previous, r in zip(records, records[1:])
               if previous["step"] >= warmup]
    steady = [r for r, _ in windows]
    if not steady:
        raise ValueError(f"no log window after the warm-up of {warmup} steps ({len(records)} records)")
    tps = _median(steady, "tokens_per_sec_per_device")
    out = {"steps_measured": sum(n for _, n in windows), "tokens_per_s": tps, "step_s": _median(steady, "step_time_s"),
           "first_step_s": records[0]["step_time_s"], "first_step_at_s": records[0]["elapsed_s"],
           "loss_last": records[-1]["loss"],
           "memory_gib": _max(records, "memory_gib"), "memory_reserved_gib": _max(records, "memory_reserved_gib"),
           "mfu_logged": _median(steady, "mfu")}
    fpt = described.get("flops_per_token")
    if fpt:
        out["flops_per_token"] = fpt
        out["tflops_per_gpu"] = fpt * tps / 1e12
        if matmul_flops:
            out["mfu_matmul"] = fpt * tps / matmul_flops
    estimate = (described.get("memory_estimate_gib") or {}).get("total")
    if estimate:
        out["memory_estimate_gib"] = estimate
        if out["memory_gib"] is not None:
            out["memory_vs_estimate"] = out["memory_gib"] / estimate
    return out


def run_once(args, case: Case, tree: str, batch: int, run_dir: str, matmul_flops: float | None) -> dict:
    """One run of the trainer at ``batch``: its row (status OK, OOM, FAIL or TIMEOUT)."""
    recipe = recipe_for(args, case, tree)
    settings = trainer_settings(args, case, batch, os.path.join(run_dir, "dump"), recipe)
    row = {"local_batch": batch, "global_batch": int(settings["training.global_batch_size"]),
           "flavor": settings["model.flavor"], "recipe": recipe, "log": os.path.join(run_dir, "train.log")}
    if args.simulate_oom_above is not None and batch > args.simulate_oom_above:
        return {**row, "status": "OOM", "error": f"simulated: batch {batch} > {args.simulate_oom_above}"}
    os.makedirs(run_dir, exist_ok=True)
    argv = as_argv(recipe, settings)
    describe = start_describe(args, tree, argv)
    code, wall = run_trainer(args, tree, argv, row["log"])
    described = finish_describe(describe)
    row.update(wall_s=wall, seq_len=described.get("seq_len"))
    if described.get("error"):
        row["describe_error"] = described["error"]
    with open(row["log"], errors="replace") as f:
        log_text = f.read()
    # which kernel configurations the run used (shipped, a folder, or autotuning), as its log says
    row["kernel_configs"] = next((line.split("kernel configurations: ", 1)[1].strip() for line in log_text.splitlines()
                                  if "kernel configurations: " in line), None)
    if code is None:
        return {**row, "status": "TIMEOUT", "error": f"stopped after {args.timeout:.0f} s"}
    if code != 0:
        if OOM_PATTERN.search(log_text):
            return {**row, "status": "OOM", "error": error_line(log_text, OOM_PATTERN.pattern), "exit": code}
        return {**row, "status": "FAIL", "error": error_line(log_text), "exit": code}
    try:
        return {**row, "status": "OK", **measures(read_metrics(settings["job.dump_folder"]), args.warmup, described,
                                                  matmul_flops)}
    except (ValueError, KeyError) as e:
        return {**row, "status": "FAIL", "error": f"metrics.jsonl: {e}"}


def run_fitting(args, case: Case, tree: str, batch: int, run_dir: str, matmul_flops: float | None) -> dict:
    """run_once, then with --fit at half the local batch while it runs out of memory."""
    tried = []
    while True:
        row = run_once(args, case, tree, batch, os.path.join(run_dir, f"batch{batch}"), matmul_flops)
        if row["status"] != "OOM" or not args.fit or batch == 1:
            break
        tried.append(batch)
        print(f"    out of memory at local batch {batch}: retrying at {batch // 2}", flush=True)
        batch //= 2
    return {**row, **({"oom_at": tried} if tried else {})}


# ================================================================================================ report


def _num(x, fmt="{:.1f}"):
    return fmt.format(x) if x is not None else "-"


def _pct(x):
    return f"{100 * x:.1f}%" if x is not None else "-"


COLUMNS = ["case", "tree", "rep", "batch", "tok/s/dev", "ms/step", "first step s", "first step at s", "TFLOP/s/GPU",
           "MFU logged", "MFU vs matmul", "peak alloc GiB", "peak reserved GiB", "estimate GiB (peak / estimate)",
           "status"]


def table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        status = r["status"] + (f" (OOM at {','.join(map(str, r['oom_at']))})" if r.get("oom_at") else "")
        if r.get("error"):
            status += f": {r['error'][:100]}"
        estimate = "-" if r.get("memory_estimate_gib") is None else \
            f"{r['memory_estimate_gib']:.1f}" + (f" ({r['memory_vs_estimate']:.2f})" if r.get("memory_vs_estimate")
                                                   else "")
        case = r["case"] + (f" ({r['flavor']})" if r.get("flavor") and r["flavor"] != r["case"].split(":")[0] else "")
        out.append([case, r["tree"], r["repeat"], r.get("local_batch"), _num(r.get("tokens_per_s"), "{:,.0f}"),
                    _num(1e3 * r["step_s"] if r.get("step_s") else None), _num(r.get("first_step_s")),
                    _num(r.get("first_step_at_s")), _num(r.get("tflops_per_gpu")),
                    _pct(r.get("mfu_logged")), _pct(r.get("mfu_matmul")), _num(r.get("memory_gib")),
                    _num(r.get("memory_reserved_gib")), estimate, status])
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per case and tree: the median tokens/s over the repeats that ran, and its ratio to the first tree's."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        base = None
        for tree in dict.fromkeys(r["tree"] for r in rows):
            ok = [r["tokens_per_s"] for r in rows if r["case"] == case and r["tree"] == tree and r["status"] == "OK"]
            median = statistics.median(ok) if ok else None
            base = median if base is None else base
            out.append({"case": case, "tree": tree, "runs": len(ok), "tokens_per_s": median,
                        "vs_first_tree": median / base if median and base else None})
    return out


def markdown(args, info: dict, command: str, rows: list[dict]) -> str:
    matmul = info.get("matmul_flops")
    lines = [f"## The trainer's speed, {info['date']}, {info.get('gpu') or 'CPU dry run'}", "",
             f"    {command}", "",
             f"python -m hybridtitan.train ({args.launcher}, one process) on mock data, {args.steps} steps, the "
             f"medians over steps {args.warmup + 1}-{args.steps}; one micro-batch per step unless the case sets "
             f"training.global_batch_size; MFU logged: against the datasheet's peak; MFU vs matmul: against the bf16 "
             f"{args.matmul_size}^3 matmul measured at the start"
             + (f" ({matmul / 1e12:.4g} TFLOP/s)" if matmul else " (not measured on a CPU)")
             + "; estimate: python -m hybridtitan.describe's memory estimate.", "",
             format_table(COLUMNS, table_rows(rows)), ""]
    if len(args.trees) > 1 or args.repeat > 1:
        lines += ["Median tokens/s per device over the repeats:", "",
                  format_table(["case", "tree", "runs", "tok/s/dev", "vs first tree"],
                               [[s["case"], s["tree"], s["runs"], _num(s["tokens_per_s"], "{:,.0f}"),
                                 _num(s["vs_first_tree"], "{:.3f}x")] for s in summary(rows)]), ""]
    return "\n".join(lines)


def save(args, info: dict, command: str, rows: list[dict]) -> None:
    if args.json:
        write_json(args.json, {"command": command, **info, "settings": {
            "steps": args.steps, "warmup": args.warmup, "device": args.device, "launcher": args.launcher,
            "repeat": args.repeat, "fit": args.fit, "recipe": args.recipe, "cases": [c.spec for c in args.cases]},
            "results": rows, "summary": summary(rows)})
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(args, info, command, rows))


# ================================================================================================ main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.matmul_child is not None:
        return matmul_child(args.matmul_child)
    command = "python " + shlex.join([os.path.relpath(os.path.abspath(__file__))] +
                                     (sys.argv[1:] if argv is None else list(argv)))
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": None, "matmul_flops": None,
            "trees": [{"label": tree_label(t, i == 0), "path": t} for i, t in enumerate(args.trees)]}
    if args.device == "cuda":
        rate = measure_matmul(args.matmul_size)
        if rate.get("error"):
            print(f"error: {rate['error']} (a dry run on a CPU: --device cpu)", file=sys.stderr)
            return 2
        info.update(rate)
        print(f"{info['gpu']}: bf16 matmul {args.matmul_size}^3 {info['matmul_flops'] / 1e12:.4g} TFLOP/s", flush=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="trainer-speed-")
    labels = [t["label"] for t in info["trees"]]
    plan = [(r, case, i) for r in range(args.repeat) for case in args.cases for i in range(len(args.trees))]
    fitted: dict[tuple, int] = {}  # (case, tree) -> the local batch that fitted, for the later repeats
    rows: list[dict] = []
    t0 = time.perf_counter()
    for n, (repeat, case, i) in enumerate(plan):
        tree = args.trees[i]
        print(f"[{time.perf_counter() - t0:6.0f}s] {n + 1}/{len(plan)} {case.spec} on {labels[i]}"
              f"{f', repeat {repeat + 1}' if args.repeat > 1 else ''}", flush=True)
        head = {"case": case.spec, "tree": labels[i], "tree_path": tree, "repeat": repeat + 1}
        try:
            batch = fitted.get((case.spec, i)) or start_batch(args, case, recipe_for(args, case, tree))
            row = {**head, **run_fitting(args, case, tree, batch, os.path.join(workdir, f"run{n + 1}"),
                                         info["matmul_flops"])}
        except (OSError, ValueError) as e:  # a recipe that is not there, a case that names no batch
            row = {**head, "status": "FAIL", "error": str(e)}
        if row["status"] == "OK":
            fitted[(case.spec, i)] = row["local_batch"]
        rows.append(row)
        print("    " + " | ".join(str(c) for c in table_rows([row])[0][3:]), flush=True)
        save(args, info, command, rows)
    print("\n" + markdown(args, info, command, rows))
    print(f"logs and dump folders: {workdir}")
    return 1 if any(r["status"] in ("FAIL", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

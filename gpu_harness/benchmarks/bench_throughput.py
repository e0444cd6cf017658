"""Training throughput on one GPU: hybridtitan against FLA's Hugging Face models, wrapped the same way.

    python gpu_harness/benchmarks/bench_throughput.py       # gdn_300M, kda_300M (+ FLA twice), zebra_*_300M, gdn_1B
    python gpu_harness/benchmarks/bench_throughput.py --models gdn_300M,kda_300M --markdown $OUT/b.md --json $OUT/b.json
    python gpu_harness/benchmarks/bench_throughput.py --models gdn_300M --impls hybridtitan --profile gdn_300M
    python gpu_harness/benchmarks/bench_throughput.py --device cpu --tiny  # a CPU dry run: the whole flow, debug models

One process, world size 1: a process group of one (NCCL; gloo on a CPU) and a 1-D mesh, so that FSDP2 works as
in the trainer. Every implementation gets the same treatment: fully_shard per block then the root (ours built
by hybridtitan.train.build_parallel_model under the variant's kernel configuration; FLA's model.model.layers[i],
then the model, through hybridtitan.parallel.apply_fsdp with the same reshard-after-forward choice), bf16
parameters and float32 gradient reduction, torch.optim.AdamW(fused=True), the same random token batches of
micro-batch B x seq, and the trainer's CUDA allocator setting (expandable_segments:True) set once before the
first CUDA allocation. Our step: model(ids, labels=shifted ids);
FLA's: model(input_ids=ids, labels=ids) (FLA shifts the labels itself), so both count the same B x (seq - 1)
tokens. FLA runs twice: 'fla-ce' (fuse_cross_entropy: its fused CE over the full logits) and 'fla-flce'
(fuse_linear_cross_entropy). Ours runs as the variants of OURS, each a kernel configuration
(hybridtitan.ops.KernelConfig) and whether torch.compile takes every sublayer whole; two versions of the code
are compared by running this script from each checkout (gpu_harness/benchmarks/trainer_speed.py --tree does it for the
trainer in one run).

Measured: warm-up steps (the first includes Triton autotuning; peak-memory statistics are reset after it), then
timed steps between CUDA events. tokens/s = B x seq x steps / time; MFU = counted training FLOPs per token
(hybridtitan.models.flops, the same count for FLA's model of the same configuration) x tokens/s over (a) the
measured bf16 matmul rate (8192^3) and (b) 989 TFLOP/s (H100/H200 dense bf16 datasheet). A case that runs out
of memory is retried with the next smaller micro-batch (32, 24, 16, 12, 8, ...). Every case prints a row and
the run goes on past a failing one; --json is rewritten after every case, so a run cut short keeps its results.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import gzip
import json
import math
import os
import shlex
import shutil
import sys
import time
import traceback

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

import torch  # noqa: E402

from common import (  # noqa: E402
    DATASHEET_FLOPS,
    Timer,
    fla_config,
    fla_model_class,
    format_table,
    free_memory,
    init_process_group_of_one,
    is_oom,
    is_pure_fla_model,
    kernel_config_arguments,
    matmul_rate,
    one_line,
    record_kernel_configs,
    rel_err,
    set_expandable_segments,
    sync,
    use_kernel_configs,
    versions,
    write_json,
)

MODELS = "gdn_300M,kda_300M,zebra_gdn_300M,zebra_mamba2_300M,gdn_1B"
FLA_MODELS = "gdn_300M,kda_300M"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running our model: KernelConfig fields over the recipes' GPU kernels (below), and
    torch.compile of every sublayer whole (compile.components "model")."""

    what: str
    kernels: dict = dataclasses.field(default_factory=dict)
    compile_model: bool = False


# What the GPU recipes run (hybridtitan.train.kernel_config of compile.components = ["norm", "swiglu"]): the
# RMSNorms with the residual adds fused into them and the MLPs' SwiGLU passes compiled; each cross-entropy chunk's
# softmax and the short convolutions in our Triton kernels; the rest FLA's kernels. The residual adds are fused
# on a CPU too (the trainer fuses them on GPUs only: on a CPU there is no kernel to save), so that the dry run
# takes the GPU's code path.
RECIPE_KERNELS = {"fused_residual": True, "compiled_norms": True, "compiled_swiglu": True}
OURS = {
    "hybridtitan": Variant("the recipes' kernels"),
    "hybridtitan-fla-conv": Variant("FLA's short-convolution kernels instead of ours", {"triton_conv": False}),
    "hybridtitan-graphs": Variant("the recurrent mixers' FLA calls replayed from CUDA graphs", {"cuda_graphs": True}),
    "hybridtitan-fla-swiglu": Variant("SwiGLU in FLA's kernels", {"compiled_swiglu": False}),
    "hybridtitan-compiled-loss": Variant("the norms and the loss chunks compiled, SwiGLU in FLA's kernels",
                                         {"compiled_swiglu": False, "compiled_loss": True}),
    "hybridtitan-fla-norm": Variant("the loss chunks compiled, the norms and SwiGLU in FLA's kernels",
                                    {"compiled_norms": False, "compiled_swiglu": False, "compiled_loss": True}),
    "hybridtitan-eager": Variant("nothing compiled", {"compiled_norms": False, "compiled_swiglu": False}),
    "hybridtitan-compiled": Variant("every sublayer compiled whole, the loss chunks too", {"compiled_loss": True},
                                    compile_model=True),
    "hybridtitan-unfused-residual": Variant("each residual add a pass of its own before the next norm",
                                            {"fused_residual": False}),
}
IMPLS = (*OURS, "fla-ce", "fla-flce")
DEFAULT_IMPLS = "hybridtitan,fla-ce,fla-flce"
LADDER = (32, 24, 16, 12, 8, 6, 4, 2, 1)
# --tiny: each model stands in for by a debug flavor of the same kind
TINY_FLAVOR = {"gdn_300M": "debug_gdn", "kda_300M": "debug_kda", "zebra_gdn_300M": "debug_hybrid",
               "zebra_mamba2_300M": "debug_mamba2", "gdn_1B": "debug_gdn", "kda_1B": "debug_kda"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true",
                   help="dry run: debug flavors, seq 128, batch 2, 1 warm-up + 2 timed steps; FLA's models are "
                        "built and wrapped but not run on a CPU")
    p.add_argument("--models", default=MODELS, help=f"flavors, comma-separated (default {MODELS})")
    p.add_argument("--fla-models", default=FLA_MODELS,
                   help=f"of --models, those also run with FLA's HF classes (pure GDN/KDA only; default {FLA_MODELS})")
    p.add_argument("--impls", default=DEFAULT_IMPLS, help=f"of {','.join(IMPLS)} (default {DEFAULT_IMPLS})")
    p.add_argument("--extra", default="",
                   help="more cases, MODEL:IMPL comma-separated, run after the others (e.g. "
                        "gdn_300M:hybridtitan-eager,gdn_300M:hybridtitan-compiled)")
    p.add_argument("--batch", type=int, default=32, help="micro-batch (sequences per step)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="our models: tokens per chunk of the output layer and its cross-entropy (default: the "
                        "trainer's training.loss_chunk_size)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-oom-retry", action="store_true", help="on out-of-memory, report instead of a smaller batch")
    p.add_argument("--ac", choices=("none", "full"), default="none",
                   help="activation checkpointing, every sublayer (ours) / every block (FLA)")
    p.add_argument("--profile", default=None,
                   help="CASE[,CASE...], CASE = MODEL or MODEL:IMPL (e.g. gdn_300M or kda_300M:fla-ce): after "
                        "timing, 3 more steps under torch.profiler; writes a gzipped Chrome trace, a kernel table "
                        "and how busy the GPU was (gpu_timeline)")
    p.add_argument("--profile-dir", default=None, help="where the profile goes (default $OUT if set, else ./profiles)")
    p.add_argument("--markdown", default=None, help="append a dated section (command, versions, table) to this file")
    kernel_config_arguments(p)
    p.add_argument("--json", default=None, help="write every result to this file (rewritten after each case)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no new case after this much time (results so far are still written)")
    p.add_argument("--no-ce-bench", action="store_true",
                   help="skip the output-layer cross-entropy micro-benchmark (ours eager and compiled, FLA's fused "
                        "linear CE)")
    p.add_argument("--ce-tokens", type=int, default=None, help="tokens of the CE micro-benchmark (default batch x seq)")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="print the traceback of a failing case")
    p.add_argument("--simulate-oom-above", type=int, default=None, help=argparse.SUPPRESS)  # CPU test of the retry
    args = p.parse_args(argv)
    if args.tiny:
        for name, value in (("seq", 128), ("batch", 2), ("warmup", 1), ("steps", 2), ("matmul_size", 512)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.models = [m for m in args.models.split(",") if m]
    args.fla_models = {m for m in args.fla_models.split(",") if m}
    args.impls = [i for i in args.impls.split(",") if i]
    args.extra = [tuple(c.split(":", 1)) for c in args.extra.split(",") if c]
    bad = [i for i in args.impls + [c[-1] for c in args.extra] if i not in IMPLS]
    if bad:
        p.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    if args.loss_chunk is not None and args.loss_chunk < 1:
        p.error(f"--loss-chunk must be at least 1, got {args.loss_chunk}")
    return args


# ================================================================================================ models


def model_args_for(name: str, tiny: bool):
    from hybridtitan.models import get_flavor

    return get_flavor(TINY_FLAVOR.get(name, name) if tiny else name)


def kernel_config(impl: str):
    """The KernelConfig of one of our variants."""
    from hybridtitan.ops import KernelConfig

    return KernelConfig(**{**RECIPE_KERNELS, **OURS[impl].kernels})


def build_ours(margs, mesh, device, param_dtype, ac: str, impl: str):
    """As the trainer builds it (hybridtitan.train.build_parallel_model), under the variant's kernels."""
    from hybridtitan import ops
    from hybridtitan.train import build_parallel_model

    return build_parallel_model(margs, mesh, device, kernels=ops.Kernels(kernel_config(impl)), ac_mode=ac,
                                compile_model=OURS[impl].compile_model, param_dtype=param_dtype)


def build_fla(margs, impl: str, mesh, device, param_dtype, ac: str):
    """FLA's ForCausalLM of the same configuration, wrapped by the trainer's own hybridtitan.parallel.apply_fsdp
    (fully_shard per block then the root, the default reshard-after-forward choice)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from hybridtitan.parallel import apply_fsdp

    config = fla_config(margs, loss="plain" if impl == "fla-ce" else "linear")
    with torch.device(device):
        model = fla_model_class(margs)(config)  # float32 master weights, as ours; FLA's own init
    layers = model.model.layers
    if ac == "full":
        for i, block in enumerate(layers):
            layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                           preserve_rng_state=False)
    apply_fsdp(model, mesh, param_dtype, torch.float32, layers=layers)
    model.train()
    return model


def build_optimizer(model, device, lr: float):
    """The same AdamW for both: betas (0.9, 0.95), weight decay 0.01 on every parameter, fused kernels."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                                 fused=True)
    except (RuntimeError, TypeError):
        if device.type == "cuda":
            raise
        # a CPU build without the fused CPU kernel: the multi-tensor path (the trainer's choice on a CPU)
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                                 foreach=True)


def make_batches(vocab: int, batch: int, seq: int, device, seed: int, n: int = 2):
    """The same n random batches for every implementation: (ids, ids shifted by one with -100 last)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
        out.append((ids.to(device), labels.to(device)))
    return out


# ================================================================================================ one case


def run_case(args, mesh, device, name: str, impl: str, batch: int, info: dict) -> dict:
    from hybridtitan.models.flops import flops_per_token, param_counts

    margs = model_args_for(name, args.tiny)
    if args.simulate_oom_above is not None and batch > args.simulate_oom_above:
        raise torch.OutOfMemoryError(f"simulated: batch {batch} > {args.simulate_oom_above}")
    on_gpu = device.type == "cuda"
    param_dtype = torch.bfloat16 if on_gpu else torch.float32  # the trainer's choice on a CPU
    t_build = time.perf_counter()
    torch.manual_seed(args.seed)  # the same initial weights for every case of a model: comparable step-1 losses
    if impl in OURS:
        model = build_ours(margs, mesh, device, param_dtype, args.ac, impl)
    else:
        model = build_fla(margs, impl, mesh, device, param_dtype, args.ac)
    optimizer = build_optimizer(model, device, args.lr)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    row = {"case": name, "flavor": TINY_FLAVOR.get(name, name) if args.tiny else name, "impl": impl, "batch": batch,
           "seq": args.seq, "params": n_params, "counted_params": param_counts(margs)["total"],
           "flops_per_token": flops_per_token(margs, args.seq)["total"],
           "build_s": time.perf_counter() - t_build}
    if impl in OURS:
        from hybridtitan.job_config import Training

        row["loss_chunk"] = args.loss_chunk or Training.loss_chunk_size
    if impl not in OURS and not on_gpu:
        del model, optimizer
        row.update(status="SKIP", note="FLA's HF models need a GPU: built, wrapped and optimizer made only")
        return row

    batches = make_batches(margs.vocab_size, batch, args.seq, device, args.seed)
    if impl in OURS:
        def step(ids, labels):
            loss = model(ids, labels=labels, loss_chunk_size=row["loss_chunk"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
    else:
        def step(ids, labels):
            out = model(input_ids=ids, labels=ids)  # FLA shifts the labels itself
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return out.loss.detach()

    t_warm = time.perf_counter()
    losses = []
    for i in range(args.warmup):
        losses.append(step(*batches[i % len(batches)]).float().item())
        if i == 0 and on_gpu:
            # the first step autotunes FLA's kernels: the peak is measured from the second step on
            torch.cuda.reset_peak_memory_stats(device)
    row["warmup_s"] = time.perf_counter() - t_warm
    gc.collect()
    gc.disable()  # as the trainer's loop
    try:
        with Timer(device) as t:
            for i in range(args.steps):
                loss = step(*batches[i % len(batches)])
    finally:
        gc.enable()
    tokens = batch * args.seq * args.steps
    tps = tokens / t.seconds
    row.update(status="OK", step_ms=1e3 * t.seconds / args.steps, tokens_per_s=tps,
               loss_first=losses[0], loss_last=loss.float().item(),
               mfu_matmul=row["flops_per_token"] * tps / info["matmul_flops"],
               mfu_datasheet=row["flops_per_token"] * tps / DATASHEET_FLOPS)
    if on_gpu:
        row["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    if not math.isfinite(row["loss_last"]):
        row["note"] = "non-finite loss"
    if args.profile and any(profile_matches(spec, name, impl) for spec in args.profile.split(",")):
        row["profile"] = profile_steps(args, device, step, batches, f"{name}_{impl}")
    return row


def profile_matches(spec: str, name: str, impl: str) -> bool:
    model, _, which = spec.partition(":")
    return model == name and (which or "hybridtitan") == impl


def profile_steps(args, device, step, batches, tag: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    folder = args.profile_dir or os.environ.get("OUT") or "profiles"
    os.makedirs(folder, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        for i in range(3):
            step(*batches[i % len(batches)])
        sync(device)
        wall_ms = 1e3 * (time.perf_counter() - start)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
    except Exception:  # noqa: BLE001 - older/newer naming of the device column
        table = prof.key_averages().table(sort_by="self_device_time_total" if device.type == "cuda"
                                          else "self_cpu_time_total", row_limit=40)
    # the same, split by input shapes: which tensors the copies and elementwise passes are over
    with contextlib.suppress(Exception):
        by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=30,
                                                                      max_name_column_width=40,
                                                                      max_shapes_column_width=90)
        table += "\nby input shape:\n" + by_shape
    if device.type == "cuda":  # where the CPU's time goes (a launch-bound step is limited by it)
        with contextlib.suppress(Exception):
            table += "\nby CPU time:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                                     max_name_column_width=50)
    raw = os.path.join(folder, f"profile_{tag}.json")
    prof.export_chrome_trace(raw)
    timeline = gpu_timeline(raw, wall_ms, steps=3) if device.type == "cuda" else None
    if timeline:
        table += "\n" + timeline["summary"]
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    table_path = os.path.join(folder, f"profile_{tag}.txt")
    with open(table_path, "w") as f:  # with every kernel's total, which the printout leaves out
        f.write(table + "\n" + (timeline["kernels"] + "\n" if timeline else ""))
    print(f"profile of 3 steps ({tag}):\n{table}", flush=True)
    return {"trace": raw + ".gz", "table": table_path, "timeline": timeline}


def gpu_timeline(trace_path: str, wall_ms: float, steps: int, gap_floor_us: float = 20.0) -> dict | None:
    """How busy the GPU was in a profiler trace: the union of its kernels, copies and memsets against the wall
    time of the profiled steps, and its idle gaps. For each gap, how long before the kernel that ends it the CPU
    had launched that kernel: a launch just before (under ``gap_floor_us``) means the GPU was waiting for the CPU
    to get there (launch-bound), an earlier one means it waited for something else (an event, a copy).
    """
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    launches = {}  # correlation id -> end of the CPU's launch call
    device_work = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, correlation = e.get("cat", ""), (e.get("args") or {}).get("correlation")
        if cat in ("cuda_runtime", "cuda_driver") and correlation is not None:
            launches[correlation] = e["ts"] + e.get("dur", 0.0)
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device_work.append((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("name", "?"), correlation))
    if not device_work:
        return None
    device_work.sort()
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = device_work[0][0], device_work[0][1], device_work[0][2]
    for start, end, name, correlation in device_work[1:]:
        if start > cur_end:  # a gap: close the busy stretch
            busy += cur_end - cur_start
            launched = launches.get(correlation)
            lag = start - launched if launched is not None else float("nan")
            gaps.append((start - cur_end, lag, cur_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    idle = sum(g[0] for g in gaps)
    cpu_bound = sum(gap for gap, lag, _, _ in gaps if lag < gap_floor_us)  # NaN (launch unseen) compares False
    per = 1e3 * steps
    lines = [f"GPU timeline over {steps} steps: wall {wall_ms / steps:.1f} ms/step; device busy "
             f"{busy / per:.1f} ms/step, idle between its first and last kernel {idle / per:.1f} ms/step "
             f"({len(gaps) / steps:.0f} gaps/step), of which {cpu_bound / per:.1f} ms/step waiting for a launch "
             f"(the next kernel launched < {gap_floor_us:.0f} us before it began)",
             "largest gaps: us | launched us before start | after -> before"]
    for gap, lag, before, after in sorted(gaps, reverse=True)[:10]:
        lines.append(f"  {gap:9.1f} | {lag:9.1f} | {before[:50]} -> {after[:50]}")
    # every kernel, copy and memset by name (the profiler's tables stop at their first rows)
    total_us, calls = collections.Counter(), collections.Counter()
    for start, end, name, _ in device_work:
        total_us[name] += end - start
        calls[name] += 1
    kernels = [f"every GPU kernel over {steps} steps: ms/step | calls/step | us/call | name"]
    kernels += [f"  {us / per:8.3f} | {calls[name] / steps:7.1f} | {us / calls[name]:8.1f} | {name[:120]}"
                for name, us in total_us.most_common()]
    return {"wall_ms_per_step": wall_ms / steps, "busy_ms_per_step": busy / per, "idle_ms_per_step": idle / per,
            "launch_wait_ms_per_step": cpu_bound / per, "summary": "\n".join(lines), "kernels": "\n".join(kernels)}


def run_with_retry(args, mesh, device, name: str, impl: str, info: dict) -> dict:
    """run_case at --batch, then at each smaller batch of the ladder while it runs out of memory."""
    ladder = [args.batch] + [b for b in LADDER if b < args.batch]
    if args.no_oom_retry:
        ladder = ladder[:1]
    tried = []
    for batch in ladder:
        error = None
        try:
            row = run_case(args, mesh, device, name, impl, batch, info)
            if tried:
                row["oom_at"] = tried
            return row
        except Exception as e:  # noqa: BLE001 - one failing case must not end the run
            if args.verbose:
                traceback.print_exc()
            error, oom = one_line(e), is_oom(e)
        # outside the except block: the traceback (and the model it holds) is gone before memory is freed
        if impl in OURS:  # a variant that compiles keeps its graphs (and their memory) until reset
            torch._dynamo.reset()
        free_memory(device)
        if not oom:
            return {"case": name, "impl": impl, "batch": batch, "status": "FAIL", "error": error,
                    **({"oom_at": tried} if tried else {})}
        tried.append(batch)
        print(f"    out of memory at batch {batch}" + (" - retrying smaller" if batch != ladder[-1] else ""),
              flush=True)
    return {"case": name, "impl": impl, "batch": None, "status": "FAIL", "error": f"out of memory at {tried}",
            "oom_at": tried}


# ================================================================================================ CE micro-benchmark


def ce_bench(args, device) -> list[dict]:
    """Forward + backward of the output layer's loss, [tokens, dim] x [vocab, dim] in bf16: the op's compiled
    path (KernelConfig(compiled_loss=True), compile.components = ["loss"]; the first row, the yardstick of the
    others' gradients), our Triton kernel for the chunks' softmax (KernelConfig.triton_loss, the GPUs' default)
    at several settings, the eager chunks, and FLA's fused linear cross-entropy. Other settings of our kernel go
    in as the ``chunk_fn`` of hybridtitan.ops.cross_entropy.linear_cross_entropy."""
    from hybridtitan.ops import KernelConfig, Kernels, cross_entropy

    tiny = args.tiny
    tokens = args.ce_tokens or (512 if tiny else min(args.batch * args.seq, 65536))
    dim, vocab = (128, 8192) if tiny else (1024, 128256)
    gen = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(tokens, dim, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.05).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[torch.rand(tokens, generator=gen) < 0.05] = -100
    targets = targets.to(device)
    count = (targets != -100).sum().clamp(min=1)
    chunk = 256 if tiny else 4096

    def under(config: KernelConfig):
        kernels = Kernels(config)

        def fn(h, w):
            return kernels.linear_cross_entropy(h, w, targets, chunk_size=chunk)[0] / count
        return fn

    def fla_flce(h, w):
        from fla.modules import FusedLinearCrossEntropyLoss

        return FusedLinearCrossEntropyLoss(reduction="mean")(h, targets, w)

    def triton_chunks(block, warps, programs):
        from hybridtitan.ops import cross_entropy_triton

        def chunk_fn(logits, target, valid):
            return cross_entropy_triton.chunk_loss_and_grad(logits, target, valid, block, warps, programs)

        def fn(h, w):
            return cross_entropy.linear_cross_entropy(h, w, targets, chunk_size=chunk, chunk_fn=chunk_fn)[0] / count
        return fn

    # Triton kernel settings (block of columns, warps, programs: None = one per row, else that many looping)
    triton_configs = [(8192, 16, None), (4096, 8, None), (16384, 32, None), (8192, 16, 264), (8192, 32, 132),
                      (16384, 16, 528)]
    from hybridtitan.ops.cross_entropy_triton import BLOCK, NUM_WARPS

    def triton_label(b, w, p):
        if (b, w, p) == (BLOCK, NUM_WARPS, None):
            return f"hybridtitan, our Triton kernel, blocks {b}, {w} warps, a program per row (the recipes')"
        return f"candidate: Triton kernel, blocks {b}, {w} warps, " + (f"{p} programs" if p else "a program per row")

    impls = [("hybridtitan, chunks compiled (compile.components = [\"loss\"])",
              under(KernelConfig(compiled_loss=True))),
             *((triton_label(b, w, p), triton_chunks(b, w, p)) for b, w, p in triton_configs),
             ("hybridtitan ops.linear_cross_entropy, eager chunks (triton_loss off)",
              under(KernelConfig(triton_loss=False))),
             ("FLA FusedLinearCrossEntropyLoss", fla_flce)]
    rows, base = [], None
    flops = 6 * tokens * dim * vocab  # logits, grad of the hidden states, grad of the weight
    for label, fn in impls:
        row = {"impl": label, "tokens": tokens, "dim": dim, "vocab": vocab}
        if (label.startswith("FLA") or "Triton" in label) and device.type != "cuda":
            rows.append({**row, "status": "SKIP", "note": "Triton kernels need a GPU"})
            continue
        try:
            free_memory(device)

            def run(fn=fn):
                h = hidden.detach().clone().requires_grad_()
                w = weight.detach().clone().requires_grad_()
                loss = fn(h, w)
                loss.backward()
                return loss.detach(), h.grad, w.grad

            out = run()  # warm-up (autotuning)
            with Timer(device) as t:
                for _ in range(3):
                    out = run()
            ms = 1e3 * t.seconds / 3
            row.update(status="OK", ms=ms, tflops=flops / (ms / 1e3) / 1e12, loss=out[0].float().item())
            if device.type == "cuda":
                row["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if base is None:  # kept off the GPU, so that it is not in the later rows' peak memory
                base = tuple(t.cpu() for t in out)
            else:
                row.update(loss_rel_vs_first=abs(row["loss"] - base[0].item()) / abs(base[0].item()),
                           grad_hidden_err_vs_first=rel_err(out[1], base[1]),
                           grad_weight_err_vs_first=rel_err(out[2], base[2]))
            del out
        except Exception as e:  # noqa: BLE001
            row.update(status="FAIL", error=one_line(e))
        rows.append(row)
    return rows


CE_COLUMNS = ["cross-entropy impl", "tokens x dim -> vocab", "ms fwd+bwd", "TFLOP/s", "peak alloc GiB",
              "grad err vs first row (hidden / weight)", "status"]


def ce_table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        errs = "-"
        if "grad_hidden_err_vs_first" in r:
            errs = f"{r['grad_hidden_err_vs_first']:.1e} / {r['grad_weight_err_vs_first']:.1e}"
        status = r["status"] + (f": {r['error'][:80]}" if r.get("error") else "") + \
            (f" [{r['note']}]" if r.get("note") else "")
        out.append([r["impl"], f"{r['tokens']} x {r['dim']} -> {r['vocab']}", _num(r.get("ms")),
                    _num(r.get("tflops")), _num(r.get("peak_alloc_gib")), errs, status])
    return out


# ================================================================================================ report


def _pct(x):
    return f"{100 * x:.1f}%" if x is not None else "-"


def _num(x, fmt="{:.1f}"):
    return fmt.format(x) if x is not None else "-"


COLUMNS = ["case", "impl", "batch", "tok/s", "ms/step", "MFU vs matmul", "MFU vs 989T", "peak alloc GiB",
           "peak reserved GiB", "loss step 1", "status"]


def table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        status = r["status"]
        if r.get("oom_at"):
            status += f" (OOM at {','.join(map(str, r['oom_at']))})"
        if r.get("error"):
            status += f": {r['error'][:90]}"
        if r.get("note"):
            note = r["note"] if len(r["note"]) <= 40 else r["note"][:37] + "..."
            status += f" [{note}]"
        out.append([r["case"] + (f" ({r['flavor']})" if r.get("flavor") and r["flavor"] != r["case"] else ""),
                    r["impl"], r.get("batch"),
                    _num(r.get("tokens_per_s"), "{:,.0f}"), _num(r.get("step_ms")),
                    _pct(r.get("mfu_matmul")), _pct(r.get("mfu_datasheet")),
                    _num(r.get("peak_alloc_gib")), _num(r.get("peak_reserved_gib")),
                    _num(r.get("loss_first"), "{:.3f}"), status])
    return out


def variants_text(impls) -> str:
    """What each of our variants in ``impls`` runs, in the order given."""
    ours = list(dict.fromkeys(i for i in impls if i in OURS))
    return "; ".join(f"{i}: {OURS[i].what}" for i in ours)


def settings_text(args, info: dict, device) -> str:
    alloc = "CUDA allocator expandable_segments:True (set before the first CUDA allocation, both implementations)" \
        if info.get("expandable_segments") else "default allocator (CPU)"
    variants = variants_text([*args.impls, *(impl for _, impl in args.extra)])
    return (f"{info.get('gpu') or info.get('cpu')}; torch {info['torch']} (CUDA {info['cuda']}), triton "
            f"{info['triton']}, fla {info['fla']}, transformers {info['transformers']}.\n"
            f"One process (world size 1, {'NCCL' if device.type == 'cuda' else 'gloo'}), FSDP2 fully_shard per "
            f"block + root, {'bf16' if device.type == 'cuda' else 'float32'} params / float32 reduce, "
            f"AdamW(fused=True), seq {args.seq}, warm-up {args.warmup} + {args.steps} timed steps, activation "
            f"checkpointing {args.ac}; the recipes' kernels: the RMSNorms with the residual adds fused into them "
            f"and the MLPs' SwiGLU passes compiled, each cross-entropy chunk's softmax and the short convolutions "
            f"in our Triton kernels, the rest FLA's{'; ' + variants if variants else ''}; FLA eager; one shard, so "
            f"no reshard after the forward pass (both); {alloc}.\n"
            f"Measured bf16 matmul ({args.matmul_size}^3): {info['matmul_flops'] / 1e12:.4g} TFLOP/s; MFU from "
            f"hybridtitan.models.flops (same count for FLA's model of the same configuration). fla-ce: FLA's "
            f"fused cross-entropy over the full logits; fla-flce: its fused linear cross-entropy; ours: the "
            f"chunked linear cross-entropy.")


def write_markdown(path: str, args, info: dict, device, rows: list[dict], command: str,
                   ce_rows: list[dict] | None = None) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    text = [f"\n## Throughput, {info['date']}, {info.get('gpu') or 'CPU dry run'}\n",
            f"    {command}\n", settings_text(args, info, device) + "\n",
            format_table(COLUMNS, table_rows(rows)) + "\n"]
    if ce_rows:
        text.append("Output-layer cross-entropy alone (forward + backward, bf16; TFLOP/s over 6 x tokens x dim x "
                    "vocab):\n\n" + format_table(CE_COLUMNS, ce_table_rows(ce_rows)) + "\n")
    failed = [r for r in rows if r["status"] == "FAIL"]
    if failed:
        text.append("Failures:\n" + "\n".join(f"- {r['case']} / {r['impl']}: {r.get('error')}" for r in failed) + "\n")
    with open(path, "a") as f:
        f.write("\n".join(text))


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0])] + (sys.argv[1:] if argv is None else argv))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no GPU is visible", file=sys.stderr)
        return 2
    expandable = set_expandable_segments(device)  # before any CUDA allocation
    tuned = use_kernel_configs(args.kernel_configs, device)  # before FLA is imported (both implementations)
    mesh = init_process_group_of_one(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    info = versions(device)  # (imports FLA: the configurations are chosen first)
    info["expandable_segments"] = expandable
    info["kernel_configs"] = tuned.message
    print(f"bench_throughput: {settings_text(args, {**info, 'matmul_flops': float('nan')}, device).splitlines()[0]}",
          flush=True)
    if expandable:
        print("allocator: expandable_segments:True for both implementations (as hybridtitan's trainer)", flush=True)
    info["matmul_flops"] = matmul_rate(device, args.matmul_size)
    print(f"bf16 matmul {args.matmul_size}^3: {info['matmul_flops'] / 1e12:.4g} TFLOP/s "
          f"(datasheet {DATASHEET_FLOPS / 1e12:.0f})", flush=True)

    plan = []
    for name in args.models:
        for impl in args.impls:
            if impl not in OURS and name not in args.fla_models:
                continue
            plan.append((name, impl))
    plan += [c for c in args.extra if c not in plan]
    for name in args.fla_models - set(args.models):
        print(f"note: --fla-models {name} is not in --models: not run", flush=True)

    rows: list[dict] = []
    ce_rows: list[dict] = []
    t0 = time.perf_counter()

    def save():
        if args.json:
            write_json(args.json, {"versions": info, "command": command, "settings": vars(args) | {
                "fla_models": sorted(args.fla_models)}, "results": rows, "cross_entropy": ce_rows})

    if not args.no_ce_bench:
        try:
            ce_rows = ce_bench(args, device)
            free_memory(device)
        except Exception as e:  # noqa: BLE001
            ce_rows = [{"impl": "(cross-entropy micro-benchmark)", "tokens": "-", "dim": "-", "vocab": "-",
                        "status": "FAIL", "error": one_line(e)}]
        print("\n" + format_table(CE_COLUMNS, ce_table_rows(ce_rows)) + "\n", flush=True)
        save()

    for n, (name, impl) in enumerate(plan):
        elapsed = time.perf_counter() - t0
        if args.time_budget is not None and elapsed > args.time_budget:
            rows.append({"case": name, "impl": impl, "batch": None, "status": "SKIP",
                         "note": f"time budget of {args.time_budget:.0f} s spent", "error": "not run: time budget"})
            print(f"[{elapsed:6.1f}s] skip {name} / {impl}: time budget spent", flush=True)
            save()
            continue
        print(f"[{elapsed:6.1f}s] {n + 1}/{len(plan)} {name} / {impl}, batch {args.batch}", flush=True)
        if impl not in OURS:
            try:
                if not is_pure_fla_model(model_args_for(name, args.tiny)):
                    raise ValueError("not a pure GDN/KDA model: FLA's HF classes cannot hold it")
            except Exception as e:  # noqa: BLE001
                rows.append({"case": name, "impl": impl, "batch": None, "status": "FAIL", "error": one_line(e)})
                save()
                continue
        row = run_with_retry(args, mesh, device, name, impl, info)
        rows.append(row)
        free_memory(device)
        print("    " + " | ".join(str(c) for c in table_rows([row])[0][2:]), flush=True)
        save()

    print(f"\n{settings_text(args, info, device)}\n")
    print(format_table(COLUMNS, table_rows(rows)))
    if ce_rows:
        print("\n" + format_table(CE_COLUMNS, ce_table_rows(ce_rows)))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.markdown:
        write_markdown(args.markdown, args, info, device, rows, command, ce_rows)
        print(f"appended to {args.markdown}")
    save()
    if args.json:
        print(f"wrote {args.json}")
    record_kernel_configs(args.record_kernel_configs, device, "bench_throughput")
    with contextlib.suppress(Exception):
        from common import destroy_process_group

        destroy_process_group()
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

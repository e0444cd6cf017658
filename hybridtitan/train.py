"""The training entry point and loop.

    torchrun --nproc_per_node N -m hybridtitan.train --job.config_file train_configs/X.toml [--section.key value]
    python -m hybridtitan.train --job.config_file ...          (one process)

Everything a run needs is checked before anything is written: a bad recipe, override, data path or tokenizer
is one line on stderr and exit code 2, and no checkpoint is touched. On SIGTERM or Ctrl-C the loop finishes
its step (or the next: the ranks learn of a stop one step late), saves a checkpoint and stops, so a preempted
job resumes where it was. torchtitan's Trainer assumes a GPU; this loop runs on a CPU (gloo, float32) and on
GPUs (NCCL/RCCL, bf16 parameters, fp32 reductions).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from hybridtitan import ops
from hybridtitan.checkpoint import (
    CheckpointError,
    CheckpointManager,
    complete_steps,
    is_model_only,
    load_model_args,
    read_job_config,
    resolve_checkpoint,
)
from hybridtitan.config import (
    TRAIN_USAGE,
    ConfigError,
    compiles,
    model_args,
    parse_config,
    selective_ac_interval,
    to_dict,
)
from hybridtitan.data import build_dataloader, build_tokenizer
from hybridtitan.data.config import recorded_path
from hybridtitan.errors import DataError, first_error_line
from hybridtitan.metrics import MetricsLogger
from hybridtitan.models import build_model
from hybridtitan.models.flops import flops_per_token, param_counts
from hybridtitan.optim import (
    SCHEDULE_KEYS,
    apply_schedule,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    reshape_schedule,
    schedule_shape,
)
from hybridtitan.parallel import build_mesh, parallelize, resolve_data_parallel

logger = logging.getLogger("hybridtitan")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout, force=True)


class TrainState(Stateful):
    def __init__(self):
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tokens_seen, self.skipped_steps = sd["step"], sd["tokens_seen"], sd["skipped_steps"]


@dataclasses.dataclass
class Plan:
    """What the checks before any side effect worked out."""

    device: torch.device
    world_size: int
    dp: Any
    grad_accum: int
    tokenizer: Any
    model_args: Any
    dataloader: Any
    seed: int


def preflight(cfg) -> Plan:
    """Every check that can fail on the user's input, before a process group, a folder or a file is made."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        dp = resolve_data_parallel(cfg.parallelism.data_parallel_replicate_degree,
                                   cfg.parallelism.data_parallel_shard_degree, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = cfg.training
    per_step = t.local_batch_size * dp.size
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise ConfigError(f"training.global_batch_size ({global_batch}) is not divisible by local_batch_size x "
                          f"data-parallel size ({t.local_batch_size} x {dp.size} = {per_step})")
    args = model_args(cfg)
    tokenizer = None
    if cfg.data.source != "mock":
        try:
            tokenizer = build_tokenizer(cfg.data.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    seed = 42 if cfg.debug.seed is None else cfg.debug.seed
    try:  # only data parallelism: the data-parallel rank is the global rank
        dataloader = build_dataloader(
            cfg.data, tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            dp_rank=int(os.environ.get("RANK", "0")), dp_world_size=dp.size, seed=seed, vocab_size=args.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_checkpoints(cfg, args)
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return Plan(device, world_size, dp, global_batch // per_step, tokenizer, args, dataloader, seed)


def _check_checkpoints(cfg, args) -> None:
    """The checkpoint a run would start from exists, holds this model and fits this run's data loader; a rewind
    would not be undone later."""
    folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
    steps = complete_steps(folder)
    if (cfg.checkpoint.enable and not steps and not cfg.checkpoint.initial_load_path
            and os.path.isfile(os.path.join(folder, ".metadata"))):
        # e.g. python -m hybridtitan.import_hf --output DUMP/checkpoint: training from scratch beside it would
        # look like a resume that silently lost its weights
        raise ConfigError(f"{folder} holds a checkpoint itself, not in a step-N folder: move it to "
                          f"{os.path.join(folder, 'step-0')} to start from its weights (or name it in "
                          "checkpoint.initial_load_path)")
    start, model_only = None, False
    if cfg.checkpoint.enable and cfg.checkpoint.load_step > 0:
        try:
            start = resolve_checkpoint(folder, cfg.checkpoint.load_step)
        except ValueError as e:
            raise ConfigError(f"checkpoint.load_step: {e}") from None
        newer = [s for s in steps if s > cfg.checkpoint.load_step]
        if newer:
            raise ConfigError(f"checkpoint.load_step {cfg.checkpoint.load_step} is older than step(s) "
                              f"{', '.join(map(str, newer))} in {folder}: move those folders away first (the next "
                              "resume would return to them, and keep_latest_k would delete the new ones)")
    elif cfg.checkpoint.enable and steps:
        start, model_only = os.path.join(folder, f"step-{steps[-1]}"), steps[-1] == 0
        # step 0 is a model-only starting point on purpose (import_hf); a later model-only step ends a run: taking
        # it as the resume point would restart at step 0 below the older full checkpoints, and keep_latest_k would
        # then delete the new ones
        if steps[-1] > 0 and is_model_only(start):
            raise ConfigError(f"{start} holds only the model (written by import_hf, or by "
                              "checkpoint.last_save_model_only): a run cannot go on from it, only start from it as "
                              "step-0. To train on from its weights, give it as checkpoint.initial_load_path with "
                              "another job.dump_folder")
    elif cfg.checkpoint.initial_load_path:
        try:
            start = resolve_checkpoint(cfg.checkpoint.initial_load_path)
        except ValueError as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from None
        model_only = cfg.checkpoint.initial_load_model_only
    if cfg.checkpoint.enable and steps and steps[-1] > 0 and "train_state" in cfg.checkpoint.exclude_from_loading:
        raise ConfigError(f"checkpoint.exclude_from_loading: train_state restarts the step count at 0 in {folder}, "
                          f"which holds step {steps[-1]}: the new checkpoints would sit below it (the next resume "
                          "would return to it, and keep_latest_k would delete them). To train on from its weights, "
                          "give it as checkpoint.initial_load_path with another job.dump_folder")
    if start is not None:
        try:
            saved = load_model_args(start)
        except CheckpointError as e:  # load_model_args turns every read or parse failure into one
            raise ConfigError(f"{start} is not a hybridtitan checkpoint: {first_error_line(e)}") from None
        if saved != args:
            diff = [f.name for f in dataclasses.fields(args) if getattr(saved, f.name) != getattr(args, f.name)]
            raise ConfigError(f"{start} holds a different model than the recipe (differs in: model."
                              f"{', model.'.join(diff)}); use another job.dump_folder or the checkpoint's model")
        if not model_only and "dataloader" not in cfg.checkpoint.exclude_from_loading and not is_model_only(start):
            _check_the_loaders_workers(cfg, start)


def _changed_settings(cfg, step_dir: str, keys: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """The job-config keys ("section.name") whose value in the step folder's job config differs from this run's, as
    (key, the checkpoint's, this run's); none where it has no job config to compare with (written by other tools)."""
    try:
        saved = read_job_config(step_dir)
        was = {key: saved[key.split(".")[0]][key.split(".")[1]] for key in keys}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    now = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in keys}
    return [(key, was[key], now[key]) for key in keys if was[key] != now[key]]


def _check_the_loaders_workers(cfg, start: str) -> None:
    """A loader's state holds one position per worker: it loads only into the same data.num_workers. Said before
    loading, since DCP and the loader refuse others in ways that name neither (a bare assertion, for one)."""
    for _, saved, now in _changed_settings(cfg, start, ("data.num_workers",)):
        raise ConfigError(f"cannot resume from {start}: {_OTHER_WORKERS}: the checkpoint's data.num_workers is "
                          f"{saved}, this run's {now}")


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _init_distributed(plan: Plan, cfg) -> None:
    backend = "nccl" if plan.device.type == "cuda" else "gloo"  # NCCL is RCCL on ROCm builds
    kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)}
    if "RANK" not in os.environ:
        # one process without torchrun: a group of one, so the sharded (FSDP) code path is the same
        store = tempfile.NamedTemporaryFile(prefix="hybridtitan-pg-", delete=False).name
        atexit.register(_remove_quietly, store)  # the store is needed while the group lives, not after
        kwargs.update(init_method=f"file://{store}", rank=0, world_size=1)
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    dist.init_process_group(**kwargs)


class _StopRequest:
    """SIGTERM / SIGINT: finish the step (the ranks agree on it a step later, _StepReports), save, exit."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        logger.warning(f"signal {signum}: saving a checkpoint after this step or the next, then stopping")


def _set_allocator(cfg, device: torch.device) -> None:
    if device.type == "cuda" and cfg.training.expandable_segments:
        # from the recipe, before the first allocation; fragmentation otherwise costs the larger batches
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def build_parallel_model(args, mesh, device: torch.device, *, ac_mode: str = "none", ac_every: int = 1,
                         compile_model: bool = False, param_dtype: torch.dtype = torch.float32,
                         reshard_after_forward: str = "default"):
    """The training model: initialised whole from the seed, then wrapped (AC -> compile -> FSDP2).

    Initialising before sharding makes the initial weights independent of the number of ranks (random ops on
    sharded CPU tensors would repeat the same numbers in every shard). The benchmark builds its models here too.
    """
    model = build_model(args, "meta")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    parallelize(model, mesh, ac_mode=ac_mode, ac_every=ac_every, compile_model=compile_model,
                param_dtype=param_dtype, reduce_dtype=torch.float32, reshard_after_forward=reshard_after_forward)
    return model.train()


def train(cfg, plan: Plan) -> dict:
    device = plan.device
    _set_allocator(cfg, device)
    _init_distributed(plan, cfg)
    rank = dist.get_rank()
    _setup_logging(rank)
    dp = plan.dp
    dp_rank = rank  # the data-parallel rank: only data parallelism, so it is the global rank
    torch.manual_seed(plan.seed)
    if cfg.debug.deterministic:
        torch.use_deterministic_algorithms(True)

    args = plan.model_args
    counts = param_counts(args)
    fpt = flops_per_token(args, cfg.training.seq_len)["total"]
    logger.info(f"model {cfg.model.flavor}: pattern {args.pattern} ({args.mixer}), {counts['total']:,} parameters "
                f"({counts['non_embedding']:,} non-embedding), {fpt / 1e9:.3f} GFLOP/token (training)")
    logger.info(f"{plan.world_size} rank(s) on {device.type}: data parallel replicate {dp.replicate} x shard "
                f"{dp.shard}, local batch {cfg.training.local_batch_size} x seq {cfg.training.seq_len}, "
                f"gradient accumulation {plan.grad_accum}")

    mesh = build_mesh(dp, device.type)
    on_gpu = device.type == "cuda"
    param_dtype = getattr(torch, cfg.training.mixed_precision_param) if on_gpu else torch.float32
    if not on_gpu and cfg.training.mixed_precision_param != "float32":
        logger.info("CPU: parameters and activations in float32 (training.mixed_precision_param applies to GPUs)")
    if on_gpu and args.mixer == "mamba2":
        from hybridtitan.ops.fla_backend import MIN_TRAINED_HEAD_DIM

        if min(args.mamba2.d_state, args.mamba2.head_dim) < MIN_TRAINED_HEAD_DIM:
            # handled (and checked on an H200), but the padding costs compute worth knowing about
            logger.info("Mamba2 with d_state %d, head_dim %d: FLA's simple-GLA backward faulted or was wrong "
                        "below %d on an H200, so smaller dims are padded to it in training "
                        "(hybridtitan.ops.fla_backend; docs/benchmarks.md)",
                        args.mamba2.d_state, args.mamba2.head_dim, MIN_TRAINED_HEAD_DIM)
    model = build_parallel_model(args, mesh, device, ac_mode=cfg.activation_checkpoint.mode,
                                 ac_every=selective_ac_interval(cfg),
                                 compile_model=compiles(cfg, "model"),
                                 param_dtype=param_dtype,
                                 reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward)
    # the elementwise part of each cross-entropy chunk through torch.compile; otherwise our Triton kernel on GPUs
    ops.compile_loss(compiles(cfg, "loss"))
    ops.compile_norms(compiles(cfg, "norm"))  # RMSNorm and the residual add before it
    ops.compile_swiglu(compiles(cfg, "swiglu"))  # the MLPs' silu(gate) * up, forward and backward
    ops.use_cuda_graphs(cfg.training.cuda_graphs)
    if cfg.training.cuda_graphs and cfg.data.document_boundaries:
        logger.warning("training.cuda_graphs: with packed documents (data.document_boundaries) the mixers run "
                       "eagerly; only whole sequences are replayed from CUDA graphs")

    optimizer = build_optimizer(model, cfg)
    lr_scheduler = build_lr_scheduler(optimizer, cfg)
    dataloader = plan.dataloader
    state = TrainState()
    job_dict = to_dict(cfg)
    job_dict["data"]["tokenizer"] = recorded_path(cfg.data.tokenizer)  # export/eval may run from elsewhere
    ckpt = CheckpointManager(
        os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder), model=model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, dataloader=dataloader, train_state=state, dp_rank=dp_rank,
        dp_world_size=dp.size, model_args=args, job_config=job_dict, interval=cfg.checkpoint.interval,
        keep_latest_k=cfg.checkpoint.keep_latest_k,
        async_mode=cfg.checkpoint.async_mode, enable=cfg.checkpoint.enable,
        first_step=cfg.checkpoint.enable_first_step_checkpoint,
        exclude_from_loading=tuple(cfg.checkpoint.exclude_from_loading))
    try:
        _resume(cfg, ckpt, state)
        data_iter = iter(dataloader)  # where the loader applies its resumed state (and refuses one of other data)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- e.g. a checkpoint of other data or workers
        logger.debug("resume failed", exc_info=True)
        if rank == 0:
            message = first_error_line(e)
            if "dataloader." in message:  # DCP naming a loader key it lacks: another data.num_workers
                message = f"{_OTHER_WORKERS} [{message}]"
            print(f"error: cannot resume from the checkpoint: {message}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)

    if rank == 0:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        with open(os.path.join(cfg.job.dump_folder, "job_config.json"), "w") as f:
            json.dump(job_dict, f, indent=2, default=str)
        if cfg.job.print_config:
            logger.info("config:\n" + json.dumps(job_dict, indent=2, default=str))
    metrics = MetricsLogger(
        cfg.job.dump_folder, rank=rank, total_steps=cfg.training.steps, flops_per_token=fpt, device=device,
        enable_tensorboard=cfg.metrics.enable_tensorboard, tb_folder=cfg.metrics.save_tb_folder,
        enable_wandb=cfg.metrics.enable_wandb, job_config=job_dict, start_step=state.step)
    stop = _StopRequest()
    last, finished, data_error = {}, False, None
    try:
        last = _loop(cfg, plan, model, optimizer, lr_scheduler, data_iter, state, ckpt, metrics, stop, device)
        finished = True
    except DataError as e:  # bad data is bad input: one line (from each rank that met it), not a traceback
        data_error = first_error_line(e)
    finally:
        ckpt.close()
        metrics.close()
        if finished:  # after an error on this rank the others may never reach it: exit now, torchrun stops them
            dist.barrier()
        dist.destroy_process_group()
    if data_error is not None:
        print(f"error: {data_error}", file=sys.stderr)
        sys.exit(2)
    return last


_OTHER_WORKERS = ("its data loader state does not fit this run's loader: it needs the data.num_workers of the run "
                  "that saved it (checkpoint.exclude_from_loading = [\"dataloader\"] starts the data afresh)")


def _resume(cfg, ckpt: CheckpointManager, state: TrainState) -> None:
    latest = ckpt.latest_step() if cfg.checkpoint.enable else None
    step_dir, model_only = None, False
    if cfg.checkpoint.enable and cfg.checkpoint.load_step > 0:
        step_dir = resolve_checkpoint(ckpt.folder, cfg.checkpoint.load_step)
        said = f"resumed from {step_dir}"
    elif latest is not None:
        # a step-0 folder is a model-only starting point (python -m hybridtitan.import_hf writes one)
        step_dir, model_only = os.path.join(ckpt.folder, f"step-{latest}"), latest == 0
        said = f"resumed from {ckpt.folder}/step-{latest}"
        if cfg.checkpoint.initial_load_path:
            logger.warning(f"checkpoint.initial_load_path {cfg.checkpoint.initial_load_path} is ignored: the run's "
                           f"own checkpoint folder holds step {latest}, and a run resumes from its own first")
    elif cfg.checkpoint.initial_load_path:
        step_dir = resolve_checkpoint(cfg.checkpoint.initial_load_path)
        model_only = cfg.checkpoint.initial_load_model_only
        said = f"initialised from {step_dir}" + (" (model only)" if model_only else "")
    if step_dir is None:
        return _warn_about_resumed_values(cfg, ckpt, state)
    ckpt.load(step_dir, model_only=model_only)
    logger.info(said + ("" if model_only else f" (step {state.step})"))
    if state.step > 0 and "lr_scheduler" not in cfg.checkpoint.exclude_from_loading:
        _keep_the_checkpoints_schedule(cfg, ckpt, step_dir)
    apply_schedule(ckpt.lr_scheduler)  # the rates of the schedule in force, whichever parts were loaded
    if state.step > 0 and "dataloader" not in cfg.checkpoint.exclude_from_loading:
        _warn_about_the_kept_data_order(cfg, step_dir)
    _warn_about_resumed_values(cfg, ckpt, state)


def _warn_about_the_kept_data_order(cfg, step_dir: str) -> None:
    """The resumed data loader goes on in the checkpoint's order: a changed data.shuffle or debug.seed would have
    no effect on it, which is said rather than left silent."""
    changed = [f"{key} {now} (checkpoint: {was})"
               for key, was, now in _changed_settings(cfg, step_dir, ("data.shuffle", "debug.seed"))]
    if changed:
        logger.warning(f"{', '.join(changed)}: the resumed data loader goes on in the checkpoint's order; to start "
                       "the data anew in the new order, add dataloader to checkpoint.exclude_from_loading")


_NEW_SCHEDULE = '(checkpoint.exclude_from_loading = ["lr_scheduler"] starts a new one)'


def _keep_the_checkpoints_schedule(cfg, ckpt: CheckpointManager, step_dir: str) -> None:
    """A resumed schedule goes on as it was saved: its step and rates come from the checkpoint, and so does its
    shape (warm-up, length, decay), which follows the recipe's values. Changed values (a longer run whose schedule
    follows training.steps, say) would otherwise bend it mid-way: the rate could jump back up tenfold. The shape in
    force is recorded in the job config of the checkpoints that follow."""
    try:
        saved = read_job_config(step_dir)
        saved_shape = schedule_shape(saved["lr_scheduler"], saved["training"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # a checkpoint without its job config (written by other tools): nothing to compare with
    shape = schedule_shape(ckpt.job_config["lr_scheduler"], cfg.training.steps)
    if saved_shape == shape:
        return
    changed = ", ".join(f"{key} {shape[key]} (checkpoint: {saved_shape[key]})"
                        for key in SCHEDULE_KEYS if shape[key] != saved_shape[key])
    logger.warning(f"lr_scheduler: {changed}: the checkpoint's schedule goes on, held past its end {_NEW_SCHEDULE}")
    kept = dataclasses.replace(cfg.lr_scheduler, **saved_shape)
    reshape_schedule(ckpt.lr_scheduler, kept)
    cfg.lr_scheduler = kept
    ckpt.job_config["lr_scheduler"].update(saved_shape)


def _warn_about_resumed_values(cfg, ckpt: CheckpointManager, state: TrainState) -> None:
    """What a resume takes from the checkpoint over the recipe, said where the two differ."""
    if state.step >= cfg.training.steps:
        logger.warning(f"the checkpoint is at step {state.step} and training.steps is {cfg.training.steps}: nothing "
                       "to train (raise training.steps to go on)")
    saved = [lr for s in ckpt.lr_scheduler.schedulers for lr in s.base_lrs]
    if state.step > 0 and any(not math.isclose(lr, cfg.optimizer.lr) for lr in saved):
        logger.warning(f"optimizer.lr {cfg.optimizer.lr} differs from the resumed schedule's {saved[0]}: the "
                       f"checkpoint's schedule goes on {_NEW_SCHEDULE}")


def _profiler(cfg):
    p = cfg.profiling
    if not p.enable_profiling:
        return contextlib.nullcontext(None)
    folder = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
    rank = dist.get_rank()

    def on_trace(prof):
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_step{prof.step_num}.json"))
        if rank == 0:
            logger.info("profile: " + prof.key_averages().table(sort_by="self_device_time_total"
                                                                if torch.cuda.is_available()
                                                                else "self_cpu_time_total", row_limit=25))

    wait = max(p.profile_freq - p.profiler_active - p.profiler_warmup, 0)
    return torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=wait, warmup=p.profiler_warmup, active=p.profiler_active),
        on_trace_ready=on_trace, record_shapes=True)


MAX_CONSECUTIVE_SKIPS = 10


class _StepReports:
    """What the host learns about each step, one step late: its gradient norm and whether a stop was asked for on
    any rank. A value read at once (``.item()``, ``bool()``) makes the host wait until the GPU has run everything
    queued; the GPU then idles while the host prepares the next step (data, optimizer, launches). Two such reads
    per step held the trainer 6-12% below the benchmark's tokens/s for the 300M recipes on an H200
    (docs/benchmarks.md). Here the two numbers travel in one small non-blocking copy, read after the next step
    is queued, when the copy is long done; the ranks' stop flags are all-reduced in the same stream, so every
    rank reads the same flag for the same step."""

    def __init__(self, device: torch.device):
        self.pending: tuple[int, torch.Tensor, Any] | None = None
        # filled in place: a new tensor from a Python value would be a blocking host-to-device copy
        self.flag = torch.zeros(1, device=device)
        self.host = torch.empty(2, pin_memory=True) if device.type == "cuda" else None

    def push(self, step: int, grad_norm: torch.Tensor, stop_requested: bool) -> None:
        """Called after the previous report was popped (its host buffer is reused)."""
        self.flag.fill_(float(stop_requested))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        values = torch.cat([grad_norm.detach().float().reshape(1), self.flag])
        event = None
        if self.host is not None:
            self.host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = self.host
        self.pending = (step, values, event)

    def pop(self) -> tuple[int, float, bool] | None:
        """(step, gradient norm, stop asked) of the last pushed step (waiting for its copy if needed), or None."""
        if self.pending is None:
            return None
        step, values, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        grad_norm, stop = values.tolist()
        return step, grad_norm, stop > 0


def _optimizer_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """The update, unless the gradient norm is not finite; returns whether it was applied (a 0-dim bool tensor).

    The fused AdamW kernels skip the update themselves when given a ``found_inf`` flag (as under a gradient
    scaler: parameters, moments and step count stay as they were), so the host never waits for the norm. Other
    implementations need the decision on the host."""
    finite = torch.isfinite(grad_norm)
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).to(torch.float32)
        optimizer.step()
    elif finite:
        optimizer.step()
    return finite


def _loop(cfg, plan, model, optimizer, lr_scheduler, data_iter, state, ckpt, metrics, stop, device) -> dict:
    t = cfg.training
    tokens_per_step_local = t.local_batch_size * t.seq_len * plan.grad_accum
    gc.disable()
    gc.collect()
    window_start, loss_sum, counted = time.perf_counter(), None, None
    consecutive_skips, stopping = 0, False
    start_step = state.step
    reports = _StepReports(device)
    last: dict = {}

    def account(report) -> None:
        """The host's bookkeeping of a finished step: skipped updates and stop requests."""
        nonlocal consecutive_skips, stopping
        if report is None:
            return
        step, grad_norm, stop_asked = report
        stopping = stopping or stop_asked
        if math.isfinite(grad_norm):
            consecutive_skips = 0
            return
        state.skipped_steps += 1
        consecutive_skips += 1
        logger.warning(f"step {step}: non-finite gradient norm {grad_norm}, update skipped")
        if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise FloatingPointError(f"{consecutive_skips} consecutive steps had non-finite gradients; "
                                     f"stopping at step {step} (the last checkpoint is intact)")

    with _profiler(cfg) as prof:
        while state.step < t.steps:
            state.step += 1
            loss_acc = torch.zeros((), device=device)
            for _ in range(plan.grad_accum):
                batch = next(data_iter)
                input_ids = batch["input_ids"].to(device, non_blocking=True)
                labels = batch["labels"].to(device, non_blocking=True)
                cu = batch.get("cu_seqlens")
                cu = cu.to(device, non_blocking=True) if cu is not None else None
                loss = model(input_ids, labels=labels, cu_seqlens=cu, loss_chunk_size=t.loss_chunk_size)
                loss = loss / plan.grad_accum
                loss.backward()
                loss_acc += loss.detach()
            grad_norm = clip_grad_norm_(model.parameters(), t.max_norm)
            # the gradient norm is already reduced over all ranks, so every rank makes the same choice
            applied = _optimizer_step(optimizer, grad_norm)
            # the mean loss of a log window counts the applied steps only
            loss_acc = torch.where(applied, loss_acc, torch.zeros_like(loss_acc))
            loss_sum = loss_acc if loss_sum is None else loss_sum + loss_acc
            counted = applied.float() if counted is None else counted + applied.float()
            lr = optimizer.param_groups[0]["lr"]
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.tokens_seen += tokens_per_step_local * plan.dp.size
            if prof is not None:
                prof.step()
            # the previous step's report (read only now: this step is queued), then this step's
            account(reports.pop())
            reports.push(state.step, grad_norm, stop.requested)

            # the first step is always reported: it shows the initial loss and the start-up cost
            log_now = state.step % cfg.metrics.log_freq == 0 or state.step in (1, t.steps, start_step + 1)
            save_now = ckpt.should_save(state.step, last=state.step == t.steps)
            if log_now or save_now or stopping:
                # the counters and the stop flag must include this step before they are logged or saved
                account(reports.pop())
            if (log_now or stopping) and counted is not None and counted.item() > 0:
                mean_loss = loss_sum / counted
                dist.all_reduce(mean_loss)  # a sum (gloo has no average)
                mean_loss /= dist.get_world_size()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the window's wall time includes its GPU work
                steps_done = state.step - (last.get("step", start_step))
                last = metrics.log(state.step, loss=mean_loss.item(), grad_norm=grad_norm.item(), lr=lr,
                                   tokens_per_step=tokens_per_step_local, window_steps=steps_done,
                                   window_time=time.perf_counter() - window_start, tokens_seen=state.tokens_seen,
                                   skipped_steps=state.skipped_steps)
                window_start, loss_sum, counted = time.perf_counter(), None, None
            if state.step % t.gc_freq == 0:
                gc.collect()
            if save_now or stopping:
                ckpt.save(state.step, model_only=state.step == t.steps and cfg.checkpoint.last_save_model_only)
            if stopping:
                logger.warning(f"stopped at step {state.step} on request")
                break
    return last


def _quiet_known_warnings() -> None:
    """Warnings of dependencies that say nothing about this run."""
    for message in ("DTensor random operators may not have complete support",  # no random op on DTensors here
                    "'set_vital' is deprecated",  # torchdata 0.11 on torch >= 2.12
                    "Triton is not supported on current platform"):  # FLA imported on a CPU machine
        warnings.filterwarnings("ignore", message=message)


def main(argv: list[str] | None = None) -> None:
    _quiet_known_warnings()
    rank = int(os.environ.get("RANK", "0"))
    if not (sys.argv[1:] if argv is None else argv):  # nothing given: the defaults alone name no data
        if rank == 0:
            print(TRAIN_USAGE + "\nerror: give a recipe (train_configs/*.toml); --help lists the keys",
                  file=sys.stderr)
        sys.exit(2)
    try:
        cfg = parse_config(argv)
        plan = preflight(cfg)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    train(cfg, plan)


if __name__ == "__main__":
    main()

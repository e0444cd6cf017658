"""The training entry point and loop.

    torchrun --nproc_per_node N -m hybridtitan.train --job.config_file train_configs/X.toml [--section.key value]
    python -m hybridtitan.train --job.config_file ...          (one process)

    cfg = parse_config(argv)         one line on stderr, exit code 2, on any bad input; nothing written yet
    plan = preflight(cfg)            data, tokenizer, model arguments, the start checkpoint chosen once
    trainer = Trainer(cfg, plan)     process group -> model -> parallelize -> optimizer -> data -> checkpoint
    trainer.train()                  for step: train_step -> maybe_log -> maybe_save -> should_stop

On SIGTERM or Ctrl-C the loop finishes its step (or the next: the ranks learn of a stop one step late), saves a
checkpoint and stops, so a preempted job resumes where it was. torchtitan's Trainer assumes a GPU; this loop runs
on a CPU (gloo, float32) and on GPUs (NCCL/RCCL, bf16 parameters, fp32 reductions).
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

from hybridtitan import ops, run_record
from hybridtitan.checkpoint import CheckpointManager
from hybridtitan.cli import fail, one_line_errors
from hybridtitan.config_manager import TRAIN_USAGE, compiles, parse_config, selective_ac_interval, to_dict
from hybridtitan.data.config import recorded_path
from hybridtitan.data.loader import IGNORE_INDEX
from hybridtitan.distill import Distiller, training_flops_per_token
from hybridtitan.dpo import VALIDATION_PARTS, PreferenceOptimizer, dpo_flops_per_token
from hybridtitan.errors import DataError, ResumeError, first_error_line
from hybridtitan.float8 import Float8Conversion, apply_float8, precompute_float8_scales
from hybridtitan.job_config import JobConfig
from hybridtitan.lr_schedule import LRSchedule
from hybridtitan.metrics import MetricsLogger
from hybridtitan.models import build_model
from hybridtitan.models.flops import param_counts
from hybridtitan.ops import kernel_configs
from hybridtitan.ops.context_parallel import context_parallel_group, shard_batch
from hybridtitan.optim import build_optimizer, clip_grad_norm_
from hybridtitan.parallel import build_mesh, parallelize
from hybridtitan.preflight import Plan, preflight
from hybridtitan.resume import resume

logger = logging.getLogger("hybridtitan")

MAX_CONSECUTIVE_SKIPS = 10


class TrainState(Stateful):
    """The loop's own counters, saved in every checkpoint."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tokens_seen, self.skipped_steps = sd["step"], sd["tokens_seen"], sd["skipped_steps"]


@dataclasses.dataclass
class StepResult:
    """One optimizer step, as device tensors (reading them would make the host wait for the GPU)."""

    loss: torch.Tensor  # the mean loss of the step's tokens on this rank
    grad_norm: torch.Tensor  # over all ranks, before clipping
    applied: torch.Tensor  # bool: the update was made (the gradient norm was finite)
    lr: float
    loss_tokens: torch.Tensor  # the tokens the loss counted, over the global batch
    parts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # distillation's terms, as loss


def kernel_config(cfg: JobConfig, device: torch.device) -> ops.KernelConfig:
    """The recipe's kernel choices (compile.components, training.cuda_graphs) for this device."""
    return ops.KernelConfig(
        fused_residual=device.type == "cuda",  # the same sums; on CPUs there is no kernel to save
        compiled_norms=compiles(cfg, "norm"), compiled_swiglu=compiles(cfg, "swiglu"),
        compiled_loss=compiles(cfg, "loss"), cuda_graphs=cfg.training.cuda_graphs, fla_kl=cfg.distill.kernel == "fla",
        gdn_backend=cfg.training.gdn_backend)


def build_parallel_model(args, mesh, device: torch.device, *, kernels: ops.Kernels = ops.DEFAULT,
                         ac_mode: str = "none", ac_every: int = 1, compile_model: bool = False,
                         param_dtype: torch.dtype = torch.float32, reshard_after_forward: str = "default",
                         float8: Float8Conversion | None = None):
    """The training model: initialised whole from the seed, then converted (``float8``: the linears float8
    training swaps) and wrapped from outside (hybridtitan.float8, hybridtitan.parallel).

    Initialising before sharding makes the initial weights independent of the number of ranks (random ops on
    sharded CPU tensors would repeat the same numbers in every shard). The benchmark builds its models here too.
    """
    model = build_model(args, "meta", kernels)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    if float8 is not None:
        apply_float8(model, float8)
    parallelize(model, mesh, ac_mode=ac_mode, ac_every=ac_every, compile_model=compile_model,
                param_dtype=param_dtype, reduce_dtype=torch.float32, reshard_after_forward=reshard_after_forward)
    return model.train()


class HostReports:
    """What the host learns of each step, one step late: its gradient norm, and whether a stop was asked for on
    any rank. A value read at once (``.item()``, ``bool()``) makes the host wait until the GPU has run everything
    queued, and the GPU then idles while the host prepares the next step (data, optimizer, launches). Here the two
    numbers travel in one small non-blocking copy, read after the next step is queued, when the copy is long done;
    the ranks' stop flags are all-reduced in the same stream, so every rank reads the same flag for the same step.
    Reading a report counts a skipped update and sets ``stopping``."""

    def __init__(self, device: torch.device, state: TrainState):
        self.state = state
        self.stopping = False
        self.consecutive_skips = 0
        self._pending: tuple[int, torch.Tensor, Any] | None = None
        # filled in place: a new tensor from a Python value would be a blocking host-to-device copy
        self._flag = torch.zeros(1, device=device)
        self._host = torch.empty(2, pin_memory=True) if device.type == "cuda" else None

    def send(self, step: int, grad_norm: torch.Tensor, stop_requested: bool) -> None:
        """This step's report, after reading the previous one (whose host buffer is reused)."""
        self.read()
        self._flag.fill_(float(stop_requested))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        values = torch.cat([grad_norm.detach().float().reshape(1), self._flag])
        event = None
        if self._host is not None:
            self._host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = self._host
        self._pending = (step, values, event)

    def read(self) -> None:
        """Reads the last report sent, if not read yet (waiting for its copy if needed)."""
        if self._pending is None:
            return
        step, values, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        grad_norm, stop = values.tolist()
        self.stopping = self.stopping or stop > 0
        if math.isfinite(grad_norm):
            self.consecutive_skips = 0
            return
        self.state.skipped_steps += 1
        self.consecutive_skips += 1
        logger.warning(f"step {step}: non-finite gradient norm {grad_norm}, update skipped")
        if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise FloatingPointError(f"{self.consecutive_skips} consecutive steps had non-finite gradients; "
                                     f"stopping at step {step} (the last checkpoint is intact)")


class LogWindow:
    """The steps since the last log line: their summed loss and distillation terms (applied steps only), and wall
    time."""

    def __init__(self, step: int):
        self.start_step, self.start_time = step, time.perf_counter()
        self.loss_sum: torch.Tensor | None = None  # [loss, *parts]
        self.part_names: list[str] = []
        self.counted: torch.Tensor | None = None

    def add(self, result: StepResult) -> None:
        self.part_names = list(result.parts)
        values = torch.stack([result.loss, *result.parts.values()]).float()
        values = torch.where(result.applied, values, torch.zeros_like(values))
        self.loss_sum = values if self.loss_sum is None else self.loss_sum + values
        applied = result.applied.float()
        self.counted = applied if self.counted is None else self.counted + applied

    def has_applied_steps(self) -> bool:
        return self.counted is not None and self.counted.item() > 0


class StopRequest:
    """SIGTERM / SIGINT: finish the step (the ranks agree on it a step later, HostReports), save, exit."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        if self.requested:  # a second SIGTERM (a scheduler and torchrun both pass it on): the save is coming
            return
        self.requested = True
        logger.warning(f"signal {signum}: saving a checkpoint after this step or the next, then stopping")


class Trainer:
    """A training run: built from a checked config, then ``train()``."""

    def __init__(self, cfg: JobConfig, plan: Plan):
        self.cfg, self.plan, self.device = cfg, plan, plan.layout.device
        t = cfg.training
        if self.device.type == "cuda" and t.expandable_segments:
            # from the recipe, before the first allocation; fragmentation otherwise costs the larger batches
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        init_distributed(self.device, cfg.comm.init_timeout_seconds, cfg.comm.backend)
        self.rank = dist.get_rank()
        setup_logging(self.rank)
        for warning in plan.warnings:
            logger.warning(warning)
        # tuned kernel configurations, before anything imports FLA (its kernels are defined at its import)
        logger.info(plan.model.kernel_configs.message)
        if self.device.type == "cuda":
            kernel_configs.activate(plan.model.kernel_configs)
        torch.manual_seed(plan.data.seed)
        if cfg.debug.deterministic:
            torch.use_deterministic_algorithms(True)

        # the model (and a distillation teacher beside it)
        args = plan.model.args
        self.flops_per_token = training_flops_per_token(args, t.seq_len, cfg.distill, plan.teacher) \
            if plan.reference is None else dpo_flops_per_token(args, t.seq_len, plan.reference)
        self._describe_run()
        on_gpu = self.device.type == "cuda"
        if not on_gpu and t.mixed_precision_param != "float32":
            logger.info("CPU: parameters and activations in float32 (training.mixed_precision_param applies to GPUs)")
        # context parallelism: each sequence split over consecutive ranks (their group made first, on every rank
        # in the same order); FSDP shards over all ranks, data parallel and CP (hybridtitan.parallel)
        self.cp_group = context_parallel_group(plan.layout.cp) if plan.layout.cp > 1 else None
        self.mesh = build_mesh(plan.layout.dp, self.device.type, plan.layout.cp)
        kernels = ops.Kernels(kernel_config(cfg, self.device))
        param_dtype = getattr(torch, t.mixed_precision_param) if on_gpu else torch.float32
        self.model = build_parallel_model(
            args, self.mesh, self.device, kernels=kernels, ac_mode=cfg.activation_checkpoint.mode,
            ac_every=selective_ac_interval(cfg), compile_model=compiles(cfg, "model"), param_dtype=param_dtype,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward, float8=plan.model.float8)
        for line in plan.model.float8.summary() if plan.model.float8 is not None else []:
            logger.info(line)
        self.distiller = Distiller(cfg.distill, plan.teacher, self.mesh, self.device, kernels, param_dtype) \
            if plan.teacher is not None else None
        self.dpo = PreferenceOptimizer(cfg.dpo, plan.reference, self.mesh, self.device, kernels, param_dtype,
                                       t.loss_chunk_size) if plan.reference is not None else None
        if t.cuda_graphs and cfg.data.document_boundaries:
            logger.warning("training.cuda_graphs: with packed documents (data.document_boundaries) the mixers run "
                           "eagerly; only whole sequences are replayed from CUDA graphs")

        # the optimizer, the data, the checkpoints
        self.optimizer = build_optimizer(self.model, cfg)
        self.lr_scheduler = LRSchedule(self.optimizer, plan.start.lr_scheduler, cfg.training.steps)
        self.dataloader = plan.data.dataloader
        self.state = TrainState()
        self.job_dict = to_dict(cfg)
        self.job_dict["data"]["tokenizer"] = recorded_path(cfg.data.tokenizer)  # export/eval may run elsewhere
        self.job_dict["lr_scheduler"] = dataclasses.asdict(plan.start.lr_scheduler)  # the schedule in force
        self.job_dict.update(run_record.record(cfg.data, plan.data.tokenizer))  # the run record a resume compares
        if plan.reference is not None:  # the reference in use, a step folder: a resume reads it here (dpo.py)
            self.job_dict["dpo"]["reference"] = plan.reference.path
        c = cfg.checkpoint
        self.checkpointer = CheckpointManager(
            os.path.join(cfg.job.dump_folder, c.folder), model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, train_state=self.state,
            dp_rank=plan.layout.dp_rank, dp_world_size=plan.layout.dp.size, model_args=args, job_config=self.job_dict,
            interval=c.interval, keep_latest_k=c.keep_latest_k, async_mode=c.async_mode, enable=c.enable,
            first_step=c.enable_first_step_checkpoint, exclude_from_loading=tuple(c.exclude_from_loading))
        try:
            resume(cfg, plan.start.checkpoint, self.checkpointer, self.state)
            self.batches = iter(self.dataloader)  # where the loader applies its resumed state (and refuses one)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's errors, or the loader's
            logger.debug("resume failed", exc_info=True)
            raise ResumeError(f"cannot resume from the checkpoint: {first_error_line(e)}") from e
        self.start_step = self.state.step

        # what the run shows
        if self.rank == 0:
            os.makedirs(cfg.job.dump_folder, exist_ok=True)
            with open(os.path.join(cfg.job.dump_folder, "job_config.json"), "w") as f:
                json.dump(self.job_dict, f, indent=2, default=str)
            if cfg.job.print_config:
                logger.info("config:\n" + json.dumps(self.job_dict, indent=2, default=str))
        self.metrics = MetricsLogger(
            cfg.job.dump_folder, rank=self.rank, total_steps=t.steps, flops_per_token=self.flops_per_token,
            device=self.device, enable_tensorboard=cfg.metrics.enable_tensorboard,
            tb_folder=cfg.metrics.save_tb_folder, enable_wandb=cfg.metrics.enable_wandb, job_config=self.job_dict,
            start_step=self.state.step)
        self.stop = StopRequest()
        self.reports = HostReports(self.device, self.state)
        self.window = LogWindow(self.state.step)
        # a DPO micro-batch of local_batch_size pairs is twice as many rows
        rows = t.local_batch_size * (2 if self.dpo is not None else 1)
        self.tokens_per_step_local = rows * t.seq_len * plan.layout.grad_accum
        self.last_logged: dict = {}

    def _describe_run(self) -> None:
        cfg, plan, args = self.cfg, self.plan, self.plan.model.args
        counts = param_counts(args)
        logger.info(f"model {cfg.model.flavor}: pattern {args.pattern} ({args.mixer}), {counts['total']:,} "
                    f"parameters ({counts['non_embedding']:,} non-embedding), {self.flops_per_token / 1e9:.3f} "
                    "GFLOP/token (training)")
        ranks = plan.layout
        cp = f", context parallel {ranks.cp} ({ranks.cp_layout})" if ranks.cp > 1 else ""
        logger.info(f"{ranks.world_size} rank(s) on {self.device.type}: data parallel replicate {ranks.dp.replicate} x "
                    f"shard {ranks.dp.shard}{cp}, local batch {cfg.training.local_batch_size} x seq "
                    f"{cfg.training.seq_len}, gradient accumulation {ranks.grad_accum}")
        logger.info(plan.data.reads)
        if self.device.type == "cuda" and args.mixer == "mamba2":
            from hybridtitan.ops.fla_backend import MIN_TRAINED_HEAD_DIM

            if min(args.mamba2.d_state, args.mamba2.head_dim) < MIN_TRAINED_HEAD_DIM:
                # handled (and checked on an H200), but the padding costs compute worth knowing about
                logger.info("Mamba2 with d_state %d, head_dim %d: FLA's simple-GLA backward faulted or was wrong "
                            "below %d on an H200, so smaller dims are padded to it in training "
                            "(hybridtitan.ops.fla_backend)", args.mamba2.d_state, args.mamba2.head_dim,
                            MIN_TRAINED_HEAD_DIM)

    # ------------------------------------------------------------------------------------------------ the loop

    def _report_autotuning(self) -> None:
        """After the first step on a GPU: the kernels that met a shape the configurations in use do not hold, and
        so autotuned in this process (each rank alone)."""
        if self.device.type != "cuda":
            return
        choice = self.plan.model.kernel_configs
        tuned = kernel_configs.autotuned_here(choice)
        if tuned and choice.folder is not None:
            logger.warning(f"{len(tuned)} kernels autotuned at shapes the kernel configurations do not hold "
                           f"({', '.join(tuned[:8])}{', ...' if len(tuned) > 8 else ''}); record them: "
                           f"python -m hybridtitan.tune with this recipe and --output {choice.path}")
        elif tuned:
            logger.info(f"{len(tuned)} kernels autotuned in the first step; python -m hybridtitan.tune with this "
                        "recipe records their choices, for training.kernel_configs")

    def train(self) -> dict:
        """Trains to training.steps (or a stop request); returns the last logged metrics."""
        t = self.cfg.training
        gc.disable()
        gc.collect()
        with profiler(self.cfg) as prof:
            for step in range(self.state.step + 1, t.steps + 1):
                self.state.step = step
                result = self.train_step()
                if step == self.start_step + 1:  # start-up is over: a collective now waits train_timeout_seconds
                    set_collective_timeout(self.cfg.comm.train_timeout_seconds, self.mesh)
                    self._report_autotuning()
                self.window.add(result)
                if prof is not None:
                    prof.step()
                # the previous step's report is read now that this one is queued; this step's goes out
                self.reports.send(step, result.grad_norm, self.stop.requested)
                log_due, save_due = self.log_due(step), self.checkpointer.should_save(step, last=step == t.steps)
                if log_due or save_due or self.reports.stopping:
                    self.reports.read()  # the counters and the stop flag must include this step
                self.maybe_log(step, result, due=log_due)
                self.maybe_validate(step)
                if step % t.gc_freq == 0:
                    gc.collect()
                self.maybe_save(step, due=save_due)
                self.maybe_evaluate(step)
                if self.should_stop(step):
                    break
        return self.last_logged

    def train_step(self) -> StepResult:
        """One optimizer step over the step's micro-batches: forward, backward, clip, update. The loss is the mean
        over the counted tokens of the global batch (all micro-batches of all ranks), so a split into more
        micro-batches or ranks gives the same step. Under context parallelism each rank holds its part of every
        row (``rank_part``): the counts and loss sums of its parts add up, over the ranks, to the whole batch's."""
        t, accum = self.cfg.training, self.plan.layout.grad_accum
        batches = [self.rank_part(next(self.batches)) for _ in range(accum)]
        counted = sum(self.counted(b) for b in batches)
        dist.all_reduce(counted)  # the global batch's
        # FSDP averages the gradients over all its ranks (data and context parallel): each micro-batch's sum over
        # the mean count per micro-batch and rank
        per_micro_batch = (counted / (self.plan.layout.dp.size * self.plan.layout.cp * accum)).clamp(min=1)
        loss_total = torch.zeros((), device=self.device)
        parts: dict[str, torch.Tensor] = {}
        for b in batches:
            for loss_sum, terms in self.losses(b):
                loss = loss_sum / per_micro_batch / accum
                loss.backward()
                loss_total += loss.detach()
                for name, value in terms.items():
                    parts[name] = parts.get(name, 0) + value / per_micro_batch / accum
        grad_norm = clip_grad_norm_(self.model.parameters(), t.max_norm)
        # the gradient norm is already reduced over all ranks, so every rank makes the same choice
        applied = optimizer_step(self.optimizer, grad_norm)
        if self.plan.model.float8 is not None:  # float8 all-gather: the next step's weight scales, in one all-reduce
            precompute_float8_scales(self.model, self.plan.model.float8)
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.tokens_seen += self.tokens_per_step_local * self.plan.layout.dp.size
        return StepResult(loss_total, grad_norm, applied, lr, counted, parts)

    def counted(self, batch: dict) -> torch.Tensor:
        """What the loss of a micro-batch is summed over: its counted tokens, or in DPO its pairs."""
        if self.dpo is not None:
            return torch.tensor(batch["input_ids"].shape[0] // 2, device=self.device)
        return (batch["labels"] != IGNORE_INDEX).sum()

    def losses(self, batch: dict) -> list[tuple[torch.Tensor, dict]]:
        """(summed loss, {distillation term: summed value}) for each forward of a micro-batch: the cross-entropy,
        with a teacher the distillation's losses (hybridtitan.distill), in DPO the preference loss (hybridtitan.dpo)."""
        if self.dpo is not None:
            return self.dpo.losses(self.model, batch)
        if self.distiller is not None:
            return self.distiller.losses(self.model, batch)
        loss_sum, _ = self.model(batch["input_ids"], labels=batch["labels"], cu_seqlens=batch.get("cu_seqlens"),
                                 loss_chunk_size=self.cfg.training.loss_chunk_size, reduction="sum",
                                 context=batch.get("context"))
        return [(loss_sum, {})]

    def to_device(self, batch: dict) -> dict:
        return {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}

    def rank_part(self, batch: dict) -> dict:
        """A host batch on the device: whole, or under context parallelism this rank's part of it with its shard
        as "context" (hybridtitan.ops.context_parallel.shard_batch: packed documents' boundaries go into the
        shard), cut on the host so that only the part is copied."""
        if self.cp_group is None:
            return self.to_device(batch)
        part, shard = shard_batch(batch, self.cp_group, self.plan.layout.cp_layout, device=self.device)
        return {**self.to_device(part), "context": shard}

    def log_due(self, step: int) -> bool:
        """Every metrics.log_freq steps, the last, and the first (the initial loss and the start-up cost) of the
        run and of a resume."""
        return step % self.cfg.metrics.log_freq == 0 or step in (1, self.cfg.training.steps, self.start_step + 1)

    def maybe_log(self, step: int, result: StepResult, due: bool) -> None:
        """The log window's mean loss, the step's gradient norm and rate, speed, memory: at a due step or a stop."""
        if not (due or self.reports.stopping) or not self.window.has_applied_steps():
            return
        w = self.window
        means = w.loss_sum / w.counted
        dist.all_reduce(means)  # a sum (gloo has no average)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's wall time includes its GPU work
        means = (means / dist.get_world_size()).tolist()
        self.last_logged = self.metrics.log(
            step, loss=means[0], parts=dict(zip(w.part_names, means[1:])), grad_norm=result.grad_norm.item(),
            lr=result.lr,
            tokens_per_step=self.tokens_per_step_local // self.plan.layout.cp,  # a CP rank computes its part of them
            window_steps=step - w.start_step,
            window_time=time.perf_counter() - w.start_time, tokens_seen=self.state.tokens_seen,
            skipped_steps=self.state.skipped_steps, loss_tokens=int(result.loss_tokens.item()))
        self.window = LogWindow(step)

    def maybe_validate(self, step: int) -> None:
        """The held-out loss every validation.freq steps and at the end (or a stop), where validation is on."""
        if self.plan.data.held_out is None:
            return
        if step % self.cfg.validation.freq and step != self.cfg.training.steps and not self.reports.stopping:
            return
        if self.dpo is not None:
            loss, pairs, values = self.validate_preferences()
            self.metrics.log_preference_validation(step, loss=loss, pairs=pairs, values=values)
            return
        loss, tokens, kl = self.validate()
        self.metrics.log_validation(step, loss=loss, tokens=tokens, kl=kl)

    @torch.no_grad()
    def validate(self) -> tuple[float, int, float | None]:
        """(mean loss over the counted tokens of the held-out set, their number, and with a teacher the mean KL
        divergence from it), over every rank's shard: the same batches each time. Nothing of the training changes:
        no RNG is drawn, no state is kept."""
        steps = self.cfg.validation.steps
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for i, (batch, shard_ended) in enumerate(self.plan.data.held_out.batches()):
            b = self.rank_part(batch)
            if self.distiller is not None:
                loss_sum, kl_sum, count = self.distiller.held_out(self.model, b)
            else:
                (loss_sum, count), kl_sum = self.model(
                    b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"),
                    loss_chunk_size=self.cfg.training.loss_chunk_size, reduction="sum",
                    context=b.get("context")), torch.zeros(())
            totals += torch.stack([loss_sum.double(), count.double(), kl_sum.double().to(self.device)])
            if steps > 0:
                if i + 1 == steps:
                    break
                continue
            # one pass: until any rank's shard ends (every rank runs the same number of forward passes)
            ended = torch.tensor([float(shard_ended)], device=self.device)
            dist.all_reduce(ended, op=dist.ReduceOp.MAX)
            if ended.item() > 0:
                break
        self.model.train()
        dist.all_reduce(totals)
        loss_sum, count, kl_sum = totals.tolist()
        return loss_sum / max(count, 1), int(count), kl_sum / max(count, 1) if self.distiller is not None else None

    @torch.no_grad()
    def validate_preferences(self) -> tuple[float, int, dict[str, float]]:
        """DPO's held-out pairs: (mean loss, their number, {dpo/accuracy, dpo/margin, dpo/chosen_reward,
        dpo/rejected_reward: mean over the pairs}), over every rank's shard, the same pairs each time."""
        steps = self.cfg.validation.steps
        self.model.eval()
        totals = torch.zeros(6, dtype=torch.float64, device=self.device)
        for i, (batch, shard_ended) in enumerate(self.plan.data.held_out.batches()):
            totals += self.dpo.held_out(self.model, self.to_device(batch))
            if steps > 0:
                if i + 1 == steps:
                    break
                continue
            ended = torch.tensor([float(shard_ended)], device=self.device)
            dist.all_reduce(ended, op=dist.ReduceOp.MAX)  # one pass: until any rank's shard ends
            if ended.item() > 0:
                break
        self.model.train()
        dist.all_reduce(totals)
        loss, *values, pairs = totals.tolist()
        return loss / max(pairs, 1), int(pairs), {k: v / max(pairs, 1) for k, v in zip(VALIDATION_PARTS, values)}

    def maybe_save(self, step: int, due: bool) -> None:
        """A checkpoint at a due step (checkpoint.interval, the last) or a stop."""
        if due or self.reports.stopping:
            last = step == self.cfg.training.steps
            self.checkpointer.save(step, model_only=last and self.cfg.checkpoint.last_save_model_only)

    def maybe_evaluate(self, step: int) -> None:
        """lm-eval's tasks on the live model after every eval.every_checkpoints-th checkpoint and at the end (not
        on a stop: the time is the scheduler's), every rank scoring its share; logged as eval/<task>/<metric>."""
        e, c = self.cfg.eval, self.cfg.checkpoint
        if not e.tasks or self.reports.stopping:
            return
        after_checkpoint = c.enable and step % (c.interval * e.every_checkpoints) == 0
        if not (after_checkpoint or step == self.cfg.training.steps):
            return
        from hybridtitan.lm_eval_model import evaluate_live

        start = time.perf_counter()
        results = evaluate_live(self.model, self.plan.data.tokenizer, e.tasks, include_path=e.include_path or None,
                                limit=e.limit, num_fewshot=e.num_fewshot, batch_size=e.batch_size,
                                max_length=self.cfg.training.seq_len, device=self.device)
        self.metrics.log_eval(step, results, seconds=time.perf_counter() - start)

    def should_stop(self, step: int) -> bool:
        if self.reports.stopping:
            logger.warning(f"stopped at step {step} on request")
        return self.reports.stopping

    def close(self, finished: bool) -> None:
        """Waits for a background save and closes the metrics; after a finished run, the ranks leave together
        (after an error on this rank the others may never get there: it leaves at once, torchrun stops them)."""
        self.checkpointer.close()
        self.metrics.close()
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def optimizer_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
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


def profiler(cfg: JobConfig):
    """torch.profiler over the steps profiling.* asks for (traces to dump_folder/save_traces_folder), or none."""
    p = cfg.profiling
    if not p.enable_profiling:
        return contextlib.nullcontext(None)
    folder = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
    rank = dist.get_rank()

    def on_trace(prof):
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_step{prof.step_num}.json"))
        if rank == 0:
            sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            logger.info("profile: " + prof.key_averages().table(sort_by=sort, row_limit=25))

    wait = max(p.profile_freq - p.profiler_active - p.profiler_warmup, 0)
    return torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=wait, warmup=p.profiler_warmup, active=p.profiler_active),
        on_trace_ready=on_trace, record_shapes=True)


def setup_logging(rank: int) -> None:
    logging.basicConfig(format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout, force=True)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def init_distributed(device: torch.device, timeout_seconds: int, backend: str) -> None:
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"  # NCCL is RCCL on ROCm builds
    kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_seconds)}
    if "RANK" not in os.environ:
        # one process without torchrun: a group of one, so the sharded (FSDP) code path is the same
        store = tempfile.NamedTemporaryFile(prefix="hybridtitan-pg-", delete=False).name
        atexit.register(_remove_quietly, store)  # the store is needed while the group lives, not after
        kwargs.update(init_method=f"file://{store}", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(**kwargs)


def set_collective_timeout(seconds: int, mesh) -> None:
    """The time any collective may wait from now on, in the default group and in each of the mesh's (FSDP's and
    HSDP's own collectives run there), with torch's own setter as torchtitan's trainer uses it. A rank that stops
    answering then ends the others within it: the scheduler can requeue."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in [None, *(mesh.get_group(dim) for dim in range(mesh.ndim))]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _quiet_known_warnings() -> None:
    """Warnings of dependencies that say nothing about this run."""
    for message in ("DTensor random operators may not have complete support",  # no random op on DTensors here
                    "'set_vital' is deprecated",  # torchdata 0.11 on torch >= 2.12
                    "Triton is not supported on current platform",  # FLA imported on a CPU machine
                    "torch.distributed is disabled"):  # a distillation teacher read from DCP, in one process
        warnings.filterwarnings("ignore", message=message)


def main(argv: list[str] | None = None) -> None:
    _quiet_known_warnings()
    rank = int(os.environ.get("RANK", "0"))
    if not (sys.argv[1:] if argv is None else argv):  # nothing given: the defaults alone name no data
        if rank == 0:
            print(TRAIN_USAGE + "\nerror: give a recipe (train_configs/*.toml); --help lists the keys",
                  file=sys.stderr)
        sys.exit(2)
    with one_line_errors():
        cfg = parse_config(argv)
        plan = preflight(cfg)
    try:
        trainer = Trainer(cfg, plan)
    except ResumeError as e:
        dist.destroy_process_group()
        fail(first_error_line(e))
    finished, error, code = False, None, 0
    try:
        trainer.train()
        finished = True
    except DataError as e:  # bad data is bad input: one line (from each rank that met it), not a traceback
        error, code = first_error_line(e), 2
    except RuntimeError as e:  # a collective that failed or timed out: another rank died or hangs
        # NCCL raises DistBackendError (a RuntimeError); gloo a plain RuntimeError from its transport, e.g.
        # "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete"
        # or "[.../gloo/transport/tcp/pair.cc:...] Connection closed by peer" (tests/test_cluster.py)
        if not isinstance(e, dist.DistBackendError) and "gloo/transport/" not in str(e):
            raise
        error, code = (f"rank {trainer.rank}: a collective failed at step {trainer.state.step} (another rank stopped "
                       f"or stopped answering; the last complete checkpoint is intact): {first_error_line(e)}"), 1
    finally:
        if code != 1:  # a broken group cannot be closed in order
            trainer.close(finished)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(code)

if __name__ == "__main__":
    main()

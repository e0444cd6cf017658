"""Everything a run is checked for before it touches anything: a process group, a folder or a file.

    plan = preflight(cfg)        # ConfigError (one line, exit code 2) on any problem

Four planners, each a frozen part of the plan: ``plan_layout`` (the data-parallel and context-parallel layout, the
gradient accumulation), ``plan_model`` (the model, its kernel configurations and float8 linears), ``plan_data``
(the tokenizer, the data loader, the held-out set) and ``plan_start``, which chooses the checkpoint the run starts
from, once: the run's own latest complete step (or ``checkpoint.load_step``), else ``checkpoint.initial_load_path``,
else none. That checkpoint must exist, hold this model (hybridtitan.model_folder), fit this run's data loader and
match its run record (hybridtitan.run_record: the tokenizer and data it was trained with); a rewind that a later
resume would undo is refused."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from hybridtitan import run_record
from hybridtitan.checkpoint import CheckpointError, complete_steps, is_model_only, read_job_config, resolve_checkpoint
from hybridtitan.config_manager import ConfigError, compiles, context_parallel_layout, held_out_data, model_args
from hybridtitan.data import HeldOut, build_dataloader, build_tokenizer
from hybridtitan.data.manifest import check_shards
from hybridtitan.data.sources import summarize
from hybridtitan.data.tokenizer import vocabulary_fingerprint
from hybridtitan.distill import Teacher, check_teacher
from hybridtitan.dpo import check_reference
from hybridtitan.errors import ConversionError, first_error_line
from hybridtitan.float8 import CONVERTER as FLOAT8
from hybridtitan.float8 import (
    Float8Conversion,
    float8_refusal_here,
    float8_settings,
    float8_warnings,
    plan_float8,
)
from hybridtitan.job_config import JobConfig
from hybridtitan.lr_schedule import SCHEDULE_KEYS, schedule_shape
from hybridtitan.model_folder import read_folder
from hybridtitan.models import ModelArgs, build_model
from hybridtitan.ops import kernel_configs
from hybridtitan.parallel import DataParallel, resolve_data_parallel

DEFAULT_SEED = 42

OTHER_WORKERS = ("its data loader state does not fit this run's loader: it needs the data.num_workers of the run "
                 "that saved it (checkpoint.exclude_from_loading = [\"dataloader\"] starts the data afresh)")
# how a warning about a resumed schedule ends
NEW_SCHEDULE = '(checkpoint.exclude_from_loading = ["lr_scheduler"] starts a new one)'


@dataclasses.dataclass(frozen=True)
class StartPoint:
    """The checkpoint a run starts from."""

    step_dir: str
    model_only: bool  # load the weights alone (an import's step-0, or initial_load_model_only)
    description: str  # how the log names it: "resumed from ..." or "initialised from ..."
    ignored_initial_load_path: bool = False  # the run's own checkpoint won over checkpoint.initial_load_path


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the ranks share the work."""

    device: torch.device
    world_size: int
    dp: DataParallel
    dp_rank: int  # this rank's data-parallel rank: the context-parallel ranks of a group read the same batches
    cp: int  # context parallelism's degree: consecutive ranks that split each sequence (same batch)
    cp_layout: str  # hybridtitan.ops.context_parallel's layout of a split sequence
    global_batch: int
    grad_accum: int


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The model the run trains, and how its kernels and linears run."""

    args: ModelArgs
    kernel_configs: kernel_configs.Choice  # the tuned kernel configurations the run uses
    float8: Float8Conversion | None  # the linears float8 training converts (model.converters)
    warnings: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """What the run reads."""

    tokenizer: Any
    dataloader: Any
    held_out: HeldOut | None  # the validation set, where validation.enable
    seed: int
    reads: str  # files, documents, tokens and the epochs the schedule makes of them
    warnings: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """Where the run starts."""

    checkpoint: StartPoint | None
    lr_scheduler: Any  # the [lr_scheduler] in force: the recipe's, or a resumed checkpoint's shape
    warnings: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the checks before any side effect worked out."""

    layout: Layout
    model: ModelPlan
    data: DataPlan
    teacher: Teacher | None  # the distillation teacher, where [distill] names one
    start: StartPlan
    reference: Teacher | None = None  # DPO's frozen reference, where [dpo] names preference pairs

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the run's log says before training, once logging is set up."""
        frozen = tuple(m.warning for m in (self.teacher, self.reference) if m is not None and m.warning)
        return self.data.warnings + frozen + self.model.warnings + self.start.warnings


def preflight(cfg: JobConfig) -> Plan:
    """Every check that can fail on the user's input, before a process group, a folder or a file is made."""
    layout = plan_layout(cfg)
    model = plan_model(cfg, layout)
    data = plan_data(cfg, layout, model.args)
    teacher = check_teacher(cfg, model.args, data.tokenizer)
    start = plan_start(cfg, model.args, data.tokenizer)
    return Plan(layout=layout, model=model, data=data, teacher=teacher, start=start,
                reference=check_reference(cfg, model.args, data.tokenizer, start.checkpoint))


def plan_layout(cfg: JobConfig) -> Layout:
    """The data-parallel and context-parallel layout of the ranks, and the gradient accumulation."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cp, cp_layout = context_parallel_plan(cfg, world_size)
    try:
        dp = resolve_data_parallel(cfg.parallelism.data_parallel_replicate_degree,
                                   cfg.parallelism.data_parallel_shard_degree, world_size // cp)
    except ValueError as e:
        raise ConfigError(str(e) + (f" (the data-parallel ranks: {world_size} / context_parallel_degree {cp})"
                                    if cp > 1 else "")) from None
    t = cfg.training
    per_step = t.local_batch_size * dp.size
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise ConfigError(f"training.global_batch_size ({global_batch}) is not divisible by local_batch_size x "
                          f"data-parallel size ({t.local_batch_size} x {dp.size} = {per_step})")
    device = gpu_of(local_rank, cfg.comm.backend) if torch.cuda.is_available() else torch.device("cpu")
    return Layout(device=device, world_size=world_size, dp=dp, dp_rank=int(os.environ.get("RANK", "0")) // cp,
                  cp=cp, cp_layout=cp_layout, global_batch=global_batch, grad_accum=global_batch // per_step)


def gpu_of(local_rank: int, backend: str) -> torch.device:
    """This rank's GPU: its own under NCCL, which refuses two ranks on one GPU; shared round-robin under gloo."""
    gpus = torch.cuda.device_count()
    if backend == "gloo":
        return torch.device(f"cuda:{local_rank % gpus}")
    if local_rank >= gpus:
        raise ConfigError(f"local rank {local_rank} has no GPU of its own ({gpus} on this node): start at most {gpus} "
                          f"ranks per node, or share the GPUs with --comm.backend gloo (slow)")
    return torch.device(f"cuda:{local_rank}")


def plan_model(cfg: JobConfig, layout: Layout) -> ModelPlan:
    """The model's arguments, checked against the layout; its kernel configurations and float8 linears."""
    args = model_args(cfg)
    check_context_parallel_model(cfg, args, layout.cp)
    float8, warnings = float8_plan(cfg, args, layout.dp, layout.device, layout.cp)
    try:
        tuned = kernel_configs.choose(cfg.training.kernel_configs, layout.device)
    except kernel_configs.KernelConfigError as e:
        raise ConfigError(str(e)) from None
    return ModelPlan(args=args, kernel_configs=tuned, float8=float8, warnings=tuple(warnings))


def plan_data(cfg: JobConfig, layout: Layout, args: ModelArgs) -> DataPlan:
    """The tokenizer, the training data's loader and the held-out set, checked against what prepared them."""
    t = cfg.training
    if cfg.dpo.path:
        return plan_preference_data(cfg, layout, args)
    tokenizer = None
    needs_tokenizer = cfg.data.source != "mock" or cfg.eval.tasks or (
        cfg.validation.enable and cfg.validation.data.source != "mock")
    if needs_tokenizer:
        try:
            tokenizer = build_tokenizer(cfg.data.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    seed = DEFAULT_SEED if cfg.debug.seed is None else cfg.debug.seed
    try:  # the ranks of a context-parallel group read the same batches (each keeps its part of every row)
        dataloader = build_dataloader(
            cfg.data, tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            dp_rank=layout.dp_rank, dp_world_size=layout.dp.size, seed=seed, vocab_size=args.vocab_size,
            eod_mask_loss=t.eod_mask_loss)
        held_out = None
        if cfg.validation.enable:
            v = cfg.validation
            held_out = HeldOut(held_out_data(cfg), tokenizer, seq_len=v.seq_len or t.seq_len,
                               local_batch_size=v.local_batch_size or t.local_batch_size,
                               dp_rank=layout.dp_rank, dp_world_size=layout.dp.size,
                               vocab_size=args.vocab_size, eod_mask_loss=t.eod_mask_loss)
        warnings = check_data_files(cfg, tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.eval.tasks:
        check_eval_tasks(cfg)
    return DataPlan(tokenizer=tokenizer, dataloader=dataloader, held_out=held_out, seed=seed,
                    reads=what_the_run_reads(cfg, layout.global_batch), warnings=tuple(warnings))


def plan_preference_data(cfg: JobConfig, layout: Layout, args: ModelArgs) -> DataPlan:
    """DPO's data (hybridtitan.data.preference): every pair read, rendered, tokenized and checked now, the training
    pairs' loader and the held-out pairs."""
    from hybridtitan.data.preference import HeldOutPairs, preference_loader, read_pairs

    t, v = cfg.training, cfg.validation
    seed = DEFAULT_SEED if cfg.debug.seed is None else cfg.debug.seed
    try:
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        pairs = read_pairs(cfg.dpo, tokenizer, max_length=t.seq_len, vocab_size=args.vocab_size)
        dataloader = preference_loader(pairs, local_batch_size=t.local_batch_size, dp_rank=layout.dp_rank,
                                       dp_world_size=layout.dp.size, seed=seed)
        held_out, held = None, None
        if v.enable:
            held = read_pairs(cfg.dpo, tokenizer, max_length=v.seq_len or t.seq_len, vocab_size=args.vocab_size,
                              validation=True)
            held_out = HeldOutPairs(held, local_batch_size=v.local_batch_size or t.local_batch_size,
                                    dp_rank=layout.dp_rank, dp_world_size=layout.dp.size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.eval.tasks:
        check_eval_tasks(cfg)
    warnings = [f"dpo: {n.truncated:,} of {len(n):,} {what} pairs are longer than {n.max_length} tokens (prompt and "
                "response): their responses are cut to fit" for n, what in ((pairs, "training"), (held, "held-out"))
                if n is not None and n.truncated]
    planned = t.steps * layout.global_batch
    reads = (f"data: {len(pairs):,} preference pairs from {cfg.dpo.path}"
             f"{f' ({cfg.dpo.split})' if cfg.dpo.split else ''}, at most {t.seq_len} tokens each; the run reads "
             f"{planned:,} pairs ({t.steps} steps x {layout.global_batch}): {planned / len(pairs):.2f} epochs"
             + (f"; {len(held):,} held-out pairs" if held is not None else ""))
    return DataPlan(tokenizer=tokenizer, dataloader=dataloader, held_out=held_out, seed=seed, reads=reads,
                    warnings=tuple(warnings))


def plan_start(cfg: JobConfig, args: ModelArgs, tokenizer) -> StartPlan:
    """The checkpoint the run starts from, checked against the model and the run record, and the schedule in force."""
    checkpoint = choose_start(cfg)
    warnings = []
    unread = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
    if not cfg.checkpoint.enable and complete_steps(unread):
        warnings.append(f"checkpoint.enable is false: the checkpoints in {unread} (steps "
                        f"{', '.join(map(str, complete_steps(unread)))}) are not loaded, and the model starts from its "
                        "random initialisation")
    if checkpoint is not None:
        check_start(cfg, checkpoint, args)
        if tokenizer is not None and not cfg.checkpoint.allow_tokenizer_change:
            run_record.check_tokenizer(checkpoint.step_dir, cfg.data, tokenizer)
    lr_scheduler, kept = schedule_in_force(cfg, checkpoint)
    return StartPlan(checkpoint=checkpoint, lr_scheduler=lr_scheduler,
                     warnings=tuple(warnings + ([kept] if kept else [])))


def context_parallel_plan(cfg: JobConfig, world_size: int) -> tuple[int, str]:
    """(degree, layout) of context parallelism (parallelism.context_parallel_degree, _load_balancer), refused in
    one line where it cannot run: a degree that does not divide the ranks, sequences that do not cut into
    2 x degree equal chunks, and what has not been made to work with it yet."""
    p, t = cfg.parallelism, cfg.training
    cp, layout = p.context_parallel_degree, context_parallel_layout(cfg)
    if cp == 1:
        return cp, layout
    key = "parallelism.context_parallel_degree"
    if world_size % cp:
        raise ConfigError(f"{key} ({cp}) must divide the {world_size} ranks: each sequence is split over {cp} "
                          "consecutive ranks, and the data-parallel size is ranks / degree")
    for name, n in split_sequence_lengths(cfg):
        if n % (2 * cp):
            raise ConfigError(f"{name} ({n}) must be divisible by 2 x {key} = {2 * cp}: context parallelism cuts "
                              f"each sequence into 2 x {cp} equal chunks")
    for refused, what in ((t.cuda_graphs, "training.cuda_graphs (the graphs replay whole sequences)"),
                          (bool(cfg.distill.teacher), "distillation ([distill] teacher)"),
                          (bool(cfg.dpo.path), "DPO ([dpo] path)"),
                          (compiles(cfg, "model"), 'torch.compile of the sublayers (compile.components "model")')):
        if refused:
            raise ConfigError(f"{key} {cp}: context parallelism does not run with {what} yet; set one of them off")
    return cp, layout


def split_sequence_lengths(cfg: JobConfig) -> list[tuple[str, int]]:
    """(key, length) of each sequence a context-parallel run splits: the training one, and the held-out one."""
    t, v = cfg.training, cfg.validation
    return [("training.seq_len", t.seq_len)] + ([("validation.seq_len", v.seq_len or t.seq_len)] if v.enable else [])


def check_context_parallel_model(cfg: JobConfig, args: ModelArgs, cp: int) -> None:
    """Each chunk of a split sequence must hold a short convolution's halo (its width - 1 previous inputs)."""
    if cp == 1 or "M" not in args.pattern:
        return
    width = getattr(args, args.mixer).conv_size
    chunk = min(n for _, n in split_sequence_lengths(cfg)) // (2 * cp)
    if chunk < width - 1:
        raise ConfigError(f"parallelism.context_parallel_degree {cp} cuts sequences into chunks of {chunk} tokens, "
                          f"fewer than the {args.mixer} convolution's {width - 1} previous inputs each needs: use "
                          "longer sequences or a lower degree")


def float8_plan(cfg: JobConfig, args: ModelArgs, dp: DataParallel, device: torch.device, cp: int = 1
                ) -> tuple[Float8Conversion | None, list[str]]:
    """Float8 training (model.converters): refused in one line where it cannot run; otherwise which linears
    convert, decided on a model of the meta device, and what the log says of it."""
    if FLOAT8 not in cfg.model.converters:
        return None, []
    settings = float8_settings(cfg)
    compiled = compiles(cfg, "model")
    refusal = float8_refusal_here(settings, device, compiled=compiled)
    if refusal is not None:
        raise ConfigError(refusal)
    sharded = dp.shard * cp > 1  # FSDP shards over the context-parallel ranks too
    conversion = plan_float8(build_model(args, "meta"), settings, fsdp_sharded=sharded)
    warnings = float8_warnings(settings, compiled=compiled, fsdp_sharded=sharded)
    if not conversion.converted:
        warnings.append(f"{FLOAT8}: no linear layer of this model gains from float8 (every one is kept: "
                        "describe lists why), so the run trains in its usual precision")
    return conversion, warnings


def schedule_in_force(cfg: JobConfig, start: StartPoint | None) -> tuple[Any, str | None]:
    """The learning-rate schedule the run follows, and what the log says of it. A resumed schedule goes on as it
    was saved: its step comes from the checkpoint, and so does its shape (warm-up, length, decay) where the
    recipe's values differ (a longer run, whose schedule follows training.steps, say), which would otherwise bend
    it mid-way: the rate could jump back up tenfold. The job config of the checkpoints that follow records the
    shape in force."""
    loaded = "lr_scheduler" not in cfg.checkpoint.exclude_from_loading and \
        "train_state" not in cfg.checkpoint.exclude_from_loading
    if start is None or start.model_only or not loaded or is_model_only(start.step_dir) or \
            os.path.basename(start.step_dir.rstrip("/")) == "step-0":
        return cfg.lr_scheduler, None
    try:
        saved = read_job_config(start.step_dir)
        saved_shape = schedule_shape(saved["lr_scheduler"], saved["training"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return cfg.lr_scheduler, None  # a checkpoint without its job config (written by other tools)
    shape = schedule_shape(dataclasses.asdict(cfg.lr_scheduler), cfg.training.steps)
    if shape == saved_shape:
        return cfg.lr_scheduler, None
    changed = ", ".join(f"{key} {shape[key]} (checkpoint: {saved_shape[key]})"
                        for key in SCHEDULE_KEYS if shape[key] != saved_shape[key])
    return (dataclasses.replace(cfg.lr_scheduler, **saved_shape),
            f"lr_scheduler: {changed}: the checkpoint's schedule goes on, held past its end {NEW_SCHEDULE}")


def check_data_files(cfg: JobConfig, tokenizer) -> list[str]:
    """The training and held-out data against what prepared them, before anything is written: no training file
    that is also held out (a glob that takes in the validation shards), and Megatron shards checked against their
    manifests (data.manifest.check_shards). ValueError (one line); returns the warnings to log."""
    training = run_record.data_files(cfg.data)
    warnings = []
    if cfg.validation.enable:
        held = run_record.data_files(held_out_data(cfg))
        both = sorted(set(training) & set(held))
        if both:
            raise ValueError(f"data.path {cfg.data.path} also takes in the held-out {both[0]}, which "
                             f"validation.data.path names: the run would train on its validation set (narrow the "
                             "glob, e.g. PREFIX_* for prepare_data.py's shards)")
        if cfg.validation.data.source == "megatron":
            warnings += check_shards(held, fingerprint(tokenizer), "validation.data.path")
    if cfg.data.source == "megatron":
        warnings = check_shards(training, fingerprint(tokenizer)) + warnings
    return warnings


def fingerprint(tokenizer) -> str | None:
    return vocabulary_fingerprint(tokenizer) if tokenizer is not None else None


def what_the_run_reads(cfg: JobConfig, global_batch: int) -> str:
    """One line for the log: the training data's files, documents and tokens, and the epochs of it that
    training.steps x the global batch x seq_len make (packing adds an EOD after every document)."""
    planned = cfg.training.steps * global_batch * cfg.training.seq_len
    summary = summarize(cfg.data)
    if summary is None:
        return f"data: {cfg.data.source} source, {planned:,} tokens over the run"
    files = f"{summary['files']} file(s), " if summary["files"] else ""
    if "all_documents" in summary:  # the counts are the slice's
        start, end = cfg.data.document_slice
        files += f"data.document_slice [{start}, {end}) of {summary['all_documents']:,} documents: "
    if summary["tokens"] is None:
        return (f"data: {files}{summary['documents']:,} documents (tokenized as they are read); the run reads "
                f"{planned:,} tokens")
    per_epoch = summary["tokens"] + summary["documents"]
    return (f"data: {files}{summary['documents']:,} documents, {summary['tokens']:,} tokens; the run reads "
            f"{planned:,} tokens ({cfg.training.steps} steps x {global_batch} x {cfg.training.seq_len}): "
            f"{planned / max(per_epoch, 1):.2f} epochs")


def check_eval_tasks(cfg: JobConfig) -> None:
    """The [eval] tasks exist (lm-eval's, or in eval.include_path): said now, not after hours of training."""
    from hybridtitan.lm_eval_model import EvalError, task_manager_for

    if cfg.eval.include_path and not os.path.isdir(cfg.eval.include_path):
        raise ConfigError(f"eval.include_path: no such folder: {cfg.eval.include_path}")
    try:
        task_manager_for(cfg.eval.tasks, cfg.eval.include_path or None)
    except EvalError as e:
        raise ConfigError(f"eval.tasks: {e}") from None


def choose_start(cfg: JobConfig) -> StartPoint | None:
    """The checkpoint the run starts from: its own folder's (the latest complete step, or checkpoint.load_step)
    first, then checkpoint.initial_load_path; refused where that would lose or undo work."""
    c = cfg.checkpoint
    folder = os.path.join(cfg.job.dump_folder, c.folder)
    steps = complete_steps(folder) if c.enable else []
    if c.enable and not steps and not c.initial_load_path and os.path.isfile(os.path.join(folder, ".metadata")):
        # e.g. python -m hybridtitan.import_hf --output DUMP/checkpoint: training from scratch beside it would
        # look like a resume that silently lost its weights
        raise ConfigError(f"{folder} holds a checkpoint itself, not in a step-N folder: move it to "
                          f"{os.path.join(folder, 'step-0')} to start from its weights (or name it in "
                          "checkpoint.initial_load_path)")
    start = _start_in(cfg, folder, steps)
    if steps and steps[-1] > 0 and "train_state" in c.exclude_from_loading:
        raise ConfigError(f"checkpoint.exclude_from_loading: train_state restarts the step count at 0 in {folder}, "
                          f"which holds step {steps[-1]}: the new checkpoints would sit below it (the next resume "
                          "would return to it, and keep_latest_k would delete them). To train on from its weights, "
                          "give it as checkpoint.initial_load_path with another job.dump_folder")
    return start


def _start_in(cfg: JobConfig, folder: str, steps: list[int]) -> StartPoint | None:
    c = cfg.checkpoint
    if c.enable and c.load_step > 0:
        try:
            step_dir = resolve_checkpoint(folder, c.load_step)
        except ValueError as e:
            raise ConfigError(f"checkpoint.load_step: {e}") from None
        newer = [s for s in steps if s > c.load_step]
        if newer:
            raise ConfigError(f"checkpoint.load_step {c.load_step} is older than step(s) "
                              f"{', '.join(map(str, newer))} in {folder}: move those folders away first (the next "
                              "resume would return to them, and keep_latest_k would delete the new ones)")
        return StartPoint(step_dir, model_only=False, description=f"resumed from {step_dir}")
    if steps:
        step_dir = os.path.join(folder, f"step-{steps[-1]}")
        # step 0 is a model-only starting point on purpose (import_hf); a later model-only step ends a run: taking
        # it as the resume point would restart at step 0 below the older full checkpoints, and keep_latest_k would
        # then delete the new ones
        if steps[-1] > 0 and is_model_only(step_dir):
            raise ConfigError(f"{step_dir} holds only the model (written by import_hf, or by "
                              "checkpoint.last_save_model_only): a run cannot go on from it, only start from it as "
                              "step-0. To train on from its weights, give it as checkpoint.initial_load_path with "
                              "another job.dump_folder")
        return StartPoint(step_dir, model_only=steps[-1] == 0,
                          description=f"resumed from {folder}/step-{steps[-1]}",
                          ignored_initial_load_path=bool(c.initial_load_path))
    if c.initial_load_path:
        try:
            step_dir = resolve_checkpoint(c.initial_load_path)
        except ValueError as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from None
        model_only = c.initial_load_model_only
        return StartPoint(step_dir, model_only,
                          description=f"initialised from {step_dir}" + (" (model only)" if model_only else ""))
    return None


def check_start(cfg: JobConfig, start: StartPoint, args: ModelArgs) -> None:
    """The starting checkpoint holds this model, and its data loader state fits this run's loader and data."""
    try:
        saved = read_folder(start.step_dir).args
    except (CheckpointError, ConversionError) as e:  # every read or parse failure of the folder, naming the file
        raise ConfigError(f"cannot start from {start.step_dir}: {first_error_line(e)}") from None
    if saved != args:
        diff = [f.name for f in dataclasses.fields(args) if getattr(saved, f.name) != getattr(args, f.name)]
        raise ConfigError(f"{start.step_dir} holds a different model than the recipe (differs in: model."
                          f"{', model.'.join(diff)}); use another job.dump_folder or the checkpoint's model")
    loads_the_loader = "dataloader" not in cfg.checkpoint.exclude_from_loading
    if not start.model_only and loads_the_loader and not is_model_only(start.step_dir):
        # A loader's state holds one position per worker: it loads only into the same data.num_workers. Said before
        # loading, since DCP and the loader refuse others in ways that name neither (a bare assertion, for one).
        for _, was, now in changed_settings(cfg, start.step_dir, ("data.num_workers",)):
            raise ConfigError(f"cannot resume from {start.step_dir}: {OTHER_WORKERS}: the checkpoint's "
                              f"data.num_workers is {was}, this run's {now}")
        run_record.check_data(start.step_dir, cfg.data)


def changed_settings(cfg: JobConfig, step_dir: str, keys: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """The job-config keys ("section.name") whose value in the step folder's job config differs from this run's, as
    (key, the checkpoint's, this run's); none where it has no job config to compare with (written by other tools)."""
    try:
        saved = read_job_config(step_dir)
        was = {key: saved[key.split(".")[0]][key.split(".")[1]] for key in keys}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    now = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in keys}
    return [(key, was[key], now[key]) for key in keys if was[key] != now[key]]

"""Loading the start point a run's preflight chose into the live training state, and saying what a resume keeps.

A resume goes on as the checkpoint left off: the model, optimizer, schedule (its shape included), data loader
position, step and RNG. Where the recipe differs from what the checkpoint carries (a longer run, another learning
rate, another shuffle or seed), the checkpoint's wins and the log says so; ``checkpoint.exclude_from_loading``
starts the named parts afresh instead.
"""

from __future__ import annotations

import logging
import math
import os

from hybridtitan.checkpoint import CheckpointManager
from hybridtitan.job_config import JobConfig
from hybridtitan.lr_schedule import apply_schedule
from hybridtitan.preflight import NEW_SCHEDULE, StartPoint, changed_settings

logger = logging.getLogger("hybridtitan")


def resume(cfg: JobConfig, start: StartPoint | None, ckpt: CheckpointManager, state) -> None:
    """Loads ``start`` (None: a fresh start) into the manager's live model, optimizer, schedule, loader and
    ``state``. Raises what DCP or the loader raise on a checkpoint that does not fit."""
    if start is None:
        return warn_about_resumed_values(cfg, ckpt, state)
    if start.ignored_initial_load_path:
        step = os.path.basename(start.step_dir).removeprefix("step-")
        logger.warning(f"checkpoint.initial_load_path {cfg.checkpoint.initial_load_path} is ignored: the run's own "
                       f"checkpoint folder holds step {step}, and a run resumes from its own first")
    ckpt.load(start.step_dir, model_only=start.model_only)
    logger.info(start.description + ("" if start.model_only else f" (step {state.step})"))
    apply_schedule(ckpt.lr_scheduler)  # the rates of the schedule in force, whichever parts were loaded
    if state.step > 0 and "dataloader" not in cfg.checkpoint.exclude_from_loading:
        warn_about_the_kept_data_order(cfg, start.step_dir)
    warn_about_resumed_values(cfg, ckpt, state)


def warn_about_the_kept_data_order(cfg: JobConfig, step_dir: str) -> None:
    """The resumed data loader goes on in the checkpoint's order: a changed data.shuffle or debug.seed would have
    no effect on it, which is said rather than left silent."""
    changed = [f"{key} {now} (checkpoint: {was})"
               for key, was, now in changed_settings(cfg, step_dir, ("data.shuffle", "debug.seed"))]
    if changed:
        logger.warning(f"{', '.join(changed)}: the resumed data loader goes on in the checkpoint's order; to start "
                       "the data anew in the new order, add dataloader to checkpoint.exclude_from_loading")


def warn_about_resumed_values(cfg: JobConfig, ckpt: CheckpointManager, state) -> None:
    """What a resume takes from the checkpoint over the recipe, said where the two differ."""
    if state.step >= cfg.training.steps:
        logger.warning(f"the checkpoint is at step {state.step} and training.steps is {cfg.training.steps}: nothing "
                       "to train (raise training.steps to go on)")
    saved = [lr for s in ckpt.lr_scheduler.schedulers for lr in s.base_lrs]
    if state.step > 0 and any(not math.isclose(lr, cfg.optimizer.lr) for lr in saved):
        logger.warning(f"optimizer.lr {cfg.optimizer.lr} differs from the resumed schedule's {saved[0]}: the "
                       f"checkpoint's schedule goes on {NEW_SCHEDULE}")

"""The learning-rate schedule: linear warm-up, an optional stable phase, then linear, sqrt or cosine decay to
``lr * min_lr_factor``, held there past its end.

torchtitan 0.2.2's schedule and settings (``[lr_scheduler]``: warmup_steps, total_steps, decay_ratio, decay_type,
min_lr_factor), with the same factors at every step of the schedule, and its checkpoint state (one LambdaLR's,
whose factor functions are partial objects with nothing of their own to save): a run resumes from either's
checkpoints. Two differences, both past the schedule's end (total_steps shorter than the run, or a schedule
resumed with a reset step): the rate stays at the floor, where torchtitan's decay goes on below it, to negative
rates that would train the model backwards (and its cosine back up); and a schedule left no decay steps stays
flat, where torchtitan's fails an assertion.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from hybridtitan.job_config import JobConfig

logger = logging.getLogger("hybridtitan")

SCHEDULE_KEYS = ("warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor")
DECAYS = {
    "linear": lambda progress: 1.0 - progress,
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def lr_factor(step: int, warmup_steps: int, stable_steps: int, decay_steps: int, decay_type: str,
              min_lr_factor: float) -> float:
    """The factor of the peak rate for the update after ``step`` updates (0-indexed): up in equal steps over the
    warm-up to 1 at its last step, 1 over the stable steps, then down to min_lr_factor at the schedule's last
    step, and min_lr_factor after it."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < warmup_steps + stable_steps or decay_steps == 0:
        return 1.0
    progress = min((step + 1 - warmup_steps - stable_steps) / decay_steps, 1.0)
    return min_lr_factor + (1.0 - min_lr_factor) * DECAYS[decay_type](progress)


def schedule_steps(lr_scheduler, training_steps: int) -> dict:
    """lr_factor's step counts and settings for an ``[lr_scheduler]`` section: total_steps (training.steps unless
    set) split into warm-up, stable and decay (the whole rest, or decay_ratio of the total). The stable phase has
    one step more than the schedule's, so that its last step does not decay to the floor yet (torchtitan's
    "virtual last step")."""
    total = lr_scheduler.total_steps if lr_scheduler.total_steps is not None else training_steps
    warmup = int(lr_scheduler.warmup_steps)
    if warmup > total:
        logger.warning(f"Warmup steps ({warmup}) exceed total steps ({total}). Adjusting warmup steps to {total}.")
        warmup = total
    decay = total - warmup
    if lr_scheduler.decay_ratio is not None:
        decay = round(total * lr_scheduler.decay_ratio)
        if warmup + decay > total:
            logger.warning(f"Warmup ({warmup}) + decay ({decay}) steps exceed total steps ({total}). "
                           f"Adjusting decay steps to {total - warmup}.")
            decay = total - warmup
    return dict(warmup_steps=warmup, stable_steps=total + 1 - warmup - decay, decay_steps=decay,
                decay_type=lr_scheduler.decay_type, min_lr_factor=lr_scheduler.min_lr_factor)


class LRSchedule:
    """The schedule of an optimizer, stepped once per update; its state is its LambdaLR's (the step count)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_scheduler, training_steps: int):
        # a partial object, not a closure: LambdaLR's state_dict keeps a callable object's __dict__ (empty here)
        factor = functools.partial(lr_factor, **schedule_steps(lr_scheduler, training_steps))
        self.schedulers = [LambdaLR(optimizer, factor)]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(copy.deepcopy(state_dict))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig) -> LRSchedule:
    return LRSchedule(optimizer, cfg.lr_scheduler, cfg.training.steps)


def schedule_shape(lr_scheduler: dict, training_steps: int) -> dict:
    """The settings a schedule's shape follows (``lr_scheduler`` as a dict), total_steps resolved: training.steps
    unless it is set."""
    shape = {key: lr_scheduler.get(key) for key in SCHEDULE_KEYS}
    if shape["total_steps"] is None:
        shape["total_steps"] = training_steps
    return shape


def apply_schedule(schedule: LRSchedule) -> None:
    """Sets each parameter group's learning rate to its schedule's at the schedule's step. A resume loads the
    optimizer's rates and the schedule's step apart: with either left out of loading (a fresh optimizer on a
    resumed schedule, or a new schedule on a resumed optimizer) the first step would otherwise run at the rate the
    other one holds; the schedule writes the rates only when it steps."""
    for scheduler in schedule.schedulers:
        for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(scheduler.last_epoch)


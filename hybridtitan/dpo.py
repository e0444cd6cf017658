"""DPO in the train loop, the third upcycling stage (docs/dpo.md). A frozen reference sits beside the student, and the
loss is the sigmoid DPO loss of preference pairs (hybridtitan.ops.dpo) over the responses' summed log-probabilities.

    reference = check_reference(cfg, student_args, tokenizer, start)    preflight: one line, exit code 2
    optimizer = PreferenceOptimizer(cfg.dpo, reference, mesh, ...)       the Trainer: the reference sharded as a
    for loss, parts in optimizer.losses(model, batch):                   distillation teacher (distill.frozen_model)
        loss.backward()

A micro-batch holds B pairs as 2B rows: the chosen rows, then the rejected ones (hybridtitan.data.preference). Their
labels count only the responses' tokens. The reference's forward runs without gradients, and the student's runs over all
2B rows at once. The loss is summed over the pairs, and the loop divides it by the global batch's count of pairs. So the
step is the same for any split into micro-batches and ranks.

By default the reference is the checkpoint the stage starts from: the run's own step-0, else
checkpoint.initial_load_path, as in preflight.choose_start. It is resolved to a step folder once. The run's job config
records that folder as dpo.reference, and a resume reads it there. So a newer step in the folder that initial_load_path
names does not change the reference mid-run."""

from __future__ import annotations

import functools
import logging
import os

import torch

from hybridtitan.checkpoint import CheckpointError, read_job_config, resolve_checkpoint
from hybridtitan.config_manager import ConfigError
from hybridtitan.data.loader import IGNORE_INDEX
from hybridtitan.distill import Teacher, check_frozen, frozen_model
from hybridtitan.job_config import JobConfig
from hybridtitan.models import ModelArgs
from hybridtitan.ops.dpo import dpo_loss, sequence_logprobs

logger = logging.getLogger("hybridtitan")

# the terms a training step logs (as the loss: means over the step's pairs), and those a validation logs
TRAIN_PARTS = ("dpo/train_accuracy", "dpo/train_margin")
VALIDATION_PARTS = ("dpo/accuracy", "dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward")


def reference_path(cfg: JobConfig, start) -> str:
    """The reference's folder: dpo.reference, else the step folder the stage started from (module docstring)."""
    d, c = cfg.dpo, cfg.checkpoint
    if d.reference:
        return d.reference
    if start is not None and not start.model_only:  # a resume: the reference its run recorded
        try:
            recorded = read_job_config(start.step_dir).get("dpo", {}).get("reference")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded:
            return recorded
    own = os.path.join(cfg.job.dump_folder, c.folder, "step-0")
    if c.enable and os.path.isfile(os.path.join(own, ".metadata")):
        return own
    if c.initial_load_path:
        try:
            return resolve_checkpoint(c.initial_load_path)
        except (CheckpointError, ValueError) as e:
            raise ConfigError(f"dpo.reference: {e}") from None
    raise ConfigError("dpo.reference: the run starts from no checkpoint (no checkpoint.initial_load_path, no step-0 "
                      "in its checkpoint folder), so there is no model to take as the reference: name one")


def check_reference(cfg: JobConfig, student: ModelArgs, tokenizer, start) -> Teacher | None:
    """The frozen reference of a DPO run, checked as a distillation teacher is (distill.check_frozen). None where the
    recipe is not DPO."""
    if not cfg.dpo.path:
        return None
    return check_frozen(reference_path(cfg, start), "dpo.reference", cfg, student, tokenizer)


def dpo_flops_per_token(args, seq_len: int, reference: Teacher) -> float:
    """The training FLOPs per token of a DPO step: the student's forward and backward and the reference's forward
    (models/flops.py). The output layer is counted whole, although it is formed on the response tokens alone."""
    from hybridtitan.models.flops import flops_per_token

    return flops_per_token(args, seq_len)["total"] + flops_per_token(reference.args, seq_len)["total"] / 3


class PreferenceOptimizer:
    """The reference and the DPO loss of one run."""

    def __init__(self, d, reference: Teacher, mesh, device: torch.device, kernels, param_dtype: torch.dtype,
                 chunk_size: int):
        self.d, self.chunk_size = d, chunk_size
        self.reference, source, n_params = frozen_model(reference, mesh, device, kernels, param_dtype)
        logger.info(f"DPO reference: {source}, pattern {reference.args.pattern}, {n_params:,} parameters (sharded, "
                    f"{str(param_dtype).removeprefix('torch.')}); loss = -log sigmoid({d.beta} x ((pi_c - ref_c) - "
                    "(pi_r - ref_r))) over the responses' summed log-probabilities")

    def _logprobs(self, model, batch: dict) -> torch.Tensor:
        head = functools.partial(_logprobs_head, labels=batch["labels"], chunk_size=self.chunk_size)
        return model(batch["input_ids"], head=head)

    def _pairs(self, model, batch: dict):
        """(loss, chosen reward, rejected reward) per pair of the micro-batch."""
        with torch.no_grad():
            ref = self._logprobs(self.reference, batch)
        policy = self._logprobs(model, batch)
        pairs = policy.shape[0] // 2
        return dpo_loss(policy[:pairs], policy[pairs:], ref[:pairs], ref[pairs:], self.d.beta)

    def losses(self, model, batch: dict) -> list[tuple[torch.Tensor, dict]]:
        """[(the DPO loss summed over the pairs, {term: summed value})] from one forward of the student."""
        loss, chosen, rejected = self._pairs(model, batch)
        margin = chosen - rejected
        return [(loss.sum(), dict(zip(TRAIN_PARTS, ((margin > 0).float().sum(), margin.sum()))))]

    @torch.no_grad()
    def held_out(self, model, batch: dict) -> torch.Tensor:
        """[loss, accuracy, margin, chosen reward, rejected reward, pairs], summed over a held-out batch's pairs. The
        accuracy counts the pairs whose chosen response the student prefers more than the reference does (a positive
        margin)."""
        loss, chosen, rejected = self._pairs(model, batch)
        margin = chosen - rejected
        return torch.stack([loss.sum(), (margin > 0).float().sum(), margin.sum(), chosen.sum(), rejected.sum(),
                            torch.tensor(float(len(loss)), device=loss.device)]).double()


def _logprobs_head(hidden: torch.Tensor, weight: torch.Tensor, *, labels: torch.Tensor, chunk_size: int):
    return sequence_logprobs(hidden, weight, labels, ignore_index=IGNORE_INDEX, chunk_size=chunk_size)

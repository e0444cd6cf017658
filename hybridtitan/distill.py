"""Distillation in the train loop: a frozen teacher beside the student, and the losses that the recipe's [distill]
section weighs (Zebra-Llama's and HyLo's recipes; docs/upcycling.md).

    teacher = check_teacher(cfg, student_args, tokenizer)     preflight: a teacher that does not fit the student
                                                              is one line, exit code 2, before anything is written
    distiller = Distiller(cfg.distill, teacher, mesh, ...)    the Trainer: the teacher built, loaded and sharded
    for loss, parts in distiller.losses(model, batch):        a micro-batch: the teacher's forward without
        loss.backward()                                       gradients, then the student's forward(s)

The teacher is a HybridLM like the student; a Llama is a pattern of grouped-query attention and MLPs. It is built and
sharded with FSDP2 the same way, with its parameters in the training's 16-bit dtype on GPUs. It takes no gradient, has
no optimizer state and is never in a checkpoint; a resume reads it again from its folder.

Each micro-batch has these losses:

* KL and cross-entropy (kl_weight, ce_weight). The student's forward ends in ``ops.linear_kl_div`` over its final
  hidden states and output weight and the teacher's, one chunk of tokens at a time.
* Layer distillation (layer_weight). The student runs its ``teacher_forced`` forward, with each block fed the
  teacher's stream. Per block, it takes the L2 distance of the block's output, and of its mixing sublayer's
  output, from the teacher's (``ops.layer_distance``), summed over the blocks.

Each loss is a sum over the counted tokens, with the EOD mask and ignored labels as for the cross-entropy. The loop
divides it by the global batch's count. So the step is the same for any split into micro-batches and ranks."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from hybridtitan.config_manager import ConfigError
from hybridtitan.data.loader import IGNORE_INDEX
from hybridtitan.data.tokenizer import vocabulary_fingerprint
from hybridtitan.errors import ConversionError
from hybridtitan.job_config import JobConfig
from hybridtitan.models import ModelArgs
from hybridtitan.models.flops import flops_per_token
from hybridtitan.models.model import StreamRecord
from hybridtitan.ops.kl_div import layer_distance

logger = logging.getLogger("hybridtitan")


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A frozen model that preflight found to fit the student: a distillation teacher, or DPO's reference."""

    path: str
    args: ModelArgs
    warning: str | None = None  # what the run's log should say of it


def check_frozen(path: str, key: str, cfg: JobConfig, student: ModelArgs, tokenizer) -> Teacher:
    """Checks a frozen model beside the student (recipe key ``key``) without reading its weights. It must be a model
    folder that loads, with the student's vocabulary size and tokenizer. Raises ConfigError (one line) otherwise."""
    # imported here: the Hugging Face side (a second of start-up) only where a frozen model is read
    from hybridtitan.checkpoint import CheckpointError
    from hybridtitan.hf.convert import load_tokenizer
    from hybridtitan.model_folder import read_folder

    try:
        held = read_folder(path)
        args, frozen_tokenizer = held.args, held.tokenizer
        frozen_tok = load_tokenizer(frozen_tokenizer) if frozen_tokenizer else None
    except (CheckpointError, ConversionError) as e:
        raise ConfigError(f"{key}: {e}") from None
    if args.vocab_size != student.vocab_size:
        raise ConfigError(f"{key} {path} has a vocabulary of {args.vocab_size}, the student "
                          f"{student.vocab_size}: the two models' distributions are compared token by token")
    warning = None
    if frozen_tok is None:
        warning = f"{key} {path} names no tokenizer: that it encodes as data.tokenizer cannot be checked"
    elif tokenizer is not None and vocabulary_fingerprint(frozen_tok) != vocabulary_fingerprint(tokenizer):
        raise ConfigError(f"{key} {path}: its tokenizer ({frozen_tokenizer}) differs from "
                          f"data.tokenizer ({cfg.data.tokenizer}): the same ids would mean other tokens")
    return Teacher(path, args, warning)


def check_teacher(cfg: JobConfig, student: ModelArgs, tokenizer) -> Teacher | None:
    """The [distill] teacher, checked against the student without reading its weights (check_frozen). For layer
    distillation it must also have the same sublayer structure and width. Raises ConfigError (one line) otherwise.
    Returns None where the recipe names no teacher."""
    d = cfg.distill
    if not d.teacher:
        return None
    teacher = check_frozen(d.teacher, "distill.teacher", cfg, student, tokenizer)
    args = teacher.args
    if d.layer_weight:
        structure = [k == "mlp" for k in args.kinds], [k == "mlp" for k in student.kinds]
        if structure[0] != structure[1] or args.dim != student.dim:
            raise ConfigError(f"distill.layer_weight: layer distillation pairs each block of the student with the "
                              f"teacher's, but the teacher ({args.pattern}, dim {args.dim}) and the student "
                              f"({student.pattern}, dim {student.dim}) differ in their MLPs' places or width")
        if student.kinds[0] == "mlp":
            raise ConfigError(f"distill.layer_weight: the pattern {student.pattern} starts with an MLP; layer "
                              "distillation's blocks start with attention or a mixer")
    return teacher


def training_flops_per_token(args, seq_len: int, d, teacher) -> float:
    """The training FLOPs per token of a step (models/flops.py).

    They are the student's forward and backward. With a teacher (hybridtitan.distill) they add its forward without the
    output layer, and the teacher's logits that the KL forms. For layer distillation they add the student's
    teacher-forced pass over its sublayers, without the output layer."""
    student = flops_per_token(args, seq_len)
    if teacher is None:
        return student["total"]
    t = flops_per_token(teacher.args, seq_len)
    total = (t["total"] - t["output_layer"]) / 3
    if d.kl_weight or d.ce_weight:
        total += student["total"] + 2 * teacher.args.dim * teacher.args.vocab_size
    if d.layer_weight:
        total += student["total"] - student["output_layer"]
    return total


def _keep(hidden: torch.Tensor, output_weight: torch.Tensor):
    # the output weight is FSDP's gathered copy only while the forward runs: kept as a copy
    return hidden, output_weight.detach().clone()


def frozen_model(frozen: Teacher, mesh, device: torch.device, kernels, param_dtype: torch.dtype):
    """(model, how to name its source, its parameter count) of a frozen model, such as a teacher or a reference.

    It is built and sharded with FSDP2 as the student is, in ``param_dtype``. Each rank reads only its shard of the
    weights (model_loader.load_into_shards), never the whole. It takes no gradient, has no optimizer state and is never
    in a checkpoint; a resume reads it again from its folder."""
    from hybridtitan.model_loader import load_into_shards
    from hybridtitan.models import build_model
    from hybridtitan.parallel import parallelize

    model = build_model(frozen.args, "meta", kernels).to(param_dtype)
    # every module frees its gathered parameters after its forward (the root too: no backward needs them)
    parallelize(model, mesh, ac_mode="none", ac_every=1, compile_model=False, param_dtype=param_dtype,
                reduce_dtype=param_dtype, reshard_after_forward="always")
    model.to_empty(device=device)
    source = load_into_shards(model, frozen.path)  # each rank reads its shard alone, never the whole model
    return model.requires_grad_(False).eval(), source, sum(p.numel() for p in model.parameters())


class Distiller:
    """The teacher and the losses of one run."""

    def __init__(self, d, teacher: Teacher, mesh, device: torch.device, kernels, param_dtype: torch.dtype):
        self.d, self.kernels = d, kernels
        self.teacher, source, n_params = frozen_model(teacher, mesh, device, kernels, param_dtype)
        logger.info(f"distillation teacher: {source}, pattern {teacher.args.pattern}, {n_params:,} "
                    f"parameters (sharded, {str(param_dtype).removeprefix('torch.')}); loss = {d.kl_weight} x T^2 x KL "
                    f"+ {d.ce_weight} x CE + {d.layer_weight} x layer distance, T = {d.temperature}")

    @torch.no_grad()
    def teacher_forward(self, batch: dict, collect: bool):
        """The teacher's final hidden states, its output weight and, with ``collect``, its residual stream at every
        sublayer."""
        streams = StreamRecord() if collect else None
        hidden, weight = self.teacher(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), head=_keep,
                                      collect=streams)
        return hidden, weight, streams

    def losses(self, model, batch: dict) -> list[tuple[torch.Tensor, dict]]:
        """(summed weighted loss, {part: summed value}) for each student forward of this micro-batch, each to be
        backpropagated. The forwards are the KL and cross-entropy forward, the layer-distillation forward, or both."""
        d = self.d
        hidden, weight, streams = self.teacher_forward(batch, collect=bool(d.layer_weight))
        out = []
        if d.kl_weight or d.ce_weight:
            head = functools.partial(self.kernels.linear_kl_div, t_hidden=hidden, t_weight=weight,
                                     targets=batch["labels"], temperature=d.temperature, kl_weight=d.kl_weight,
                                     ce_weight=d.ce_weight, ignore_index=IGNORE_INDEX, chunk_size=d.chunk_size)
            loss, kl, ce, _ = model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), head=head)
            out.append((loss, {"kl": kl, "ce": ce} if d.ce_weight else {"kl": kl}))
        if d.layer_weight:
            valid = batch["labels"] != IGNORE_INDEX
            total = torch.zeros((), dtype=torch.float32, device=valid.device)
            outputs = model.teacher_forced(list(streams[:-1]), cu_seqlens=batch.get("cu_seqlens"))
            for block, (stream, mixed) in zip(model.blocks(), outputs):
                total = total + layer_distance(stream, streams[block.stop], valid) + \
                    layer_distance(mixed, streams[block.start + 1] - streams[block.start], valid)
            out.append((d.layer_weight * total, {"layer": total.detach()}))
        return out

    @torch.no_grad()
    def held_out(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, summed KL at temperature 1, counted tokens) of a held-out batch."""
        hidden, weight, _ = self.teacher_forward(batch, collect=False)
        head = functools.partial(self.kernels.linear_kl_div, t_hidden=hidden, t_weight=weight, targets=batch["labels"],
                                 ignore_index=IGNORE_INDEX, chunk_size=self.d.chunk_size)
        _, kl, ce, count = model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), head=head)
        return ce, kl, count

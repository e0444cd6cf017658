"""What a model folder holds: its kind, the model's arguments and the tokenizer that goes with it, read without
its weights. The one answer for a run's start point and teacher (preflight, distill), the model loader and export.

    held = read_folder("outputs/run/checkpoint")   # ModelFolder(kind="dcp", path=".../step-8", args=..., tokenizer=...)

A path is a DCP step folder of ours (``model_args.json`` beside the shards), a checkpoint folder or a dump folder
(the latest complete step, or ``step``), or a Hugging Face folder (``config.json``): a Llama, an FLA GDN/KDA model or
a hybridtitan export. Every failure a person can cause is a CheckpointError or ConversionError of one line.
"""

from __future__ import annotations

import dataclasses
import os

from hybridtitan.checkpoint import JOB_CONFIG_FILE, load_model_args, read_job_config, resolve_checkpoint
from hybridtitan.data.config import resolve_path
from hybridtitan.errors import CheckpointError, ConversionError, first_error_line
from hybridtitan.models import ModelArgs

DCP = "dcp"  # a step folder of ours
HF = "hf"  # a Hugging Face folder
TOKENIZER_FOLDER = "tokenizer"  # the tokenizer an import or an upcycling saves inside its step folder


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """What a model folder holds."""

    kind: str  # DCP or HF
    path: str  # the step folder a checkpoint or dump folder resolves to; a Hugging Face folder itself
    args: ModelArgs
    tokenizer: str | None  # a tokenizer folder or hub name; None where the folder names none
    model_type: str = ""  # a Hugging Face folder's config.json model_type

    @property
    def source(self) -> str:
        """How a log names it."""
        return f"DCP checkpoint {self.path}" if self.kind == DCP else f"HF folder {self.path} ({self.model_type})"

    def tokenizer_or(self, given: str | None) -> str:
        """The tokenizer to load: ``given`` (a --tokenizer), else the folder's. A Hugging Face folder is its own
        (loading says what it lacks); ConversionError where a step folder names none."""
        if given:
            return given
        if self.kind == HF:
            return self.path
        if not self.tokenizer:
            raise ConversionError(f"{self.path} names no tokenizer (no {JOB_CONFIG_FILE}); pass --tokenizer")
        return self.tokenizer


def read_folder(path: str, step: int | None = None) -> ModelFolder:
    """What the model folder ``path`` holds (``step``: that step of a checkpoint or dump folder)."""
    if is_hf(path):
        if step is not None:
            raise ConversionError(f"--step: {path} is a Hugging Face folder, which holds one model (no steps)")
        # imported here: the Hugging Face side takes seconds to import, and a run's checks read step folders only
        from hybridtitan.hf.convert import model_args_from_hf_config, read_hf_config

        config = read_hf_config(path)
        return ModelFolder(HF, path, model_args_from_hf_config(config, path), path if has_tokenizer(path) else None,
                           str(config.get("model_type")))
    step_dir = resolve_checkpoint(path, step)
    return ModelFolder(DCP, step_dir, load_model_args(step_dir), _step_tokenizer(step_dir))


def is_hf(path: str) -> bool:
    """A Hugging Face folder: one with a config.json (hf.convert.is_hf_folder's test, without importing it)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer_config.json"))


def _step_tokenizer(step_dir: str) -> str | None:
    """The tokenizer a step folder was trained with: its job_config.json's data.tokenizer (a path inside the
    package resolved as the trainer does), else the tokenizer folder saved inside it (import_hf, upcycle)."""
    path = os.path.join(step_dir, JOB_CONFIG_FILE)
    if os.path.isfile(path):
        try:
            data = read_job_config(step_dir).get("data") or {}
        except (OSError, ValueError, AttributeError) as e:  # JSONDecodeError is a ValueError; a list, not a dict
            raise CheckpointError(f"cannot read {path}: {first_error_line(e)}") from None
        tok = data.get("tokenizer") if isinstance(data, dict) else None
        if tok:
            return resolve_path(tok)
    inside = os.path.join(step_dir, TOKENIZER_FOLDER)
    return inside if os.path.isdir(inside) else None

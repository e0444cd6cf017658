"""Any model folder -> HybridLM and tokenizer: the one place that reads a model for evaluation, generation,
upcycling and a distillation teacher.

    model, tokenizer, source = load("outputs/run/checkpoint", device="cuda", dtype="bfloat16")
    args, state, source = read_model("hf/Llama-3.2-1B")         # the weights alone, no model built

A path may be a DCP step folder, a checkpoint folder or a dump folder (the latest complete step, or ``step``), or a
Hugging Face folder: a Llama (LlamaForCausalLM), an FLA GatedDeltaNet/KDA model or a hybridtitan export. Every
failure a person can cause is a CheckpointError or ConversionError of one line.
"""

from __future__ import annotations

import os

import torch

from hybridtitan.checkpoint import load_model_args, read_dcp_model_state, resolve_checkpoint
from hybridtitan.errors import ConversionError
from hybridtitan.hf.convert import (
    checkpoint_tokenizer,
    is_hf_folder,
    load_tokenizer,
    model_args_from_hf_config,
    model_from_state,
    read_hf_config,
    read_hf_model,
)
from hybridtitan.models import HybridLM, ModelArgs


def is_hf(path: str) -> bool:
    return os.path.isdir(path) and is_hf_folder(path)


def read_model(path: str, step: int | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor], str]:
    """(model arguments, tensors under HybridLM's names in their stored dtype, how to name the source)."""
    if is_hf(path):
        if step is not None:
            raise ConversionError(f"--step: {path} is a Hugging Face folder, which holds one model (no steps)")
        args, state, model_type = read_hf_model(path)
        return args, state, f"HF folder {path} ({model_type})"
    step_dir = resolve_checkpoint(path, step)
    args = load_model_args(step_dir)
    return args, read_dcp_model_state(step_dir, args), f"DCP checkpoint {step_dir}"


def read_model_args(path: str, step: int | None = None) -> ModelArgs:
    """The model arguments of a model folder, without reading its weights."""
    if is_hf(path):
        return model_args_from_hf_config(read_hf_config(path), path)
    return load_model_args(resolve_checkpoint(path, step))


def tokenizer_path(path: str, step: int | None = None) -> str | None:
    """The tokenizer that goes with a model folder: an HF folder's own, a checkpoint's data.tokenizer (or the
    tokenizer folder an import saved inside it)."""
    if is_hf(path):
        return path if has_tokenizer(path) else None
    return checkpoint_tokenizer(resolve_checkpoint(path, step))


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer_config.json"))


def load(path: str, *, step: int | None = None, device: str | torch.device = "cpu", dtype: str = "float32",
         tokenizer: str | None = None) -> tuple[HybridLM, object, str]:
    """(HybridLM in eval mode, its tokenizer, how to name the source). The tokenizer is checked against the model's
    vocabulary before the weights are read."""
    if is_hf(path):
        args, state, source = read_model(path, step)
        tok = load_tokenizer(tokenizer or path, args.vocab_size)
    else:
        step_dir = resolve_checkpoint(path, step)
        args = load_model_args(step_dir)
        tok_path = tokenizer or checkpoint_tokenizer(step_dir)
        if not tok_path:
            raise ConversionError(f"{step_dir} names no tokenizer (no job_config.json); pass --tokenizer")
        tok = load_tokenizer(tok_path, args.vocab_size)
        state, source = read_dcp_model_state(step_dir, args), f"DCP checkpoint {step_dir}"
    model = model_from_state(args, state, getattr(torch, dtype), device, source=path)
    return model.eval(), tok, source

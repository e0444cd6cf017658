"""Any model folder -> HybridLM and tokenizer: the one place that reads a model for evaluation, generation,
upcycling and a distillation teacher.

    model, tokenizer, source = load("outputs/run/checkpoint", device="cuda", dtype="bfloat16")
    args, state, source = read_model("hf/Llama-3.2-1B")         # the weights alone, no model built

What a folder holds without its weights (its model arguments, its tokenizer) is hybridtitan.model_folder's.

A path may be a DCP step folder, a checkpoint folder or a dump folder (the latest complete step, or ``step``), or a
Hugging Face folder: a Llama (LlamaForCausalLM), an FLA GatedDeltaNet/KDA model or a hybridtitan export. Every
failure a person can cause is a CheckpointError or ConversionError of one line.
"""

from __future__ import annotations

import torch

from hybridtitan.checkpoint import read_dcp_model_state
from hybridtitan.hf.convert import load_tokenizer, model_from_state, read_hf_model
from hybridtitan.model_folder import HF, ModelFolder, read_folder
from hybridtitan.models import HybridLM, ModelArgs


def read_model(path: str, step: int | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor], str]:
    """(model arguments, tensors under HybridLM's names in their stored dtype, how to name the source)."""
    held = read_folder(path, step)
    return held.args, _read_state(held), held.source


def _read_state(held: ModelFolder) -> dict[str, torch.Tensor]:
    return read_hf_model(held.path)[1] if held.kind == HF else read_dcp_model_state(held.path, held.args)


def load(path: str, *, step: int | None = None, device: str | torch.device = "cpu", dtype: str = "float32",
         tokenizer: str | None = None) -> tuple[HybridLM, object, str]:
    """(HybridLM in eval mode, its tokenizer, how to name the source). The tokenizer is checked against the model's
    vocabulary before the weights are read."""
    held = read_folder(path, step)
    tok = load_tokenizer(held.tokenizer_or(tokenizer), held.args.vocab_size)
    model = model_from_state(held.args, _read_state(held), getattr(torch, dtype), device, source=path)
    return model.eval(), tok, held.source

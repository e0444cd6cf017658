"""Any model folder -> HybridLM and tokenizer: the one place that reads a model for evaluation, generation,
upcycling and a distillation teacher.

    model, tokenizer, source = load("outputs/run/checkpoint", device="cuda", dtype="bfloat16")
    args, state, source = read_model("hf/Llama-3.2-1B")         # the weights alone, no model built
    source = load_into_shards(sharded_model, "hf/Llama-3.2-1B")  # each rank reads the rows it holds alone

What a folder holds without its weights (its model arguments, its tokenizer) is hybridtitan.model_folder's.

A path may be a DCP step folder, a checkpoint folder or a dump folder (the latest complete step, or ``step``), or a
Hugging Face folder: a Llama (LlamaForCausalLM), an FLA GatedDeltaNet/KDA model or a hybridtitan export. Every
failure a person can cause is a CheckpointError or ConversionError of one line.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from hybridtitan.checkpoint import read_dcp_model_state, read_dcp_shards
from hybridtitan.errors import CheckpointError, ConversionError
from hybridtitan.hf.convert import hf_tensor_files, load_tokenizer, model_from_state, read_hf_model
from hybridtitan.model_folder import HF, ModelFolder, read_folder
from hybridtitan.models import HybridLM, ModelArgs


def read_model(path: str, step: int | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor], str]:
    """(model arguments, tensors under HybridLM's names in their stored dtype, how to name the source)."""
    held = read_folder(path, step)
    return held.args, _read_state(held), held.source


def load_into_shards(model: HybridLM, path: str) -> str:
    """Fills a model whose parameters FSDP2 has sharded (and materialised) with the weights of ``path``, every
    rank reading the rows it holds and no more (a teacher of 8B is 16 GB whole: on every rank of a node, 128 GB):
    a DCP folder through DCP's sharded load, a safetensors folder by row ranges. Returns how to name the source.
    A folder of pytorch_model.bin alone cannot be read in part: each rank reads it whole and keeps its rows."""
    held = read_folder(path)
    state = get_model_state_dict(model)
    if held.kind != HF:
        read_dcp_shards(held.path, held.args, state)
        return held.source
    try:
        _, where = hf_tensor_files(held.path)
        read = None
    except ConversionError:
        where, read = {}, read_hf_model(held.path)[1]
    from safetensors import safe_open

    filled = set()
    for key, param in state.items():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.data_ptr() in filled and local.numel():  # a tied weight, filled under its other name
            continue
        start, stop = _rows(param)
        if read is not None:
            rows = read[key][start:stop]
        elif key not in where:
            raise CheckpointError(f"{held.path} lacks tensor {key} of the model its config.json describes")
        else:
            file, name = where[key]
            with safe_open(file, framework="pt") as f:
                rows = f.get_slice(name)[start:stop]
        if tuple(rows.shape) != tuple(local.shape):
            raise CheckpointError(f"{held.path}: tensor {key} holds {tuple(rows.shape)} where this rank's shard of "
                                  f"the model is {tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(rows)
        filled.add(local.data_ptr())
    return held.source


def _rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of dimension 0 this rank holds of a parameter FSDP2 has sharded (torch.chunk's
    split: ceil(n / shards) rows each, the last ones fewer or none)."""
    n = param.shape[0] if param.dim() else 1
    if not isinstance(param, DTensor):
        return 0, n
    start, stop = 0, n
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"a parameter sharded on dimension {placement.dim}: FSDP2 shards dimension 0")
            size, coord = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
            chunk = -(-(stop - start) // size)
            start, stop = min(start + coord * chunk, stop), min(start + (coord + 1) * chunk, stop)
    return start, stop


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

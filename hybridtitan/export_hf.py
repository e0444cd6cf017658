"""DCP checkpoint -> Hugging Face folder: safetensors, config.json, generation_config.json, tokenizer.

    python -m hybridtitan.export_hf --checkpoint outputs/gdn_300M/checkpoint/step-4768 --output hf/gdn_300M

The model tensors are read straight from the DCP folder. It may be a step folder, a checkpoint folder or a dump folder;
the latter two give the latest complete step, or --step N.

The layout depends on the model:

* A Llama (grouped-query attention and MLPs alone) is written as transformers' LlamaForCausalLM.
* Pure GDN and KDA models are written in FLA's own layouts (GatedDeltaNetForCausalLM, KDAForCausalLM).
  ``import fla`` and ``AutoModelForCausalLM.from_pretrained`` load them without hybridtitan.
* Every other model (MLA hybrids, Mamba2) is written in hybridtitan's own layout (``model_type: hybridtitan``).

A folder in hybridtitan's layout carries the package's own model code. Its modules are written flat beside config.json
(hybridtitan.hf.remote) and named by ``auto_map``. It loads with ``trust_remote_code=True`` where only torch and
transformers are installed, using FLA's kernels on GPUs where FLA imports, and it runs exactly what hybridtitan runs.
Where hybridtitan is imported, its registered classes load the folder. ``--format hybridtitan`` writes a GDN or KDA
model in our layout too.

The folder is written next to the output under a temporary name and renamed into place once complete. So an interrupted
export leaves nothing that looks finished. An existing output folder that is not empty is refused. --overwrite replaces
an earlier export (only the files an export writes), never a folder of other things."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings

from hybridtitan.cli import OneLineParser, fail, one_line_errors, parse_size

DTYPES = ("bfloat16", "float32", "float16")
FORMATS = ("auto", "llama", "fla", "hybridtitan")


def _max_position_embeddings(step_dir: str) -> int:
    from hybridtitan.checkpoint import read_job_config

    try:
        return int(read_job_config(step_dir)["training"]["seq_len"])
    except (OSError, KeyError, TypeError, ValueError):
        return 2048


def export(checkpoint: str, output: str, *, step: int | None = None, dtype: str = "bfloat16",
           tokenizer: str | None = None, overwrite: bool = False, format: str = "auto",
           max_shard_size: int | None = None) -> str:
    """Writes the Hugging Face folder ``output`` from a DCP checkpoint. Returns the layout written: "llama", "fla" or
    "hybridtitan". Raises CheckpointError or ConversionError, in one line, on bad input, before anything is written."""
    import torch

    from hybridtitan.checkpoint import read_dcp_model_state
    from hybridtitan.hf.convert import (
        DEFAULT_MAX_SHARD_SIZE,
        ConversionError,
        fla_config,
        fla_layout_problem,
        load_tokenizer,
        output_problem,
        publish_folder,
        to_fla_key,
        write_safetensors,
    )
    from hybridtitan.hf.llama import llama_config, llama_layout_problem, to_llama_key
    from hybridtitan.model_folder import DCP, read_folder

    output = os.path.normpath(output)
    problem = output_problem(output, overwrite, "export")
    if problem:
        raise ConversionError(problem)
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if format not in FORMATS:
        raise ConversionError(f"--format must be one of {', '.join(FORMATS)} (got {format!r})")
    held = read_folder(checkpoint, step)  # (an --output holding it is refused above: not an export)
    if held.kind != DCP:
        raise ConversionError(f"{checkpoint} is a Hugging Face folder already; export reads a DCP checkpoint")
    step_dir, args = held.path, held.args
    problems = {"llama": llama_layout_problem(args), "fla": fla_layout_problem(args)}
    if problems.get(format):
        raise ConversionError(f"--format {format}: {problems[format]}")
    layout = format if format != "auto" else next((name for name, problem in problems.items() if problem is None),
                                                  "hybridtitan")

    tok = load_tokenizer(held.tokenizer_or(tokenizer), args.vocab_size)
    state = read_dcp_model_state(step_dir, args)

    torch_dtype = getattr(torch, dtype)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    max_pos = _max_position_embeddings(step_dir)
    if layout in ("llama", "fla"):
        rename, make_config = (to_llama_key, llama_config) if layout == "llama" else (to_fla_key, fla_config)
        tensors = {rename(k): state.pop(k).to(torch_dtype).contiguous() for k in list(state)}
        config = make_config(args, max_position_embeddings=max_pos, dtype=torch_dtype, **special)
    else:
        from hybridtitan.hf import HybridTitanConfig

        tensors = {"model." + k: state.pop(k).to(torch_dtype).contiguous() for k in list(state)}
        config = HybridTitanConfig.from_model_args(args, max_position_embeddings=max_pos, **special)
        config.architectures = ["HybridTitanForCausalLM"]
        config.dtype = torch_dtype

    from transformers import GenerationConfig

    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(output)}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write_safetensors(tensors, tmp, max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        config.save_pretrained(tmp)
        GenerationConfig(**special).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _portable_tokenizer_config(tmp)
        publish_folder(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return layout


def _portable_tokenizer_config(folder: str) -> None:
    """The saved tokenizer_config.json, made portable.

    It drops what describes this machine's load (transformers records is_local and local_files_only from it). It also
    names the class so that transformers 4 knows it too. transformers 5 writes its internal "TokenizersBackend", and
    "PreTrainedTokenizerFast" names the same class there."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hybridtitan.export_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a DCP step folder, checkpoint folder or dump folder")
    p.add_argument("--output", required=True, help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weight dtype (default bfloat16)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the checkpoint's data.tokenizer)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="auto: Llama's for a Llama, FLA's for pure GDN/KDA, hybridtitan's otherwise")
    p.add_argument("--max_shard_size", type=parse_size, default=None, help="shard past this size (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from hybridtitan.hf.convert import output_problem

    problem = output_problem(os.path.normpath(args.output), args.overwrite, "export")
    if problem:  # before reading any checkpoint
        fail(problem)
    warnings.filterwarnings("ignore", message="Triton is not supported")  # FLA on a CPU machine
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP read in one process
    with one_line_errors():
        layout = export(args.checkpoint, args.output, step=args.step, dtype=args.dtype, tokenizer=args.tokenizer,
                        overwrite=args.overwrite, format=args.format, max_shard_size=args.max_shard_size)
    print(f"exported {args.checkpoint} to {args.output} ({layout} layout, {args.dtype})")


if __name__ == "__main__":
    main()

"""Hugging Face folder (or Primus checkpoint) -> DCP step-0 that training can start from.

    python -m hybridtitan.import_hf --model hf/fla-gdn-340M --output outputs/gdn_ft/checkpoint/step-0
    python -m hybridtitan.import_hf --model primus/output/.../checkpoints --output outputs/gdn_ft/checkpoint/step-0
    python -m hybridtitan.train --job.config_file ... --job.dump_folder outputs/gdn_ft      # starts from step-0
    (or, with any dump folder: --checkpoint.initial_load_path outputs/gdn_ft/checkpoint/step-0)

Reads a Llama (LlamaForCausalLM), an FLA GatedDeltaNet/KDA checkpoint (GatedDeltaNetForCausalLM, KDAForCausalLM)
or one of our own exports (model_type hybridtitan), checks that every tensor fits the model its config describes,
and writes a model-only DCP checkpoint with model_args.json; the tokenizer found in the folder (or --tokenizer) is
saved inside it under ``tokenizer/``, where export and evaluation find it. A Primus (Megatron-LM) checkpoint
folder, a run's or one ``iter_N`` in either of its formats, is read by hybridtitan.primus_checkpoint instead (the
model only: its optimizer state does not carry over). The step folder appears only once complete. An existing
output folder that is not empty is refused; --overwrite replaces an earlier import (a model-only step folder), never
a training checkpoint or a run's dump or checkpoint folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import warnings

from hybridtitan.cli import OneLineParser, fail, one_line_errors


def import_hf(model: str, output: str, *, tokenizer: str | None = None, overwrite: bool = False) -> str:
    """Writes the DCP step folder ``output`` from a Hugging Face folder or a Primus checkpoint; returns the
    model_type read (for a Primus checkpoint, a description of it). Raises ConversionError (one line) on bad input,
    before writing anything."""
    from hybridtitan.hf.convert import (
        ConversionError,
        is_hf_folder,
        load_tokenizer,
        model_from_state,
        output_problem,
        read_hf_model,
    )
    from hybridtitan.model_folder import has_tokenizer
    from hybridtitan.primus_checkpoint import is_primus_checkpoint, primus_model

    output = os.path.normpath(output)
    problem = output_problem(output, overwrite, "import")
    if problem:
        raise ConversionError(problem)
    if not is_hf_folder(model) and is_primus_checkpoint(model):
        net, tok, description = primus_model(model, tokenizer)
        write_step_folder(net, output, tok)
        return description
    args, state, model_type = read_hf_model(model)
    net = model_from_state(args, state, source=model)
    del state
    tok_path = tokenizer or (model if has_tokenizer(model) else None)
    tok = load_tokenizer(tok_path, args.vocab_size) if tok_path else None

    write_step_folder(net, output, tok)
    return model_type


def write_step_folder(model, output: str, tokenizer=None) -> None:
    """A model-only DCP step folder with the tokenizer inside (``tokenizer/``), that appears only once complete
    (written beside it under another name, then moved into place)."""
    from hybridtitan.checkpoint import save_model_checkpoint
    from hybridtitan.hf.convert import publish_folder
    from hybridtitan.model_folder import TOKENIZER_FOLDER

    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(output)}.import-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model_checkpoint(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER_FOLDER))
        publish_folder(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp + ".partial", ignore_errors=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hybridtitan.import_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a Hugging Face folder (a Llama, FLA GDN/KDA or a hybridtitan export) or a Primus "
                        "checkpoint folder (a run's or one iter_N; the model only)")
    p.add_argument("--output", required=True, help="the step folder to write, e.g. OUT/checkpoint/step-0")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer to save with it (default: the model folder's; for a Primus checkpoint, its "
                        "args.tokenizer_model where it loads)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from hybridtitan.hf.convert import output_problem

    output = os.path.normpath(args.output)
    problem = output_problem(output, args.overwrite, "import")
    if problem:  # before reading any checkpoint
        fail(problem)
    step = re.fullmatch(r"step-(\d+)", os.path.basename(output))
    if step and int(step.group(1)) > 0 and os.path.basename(os.path.dirname(os.path.abspath(output))) == "checkpoint":
        # the trainer starts from a model-only step-0, but refuses to go on from a later model-only step
        fail(f"--output {args.output}: a run starts from an import in checkpoint/step-0 only; name it step-0, or "
             "import elsewhere and give the folder as checkpoint.initial_load_path")
    if not os.path.isdir(args.model):
        fail(f"model folder not found: {args.model}")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with one_line_errors():
        model_type = import_hf(args.model, args.output, tokenizer=args.tokenizer, overwrite=args.overwrite)
    print(f"imported {args.model} ({model_type}) to {args.output}")


if __name__ == "__main__":
    main()

"""lm-eval over our model, straight from a DCP checkpoint (no export step) or a Hugging Face folder.

    python -m hybridtitan.eval --checkpoint outputs/gdn_300M/checkpoint/step-4768 --tasks arc_easy,hellaswag
    python -m hybridtitan.eval --checkpoint hf/gdn_300M --tasks my_task --include_path my_tasks/ --limit 100
    torchrun --nproc_per_node 8 -m hybridtitan.eval --checkpoint ... --tasks ... --batch_size auto

The model is always HybridLM, our own code, which runs on CPU too. A DCP folder is read directly. An HF folder is loaded
into it: our own export, or an FLA GatedDeltaNet/KDA checkpoint through the reverse name mapping. loglikelihood,
loglikelihood_rolling and generate_until are batched. Generation is greedy and decodes with the recurrent and MLA
caches.

It prints lm-eval's table and writes its JSON to --output_path. --include_path takes local task YAMLs, as lm-eval does.
--batch_size auto (or auto:N, as in lm-eval) picks the largest batch that fits.

Under torchrun every rank loads the model (on cuda:LOCAL_RANK on GPUs, otherwise on the CPU over gloo) and scores its
share of the batches. Rank 0 prints and writes the results, which equal those of one process, sample for sample. The
lm-eval model itself is hybridtitan.lm_eval_model, and hybridtitan.model_loader reads the model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings

from hybridtitan.cli import OneLineParser, fail, one_line_errors
from hybridtitan.errors import first_error_line
from hybridtitan.lm_eval_model import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_GEN_TOKS,
    DEFAULT_MAX_LENGTH,
    EvalError,
    HybridTitanLM,
    evaluate,
    parse_batch_size,
    task_manager_for,
)


def results_file(path: str, overwrite: bool = False, create: bool = False) -> str:
    """The file --output_path names: the path itself, or a new results_<time>.json in a folder. A folder is one that
    exists, or a path ending with a separator.

    It is checked before the evaluation, so that a bad path fails before the work, not after it. The folders are made
    only with ``create``, when writing. Raises EvalError for an existing file without ``overwrite``, or where no folder
    can be made."""
    folder_form = os.path.isdir(path) or path.endswith(("/", os.sep))
    folder = os.path.abspath(path if folder_form else os.path.dirname(os.path.abspath(path)))
    if not folder_form and os.path.exists(path) and not overwrite:
        raise EvalError(f"output file exists: {path} (pass --overwrite to replace it)")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise EvalError(f"--output_path {path}: {existing} is not a writable folder")
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise EvalError(f"--output_path {path}: {e}") from None
    return os.path.join(folder, f"results_{time.strftime('%Y-%m-%dT%H-%M-%S')}.json") if folder_form else path


def write_json(results: dict, path: str) -> str:
    from lm_eval.utils import handle_non_serializable

    path = results_file(path, overwrite=True, create=True)
    tmp = path + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ CLI


def _limit(text: str):
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return int(value) if value >= 1 and value == int(value) and "." not in text else value


def _batch_size(text: str):
    try:
        return parse_batch_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--batch_size ")) from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hybridtitan.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a DCP step/checkpoint/dump folder, or a Hugging Face folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (or YAML paths)")
    p.add_argument("--include_path", default=None, help="a folder of extra task YAMLs")
    p.add_argument("--limit", type=_limit, default=None, help="examples per task (a fraction if < 1)")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--batch_size", type=_batch_size, default=8,
                   help="an integer, or auto / auto:N (the largest that fits, detected once / N times)")
    p.add_argument("--max_batch_size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                   help="where --batch_size auto starts (on a CPU also at most what half the free memory holds)")
    p.add_argument("--max_length", type=int, default=DEFAULT_MAX_LENGTH, help="context length in tokens")
    p.add_argument("--max_gen_toks", type=int, default=DEFAULT_MAX_GEN_TOKS,
                   help="default generation length when a task sets none")
    p.add_argument("--output_path", default=None,
                   help="results JSON file, or a folder to put one in (an existing one, or a path ending with /)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_path file")
    p.add_argument("--log_samples", action="store_true",
                   help="also write every sample (its requests and responses) in the --output_path JSON")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the checkpoint's)")
    p.add_argument("--kernel_configs", default="shipped",
                   help="tuned Triton kernel configurations on a GPU: shipped (the package's for this GPU and "
                        "versions, else FLA autotunes), autotune, or a folder python -m hybridtitan.tune recorded")
    p.add_argument("--step", type=int, default=None, help="the DCP step (default: the latest complete one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--bootstrap_iters", type=int, default=100000, help="lm-eval's stderr bootstrap (0: none)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        fail("--tasks is empty")
    if args.output_path:
        with one_line_errors():
            results_file(args.output_path, args.overwrite)
    if args.log_samples and not args.output_path:
        fail("--log_samples writes the samples in the --output_path JSON: give --output_path")
    if args.include_path and not os.path.isdir(args.include_path):
        fail(f"--include_path: no such folder: {args.include_path}")
    if not os.path.exists(args.checkpoint):
        fail(f"checkpoint not found: {args.checkpoint}")
    if (isinstance(args.batch_size, int) and args.batch_size < 1) or args.max_length < 2:
        fail("--batch_size must be >= 1 and --max_length >= 2")
    if args.max_batch_size < 1:
        fail(f"--max_batch_size must be >= 1 (got {args.max_batch_size})")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        fail(f"--num_fewshot must be >= 0 (got {args.num_fewshot})")
    if args.step is not None and os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        fail(f"--step: {args.checkpoint} is a Hugging Face folder, which holds one model (no steps)")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Triton is not supported")

    import torch

    from hybridtitan.checkpoint import resolve_checkpoint
    from hybridtitan.hf.convert import is_hf_folder
    from hybridtitan.ops import kernel_configs

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda: no GPU is available")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    with one_line_errors():
        tuned = kernel_configs.use(args.kernel_configs, torch.device(device))  # before FLA is imported
        if not is_hf_folder(args.checkpoint):
            resolve_checkpoint(args.checkpoint, args.step)  # a bad folder fails before the tasks are indexed
        task_manager, tasks = task_manager_for(names, args.include_path)
    if world > 1:  # torchrun: one model per rank, each scoring its share of the batches
        import torch.distributed as dist

        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if rank:
            logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        _evaluate_main(args, tasks, task_manager, device=device, dtype=dtype, world=world, rank=rank, tuned=tuned)
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _evaluate_main(args, tasks, task_manager, *, device: str, dtype: str, world: int, rank: int, tuned) -> None:
    """The evaluation itself. ``tuned`` holds the kernel configurations in use (hybridtitan.ops.kernel_configs.Choice).
    """
    from hybridtitan.model_loader import load

    with one_line_errors():
        model, tokenizer, source = load(args.checkpoint, step=args.step, device=device, dtype=dtype,
                                        tokenizer=args.tokenizer)
    lm = HybridTitanLM(model, tokenizer, batch_size=args.batch_size, max_length=args.max_length,
                       max_gen_toks=args.max_gen_toks, max_batch_size=args.max_batch_size, distributed=world > 1)
    try:
        results = evaluate(lm, tasks, task_manager, limit=args.limit, num_fewshot=args.num_fewshot,
                           batch_size=args.batch_size, device=device, bootstrap_iters=args.bootstrap_iters,
                           log_samples=args.log_samples)
    except ConnectionError as e:  # a task's dataset on the Hub, offline or unreachable (datasets raises this)
        fail(f"--tasks: cannot load a task's data: {first_error_line(e)} (a task on the Hub needs network access "
             "once, to cache its data; a task of local files, through --include_path, needs none)")
    if rank or results is None:  # every rank computed the same results: rank 0 shows them
        return
    from lm_eval.utils import make_table

    results.setdefault("config", {})["model"] = f"hybridtitan ({source})"
    batch = args.batch_size
    if isinstance(batch, str):
        batch = f"{args.batch_size} (chosen: {', '.join(map(str, lm.batch_sizes.values())) or 'none'})"
    ranks = f", {world} processes (data parallel)" if world > 1 else ""
    print(f"hybridtitan: {source}, {dtype} on {device}, batch_size {batch}, limit {args.limit}{ranks}; "
          f"{tuned.message}")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output_path:
        print(f"results written to {write_json(results, args.output_path)}")


if __name__ == "__main__":
    main()

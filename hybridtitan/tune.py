"""Record the kernel configurations a recipe autotunes to on this GPU, into a folder every later run reads.

    python -m hybridtitan.tune --job.config_file train_configs/kda_300M.toml --output kernel_configs/NVIDIA_H200
    python -m hybridtitan.tune --job.config_file train_configs/zebra_llama_1B.toml --decode    # and decoding's
    torchrun ... -m hybridtitan.train --job.config_file ... --training.kernel_configs kernel_configs/NVIDIA_H200

It runs ``--steps`` training steps of the recipe in this process, on this GPU, on mock tokens. The steps run forward and
backward at the recipe's shapes: its micro-batch, its sequence length, packed documents where
``data.document_boundaries`` says so, its activation checkpointing and its torch.compile. There is no checkpoint,
validation or evaluation. Meanwhile every Triton kernel autotunes once at each shape that ``--output`` does not hold
yet; with ``--retune``, at every shape. With ``--decode`` it also runs decoding's prefill and one-token steps.

It then merges the configuration the autotuner chose for every shape of every kernel, FLA's and ours, into ``--output``
in FLA's format. It records the GPU and the Triton, FLA and torch versions with them (hybridtitan.ops.kernel_configs).
The default folder is the package's folder for this GPU, hybridtitan/kernel_configs/<GPU>/. Several recipes merge into
one folder, one run at a time or several at once.

One process is enough for a run on any number of GPUs, because every data-parallel rank runs the same micro-batch
shapes. A context-parallel run's shapes are a rank's share of each sequence, so tune it with ``--training.seq_len`` at
that share. A user error gives one line and exit code 2 before anything is written, and so does a machine without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time

DECODE_PROMPTS = (16, 512)  # prompt lengths: below and above the recurrent kernels' limit (fla_backend)
DECODE_STEPS = 4


def build_parser() -> argparse.ArgumentParser:
    from hybridtitan.cli import OneLineParser

    p = OneLineParser(prog="python -m hybridtitan.tune", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                      epilog="Every other argument is the trainer's: --job.config_file RECIPE and "
                             "--section.key VALUE overrides.")
    p.add_argument("--output", default=None, help="the folder to merge into (default: the package's for this GPU)")
    p.add_argument("--steps", type=int, default=2, help="training steps to run (the first autotunes)")
    p.add_argument("--decode", action="store_true", help="also decoding's shapes (generate, lm-eval's generation)")
    p.add_argument("--one-of-each", action="store_true",
                   help="a model of one sublayer of each kind of the pattern (\"*-M-M-M-\" -> \"*-M\"): the same "
                        "shapes in a fraction of the memory and time (a model too large for one GPU)")
    p.add_argument("--retune", action="store_true",
                   help="autotune every shape again (default: a shape --output already holds keeps its configuration)")
    return p


# the recipe's model and shapes without its data (tuning runs on mock tokens; a DPO recipe's pairs are left out too)
RECIPE_ONLY = ["--data.source", "mock", "--validation.enable", "false", "--dpo.path", ""]


# what tuning changes of the recipe: the step alone, in this process, autotuning every kernel
def tuning_overrides(steps: int, dump_folder: str, local_batch_size: int) -> list[str]:
    settings = {"data.source": "mock", "training.steps": steps, "training.kernel_configs": "autotune",
                "training.global_batch_size": local_batch_size, "checkpoint.enable": "false",
                "checkpoint.initial_load_path": "", "validation.enable": "false", "eval.tasks": "",
                "metrics.enable_tensorboard": "false", "job.dump_folder": dump_folder}
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


def run_decoding(args, device) -> None:
    """Decoding's prefill and one-token steps in bfloat16, as ``generate`` and lm-eval's generation run them."""
    import torch

    from hybridtitan import ops
    from hybridtitan.models import InferenceCache, build_model

    model = build_model(args, "meta", ops.Kernels())
    model.to_empty(device=device)
    model.init_weights()
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for length in DECODE_PROMPTS:
            cache = InferenceCache(len(model.layers))
            ids = torch.randint(0, args.vocab_size, (1, length), device=device)
            token = model(ids, cache=cache)[:, -1:].argmax(-1)
            for _ in range(DECODE_STEPS):
                token = model(token, cache=cache)[:, -1:].argmax(-1)
    torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, recipe_argv = build_parser().parse_known_args(argv)
    from hybridtitan.cli import fail, one_line_errors

    if own.steps < 1:
        fail(f"--steps must be >= 1 (got {own.steps})")
    if not any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in recipe_argv):
        fail("give a recipe: --job.config_file RECIPE.toml")
    if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1":
        fail("tune runs in one process (a rank's shapes are the same on any number of GPUs): run it without "
             "torchrun")

    import torch

    from hybridtitan.config_manager import parse_config
    from hybridtitan.ops import kernel_configs
    from hybridtitan.preflight import preflight

    if not torch.cuda.is_available():
        fail("no GPU: kernel configurations are recorded on the GPU they are for (its Triton kernels autotune "
             "there)")
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = kernel_configs.this_gpu(device)
    output = own.output or str(kernel_configs.SHIPPED / gpu["dir"])
    with one_line_errors():
        if os.path.exists(os.path.join(output, kernel_configs.RECORD)):  # merged into: it must be this machine's
            why = kernel_configs.foreign(kernel_configs.read_folder(output).record, gpu,
                                         kernel_configs.these_versions())
            if why:
                raise kernel_configs.KernelConfigError(f"--output {output}: another machine's configurations "
                                                       f"({why}): record into a folder of its own")
        elif os.path.exists(output) and os.listdir(output):
            raise kernel_configs.KernelConfigError(f"--output {output}: a folder that is not one of kernel "
                                                   "configurations (it holds files and no record.json)")
        # the recipe read as tuning runs it (mock tokens), so that its data need not be on this machine
        recipe = parse_config(recipe_argv + RECIPE_ONLY)
        if own.one_of_each:  # every sublayer of a kind has the same shapes, so the kernels meet the same keys
            from hybridtitan.config_manager import model_args

            recipe_argv = recipe_argv + ["--model.pattern", "".join(dict.fromkeys(model_args(recipe).pattern))]
            recipe = parse_config(recipe_argv + RECIPE_ONLY)
    with tempfile.TemporaryDirectory(prefix="hybridtitan-tune-") as dump:
        with one_line_errors():
            cfg = parse_config(recipe_argv + tuning_overrides(own.steps, dump, recipe.training.local_batch_size))
            plan = preflight(cfg)
        if not own.retune and os.path.exists(os.path.join(output, kernel_configs.RECORD)):
            # the shapes recorded already keep their configurations (exact keys only): only new ones autotune
            kept = kernel_configs.read_folder(output)
            plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, kernel_configs=kernel_configs.Choice(
                output, kept, f"kernel configurations: {output}'s {kept.entries()} recorded shapes kept, every other "
                              "shape autotunes (--retune: all of them)", mode="strict")))
        from hybridtitan.train import Trainer

        started = time.perf_counter()
        trainer = Trainer(cfg, plan)
        # a time box (SIGTERM) ends the run, not the recording: the shapes tuned so far are kept
        def run():
            trainer.train()
            if own.decode:
                run_decoding(plan.model.args, device)

        try:
            stopped = not ran_to_the_end(run)
        finally:
            trainer.close(True)
    seconds = time.perf_counter() - started
    recorded = {"recipe": recipe.job.config_file, "argv": recipe_argv, "decode": own.decode,
                "pattern": plan.model.args.pattern,
                "local_batch_size": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len,
                "document_boundaries": cfg.data.document_boundaries, "seconds": round(seconds, 1),
                "complete": not stopped}
    with one_line_errors():
        written = kernel_configs.save_choices(output, gpu, recorded)
    print(f"hybridtitan.tune: {recipe.job.config_file} on {gpu['name']} in {seconds:.0f} s: {len(written)} kernels, "
          f"{sum(written.values())} recorded shapes in {output}"
          + ("; stopped (SIGTERM) before the end: run it again to tune the rest" if stopped else
             f"; use it with --training.kernel_configs {output}"
             + (" (or shipped: it is the package's folder for this GPU)" if own.output is None else "")))
    if stopped:
        sys.exit(1)


class Stopped(BaseException):
    """SIGTERM arrived (a time box): stop the run and record what was tuned. It is a BaseException, like
    KeyboardInterrupt, so that no `except Exception` in a kernel's autotuning loop swallows it."""


_signalled = False


def _stop(signum, frame):
    global _signalled
    _signalled = True
    raise Stopped()


def ran_to_the_end(run) -> bool:
    """Runs ``run()`` under the time box's SIGTERM. Returns True if it ended, and False if SIGTERM stopped it, whatever
    error it surfaced as. (torch.compile wraps an exception raised while it compiles.)"""
    global _signalled
    _signalled = False
    signal.signal(signal.SIGTERM, _stop)
    try:
        run()
        return True
    except BaseException as error:
        if not _signalled:
            raise
        print(f"hybridtitan.tune: SIGTERM; the run ended with {type(error).__name__}", file=sys.stderr)
        return False
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    main()

"""The trainer's context parallelism on one GPU: two ranks sharing it train as one process on the same batches.

    python gpu_harness/checks/cp_train_check.py --json $OUT/cp_train.json                  # on the GPU machine
    python gpu_harness/checks/cp_train_check.py --flavor debug_hybrid --seq-len 256        # a CPU dry run

Three runs of ``hybridtitan.train`` on the shipped corpus as packed documents (train_configs/debug_hybrid.toml's
data, --flavor's model, default the zebra hybrid zebra_gdn_300M: GDN + MLA): one process at
context_parallel_degree 1; two ranks under torchrun at degree 2 (``--comm.backend gloo``: NCCL refuses two ranks on
one GPU, so gloo carries FSDP's and CP's collectives through the host; NCCL's path needs two GPUs); and the CP run
resumed from its checkpoint at the middle step. The same global batch of --rows rows per step in every run. AdamW
with eps 1 and lr 0.1 (its update close to lr x the gradient's momentum, so equal updates mean equal gradients).

Checked, against --bar (default 2e-2, bfloat16 parameters and activations): every step's loss of the CP run
against the one-process run's (|a - b| / |b|), and the weights' change over the second half of the steps
(||dW_cp - dW_one|| / ||dW_one|| over all weights); the resumed run's losses and final weights against the
uninterrupted CP run's. Exit code 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

import torch  # noqa: E402

from common import REPO  # noqa: E402


def train(folder: str, common: list[str], *, cp: bool, timeout: float) -> None:
    args = ["-m", "hybridtitan.train", *common, "--job.dump_folder", folder]
    if cp:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args,
                "--parallelism.context_parallel_degree", "2", "--comm.backend", "gloo"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    with open(os.path.join(os.path.dirname(folder), os.path.basename(folder) + ".log"), "w") as log:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if proc.returncode:
        tail = open(log.name).read()[-3000:]
        raise SystemExit(f"{folder}: the trainer exited with {proc.returncode}\n{tail}")


def losses(folder: str) -> dict[int, float]:
    from hybridtitan.plot import load_run

    return {r["step"]: r["loss"] for r in load_run(folder).records if "loss" in r}


def weights(folder: str, step: int) -> dict[str, torch.Tensor]:
    from hybridtitan.checkpoint import load_model

    model, _ = load_model(os.path.join(folder, "checkpoint", f"step-{step}"))
    return {n: p.detach().double() for n, p in model.state_dict().items()}


def change_error(a0, a1, b0, b1) -> float:
    """||(b1 - b0) - (a1 - a0)|| / ||a1 - a0|| over all tensors, a the reference."""
    num = sum(((b1[n] - b0[n]) - (a1[n] - a0[n])).pow(2).sum() for n in a0).sqrt().item()
    den = sum((a1[n] - a0[n]).pow(2).sum() for n in a0).sqrt().item()
    return num / den


def weight_error(a, b) -> float:
    num = sum((b[n] - a[n]).pow(2).sum() for n in a).sqrt().item()
    return num / sum(a[n].pow(2).sum() for n in a).sqrt().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="zebra_gdn_300M")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=2, help="rows per step (the global batch)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bar", type=float, default=2e-2)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--folder", default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    half = args.steps // 2
    common = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_hybrid.toml"),
              "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
              "--training.local_batch_size", str(args.rows), "--training.global_batch_size", str(args.rows),
              "--training.steps", str(args.steps), "--checkpoint.interval", str(half),
              "--checkpoint.keep_latest_k", "0", "--optimizer.eps", "1", "--optimizer.lr", "0.1",
              "--lr_scheduler.warmup_steps", "0",
              "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false"]
    root = args.folder or tempfile.mkdtemp(prefix="cp_train_check-")
    os.makedirs(root, exist_ok=True)
    one, cp, resumed = (os.path.join(root, name) for name in ("one", "cp", "resumed"))
    for path in (one, cp, resumed):
        shutil.rmtree(path, ignore_errors=True)
    print(f"{args.flavor}, {args.rows} x {args.seq_len} tokens of packed documents per step, {args.steps} steps; "
          f"torch {torch.__version__}; runs in {root}", flush=True)
    train(one, common, cp=False, timeout=args.timeout)
    train(cp, common, cp=True, timeout=args.timeout)
    os.makedirs(os.path.join(resumed, "checkpoint"))
    shutil.copytree(os.path.join(cp, "checkpoint", f"step-{half}"),
                    os.path.join(resumed, "checkpoint", f"step-{half}"))
    train(resumed, common, cp=True, timeout=args.timeout)

    a, b, r = losses(one), losses(cp), losses(resumed)
    report = {"losses": {s: {"one": a[s], "cp": b[s], "resumed": r.get(s)} for s in sorted(a)}}
    report["loss_error"] = max(abs(b[s] - a[s]) / abs(a[s]) for s in a)
    report["resumed_loss_error"] = max(abs(r[s] - b[s]) / abs(b[s]) for s in range(half + 1, args.steps + 1))
    wa0, wa1, wb0, wb1 = (weights(f, s) for f in (one, cp) for s in (half, args.steps))
    report["weight_change_error"] = change_error(wa0, wa1, wb0, wb1)
    report["resumed_weight_error"] = weight_error(wb1, weights(resumed, args.steps))
    report["resumed_weight_change_error"] = change_error(wb0, wb1, wb0, weights(resumed, args.steps))
    for s in sorted(a):
        print(f"step {s}: loss one {a[s]:.5f}  cp {b[s]:.5f}  resumed "
              + (f"{r[s]:.5f}" if s in r else "-"))
    failed = 0
    for key in ("loss_error", "weight_change_error", "resumed_loss_error", "resumed_weight_change_error"):
        ok = report[key] <= args.bar
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {key} {report[key]:.2e}", flush=True)
    print(f"resumed_weight_error {report['resumed_weight_error']:.2e} (of the weights themselves)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flavor": args.flavor, "seq_len": args.seq_len, "rows": args.rows, "bar": args.bar,
                       "torch": torch.__version__, **report}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

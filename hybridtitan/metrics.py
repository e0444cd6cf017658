"""Training metrics: one console line per log step, a JSONL file in the dump folder, TensorBoard, and optionally W&B.

Only rank 0 writes. Throughput is tokens per second per device, counting every token processed. TFLOP/s per device is
the counted training FLOPs per token (models/flops.py) times that rate. MFU is that over the device's datasheet peak
bf16 FLOP/s. A CPU has no peak, so MFU is left out there."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time

import torch

logger = logging.getLogger("hybridtitan")


def peak_flops(device: torch.device) -> float | None:
    """The GPU's datasheet dense bf16 FLOP/s (torchtitan's table), or None on a CPU."""
    if device.type != "cuda":
        return None
    from torchtitan.tools.utils import get_peak_flops

    return get_peak_flops(torch.cuda.get_device_name(device))


def _fmt_time(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def set_aside_records_after(path: str, step: int) -> int:
    """Moves the records of ``path`` past ``step`` to ``metrics.superseded.jsonl`` beside it. Returns how many moved.

    A run resumed at ``step`` trains the later steps again, for example after a crash between two checkpoints. So does a
    run that starts afresh in the folder of an earlier one. A line cut short by a crash is moved too."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep, superseded = [], []
    for line in lines:
        try:
            kept = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            kept = False
        (keep if kept else superseded).append(line if line.endswith("\n") else line + "\n")
    if not superseded:
        return 0
    with open(os.path.join(os.path.dirname(path), "metrics.superseded.jsonl"), "a") as f:
        f.writelines(superseded)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    logger.info(f"metrics.jsonl: {len(superseded)} record(s) past step {step} moved to metrics.superseded.jsonl "
                "(steps trained again, or an earlier run's)")
    return len(superseded)


class MetricsLogger:
    def __init__(self, dump_folder: str, *, rank: int, total_steps: int, flops_per_token: float,
                 device: torch.device, enable_tensorboard: bool, tb_folder: str, enable_wandb: bool,
                 job_config: dict | None = None, start_step: int = 0):
        self.rank, self.total_steps = rank, total_steps
        self.flops_per_token, self.device = flops_per_token, device
        self.peak = peak_flops(device)
        self.start = time.monotonic()
        self.tb = self.wandb = None
        self.jsonl = None
        if rank != 0:
            return
        os.makedirs(dump_folder, exist_ok=True)
        # appended, so a resumed run continues the same file, without the records of the steps it trains again
        path = os.path.join(dump_folder, "metrics.jsonl")
        set_aside_records_after(path, start_step)
        self.jsonl = open(path, "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # one folder per run, as metrics.jsonl: a resumed run's events hide those of the steps it trains
            # again (TensorBoard purges events from purge_step on), so each step shows once, on one curve
            self.tb = SummaryWriter(os.path.join(dump_folder, tb_folder), purge_step=start_step + 1)
        if enable_wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("metrics.enable_wandb needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "hybridtitan"), dir=dump_folder,
                                    config=job_config)

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, tokens_per_step: int, window_steps: int,
            window_time: float, tokens_seen: int, skipped_steps: int, loss_tokens: int | None = None,
            parts: dict[str, float] | None = None) -> dict:
        """Logs the last ``window_steps`` steps, which took ``window_time`` seconds at ``tokens_per_step`` tokens per
        device each (every token processed). ``loss_tokens`` are the tokens the loss of this step counted, over the
        global batch. ``parts`` are distillation's terms, per counted token, logged as distill/<name>."""
        step_time = window_time / max(window_steps, 1)
        tps = tokens_per_step / step_time if step_time > 0 else 0.0
        elapsed = time.monotonic() - self.start
        # from the recent steps' pace: the first steps (compilation, autotuning) would inflate it
        eta = step_time * (self.total_steps - step)
        record = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_sec_per_device": tps,
            "step_time_s": step_time, "tokens_seen": tokens_seen, "elapsed_s": elapsed, "eta_s": eta,
            "skipped_steps": skipped_steps,
            # the model FLOPs done per second (training FLOPs per token x tokens/s), the figure Primus reports
            "tflops_per_device": self.flops_per_token * tps / 1e12,
        }
        for name, value in (parts or {}).items():  # distillation's by their names, DPO's under dpo/
            record[name if "/" in name else f"distill/{name}"] = value
        if loss_tokens is not None:
            record["loss_tokens"] = loss_tokens
        if self.peak:
            record["mfu"] = self.flops_per_token * tps / self.peak
        if self.device.type == "cuda":
            record["memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            record["memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if self.rank == 0:
            self._write(record)
        return record

    def log_validation(self, step: int, *, loss: float, tokens: int, kl: float | None = None) -> dict:
        """Logs the held-out set's mean loss at ``step``, and its perplexity exp(loss), over ``tokens`` tokens. With a
        distillation teacher it also logs the mean KL divergence from the teacher."""
        record = {"step": step, "validation/loss": loss, "validation/perplexity": math.exp(min(loss, 80.0)),
                  "validation/tokens": tokens}
        if kl is not None:
            record["validation/kl"] = kl
        if self.rank == 0:
            shown_kl = f" | kl {kl:.4f}" if kl is not None else ""
            logger.info(f"validation at step {step}: loss {loss:.4f} | perplexity {record['validation/perplexity']:.2f}"
                        f"{shown_kl} | {tokens:,} tokens")
            self._record(record)
        return record

    def log_preference_validation(self, step: int, *, loss: float, pairs: int, values: dict[str, float]) -> dict:
        """Logs DPO's held-out pairs at ``step``: the mean loss and ``values`` (dpo/accuracy, dpo/margin, the chosen and
        rejected rewards), as means over ``pairs`` pairs."""
        record = {"step": step, "validation/loss": loss, **values, "validation/pairs": pairs}
        if self.rank == 0:
            shown = " | ".join(f"{key.removeprefix('dpo/')} {value:.4f}" for key, value in values.items())
            logger.info(f"validation at step {step}: loss {loss:.4f} | {shown} | {pairs:,} pairs")
            self._record(record)
        return record

    def log_eval(self, step: int, results: dict[str, float], seconds: float) -> dict:
        """Downstream evaluation at ``step``: ``results`` as {"eval/<task>/<metric>": value}."""
        record = {"step": step, **results}
        if self.rank == 0:
            shown = " | ".join(f"{key.removeprefix('eval/')} {value:.4f}" for key, value in results.items()
                               if not key.endswith("_stderr"))
            logger.info(f"eval at step {step} ({seconds:.0f} s): {shown}")
            self._record(record)
        return record

    def _write(self, r: dict) -> None:
        parts = [f"step {r['step']:>{len(str(self.total_steps))}}/{self.total_steps}", f"loss {r['loss']:.4f}",
                 *(f"{key.partition('/')[2]} {value:.4f}" for key, value in r.items()
                   if key.startswith(("distill/", "dpo/"))),
                 f"grad_norm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}",
                 f"tok/s/dev {r['tokens_per_sec_per_device']:,.0f}"]
        parts.append(f"tflop/s/dev {r['tflops_per_device']:.3g}")
        if "mfu" in r:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if "memory_gib" in r:
            parts.append(f"mem {r['memory_gib']:.1f} GiB")
        parts += [f"elapsed {_fmt_time(r['elapsed_s'])}", f"eta {_fmt_time(r['eta_s'])}"]
        if r["skipped_steps"]:
            parts.append(f"skipped {r['skipped_steps']}")
        logger.info(" | ".join(parts))
        self._record(r)

    def _record(self, r: dict) -> None:
        """One record to metrics.jsonl, TensorBoard and W&B."""
        self.jsonl.write(json.dumps(r) + "\n")
        if self.tb is not None:
            for key, value in r.items():
                if key != "step":
                    self.tb.add_scalar(key, value, r["step"])
        if self.wandb is not None:
            self.wandb.log(r, step=r["step"])

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

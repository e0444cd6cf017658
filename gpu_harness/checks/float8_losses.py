"""float8_check.sh's loss table: each run's losses from OUT/float8_loss_RUN.jsonl (the trainer's metrics.jsonl),
RUN being precision:seed, and each float8 run's mean over the last 50 steps against the bf16 runs' range.

    python gpu_harness/checks/float8_losses.py OUT STEPS bf16:1 bf16:2 bf16:3 tensorwise:1 rowwise:1
"""

from __future__ import annotations

import os
import statistics
import sys

from hybridtitan.plot import load_run

LAST = 50  # the steps averaged at the end


def losses(out: str, run: str) -> dict[int, float]:
    """step -> loss, read by the package's metrics.jsonl reader (a line cut short by a time box is passed over)."""
    path = os.path.join(out, f"float8_loss_{run}.jsonl")
    if not os.path.exists(path):
        return {}
    return {r["step"]: r["loss"] for r in load_run(path).records if "loss" in r}


def report(out: str, steps: int, runs: list[str]) -> list[str]:
    means, lines = {}, ["| run | steps | loss at 1 | at 100 | at 250 | mean of the last 50 | against bf16 |",
                        "| --- | --- | --- | --- | --- | --- | --- |"]
    by_run = {run: losses(out, run) for run in runs}
    for run, loss in by_run.items():
        if max(loss, default=0) < steps:
            lines.append(f"| {run} | {max(loss, default=0)} | incomplete | | | | |")
            continue
        means[run] = statistics.fmean(loss[s] for s in range(steps - LAST + 1, steps + 1))
    bf16 = [m for run, m in means.items() if run.startswith("bf16:")]
    low, high = (min(bf16), max(bf16)) if bf16 else (None, None)
    for run in runs:
        if run not in means:
            continue
        loss = by_run[run]
        at = [f"{loss[s]:.4f}" if s in loss else "-" for s in (1, 100, 250)]
        if run.startswith("bf16:") or low is None:
            where = "" if low is None else f"range {low:.4f}-{high:.4f}"
        elif low <= means[run] <= high:
            where = "inside the range"
        else:
            edge = high if means[run] > high else low
            where = f"{(means[run] - edge) / edge:+.2%} outside the range"
        lines.append(f"| {run} | {steps} | {' | '.join(at)} | {means[run]:.4f} | {where} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(report(argv[0], int(argv[1]), argv[2:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

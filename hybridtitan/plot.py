"""Training curves of one or more runs, as one PNG.

    python -m hybridtitan.plot outputs/debug_hybrid --output curves.png
    python -m hybridtitan.plot outputs/run_a outputs/run_b/metrics.jsonl --output cmp.png --x tokens --smooth 25

A RUN is a dump folder (its metrics.jsonl and, for the label, job_config.json) or a metrics.jsonl path; the
records a resumed run set aside (metrics.superseded.jsonl) are not read. One figure, panels sharing the x axis
(the step, or the tokens seen with ``--x tokens``): the training loss (each logged value thin and faint, and a
centred moving mean over ``--smooth`` logged points in bold; ``--smooth 1`` turns it off), the validation loss,
the learning rate, the gradient norm before clipping (log scale, with the clipping threshold dotted) and the
tokens per second per device. A run has one colour in every panel and is labelled by its model flavor and
job.description (else its folder name). A panel no run has data for is left out; a record without a key, or
with a non-finite value (a NaN loss), is skipped for that key. The PNG is written atomically.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # no display: before pyplot is imported anywhere
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

from hybridtitan.cli import OneLineParser, fail  # noqa: E402

# (key in metrics.jsonl, panel title); the order of the panels, top to bottom
PANELS = [
    ("loss", "training loss (nats/token)"),
    ("validation/loss", "validation loss (nats/token)"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm before clipping (dotted: training.max_norm)"),
    ("tokens_per_sec_per_device", "throughput (tokens/s per device)"),
]
X_LABELS = {"step": "step", "tokens": "tokens seen"}


@dataclass
class Run:
    label: str
    records: list[dict]
    max_norm: float | None = None  # training.max_norm: the clipping threshold drawn in the grad-norm panel
    folder: str = field(default="", repr=False)


def load_run(path: str) -> Run:
    """The run at ``path`` (a dump folder or its metrics.jsonl); exits with one line if it has no records."""
    metrics = path if os.path.isfile(path) else os.path.join(path, "metrics.jsonl")
    folder = os.path.dirname(os.path.abspath(metrics))
    if not os.path.exists(path):
        fail(f"{path}: no such folder or file")
    if not os.path.isfile(metrics):
        fail(f"{path}: no metrics.jsonl in this folder (not a dump folder, or the run logged nothing yet)")
    records = []
    with open(metrics) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if isinstance(record, dict) and _finite(record.get("step")):
                records.append(record)
    if not records:
        fail(f"{metrics}: no complete metrics record in it (the run logged nothing yet?)")
    config = {}
    try:
        with open(os.path.join(folder, "job_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        pass  # no config: the folder name labels the run
    flavor = (config.get("model") or {}).get("flavor")
    description = (config.get("job") or {}).get("description") or os.path.basename(folder)
    label = f"{flavor}: {description}" if flavor else description
    max_norm = (config.get("training") or {}).get("max_norm")
    return Run(label, records, max_norm if _finite(max_norm) and max_norm > 0 else None, folder)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(run: Run, key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """The finite values of ``key`` against the step or the tokens seen, by step (a later record of a step wins).
    A record without tokens_seen (a validation record, say) takes that of the training record of its step."""
    tokens_at = {r["step"]: r["tokens_seen"] for r in run.records if _finite(r.get("tokens_seen"))}
    points = {}
    for r in run.records:
        if _finite(r.get(key)):
            at = r["step"] if x == "step" else r.get("tokens_seen", tokens_at.get(r["step"]))
            if _finite(at):
                points[r["step"]] = (at, r[key])
    xy = np.array([points[s] for s in sorted(points)], dtype=float).reshape(-1, 2)
    return xy[:, 0], xy[:, 1]


def centred_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over the ``window`` points centred on each point (window made odd), narrower at the two ends."""
    half = window // 2
    sums = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(len(values))
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def plot(runs: list[Run], x: str = "step", smooth: int | None = None, title: str | None = None):
    """The figure of ``runs``; its axes are the non-empty panels, top to bottom, titled as in PANELS.
    ``smooth``: the moving mean's window in logged points (None: about a twentieth of each run's points)."""
    data = {key: [series(run, key, x) for run in runs] for key, _ in PANELS}
    panels = [(key, name) for key, name in PANELS if any(len(xs) for xs, _ in data[key])]
    if not panels:
        against = "step" if x == "step" else "tokens_seen (try --x step)"
        fail(f"none of the runs has a value to plot against {against}: no loss, lr, grad_norm or throughput")
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 1.2 + 2.1 * len(panels)),
                             layout="constrained", squeeze=False)
    axes = axes[:, 0]
    for ax, (key, name) in zip(axes, panels):
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
        for i, (run, (xs, ys)) in enumerate(zip(runs, data[key])):
            color = f"C{i % 10}"
            if not len(xs):
                continue
            if key == "loss":
                window = smooth or max(1, round(len(ys) / 20))
                if window > 1:
                    ax.plot(xs, ys, color=color, lw=0.7, alpha=0.3, label=f"_{run.label} (raw)")
                    ys = centred_mean(ys, window)
                ax.plot(xs, ys, color=color, lw=2, label=run.label)
            elif key == "validation/loss":
                ax.plot(xs, ys, color=color, lw=1.5, marker="o", ms=4, label=run.label)
            else:
                ax.plot(xs, ys, color=color, lw=1.3, label=run.label)
            if key == "grad_norm" and run.max_norm is not None:
                ax.axhline(run.max_norm, color=color, lw=1, ls=":", label=f"_{run.label} (max_norm)")
        values = np.concatenate([ys for _, ys in data[key]])
        plain = ticker.FuncFormatter(lambda v, _: f"{v:.4g}")  # 0.003, not 3 with an offset text "1e-3"
        ax.yaxis.set_major_formatter(plain)
        if key == "grad_norm" and values.min() > 0:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)  # 0.4, not 4 x 10^-1
            ax.yaxis.set_minor_formatter(ticker.FuncFormatter(  # 0.2 and 0.5 between 0.1 and 1: no crowding
                lambda v, _: f"{v:.4g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
        if key == "tokens_per_sec_per_device":
            ax.yaxis.set_major_formatter(ticker.EngFormatter(sep=""))
    axes[-1].set_xlabel(X_LABELS[x])
    if x == "tokens":
        axes[-1].xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
    handles = [plt.Line2D([], [], color=f"C{i % 10}", lw=2, label=run.label) for i, run in enumerate(runs)]
    wide = max(len(run.label) for run in runs) > 45
    # above the panels, never over a curve; the title is the legend's, so the two cannot overlap
    fig.legend(handles=handles, loc="outside upper center", ncols=1 if wide else min(len(runs), 3),
               frameon=False, fontsize=9, title=title, title_fontproperties={"size": 12, "weight": "bold"})
    return fig


def save(fig, output: str) -> None:
    """Writes the PNG to a temporary file beside ``output``, then renames it: never a half-written picture."""
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        fail(f"{output}: its folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=120)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it, not mkstemp's 0600
        os.replace(tmp, output)
    except BaseException:
        os.unlink(tmp)
        raise


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        fail(f"argument --smooth: must be a whole number of logged points, 1 or more, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m hybridtitan.plot", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a dump folder or a metrics.jsonl path")
    parser.add_argument("--output", required=True, help="the PNG to write")
    parser.add_argument("--x", choices=sorted(X_LABELS), default="step", help="the x axis (default: step)")
    parser.add_argument("--smooth", type=_positive_int, default=None,
                        help="the training loss's centred moving mean, in logged points (default: about a "
                             "twentieth of the run's points; 1: off)")
    parser.add_argument("--title", default=None, help="a title above the figure")
    args = parser.parse_args(argv)
    runs = [load_run(path) for path in args.runs]
    labels = [run.label for run in runs]
    for run in runs:  # two runs of one recipe: the folder tells them apart
        if labels.count(run.label) > 1:
            run.label = f"{run.label} [{os.path.basename(run.folder)}]"
    fig = plot(runs, x=args.x, smooth=args.smooth, title=args.title)
    save(fig, args.output)
    plt.close(fig)
    print(args.output)


if __name__ == "__main__":
    main()

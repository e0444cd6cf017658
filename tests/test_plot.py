"""python -m hybridtitan.plot: the figure's panels and lines, for hand-made runs and one real tiny run; bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from hybridtitan import plot as plot_mod

ROOT = Path(__file__).resolve().parents[1]
TITLES = dict(plot_mod.PANELS)


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def fake_run(folder: Path, *, flavor: str, description: str, steps: int = 200, every: int = 5, seed: int = 0,
             tokens_per_step: int = 8192, validation_every: int | None = None, nan_at: int | None = None,
             lr: float = 3e-3) -> list[dict]:
    """A run's metrics.jsonl and job_config.json as the trainer writes them: a warm-up-stable-decay rate, a noisy
    decaying loss, validation records (their own lines, without the training keys) every ``validation_every``
    steps, the loss NaN at step ``nan_at``. Returns the records."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    records = []
    for step in [1, *range(every, steps + 1, every)]:
        warm = min(step / 20, 1.0)
        decay = 1.0 if step < 0.75 * steps else 1 - 0.9 * (step - 0.75 * steps) / (0.25 * steps)
        loss = 3.5 + 7.0 * math.exp(-step / 30) + rng.normal(0, 0.15)
        tps = (2000 if step == 1 else 40000) * (1 + rng.normal(0, 0.03))
        records.append({
            "step": step, "loss": float("nan") if step == nan_at else loss,
            "grad_norm": 4.0 * math.exp(-step / 40) + 0.3 + abs(rng.normal(0, 0.1)), "lr": lr * warm * decay,
            "tokens_per_sec_per_device": tps, "step_time_s": tokens_per_step / tps,
            "tokens_seen": step * tokens_per_step, "elapsed_s": step * 0.2, "eta_s": (steps - step) * 0.2,
            "skipped_steps": 0})
        if validation_every and step % validation_every == 0:
            v = 3.7 + 6.5 * math.exp(-step / 30)
            records.append({"step": step, "validation/loss": v, "validation/perplexity": math.exp(v)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"job": {"description": description, "dump_folder": str(folder)},
              "model": {"name": "hybrid", "flavor": flavor}, "training": {"steps": steps, "max_norm": 1.0}}
    (folder / "job_config.json").write_text(json.dumps(config, indent=2))
    return records


@pytest.fixture
def two_runs(tmp_path):
    a = fake_run(tmp_path / "gdn", flavor="gdn_300M", description="GDN 300M, lr 3e-3", validation_every=50)
    b = fake_run(tmp_path / "kda", flavor="kda_300M", description="KDA 300M, lr 2e-3", seed=1, nan_at=40,
                 lr=2e-3)
    # records a resumed run set aside: never read
    (tmp_path / "kda" / "metrics.superseded.jsonl").write_text(json.dumps({**b[-1], "step": 10**6}) + "\n")
    return tmp_path, a, b


def _lines(ax, label):
    return [line for line in ax.get_lines() if line.get_label() == label]


def _count(records, key):
    return sum(1 for r in records if key in r and math.isfinite(r[key]))


def test_fake_runs_every_panel_and_series(two_runs):
    tmp, a, b = two_runs
    runs = [plot_mod.load_run(str(tmp / "gdn")), plot_mod.load_run(str(tmp / "kda" / "metrics.jsonl"))]
    assert [r.label for r in runs] == ["gdn_300M: GDN 300M, lr 3e-3", "kda_300M: KDA 300M, lr 2e-3"]
    fig = plot_mod.plot(runs, smooth=9, title="two runs")
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    assert list(axes) == [name for _, name in plot_mod.PANELS]  # all five, in order
    loss, val = axes[TITLES["loss"]], axes[TITLES["validation/loss"]]
    for run, records, color in zip(runs, (a, b), ("C0", "C1")):
        n = _count(records, "loss")
        (smoothed,), (raw,) = _lines(loss, run.label), _lines(loss, f"_{run.label} (raw)")
        assert len(raw.get_xdata()) == len(smoothed.get_xdata()) == n
        assert raw.get_linewidth() < smoothed.get_linewidth() and raw.get_alpha() < 1
        for key in ("lr", "grad_norm", "tokens_per_sec_per_device"):
            (line,) = _lines(axes[TITLES[key]], run.label)
            assert len(line.get_xdata()) == _count(records, key) and line.get_color() == color
        assert smoothed.get_color() == raw.get_color() == color  # one colour per run, in every panel
    assert _count(b, "loss") == len(b) - 1  # the NaN step is left out
    assert max(_lines(loss, runs[1].label)[0].get_xdata()) == b[-1]["step"]  # not the superseded record
    (vline,) = _lines(val, runs[0].label)
    assert list(vline.get_xdata()) == [50, 100, 150, 200] and vline.get_marker() == "o"
    assert not _lines(val, runs[1].label)  # the KDA run has no validation records
    assert axes[TITLES["grad_norm"]].get_yscale() == "log"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [r.label for r in runs]
    assert fig.legends[0].get_title().get_text() == "two runs"
    assert axes[TITLES["tokens_per_sec_per_device"]].get_xlabel() == "step"


def test_x_tokens_and_panels_without_data(two_runs):
    tmp, a, _ = two_runs
    run = plot_mod.load_run(str(tmp / "gdn"))
    fig = plot_mod.plot([run], x="tokens", smooth=1)
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    (loss,) = _lines(axes[TITLES["loss"]], run.label)  # smooth 1: the raw values, one line
    assert list(loss.get_xdata()) == [r["tokens_seen"] for r in a if "loss" in r]
    (val,) = _lines(axes[TITLES["validation/loss"]], run.label)  # tokens taken from the step's training record
    assert list(val.get_xdata()) == [s * 8192 for s in (50, 100, 150, 200)]
    assert fig.axes[-1].get_xlabel() == "tokens seen"
    # a run that logged only the loss: the other panels are left out
    only = plot_mod.Run("bare", [{"step": 1, "loss": 10.0}, {"step": 2, "loss": float("inf")}, {"step": 3}])
    fig = plot_mod.plot([only])
    assert [ax.get_title(loc="left") for ax in fig.axes] == [TITLES["loss"]]
    assert len(_lines(fig.axes[0], "bare")[0].get_xdata()) == 1


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hybridtitan.plot", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)


def _check_png(path: Path, min_bytes: int = 20_000):
    assert path.stat().st_size > min_bytes
    image = mpimg.imread(path)
    height, width = image.shape[:2]
    assert width == 1200 and 800 < height < 2000 and image.std() > 0.05  # 10 in at 120 dpi, not blank


def test_real_tiny_run(tmp_path, capsys):
    """A 6-step run of the trainer (the debug recipe's validation every 3 steps and at the end, 2 batches each),
    plotted by the CLI beside a fake run."""
    dump = tmp_path / "real"
    cmd = [sys.executable, "-m", "hybridtitan.train", "--job.config_file", "train_configs/debug_hybrid.toml",
           "--training.steps", "6", "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--training.global_batch_size", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
           "false", "--checkpoint.enable", "false", "--validation.freq", "3", "--validation.steps", "2",
           "--job.dump_folder", str(dump)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    validated = [r for r in lines if "validation/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in validated] == [3, 6]

    run = plot_mod.load_run(str(dump))
    assert run.label == "debug_hybrid: debug hybrid (*-M-M-*-) on the shipped corpus" and run.max_norm == 1.0
    fig = plot_mod.plot([run], x="tokens")
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    assert len(axes) == 5
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec_per_device"):
        (line,) = _lines(axes[TITLES[key]], run.label)
        assert list(line.get_xdata()) == [r["tokens_seen"] for r in records]
        assert np.allclose(line.get_ydata(), [r[key] for r in records])
    (line,) = _lines(axes[TITLES["validation/loss"]], run.label)
    assert np.allclose(line.get_ydata(), [r["validation/loss"] for r in validated])

    fake_run(tmp_path / "fake", flavor="gdn_300M", description="a fake run", validation_every=50)
    out = tmp_path / "curves.png"
    plot_mod.main([str(dump), str(tmp_path / "fake"), "--output", str(out), "--x", "tokens", "--title", "t"])
    assert capsys.readouterr().out.strip() == str(out)
    _check_png(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "fake", "real"]  # no temporary left


@pytest.mark.parametrize("case", ["no_folder", "not_a_dump", "empty", "blank_lines", "bad_smooth", "bad_x"])
def test_cli_errors_one_line_exit_2(tmp_path, capsys, case):
    """In-process (main() as `python -m` calls it): a subprocess would spend seconds importing hybridtitan."""
    folder = tmp_path / "run"
    folder.mkdir()
    args = [str(folder), "--output", str(tmp_path / "c.png")]
    if case == "no_folder":
        args[0] = str(tmp_path / "missing")
    elif case == "empty":
        (folder / "metrics.jsonl").write_text("")
    elif case == "blank_lines":  # a crash cut the only line short
        (folder / "metrics.jsonl").write_text('\n\n{"step": 1, "lo')
    elif case in ("bad_smooth", "bad_x"):
        fake_run(folder / "r", flavor="f", description="d", steps=20)
        args[0] = str(folder / "r")
        args += ["--smooth", "0"] if case == "bad_smooth" else ["--x", "time"]
    with pytest.raises(SystemExit) as exit_:
        plot_mod.main(args)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert not (tmp_path / "c.png").exists()


def test_cli_fake_runs_png(two_runs):
    """The real command line, in its own process, as a user runs it."""
    tmp, _, _ = two_runs
    out = tmp / "curves.png"
    proc = _cli(str(tmp / "gdn"), str(tmp / "kda"), "--output", str(out), "--smooth", "5")
    assert proc.returncode == 0 and proc.stdout.strip() == str(out), proc.stderr
    _check_png(out)

"""Training metrics: metrics.jsonl and TensorBoard hold each step once across a resume."""

from __future__ import annotations

import json

import torch


def test_resumed_run_sets_aside_the_metrics_of_steps_it_trains_again(tmp_path):
    """A run killed after step 12 whose last checkpoint is step 8 trains steps 9-12 again: their first records (and
    a line the kill cut short) move to metrics.superseded.jsonl, so metrics.jsonl holds each step once."""
    from hybridtitan.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 13)) + '{"step": 1')
    logger = MetricsLogger(str(tmp_path), rank=0, total_steps=20, flops_per_token=1.0, device=torch.device("cpu"),
                           enable_tensorboard=False, tb_folder="tb", enable_wandb=False, start_step=8)
    logger.log(9, loss=0.5, grad_norm=1.0, lr=1e-3, tokens_per_step=8, window_steps=1, window_time=1.0,
               tokens_seen=72, skipped_steps=0)
    logger.close()
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in kept] == [*range(1, 10)] and kept[-1]["loss"] == 0.5
    superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:4]] == [9, 10, 11, 12]
    assert superseded[4:] == ['{"step": 1']
    # a resume that trains nothing again leaves the file as it is
    before = path.read_text()
    MetricsLogger(str(tmp_path), rank=0, total_steps=20, flops_per_token=1.0, device=torch.device("cpu"),
                  enable_tensorboard=False, tb_folder="tb", enable_wandb=False, start_step=9).close()
    assert path.read_text() == before and len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 5

def test_resumed_run_hides_the_tensorboard_events_of_steps_it_trains_again(tmp_path):
    """TensorBoard, as metrics.jsonl: after a resume from step 8 of a run that logged steps 1-12, each step shows
    once, steps 9-10 with the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridtitan.metrics import MetricsLogger

    def run(start_step, steps, loss):
        logger = MetricsLogger(str(tmp_path), rank=0, total_steps=20, flops_per_token=1.0, device=torch.device("cpu"),
                               enable_tensorboard=True, tb_folder="tb", enable_wandb=False, start_step=start_step)
        for s in steps:
            logger.log(s, loss=loss(s), grad_norm=1.0, lr=1e-3, tokens_per_step=8, window_steps=1, window_time=1.0,
                       tokens_seen=8 * s, skipped_steps=0)
        logger.close()

    run(0, range(1, 13), lambda s: 10.0 - s)
    run(8, range(9, 11), lambda s: 100.0 + s)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    shown = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(shown) == [*range(1, 11)], shown
    assert shown[8] == 2.0 and shown[9] == 109.0 and shown[10] == 110.0

"""Validation for real: the held-out loss on 2 gloo processes, every validation.freq steps and at the end, the
same batches each time, and nothing of the training changed by it."""

from __future__ import annotations

import math

import torch

from helpers import QUICK, losses, records, run_train, state

HELD_OUT = ["--validation.enable", "true", "--validation.freq", "3", "--validation.data.path",
            "hybridtitan/assets/corpus/validation.jsonl"]


def test_validation_changes_nothing_and_resumes_exactly(tmp_path):
    """With validation (3 batches per rank, every 3 steps and at the end) the training losses and the weights are
    bit for bit those of a run without it; a run stopped at step 4 and resumed validates at the same steps with
    the same values (the same weights on the same held-out batches)."""
    common = [*QUICK, "--checkpoint.enable", "true", "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "8"]
    plain, checked, resumed = tmp_path / "plain", tmp_path / "validated", tmp_path / "resumed"
    run_train(plain, *common, "--training.steps", "8")
    run_train(checked, *common, *HELD_OUT, "--validation.steps", "3", "--training.steps", "8")
    assert losses(plain) == losses(checked)
    assert all(torch.equal(a, b) for a, b in zip(state(plain, 8).values(), state(checked, 8).values()))
    validated = records(checked, "validation/loss")
    assert sorted(validated) == [3, 6, 8]
    for r in validated.values():
        assert math.isfinite(r["validation/loss"]) and r["validation/perplexity"] == math.exp(r["validation/loss"])
        assert r["validation/tokens"] == 2 * 3 * 2 * 128  # ranks x batches x sequences x tokens, all counted
    assert validated[8]["validation/loss"] < validated[3]["validation/loss"]  # it learned something
    run_train(resumed, *common, *HELD_OUT, "--validation.steps", "3", "--training.steps", "4")
    run_train(resumed, *common, *HELD_OUT, "--validation.steps", "3", "--training.steps", "8")
    assert losses(resumed) == losses(checked)
    again = records(resumed, "validation/loss")
    assert sorted(again) == [3, 4, 6, 8]  # step 4 ended the first launch
    assert all(again[s]["validation/loss"] == validated[s]["validation/loss"] for s in (3, 6, 8))


def test_one_pass_over_the_held_out_set_with_the_eod_mask(tmp_path):
    """validation.steps = -1: one pass over the shipped held-out set, split between the ranks; with
    training.eod_mask_loss the tokens after each EOD are not counted."""
    dump, masked = tmp_path / "pass", tmp_path / "masked"
    args = [*QUICK, *HELD_OUT, "--training.steps", "1", "--checkpoint.enable", "false"]
    run_train(dump, *args)
    run_train(masked, *args, "--training.eod_mask_loss", "true")
    whole, fewer = records(dump, "validation/loss")[1], records(masked, "validation/loss")[1]
    assert whole["validation/tokens"] % (2 * 2 * 128) == 0 and whole["validation/tokens"] >= 10 * 2 * 2 * 128
    assert 0 < whole["validation/tokens"] - fewer["validation/tokens"] < 0.1 * whole["validation/tokens"]

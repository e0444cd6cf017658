"""The trainer, for real: 2 processes over gloo, FSDP2 and HSDP, gradient accumulation, skipped
updates, a rank's error ending the run."""

from __future__ import annotations

import json
import time

import pytest
import torch

from helpers import QUICK, RECIPE, ROOT, losses, records, run_ranks, run_train, state
from hybridtitan.checkpoint import complete_steps


def test_debug_recipe_trains_validates_and_evaluates(tmp_path):
    """The recipe's schedule (200 steps, validation every 50, checkpoints at 100 and 200) on 2 processes, at an
    eighth of its tokens per step (seq_len 128, global batch 4) to keep the suite quick, with lm-eval's local
    stdlib_mc task evaluated during training: the loss it reports after 200 steps (the mean over its last log
    window, steps 191-200) is below 75% of the first step's loss, and so is the held-out loss; the accuracy
    logged at the checkpoints of steps 100 and 200 is what python -m hybridtitan.eval gives on them (each rank
    scored half of the requests)."""
    dump = tmp_path / "run"
    proc = run_train(dump, "--training.seq_len", "128", "--training.local_batch_size", "2",
                     "--training.global_batch_size", "4", "--eval.tasks", "stdlib_mc", "--eval.include_path",
                     "tests/assets/tasks", timeout=1800)
    documents = len((ROOT / "hybridtitan" / "assets" / "corpus" / "train.jsonl").read_text().splitlines())
    assert (f"data: 1 file(s), {documents:,} documents (tokenized as they are read); the run reads 102,400 tokens"
            in proc.stdout + proc.stderr)
    loss = losses(dump)
    assert min(loss) == 1 and max(loss) == 200
    assert loss[200] < 0.75 * loss[1], (loss[1], loss[200])
    held_out = records(dump, "validation/loss")
    assert sorted(held_out) == [50, 100, 150, 200] and held_out[200]["validation/loss"] < 0.75 * loss[1]
    evaluated = records(dump, "eval/stdlib_mc/acc")
    assert sorted(evaluated) == [100, 200]
    from hybridtitan.eval import main as evaluate_checkpoint  # the CLI's entry point, in this process

    for step in (100, 200):
        out = tmp_path / f"eval-{step}.json"
        evaluate_checkpoint(["--checkpoint", str(dump / "checkpoint"), "--step", str(step), "--tasks", "stdlib_mc",
                             "--include_path", str(ROOT / "tests" / "assets" / "tasks"), "--output_path", str(out)])
        results = json.loads(out.read_text())["results"]["stdlib_mc"]
        for metric in ("acc", "acc_norm"):
            assert evaluated[step][f"eval/stdlib_mc/{metric}"] == results[f"{metric},none"], (step, metric)

def test_gradient_accumulation_matches_larger_batch(tmp_path):
    """local batch 2 x 2 accumulation steps == local batch 4 (same data, same update, up to rounding)."""
    big, acc = tmp_path / "big", tmp_path / "acc"
    base = [*QUICK, "--training.steps", "3", "--checkpoint.enable", "false"]
    run_train(big, *base, "--training.local_batch_size", "4", "--training.global_batch_size", "4", nproc=1)
    run_train(acc, *base, "--training.local_batch_size", "2", "--training.global_batch_size", "4", nproc=1)
    lb, la = losses(big), losses(acc)
    for step in (1, 2, 3):
        assert abs(lb[step] - la[step]) < 1e-4 * lb[step], (step, lb[step], la[step])


# Run in 2 ranks by test_hsdp_replicas_hold_equal_weights: the trainer itself (hybridtitan.train.Trainer) on
# 2 ranks as 2 replicas x 1 shard, then every rank's parameters gathered and compared.
_HSDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from hybridtitan.config_manager import parse_config
from hybridtitan.preflight import preflight
from hybridtitan.train import Trainer
cfg = parse_config(sys.argv[1:])
trainer = Trainer(cfg, preflight(cfg))
trainer.train()
local = torch.cat([p.to_local().detach().flatten() for p in trainer.model.parameters()])
gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, local)
if dist.get_rank() == 0:
    print("replicas equal:", all(torch.equal(g, gathered[0]) for g in gathered))
    print("changed by training:", trainer.state.step)
trainer.close(finished=True)
"""


def test_hsdp_replicas_hold_equal_weights(tmp_path):
    """HSDP over 2 ranks (2 replicas x 1 shard): after 3 steps, each on its own data, the replicas hold the same
    weights bit for bit (their gradients were averaged), and the checkpoint saved is one that loads."""
    script = tmp_path / "hsdp.py"
    script.write_text(_HSDP_SCRIPT)
    dump = tmp_path / "hsdp"
    proc = run_ranks([str(script), "--job.config_file", RECIPE, "--job.dump_folder", str(dump), *QUICK,
                      "--training.steps", "3", "--checkpoint.enable", "true", "--checkpoint.interval", "3",
                      "--parallelism.data_parallel_replicate_degree", "2"], 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replicate 2 x shard 1" in proc.stdout
    assert "replicas equal: True" in proc.stdout and "changed by training: 3" in proc.stdout, proc.stdout[-2000:]
    assert complete_steps(str(dump / "checkpoint")) == [3]
    assert all(torch.isfinite(v).all() for v in state(dump, 3).values())


# The trainer with its training loss NaN at the listed forward calls of each rank (so those steps' gradients are
# not finite): each rank runs this script, which patches the model class, then runs `python -m hybridtitan.train`.
_NAN_INJECTOR = """
import os, runpy
_steps = {int(s) for s in os.environ["HT_TEST_NAN_CALLS"].split(",")}
from hybridtitan.models import model as _m
_forward, _calls = _m.HybridLM.forward, [0]
def _forward_with_nan(self, *args, **kwargs):
    out = _forward(self, *args, **kwargs)
    if kwargs.get("labels") is not None:
        _calls[0] += 1
        if _calls[0] in _steps:
            out = (out[0] * float("nan"), out[1]) if isinstance(out, tuple) else out * float("nan")
    return out
_m.HybridLM.forward = _forward_with_nan
runpy.run_module("hybridtitan.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_nonfinite_gradients_skip_the_update(tmp_path, implementation):
    """Steps 3 and 4 get NaN gradients: neither changes the weights (step 4's checkpoint equals step 2's), each
    is logged and counted, and training carries on with finite losses. "fused" skips on the device (the fused
    AdamW's found_inf; the host learns of it a step later), "foreach" on the host."""
    script = tmp_path / "train_with_nan.py"
    script.write_text(_NAN_INJECTOR)
    dump = tmp_path / "run"
    proc = run_ranks([str(script), "--job.config_file", RECIPE, "--job.dump_folder", str(dump), *QUICK,
                      "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                      "--checkpoint.keep_latest_k", "0", "--optimizer.implementation", implementation], 2,
                     environ={"HT_TEST_NAN_CALLS": "3,4"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 3: non-finite gradient norm nan, update skipped" in proc.stdout
    assert "step 4: non-finite gradient norm nan, update skipped" in proc.stdout
    logged = records(dump)
    assert sorted(logged) == [1, 2, 5, 6]  # a window whose every update was skipped logs nothing
    assert logged[2]["skipped_steps"] == 0 and logged[6]["skipped_steps"] == 2
    assert all(r["loss"] == r["loss"] for r in logged.values())  # finite: the skipped steps are not averaged in
    s2, s4, s6 = state(dump, 2), state(dump, 4), state(dump, 6)
    assert all(torch.equal(s2[k], s4[k]) for k in s2)
    assert not all(torch.equal(s4[k], s6[k]) for k in s4)

def test_error_on_one_rank_with_a_background_save_ends_the_run_at_once(tmp_path):
    """A rank that meets bad data mid-run while an async save is in flight: its save completes without a barrier
    the other rank never reaches, and the run ends in seconds with the saves made so far, not at the timeout."""
    words = "the quick brown fox jumps over the lazy dog and keeps on running through the field " * 3
    texts = [words] * 300
    texts[201] = 7  # rank 1's 101st document (positions 1, 3, 5, ...): past its first block of 64
    data = tmp_path / "late.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    t0 = time.monotonic()
    proc = run_train(tmp_path / "run", *QUICK, "--training.steps", "200", "--data.path", str(data), "--data.shuffle",
                     "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.async_mode",
                     "async", "--comm.init_timeout_seconds", "240", check=False, timeout=600, torchrun=True)
    assert proc.returncode != 0
    assert "error: data: document 201: 'text' holds int 7, not text" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert time.monotonic() - t0 < 180, "waited for the collective timeout"
    assert len(complete_steps(str(tmp_path / "run" / "checkpoint"))) >= 2

def test_error_on_one_rank_ends_the_run_at_once(tmp_path):
    """A rank that fails (here: its shard of the data holds only empty documents) exits with its own error; the
    others are stopped by torchrun instead of waiting out the collective timeout in a final barrier."""
    data = tmp_path / "odd.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} has some words in it. " * 5 if i % 2 == 0 else ""})
                            + "\n" for i in range(40)))
    t0 = time.monotonic()
    proc = run_train(tmp_path / "run", *QUICK, "--training.steps", "4", "--data.path", str(data), "--data.shuffle",
                     "false", "--comm.init_timeout_seconds", "240", check=False, timeout=600, torchrun=True)
    assert proc.returncode != 0
    # the failing rank says it in one line, as for other bad input, not in a traceback of the data pipeline
    assert "error: data: shard 1 of 2 holds only empty documents" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "raise DataError" not in proc.stdout + proc.stderr
    # ~15 s here; a rank waiting in the barrier would add the 240 s timeout
    assert time.monotonic() - t0 < 180, "waited for the collective timeout"


# Run in 1 or 2 ranks by test_eod_mask_loss_is_the_global_mean: the trainer on one fixed global batch of 4 rows,
# each rank given its rows (a quarter of them per micro-batch and rank at most), one step, checkpoint saved.
_GLOBAL_BATCH_SCRIPT = """
import os, sys, torch
from hybridtitan.config_manager import parse_config
from hybridtitan.data.loader import Collate
from hybridtitan.preflight import preflight
from hybridtitan.train import Trainer
cfg = parse_config(sys.argv[1:])
plan = preflight(cfg)
trainer = Trainer(cfg, plan)
rows = torch.load(os.environ["HT_TEST_BATCH"])  # [4, T + 1]
rank, local = int(os.environ.get("RANK", "0")), cfg.training.local_batch_size
mine = rows[rank * (len(rows) // plan.layout.dp.size):][: len(rows) // plan.layout.dp.size]
collate = Collate(eos=0, document_boundaries=False, vocab_size=None, eod_mask_loss=cfg.training.eod_mask_loss)
trainer.batches = iter([collate([{"input_ids": r[:-1], "labels": r[1:]} for r in mine[i:i + local]])
                        for i in range(0, len(mine), local)])
trainer.train()
trainer.close(finished=True)
"""


def test_eod_mask_loss_is_the_global_mean(tmp_path):
    """training.eod_mask_loss: no loss where the input is EOD, and the loss is the mean over the counted tokens of
    the whole global batch. Short documents make the counts differ between rows, so a mean per micro-batch would
    differ from it. One step on the same 4 rows, split 4 x 1, 2 micro-batches x 2, 2 ranks x 2, 2 ranks x 2
    micro-batches x 1: the same logged loss, equal to the masked mean computed here, and the same update (up to
    float32 rounding)."""
    from hybridtitan.data.tokenizer import build_tokenizer
    from hybridtitan.models import build_model, get_flavor

    gen = torch.Generator().manual_seed(0)
    T, eos = 64, 0  # the shipped tokenizer's EOS is id 0
    assert build_tokenizer("hybridtitan/assets/tokenizer").eos_token_id == eos
    rows = torch.randint(1, 8192, (4, T + 1), generator=gen)
    rows[torch.rand(4, T + 1, generator=gen) < torch.tensor([0.02, 0.3, 0.1, 0.5]).unsqueeze(1)] = eos
    torch.save(rows, tmp_path / "batch.pt")
    script = tmp_path / "global_batch.py"
    script.write_text(_GLOBAL_BATCH_SCRIPT)
    splits = {"4x1": (1, 4), "2x2": (1, 2), "ranks2x2": (2, 2), "ranks2x1x2": (2, 1)}
    dumps = {}
    for name, (nproc, local) in splits.items():
        dumps[name] = tmp_path / name
        args = [str(script), "--job.config_file", RECIPE, "--job.dump_folder", str(dumps[name]), *QUICK,
                "--training.seq_len", str(T), "--training.local_batch_size", str(local),
                "--training.global_batch_size", "4", "--training.steps", "1", "--training.eod_mask_loss", "true",
                "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--lr_scheduler.warmup_steps", "0",
                # Adam with a large eps: an update proportional to the gradient, which the weights then show (with
                # the usual eps, a gradient near zero would turn into a full step of either sign)
                "--optimizer.lr", "1.0", "--optimizer.eps", "1.0", "--optimizer.weight_decay", "0"]
        proc = run_ranks(args, nproc, environ={"HT_TEST_BATCH": str(tmp_path / "batch.pt")})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the expected loss: the initial model (the trainer's seed) on all 4 rows, masked where the input is EOD
    torch.manual_seed(42)  # as the trainer builds it: on the meta device, then initialised
    model = build_model(get_flavor("debug_hybrid"), "meta")
    model.to_empty(device="cpu")
    model.init_weights()
    inputs, labels = rows[:, :-1], rows[:, 1:].masked_fill(rows[:, :-1] == eos, -100)
    with torch.no_grad():
        logits = model(inputs)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
    per_row = [torch.nn.functional.cross_entropy(logits[i], labels[i]).item() for i in range(4)]
    assert abs(sum(per_row) / 4 - expected) > 1e-4 * expected  # a mean of means: 10x the tolerance below
    for name, dump in dumps.items():
        record = records(dump)[1]
        assert abs(record["loss"] - expected) < 1e-5 * expected, (name, record["loss"], expected)
        assert record["loss_tokens"] == int((labels != -100).sum())
    initial = model.state_dict()
    reference = {key: value - initial[key] for key, value in state(dumps["4x1"], 1).items()}
    assert all(update.abs().max() > 0 for key, update in reference.items() if "embeddings" in key or "proj" in key)
    for name in ("2x2", "ranks2x2", "ranks2x1x2"):
        for key, value in state(dumps[name], 1).items():
            update = value - initial[key]
            assert (update - reference[key]).norm() <= 1e-4 * reference[key].norm() + 1e-7, (name, key)

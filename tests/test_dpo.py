"""DPO, the third upcycling stage: the loss and its gradient against their written-out definition, the preference
rows' masks, a debug student's preference accuracy rising on a preference set made here, a bitwise resume on 2
ranks, and malformed preference data refused in one line (exit code 2) before anything is written."""

from __future__ import annotations

import functools
import json
import random
import shutil

import pytest
import torch

from helpers import main_error, records, run_train, state
from hybridtitan.ops.dpo import dpo_loss, sequence_logprobs

FLAVOR = "debug_llama"
# 2 pairs per rank and micro-batch, sequences of at most 128 tokens (the Zebra template's headers are 60 of them)
QUICK = ["--training.seq_len", "128", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
WORDS = ["apple", "river", "stone", "cloud", "green", "light", "table", "music", "north", "paper"]


@functools.cache
def answers() -> tuple[list[str], list[str]]:
    """30 words for the chosen responses and 30 others for the rejected ones, each one token of the shipped
    tokenizer: a model learns each word's preference from the pairs that hold it (one step does not teach all)."""
    from hybridtitan.data import build_tokenizer

    vocab = build_tokenizer("hybridtitan/assets/tokenizer").get_vocab()
    pool = sorted(k[1:] for k in vocab if k.startswith("\u0120") and k[1:].isalpha() and k[1:].islower()
                  and len(k) >= 6)
    return pool[0:300:10], pool[5:305:10]


def preference_rows(n: int, seed: int) -> list[dict]:
    """Pairs whose chosen response is one of the chosen words and rejected one of the others, at random."""
    rng = random.Random(seed)
    good, bad = answers()
    rows = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": f"Describe {words}.", "chosen": f"It is {rng.choice(good)}.",
                     "rejected": f"It is {rng.choice(bad)}."})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def recipe(tmp_path) -> str:
    """A DPO recipe of the debug Llama: the [dpo] pairs a test writes, the shipped tokenizer."""
    path = tmp_path / "dpo.toml"
    path.write_text(f"""
[model]
flavor = "{FLAVOR}"
[data]
tokenizer = "hybridtitan/assets/tokenizer"
[dpo]
chat_template = "zebra"
beta = 0.1
[optimizer]
lr = 1e-3
weight_decay = 0.0
implementation = "foreach"
[lr_scheduler]
warmup_steps = 0
[training]
steps = 10
[checkpoint]
enable = true
interval = 100
[activation_checkpoint]
mode = "none"
[debug]
seed = 7
""")
    return str(path)


def start_checkpoint(dump) -> str:
    """A debug Llama from its seeded initialisation, as the run's own model-only step-0 (the stage's start)."""
    from hybridtitan.checkpoint import save_model_checkpoint
    from hybridtitan.models import build_model, get_flavor

    torch.manual_seed(0)
    model = build_model(get_flavor(FLAVOR), "cpu")
    with torch.no_grad():
        model.init_weights()
    step0 = dump / "checkpoint" / "step-0"
    step0.parent.mkdir(parents=True)
    save_model_checkpoint(model, str(step0))
    return str(step0)


# --------------------------------------------------------------------------------------------- the definition


def test_loss_and_gradient_equal_the_definition():
    """The summed response log-probabilities (prompt tokens ignored), the DPO loss, the rewards and the gradients
    of the hidden states and output weight equal -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))) written out
    over the full logits; chunking changes nothing."""
    torch.manual_seed(0)
    pairs, T, D, V, beta = 3, 9, 8, 40, 0.3
    hidden = torch.randn(2 * pairs, T, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    labels = torch.randint(0, V, (2 * pairs, T))
    prompt = torch.tensor([2, 3, 1, 2, 3, 1])  # each row's prompt tokens: their labels are not counted
    ends = torch.tensor([9, 7, 8, 6, 9, 5])  # and the padding after the response
    positions = torch.arange(T)
    counted = (positions >= (prompt - 1).unsqueeze(1)) & (positions < (ends - 1).unsqueeze(1))
    masked = labels.masked_fill(~counted, -100)
    ref = torch.randn(2 * pairs)

    logp = sequence_logprobs(hidden, weight, masked, chunk_size=4)
    loss, chosen, rejected = dpo_loss(logp[:pairs], logp[pairs:], ref[:pairs], ref[pairs:], beta)

    log_softmax = torch.log_softmax(hidden @ weight.t(), dim=-1)
    expected_logp = torch.stack([sum(log_softmax[r, t, labels[r, t]] for t in range(T) if counted[r, t])
                                 for r in range(2 * pairs)])
    pi_c, pi_r, ref_c, ref_r = expected_logp[:pairs], expected_logp[pairs:], ref[:pairs], ref[pairs:]
    expected = -torch.log(torch.sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))))
    torch.testing.assert_close(logp, expected_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chosen, (beta * (pi_c - ref_c)).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rejected, (beta * (pi_r - ref_r)).detach(), rtol=1e-5, atol=1e-5)
    ours = torch.autograd.grad(loss.sum(), (hidden, weight))
    theirs = torch.autograd.grad(expected.sum(), (hidden, weight))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the reference's path: no graph, the same sums
        torch.testing.assert_close(sequence_logprobs(hidden, weight, masked, chunk_size=100), expected_logp.detach(),
                                   rtol=1e-5, atol=1e-5)


def test_rows_count_the_response_tokens_alone(tmp_path):
    """A pair's rows are prompt then response, rendered through the Zebra template; the labels are the response's
    tokens at the positions that predict them, nothing of the prompt or the padding; a long response is cut to
    max_length and counted as truncated."""
    from hybridtitan.data import build_tokenizer
    from hybridtitan.data.preference import collate, read_pairs
    from hybridtitan.job_config import Dpo

    tok = build_tokenizer("hybridtitan/assets/tokenizer")
    rows = preference_rows(3, 0) + [{"prompt": "Say it.", "chosen": "word " * 200, "rejected": "No."}]
    d = Dpo(path=write_jsonl(tmp_path / "pairs.jsonl", rows))
    pairs = read_pairs(d, tok, max_length=128, vocab_size=8192)
    assert len(pairs) == 4 and pairs.truncated == 1
    batch = collate([pairs.rows(i) for i in range(4)])
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 128)
    for i in range(4):
        prompt = pairs.prompts[i]
        for row, response in ((i, pairs.chosen[i]), (4 + i, pairs.rejected[i])):
            ids, labels = batch["input_ids"][row], batch["labels"][row]
            assert ids[:len(prompt)].tolist() == prompt.tolist()
            assert ids[len(prompt):len(prompt) + len(response)].tolist() == response.tolist()
            counted = (labels != -100).nonzero().squeeze(1)
            assert counted.tolist() == list(range(len(prompt) - 1, len(prompt) + len(response) - 1))
            assert labels[counted].tolist() == response.tolist()
    text = tok.decode(pairs.prompts[0].tolist() + pairs.chosen[0].tolist())
    assert text.endswith(f"<|start_header_id|>assistant<|end_header_id|>\n\n{rows[0]['chosen']}<|eot_id|>"), text
    assert len(pairs.prompts[3]) + len(pairs.chosen[3]) == 128


def test_conversations_read_through_datasets(tmp_path):
    """Rows as Hugging Face's ultrafeedback_binarized holds them (each response a conversation ending with it, the
    prompt its turns before), from a file datasets reads: the prompt is the conversation's turns before the
    response, rendered as a prompt given as text would be; responses that continue different conversations are
    refused, naming the row."""
    from hybridtitan.data import build_tokenizer
    from hybridtitan.data.preference import read_pairs
    from hybridtitan.job_config import Dpo

    tok = build_tokenizer("hybridtitan/assets/tokenizer")
    user = {"role": "user", "content": "Name a prime."}
    rows = [{"prompt": "Name a prime.", "chosen": [user, {"role": "assistant", "content": "7."}],
             "rejected": [user, {"role": "assistant", "content": "9."}]}]
    (tmp_path / "pairs.json").write_text(json.dumps(rows))
    as_text = tmp_path / "text.jsonl"
    write_jsonl(as_text, [{"prompt": "Name a prime.", "chosen": "7.", "rejected": "9."}])
    pairs = read_pairs(Dpo(path=str(tmp_path / "pairs.json")), tok, max_length=128, vocab_size=8192)
    text = read_pairs(Dpo(path=str(as_text)), tok, max_length=128, vocab_size=8192)
    for a, b in ((pairs.prompts, text.prompts), (pairs.chosen, text.chosen), (pairs.rejected, text.rejected)):
        assert a[0].tolist() == b[0].tolist()
    rows[0]["rejected"][0] = {"role": "user", "content": "Name a square."}
    (tmp_path / "pairs.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="dpo.path: row 0: 'chosen' and 'rejected' continue different"):
        read_pairs(Dpo(path=str(tmp_path / "pairs.json")), tok, max_length=128, vocab_size=8192)


# ------------------------------------------------------------------------------------------------- training


def test_preference_accuracy_rises(tmp_path):
    """A debug Llama trained by DPO from its own initialisation (the reference) for 10 steps on pairs made here:
    the first step's loss is log 2 (the student is the reference), the held-out preference accuracy and reward
    margin rise; the log holds the training terms and the validation's."""
    dump = tmp_path / "run"
    start_checkpoint(dump)
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(64, 1))
    held = write_jsonl(tmp_path / "held.jsonl", preference_rows(16, 2))
    run_train(dump, *QUICK, "--dpo.path", train, "--dpo.validation_path", held, "--validation.enable", "true",
              "--validation.freq", "1", "--training.steps", "10", recipe=recipe(tmp_path), nproc=1)
    held_out = records(dump, "validation/loss")
    assert held_out[1]["validation/pairs"] == 16
    first, last = held_out[1], held_out[10]
    # (from 0.625 after the first step to 1.0 by the fifth, 2026-12-07)
    assert last["dpo/accuracy"] >= 0.9 and last["dpo/accuracy"] > first["dpo/accuracy"] + 0.2, held_out
    assert last["dpo/margin"] > first["dpo/margin"] and last["validation/loss"] < first["validation/loss"]
    assert last["dpo/chosen_reward"] - last["dpo/rejected_reward"] == pytest.approx(last["dpo/margin"], rel=1e-6)
    logged = records(dump)
    assert {"dpo/train_accuracy", "dpo/train_margin"} <= set(logged[10])
    assert logged[1]["loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2: the student is the reference
    config = json.loads((dump / "job_config.json").read_text())
    assert config["dpo"]["reference"] == str(dump / "checkpoint" / "step-0")


def test_dpo_resumes_exactly_on_two_ranks(tmp_path):
    """DPO on 2 processes (FSDP2 over gloo), validation on: 3 steps, stop, resume to 6 equals 6 steps straight,
    every loss term and every weight bitwise; the reference is in no checkpoint."""
    train = write_jsonl(tmp_path / "train.jsonl", preference_rows(24, 3))  # 6 steps of 4 pairs: an epoch's turn
    held = write_jsonl(tmp_path / "held.jsonl", preference_rows(6, 4))
    common = [*QUICK, "--dpo.path", train, "--dpo.validation_path", held, "--validation.enable", "true",
              "--validation.freq", "2", "--checkpoint.interval", "3", "--lr_scheduler.total_steps", "6",
              "--training.local_batch_size", "1", "--training.global_batch_size", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for dump in (straight, resumed):
        start_checkpoint(dump)
    config = recipe(tmp_path)
    run_train(straight, *common, "--training.steps", "6", recipe=config)
    run_train(resumed, *common, "--training.steps", "3", recipe=config)
    proc = run_train(resumed, *common, "--training.steps", "6", recipe=config)
    assert f"resumed from {resumed / 'checkpoint'}/step-3" in proc.stdout, proc.stdout[-2000:]
    a, b = records(straight), records(resumed)
    for step in (4, 5, 6):
        for key in ("loss", "dpo/train_accuracy", "dpo/train_margin", "grad_norm"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    va, vb = records(straight, "validation/loss"), records(resumed, "validation/loss")
    assert va[6] == vb[6]
    sa, sb = state(straight, 6), state(resumed, 6)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(resumed / "checkpoint" / "step-6")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.") for k in keys) and "dataloader" in {k.split(".")[0] for k in keys}
    assert not any("reference" in k for k in keys)


def test_the_reference_is_the_start_and_stays_it_on_a_resume(tmp_path):
    """Unset, dpo.reference is the newest step of checkpoint.initial_load_path's folder when the run starts; a resume
    reads the step its run recorded, not a newer one that has appeared in that folder since."""
    from hybridtitan.config_manager import parse_config
    from hybridtitan.dpo import reference_path
    from hybridtitan.preflight import StartPoint

    path = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(4, 0))
    start_checkpoint(tmp_path / "kl")  # kl/checkpoint/step-0
    cfg = parse_config(["--job.config_file", recipe(tmp_path), "--job.dump_folder", str(tmp_path / "run"),
                        "--dpo.path", path, "--checkpoint.initial_load_path", str(tmp_path / "kl" / "checkpoint")])
    first = reference_path(cfg, None)
    assert first == str(tmp_path / "kl" / "checkpoint" / "step-0")
    shutil.copytree(first, tmp_path / "kl" / "checkpoint" / "step-7")  # a newer step of stage 2
    own = tmp_path / "run" / "checkpoint" / "step-3"
    own.mkdir(parents=True)
    (own / "job_config.json").write_text(json.dumps({"dpo": {"reference": first}}))
    assert reference_path(cfg, StartPoint(str(own), model_only=False, description="resumed")) == first
    assert reference_path(cfg, None) == str(tmp_path / "kl" / "checkpoint" / "step-7")


# ------------------------------------------------------------------------------------------- malformed data


@pytest.mark.parametrize("line, expected", [
    ({"prompt": "Hello.", "rejected": "No."}, "pairs.jsonl line 3: no 'chosen' field"),
    ({"prompt": "Hello.", "chosen": "  ", "rejected": "No."}, "pairs.jsonl line 3: 'chosen' is an empty response"),
    ('{"prompt": "Hello.", "chosen": "Yes.", ', "pairs.jsonl line 3: not JSON"),
    ({"prompt": "word " * 80, "chosen": "Yes.", "rejected": "No."},
     "pairs.jsonl line 3: the prompt alone is"),
])
def test_malformed_preference_data_is_refused(tmp_path, capsys, line, expected):
    """A missing field, an empty response, a line that is not JSON, a prompt longer than the pair's max length
    (training.seq_len): one line naming the file's line and the field, exit code 2, nothing written."""
    dump = tmp_path / "run"
    start_checkpoint(tmp_path / "start")
    rows = preference_rows(2, 0) + [line] + preference_rows(2, 1)
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    code, err = main_error(capsys, ["--job.config_file", recipe(tmp_path), "--job.dump_folder", str(dump), *QUICK,
                                    "--dpo.path", path, "--checkpoint.initial_load_path", str(tmp_path / "start")])
    assert code == 2 and err.startswith("error: dpo.path: ") and expected in err and "\n" not in err, err
    assert not dump.exists()


def test_a_dpo_recipe_without_a_reference_or_with_other_data_is_refused(tmp_path, capsys):
    """No checkpoint to start from and no dpo.reference, or [data] / [distill] set beside [dpo]: one line each."""
    path = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(4, 0))
    base = ["--job.config_file", recipe(tmp_path), "--job.dump_folder", str(tmp_path / "run"), *QUICK,
            "--dpo.path", path]
    for extra, expected in (([], "dpo.reference: the run starts from no checkpoint"),
                            (["--data.path", path], "dpo.path: a DPO run does not take data.path"),
                            (["--validation.enable", "true"], "dpo.validation_path: validation.enable needs")):
        code, err = main_error(capsys, base + extra)
        assert code == 2 and expected in err and "\n" not in err, (extra, err)
    assert not (tmp_path / "run").exists()

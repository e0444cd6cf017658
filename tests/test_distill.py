"""Distillation for real: a tiny Llama teacher trained here by the trainer on the shipped corpus, upcycled into a
`*-M-M-M-` hybrid and distilled by the trainer (KL, cross-entropy and layer distillation), exact resume, the
losses against their direct definitions, and a teacher that does not fit the student refused in one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from helpers import QUICK, main_error, records, run_train, state
from hybridtitan.ops.kl_div import kl_chunk, layer_distance, linear_kl_div

STUDENT = ["--model.flavor", "debug_llama_upcycled"]
TEACHER_STEPS = 150


@pytest.fixture(scope="session")
def teacher(tmp_path_factory):
    """debug_llama trained for TEACHER_STEPS steps on the shipped corpus (one process)."""
    dump = tmp_path_factory.mktemp("teacher")
    run_train(dump, *QUICK, "--model.flavor", "debug_llama", "--training.steps", str(TEACHER_STEPS),
              "--metrics.log_freq", "50", "--checkpoint.interval", str(TEACHER_STEPS), nproc=1)
    return dump / "checkpoint" / f"step-{TEACHER_STEPS}"


def upcycle(teacher, folder):
    """The teacher upcycled into debug_llama_upcycled (*-M-M-M-: its layer 0 as MLA), in folder's checkpoint/step-0."""
    from hybridtitan.upcycle import main

    main(["--model", str(teacher), "--attention-layers", "0", "--output", str(folder / "checkpoint" / "step-0")])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("ce_weight", [0.0, 0.7])
def test_linear_kl_div_equals_its_definition(temperature, ce_weight):
    """Chunked, with ignored tokens: the KL, the cross-entropy, the weighted loss and its gradients equal those of
    the full logits through torch's kl_div and cross_entropy."""
    torch.manual_seed(0)
    V, N = 50, 37
    h = torch.randn(N, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    th, tw = torch.randn(N, 6), torch.randn(V, 6)
    targets = torch.randint(0, V, (N,))
    targets[:5] = -100
    loss, kl, ce, count = linear_kl_div(h, w, th, tw, targets, temperature=temperature, kl_weight=0.5,
                                        ce_weight=ce_weight, chunk_size=8)
    valid = targets != -100
    s, t = h @ w.t(), th @ tw.t()
    ref_kl = torch.nn.functional.kl_div(torch.log_softmax(s / temperature, 1), torch.log_softmax(t / temperature, 1),
                                        log_target=True, reduction="none").sum(1)[valid].sum()
    ref_ce = torch.nn.functional.cross_entropy(s[valid], targets[valid], reduction="sum")
    ref = 0.5 * temperature**2 * ref_kl + ce_weight * ref_ce
    assert count == valid.sum()
    torch.testing.assert_close(kl, ref_kl.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    if ce_weight:
        torch.testing.assert_close(ce, ref_ce.detach(), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # validation's path: the same sums, no gradient buffers
        _, kl2, ce2, _ = linear_kl_div(h, w, th, tw, targets, temperature=temperature, chunk_size=8)
    torch.testing.assert_close(kl2, ref_kl.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ce2, torch.nn.functional.cross_entropy(s[valid], targets[valid], reduction="sum")
                               .detach(), rtol=1e-5, atol=1e-5)


def test_compiled_kl_chunk_equals_eager():
    from hybridtitan.ops.kl_div import compiled_kl_chunk

    torch.manual_seed(0)
    s, t = torch.randn(16, 300), torch.randn(16, 300)
    target, valid = torch.randint(0, 300, (16, 1)), torch.rand(16) > 0.3
    for a, b in zip(kl_chunk(s.clone(), t, target, valid, 1.5, 2.0, 0.5),
                    compiled_kl_chunk()(s.clone(), t, target, valid, 1.5, 2.0, 0.5)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_layer_distance():
    a, b = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    valid = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    expected = sum(torch.linalg.vector_norm(a[i, j] - b[i, j]) for i in range(2) for j in range(5) if valid[i, j])
    torch.testing.assert_close(layer_distance(a, b, valid), expected)


def test_teacher_forced_blocks_of_a_model_fed_its_own_streams_give_them_back():
    """Each block of the Llama pattern (attention then MLP) fed the model's own stream returns the next stream (the
    final-normed states after the last) and the attention's contribution: layer distillation of a model against
    itself is zero."""
    from hybridtitan.models import build_model, get_flavor
    from hybridtitan.models.model import StreamRecord

    model = build_model(get_flavor("debug_llama"), "cpu")
    model.init_weights()
    ids = torch.randint(0, 8192, (2, 16))
    streams = StreamRecord()
    with torch.no_grad():
        model(ids, head=lambda h, w: h, collect=streams)
        out = model.teacher_forced(list(streams[:-1]))
    assert [(b.start, b.stop) for b in model.blocks()] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for block, (stream, mixed) in zip(model.blocks(), out):
        torch.testing.assert_close(stream, streams[block.stop], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed, streams[block.start + 1] - streams[block.start], rtol=1e-5, atol=1e-5)


def test_upcycled_and_distilled_beats_training_from_scratch(teacher, tmp_path):
    """The teacher upcycled into *-M-M-M- and distilled for 40 steps (KL and cross-entropy) reaches a lower held-out
    loss than the same hybrid from random initialisation trained for the same 40 steps on the same data; the log
    holds the KL and cross-entropy, the held-out KL is logged and falls."""
    steps = ["--training.steps", "40", "--validation.enable", "true", "--validation.freq", "20",
             "--validation.steps", "4", "--metrics.log_freq", "10", "--checkpoint.interval", "40"]
    distilled, scratch = tmp_path / "distilled", tmp_path / "scratch"
    upcycle(teacher, distilled)
    run_train(distilled, *QUICK, *STUDENT, *steps, "--distill.teacher", str(teacher), "--distill.ce_weight", "0.5",
              nproc=1)
    run_train(scratch, *QUICK, *STUDENT, *steps, nproc=1)
    held_out = {name: records(dump, "validation/loss") for name, dump in (("d", distilled), ("s", scratch))}
    assert held_out["d"][40]["validation/loss"] < held_out["s"][40]["validation/loss"] - 0.2, held_out
    kl = {step: r["validation/kl"] for step, r in held_out["d"].items()}
    assert kl[40] < kl[20] and "validation/kl" not in held_out["s"][40]
    logged = records(distilled)[40]
    assert {"distill/kl", "distill/ce"} <= set(logged)
    assert logged["loss"] == pytest.approx(logged["distill/kl"] + 0.5 * logged["distill/ce"], rel=1e-4)


def test_distillation_resumes_exactly_on_two_ranks(teacher, tmp_path):
    """KL + cross-entropy + layer distillation on 2 processes with packed documents and the EOD mask: 3 steps, stop,
    resume to 6 equals 6 steps straight, every loss term and every weight bitwise; the teacher is in no
    checkpoint."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for dump in (straight, resumed):
        upcycle(teacher, dump)
    common = [*QUICK, *STUDENT, "--distill.teacher", str(teacher), "--distill.ce_weight", "0.3",
              "--distill.layer_weight", "0.1", "--training.eod_mask_loss", "true", "--checkpoint.interval", "3",
              "--lr_scheduler.total_steps", "6"]
    run_train(straight, *common, "--training.steps", "6")
    run_train(resumed, *common, "--training.steps", "3")
    run_train(resumed, *common, "--training.steps", "6")
    a, b = records(straight), records(resumed)
    for step in (4, 5, 6):
        for key in ("loss", "distill/kl", "distill/ce", "distill/layer"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    sa, sb = state(straight, 6), state(resumed, 6)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(straight / "checkpoint" / "step-6")).read_metadata().state_dict_metadata
    assert not any("teacher" in k for k in keys)
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == set(sa)


def test_gradient_accumulation_with_a_teacher(teacher, tmp_path):
    """Local batch 2 x 2 accumulation steps == local batch 4: the distillation losses are sums over the counted
    tokens, divided by the global batch's count."""
    base = [*QUICK, *STUDENT, "--distill.teacher", str(teacher), "--distill.layer_weight", "0.5",
            "--training.steps", "2", "--checkpoint.initial_load_path", str(tmp_path / "up" / "checkpoint" / "step-0"),
            "--training.global_batch_size", "4"]
    upcycle(teacher, tmp_path / "up")
    run_train(tmp_path / "big", *base, "--training.local_batch_size", "4", nproc=1)
    run_train(tmp_path / "acc", *base, "--training.local_batch_size", "2", nproc=1)
    for step in (1, 2):
        big, acc = records(tmp_path / "big")[step], records(tmp_path / "acc")[step]
        for key in ("loss", "distill/kl", "distill/layer"):
            assert big[key] == pytest.approx(acc[key], rel=1e-4), (step, key)


def test_a_teacher_sharded_over_two_ranks_gives_the_whole_teachers_kl(teacher, tmp_path):
    """2 ranks on the same data, the teacher (and student) sharded over both (FSDP: each rank reads its half of the
    teacher, model_loader.load_into_shards) or whole on each (HSDP of 2 replicas of 1 shard): the same KL, layer
    distance and loss at every step."""
    base = [*QUICK, *STUDENT, "--distill.teacher", str(teacher), "--distill.layer_weight", "0.5",
            "--training.steps", "2", "--checkpoint.initial_load_path", str(tmp_path / "up" / "checkpoint" / "step-0")]
    upcycle(teacher, tmp_path / "up")
    run_train(tmp_path / "sharded", *base)
    run_train(tmp_path / "whole", *base, "--parallelism.data_parallel_replicate_degree", "2",
              "--parallelism.data_parallel_shard_degree", "1")
    for step in (1, 2):
        sharded, whole = records(tmp_path / "sharded")[step], records(tmp_path / "whole")[step]
        for key in ("loss", "distill/kl", "distill/layer"):
            assert sharded[key] == pytest.approx(whole[key], rel=1e-4), (step, key)


def test_upcycle_selects_by_the_kl_as_defined(tmp_path):
    """upcycle select's measure (kl_to_teacher) against the KL written out from both models' full logits: the
    mean over the counted tokens of sum_v p_teacher (log p_teacher - log p_student)."""
    from hybridtitan.models import build_model, get_flavor
    from hybridtitan.upcycle import kl_to_teacher

    torch.manual_seed(0)
    teacher_model = build_model(get_flavor("debug_llama"), "cpu").eval()
    student = build_model(get_flavor("debug_llama_upcycled"), "cpu").eval()
    for m in (teacher_model, student):
        m.init_weights()
    ids = torch.randint(0, 8192, (2, 64))
    labels = torch.roll(ids, -1, dims=1)
    labels[0, :5] = -100  # tokens not counted
    batches = [{"input_ids": ids, "labels": labels}]
    with torch.no_grad():
        measured = kl_to_teacher(student, teacher_model, batches)
        log_p = torch.log_softmax(teacher_model(ids).double(), -1)
        log_q = torch.log_softmax(student(ids).double(), -1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    expected = per_token[labels != -100].mean().item()
    assert measured == pytest.approx(expected, rel=1e-4)
    assert expected > 0.01  # two unrelated models: a KL far from 0


def test_a_teacher_that_does_not_fit_is_one_line(teacher, tmp_path, capsys):
    """Another vocabulary, another tokenizer, a missing folder, layer distillation across other structures: one
    line, exit code 2, before anything is written."""
    from test_llama import make_llama

    dump = tmp_path / "run"
    base = ["--job.config_file", "train_configs/debug_hybrid.toml", "--job.dump_folder", str(dump), *QUICK, *STUDENT]

    def refused(extra, message):
        code, err = main_error(capsys, [*base, *extra])
        assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert message in err, err
        assert not dump.exists()

    make_llama(tmp_path / "small_vocab", vocab_size=4096)
    shutil.copytree("hybridtitan/assets/tokenizer", tmp_path / "small_vocab", dirs_exist_ok=True)
    refused(["--distill.teacher", str(tmp_path / "small_vocab")], "has a vocabulary of 4096, the student 8192")

    other = tmp_path / "other_tokenizer"
    make_llama(other)
    shutil.copytree("hybridtitan/assets/tokenizer", other, dirs_exist_ok=True)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    refused(["--distill.teacher", str(other)], "its tokenizer")
    refused(["--distill.teacher", str(other)], "differs from data.tokenizer")

    refused(["--distill.teacher", str(tmp_path / "nowhere")], "distill.teacher: checkpoint not found")
    refused(["--distill.teacher", str(teacher), "--distill.layer_weight", "1", "--model.pattern=*-M-MM-M-"],
            "differ in their MLPs' places or width")
    refused(["--distill.teacher", str(teacher), "--distill.kl_weight", "0"], "are all 0: nothing would be learned")
    refused(["--distill.teacher", str(teacher), "--distill.temperature", "0"], "distill.temperature must be positive")
    assert not os.path.exists(dump)


KL_KERNEL_SCRIPT = r"""
import torch
from hybridtitan.ops import kl_div, kl_div_triton

torch.manual_seed(0)
for rows, vocab, block, temperature, ce_weight in [(7, 1000, 256, 1.0, 0.0), (9, 1024, 256, 2.0, 0.0),
                                                   (5, 300, 512, 1.0, 0.7), (3, 64, 64, 0.5, 0.0)]:
    s = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
    t = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows, 1))
    valid = torch.rand(rows) > 0.3
    valid[0], valid[-1] = True, False
    ref_kl, ref_ce, ref_grad = kl_div.kl_chunk(s.clone(), t, target, valid, temperature, 1.5 * temperature ** 2,
                                                ce_weight)
    buffer = s.clone()
    kl, ce, grad = kl_div_triton.kl_chunk(buffer, t, target, valid, temperature, 1.5 * temperature ** 2, ce_weight,
                                           block=block, num_warps=4)
    assert grad.data_ptr() == buffer.data_ptr() and grad.dtype == torch.bfloat16
    assert abs(kl.item() - ref_kl.item()) <= 1e-4 * abs(ref_kl.item()) + 1e-5, (kl, ref_kl)
    assert abs(ce.item() - ref_ce.item()) <= 1e-4 * abs(ref_ce.item()) + 1e-5, (ce, ref_ce)
    assert (grad.float() - ref_grad.float()).abs().max().item() <= 2 ** -7
    assert (grad[~valid] == 0).all()
print("OK")
"""


def test_kl_kernel_in_triton_interpreter(run_in_triton_interpreter):
    """The GPUs' KL chunk kernel (ops.kl_div_triton), run by Triton's interpreter on the CPU, against the eager
    chunk: KL, cross-entropy at temperature 1, the gradient written over the student's logits, ignored rows, a
    vocabulary that is no multiple of the block, temperatures above and below 1."""
    run_in_triton_interpreter(KL_KERNEL_SCRIPT)

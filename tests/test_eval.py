"""lm-eval over our model, offline: a small multiple-choice task shipped in tests/assets/tasks, scored from a DCP
checkpoint and from its Hugging Face export (FLA's layout and ours) with the same accuracy; the LM's three request
kinds checked against direct computations and against transformers' generate()."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_export_hf import run_cli, train_debug_checkpoints  # the session's trained dumps, shared

TASKS = Path(__file__).resolve().parent / "assets" / "tasks"


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    return train_debug_checkpoints(tmp_path_factory)


def _run_eval(capsys, argv) -> str:
    from hybridtitan.eval import main

    main(argv)
    return capsys.readouterr().out


@pytest.mark.parametrize("flavor", ["debug_hybrid", "debug_gdn"])
def test_same_accuracy_from_dcp_and_hf_export(flavor, trained, tmp_path, capsys):
    """debug_hybrid goes through our own HF layout, debug_gdn through FLA's (read back by the reverse mapping)."""
    from hybridtitan.export_hf import export

    hf_dir = tmp_path / "hf"
    export(str(trained[flavor]), str(hf_dir), dtype="float32")
    results = {}
    for name, source in (("dcp", trained[flavor]), ("hf", hf_dir)):
        # a file, and a folder that does not exist yet (a path ending with a separator)
        output = str(tmp_path / f"{name}.json") if name == "dcp" else str(tmp_path / "new" / "results") + os.sep
        out = _run_eval(capsys, ["--checkpoint", str(source), "--tasks", "stdlib_mc", "--include_path", str(TASKS),
                                 "--batch_size", "16", "--output_path", output, "--device", "cpu",
                                 "--bootstrap_iters", "0"])
        assert "stdlib_mc" in out and "|acc" in out.replace(" ", "")  # lm-eval's table
        (path,) = [Path(output)] if name == "dcp" else list(Path(output).glob("results_*.json"))
        results[name] = json.loads(path.read_text())["results"]["stdlib_mc"]
    assert results["dcp"]["acc,none"] == results["hf"]["acc,none"]
    assert results["dcp"]["acc_norm,none"] == results["hf"]["acc_norm,none"]
    assert 0.0 <= results["dcp"]["acc,none"] <= 1.0


@pytest.fixture(scope="module")
def lm_and_hf(trained, tmp_path_factory):
    """HybridTitanLM over the trained debug_hybrid DCP checkpoint, and transformers' model of its export."""
    from transformers import AutoModelForCausalLM

    import hybridtitan.hf  # noqa: F401
    from hybridtitan.export_hf import export
    from hybridtitan.lm_eval_model import HybridTitanLM
    from hybridtitan.model_loader import load

    model, tok, _ = load(str(trained["debug_hybrid"]))
    hf_dir = tmp_path_factory.mktemp("lm") / "hf"
    export(str(trained["debug_hybrid"]), str(hf_dir), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    return HybridTitanLM(model, tok, batch_size=3, max_length=64), hf


def _requests(kind, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


def test_loglikelihood_batched_equals_direct(lm_and_hf):
    lm, hf = lm_and_hf
    pairs = [("Return the number of Thread objects", " currently alive."), ("Close the file", " and flush it."),
             ("Set", " the debug output level."), ("", "Return whether a path is absolute.")]
    batched = lm.loglikelihood(_requests("loglikelihood", pairs))
    lm.batch_size = 1
    single = lm.loglikelihood(_requests("loglikelihood", pairs))
    lm.batch_size = 3
    for (a, ga), (b, gb) in zip(batched, single):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    # directly from the logits of the concatenated tokens
    ctx, cont = lm.tok_encode(pairs[0][0]), lm.tok_encode(pairs[0][0] + pairs[0][1])[len(lm.tok_encode(pairs[0][0])):]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids)[0, :-1].float(), -1)
    direct = sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
    assert batched[0][0] == pytest.approx(direct, abs=1e-4)


def test_loglikelihood_rolling(lm_and_hf):
    lm, _ = lm_and_hf
    text = "Return the hash value of the object. Serialize obj to a JSON formatted str."
    ids = lm.tok_encode(text)
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([[lm.eot_token_id] + ids]))[0, :-1].float(), -1)
    direct = logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).sum().item()
    (rolled,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    assert rolled == pytest.approx(direct, abs=1e-3)
    lm.max_length = 8  # several disjoint windows
    try:
        (windowed,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    finally:
        lm.max_length = 64
    assert windowed < 0 and windowed != pytest.approx(rolled, abs=1e-6)


def test_generate_until_matches_transformers_generate(lm_and_hf):
    """Batched lockstep greedy decoding (prompts of different lengths) = transformers' generate() per prompt."""
    lm, hf = lm_and_hf
    prompts = ["Return the number of", "Close the file and flush the write buffer of the", "Set the",
               "Read and return at most size bytes"]
    new = 6
    texts = lm.generate_until(_requests("generate_until", [(p, {"until": ["\x00"], "max_gen_toks": new})
                                                         for p in prompts]))
    for prompt, text in zip(prompts, texts):
        ids = torch.tensor([lm.tok_encode(prompt)])
        out = hf.generate(ids, max_new_tokens=new, do_sample=False)[0, ids.shape[1]:].tolist()
        if out and out[-1] == lm.eot_token_id:
            out = out[:-1]
        assert text == lm.tok_decode(out), prompt
    # a stop string cuts the continuation
    stop = texts[0][1:3] if len(texts[0]) > 3 else texts[0]
    (cut,) = lm.generate_until(_requests("generate_until", [(prompts[0], {"until": [stop], "max_gen_toks": new})]))
    assert stop not in cut and texts[0].startswith(cut)


def test_eval_bad_input(trained, tmp_path, capsys):
    from hybridtitan.eval import main

    def expect(argv, match):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err

    common = ["--tasks", "stdlib_mc", "--include_path", str(TASKS)]
    expect(["--checkpoint", str(tmp_path / "nope"), *common], "not found")
    expect(["--checkpoint", str(trained["debug_gdn"]), "--step", "5", *common], "step 5 not found")
    partial = tmp_path / "partial"
    (partial / "step-3.partial").mkdir(parents=True)
    expect(["--checkpoint", str(partial), *common], "incomplete")
    expect(["--checkpoint", str(trained["debug_gdn"]), "--tasks", "stdlib_mc", "--include_path",
            str(tmp_path / "no_tasks")], "--include_path")
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    expect(["--checkpoint", str(trained["debug_gdn"]), *common, "--output_path", str(existing)], "exists")
    assert existing.read_text() == "{}"
    # a results folder under a file cannot be made: refused before the evaluation
    expect(["--checkpoint", str(trained["debug_gdn"]), *common, "--output_path", str(existing / "r.json")],
           "is not a writable folder")
    expect(["--checkpoint", str(trained["debug_gdn"]), *common, "--num_fewshot", "-1"], "--num_fewshot must be >= 0")
    hf_folder = tmp_path / "hf"
    hf_folder.mkdir()
    (hf_folder / "config.json").write_text("{}")
    expect(["--checkpoint", str(hf_folder), "--step", "3", *common], "is a Hugging Face folder")
    expect(["--checkpoint", str(trained["debug_gdn"]), "--tasks", str(tmp_path / "nope.yaml")],
           "no such task file")
    # a task whose data are on the Hub, offline: one line, not the datasets traceback
    hub_task = tmp_path / "hub_task.yaml"
    hub_task.write_text("task: hub_task\ndataset_path: no-such-org/no-such-data\noutput_type: multiple_choice\n"
                        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: 0\n")
    expect(["--checkpoint", str(trained["debug_gdn"]), "--tasks", str(hub_task)], "cannot load a task's data")
    # a tokenizer with more ids than the model's embedding holds: refused before the weights are read
    small = tmp_path / "small" / "checkpoint"
    shutil.copytree(Path(trained["debug_gdn"]) / "checkpoint", small)
    for args_file in small.glob("step-*/model_args.json"):
        args_file.write_text(json.dumps({**json.loads(args_file.read_text()), "vocab_size": 1000}))
    expect(["--checkpoint", str(small.parent), *common], "is larger than the model's vocab_size (1000)")
    # a checkpoint whose model_args.json is gone or damaged
    for damage in ("missing", "damaged"):
        copy = tmp_path / damage / "checkpoint"
        shutil.copytree(Path(trained["debug_gdn"]) / "checkpoint", copy)
        for args_file in copy.glob("step-*/model_args.json"):
            args_file.unlink() if damage == "missing" else args_file.write_text("{")
        expect(["--checkpoint", str(copy.parent), *common],
               "has no model_args.json" if damage == "missing" else "cannot read")


def test_cli_processes_fail_in_one_line(trained, tmp_path):
    """The three real processes (run side by side): exit code 2, one line on stderr, no traceback, nothing written.
    An unknown task is caught before the model is loaded."""
    out = tmp_path / "out"
    procs = {
        "unknown task": run_cli("hybridtitan.eval", "--checkpoint", str(trained["debug_gdn"]), "--tasks",
                                "stdlib_mc,no_such_task", "--include_path", str(TASKS), "--output_path", str(out)),
        "step 9 not found": run_cli("hybridtitan.export_hf", "--checkpoint", str(trained["debug_gdn"]), "--step", "9",
                                    "--output", str(out)),
        "model folder not found": run_cli("hybridtitan.import_hf", "--model", str(tmp_path / "missing"), "--output",
                                          str(out)),
    }
    for expected, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 2, stderr
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: "), stderr
        assert expected in stderr, stderr
    assert not out.exists()


# ------------------------------------------------------------------------------------------ --batch_size auto


class _RunsOutOfMemory(torch.nn.Module):
    """A stand-in model whose forward fails as CUDA's allocator does when a batch holds more than ``budget``
    tokens (``error`` the exception raised), and records the batch of every call."""

    def __init__(self, budget: int, error=torch.OutOfMemoryError):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.budget, self.error, self.calls = budget, error, []

    def forward(self, ids, cache=None):
        self.calls.append(tuple(ids.shape))
        if ids.numel() > self.budget:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.zeros(*ids.shape, 16)


def _fake_lm(model, batch_size="auto", **kwargs):
    from types import SimpleNamespace

    from hybridtitan.lm_eval_model import HybridTitanLM

    return HybridTitanLM(model, SimpleNamespace(pad_token_id=0, eos_token_id=1), batch_size=batch_size,
                         max_length=64, **kwargs)


def test_auto_batch_size_is_the_largest_that_fits():
    """From max_batch_size (64), halved on out-of-memory, then bisected: the largest batch below the failure."""
    from hybridtitan.lm_eval_model import EvalError

    model = _RunsOutOfMemory(budget=20 * 10)
    lm = _fake_lm(model)
    assert lm.detect_batch_size(10) == 20
    assert [b for b, _ in model.calls] == [64, 32, 16, 24, 20, 22, 21]
    # the message form of older releases and other allocators (a RuntimeError): the same answer
    assert _fake_lm(_RunsOutOfMemory(5 * 10, RuntimeError)).detect_batch_size(10) == 5
    assert _fake_lm(_RunsOutOfMemory(10**9)).detect_batch_size(10) == 64  # the start fits: one trial
    assert _fake_lm(_RunsOutOfMemory(10**9), max_batch_size=7).detect_batch_size(10) == 7
    assert _fake_lm(_RunsOutOfMemory(3)).detect_batch_size(10) == 1  # not even one row: 1 (and its real error)

    class Broken(_RunsOutOfMemory):
        def forward(self, ids, cache=None):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # not an out-of-memory: raised
        _fake_lm(Broken(0)).detect_batch_size(10)
    with pytest.raises(EvalError, match="auto"):  # a collective forward (FSDP): no trials
        _fake_lm(_RunsOutOfMemory(100), collective=True)


def test_auto_n_detects_again_as_the_requests_shorten():
    """auto:2: a size for the longest request, and another, larger one for the second half (shorter requests);
    integer batch sizes unchanged."""
    model = _RunsOutOfMemory(budget=400)  # tokens: 10 rows of 39, 44 of 9
    lm = _fake_lm(model, "auto:2")
    pairs = [([2] * n, [3]) for n in [39] * 20 + [9] * 20]  # model inputs of 39 and of 9 tokens
    assert len(lm._score(pairs)) == 40 and list(lm.batch_sizes.values()) == [10, 44]
    trials_39 = [(b, 39) for b in (64, 32, 16, 8, 12, 10, 11)]
    trials_9 = [(b, 9) for b in (64, 32, 48, 40, 44, 46, 45)]
    assert model.calls == trials_39 + trials_9 + [(10, 39), (10, 39), (20, 9)]  # sizes first, then the batches
    fixed = _fake_lm(_RunsOutOfMemory(10**9), batch_size=16)
    fixed._score(pairs)
    assert fixed.model.calls == [(16, 39), (16, 39), (8, 9)] and not fixed.batch_sizes


def test_auto_batch_size_same_accuracy_as_batch_8(trained, tmp_path, capsys):
    results = {}
    for batch in ("8", "auto"):
        path = tmp_path / f"{batch}.json"
        out = _run_eval(capsys, ["--checkpoint", str(trained["debug_hybrid"]), "--tasks", "stdlib_mc",
                                 "--include_path", str(TASKS), "--batch_size", batch, "--device", "cpu",
                                 "--bootstrap_iters", "0", "--output_path", str(path), "--log_samples"])
        results[batch] = json.loads(path.read_text())
        assert ("batch_size auto (chosen: 64)" in out) == (batch == "auto"), out
    for metric in ("acc,none", "acc_norm,none"):
        assert results["8"]["results"]["stdlib_mc"][metric] == results["auto"]["results"]["stdlib_mc"][metric]
    assert results["auto"]["config"]["batch_sizes"] == [64]
    for a, b in zip(results["8"]["samples"]["stdlib_mc"], results["auto"]["samples"]["stdlib_mc"]):
        assert a["doc_id"] == b["doc_id"]
        for (x,), (y,) in zip(a["resps"], b["resps"]):
            assert x[0] == pytest.approx(y[0], abs=1e-4) and x[1] == y[1]


def test_batch_size_bad_values(trained, capsys):
    from hybridtitan.eval import main

    common = ["--checkpoint", str(trained["debug_gdn"]), "--tasks", "stdlib_mc", "--include_path", str(TASKS)]
    for value, match in (("eight", "must be an integer, auto or auto:N"), ("auto:0", "positive number"),
                         ("0", "--batch_size must be >= 1")):
        with pytest.raises(SystemExit) as e:
            main([*common, "--batch_size", value])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and match in err, err
    with pytest.raises(SystemExit):
        main([*common, "--log_samples"])
    assert "give --output_path" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ stock lm-eval


def test_stock_lm_eval_hf_model_same_numbers(trained, tmp_path, capsys):
    """`python -m lm_eval --model hf` (transformers and the export's own code, no hybridtitan imported) on the
    float32 exports of debug_hybrid and debug_mamba2: the acc and acc_norm of hybridtitan.eval on the DCP
    checkpoint, and every sample's loglikelihood within float error (other batches, other padding)."""
    import importlib.util
    import subprocess
    import sys

    from hybridtitan.export_hf import export

    if importlib.util.find_spec("accelerate") is None:
        # lm-eval's hf model imports accelerate (lm_eval's [hf] extra) and passes transformers a device_map, which
        # transformers refuses without accelerate: stock lm-eval cannot run an HF model at all without it
        pytest.skip("accelerate is not installed: lm-eval's hf model needs it (pip install 'lm_eval[hf]')")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    flavors = ("debug_hybrid", "debug_mamba2")
    procs = {}
    for flavor in flavors:
        export(str(trained[flavor]), str(tmp_path / flavor), dtype="float32")
        procs[flavor] = subprocess.Popen(
            [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
             f"pretrained={tmp_path / flavor},trust_remote_code=True,dtype=float32", "--tasks", "stdlib_mc",
             "--include_path", str(TASKS), "--device", "cpu", "--batch_size", "8", "--output_path",
             str(tmp_path / f"{flavor}-stock"), "--log_samples"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ours = {}
    for flavor in flavors:  # meanwhile, ours on the DCP checkpoints
        path = tmp_path / f"{flavor}-ours.json"
        _run_eval(capsys, ["--checkpoint", str(trained[flavor]), "--tasks", "stdlib_mc", "--include_path",
                           str(TASKS), "--device", "cpu", "--bootstrap_iters", "0", "--output_path", str(path),
                           "--log_samples"])
        ours[flavor] = json.loads(path.read_text())
    for flavor in flavors:
        out, err = procs[flavor].communicate(timeout=600)
        assert procs[flavor].returncode == 0, (out + err)[-4000:]
        (results,) = (tmp_path / f"{flavor}-stock").glob("*/results_*.json")
        (samples,) = (tmp_path / f"{flavor}-stock").glob("*/samples_stdlib_mc_*.jsonl")
        stock = json.loads(results.read_text())["results"]["stdlib_mc"]
        mine = ours[flavor]["results"]["stdlib_mc"]
        assert (stock["acc,none"], stock["acc_norm,none"]) == (mine["acc,none"], mine["acc_norm,none"]), flavor
        theirs = {s["doc_id"]: s for s in map(json.loads, samples.read_text().splitlines())}
        for s in ours[flavor]["samples"]["stdlib_mc"]:
            for (a,), (b,) in zip(s["resps"], theirs[s["doc_id"]]["resps"], strict=True):
                assert a[0] == pytest.approx(float(b[0]), abs=1e-4) and str(a[1]) == str(b[1])  # (stock: text)


def test_generation_batched_equals_one_by_one(trained, tmp_path, capsys):
    """generate_until on prompts of other lengths (stdlib_gen): stock `lm_eval --model hf` on the debug_hybrid
    export (its own code; transformers pads the batch on the left) gives the same text with --batch_size 8 as with
    1, and so does hybridtitan.eval on the DCP checkpoint, whose text is the export's."""
    import importlib.util
    import subprocess
    import sys

    from hybridtitan.export_hf import export

    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: lm-eval's hf model needs it (pip install 'lm_eval[hf]')")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    export(str(trained["debug_hybrid"]), str(tmp_path / "export"), dtype="float32")
    procs = {batch: subprocess.Popen(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'export'},trust_remote_code=True,dtype=float32", "--tasks", "stdlib_gen",
         "--include_path", str(TASKS), "--device", "cpu", "--batch_size", str(batch), "--output_path",
         str(tmp_path / f"stock-{batch}"), "--log_samples"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for batch in (8, 1)}
    ours = {}
    for batch in (8, 1):
        path = tmp_path / f"ours-{batch}.json"
        _run_eval(capsys, ["--checkpoint", str(trained["debug_hybrid"]), "--tasks", "stdlib_gen", "--include_path",
                           str(TASKS), "--device", "cpu", "--batch_size", str(batch), "--bootstrap_iters", "0",
                           "--output_path", str(path), "--log_samples"])
        ours[batch] = {s["doc_id"]: s["resps"] for s in json.loads(path.read_text())["samples"]["stdlib_gen"]}
    stock = {}
    for batch, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, (out + err)[-4000:]
        (samples,) = (tmp_path / f"stock-{batch}").glob("*/samples_stdlib_gen_*.jsonl")
        stock[batch] = {s["doc_id"]: s["resps"] for s in map(json.loads, samples.read_text().splitlines())}
    assert len(stock[8]) == 40 and stock[8] == stock[1]
    assert ours[8] == ours[1] == stock[1]
    assert len({str(r) for r in stock[1].values()}) > 1  # the prompts are continued differently

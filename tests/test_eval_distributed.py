"""hybridtitan.eval over 2 CPU processes (gloo, started as torchrun starts its ranks: tests/helpers.run_ranks): the
CLI's data parallelism and evaluate_live, for a plain model and an FSDP2-wrapped one, against the one-process CLI
on the same debug_hybrid checkpoint.

The same file is the ranks' script (``python tests/test_eval_distributed.py CHECKPOINT OUT`` in each rank, see
``worker``): pytest collects the tests, the ranks run the worker.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "assets" / "tasks"
LIVE_BATCH = 7  # 160 requests: 23 batches, 12 on rank 0 and 11 on rank 1 (which then runs one dummy forward)


# ------------------------------------------------------------------------------------------------ the ranks


def worker(checkpoint: str, out_dir: str) -> None:
    """Each rank: evaluate_live over the plain model, then over an FSDP2-wrapped copy (hybridtitan.train's
    build_parallel_model over a 2-rank mesh, the weights set from the checkpoint); generation and rolling
    loglikelihoods through the FSDP model too. Counts the root forward calls of every phase on each rank (equal
    on both, or a collective would have waited), checks the RNG and training mode untouched, and writes what it
    found to out_dir/rank<R>.json."""
    import datetime
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from lm_eval.api.instance import Instance
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from hybridtitan.lm_eval_model import HybridTitanLM, evaluate_live
    from hybridtitan.model_loader import load
    from hybridtitan.parallel import DataParallel, build_mesh
    from hybridtitan.train import build_parallel_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))  # a hang fails within 90 s
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict = {"rank": rank}

    plain, tok, _ = load(checkpoint)
    plain.train()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    report["plain"] = evaluate_live(plain, tok, ["stdlib_mc"], include_path=str(TASKS), batch_size=LIVE_BATCH)
    report["rng_kept"] = (random.random(), np.random.rand(), torch.rand(1).item()) == before
    report["plain_training"] = plain.training

    fsdp = build_parallel_model(plain.args, build_mesh(DataParallel(1, world), "cpu"), torch.device("cpu"))
    set_model_state_dict(fsdp, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    calls = [0]
    fsdp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def counted(name, fn):
        calls[0] = 0
        out = fn()
        report.setdefault("forwards", {})[name] = calls[0]
        return out

    report["fsdp"] = counted("evaluate_live", lambda: evaluate_live(fsdp, tok, ["stdlib_mc"],
                                                                     include_path=str(TASKS),
                                                                     batch_size=LIVE_BATCH))
    report["fsdp_training"] = fsdp.training
    # every FSDP parameter sharded again, as the trainer left them
    report["resharded"] = all(type(p).__name__ == "DTensor" for p in fsdp.parameters())

    def requests(kind, args_list):
        return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]

    # generation: 5 batches of 1 (3 on rank 0, 2 and a dummy on rank 1), each of its own length
    prompts = ["Return the number of", "Close the file and flush the", "Set the", "Read and return at most",
               "Return whether a path"]
    gen = requests("generate_until", [(p, {"until": ["\x00"], "max_gen_toks": n}) for p, n in
                                      zip(prompts, (6, 2, 5, 1, 4))])
    live = HybridTitanLM(fsdp, tok, batch_size=1, max_length=64, distributed=True)
    alone = HybridTitanLM(plain, tok, batch_size=1, max_length=64)
    report["generate"] = counted("generate", lambda: live.generate_until(gen, disable_tqdm=True))
    report["generate_alone"] = alone.generate_until(gen, disable_tqdm=True)
    texts = requests("loglikelihood_rolling", [("Return the hash value of the object.",), ("Close it.",),
                                               ("Serialize obj to a JSON formatted str.",)])
    live.max_length = alone.max_length = 4  # several windows per text, in batches of 2
    live.batch_size = alone.batch_size = 2
    report["rolling"] = counted("rolling", lambda: live.loglikelihood_rolling(texts, disable_tqdm=True))
    report["rolling_alone"] = alone.loglikelihood_rolling(texts, disable_tqdm=True)
    # ranks handed different requests: refused on both at once, not a hang
    pairs = requests("loglikelihood", [("Set", " the level.")] * (3 + rank))
    try:
        live.loglikelihood(pairs, disable_tqdm=True)
        report["mismatch"] = "accepted"
    except RuntimeError as e:
        report["mismatch"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:3])
    sys.exit(0)


# ------------------------------------------------------------------------------------------------ the tests

import pytest  # noqa: E402
from test_export_hf import train_debug_checkpoints  # noqa: E402 -- the session's trained dumps, shared

from helpers import run_ranks  # noqa: E402


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    return train_debug_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def one_process(trained, tmp_path_factory):
    """The one-process CLI's results JSON (with its samples) at the batch sizes the tests use."""
    from hybridtitan.eval import main

    out = {}
    for batch in (8, LIVE_BATCH):
        path = tmp_path_factory.mktemp("one") / "results.json"
        main(["--checkpoint", str(trained["debug_hybrid"]), "--tasks", "stdlib_mc", "--include_path", str(TASKS),
              "--device", "cpu", "--batch_size", str(batch), "--bootstrap_iters", "0", "--output_path", str(path),
              "--log_samples"])
        out[batch] = json.loads(path.read_text())
    return out


def _responses(results: dict) -> list:
    return [(s["doc_id"], s["resps"]) for s in sorted(results["samples"]["stdlib_mc"], key=lambda s: s["doc_id"])]


def test_cli_data_parallel_same_numbers(trained, one_process, tmp_path):
    """`python -m hybridtitan.eval` in 2 ranks: one table, one JSON, and the numbers of one process --
    the accuracies and every sample's loglikelihoods, exactly (each rank scores its share of the same batches)."""
    output = tmp_path / "results"
    proc = run_ranks(["-m", "hybridtitan.eval", "--checkpoint", str(trained["debug_hybrid"]), "--tasks", "stdlib_mc",
                      "--include_path", str(TASKS), "--device", "cpu", "--bootstrap_iters", "0", "--output_path",
                      str(output) + os.sep, "--log_samples"], 2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("|stdlib_mc|") == 1 and proc.stdout.count("results written to") == 1, proc.stdout
    assert "2 processes (data parallel)" in proc.stdout
    (path,) = output.glob("*.json")
    two = json.loads(path.read_text())
    one = one_process[8]
    for metric in ("acc,none", "acc_norm,none"):
        assert two["results"]["stdlib_mc"][metric] == one["results"]["stdlib_mc"][metric]
    assert _responses(two) == _responses(one)


def test_evaluate_live_two_ranks_plain_and_fsdp(trained, one_process, tmp_path):
    """evaluate_live on 2 ranks, plain and FSDP2-wrapped: the one-process CLI's metrics on every rank; the same
    number of forward calls on both ranks though their shares differ (batches, generation lengths); generation
    and rolling loglikelihoods through FSDP equal to the plain model's; the RNG and training mode untouched;
    different requests on the ranks refused on both, not a hang."""
    proc = run_ranks([__file__, str(trained["debug_hybrid"]), str(tmp_path)], 2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cli = one_process[LIVE_BATCH]["results"]["stdlib_mc"]
    expected = {"eval/stdlib_mc/acc": cli["acc,none"], "eval/stdlib_mc/acc_norm": cli["acc_norm,none"]}
    for r in reports:
        assert r["plain"] == expected and r["fsdp"] == expected, r
        assert r["rng_kept"] and r["plain_training"] and r["fsdp_training"] and r["resharded"], r
        assert r["generate"] == r["generate_alone"] and r["rolling"] == r["rolling_alone"], r
        assert "different loglikelihood requests" in r["mismatch"], r
    assert reports[0]["forwards"] == reports[1]["forwards"], [r["forwards"] for r in reports]
    # 23 batches: 12 forwards on each rank (rank 1's last a dummy); the generation's 5 jobs took 3 slots
    assert reports[0]["forwards"]["evaluate_live"] == 12

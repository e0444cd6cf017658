"""Context parallelism in the trainer (parallelism.context_parallel_degree): a run whose sequences are split over 2
ranks (gloo, the CPU reference ops through hybridtitan.ops.context_parallel) trains as one process on the same
global batch: the same losses (training and held-out) and, after the steps, the same weights, within float32
tolerance. Dense rows and packed documents, both layouts (headtail = zigzag, none = contiguous), the GDN + MLA
hybrid (also over 4 ranks), the Mamba2, KDA and Llama flavors (KDA under activation checkpointing), and CP beside
data parallelism (2 x 2 ranks). A CP run's checkpoint resumes exactly at CP 2 and on one
process without CP. The refusals are one line, exit code 2, before anything is written.

The optimizer is AdamW with eps = 1: its update is then close to lr x the gradient's momentum (not its sign, as
at a small eps, where float32 noise in a near-zero gradient moves a weight by a whole step), so equal weights
after the steps say that every gradient was equal.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers import QUICK, RECIPE, losses, main_error, records, run_train, state

STEPS = 4
BASE = [*QUICK, "--training.steps", str(STEPS), "--checkpoint.interval", "2", "--optimizer.eps", "1",
        "--optimizer.lr", "0.1", "--lr_scheduler.warmup_steps", "0"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
# float32: the split computes the same sums in another order
LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL = 2e-6, 2e-6, 1e-5


def assert_same_run(one, cp, steps=range(1, STEPS + 1), step=STEPS):
    """Equal losses at ``steps`` and equal weights at checkpoint ``step`` of two runs' folders."""
    a, b = losses(one), losses(cp)
    for s in steps:
        assert abs(a[s] - b[s]) <= LOSS_RTOL * abs(a[s]), (s, a[s], b[s])
    wa, wb = state(one, step), state(cp, step)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=name)


PACKED = [*BASE, "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The hybrid on packed documents (the recipe's), with validation: one process, and CP 2 (headtail)."""
    root = tmp_path_factory.mktemp("packed")
    run_train(root / "one", *PACKED, nproc=1)
    run_train(root / "cp", *PACKED, *CP2, nproc=2)
    return root / "one", root / "cp"


def test_packed_documents_train_as_one_process(packed):
    one, cp = packed
    assert_same_run(one, cp)
    va, vb = records(one, "validation/loss"), records(cp, "validation/loss")
    assert sorted(va) == sorted(vb) == [2, 4]
    for s in va:
        assert abs(va[s]["validation/loss"] - vb[s]["validation/loss"]) <= LOSS_RTOL * va[s]["validation/loss"]
        assert va[s]["validation/tokens"] == vb[s]["validation/tokens"]


def test_four_context_ranks_train_as_one_process(packed, tmp_path):
    """CP 4: each sequence of 128 tokens in 8 chunks of 16 over 4 ranks (headtail), documents crossing several
    of them: the losses (training and held-out) and the weights of the one-process run."""
    one, _ = packed
    run_train(tmp_path / "cp4", *PACKED, "--parallelism.context_parallel_degree", "4", nproc=4)
    assert_same_run(one, tmp_path / "cp4")
    va, vb = records(one, "validation/loss"), records(tmp_path / "cp4", "validation/loss")
    assert sorted(vb) == [2, 4]
    for s in va:
        assert abs(va[s]["validation/loss"] - vb[s]["validation/loss"]) <= LOSS_RTOL * va[s]["validation/loss"]


def test_checkpoint_of_a_cp_run_resumes_without_cp(packed, tmp_path):
    """Checkpoints do not depend on the degree: the CP run's step 2, resumed on one process, goes on as the
    uninterrupted one-process run."""
    one, cp = packed
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(cp / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_train(resumed, *BASE, nproc=1)
    assert sorted(losses(resumed)) == [3, 4]
    assert_same_run(one, resumed, steps=(3, 4))


def test_checkpoint_of_a_cp_run_resumes_exactly_at_the_same_degree(packed, tmp_path):
    """The CP run's step 2, resumed at CP 2, goes on as the uninterrupted CP run (the data loader's place is the
    data-parallel rank's, shared by the CP ranks)."""
    _, cp = packed
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(cp / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_train(resumed, *BASE, *CP2, nproc=2)
    assert sorted(losses(resumed)) == [3, 4]
    assert_same_run(cp, resumed, steps=(3, 4))


def test_dense_rows_contiguous_layout_beside_data_parallel(tmp_path):
    """Dense rows, the contiguous layout, on 4 ranks: 2 data-parallel ranks x CP 2 (FSDP over all 4; the CP ranks
    of a group read their data-parallel rank's batches) against 2 data-parallel ranks without CP."""
    extra = [*BASE, "--data.document_boundaries", "false", "--checkpoint.interval", str(STEPS)]
    run_train(tmp_path / "dp", *extra, nproc=2)
    run_train(tmp_path / "cp", *extra, *CP2, "--parallelism.context_parallel_load_balancer", "none", nproc=4)
    assert_same_run(tmp_path / "dp", tmp_path / "cp")


@pytest.mark.parametrize("flavor", ["debug_mamba2", "debug_kda", "debug_llama"])
def test_mixers_train_as_one_process(tmp_path, flavor):
    """Mamba2 (its SSD through simple GLA), KDA and a Llama (grouped-query attention, Llama 3's RoPE scaling), on
    packed documents; KDA's CP run under full activation checkpointing (the recomputation issues the forward's
    collectives again, in the same order on every rank)."""
    extra = [*BASE, "--model.flavor", flavor, "--checkpoint.interval", str(STEPS)]
    ac = ["--activation_checkpoint.mode", "full"] if flavor == "debug_kda" else []
    run_train(tmp_path / "one", *extra, nproc=1)
    run_train(tmp_path / "cp", *extra, *CP2, *ac, nproc=2)
    assert_same_run(tmp_path / "one", tmp_path / "cp")


# ------------------------------------------------------------------------------------------------ the refusals


@pytest.mark.parametrize("world, extra, expected", [
    (1, ["--parallelism.context_parallel_degree", "2"], "(2) must divide the 1 ranks"),
    (2, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "130"],
     "training.seq_len (130) must be divisible by 2 x parallelism.context_parallel_degree = 4"),
    (2, ["--parallelism.context_parallel_degree", "2", "--validation.enable", "true", "--validation.seq_len", "66"],
     "validation.seq_len (66) must be divisible by 2 x"),
    (2, ["--parallelism.context_parallel_degree", "2", "--training.cuda_graphs", "true"],
     "does not run with training.cuda_graphs"),
    (2, ["--parallelism.context_parallel_degree", "2", "--distill.teacher", "nowhere"],
     "does not run with distillation"),
    (2, ["--parallelism.context_parallel_degree", "2", "--compile.enable", "true", "--compile.components", "model"],
     "does not run with torch.compile of the sublayers"),
    (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "3"],
     "(the data-parallel ranks: 4 / context_parallel_degree 2)"),
    (2, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "8", "--validation.enable", "false"],
     "chunks of 2 tokens, fewer than the gdn convolution's 3 previous inputs"),
    (1, ["--parallelism.context_parallel_degree", "0"], "context_parallel_degree must be 1 or more, got 0"),
    (1, ["--parallelism.context_parallel_load_balancer", "ptrr"],
     "context_parallel_load_balancer must be headtail or none"),
])
def test_refusals_are_one_line_before_anything_is_written(capsys, monkeypatch, tmp_path, world, extra, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    dump = tmp_path / "dump"
    code, err = main_error(capsys, ["--job.config_file", RECIPE, "--job.dump_folder", str(dump), *QUICK, *extra])
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert expected in err, err
    assert not dump.exists()


def test_load_balancer_values(tmp_path):
    """headtail (torchtitan's default) is the zigzag layout; None (the command line's none, TOML's "none") the
    contiguous one."""
    from hybridtitan.config_manager import context_parallel_layout, parse_config

    def layout(*args):
        return context_parallel_layout(parse_config(["--job.config_file", *args], check_data=False))

    assert layout(RECIPE) == "zigzag"
    assert layout(RECIPE, "--parallelism.context_parallel_load_balancer", "none") == "contiguous"
    recipe = tmp_path / "contiguous.toml"
    recipe.write_text('[parallelism]\ncontext_parallel_degree = 2\ncontext_parallel_load_balancer = "none"\n')
    assert layout(str(recipe)) == "contiguous"


def test_ranks_share_a_gpu_only_under_gloo(monkeypatch):
    """comm.backend gloo puts local ranks on the GPUs round-robin (two CP ranks on one GPU:
    gpu_harness/checks/cp_train_check.py); under NCCL a rank without a GPU of its own is refused in one line."""
    from hybridtitan.config_manager import ConfigError
    from hybridtitan.preflight import gpu_of

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [gpu_of(r, "gloo") for r in (0, 1)] == [torch.device("cuda:0")] * 2
    assert gpu_of(0, "auto") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match="local rank 1 has no GPU of its own .1 on this node.*--comm.backend gloo"):
        gpu_of(1, "auto")

"""The optimizer: clipping and the update over FSDP's sharded parameters (2 gloo processes), and the schedule,
torchtitan's warm-up and decay (compared with torchtitan's own) held at its floor past its end."""

from __future__ import annotations

import pytest
import torch

from helpers import RECIPE, run_ranks


def _rates(build, steps: int = 30):
    """The learning rate of each of ``steps`` updates under the schedule ``build(optimizer)`` makes."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, sched


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("shape", [("4", None, None), ("0", None, "0.3"), ("3", "0.5", None), ("20", None, None)],
                         ids=["warmup-decay", "no-warmup-floor", "wsd", "warmup-past-total"])
def test_lr_schedule_is_torchtitans_within_its_end(decay_type, shape):
    """Within lr_scheduler.total_steps the schedule's rates are torchtitan 0.2.2's (its settings: warm-up, decay
    type, decay_ratio, min_lr_factor, a warm-up longer than the schedule), and so is its checkpoint state."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    from hybridtitan.config_manager import parse_config
    from hybridtitan.lr_schedule import build_lr_scheduler

    warmup, ratio, floor = shape
    args = ["--job.config_file", RECIPE, "--training.steps", "12", "--lr_scheduler.warmup_steps", warmup,
            "--lr_scheduler.decay_type", decay_type]
    args += ["--lr_scheduler.decay_ratio", ratio] if ratio else []
    args += ["--lr_scheduler.min_lr_factor", floor] if floor else []
    cfg = parse_config(args, check_data=False)
    ours, sched = _rates(lambda opt: build_lr_scheduler(opt, cfg), 12)
    titan, titan_sched = _rates(lambda opt: build_lr_schedulers([opt], cfg.lr_scheduler, cfg.training.steps), 12)
    assert ours == pytest.approx(titan, rel=1e-12, abs=1e-15)
    assert len(set(ours)) > 1 or warmup == "20"
    assert sched.state_dict() == titan_sched.state_dict()


def test_lr_schedule_held_at_its_floor_past_its_end():
    """Past lr_scheduler.total_steps torchtitan's decay goes on below lr * min_lr_factor, to negative rates (its
    cosine back up); ours holds the floor there."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    from hybridtitan.config_manager import parse_config
    from hybridtitan.lr_schedule import build_lr_scheduler

    for decay_type in ("linear", "cosine"):
        cfg = parse_config(["--job.config_file", RECIPE, "--training.steps", "30", "--lr_scheduler.total_steps",
                            "12", "--lr_scheduler.warmup_steps", "4", "--lr_scheduler.min_lr_factor", "0.1",
                            "--lr_scheduler.decay_type", decay_type], check_data=False)
        ours, sched = _rates(lambda opt, cfg=cfg: build_lr_scheduler(opt, cfg))
        titan, _ = _rates(lambda opt, cfg=cfg: build_lr_schedulers([opt], cfg.lr_scheduler, cfg.training.steps))
        assert min(titan) < 0.1 or max(titan[12:]) > 0.1  # what is fixed: below the floor, or back up
        assert ours[:12] == pytest.approx(titan[:12]) and ours[0] == pytest.approx(0.25)
        assert ours[12:] == [pytest.approx(0.1)] * 18
        assert sched.state_dict()["lr_lambdas"] == [{}]  # nothing of the factor function in checkpoints
    # a schedule left no decay steps (a warm-up as long as the schedule): flat past its end, where torchtitan's
    # fails an assertion
    flat = parse_config(["--job.config_file", RECIPE, "--training.steps", "30", "--lr_scheduler.total_steps", "12",
                         "--lr_scheduler.warmup_steps", "12"], check_data=False)
    ours, _ = _rates(lambda opt: build_lr_scheduler(opt, flat))
    assert ours[11:] == [pytest.approx(1.0)] * 19
    with pytest.raises(AssertionError):
        _rates(lambda opt: build_lr_schedulers([opt], flat.lr_scheduler, flat.training.steps))


# Run by test_clipping_and_update_over_shards on 2 processes: the trainer's clipping and optimizer update against
# torch's on the same sharded gradients, over a 2-way shard mesh and a 2-way replicate x 1-way shard (HSDP) mesh.
_CLIP_SCRIPT = """
import copy, sys, torch, torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from hybridtitan.models import get_flavor
from hybridtitan.models.model import build_model
from hybridtitan.optim import LocalShardAdam, LocalShardAdamW, clip_grad_norm_
from hybridtitan.parallel import apply_fsdp, build_mesh, resolve_data_parallel
dist.init_process_group("gloo")
replicate = int(sys.argv[1])
mesh = build_mesh(resolve_data_parallel(replicate, -1, dist.get_world_size()), "cpu")
torch.manual_seed(0)
model = build_model(get_flavor("debug_hybrid"), "cpu")
model.init_weights()
apply_fsdp(model, mesh, torch.float32, torch.float32)
params = list(model.parameters())
assert len({p.placements for p in params}) == 1, "one placement for all gradients"
for scale, max_norm in ((1.0, 1.0), (1e-4, 1.0), (1.0, float("inf"))):
    torch.manual_seed(0)  # the same full gradients on every rank, each rank keeping its shards
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape) * scale, p.device_mesh, p.placements)
    original = [copy.deepcopy(p.grad) for p in params]
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True).full_tensor()
    expected_grads = [p.grad.full_tensor().clone() for p in params]
    for p, g in zip(params, original):
        p.grad = g
    norm = clip_grad_norm_(params, max_norm)
    assert norm.shape == () and torch.allclose(norm, expected, rtol=1e-6), (norm, expected)
    for p, e in zip(params, expected_grads):
        assert torch.allclose(p.grad.full_tensor(), e, rtol=1e-6, atol=1e-12)
    if scale == 1e-4:  # below max_norm: nothing scaled
        torch.manual_seed(0)
        assert all(torch.equal(p.grad.full_tensor(), torch.randn(p.shape) * scale) for p in params)
params[0].grad.to_local().view(-1)[:1] = float("inf")  # a shard with a non-finite value: every rank sees it
assert not torch.isfinite(clip_grad_norm_(params, 1.0))

# the optimizers' update on each rank's shards: the same parameters and moments as torch's on the DTensors
start = [p.detach().to_local().clone() for p in params]
start_full = [p.detach().full_tensor().clone() for p in params]  # full_tensor() may be a view of the shard
def two_steps(optimizer):
    for p, s in zip(params, start):
        p.detach().to_local().copy_(s)
    for seed in (1, 2):
        torch.manual_seed(seed)
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
        optimizer.step()
    return [p.detach().full_tensor().clone() for p in params], optimizer
for ours, theirs in ((LocalShardAdamW, torch.optim.AdamW), (LocalShardAdam, torch.optim.Adam)):
    for implementation in ({"fused": True}, {"foreach": True}, {"foreach": False}):
        kwargs = dict(lr=1e-2, weight_decay=0.1, **implementation)
        got, opt = two_steps(ours(params, **kwargs))
        expected, ref = two_steps(theirs(params, **kwargs))
        for p, g, e in zip(params, got, expected):
            assert torch.equal(g, e), (ours.__name__, implementation)
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(opt.state[p][key], DTensor)  # what checkpoints save, unchanged
                assert torch.equal(opt.state[p][key].full_tensor(), ref.state[p][key].full_tensor())
        assert not any(torch.equal(g, s) for g, s in zip(got, start_full))  # the steps changed every parameter
print("ok", flush=True)
"""


@pytest.mark.parametrize("replicate", [1, 2])
def test_clipping_and_update_over_shards(tmp_path, replicate):
    """The trainer's clipping (each rank's shards, one all-reduce over the sharded mesh dimension) gives torch's
    norm and clipped gradients, on 2 processes, sharded 2 ways or replicated 2 ways (HSDP, where a second sum over
    the replicas would double-count); its Adam and AdamW, updating the shards, give torch's parameters and moments
    bit for bit (fused, foreach and for-loop), and keep the moments as DTensors."""
    script = tmp_path / "clip.py"
    script.write_text(_CLIP_SCRIPT)
    proc = run_ranks([str(script), str(replicate)], 2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2, proc.stdout  # both ranks ran every check

"""How hybridtitan.parallel wraps a model: which sublayers free their gathered parameters after the forward pass;
gradient clipping and the optimizer's update over FSDP's sharded parameters (hybridtitan.optim)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridtitan import ops
from hybridtitan.models import get_flavor
from hybridtitan.models.model import build_model
from hybridtitan.parallel import apply_activation_checkpointing, reshard_after_forward_for


def test_reshard_policy():
    n = 4
    # default over several shards: every sublayer but the last frees its gathered parameters; the root keeps them
    assert [reshard_after_forward_for("default", i, n, 2) for i in range(n)] == [True, True, True, False]
    assert reshard_after_forward_for("default", None, n, 2) is False
    # default over one shard: nothing to save by freeing, so nothing is gathered twice
    assert not any(reshard_after_forward_for("default", i, n, 1) for i in [*range(n), None])
    assert all(reshard_after_forward_for("always", i, n, 1) for i in [*range(n), None])
    assert not any(reshard_after_forward_for("never", i, n, 8) for i in [*range(n), None])
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward"):
        reshard_after_forward_for("sometimes", 0, n, 2)


@pytest.mark.parametrize("mode,compiled_norms", [("full", False), ("selective", False), ("full", True)])
def test_activation_checkpointing_same_loss_and_gradients(mode, compiled_norms):
    """Checkpointed sublayers take the stream with the residual already added (one saved input, not two): the
    loss and every gradient are those of the model without checkpointing, also with the norms compiled (as the
    GPU recipes run them; the recomputation runs them again)."""
    torch.manual_seed(0)
    plain = build_model(get_flavor("debug_hybrid"), "cpu")
    plain.init_weights()
    checkpointed = build_model(get_flavor("debug_hybrid"), "cpu")
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, mode, every=2)
    flags = [layer.fuse_residual_add for layer in checkpointed.layers]
    assert flags == ([False] * 8 if mode == "full" else [False, True] * 4)
    ids = torch.randint(0, plain.args.vocab_size, (2, 33))
    results = []
    for model in (plain, checkpointed):
        previous = ops.compile_norms(compiled_norms and model is checkpointed)
        try:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()
        finally:
            ops.compile_norms(previous)
        results.append((loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                                        for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    assert results[1][1].keys() == results[0][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


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
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(replicate)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2, proc.stdout  # both ranks ran every check

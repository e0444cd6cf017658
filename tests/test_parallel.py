"""How hybridtitan.parallel wraps a model: which sublayers free their gathered parameters after the forward pass."""

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

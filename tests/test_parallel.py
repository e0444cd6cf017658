"""How a model is wrapped from outside: which sublayers free their gathered parameters after the forward pass;
the residual stream under the fused residual kernels and activation checkpointing."""


import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hybridtitan import ops
from hybridtitan.models import get_flavor
from hybridtitan.models.model import build_model
from hybridtitan.parallel import apply_activation_checkpointing, is_checkpointed, reshard_after_forward_for


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


def test_the_stream_is_the_sum_of_each_pair_the_sublayers_hand_on():
    """Each sublayer hands on (f(norm(x)), x), whose sum is the stream: the model is x = x + f(norm(x)) sublayer
    by sublayer, then the final norm, to the last bit on CPUs (each add the same two numbers)."""
    torch.manual_seed(0)
    model = build_model(get_flavor("debug_hybrid"), "cpu")
    model.init_weights()
    ids = torch.randint(0, model.args.vocab_size, (2, 32))
    x = model.embeddings(ids)
    for layer in model.layers:
        x = x + layer.body(layer.norm(x))
    torch.testing.assert_close(model.hidden_states(ids), model.norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("mode,compiled_norms", [("none", False), ("full", False), ("selective", False),
                                                  ("selective", True)])
def test_fused_residual_and_activation_checkpointing_same_loss_and_gradients(mode, compiled_norms):
    """The fused residual kernels (each residual add done in the next norm, Kernels.add_rms_norm) and activation
    checkpointing (whose sublayers are given the stream summed: one saved input, not two) give the loss and every
    gradient of the plain model, also with the norms compiled (as the GPU recipes run them; the recomputation
    runs them again)."""
    torch.manual_seed(0)
    plain = build_model(get_flavor("debug_hybrid"), "cpu")
    plain.init_weights()
    kernels = ops.Kernels(ops.KernelConfig(fused_residual=True, compiled_norms=compiled_norms))
    fused = build_model(get_flavor("debug_hybrid"), "cpu", kernels)
    fused.load_state_dict(plain.state_dict())
    given = []

    def checkpoint_fn(layer, *args, **kwargs):
        given.append(args[1:])
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)

    apply_activation_checkpointing(fused, mode, every=2, checkpoint_fn=checkpoint_fn)
    assert [is_checkpointed(layer) for layer in fused.layers] == {
        "none": [False] * 8, "full": [True] * 8, "selective": [True, False] * 4}[mode]
    assert fused.state_dict().keys() == plain.state_dict().keys()  # the same names: the same checkpoints
    ids = torch.randint(0, plain.args.vocab_size, (2, 33))
    results = []
    for model in (plain, fused):
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                                        for n, p in model.named_parameters()}))
    # every checkpointed sublayer was given the stream as one tensor, no residual beside it
    assert given == [(None,)] * sum(is_checkpointed(layer) for layer in fused.layers)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    assert results[1][1].keys() == results[0][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)

"""How hybridtitan.parallel wraps a model: which sublayers free their gathered parameters after the forward pass."""

import pytest

from hybridtitan.parallel import reshard_after_forward_for


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

"""Layer patterns: Primus's ratio placement rule and the validation of ModelArgs."""

import re

import pytest

from hybridtitan.models import ModelArgs
from hybridtitan.models.pattern import parse_pattern, pattern_from_ratio


@pytest.mark.parametrize(
    "n_layers, ratio, expected",
    [
        (24, 0.25, "*-M-M-M-" * 3),
        (32, 0.25, "*-M-M-M-" * 4),
        (24, 0.0, "M-" * 12),
        (28, 0.25, "*-M-M-M-" * 3 + "M-M-"),  # 14 pairs, 3 attention: 11 mixers, 2 left over at the end
    ],
)
def test_pattern_from_ratio(n_layers, ratio, expected):
    pattern = pattern_from_ratio(n_layers, ratio)
    assert pattern == expected
    assert len(pattern) == n_layers


def test_ratio_builds_the_pattern_in_model_args():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=24, ffn_dim=64, hybrid_attention_ratio=0.25)
    assert args.pattern == "*-M-M-M-*-M-M-M-*-M-M-M-"
    assert args.kinds[:4] == ["attention", "mlp", "mixer", "mlp"]


def test_parse_pattern_kinds():
    assert parse_pattern("*-M-") == ["attention", "mlp", "mixer", "mlp"]


def _args(**kw):
    base = dict(vocab_size=64, dim=32, n_layers=4, ffn_dim=64)
    base.update(kw)
    return ModelArgs(**base)


def test_unknown_symbol_names_field_position_and_allowed():
    with pytest.raises(ValueError, match=r"model\.pattern") as err:
        _args(pattern="M-X-")
    msg = str(err.value)
    assert "'X'" in msg
    assert re.search(r"position 2\b", msg)
    for symbol in ("'*'", "'M'", "'-'"):
        assert symbol in msg


def test_pattern_length_must_equal_n_layers():
    with pytest.raises(ValueError, match=r"model\.pattern.*model\.n_layers") as err:
        _args(pattern="M-M-M-")  # 6 symbols, n_layers 4
    assert "6" in str(err.value) and "4" in str(err.value)


def test_unknown_mixer_with_mixer_sublayers():
    with pytest.raises(ValueError, match=r"model\.mixer 'foo'") as err:
        _args(pattern="M-M-", mixer="foo")
    for name in ("gdn", "kda", "mamba2"):
        assert name in str(err.value)


def test_unknown_mixer_is_fine_without_mixer_sublayers():
    args = _args(pattern="*-*-", mixer="foo")
    assert args.kinds == ["attention", "mlp", "attention", "mlp"]


def test_empty_pattern_rejected():
    with pytest.raises(ValueError, match=r"model\.pattern is empty.*'\*'.*'M'.*'-'"):
        parse_pattern("")
    args = _args(pattern="M-M-")
    args.pattern = ""
    with pytest.raises(ValueError, match=r"model\.pattern is empty"):
        args.validate()


def test_ratio_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"model\.n_layers must be positive"):
        _args(n_layers=0, pattern="")
    with pytest.raises(ValueError, match=r"model\.n_layers must be even"):
        pattern_from_ratio(5, 0.25)
    with pytest.raises(ValueError, match=r"model\.hybrid_attention_ratio"):
        pattern_from_ratio(24, 1.5)

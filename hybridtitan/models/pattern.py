"""Layer patterns: one character per pre-norm residual sublayer.

    *  multi-latent attention (MLA)
    M  the linear-recurrent mixer (GDN, KDA or Mamba2, chosen by ``model.mixer``)
    -  SwiGLU MLP

``*-M-M-M-*-M-M-M-*-M-M-M-`` is the 300M hybrid: 24 sublayers, an attention every fourth mixer slot.
"""

from __future__ import annotations

SYMBOLS = {"*": "attention", "M": "mixer", "-": "mlp"}
ALLOWED = "'*' (MLA attention), 'M' (mixer), '-' (SwiGLU MLP)"


def parse_pattern(pattern: str, field: str = "model.pattern") -> list[str]:
    """The sublayer kinds of a pattern ('attention', 'mixer', 'mlp'). Raises ValueError naming the bad position."""
    if not pattern:
        raise ValueError(f"{field} is empty; give one symbol per sublayer: {ALLOWED}")
    kinds = []
    for pos, ch in enumerate(pattern):
        if ch not in SYMBOLS:
            raise ValueError(f"{field}: unknown symbol {ch!r} at position {pos} of {pattern!r}; allowed: {ALLOWED}")
        kinds.append(SYMBOLS[ch])
    return kinds


def pattern_from_ratio(n_layers: int, attention_ratio: float) -> str:
    """Primus's placement rule for a hybrid with no explicit pattern.

    The ``n_layers // 2`` (sequence mixer, MLP) pairs get ``int(pairs * ratio)`` attention slots. With a ratio up to 0.5
    they form blocks of one attention pair followed by ``pairs_left // n_attn`` mixer pairs. The mixer pairs that do not
    divide evenly go at the end. Above 0.5, the attention pairs come first, then alternating blocks."""
    if n_layers <= 0:
        raise ValueError(f"model.n_layers must be positive, got {n_layers}")
    if not 0.0 <= attention_ratio <= 1.0:
        raise ValueError(f"model.hybrid_attention_ratio must lie in [0, 1], got {attention_ratio}")
    if n_layers % 2:
        raise ValueError(
            f"model.n_layers must be even to build a pattern from hybrid_attention_ratio (pairs of mixer and MLP), "
            f"got {n_layers}; give an explicit model.pattern instead"
        )
    pairs = n_layers // 2
    n_attn = int(pairs * attention_ratio)
    n_mix = pairs - n_attn
    if n_attn == 0:
        return "M-" * pairs
    if attention_ratio <= 0.5:
        per_block = n_mix // n_attn
        return ("*-" + "M-" * per_block) * n_attn + "M-" * (n_mix % n_attn)
    return "*-" * (n_attn - n_mix) + "*-M-" * n_mix

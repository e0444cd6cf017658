"""Rotary position embeddings (RoPE) and their context extensions, shared by the attention sublayers.

    x_rot = x * cos(p * f) + rotate_half(x) * sin(p * f)       rotate_half([x1 | x2]) = [-x2 | x1]

Channel i of the first half rotates with channel i of the second half, at frequency f_i = theta^(-2i / d). This is the
"rotate-half" layout of Llama and of transformers, so no channel permutation is ever needed on import or export. There
are two extensions of the frequencies:

* YaRN (DeepSeek-V2's, used by the MLA): frequencies below ``beta_slow`` rotations over the original context are
  divided by the factor, those above ``beta_fast`` are kept, with a linear ramp between. cos and sin are scaled
  by mscale.
* Llama 3's (``rope_type: llama3`` in a Llama config.json): wavelengths longer than original / low_freq_factor
  are divided by the factor, those shorter than original / high_freq_factor are kept, with a smooth
  interpolation between."""

from __future__ import annotations

import math

import torch


def plain_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i / dim) for i < dim / 2: the rotation speed of each channel pair."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, device=None) -> torch.Tensor:
    """The YaRN-interpolated frequencies. At a factor of 1 or less they are the plain ones."""
    extra = plain_inv_freq(dim, theta, device)
    if factor <= 1:
        return extra
    inter = extra / factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original (high) frequency, 0: interpolate
    return inter * (1 - keep) + extra * keep


def llama3_inv_freq(dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, device=None) -> torch.Tensor:
    """Llama 3.1's frequencies: long wavelengths slowed by ``factor``, short ones kept, and a smooth blend between."""
    inv_freq = plain_inv_freq(dim, theta, device)
    if factor <= 1:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    slowed = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, slowed)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos and sin of positions [.., T] at the frequencies, times scale: [.., T, 1, 2 * len(inv_freq)], float32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).unsqueeze(-2), (emb.sin() * scale).unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x is [B, T, H, D]; cos and sin are [B or 1, T, 1, D], float32. Computed in float32 and returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def positions_of(T: int, rows: int, offset: int, device) -> torch.Tensor:
    """The positions of T tokens. Packed documents arrive as one row made of ``rows`` rows of T / rows tokens, and the
    positions restart on each. RoPE is relative, so within a document only differences count. Otherwise the positions
    are offset, ..., offset + T - 1."""
    if rows > 1:
        return torch.arange(T, device=device) % (T // rows)
    return torch.arange(offset, offset + T, device=device)

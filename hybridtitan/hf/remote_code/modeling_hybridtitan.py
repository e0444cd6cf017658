"""A hybridtitan export as a transformers causal LM, standalone: torch and transformers, nothing else.

This file travels inside an exported folder (``auto_map`` names it) and is loaded by ``trust_remote_code=True``;
it never imports hybridtitan. The model is a stack of pre-norm residual sublayers, one per symbol of the
config's pattern::

    h_0     = embed(input_ids)
    h_{i+1} = h_i + f_i(RMSNorm_i(h_i))         f_i: MLA attention ('*'), the mixer ('M'), SwiGLU ('-')
    logits  = RMSNorm(h_n) @ W_out^T           W_out: the embedding (tied) or lm_head

The mixer is Gated DeltaNet, Kimi Delta Attention or Mamba2 (config.mixer). Their recurrences run in FLA's Triton
kernels when the ``fla`` package imports and the tensors are on a GPU, and otherwise (a CPU, or no FLA) in the
chunked PyTorch forms below, which compute the same thing as hybridtitan's own CPU path. Attention is PyTorch's
scaled_dot_product_attention everywhere (flash or memory-efficient kernels on a GPU), as hybridtitan's is for
unpacked batches. Pass ``use_fla_kernels=False`` to ``from_pretrained`` to keep a GPU on the PyTorch path.

The weights keep hybridtitan's names under ``model.`` (``model.layers.3.mixer.q_proj.weight``), so an export's
safetensors load as they are. ``generate()`` carries a HybridTitanCache: per sublayer the short-convolution
windows, the recurrent state, and MLA's compressed latents, so each new token costs one step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_hybridtitan import HybridTitanConfig

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the output's past_key_values to cache; earlier releases have past_key_values
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"

# Tokens per chunk of the PyTorch forms, hybridtitan's: KDA's per-channel decay between every pair of positions
# of a chunk costs C x the key tensor, so its chunks are short.
GDN_CHUNK = 64
KDA_CHUNK = 16
GLA_CHUNK = 64
# On a GPU, FLA's recurrent kernels beat its chunked ones below this many tokens without gradients (decoding).
FLA_RECURRENT_MAX_TOKENS = 64
# FLA's chunk sizes as hybridtitan calls them (a KDA chunk of 32 ran faster at its key dim of 32 on an H200)
FLA_CHUNK = {"gdn": 64, "kda": 32}
# The keywords of FLA's delta-rule kernels that the call below needs (FLA 0.6 has them). An FLA whose kernels
# lack them would take their calls differently: the PyTorch forms run instead of guessing.
FLA_DELTA_KEYWORDS = ("use_beta_sigmoid_in_kernel", "state_v_first")
# FLA 0.6's chunked simple-GLA backward misbehaved below head dims of 64 (hybridtitan measured it on an H200):
# when gradients will flow, smaller dims are zero-padded to this, which changes no result.
FLA_MIN_TRAINED_HEAD_DIM = 64


# ================================================================================================ kernels


@functools.cache
def fla_ops() -> dict | None:
    """FLA's recurrence kernels by name, or None where FLA is not installed, does not import, or is a release whose
    kernels take other arguments (then the PyTorch forms run, on GPUs too)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 -- an FLA built for another torch or Triton: run without it
        logger.warning(f"hybridtitan: FLA failed to import ({type(e).__name__}: {e}); using the PyTorch kernels")
        return None
    delta = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda, fused_recurrent_kda)
    if not all(name in inspect.signature(fn).parameters for fn in delta for name in FLA_DELTA_KEYWORDS):
        logger.warning("hybridtitan: this FLA release's delta-rule kernels lack "
                       f"{', '.join(FLA_DELTA_KEYWORDS)}; using the PyTorch kernels")
        return None
    return dict(gdn=(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), kda=(chunk_kda, fused_recurrent_kda),
                gla=(chunk_simple_gla, fused_recurrent_simple_gla))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, T, H, *d] -> [B, H, N, C, *d] in float32, zero-padded at the end to N * C tokens. A zero key, value and
    log decay leaves a state untouched, so the padding changes no output and no final state."""
    B, T = x.shape[:2]
    pad = (-T) % chunk
    x = x.float()
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
    x = x.view(B, (T + pad) // chunk, chunk, *x.shape[2:])
    return x.movedim(3, 1)  # heads before chunks


def _from_chunks(y: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, d] -> [B, T, H, d]."""
    B, H, N, C, d = y.shape
    return y.movedim(1, 3).reshape(B, N * C, H, d)[:, :T]


def _channel_decay_matrix(gamma: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """exp(gamma_t - gamma_j) per key channel for j <= t (j < t if not inclusive), 0 elsewhere: gamma [..., C, K]
    -> [..., C, C, K]. The difference is masked to -inf before the exponential, so nothing overflows."""
    C = gamma.shape[-2]
    mask = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril(0 if inclusive else -1)
    diff = gamma.unsqueeze(-2) - gamma.unsqueeze(-3)  # [..., t, j, K]
    return diff.masked_fill(~mask[..., None], float("-inf")).exp()


def _scalar_decay_matrix(gamma: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """exp(gamma_t - gamma_j) for j <= t (j < t if not inclusive), 0 elsewhere: gamma [..., C] -> [..., C, C]."""
    C = gamma.shape[-1]
    mask = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril(0 if inclusive else -1)
    diff = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)  # [..., t, j]
    return diff.masked_fill(~mask, float("-inf")).exp()


def torch_chunk_delta_rule(q, k, v, g, beta, scale, state, chunk_size):
    """The gated delta rule, a chunk of C tokens at a time (the WY form FLA's kernels use), in float32.

    Per head, with S the [K, V] state and D_t = diag(exp(g_t)) (g_t a scalar, or one value per key channel):

        S_t = D_t S_{t-1} + k_t u_t^T,    u_t = beta_t (v_t - (D_t S_{t-1})^T k_t),    o_t = S_t^T (scale q_t)

    Inside a chunk, with gamma_t the cumulative log decay from the chunk start (inclusive) and S the state entering
    the chunk, the u_t solve one unit-lower-triangular system (I + diag(beta) L) [U | W] = diag(beta) [v | k e^gamma],
    L[t, j] = k_t . (e^(gamma_t - gamma_j) k_j) for j < t, and then

        u = U - W S,    o = (q e^gamma) S + Q u,    S' = e^(gamma_C) S + (k e^(gamma_C - gamma))^T u

    with Q[t, j] = q_t . (e^(gamma_t - gamma_j) k_j) for j <= t. Only the state crosses chunks (one Python step per
    chunk, never per token).

    q, k: [B, T, H, K] (already L2-normed); v: [B, T, H, V]; g: [B, T, H] or [B, T, H, K] (log decay); beta: [B, T, H];
    state: [B, H, K, V] or None. Returns o [B, T, H, V] and the final state [B, H, K, V], both float32.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    per_channel = g.dim() == 4
    q, k, v = (_to_chunks(x, chunk_size) for x in (q, k, v))  # [B, H, N, C, d]
    beta = _to_chunks(beta.unsqueeze(-1), chunk_size)  # [B, H, N, C, 1]
    gamma = _to_chunks(g if per_channel else g.unsqueeze(-1), chunk_size).cumsum(-2)  # [B, H, N, C, K or 1]
    q = q * scale
    if per_channel:
        kk = torch.einsum("...tc,...jc,...tjc->...tj", k, k, _channel_decay_matrix(gamma, inclusive=False))
        qk = torch.einsum("...tc,...jc,...tjc->...tj", q, k, _channel_decay_matrix(gamma, inclusive=True))
    else:
        gs = gamma.squeeze(-1)
        kk = (k @ k.transpose(-1, -2)) * _scalar_decay_matrix(gs, inclusive=False)
        qk = (q @ k.transpose(-1, -2)) * _scalar_decay_matrix(gs, inclusive=True)
    C = q.shape[-2]
    system = torch.eye(C, device=q.device, dtype=q.dtype) + beta * kk
    rhs = torch.cat([beta * v, beta * k * gamma.exp()], dim=-1)
    U, W = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([V, K], dim=-1)
    q_decayed = q * gamma.exp()  # reads the state entering the chunk
    gamma_end = gamma[..., -1:, :]  # [B, H, N, 1, K or 1]
    k_to_end = k * (gamma_end - gamma).exp()  # carries each key to the chunk's end

    S = q.new_zeros(B, H, K, V) if state is None else state.float()
    outputs = []
    for n in range(q.shape[2]):
        u = U[:, :, n] - W[:, :, n] @ S
        outputs.append(q_decayed[:, :, n] @ S + qk[:, :, n] @ u)
        S = S * gamma_end[:, :, n].transpose(-1, -2).exp() + k_to_end[:, :, n].transpose(-1, -2) @ u
    return _from_chunks(torch.stack(outputs, dim=2), T), S


def torch_recurrent_delta_rule(q, k, v, g, beta, scale, state):
    """The gated delta rule one token at a time (decoding): the recurrence of torch_chunk_delta_rule, literally."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32) if state is None else state.float()
    q, k, v, g, beta = q.float() * scale, k.float(), v.float(), g.float(), beta.float()
    outputs = []
    for t in range(T):
        decay = g[:, t].exp()[..., None] if g.dim() == 4 else g[:, t].exp()[..., None, None]  # [B, H, K or 1, 1]
        S = S * decay
        u = beta[:, t, :, None] * (v[:, t] - (S * k[:, t, :, :, None]).sum(-2))  # [B, H, V]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outputs, dim=1), S


def gdn_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """GDN's log decay g = -exp(A_log) * softplus(a + dt_bias), one per value head: a [B, T, HV] -> float32."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def kda_log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """KDA's log decay, one per head and key channel: a [B, T, H, K], A_log [H], dt_bias [H * K] -> float32."""
    H, K = a.shape[-2], a.shape[-1]
    return -A_log.float().view(H, 1).exp() * F.softplus(a.float() + dt_bias.float().view(H, K))


def delta_rule(kind, q, k, v, a, b, A_log, dt_bias, state=None, output_final_state=False, use_fla=False):
    """The Gated DeltaNet (kind "gdn") or KDA ("kda") core, from raw projections as hybridtitan's ops take them.

    q, k: [B, T, H, K] before their L2 norm; v: [B, T, HV, V] (HV a multiple of H: value head h reads key head
    h // (HV / H)); a: the gate logits, [B, T, HV] (GDN) or [B, T, H, K] (KDA); b: the beta logits [B, T, HV];
    state: [B, HV, K, V] float32 or None. Returns o [B, T, HV, V] in v's dtype and the final state if asked.
    On the FLA path the gate, sigmoid and L2 norm run inside FLA's kernels, called as hybridtitan calls them."""
    if use_fla:
        chunked, recurrent = fla_ops()[kind]
        decoding = not torch.is_grad_enabled() and q.shape[1] <= FLA_RECURRENT_MAX_TOKENS
        o, final = (recurrent if decoding else chunked)(
            q=q, k=k, v=v, g=a, beta=b, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, initial_state=_v_first(state),
            output_final_state=output_final_state, state_v_first=True,
            **({} if decoding else {"chunk_size": FLA_CHUNK[kind]}))
        return o.to(v.dtype), _v_first(final)
    g = kda_log_decay(a, A_log, dt_bias) if kind == "kda" else gdn_log_decay(a, A_log, dt_bias)
    beta = torch.sigmoid(b.float())
    groups = v.shape[2] // q.shape[2]
    q, k = l2norm(q.float()), l2norm(k.float())
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5
    if q.shape[1] == 1:
        o, final = torch_recurrent_delta_rule(q, k, v, g, beta, scale, state)
    else:
        o, final = torch_chunk_delta_rule(q, k, v, g, beta, scale, state, KDA_CHUNK if kind == "kda" else GDN_CHUNK)
    return o.to(v.dtype), (final if output_final_state else None)


def _v_first(state: torch.Tensor | None) -> torch.Tensor | None:
    # hybridtitan's FLA calls keep the state [N, H, V, K] inside FLA (state_v_first=True); the cache holds
    # [N, H, K, V], as the PyTorch forms. Only decoding passes states, so the transposes are tiny.
    return state.transpose(-1, -2).contiguous() if state is not None else None


def torch_chunk_simple_gla(q, k, v, g, scale, state, chunk_size=GLA_CHUNK):
    """Linear attention with one scalar decay per head (Mamba2's SSD), a chunk at a time, in float32:

        S_t = e^(g_t) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)

    Inside a chunk (gamma the cumulative log decay from its start, S the state entering it):
    o = (Q * M) v + (q e^gamma) S with M[t, j] = e^(gamma_t - gamma_j) for j <= t, and
    S' = e^(gamma_C) S + (k e^(gamma_C - gamma))^T v.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H]; state [B, H, K, V] or None. Returns o, final state (float32)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = (_to_chunks(x, chunk_size) for x in (q, k, v))  # [B, H, N, C, d]
    gamma = _to_chunks(g.unsqueeze(-1), chunk_size).cumsum(-2)  # [B, H, N, C, 1]
    q = q * scale
    intra = ((q @ k.transpose(-1, -2)) * _scalar_decay_matrix(gamma.squeeze(-1), inclusive=True)) @ v
    q_decayed = q * gamma.exp()
    gamma_end = gamma[..., -1:, :]  # [B, H, N, 1, 1]
    k_to_end = k * (gamma_end - gamma).exp()
    S = q.new_zeros(B, H, K, V) if state is None else state.float()
    outputs = []
    for n in range(q.shape[2]):
        outputs.append(intra[:, :, n] + q_decayed[:, :, n] @ S)
        S = S * gamma_end[:, :, n].exp() + k_to_end[:, :, n].transpose(-1, -2) @ v[:, :, n]
    return _from_chunks(torch.stack(outputs, dim=2), T), S


def torch_recurrent_simple_gla(q, k, v, g, scale, state):
    """The simple-GLA recurrence one token at a time (decoding)."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32) if state is None else state.float()
    q, k, v, g = q.float() * scale, k.float(), v.float(), g.float()
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outputs, dim=1), S


def simple_gla(q, k, v, g, scale, state=None, output_final_state=False, use_fla=False):
    """Mamba2's SSD as simple GLA (q = C, k = B, v = x * dt, g = A * dt). Returns o in v's dtype, final state."""
    if use_fla:
        return _fla_simple_gla(q, k, v, g, scale, state, output_final_state)
    if q.shape[1] == 1:
        o, final = torch_recurrent_simple_gla(q, k, v, g, scale, state)
    else:
        o, final = torch_chunk_simple_gla(q, k, v, g, scale, state)
    return o.to(v.dtype), (final if output_final_state else None)


def _fla_simple_gla(q, k, v, g, scale, state, output_final_state):
    chunked, recurrent = fla_ops()["gla"]
    decoding = not torch.is_grad_enabled() and q.shape[1] <= FLA_RECURRENT_MAX_TOKENS
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g))
    # zero key columns add nothing to q k^T, zero value columns give zero outputs: cut off below
    pad_k = max(FLA_MIN_TRAINED_HEAD_DIM - key_dim, 0) if backward else 0
    pad_v = max(FLA_MIN_TRAINED_HEAD_DIM - value_dim, 0) if backward else 0
    if pad_k or pad_v:
        q, k, v = F.pad(q, (0, pad_k)), F.pad(k, (0, pad_k)), F.pad(v, (0, pad_v))
        state = F.pad(state, (0, pad_v, 0, pad_k)) if state is not None else None
    o, final = (recurrent if decoding else chunked)(q=q, k=k, v=v, g=g, scale=scale, initial_state=state,
                                                    output_final_state=output_final_state)
    o = o[..., :value_dim]
    if final is not None:
        final = final[..., :key_dim, :value_dim].contiguous()
    return o.to(v.dtype), final


# ================================================================================================ building blocks


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The mixers' output norm, gated by a projection z of the input, act = SiLU or sigmoid:

        norm_before_gate:      RMSNorm(x) * act(z)                  (per head: GDN, KDA)
        otherwise:             RMSNorm_grouped(x * act(z))          (Mamba2: one RMS per group of channels)
    """

    def __init__(self, dim: int, eps: float, activation: str = "swish", norm_before_gate: bool = True,
                 group_size: int | None = None):
        super().__init__()
        self.eps, self.activation = eps, activation
        self.norm_before_gate, self.group_size = norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf, zf = x.float(), z.float()
        act = F.silu(zf) if self.activation in ("swish", "silu") else torch.sigmoid(zf)
        if not self.norm_before_gate:
            xf = xf * act
        shape = xf.shape
        if self.group_size is not None and self.group_size != shape[-1]:
            xf = xf.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).view(shape) * self.weight.float()
        if self.norm_before_gate:
            y = y * act
        return y.to(x.dtype)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time, then SiLU: y_t = SiLU(sum_i w_i x_{t-W+1+i} + b).

    The weight keeps nn.Conv1d's [channels, 1, W] shape (FLA's and hybridtitan's). Its decoding state, under
    ``key`` in a sublayer's cache dict, is the last W inputs [B, channels, W], oldest first (FLA's layout)."""

    def __init__(self, channels: int, width: int, bias: bool = False):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def forward(self, x: torch.Tensor, state: dict | None = None, key: str = "conv") -> torch.Tensor:
        B, _, D = x.shape
        W = self.width
        past = state.get(key) if state is not None else None
        # the W - 1 inputs before this call: zeros at a sequence start, the cached window when decoding
        history = past[..., 1:].to(x.dtype) if past is not None else x.new_zeros(B, D, W - 1)
        window = torch.cat([history, x.transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
        if state is not None:
            state[key] = window[..., -W:]
        y = F.conv1d(window, self.weight, self.bias, groups=D)  # [B, D, T]
        # channels last again, contiguous: the recurrence kernels read each head's channels as one row
        return F.silu(y.transpose(1, 2).contiguous())


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ================================================================================================ attention


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(a: dict, device=None) -> torch.Tensor:
    """Inverse frequencies of the rotary channels, 1 / theta^(2i / d); with YaRN (rope_scaling_factor > 1) those
    that turn fewer than beta_slow times over the original context are divided by the factor, those that turn more
    than beta_fast times kept, and a linear ramp blends the ones between."""
    dim, base, factor = a["qk_rope_head_dim"], a["rope_theta"], a["rope_scaling_factor"]
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if factor <= 1:
        return extra
    inter = extra / factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(a["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(a["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(a["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return inter * (1 - keep) + extra * keep


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + [-x2, x1] * sin, in float32. x: [B, T, H, D]; cos, sin: [1, T, 1, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class MultiLatentAttention(nn.Module):
    """DeepSeek-V2's multi-latent attention (MLA). Keys and values come from a small latent c_kv shared by all
    heads, plus one rotary key part shared by all heads:

        q               = W_qu RMSNorm(W_qd x)          (W_q x when q_lora_rank = 0)     [H, d_nope + d_rope]
        [c_kv | k_rope] = W_kvd x;     [k_nope | v] = W_kvu RMSNorm(c_kv)                 per head
        q_rope, k_rope  = RoPE(q_rope), RoPE(k_rope)    (rotate-half; YaRN when rope_scaling_factor > 1)
        o               = W_o softmax(q k^T * s + causal mask) v,   s = (d_nope + d_rope)^-1/2 * mscale^2

    The decoding cache keeps c_kv and the rotated k_rope ([B, S, kv_lora_rank], [B, S, 1, d_rope]), not K and V."""

    def __init__(self, dim: int, a: dict, norm_eps: float):
        super().__init__()
        self.a = a
        self.num_heads = H = a["num_heads"]
        self.qk_head_dim = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
        if a["q_lora_rank"] > 0:
            self.q_down_proj = nn.Linear(dim, a["q_lora_rank"], bias=False)
            self.q_norm = RMSNorm(a["q_lora_rank"], eps=norm_eps)
            self.q_up_proj = nn.Linear(a["q_lora_rank"], H * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, H * self.qk_head_dim, bias=False)
        self.kv_down_proj = nn.Linear(dim, a["kv_lora_rank"] + a["qk_rope_head_dim"], bias=False)
        self.kv_norm = RMSNorm(a["kv_lora_rank"], eps=norm_eps)
        self.kv_up_proj = nn.Linear(a["kv_lora_rank"], H * (a["qk_nope_head_dim"] + a["v_head_dim"]), bias=False)
        self.o_proj = nn.Linear(H * a["v_head_dim"], dim, bias=False)
        m = yarn_mscale(a["rope_scaling_factor"], a["mscale_all_dim"])
        self.softmax_scale = self.qk_head_dim ** -0.5 * m * m
        # YaRN scales cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
        self.rope_mscale = yarn_mscale(a["rope_scaling_factor"], a["mscale"]) / m

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * rope_inv_freq(self.a, positions.device)  # [T, d_rope / 2]
        emb = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]  # [1, T, 1, d_rope]
        return emb.cos() * self.rope_mscale, emb.sin() * self.rope_mscale

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        a, H = self.a, self.num_heads
        d_nope, d_rope, d_v = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
        q = self.q_up_proj(self.q_norm(self.q_down_proj(x))) if a["q_lora_rank"] > 0 else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, H, self.qk_head_dim).split([d_nope, d_rope], dim=-1)
        c_kv, k_rope = self.kv_down_proj(x).split([a["kv_lora_rank"], d_rope], dim=-1)

        offset = state["c_kv"].shape[1] if state is not None and "c_kv" in state else 0
        cos, sin = self.rotary(torch.arange(offset, offset + T, device=x.device))
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)  # [B, T, 1, d_rope]
        if state is not None:
            if offset:
                c_kv = torch.cat([state["c_kv"], c_kv], dim=1)
                k_rope = torch.cat([state["k_rope"], k_rope], dim=1)
            state["c_kv"], state["k_rope"] = c_kv, k_rope
        S = c_kv.shape[1]
        k_nope, v = self.kv_up_proj(self.kv_norm(c_kv)).view(B, S, H, d_nope + d_v).split([d_nope, d_v], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, S, H, d_rope)], dim=-1)
        # the T queries are the last T of the S positions (S > T when decoding against the cache)
        mask = None if S == T else torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None, scale=self.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * d_v))


# ================================================================================================ mixers


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Yang et al., 2024), FLA's parameter names and shapes:

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))   (H key heads, HV >= H value heads)
        g_t     = -exp(A_log) * softplus(W_a x + dt_bias)                     (log decay, one per value head)
        beta_t  = sigmoid(W_b x)
        o       = gated delta rule(l2norm(q), l2norm(k), v, g, beta)          (value head h reads key head h // (HV/H))
        out     = W_o(RMSNorm(o) * SiLU(W_g x))                               (norm per head)
    """

    def __init__(self, dim: int, a: dict, norm_eps: float, use_fla: bool = True):
        super().__init__()
        self.num_heads, self.num_v_heads = a["num_heads"], a["num_v_heads"]
        self.head_dim, self.head_v_dim = a["head_dim"], a["head_v_dim"]
        self.use_fla = use_fla
        key_dim, value_dim = self.num_heads * self.head_dim, self.num_v_heads * self.head_v_dim
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        self.a_proj = nn.Linear(dim, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(dim, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.q_conv1d = ShortConvolution(key_dim, a["conv_size"])
        self.k_conv1d = ShortConvolution(key_dim, a["conv_size"])
        self.v_conv1d = ShortConvolution(value_dim, a["conv_size"])
        self.g_proj = nn.Linear(dim, value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="swish")
        self.o_proj = nn.Linear(value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        q = self.q_conv1d(self.q_proj(x), state, "q_conv").view(B, T, H, K)
        k = self.k_conv1d(self.k_proj(x), state, "k_conv").view(B, T, H, K)
        v = self.v_conv1d(self.v_proj(x), state, "v_conv").view(B, T, HV, V)
        o, final = delta_rule("gdn", q, k, v, self.a_proj(x), self.b_proj(x), self.A_log, self.dt_bias,
                              state=state.get("recurrent") if state is not None else None,
                              output_final_state=state is not None, use_fla=self.use_fla and _on_fla_device(x))
        if state is not None:
            state["recurrent"] = final
        o = self.o_norm(o.to(x.dtype), self.g_proj(x).view(B, T, HV, V))
        return self.o_proj(o.reshape(B, T, -1))

    @torch.no_grad()
    def init_special(self) -> None:
        init_log_uniform_A(self.A_log)
        init_dt_bias(self.dt_bias)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (Kimi Linear, 2025): Gated DeltaNet with one decay per key channel, from a low-rank
    projection, and a low-rank sigmoid output gate (FLA's names and shapes):

        g_t = -exp(A_log_h) * softplus(W_f2 W_f1 x + dt_bias)     (per head and key channel)
        out = W_o(RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g))
    """

    def __init__(self, dim: int, a: dict, norm_eps: float, use_fla: bool = True):
        super().__init__()
        self.num_heads, self.head_dim, self.head_v_dim = a["num_heads"], a["head_dim"], a["head_v_dim"]
        self.use_fla = use_fla
        key_dim, value_dim = self.num_heads * self.head_dim, self.num_heads * self.head_v_dim
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        self.q_conv1d = ShortConvolution(key_dim, a["conv_size"])
        self.k_conv1d = ShortConvolution(key_dim, a["conv_size"])
        self.v_conv1d = ShortConvolution(value_dim, a["conv_size"])
        # low-rank decay and gate, of rank head_v_dim (FLA's)
        self.f_proj = nn.Sequential(nn.Linear(dim, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, key_dim, bias=False))
        self.b_proj = nn.Linear(dim, self.num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(key_dim))
        self.g_proj = nn.Sequential(nn.Linear(dim, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, value_dim, bias=True))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_dim, self.head_v_dim
        q = self.q_conv1d(self.q_proj(x), state, "q_conv").view(B, T, H, K)
        k = self.k_conv1d(self.k_proj(x), state, "k_conv").view(B, T, H, K)
        v = self.v_conv1d(self.v_proj(x), state, "v_conv").view(B, T, H, V)
        o, final = delta_rule("kda", q, k, v, self.f_proj(x).view(B, T, H, K), self.b_proj(x), self.A_log,
                              self.dt_bias, state=state.get("recurrent") if state is not None else None,
                              output_final_state=state is not None, use_fla=self.use_fla and _on_fla_device(x))
        if state is not None:
            state["recurrent"] = final
        o = self.o_norm(o.to(x.dtype), self.g_proj(x).view(B, T, H, V))
        return self.o_proj(o.reshape(B, T, -1))

    @torch.no_grad()
    def init_special(self) -> None:
        init_log_uniform_A(self.A_log)
        init_dt_bias(self.dt_bias)


class Mamba2(nn.Module):
    """Mamba2 (Dao & Gu, 2024), the SSD layer as Megatron's MambaMixer lays it out:

        [z | x | B | C | dt] = W_in u
        x, B, C = SiLU(conv([x | B | C]) + b)            (B and C: one per group of H / G heads)
        dt      = softplus(dt + dt_bias);   A = -exp(A_log)
        y       = SSD(x * dt, A * dt, B, C) + D * x      (simple GLA: q = C, k = B, v = x * dt, log decay A * dt)
        out     = W_out(RMSNorm_grouped(y * SiLU(z)))
    """

    def __init__(self, dim: int, a: dict, norm_eps: float, use_fla: bool = True):
        super().__init__()
        self.d_inner = dim * a["expand"]
        self.head_dim, self.d_state, self.n_groups = a["head_dim"], a["d_state"], a["n_groups"]
        self.num_heads = self.d_inner // self.head_dim
        self.bc_dim = self.n_groups * self.d_state
        self.use_fla = use_fla
        self.in_proj = nn.Linear(dim, 2 * self.d_inner + 2 * self.bc_dim + self.num_heads, bias=False)
        self.conv1d = ShortConvolution(self.d_inner + 2 * self.bc_dim, a["conv_size"], bias=True)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, eps=norm_eps, activation="swish", norm_before_gate=False,
                                 group_size=self.d_inner // self.n_groups)
        self.out_proj = nn.Linear(self.d_inner, dim, bias=False)

    def forward(self, u: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        B, T, _ = u.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        z, xbc, dt = self.in_proj(u).split([self.d_inner, self.d_inner + 2 * self.bc_dim, H], dim=-1)
        x, Bm, Cm = self.conv1d(xbc, state, "conv").split([self.d_inner, self.bc_dim, self.bc_dim], dim=-1)
        x = x.view(B, T, H, P)
        Bm = Bm.view(B, T, G, N).repeat_interleave(H // G, dim=2)
        Cm = Cm.view(B, T, G, N).repeat_interleave(H // G, dim=2)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [B, T, H]
        A = -self.A_log.float().exp()
        y, final = simple_gla(Cm, Bm, (x * dt.unsqueeze(-1)).to(x.dtype), A * dt, scale=1.0,
                              state=state.get("recurrent") if state is not None else None,
                              output_final_state=state is not None, use_fla=self.use_fla and _on_fla_device(u))
        if state is not None:
            state["recurrent"] = final
        y = y.to(x.dtype) + x * self.D.to(x.dtype).view(H, 1)
        return self.out_proj(self.norm(y.reshape(B, T, self.d_inner), z))

    @torch.no_grad()
    def init_special(self) -> None:
        init_log_uniform_A(self.A_log)
        init_dt_bias(self.dt_bias)
        nn.init.ones_(self.D)


MIXER_CLASSES = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2}


def _on_fla_device(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_ops() is not None


@torch.no_grad()
def init_log_uniform_A(A_log: torch.Tensor, low: float = 1.0, high: float = 16.0) -> None:
    """A_log = log(A), A ~ U(low, high)."""
    nn.init.uniform_(A_log, low, high)
    A_log.log_()


@torch.no_grad()
def init_dt_bias(dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> None:
    """dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max], at least ``floor`` (Mamba's init)."""
    nn.init.uniform_(dt_bias)
    dt_bias.mul_(math.log(dt_max) - math.log(dt_min)).add_(math.log(dt_min)).exp_().clamp_(min=floor)
    dt_bias.add_(torch.log(-torch.expm1(-dt_bias)))


# ================================================================================================ the stack


class HybridTitanSublayer(nn.Module):
    """One pre-norm residual sublayer: x + f(RMSNorm(x)), f MLA attention, the mixer or SwiGLU."""

    def __init__(self, config: HybridTitanConfig, kind: str):
        super().__init__()
        a = config.model_args
        dim, eps = a["dim"], a["norm_eps"]
        use_fla = getattr(config, "use_fla_kernels", True)
        self.kind = kind
        self.norm = RMSNorm(dim, eps=eps)
        if kind == "attention":
            self.attn = MultiLatentAttention(dim, config.mla_args, eps)
        elif kind == "mixer":
            self.mixer = MIXER_CLASSES[a["mixer"]](dim, config.mixer_args, eps, use_fla=use_fla)
        else:
            self.mlp = SwiGLU(dim, a["ffn_dim"])

    @property
    def body(self) -> nn.Module:
        return getattr(self, {"attention": "attn", "mixer": "mixer", "mlp": "mlp"}[self.kind])

    def forward(self, hidden_states: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        return hidden_states + self.body(self.norm(hidden_states), state)


class HybridTitanModel(nn.Module):
    """Embedding, the sublayers, the final RMSNorm and (untied models only) the output layer: hybridtitan's HybridLM
    names, so that an export's ``model.*`` tensors load unchanged."""

    def __init__(self, config: HybridTitanConfig):
        super().__init__()
        dim = config.model_args["dim"]
        self.embeddings = nn.Embedding(config.vocab_size, dim)
        self.layers = nn.ModuleList(HybridTitanSublayer(config, kind) for kind in config.sublayer_kinds)
        self.norm = RMSNorm(dim, eps=config.model_args["norm_eps"])
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(dim, config.vocab_size, bias=False)
        # activation checkpointing (HybridTitanForCausalLM._set_gradient_checkpointing): the function, and which
        # sublayers it recomputes
        self.checkpoint_fn = None
        self.checkpointed = [False] * len(self.layers)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embeddings.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.LongTensor, cache: HybridTitanCache | None = None,
                output_hidden_states: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """The final-normed hidden states [B, T, D], and with ``output_hidden_states`` (as transformers' models
        give them) the embeddings' output, the residual stream entering each later sublayer, the final states."""
        h = self.embeddings(input_ids)
        collected = [] if output_hidden_states else None
        recompute = self.checkpoint_fn is not None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if collected is not None:
                collected.append(h)
            if recompute and self.checkpointed[i]:
                h = self.checkpoint_fn(layer, h)  # no cache here: the recomputation would advance it twice
            else:
                h = layer(h, cache.states[i] if cache is not None else None)
        h = self.norm(h)
        if collected is not None:
            collected.append(h)
        return h, tuple(collected) if collected is not None else None


class HybridTitanCache(Cache):
    """The decoding state of every sublayer, a transformers Cache (so ``generate`` carries, reorders and repeats
    it). ``states[i]`` is sublayer i's dict: convolution windows (``conv``, ``q_conv``, ``k_conv``, ``v_conv``:
    [B, channels, W]), the recurrent state (``recurrent``: [B, H, K, V], float32), MLA's latents (``c_kv``,
    ``k_rope``); every tensor has the batch first. A recurrent state cannot be rolled back, so ``crop`` refuses
    anything but a no-op (as FLA's caches do)."""

    is_compileable = False

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.states: list[dict] = [{} for _ in range(num_layers)]
        self.seen_tokens = 0

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        return f"HybridTitanCache(num_layers={self.num_layers}, seen_tokens={self.seen_tokens})"

    def _map(self, fn) -> None:
        for state in self.states:
            for key, value in state.items():
                state[key] = fn(value)

    def get_seq_length(self, layer_idx: int = 0, cache_position=None) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda v: v.index_select(0, beam_idx.to(v.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda v: v.index_select(0, indices.to(v.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda v: v.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.seen_tokens + max_length
        if max_length < self.seen_tokens:
            raise NotImplementedError("a recurrent state cannot be rolled back: HybridTitanCache cannot be cropped")

    def reset(self) -> None:
        self.states = [{} for _ in range(self.num_layers)]
        self.seen_tokens = 0

    def activate_past_recording(self) -> None:
        pass

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.seen_tokens > 0

    @property
    def is_linear(self) -> list[bool]:
        # attention and recurrent states mixed: sequence-length bookkeeping applies (get_seq_length)
        return [False] * self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        for state in self.states:
            for value in state.values():
                return value.shape[0]
        return -1


class HybridTitanPreTrainedModel(PreTrainedModel):
    config_class = HybridTitanConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["HybridTitanSublayer"]
    _is_stateful = True  # recurrent state: no assisted decoding, no cache cropping
    supports_gradient_checkpointing = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """hybridtitan's initialisation, one module at a time, skipping modules whose parameters were loaded:
        N(0, init_std) for every matrix and convolution, zero biases, unit norms; A_log, dt_bias, D per mixer."""
        params = list(module.parameters(recurse=False))
        if not params or all(getattr(p, "_is_hf_initialized", False) for p in params):
            return
        std = self.config.model_args.get("init_std", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding, ShortConvolution)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            nn.init.ones_(module.weight)
        if hasattr(module, "init_special"):
            module.init_special()


class HybridTitanForCausalLM(HybridTitanPreTrainedModel, GenerationMixin):
    """A causal LM over the hybrid stack. ``forward`` accepts what ``generate`` passes; padding is supported only on
    the right and without a cache (a recurrent state cannot skip pads)."""

    def __init__(self, config: HybridTitanConfig):
        super().__init__(config)
        self.model = HybridTitanModel(config)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward makes its own HybridTitanCache on the first call

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.model.lm_head  # None when tied: the logits then use the embedding itself

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.model.lm_head = new_embeddings

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1, **kwargs) -> None:
        """Where transformers' activation_checkpointing_enable / gradient_checkpointing_enable (and disable) end:
        every ``every_n_layers``-th sublayer (attention, mixer or MLP), counting from the first, recomputed in the
        backward pass by ``gradient_checkpointing_func``; disabled, none."""
        if enable and gradient_checkpointing_func is None:
            from torch.utils.checkpoint import checkpoint

            gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        self.model.checkpoint_fn = gradient_checkpointing_func if enable else None
        every = max(int(every_n_layers or 1), 1)
        self.model.checkpointed = [enable and i % every == 0 for i in range(len(self.model.layers))]
        self.gradient_checkpointing = enable  # what transformers' is_gradient_checkpointing reads

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: HybridTitanCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: HybridTitanCache | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        if input_ids is None:
            raise ValueError("HybridTitanForCausalLM needs input_ids (inputs_embeds are not supported)")
        if cache is None:
            cache = past_key_values
        if use_cache is None:
            # an eval forward returns a cache to decode on, except for a padded batch (scoring), which no cache can
            # hold; a cache passed in is always used (and a padded mask with it refused), never dropped
            use_cache = self.config.use_cache and not self.training and (cache is not None
                                                                         or not _padded(attention_mask))
        if cache is not None and not isinstance(cache, HybridTitanCache):
            raise TypeError(f"HybridTitanForCausalLM needs a HybridTitanCache, got {type(cache).__name__}")
        if self.model.checkpoint_fn is not None and torch.is_grad_enabled():
            # the backward pass runs the checkpointed sublayers again, which would advance a cache a second time
            if cache is not None:
                raise ValueError("HybridTitanForCausalLM cannot update a cache under activation checkpointing with "
                                 "gradients on: call it under torch.no_grad(), or switch checkpointing off")
            use_cache = False
        if use_cache and cache is None:
            cache = HybridTitanCache(len(self.model.layers))
        _check_mask(attention_mask, with_cache=cache is not None)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states

        h, all_hidden = self.model(input_ids, cache=cache, output_hidden_states=output_hidden_states)
        if cache is not None:
            cache.seen_tokens += input_ids.shape[1]
        if labels is None and isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        elif labels is None and isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        logits = (h @ self.model.output_weight.t()).float()

        loss = None
        if labels is not None:
            # transformers' Trainer passes num_items_in_batch, the counted labels of all of a step's accumulated
            # micro-batches, and leaves the loss unscaled: the sum over that count gives the same step for any
            # number of micro-batches
            num_items = kwargs.get("num_items_in_batch")
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100,
                                   reduction="mean" if num_items is None else "sum")
            if num_items is not None:
                loss = loss / torch.as_tensor(num_items, device=loss.device)
        if return_dict is None:
            return_dict = self.config.return_dict
        if return_dict is False:
            out = (logits, *(x for x in (cache, all_hidden) if x is not None))
            return (loss, *out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=all_hidden, **{_CACHE_FIELD: cache})


def _padded(attention_mask: torch.Tensor | None) -> bool:
    return attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())


def _check_mask(attention_mask: torch.Tensor | None, with_cache: bool) -> None:
    """Right padding is harmless in a causal forward; anything else would leak pads into the recurrent state."""
    if not _padded(attention_mask):
        return
    if with_cache:
        raise ValueError("HybridTitanForCausalLM cannot decode padded batches (a recurrent state cannot skip pads): "
                         "generate each prompt on its own, or batch prompts of equal length")
    m = attention_mask.long()
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("HybridTitanForCausalLM supports right padding only (a recurrent state cannot skip left pads)")


__all__ = ["HybridTitanForCausalLM", "HybridTitanPreTrainedModel", "HybridTitanModel", "HybridTitanCache"]

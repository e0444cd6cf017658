"""The GPU path: FLA's Triton kernels (CUDA and ROCm alike). Imported only when a GPU tensor reaches an op.

Each function has the signature of its PyTorch twin in ``reference.py`` (through ``ops/__init__.py``).
"""

from __future__ import annotations

import importlib
import inspect
import logging

import torch
import torch.nn.functional as F
from fla.modules.activations import swiglu_linear as _fla_swiglu_linear
from fla.modules.convolution import causal_conv1d as _fla_causal_conv1d
from fla.modules.fused_kl_div import fused_kl_div_loss
from fla.modules.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
from fla.modules.layernorm import rms_norm as _fla_rms_norm
from fla.modules.norm.layernorm_gated import rmsnorm_fn as _fla_group_rmsnorm
from fla.ops.attn import parallel_attn
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fla.ops.kda import chunk_kda, fused_recurrent_kda
from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

logger = logging.getLogger("hybridtitan")

# Below this many tokens without gradients (decoding), the recurrent kernels beat the chunked ones.
RECURRENT_MAX_TOKENS = 64

# Tokens per chunk of the chunked delta-rule kernels (FLA's default is 64; both take 32). At KDA's key dim of 32
# chunks of 32 are faster (docs/findings.md); the arithmetic is the same either way, up to the order of bf16
# roundings.
CHUNK_SIZE = {"gdn": 64, "kda": 32}


# Autotune configs of 3 or more pipeline stages have hung FLA's backward passes on AMD GPUs (Primus drops them from
# the kernels below on ROCm; docs/rocm.md): the state gradient of simple GLA (Mamba2's SSD) and of the delta rules,
# and KDA's kernels. FLA 0.6.0 offers them 2, 3 and 4 stages on every device. On ROCm builds of torch the configs
# above 2 are dropped before the first call, where a kernel has others: the autotuner picks among the rest, and
# the arithmetic is the same. (None: every autotuned kernel of the module.)
ROCM_MAX_STAGES = 2
ROCM_STAGE_LIMITS = {
    "fla.ops.common.chunk_h": ("chunk_bwd_kernel_dh",),
    "fla.ops.common.chunk_delta_h": ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",),
    "fla.ops.kda.chunk_bwd": None,
    "fla.ops.kda.chunk_intra": None,
    "fla.ops.kda.wy_fast": None,
}


def autotuned_kernels(module_names) -> dict:
    """Every autotuned Triton kernel of these modules, by "module.name": its Autotuner."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name in module_names:
        for attr, kernel in vars(importlib.import_module(name)).items():
            while not isinstance(kernel, Autotuner) and hasattr(kernel, "fn"):  # under triton.heuristics
                kernel = kernel.fn
            if isinstance(kernel, Autotuner):
                found[f"{name}.{attr}"] = kernel
    return found


def limited_kernels(limits: dict) -> dict:
    """The autotuned kernels that ``limits`` (module -> kernel names, or None for all) names."""
    return {key: kernel for key, kernel in autotuned_kernels(limits).items()
            if limits[key.rsplit(".", 1)[0]] is None or key.rsplit(".", 1)[1] in limits[key.rsplit(".", 1)[0]]}


def limit_num_stages(limits: dict, max_stages: int) -> int:
    """Drops the autotune configs of more than ``max_stages`` stages from the kernels ``limits`` names (a kernel
    left with none keeps its own); returns how many were dropped."""
    dropped = 0
    for kernel in limited_kernels(limits).values():
        keep = [c for c in kernel.configs if (c.num_stages or 0) <= max_stages]
        if keep and len(keep) < len(kernel.configs):
            dropped += len(kernel.configs) - len(keep)
            kernel.configs = keep
    return dropped


if torch.version.hip:
    limit_num_stages(ROCM_STAGE_LIMITS, ROCM_MAX_STAGES)

_logged_kernels: set[str] = set()  # the ops whose kernel this process has named in its log


def log_kernel_choice(op: str, kernel: str) -> None:
    """Names once per process the kernel that runs an op (the log of rank 0)."""
    if op not in _logged_kernels:
        _logged_kernels.add(op)
        logger.info(f"{op}: {kernel}")


def _decoding(q: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() and q.shape[1] <= RECURRENT_MAX_TOKENS


def _v_first(state):
    # FLA's layers keep the delta-rule state as [N, H, V, K] (state_v_first=True); the ops' contract is
    # [N, H, K, V], as the PyTorch reference. Only decoding passes states, so the transposes are tiny.
    return state.transpose(-1, -2).contiguous() if state is not None else None


def _delta_rule(mixer, chunk_fn, recurrent_fn, inputs, *, cu_seqlens, initial_state, output_final_state,
                gate_outside: bool = False):
    """GDN and KDA take the same ``inputs`` (q, k, v, a, b, A_log, dt_bias): raw gate and beta logits, the gate and
    L2 norm fused in the kernel. With ``gate_outside``, the log decay -exp(A_log) * softplus(a + dt_bias) and beta's
    sigmoid are computed here in float32 and handed to the kernel (GDN only)."""
    q, k, v, a, b, A_log, dt_bias = inputs
    decoding = _decoding(q)
    if gate_outside:
        gates = dict(g=-A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), beta=torch.sigmoid(b.float())
                     .to(q.dtype), use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
    else:
        gates = dict(g=a, beta=b, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True)
    o, state = (recurrent_fn if decoding else chunk_fn)(
        q=q, k=k, v=v, **gates, use_qk_l2norm_in_kernel=True, initial_state=_v_first(initial_state),
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, state_v_first=True,
        **({} if decoding else {"chunk_size": CHUNK_SIZE[mixer]}),
    )
    return o, _v_first(state)


GDN_BACKENDS = ("triton", "flash_qla")

# FLA's chunk_gated_delta_rule routes a call to FlashQLA where that package is installed and takes the call
# (FLA's backend dispatch); its own Triton implementation is the function under the dispatch.
_triton_chunk_gated_delta_rule = torch.compiler.disable(inspect.unwrap(chunk_gated_delta_rule))


def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, *, cu_seqlens=None, initial_state=None, output_final_state=False,
                     backend: str = "triton"):
    """``backend``: "triton" (FLA's Triton kernels on every GPU, whatever else is installed) or "flash_qla" (FLA's
    dispatch: FlashQLA where installed and the call suits it, which needs the gate and beta computed outside the
    kernel, else FLA's Triton kernels). On ROCm the gate is computed in float32 outside the kernel too (Primus met
    NaN gradients with the gate fused there on AMD GPUs)."""
    if backend not in GDN_BACKENDS:
        raise ValueError(f"gated delta rule backend must be one of {', '.join(GDN_BACKENDS)}, got {backend!r}")
    inputs = (q, k, v, a, b, A_log, dt_bias)
    gate_outside = backend == "flash_qla" or bool(torch.version.hip)
    chunk_fn = chunk_gated_delta_rule if backend == "flash_qla" else _triton_chunk_gated_delta_rule
    if backend == "flash_qla":
        log_kernel_choice("gated_delta_rule", _flash_qla_verdict(inputs, cu_seqlens, initial_state))
    else:
        where = " (the gate in float32 outside the kernel, ROCm)" if gate_outside else ""
        log_kernel_choice("gated_delta_rule", "FLA's Triton kernels" + where)
    return _delta_rule("gdn", chunk_fn, fused_recurrent_gated_delta_rule, inputs, cu_seqlens=cu_seqlens,
                       initial_state=initial_state, output_final_state=output_final_state, gate_outside=gate_outside)


def _flash_qla_verdict(inputs, cu_seqlens, initial_state) -> str:
    """Which kernels FLA's dispatch will run for this call under the flash_qla backend, in words."""
    q, k, v, a, b = inputs[:5]
    from fla.ops.gated_delta_rule.backends import FlashQLABackend

    if not FlashQLABackend.is_available():
        return "FlashQLA asked for but not installed: FLA's Triton kernels"
    accepted, reason = FlashQLABackend().verify(
        "chunk_gated_delta_rule", q, k, v, a.float(), b, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
    return "FlashQLA" if accepted else f"FlashQLA declined ({reason}): FLA's Triton kernels"


def kda(q, k, v, a, b, A_log, dt_bias, *, cu_seqlens=None, initial_state=None, output_final_state=False):
    log_kernel_choice("kda", f"FLA's Triton kernels, chunks of {CHUNK_SIZE['kda']}")
    return _delta_rule("kda", chunk_kda, fused_recurrent_kda, (q, k, v, a, b, A_log, dt_bias), cu_seqlens=cu_seqlens,
                       initial_state=initial_state, output_final_state=output_final_state)


# FLA 0.6.0's chunked simple-GLA backward is only trusted at head dims of at least 64: below it, on an H200, its
# chunk_bwd_dqkwg faulted (an illegal memory access) or returned a wrong gate gradient (docs/findings.md); at 64
# and 64 every parity check passes (gpu_harness/checks/gpu_check.py).
# Zero columns of q and k add nothing to q k^T, to the state's other rows or to any gradient; zero columns of v
# give zero output columns and state columns, which are cut off. So when a backward pass will follow, smaller head
# dims are padded to this (the forward pass alone was right at 16 and 32, so evaluation runs unpadded).
MIN_TRAINED_HEAD_DIM = 64


def simple_gla(q, k, v, g, scale=None, *, cu_seqlens=None, initial_state=None, output_final_state=False):
    log_kernel_choice("simple_gla", "FLA's Triton kernels (Mamba2's SSD)")
    decoding = _decoding(q)
    fn = fused_recurrent_simple_gla if decoding else chunk_simple_gla
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g))
    pad_k = max(MIN_TRAINED_HEAD_DIM - key_dim, 0) if backward else 0
    pad_v = max(MIN_TRAINED_HEAD_DIM - value_dim, 0) if backward else 0
    if pad_k:
        scale = key_dim ** -0.5 if scale is None else scale  # FLA's default would see the padded width
        q, k = F.pad(q, (0, pad_k)), F.pad(k, (0, pad_k))
    if pad_v:
        v = F.pad(v, (0, pad_v))
    if initial_state is not None and (pad_k or pad_v):  # [N, H, K, V]
        initial_state = F.pad(initial_state, (0, pad_v, 0, pad_k))
    o, state = fn(q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if pad_v:
        o = o[..., :value_dim]
    if state is not None and (pad_k or pad_v):
        state = state[..., :key_dim, :value_dim].contiguous()
    return o, state


def causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state):
    return _fla_causal_conv1d(
        x=x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens,
        initial_state=initial_state, output_final_state=output_final_state,
    )


def rms_norm(x, weight, eps):
    return _fla_rms_norm(x, weight, None, eps=eps)


def add_rms_norm(x, residual, weight, eps):
    # FLA's prenorm form: one kernel returns the norm of x + residual and the sum itself; its backward adds the
    # sum's own gradient into the input gradient in the same pass
    return _fla_rms_norm(x, weight, None, residual=residual, eps=eps, prenorm=True)


def gated_rms_norm(x, gate, weight, eps, activation, norm_before_gate, group_size):
    if norm_before_gate and group_size in (None, x.shape[-1]):
        return _fla_rms_norm_gated(x, gate, weight, None, activation=activation, eps=eps)
    if activation not in ("swish", "silu"):
        raise ValueError("the grouped gated RMSNorm supports the swish gate only")
    return _fla_group_rmsnorm(x, weight, None, z=gate, eps=eps, group_size=group_size,
                              norm_before_gate=norm_before_gate)


def swiglu_linear(gate, up, weight):
    return _fla_swiglu_linear(gate, up, weight, None)


def attention(q, k, v, scale, cu_seqlens, rows):
    if cu_seqlens is None and q.shape[1] != k.shape[1]:  # decoding against a cache; a CP rank's run of queries
        return bottom_right_attention(q, k, v, scale)
    if cu_seqlens is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=k.shape[2] != q.shape[2],
        )
        return out.transpose(1, 2)
    return parallel_attn(q, k, v, scale=scale, cu_seqlens=cu_seqlens)  # grouped-query heads taken as they are


def bottom_right_attention(q, k, v, scale):
    """Causal attention of T queries that are the last T positions of S >= T keys, through SDPA's flash kernel
    (its causal mask is bottom-right aligned where T < S) or, where flash refuses (key and value widths unequal),
    the memory-efficient kernel; no [T, S] mask is built. Grouped key/value heads are repeated first: SDPA's flash
    call for this bias takes equal heads."""
    from torch.nn.attention.bias import causal_lower_right

    if k.shape[2] != q.shape[2]:
        k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=causal_lower_right(q.shape[1], k.shape[1]), scale=scale)
    return out.transpose(1, 2)


def kl_div(hidden, weight, t_hidden, t_weight, valid):
    """Summed KL(teacher || student) over the valid rows, from both models' hidden states and output weights: FLA's
    fused kernel (the logits formed a chunk at a time, the gradients computed in place). It averages over all the
    rows it is given: the rows that do not count are zeroed in both models (equal, uniform distributions: no KL
    and no gradient), which needs no host sync, and the mean is multiplied back by their number."""
    mask = valid.to(hidden.dtype).unsqueeze(1)
    mean = fused_kl_div_loss(hidden * mask, (t_hidden * mask.to(t_hidden.dtype)).detach(), weight,
                             t_weight.detach(), reduction="batchmean")
    return mean * hidden.shape[0]

"""Every compute kernel of the models, chosen in one place.

A tensor on a GPU (CUDA or ROCm: PyTorch calls both "cuda") goes to FLA's Triton kernels (``fla_backend``), or
to Triton kernels of our own where they are faster (the cross-entropy chunks, ``cross_entropy_triton``; the
short convolution of whole sequences, ``conv_triton``), or through torch.compile where the trainer asks for it;
anything else to the chunked PyTorch reference (``reference``), which computes the same algorithm. Model code
calls these functions and never chooses a kernel itself. ``use_reference_kernels()`` forces the reference on
any device, for parity checks. ``use_cuda_graphs()`` replays the recurrent mixers' FLA calls from CUDA graphs
(``cuda_graphs``; the calling layer passes itself as ``site``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from . import reference
from .cross_entropy import compile_chunks as compile_loss
from .cross_entropy import linear_cross_entropy
from .cross_entropy import use_triton_chunks as use_triton_loss

__all__ = [
    "gated_delta_rule", "kda", "simple_gla", "causal_conv1d", "short_conv", "rms_norm", "add_rms_norm",
    "gated_rms_norm", "swiglu_linear", "attention", "linear_cross_entropy", "compile_loss", "use_triton_loss",
    "use_triton_conv", "use_cuda_graphs", "compile_norms", "compile_swiglu", "use_reference_kernels",
    "backend_for",
]

_FORCE_REFERENCE = False
_COMPILED_NORMS = False
_COMPILED_SWIGLU = False
_TRITON_CONV = True
_CUDA_GRAPHS = False

# KDA's reference computes the per-channel decay between every pair of positions of a chunk: with chunks of 16
# that costs 16 x the key tensor, and stays exact however strong the decay (no exp(+gamma) is ever formed).
GDN_CHUNK = 64
KDA_CHUNK = 16


@contextlib.contextmanager
def use_reference_kernels():
    """Within this block every op runs the PyTorch reference, on any device."""
    global _FORCE_REFERENCE
    previous, _FORCE_REFERENCE = _FORCE_REFERENCE, True
    try:
        yield
    finally:
        _FORCE_REFERENCE = previous


@functools.cache
def _fla():
    from . import fla_backend

    return fla_backend


def backend_for(x: torch.Tensor) -> str:
    return "fla" if (x.is_cuda and not _FORCE_REFERENCE) else "torch"


def use_cuda_graphs(enable: bool = True) -> bool:
    """On GPUs, the recurrent mixers' FLA calls of whole sequences in training replayed from CUDA graphs, one
    pair per calling layer (``cuda_graphs``; the ops' ``site`` argument names the layer). Returns the previous
    setting."""
    global _CUDA_GRAPHS
    previous, _CUDA_GRAPHS = _CUDA_GRAPHS, enable
    return previous


def _fla_mixer(name: str, site, tensors: tuple, cu_seqlens, initial_state, output_final_state, *extra):
    """FLA's ``name`` op, through the site's CUDA graphs where they apply (whole sequences, no state)."""
    fn = getattr(_fla(), name)
    if _CUDA_GRAPHS and site is not None and cu_seqlens is None and initial_state is None and not output_final_state:
        from . import cuda_graphs

        return cuda_graphs.graphed_call(site, lambda *t: fn(*t, *extra, None, None, False)[0], *tensors), None
    return fn(*tensors, *extra, cu_seqlens, initial_state, output_final_state)


def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state=False,
                     site=None):
    """Gated DeltaNet core. q, k: [B, T, H, K] before their L2 norm; v: [B, T, HV, V]; a, b: [B, T, HV] raw gate
    and beta logits. decay = -exp(A_log) * softplus(a + dt_bias) (float32), beta = sigmoid(b). ``site``: any
    object naming the calling layer, for state the GPU path keeps per layer (CUDA graphs); ignored elsewhere."""
    if backend_for(q) == "fla":
        return _fla_mixer("gated_delta_rule", site, (q, k, v, a, b, A_log, dt_bias), cu_seqlens, initial_state,
                          output_final_state)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return reference.chunk_delta_rule(
        reference.l2norm(q.float()), reference.l2norm(k.float()), v, g, torch.sigmoid(b.float()),
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=GDN_CHUNK,
    )


def kda(q, k, v, a, b, A_log, dt_bias, cu_seqlens=None, initial_state=None, output_final_state=False, site=None):
    """Kimi Delta Attention core. As ``gated_delta_rule`` but a: [B, T, HV, K] (one decay per key channel),
    dt_bias: [HV * K]."""
    if backend_for(q) == "fla":
        return _fla_mixer("kda", site, (q, k, v, a, b, A_log, dt_bias), cu_seqlens, initial_state,
                          output_final_state)
    HV, K = a.shape[-2], a.shape[-1]
    g = -A_log.float().view(HV, 1).exp() * F.softplus(a.float() + dt_bias.float().view(HV, K))
    return reference.chunk_delta_rule(
        reference.l2norm(q.float()), reference.l2norm(k.float()), v, g, torch.sigmoid(b.float()),
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=KDA_CHUNK,
    )


def simple_gla(q, k, v, g, scale=None, cu_seqlens=None, initial_state=None, output_final_state=False, site=None):
    """Linear attention with a scalar log decay g: [B, T, H] per head (Mamba2's SSD with q=C, k=B, v=x*dt)."""
    if backend_for(q) == "fla":
        return _fla_mixer("simple_gla", site, (q, k, v, g), cu_seqlens, initial_state, output_final_state, scale)
    return reference.chunk_simple_gla(q, k, v, g.float(), scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def causal_conv1d(x, weight, bias=None, activation="silu", cu_seqlens=None, initial_state=None,
                  output_final_state=False):
    """Depthwise causal convolution. x: [B, T, D]; weight: [D, W]; states [N, D, W] (last W inputs)."""
    if backend_for(x) == "fla":
        return _fla().causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)
    return reference.causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)


def use_triton_conv(enable: bool = True) -> bool:
    """On GPUs, short convolutions of whole sequences in ``conv_triton``'s kernels (the default) or, off, FLA's.
    Returns the previous setting."""
    global _TRITON_CONV
    previous, _TRITON_CONV = _TRITON_CONV, enable
    return previous


def short_conv(x, weight, bias=None, activation="silu", sizes=None, cu_seqlens=None, initial_state=None,
               output_final_state=False):
    """``causal_conv1d`` with its output as one tensor per block of ``sizes`` channels (default: one), e.g. a
    mixer's q, k and v. Returns (outputs, final state or None). On GPUs, whole sequences without a state go to
    our kernels (``conv_triton``), which write each block as its own contiguous tensor (no copy when the
    recurrent kernels take them); packed documents, decoding and other devices get views of one output."""
    sizes = tuple(sizes) if sizes else (x.shape[-1],)
    # inside a sublayer that torch.compile traces whole (compile.components "model") FLA's kernel stays: ours
    # was not measured there
    if (_TRITON_CONV and backend_for(x) == "fla" and cu_seqlens is None and initial_state is None
            and not output_final_state and activation in (None, "silu", "swish")
            and not torch.compiler.is_compiling()):
        from . import conv_triton

        return list(conv_triton.short_conv(x, weight, bias, activation is not None, sizes)), None
    y, state = causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)
    return list(y.split(sizes, dim=-1)), state


def compile_norms(enable: bool = True) -> bool:
    """RMSNorm, and the residual add fused with it, through torch.compile on every device (the trainer's
    compile.components = ["norm"]) instead of FLA's kernel on GPUs / the eager reference elsewhere. Inductor's
    backward reads and writes each [tokens, dim] tensor at close to the memory's speed; FLA 0.6.0's row kernel
    ran at ~0.9 TB/s on an H200 (docs/benchmarks.md). Returns the previous setting. (torch.compile's default
    dynamic shapes: a new hidden size compiles once more, then the dims become symbolic.)"""
    global _COMPILED_NORMS
    previous, _COMPILED_NORMS = _COMPILED_NORMS, enable
    return previous


def _add_rms_norm_eager(x, residual, weight, eps):
    total = x + residual
    return reference.rms_norm(total, weight, eps), total


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


def _compiled_unless_tracing(fn):
    # inside a sublayer that torch.compile traces whole (compile.components "model"), Dynamo puts the plain
    # function into the enclosing graph; the cached compiled wrapper there only draws a warning
    return fn if torch.compiler.is_compiling() else _compiled(fn)


def rms_norm(x, weight, eps):
    if _COMPILED_NORMS and not _FORCE_REFERENCE:
        return _compiled_unless_tracing(reference.rms_norm)(x, weight, eps)
    if backend_for(x) == "fla":
        return _fla().rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    """(rms_norm(x + residual), x + residual): a pre-norm block's residual add and the next norm in one kernel
    (forward and backward), instead of a separate pass over the residual stream for the add."""
    if _COMPILED_NORMS and not _FORCE_REFERENCE:
        return _compiled_unless_tracing(_add_rms_norm_eager)(x, residual, weight, eps)
    if backend_for(x) == "fla":
        return _fla().add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm_eager(x, residual, weight, eps)


def gated_rms_norm(x, gate, weight, eps, activation="swish", norm_before_gate=True, group_size=None):
    if backend_for(x) == "fla":
        return _fla().gated_rms_norm(x, gate, weight, eps, activation, norm_before_gate, group_size)
    return reference.gated_rms_norm(x, gate, weight, eps, activation, norm_before_gate, group_size)


def compile_swiglu(enable: bool = True) -> bool:
    """SwiGLU's elementwise passes (forward, and the backward's, which forms silu(gate) * up again) through
    torch.compile on every device (the trainer's compile.components = ["swiglu"]) instead of FLA's kernels on
    GPUs / eager elsewhere. Returns the previous setting."""
    global _COMPILED_SWIGLU
    previous, _COMPILED_SWIGLU = _COMPILED_SWIGLU, enable
    return previous


def _swiglu_forward(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _swiglu_backward(gate, up, grad_h):
    """d gate, d up and h = silu(gate) * up again, from one pass over gate, up and the gradient of h."""
    g, u, dh = gate.float(), up.float(), grad_h.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    d_gate = dh * u * sig * (1 + g * (1 - sig))
    return d_gate.to(gate.dtype), (dh * silu).to(up.dtype), (silu * u).to(gate.dtype)


class _CompiledSwiGLULinear(torch.autograd.Function):
    """swiglu_linear with its elementwise passes compiled: saves gate and up, not the product."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return F.linear(_compiled_unless_tracing(_swiglu_forward)(gate, up), weight)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        grad_h = grad_out @ weight
        d_gate, d_up, h = _compiled_unless_tracing(_swiglu_backward)(gate, up, grad_h)
        d_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        return d_gate, d_up, d_weight


def swiglu_linear(gate, up, weight):
    """(silu(gate) * up) @ weight.T, without keeping silu(gate) * up for the backward pass: it is formed again
    there, in the same pass that computes the gradients of gate and up. Saves one [tokens, hidden] activation per
    MLP (a quarter of a 300M model's activation memory) for no extra matrix product."""
    if _COMPILED_SWIGLU and not _FORCE_REFERENCE:
        return _CompiledSwiGLULinear.apply(gate, up, weight)
    if backend_for(gate) == "fla":
        return _fla().swiglu_linear(gate, up, weight)
    return F.linear(F.silu(gate) * up, weight)


def attention(q, k, v, scale, cu_seqlens=None, rows=1):
    """Causal attention. q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; packed documents as ``cu_seqlens`` over a batch of
    one flattened from ``rows`` rows."""
    if backend_for(q) == "fla":
        return _fla().attention(q, k, v, scale, cu_seqlens, rows)
    return reference.causal_attention(q, k, v, scale, cu_seqlens, rows)

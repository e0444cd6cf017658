"""Every compute kernel of the models, chosen in one place from one ``KernelConfig`` given at build time.

    kernels = ops.Kernels(ops.KernelConfig(compiled_norms=True))     # the trainer builds it from the recipe
    model = build_model(args, kernels=kernels)                       # every module keeps it as ``self.ops``
    o, state = self.ops.gated_delta_rule(q, k, v, a, b, A_log, dt_bias)   # inside a mixer

A tensor on a GPU goes to FLA's Triton kernels (``fla_backend``). (CUDA and ROCm are both "cuda" to PyTorch.) Where our
own Triton kernels are faster, it goes to them instead: each cross-entropy chunk's softmax (``cross_entropy_triton``)
and the short convolution of whole sequences (``conv_triton``). Where the config asks for it, it goes through
torch.compile. Anything else goes to the chunked PyTorch reference (``reference``), which computes the same algorithm.
Model code calls these methods and never chooses a kernel itself.

Under context parallelism the models pass the rank's ``ContextShard`` down as ``context=``, as they pass ``cu_seqlens``.
The recurrences, short convolutions and attention then go through ``context_parallel``'s algorithms, which call these
same methods on the local tokens. The models hold no rank or collective logic.

The module-level functions (``ops.gated_delta_rule``, ...) are the default configuration's, for tests and tools."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from . import context_parallel, cross_entropy, kl_div, reference

__all__ = ["KernelConfig", "Kernels", "DEFAULT"]

# KDA's reference computes the per-channel decay between every pair of positions of a chunk. With chunks of 16
# that costs 16 x the key tensor, and it stays exact however strong the decay (no exp(+gamma) is ever formed).
GDN_CHUNK = 64
KDA_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs each op. CPU tensors always run the PyTorch reference, or torch.compile of it where
    asked. The choices below concern GPUs unless they say otherwise."""

    reference: bool = False
    """The PyTorch reference on every device (parity checks against the GPU kernels)"""

    fused_residual: bool = False
    """Each sublayer's residual add done inside the next RMSNorm's kernel (``add_rms_norm``): one pass over the
    residual stream less per sublayer, forward and backward"""

    compiled_norms: bool = False
    """RMSNorm, with the residual add fused into it, through torch.compile (any device) instead of FLA's kernel"""

    compiled_swiglu: bool = False
    """SwiGLU's elementwise passes, forward and backward, through torch.compile (any device) instead of FLA's"""

    compiled_loss: bool = False
    """The elementwise part of each cross-entropy chunk through torch.compile (any device)"""

    triton_loss: bool = True
    """Each cross-entropy chunk's softmax and gradient in our Triton kernel (off: eager PyTorch)"""

    triton_conv: bool = True
    """Short convolutions of whole sequences in our Triton kernels (off: FLA's)"""

    cuda_graphs: bool = False
    """The recurrent mixers' FLA calls of whole sequences replayed from CUDA graphs (hybridtitan.ops.cuda_graphs)"""

    fla_kl: bool = False
    """The distillation KL through FLA's fused kernel (temperature 1) instead of our chunked one with its Triton
    kernel"""

    gdn_backend: str = "triton"
    """FLA's backend for the gated delta rule: "triton" (its Triton kernels) or "flash_qla" (FlashQLA where
    installed and the call suits it)"""


@functools.cache
def _fla():
    from . import fla_backend

    return fla_backend


@functools.cache
def fla_available() -> bool:
    """Whether FLA's kernels (flash-linear-attention and Triton) import here. An export loaded where they are missing
    runs the PyTorch forms instead (hybridtitan.hf.modeling)."""
    try:
        _fla()
    except ImportError:
        return False
    return True


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


def _compiled_unless_tracing(fn):
    # inside a sublayer that torch.compile traces whole (compile.components "model"), Dynamo puts the plain
    # function into the enclosing graph. The cached compiled wrapper would only draw a warning there.
    return fn if torch.compiler.is_compiling() else _compiled(fn)


def _add_rms_norm_eager(x, residual, weight, eps):
    total = x + residual
    return reference.rms_norm(total, weight, eps), total


def _swiglu_forward(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _swiglu_backward(gate, up, grad_h):
    """d gate, d up, and h = silu(gate) * up again, from one pass over gate, up and the gradient of h."""
    g, u, dh = gate.float(), up.float(), grad_h.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    d_gate = dh * u * sig * (1 + g * (1 - sig))
    return d_gate.to(gate.dtype), (dh * silu).to(up.dtype), (silu * u).to(gate.dtype)


class _CompiledSwiGLULinear(torch.autograd.Function):
    """swiglu_linear with its elementwise passes compiled. It saves gate and up, not their product."""

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


class Kernels:
    """The ops of the models under one KernelConfig. Each method has the signature of its PyTorch reference."""

    def __init__(self, config: KernelConfig | None = None):
        self.config = config or KernelConfig()

    def __repr__(self) -> str:
        return f"Kernels({self.config})"

    def backend_for(self, x: torch.Tensor) -> str:
        """"fla" (the GPU kernels) or "torch" (the PyTorch reference) for an op on ``x``."""
        return "fla" if (x.is_cuda and not self.config.reference) else "torch"

    # ---- context parallelism

    def whole_sequence(self, x, context=None):
        """``x`` [B, L, ...] itself, or, under context parallelism, the whole sequence [B, T, ...] of every rank's part,
        in order, with autograd. ``context`` is the rank's ContextShard. Attention uses this for its keys and values, or
        for the MLA latent they are formed from."""
        return x if context is None else context_parallel.gather_sequence(x, context)

    @staticmethod
    def _under_context(name, cu_seqlens, initial_state, output_final_state) -> None:
        if cu_seqlens is not None or initial_state is not None or output_final_state:
            raise ValueError(f"{name} under context parallelism takes the shard's boundaries and states from its "
                             "context: no cu_seqlens, initial_state or final state (decoding runs without CP)")

    # ---- the recurrent mixers

    def _fla_mixer(self, name: str, site, tensors: tuple, cu_seqlens, initial_state, output_final_state, *extra,
                   **options):
        """FLA's ``name`` op. It runs through the site's CUDA graphs where they apply: whole sequences with no state."""
        fn = functools.partial(getattr(_fla(), name), **options) if options else getattr(_fla(), name)
        if (self.config.cuda_graphs and site is not None and cu_seqlens is None and initial_state is None
                and not output_final_state):
            from . import cuda_graphs

            return cuda_graphs.graphed_call(site, lambda *t: fn(*t, *extra)[0], *tensors), None
        return fn(*tensors, *extra, cu_seqlens=cu_seqlens, initial_state=initial_state,
                  output_final_state=output_final_state)

    def gated_delta_rule(self, q, k, v, a, b, A_log, dt_bias, *, cu_seqlens=None, initial_state=None,
                         output_final_state=False, site=None, context=None):
        """The Gated DeltaNet core.

        q and k are [B, T, H, K], before their L2 norm. v is [B, T, HV, V]. a and b are [B, T, HV], the raw gate and
        beta logits. decay = -exp(A_log) * softplus(a + dt_bias) in float32, and beta = sigmoid(b).

        ``site`` is the calling layer. The GPU path keeps state per layer (CUDA graphs) under it; other paths ignore it.
        ``context`` is the rank's ContextShard under context parallelism; the tensors are then its local part."""
        if context is not None:
            self._under_context("gated_delta_rule", cu_seqlens, initial_state, output_final_state)
            return context_parallel.cp_gated_delta_rule(self, context, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias)
        if self.backend_for(q) == "fla":
            return self._fla_mixer("gated_delta_rule", site, (q, k, v, a, b, A_log, dt_bias), cu_seqlens,
                                   initial_state, output_final_state, backend=self.config.gdn_backend)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        return reference.chunk_delta_rule(
            reference.l2norm(q.float()), reference.l2norm(k.float()), v, g, torch.sigmoid(b.float()),
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_size=GDN_CHUNK,
        )

    def kda(self, q, k, v, a, b, A_log, dt_bias, *, cu_seqlens=None, initial_state=None, output_final_state=False,
            site=None, context=None):
        """The Kimi Delta Attention core. As ``gated_delta_rule``, but a is [B, T, HV, K] (one decay per key channel)
        and dt_bias is [HV * K]."""
        if context is not None:
            self._under_context("kda", cu_seqlens, initial_state, output_final_state)
            return context_parallel.cp_kda(self, context, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias)
        if self.backend_for(q) == "fla":
            return self._fla_mixer("kda", site, (q, k, v, a, b, A_log, dt_bias), cu_seqlens, initial_state,
                                   output_final_state)
        HV, K = a.shape[-2], a.shape[-1]
        g = -A_log.float().view(HV, 1).exp() * F.softplus(a.float() + dt_bias.float().view(HV, K))
        return reference.chunk_delta_rule(
            reference.l2norm(q.float()), reference.l2norm(k.float()), v, g, torch.sigmoid(b.float()),
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_size=KDA_CHUNK,
        )

    def simple_gla(self, q, k, v, g, scale=None, *, cu_seqlens=None, initial_state=None, output_final_state=False,
                   site=None, context=None):
        """Linear attention with a scalar log decay g [B, T, H] per head. This is Mamba2's SSD with q=C, k=B, v=x*dt."""
        if context is not None:
            self._under_context("simple_gla", cu_seqlens, initial_state, output_final_state)
            return context_parallel.cp_simple_gla(self, context, q, k, v, g, scale=scale)
        if self.backend_for(q) == "fla":
            return self._fla_mixer("simple_gla", site, (q, k, v, g), cu_seqlens, initial_state, output_final_state,
                                   scale)
        return reference.chunk_simple_gla(q, k, v, g.float(), scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    # ---- convolutions

    def causal_conv1d(self, x, weight, bias=None, activation="silu", *, cu_seqlens=None, initial_state=None,
                      output_final_state=False, context=None):
        """Depthwise causal convolution. x is [B, T, D], weight is [D, W], and states are [N, D, W] (the last W inputs).
        """
        if context is not None:
            self._under_context("causal_conv1d", cu_seqlens, initial_state, output_final_state)
            return context_parallel.cp_causal_conv1d(self, context, x, weight, bias, activation)
        if self.backend_for(x) == "fla":
            return _fla().causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)
        return reference.causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)

    def short_conv(self, x, weight, bias=None, activation="silu", sizes=None, *, cu_seqlens=None, initial_state=None,
                   output_final_state=False, context=None):
        """``causal_conv1d`` with its output as one tensor per block of ``sizes`` channels (default: one block), such as
        a mixer's q, k and v. Returns (outputs, final state or None).

        On GPUs, whole sequences without a state go to our kernels (``conv_triton``). They write each block as its own
        contiguous tensor, so the recurrent kernels take them without a copy. Packed documents, decoding and other
        devices get views of one output."""
        if context is not None:
            self._under_context("short_conv", cu_seqlens, initial_state, output_final_state)
            return context_parallel.cp_short_conv(self, context, x, weight, bias, activation, sizes)
        sizes = tuple(sizes) if sizes else (x.shape[-1],)
        # inside a sublayer that torch.compile traces whole (compile.components "model"), FLA's kernel runs: ours
        # is not measured there
        if (self.config.triton_conv and self.backend_for(x) == "fla" and cu_seqlens is None
                and initial_state is None and not output_final_state and activation in (None, "silu", "swish")
                and not torch.compiler.is_compiling()):
            from . import conv_triton

            return list(conv_triton.short_conv(x, weight, bias, activation is not None, sizes)), None
        y, state = self.causal_conv1d(x, weight, bias, activation, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                       output_final_state=output_final_state)
        return list(y.split(sizes, dim=-1)), state

    # ---- norms

    def _compiles_norms(self) -> bool:
        return self.config.compiled_norms and not self.config.reference

    def rms_norm(self, x, weight, eps):
        if self._compiles_norms():
            return _compiled_unless_tracing(reference.rms_norm)(x, weight, eps)
        if self.backend_for(x) == "fla":
            return _fla().rms_norm(x, weight, eps)
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        """(rms_norm(x + residual), x + residual).

        With ``fused_residual``, a pre-norm block's residual add and the next norm run in one kernel, forward and
        backward. Otherwise the add is a pass of its own over the residual stream."""
        if not self.config.fused_residual:
            total = x + residual
            return self.rms_norm(total, weight, eps), total
        if self._compiles_norms():
            return _compiled_unless_tracing(_add_rms_norm_eager)(x, residual, weight, eps)
        if self.backend_for(x) == "fla":
            return _fla().add_rms_norm(x, residual, weight, eps)
        return _add_rms_norm_eager(x, residual, weight, eps)

    def gated_rms_norm(self, x, gate, weight, eps, activation="swish", norm_before_gate=True, group_size=None):
        if self.backend_for(x) == "fla":
            return _fla().gated_rms_norm(x, gate, weight, eps, activation, norm_before_gate, group_size)
        return reference.gated_rms_norm(x, gate, weight, eps, activation, norm_before_gate, group_size)

    # ---- the MLP, attention, the loss

    def swiglu_linear(self, gate, up, weight):
        """(silu(gate) * up) @ weight.T, without keeping silu(gate) * up for the backward pass.

        The backward forms the product again, in the same pass that computes the gradients of gate and up. This saves
        one [tokens, hidden] activation per MLP, about a quarter of a 300M model's activation memory, for no extra
        matrix product."""
        if self.config.compiled_swiglu and not self.config.reference:
            return _CompiledSwiGLULinear.apply(gate, up, weight)
        if self.backend_for(gate) == "fla":
            return _fla().swiglu_linear(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight)

    def attention(self, q, k, v, scale, *, cu_seqlens=None, rows=1, key_mask=None, context=None):
        """Causal attention.

        q is [B, T, H, Dk]. k is [B, S, Hk, Dk] and v is [B, S, Hk, Dv], with Hk dividing H (grouped-query heads). When
        decoding, S > T and the queries are the last T positions. Packed documents come as ``cu_seqlens`` over a batch
        of one, flattened from ``rows`` rows. ``key_mask`` [B, S] marks the keys that exist, for left-padded rows.

        ``context`` is the rank's ContextShard. Then q holds its local queries, and k and v the whole sequence's
        (``whole_sequence``)."""
        if context is not None:
            if cu_seqlens is not None or key_mask is not None:
                raise ValueError("attention under context parallelism takes the documents from its context: no "
                                 "cu_seqlens or key_mask")
            return context_parallel.cp_attention(self, context, q, k, v, scale)
        if self.backend_for(q) == "fla" and key_mask is None:
            return _fla().attention(q, k, v, scale, cu_seqlens, rows)
        return reference.causal_attention(q, k, v, scale, cu_seqlens, rows, key_mask=key_mask)

    def linear_cross_entropy(self, hidden, weight, targets, ignore_index: int = -100, chunk_size: int = 4096):
        """The summed cross-entropy of ``hidden @ weight.T`` and the number of counted targets, never holding all the
        logits (``cross_entropy``). Each chunk's elementwise part is compiled, runs in our Triton kernel (GPUs), or runs
        eagerly."""
        if self.config.reference:
            chunk_fn = cross_entropy.chunk_loss_and_grad
        elif self.config.compiled_loss:
            chunk_fn = cross_entropy.compiled_chunk_loss_and_grad()
        elif self.config.triton_loss and hidden.is_cuda:
            from . import cross_entropy_triton

            chunk_fn = cross_entropy_triton.chunk_loss_and_grad
        else:
            chunk_fn = cross_entropy.chunk_loss_and_grad
        return cross_entropy.linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index,
                                                  chunk_size=chunk_size, chunk_fn=chunk_fn)


    def linear_kl_div(self, hidden, weight, t_hidden, t_weight, targets, *, temperature: float = 1.0,
                      kl_weight: float = 1.0, ce_weight: float = 0.0, ignore_index: int = -100, chunk_size: int = 1024):
        """(loss, summed KL_T, summed cross-entropy, counted tokens) of a student's hidden states and output weight
        against a teacher's, one chunk of tokens at a time (``kl_div``). loss = kl_weight * T^2 * KL_T + ce_weight * CE.

        Each chunk's elementwise part runs in our Triton kernel on GPUs (``kl_div_triton``), and compiled or eagerly
        elsewhere. With ``fla_kl``, on GPUs at temperature 1, FLA's fused KL runs instead; the cross-entropy, where
        weighted, is still ours."""
        on_gpu = self.backend_for(hidden) == "fla"
        if (on_gpu and self.config.fla_kl and temperature == 1 and torch.is_grad_enabled()
                and (hidden.requires_grad or weight.requires_grad)):
            h, th = hidden.reshape(-1, hidden.shape[-1]), t_hidden.reshape(-1, t_hidden.shape[-1])
            t = targets.reshape(-1)
            valid = t != ignore_index
            kl = _fla().kl_div(h, weight, th.to(h.dtype), t_weight.to(weight.dtype), valid)
            loss, ce = kl_weight * kl, torch.zeros((), device=h.device)
            if ce_weight:
                ce, _ = self.linear_cross_entropy(h, weight, t, ignore_index=ignore_index, chunk_size=chunk_size)
                loss = loss + ce_weight * ce
            return loss, kl.detach(), ce.detach(), valid.sum()
        if self.config.compiled_loss and not self.config.reference:
            chunk_fn = kl_div.compiled_kl_chunk()
        elif on_gpu and self.config.triton_loss:
            from . import kl_div_triton

            chunk_fn = kl_div_triton.kl_chunk if kl_div_triton.applies(temperature, ce_weight) else kl_div.kl_chunk
        else:
            chunk_fn = kl_div.kl_chunk
        return kl_div.linear_kl_div(hidden, weight, t_hidden, t_weight, targets, temperature=temperature,
                                     kl_weight=kl_weight, ce_weight=ce_weight, ignore_index=ignore_index,
                                     chunk_size=chunk_size, chunk_fn=chunk_fn)


DEFAULT = Kernels()

# the default configuration's ops as functions, for tests and tools
gated_delta_rule, kda, simple_gla = DEFAULT.gated_delta_rule, DEFAULT.kda, DEFAULT.simple_gla
causal_conv1d, short_conv = DEFAULT.causal_conv1d, DEFAULT.short_conv
rms_norm, add_rms_norm, gated_rms_norm = DEFAULT.rms_norm, DEFAULT.add_rms_norm, DEFAULT.gated_rms_norm
swiglu_linear, attention, linear_cross_entropy = DEFAULT.swiglu_linear, DEFAULT.attention, DEFAULT.linear_cross_entropy
linear_kl_div = DEFAULT.linear_kl_div
backend_for = DEFAULT.backend_for

"""HybridLM: embedding, one pre-norm residual sublayer per pattern symbol, final RMSNorm, LM head.

Plain nn.Modules: no device, parallelism or kernel choice here (parallel.py wraps the sublayers from outside;
hybridtitan.ops picks the kernels). Build on the meta device, move to a device with ``to_empty``, then call
``init_weights``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridtitan import ops

from .args import ModelArgs
from .common import GatedRMSNorm, RMSNorm, ShortConvolution, SwiGLU
from .gdn import GatedDeltaNet
from .kda import KimiDeltaAttention
from .mamba2 import Mamba2
from .mla import MultiLatentAttention

MIXER_CLASSES = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2}


class Sublayer(nn.Module):
    """A pre-norm residual sublayer, x -> x + f(RMSNorm(x)), f one of: MLA attention ('attention'), the mixer
    ('mixer'), SwiGLU ('mlp').

    The residual add is done one sublayer late, inside the next norm's kernel: ``forward(x, delta)`` takes the
    residual stream and the previous sublayer's output not yet added to it, and returns the stream with it added
    and this sublayer's own output f(RMSNorm(x + delta)). The stack's result is the last pair's sum. That saves
    a pass over the stream per sublayer, forward and backward (the add's gradient joins the norm's backward).
    A sublayer under activation checkpointing keeps its inputs for the recomputation: it gets the stream with
    the add already done (``fuse_residual_add = False``), one saved tensor instead of two."""

    def __init__(self, kind: str, args: ModelArgs):
        super().__init__()
        self.kind = kind
        self.fuse_residual_add = True  # hybridtitan.parallel turns it off for checkpointed sublayers
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        if kind == "attention":
            self.attn = MultiLatentAttention(args.dim, args.mla, args.norm_eps)
        elif kind == "mixer":
            mixer_args = getattr(args, args.mixer)
            self.mixer = MIXER_CLASSES[args.mixer](args.dim, mixer_args, args.norm_eps)
        elif kind == "mlp":
            self.mlp = SwiGLU(args.dim, args.ffn_dim)
        else:
            raise ValueError(f"unknown sublayer kind {kind!r}")

    @property
    def body(self) -> nn.Module:
        return getattr(self, {"attention": "attn", "mixer": "mixer", "mlp": "mlp"}[self.kind])

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None, cu_seqlens=None, cache=None,
                rows: int = 1) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(x + delta, f(RMSNorm(x + delta))). Without a delta (the first sublayer): (None, f(RMSNorm(x))), the
        stream being x unchanged (handing back the input itself would, through FSDP2's hooks, return a view of it)."""
        if delta is None:
            return None, self.body(self.norm(x), cu_seqlens=cu_seqlens, cache=cache, rows=rows)
        normed, x = self.norm(x, residual=delta)
        return x, self.body(normed, cu_seqlens=cu_seqlens, cache=cache, rows=rows)


class InferenceCache:
    """Per-sublayer state for decoding: convolution windows, recurrent states, MLA latents."""

    def __init__(self, n_layers: int):
        self.layers: list[dict] = [{} for _ in range(n_layers)]

    def layer(self, i: int) -> dict:
        return self.layers[i]

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search); every state has the batch first."""
        for state in self.layers:
            for key, value in state.items():
                state[key] = value.index_select(0, index.to(value.device))


class HybridLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Sublayer(kind, args) for kind in args.kinds)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embeddings.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(self, input_ids: torch.Tensor, cu_seqlens=None, cache: InferenceCache | None = None,
                      collect: list | None = None):
        """Final-normed hidden states [B, T, D]. With ``cu_seqlens`` (boundaries over the B * T tokens, rows
        included), documents are isolated: no state or attention crosses a boundary. A ``collect`` list receives
        the residual stream entering each layer, then the final-normed states (transformers' hidden_states)."""
        B, T = input_ids.shape
        h, delta = self.embeddings(input_ids), None
        rows = 1
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.long()  # once per forward: the kernels index with it (loaders give int32)
            if B > 1:
                h, rows = h.reshape(1, B * T, -1), B
        for i, layer in enumerate(self.layers):
            if delta is not None and not layer.fuse_residual_add:
                h, delta = h + delta, None
            if collect is not None:
                collect.append((h if delta is None else h + delta).view(B, T, -1))
            stream, delta = layer(h, delta, cu_seqlens=cu_seqlens,
                                  cache=cache.layer(i) if cache is not None else None, rows=rows)
            h = h if stream is None else stream
        out = self.norm(h) if delta is None else self.norm(h, residual=delta)[0]
        if collect is not None:
            collect.append(out.view(B, T, -1))
        return out.view(B, T, -1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, cu_seqlens=None,
                cache: InferenceCache | None = None, ignore_index: int = -100,
                loss_chunk_size: int = 4096) -> torch.Tensor:
        """Mean cross-entropy over the counted labels if ``labels`` are given (the logits are formed
        ``loss_chunk_size`` tokens at a time, never whole), else the logits [B, T, V] in float32."""
        h = self.hidden_states(input_ids, cu_seqlens=cu_seqlens, cache=cache)
        if labels is None:
            return (h @ self.output_weight.t()).float()
        loss_sum, count = ops.linear_cross_entropy(h, self.output_weight, labels, ignore_index=ignore_index,
                                                   chunk_size=loss_chunk_size)
        return loss_sum / count.clamp(min=1)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The reference initialisation of every module (see ``init_module``)."""
        for module in self.modules():
            init_module(module, self.args.init_std)


@torch.no_grad()
def init_module(module: nn.Module, std: float) -> None:
    """The reference initialisation of one module's own parameters: N(0, std) for every matrix and convolution
    (the output layer too), zero biases, unit norms; A_log, dt_bias and D as each mixer specifies."""
    if isinstance(module, (nn.Linear, nn.Embedding, ShortConvolution)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (RMSNorm, GatedRMSNorm)):
        module.reset_parameters()
    if hasattr(module, "init_special"):
        module.init_special()


def build_model(args: ModelArgs, device: str | torch.device = "meta") -> HybridLM:
    with torch.device(device):
        return HybridLM(args)

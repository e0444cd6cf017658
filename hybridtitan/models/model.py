"""HybridLM: embedding, one pre-norm residual sublayer per pattern symbol, final RMSNorm, LM head.

    h_0 = E[input_ids]
    h_i = h_{i-1} + f_i(RMSNorm_i(h_{i-1}))      f_i: attention ('*'), the mixer ('M') or SwiGLU ('-')
    logits = RMSNorm(h_n) W_out^T                (W_out = E with tied embeddings)

Each sublayer hands on the stream as a pair whose sum it is, (f_i(...), h_{i-1}). The next sublayer's norm adds them
(FLA's ``norm(h, residual, prenorm=True)``), so the add and the norm can be one kernel.

The modules are plain nn.Modules, with no device, parallelism or kernel choice here. hybridtitan.parallel wraps the
sublayers from outside, and the ``kernels`` given at build time pick every kernel (hybridtitan.ops). Build on the meta
device, move to a device with ``to_empty``, then call ``init_weights``."""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence

import torch
import torch.nn as nn

from hybridtitan import ops
from hybridtitan.ops import Kernels

from .args import ModelArgs
from .gdn import GatedDeltaNet
from .gqa import GroupedQueryAttention
from .kda import KimiDeltaAttention
from .mamba2 import Mamba2
from .mla import MultiLatentAttention
from .modules import GatedRMSNorm, RMSNorm, ShortConvolution, SwiGLU

MIXER_CLASSES = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2}
BODY_NAMES = {"attention": "attn", "mixer": "mixer", "mlp": "mlp"}


class Sublayer(nn.Module):
    """A pre-norm residual sublayer, x -> x + f(RMSNorm(x)). f is the attention ('attention': MLA, or grouped-query
    attention where model.attention is "gqa"), the mixer ('mixer'), or SwiGLU ('mlp')."""

    def __init__(self, kind: str, args: ModelArgs, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, kernels=kernels)
        if kind == "attention" and args.attention == "gqa":
            self.attn = GroupedQueryAttention(args.dim, args.gqa, kernels)
        elif kind == "attention":
            self.attn = MultiLatentAttention(args.dim, args.mla, args.norm_eps, kernels)
        elif kind == "mixer":
            self.mixer = MIXER_CLASSES[args.mixer](args.dim, getattr(args, args.mixer), args.norm_eps, kernels)
        elif kind == "mlp":
            self.mlp = SwiGLU(args.dim, args.ffn_dim, kernels)
        else:
            raise ValueError(f"unknown sublayer kind {kind!r}")

    @property
    def body(self) -> nn.Module:
        """f: the attention, mixer or MLP."""
        return getattr(self, BODY_NAMES[self.kind])

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None = None, cu_seqlens=None, cache=None,
                rows: int = 1, context=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x = h + residual (h alone where ``residual`` is None) -> (f(RMSNorm(x)), x). The output is their sum."""
        normed, residual = self.norm(h, residual, prenorm=True)
        return self.body(normed, cu_seqlens=cu_seqlens, cache=cache, rows=rows, context=context), residual


class LayerState(MutableMapping):
    """One sublayer's decoding state (convolution window, recurrent state, MLA latents), as a mapping that is not a
    dict. FSDP2's pre-forward rebuilds every dict among a sharded module's arguments, to cast their tensors for mixed
    precision. What a sublayer wrote into a dict would then be lost, and each decoding step would see no state."""

    def __init__(self):
        self._state: dict = {}

    def __getitem__(self, key):
        return self._state[key]

    def __setitem__(self, key, value):
        self._state[key] = value

    def __delitem__(self, key):
        del self._state[key]

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)


class StreamRecord(MutableSequence):
    """A list for ``collect`` (the residual stream at each sublayer) that is not a list. FSDP2's pre-forward rebuilds
    every list among a sharded module's arguments, so what the forward appended to a list would be lost."""

    def __init__(self):
        self._items: list = []

    def __getitem__(self, i):
        return self._items[i]

    def __setitem__(self, i, value):
        self._items[i] = value

    def __delitem__(self, i):
        del self._items[i]

    def __len__(self):
        return len(self._items)

    def insert(self, i, value):
        self._items.insert(i, value)


class InferenceCache:
    """Per-sublayer state for decoding: convolution windows, recurrent states, MLA latents."""

    def __init__(self, n_layers: int):
        self.layers: list[LayerState] = [LayerState() for _ in range(n_layers)]

    def layer(self, i: int) -> LayerState:
        return self.layers[i]

    @staticmethod
    def stack(caches: list[InferenceCache]) -> InferenceCache:
        """One batched cache from the caches of rows decoded apart.

        The rows are prompts of other lengths, each fed alone so that no padding enters a recurrent state, a convolution
        window or attention. Their states are stacked. The attention's cached sequences of other lengths are
        left-padded, with a ``key_mask`` of the real positions, which the attention sublayers honour from then on."""
        out = InferenceCache(len(caches[0].layers))
        for i, state in enumerate(out.layers):
            rows = [c.layers[i] for c in caches]
            lengths = None
            for key in rows[0]:
                values = [r[key] for r in rows]
                if all(v.shape == values[0].shape for v in values):
                    state[key] = torch.cat(values, dim=0)
                    continue
                longest = max(v.shape[1] for v in values)  # a sequence: left-padded to the longest
                state[key] = torch.cat([torch.cat([v.new_zeros(v.shape[0], longest - v.shape[1], *v.shape[2:]), v],
                                                  dim=1) for v in values], dim=0)
                lengths = [v.shape[1] for v in values]
            if lengths is not None:
                positions = torch.arange(max(lengths), device=state[key].device)
                state["key_mask"] = torch.stack([positions >= max(lengths) - n for n in lengths])
        return out

    def reorder(self, index: torch.Tensor) -> None:
        """Selects batch rows (beam search). Every state has the batch first."""
        for state in self.layers:
            for key, value in state.items():
                state[key] = value.index_select(0, index.to(value.device))


class HybridLM(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels = ops.DEFAULT):
        super().__init__()
        self.args, self.ops = args, kernels
        self.embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Sublayer(kind, args, kernels) for kind in args.kinds)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, kernels=kernels)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embeddings.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(self, input_ids: torch.Tensor, cu_seqlens=None, cache: InferenceCache | None = None,
                      collect: list | None = None, context=None) -> torch.Tensor:
        """The final-normed hidden states [B, T, D].

        With ``cu_seqlens`` (boundaries over the B * T tokens, rows included) the documents are isolated: no state or
        attention crosses a boundary. A ``collect`` list receives the residual stream entering each sublayer, then the
        final-normed states (transformers' hidden_states).

        ``context`` is this rank's context-parallel shard (hybridtitan.ops.context_parallel.ContextShard). Then
        ``input_ids`` are the rank's part of the rows; for a packed batch, its part of the rows flattened into one. The
        documents are the shard's (no ``cu_seqlens``), and every sublayer gets the shard."""
        B, T = input_ids.shape
        h, residual, rows = self.embeddings(input_ids), None, 1
        if context is not None and (cu_seqlens is not None or cache is not None):
            raise ValueError("a context-parallel forward takes its documents from the context: no cu_seqlens, and no "
                             "decoding cache")
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.long()  # once per forward: the kernels index with it (loaders give int32)
            if B > 1:  # packed documents: one row of B * T tokens, the rows' starts among the boundaries
                h, rows = h.reshape(1, B * T, -1), B
        for i, layer in enumerate(self.layers):
            if collect is not None:
                collect.append((h if residual is None else h + residual).view(B, T, -1))
            h, residual = layer(h, residual, cu_seqlens=cu_seqlens, cache=cache.layer(i) if cache is not None else None,
                                rows=rows, context=context)
        out = self.norm(h, residual).view(B, T, -1)
        if collect is not None:
            collect.append(out)
        return out

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, cu_seqlens=None,
                cache: InferenceCache | None = None, ignore_index: int = -100, loss_chunk_size: int = 4096,
                reduction: str = "mean", head=None, collect: list | None = None, context=None):
        """The logits [B, T, V] in float32, or, given ``labels``, the cross-entropy over the counted labels.

        With labels, the logits are formed ``loss_chunk_size`` tokens at a time, never whole. The result is the mean
        loss, or with ``reduction="sum"`` the pair (summed loss, count). The trainer uses the sum and divides by the
        count of its whole step.

        ``head`` is a function of the final hidden states and the output weight whose result is returned instead, such
        as a distillation loss (hybridtitan.distill). ``collect`` and ``context`` are as in ``hidden_states``; under
        context parallelism the labels, like the inputs, are the rank's part."""
        h = self.hidden_states(input_ids, cu_seqlens=cu_seqlens, cache=cache, collect=collect, context=context)
        if head is not None:
            return head(h, self.output_weight)
        if labels is None:
            return (h @ self.output_weight.t()).float()
        loss_sum, count = self.ops.linear_cross_entropy(h, self.output_weight, labels, ignore_index=ignore_index,
                                                        chunk_size=loss_chunk_size)
        return (loss_sum, count) if reduction == "sum" else loss_sum / count.clamp(min=1)

    def blocks(self) -> list[range]:
        """The sublayers grouped as layer distillation compares them: each token-mixing sublayer (attention or mixer)
        with the MLPs after it. A Llama layer is one block: attention, then MLP."""
        starts = [i for i, layer in enumerate(self.layers) if layer.kind != "mlp"]
        if not starts or starts[0] != 0:
            raise ValueError(f"pattern {self.args.pattern!r}: layer distillation needs a token-mixing sublayer first")
        return [range(s, e) for s, e in zip(starts, [*starts[1:], len(self.layers)])]

    def teacher_forced(self, streams: list[torch.Tensor], cu_seqlens=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer distillation's forward (Zebra-Llama's).

        Each block (``blocks``) is fed the residual stream that enters it in another model. ``streams`` is that model's
        ``hidden_states(collect=...)``, [B, T, D] per sublayer. For each block it returns the block's output as
        ``collect`` records it (the stream entering the next sublayer; after the last block, the final-normed states),
        and its token-mixing sublayer's output f(norm(x)). Each is [B, T, D]."""
        B, T, _ = streams[0].shape
        rows = B if cu_seqlens is not None and B > 1 else 1
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.long()
        out = []
        for block in self.blocks():
            x = streams[block.start].reshape(1, B * T, -1) if rows > 1 else streams[block.start]
            h, residual = self.layers[block.start](x, cu_seqlens=cu_seqlens, rows=rows)
            mixed = h  # the token-mixing sublayer's f(norm(x))
            for i in block[1:]:
                h, residual = self.layers[i](h, residual, cu_seqlens=cu_seqlens, rows=rows)
            y = h + residual if block.stop < len(self.layers) else self.norm(h, residual)
            out.append((y.view(B, T, -1), mixed.view(B, T, -1)))
        return out

    @torch.no_grad()
    def init_weights(self) -> None:
        """The reference initialisation of every module (see ``init_module``)."""
        for module in self.modules():
            init_module(module, self.args.init_std)


@torch.no_grad()
def init_module(module: nn.Module, std: float) -> None:
    """The reference initialisation of one module's own parameters: N(0, std) for every matrix and convolution (the
    output layer too), zero biases, and unit norms. A_log, dt_bias and D are set as each mixer specifies."""
    if isinstance(module, (nn.Linear, nn.Embedding, ShortConvolution)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (RMSNorm, GatedRMSNorm)):
        module.reset_parameters()
    if hasattr(module, "init_special"):
        module.init_special()


def build_model(args: ModelArgs, device: str | torch.device = "meta", kernels: Kernels = ops.DEFAULT) -> HybridLM:
    with torch.device(device):
        return HybridLM(args, kernels)

"""The residual add of each pre-norm sublayer, done inside the next sublayer's RMSNorm kernel.

A stack of pre-norm sublayers computes ``x = x + f(norm(x))`` again and again. Written so, each sublayer ends
with an add (a pass over the [tokens, dim] stream) and the next begins with a norm (another); in the backward
pass the stream's gradient is summed once more. FLA's models fuse the two: the norm takes the residual and
returns both the sum and its norm, from one kernel whose backward adds the sum's own gradient in the same pass
(``Kernels.add_rms_norm``). The sums are the same numbers; only the passes differ.

``fuse_residual_adds`` swaps each sublayer of a built model for a ``FusedResidualSublayer`` that holds the same
children (so the same parameter names and checkpoints) and carries the stream to the next one as a pair
(x, branch) whose sum the stream is, the add not yet done:

    x, branch  ->  x, normed = norm(branch, residual=x)  ->  (x, f(normed))

A sublayer under activation checkpointing keeps its inputs for the recomputation, and one tensor is less memory
than a pair: it is left as it is, and the sublayer before it hands on the stream summed. So does the last one.
"""

from __future__ import annotations

import torch.nn as nn


class FusedResidualSublayer(nn.Module):
    """``sublayer``'s x -> x + f(norm(x)) with the add left to the next norm (see the module docstring).
    ``sublayer``: a pre-norm sublayer with children ``norm`` (an RMSNorm that takes a residual) and ``body``."""

    def __init__(self, sublayer: nn.Module, hand_on_pair: bool):
        super().__init__()
        for name, child in sublayer.named_children():
            self.add_module(name, child)
        self.kind = getattr(sublayer, "kind", None)
        self.body_name = next(name for name, child in sublayer.named_children() if child is sublayer.body)
        self.hand_on_pair = hand_on_pair

    @property
    def body(self) -> nn.Module:
        return getattr(self, self.body_name)

    def forward(self, x, **kwargs):
        if isinstance(x, tuple):  # (stream, branch): the previous sublayer's add is done here, in the norm
            stream, branch = x
            normed, stream = self.norm(branch, residual=stream)
        else:
            stream, normed = x, self.norm(x)
        out = self.body(normed, **kwargs)
        return (stream, out) if self.hand_on_pair else stream + out


def fuse_residual_adds(layers: nn.ModuleList, fusable) -> None:
    """Swaps, in place, every sublayer of ``layers`` for which ``fusable(layer)`` holds for its fused form; one
    followed by another fused sublayer hands on the pair, the others the sum."""
    chosen = [fusable(layer) for layer in layers]
    for i, layer in enumerate(layers):
        if chosen[i]:
            layers[i] = FusedResidualSublayer(layer, hand_on_pair=i + 1 < len(layers) and chosen[i + 1])


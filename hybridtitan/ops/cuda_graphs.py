"""The recurrent mixers' FLA calls replayed from CUDA graphs: one call's ~20 kernel launches for the price of one.

Why: a chunked gated delta rule or KDA call is FLA's Python around ~20 Triton launches, which at small
micro-batches costs the host more time than the GPU spends on the work: the host's launches then set the step's
pace, and a replayed graph is one launch. Where the GPU sets the pace (the recipes' micro-batches) it saves
nothing and costs memory, hence ``training.cuda_graphs``, off by default (docs/findings.md has the numbers).

How: per call site (a layer: ``site``, held weakly) and per input signature (shapes, strides, dtypes, which
inputs need gradients), the call's forward and backward are captured once, after a warm-up that lets FLA's
autotuning run outside the capture. Each call then copies its inputs into the graph's own input tensors,
replays the forward graph and returns the graph's output; its backward copies the output's gradient in and
replays the backward graph. The graph keeps what its backward needs (it never frees the captured forward's saved
tensors), so each layer owns its inputs, outputs, saved tensors and input gradients for good; scratch memory is
shared by every layer's graphs through one memory pool. Sharing is safe because a layer's lasting tensors can
only reuse scratch of graphs captured before it, i.e. of earlier layers, whose forward runs before this layer's
and whose backward runs after it.

A layer must not be called again before the backward pass of its previous call: the second replay would
overwrite what that backward reads. Training steps, gradient accumulation and activation checkpointing (whose
recomputation replays the same inputs) keep to this.

Only whole sequences in training are graphed (no cu_seqlens, no state in or out, gradients on); anything else,
a call inside torch.compile, or a failed capture (the op then stays eager at that site) runs the op directly.
CUDA and ROCm (HIP graphs) alike; not testable on a CPU: gpu_harness/checks/gpu_check.py compares graphed against eager.
"""

from __future__ import annotations

import warnings
import weakref

import torch

# captures per site before further signatures run eagerly: a training run has one, a benchmark that lowers its
# micro-batch after running out of memory builds new layers (new sites) anyway
MAX_SIGNATURES = 2
WARMUP_CALLS = 2

_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # site -> {signature: _Graphs or None}
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every _Graphs alive
_POOL = None


def _signature(args) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.requires_grad, t.device) for t in args)


def _pool():
    """The memory pool every site's graphs share; a new one once no graph is alive (a deleted model's graphs go
    with its layers), so that their memory can go back to the allocator."""
    global _POOL
    if _POOL is None or not len(_LIVE):
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


class _Graphs:
    """One site's captured forward and backward for one signature of ``fn(*args) -> output``."""

    def __init__(self, fn, args: tuple[torch.Tensor, ...]):
        self.inputs = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        self.needs_grad = [i for i, a in enumerate(self.inputs) if a.requires_grad]
        grad_inputs = [self.inputs[i] for i in self.needs_grad]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # FLA's autotuning and first-call work, outside the capture
            for _ in range(WARMUP_CALLS):
                out = fn(*self.inputs)
                torch.autograd.grad(out, grad_inputs, torch.zeros_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        pool = _pool()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            self.output = fn(*self.inputs)
        self.grad_output = torch.empty_like(self.output)
        with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(self.output, grad_inputs, self.grad_output, retain_graph=True,
                                        allow_unused=True)
        self.grads = dict(zip(self.needs_grad, grads))
        _LIVE.add(self)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: _Graphs, *args):
        for static, a in zip(graphs.inputs, args):
            if static.data_ptr() != a.data_ptr():
                static.copy_(a)
        graphs.forward_graph.replay()
        ctx.graphs, ctx.leaves = graphs, [a.is_leaf for a in args]
        return graphs.output.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        graphs = ctx.graphs
        graphs.grad_output.copy_(grad)
        graphs.backward_graph.replay()
        out = []
        for i, leaf in enumerate(ctx.leaves):
            g = graphs.grads.get(i)
            # a leaf's gradient is cloned: autograd may keep the tensor it gets as the parameter's .grad, which
            # the next replay would overwrite; other gradients are consumed before this site replays again
            out.append(None if g is None else (g.clone() if leaf else g.detach()))
        return (None, *out)


def _eligible(args) -> bool:
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and all(t.is_cuda for t in args) and any(t.requires_grad for t in args))


def graphed_call(site, fn, *args: torch.Tensor) -> torch.Tensor:
    """fn(*args) (a tensor output; ``args`` all tensors) through the site's CUDA graphs where possible. What
    ``fn`` holds besides ``args`` (a scale, say) is captured with it: it must be the same at every call of a
    site."""
    if site is None or not _eligible(args):
        return fn(*args)
    captured = _SITES.setdefault(site, {})
    key = _signature(args)
    graphs = captured.get(key, False)
    if graphs is False:
        graphs = None
        if len(captured) < MAX_SIGNATURES:
            try:
                graphs = _Graphs(fn, args)
            except RuntimeError as exc:  # e.g. an op that synchronises with the host: stays eager here
                warnings.warn(f"CUDA graph capture of {getattr(fn, '__name__', fn)} failed, running it eagerly "
                              f"at this call site: {exc}", stacklevel=2)
                torch.cuda.synchronize()
        captured[key] = graphs
    if graphs is None:
        return fn(*args)
    return _Replay.apply(graphs, *args)

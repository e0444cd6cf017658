"""Chunked fused linear cross-entropy: the loss of ``hidden @ weight.T`` without ever holding all the logits.

The logits of a 128K vocabulary are the largest activation of a small model (2048 tokens x 128256 x 4 bytes =
1 GB per sequence in float32). Here the tokens are processed ``chunk_size`` at a time: each chunk's logits are
formed, turned into its loss and, while they are at hand, into the gradients of the hidden states and of the
weight. Only those gradients are kept for the backward pass, so the extra memory is one chunk of logits. Plain
PyTorch: the same code runs on CPU, CUDA and ROCm.

Eagerly, a chunk's softmax costs several passes over its logits (float conversion, max, exp, sum, scaling,
cast). The caller chooses who does that part (``chunk_fn``; ``Kernels.linear_cross_entropy`` picks it from the
kernel config): eager PyTorch (``chunk_loss_and_grad``), torch.compile of it (``compiled_chunk_loss_and_grad``:
one fused kernel, the fast path on CPUs), or on GPUs our Triton kernel (``cross_entropy_triton``: two passes
over each row, the gradient written in place). Where the backend can (CUDA), each chunk's weight gradient is
added to the float32 accumulator inside its GEMM.
"""

from __future__ import annotations

import functools

import torch


def chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor):
    """Summed loss of one chunk and d loss / d logits (softmax - onehot, zero where not valid), in the logits'
    dtype. logits: [c, V] as the matrix product gave them (overwritten); target: [c, 1] (in range); valid: [c].

    One exponential pass serves the loss and the gradient: e = exp(x - max), lse = max + log(sum e). The passes
    work in place, so eagerly the chunk costs one float32 chunk of memory."""
    x = logits.float()
    target_logit = x.gather(1, target)
    peak = x.amax(dim=1, keepdim=True)
    e = x.sub_(peak).exp_()
    sum_e = e.sum(dim=1, keepdim=True)
    weight = valid.to(torch.float32).unsqueeze(1)
    loss = ((peak + sum_e.log() - target_logit) * weight).sum()
    grad = e.mul_(weight / sum_e).scatter_add_(1, target, -weight)
    return loss, grad.to(logits.dtype)


def _chunk_loss_and_grad_fusable(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor):
    """The same as ``chunk_loss_and_grad``, written for torch.compile: out of place, and the target's -1 comes
    from comparing column indices inside the gradient's one expression. (A scatter into the gradient makes
    Inductor write the whole [c, V] gradient and copy it once more: 11.5 ms of a 304 ms step on the H200.)"""
    x = logits.float()
    peak = x.amax(dim=1, keepdim=True)
    e = (x - peak).exp()
    sum_e = e.sum(dim=1, keepdim=True)
    weight = valid.to(torch.float32).unsqueeze(1)
    loss = ((peak + sum_e.log() - x.gather(1, target)) * weight).sum()
    columns = torch.arange(x.shape[1], device=x.device)
    grad = e * (weight / sum_e) - torch.where(columns == target, weight, 0.0)
    return loss, grad.to(logits.dtype)


@functools.cache
def compiled_chunk_loss_and_grad():
    """``chunk_loss_and_grad`` as one torch.compile'd kernel (compiled once per process)."""
    return torch.compile(_chunk_loss_and_grad_fusable, dynamic=False)


class _LinearCrossEntropy(torch.autograd.Function):
    """Called where a gradient is wanted. ``chunk_fn`` (the signature of ``chunk_loss_and_grad``) does each
    chunk's softmax part."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, chunk_size: int, chunk_fn):
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, n, chunk_size):
            h = hidden[start:start + chunk_size]
            t = targets[start:start + chunk_size]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
            loss, probs = chunk_fn(h @ weight.t(), safe_t, valid)
            _accumulate(grad_hidden, grad_weight, probs.to(hidden.dtype), h, weight, start)
            total += loss
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_output.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = grad_weight * grad_output.to(grad_weight.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def _accumulate(grad_hidden, grad_weight, probs, h, weight, start: int) -> None:
    """The chunk's share of the gradients: d hidden = probs W, d W += probs^T h (d W in float32)."""
    grad_hidden[start:start + probs.shape[0]] = probs @ weight
    if probs.dtype == torch.float32:
        grad_weight.addmm_(probs.t(), h)
    elif not _add_in_gemm(grad_weight, probs.t(), h):
        grad_weight.add_(probs.t() @ h)  # a bf16 product (fp32 accumulation inside), then added in fp32


def _add_in_gemm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """acc += a @ b for low-precision a, b and a float32 acc, in the GEMM itself (beta = 1, float32 output):
    no low-precision [V, D] product written, read back and added (a [V, D] pass per chunk).
    Returns False, doing nothing, where the backend lacks such a GEMM (CPU)."""
    if not _fp32_out_gemm_supported(acc.device.type, a.dtype):
        return False
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return True


@functools.cache
def _fp32_out_gemm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Tried once per device type and input dtype on 2 x 2 matrices (an error on real data, such as running out
    of memory, must not be mistaken for missing support); checks that the sum lands in the accumulator."""
    try:
        ones = torch.ones(2, 2, dtype=dtype, device=device_type)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, ones, ones, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    chunk_fn=chunk_loss_and_grad,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets``, and the number of counted tokens.

    hidden: [..., D]; weight: [V, D]; targets: [...] (``ignore_index`` marks tokens that do not count).
    Divide the sum by the count (or by a global token count) for the mean. ``chunk_fn``: each chunk's softmax and
    gradient (the signature of ``chunk_loss_and_grad``).
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden states for {t.shape[0]} targets")
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        loss_sum = _LinearCrossEntropy.apply(h, weight, t, ignore_index, chunk_size, chunk_fn)
    else:  # evaluation: the loss alone, no gradient buffers
        loss_sum = _loss_only(h, weight, t, ignore_index, chunk_size)
    return loss_sum, (t != ignore_index).sum()


def _loss_only(hidden, weight, targets, ignore_index: int, chunk_size: int) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        t = targets[start:start + chunk_size]
        valid = t != ignore_index
        x = (hidden[start:start + chunk_size] @ weight.t()).float()
        lse = torch.logsumexp(x, dim=1, keepdim=True)
        total += ((lse - x.gather(1, torch.where(valid, t, 0).unsqueeze(1))).squeeze(1) * valid).sum()
    return total

"""One cross-entropy chunk's softmax, loss and logit gradient in a Triton kernel of our own (GPUs: CUDA, ROCm).

A chunk of 4,096 tokens over a 128,256-word vocabulary is 1 GB of bf16 logits. What follows the logits' GEMM is
pure memory traffic: find each row's log-sum-exp, then write softmax - onehot. The fastest route reads the row
twice and writes it once. Each program here owns whole rows, one at a time, so a row's second read follows its
first closely and can come from the L2 cache, where torch.compile's kernel makes more passes (docs/findings.md).
The gradient overwrites the logits in place (they are not needed after), which also saves a second chunk of
memory.

Work is in base 2 (x * log2(e), exp2): one exp2 per element per pass. The first pass keeps a running maximum
and sum per row (the sum rescaled when the maximum grows), so it reads the row once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: a kernel may only read globals that are

# The fastest of the settings tried on an H200 (gpu_harness/benchmarks/bench_throughput.py, the output layer alone);
# `chunk_loss_and_grad` takes others.
BLOCK = 8192
NUM_WARPS = 16


@triton.jit
def _softmax_cross_entropy_rows(logits_ptr, target_ptr, weight_ptr, loss_ptr, n_rows, n_cols, row_stride,
                                BLOCK: tl.constexpr):
    """Per row r: loss[r] = weight[r] * (lse(x_r) - x_r[target[r]]); x_r <- weight[r] * (softmax(x_r) - onehot)."""
    columns = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        base = logits_ptr + tl.cast(row, tl.int64) * row_stride  # 64-bit: chunks past 2^31 elements
        target = tl.load(target_ptr + row)
        weight = tl.load(weight_ptr + row)
        target_logit = tl.load(base + target).to(tl.float32)  # before the second pass overwrites it
        # pass 1: running max m (of x * log2 e) and sum s of exp2(x * log2 e - m)
        m = tl.zeros([], dtype=tl.float32) - float("inf")
        s = tl.zeros([], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            idx = start + columns
            x = tl.load(base + idx, mask=idx < n_cols, other=-float("inf")).to(tl.float32) * LOG2E
            m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every block holds at least one column
            s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
            m = m_new
        lse2 = m + tl.log2(s)  # log-sum-exp in base 2
        tl.store(loss_ptr + row, weight * (lse2 / LOG2E - target_logit))
        # pass 2: the gradient, in place
        for start in range(0, n_cols, BLOCK):
            idx = start + columns
            mask = idx < n_cols
            x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) * LOG2E
            grad = tl.exp2(x - lse2) * weight - tl.where(idx == target, weight, 0.0)
            tl.store(base + idx, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, block: int = BLOCK,
                        num_warps: int = NUM_WARPS, programs: int | None = None):
    """The signature of ``cross_entropy._chunk_loss_and_grad``: summed loss (float32) and d loss / d logits in the
    logits' dtype, written over ``logits`` [c, V] (row-contiguous). target: [c, 1] in range; valid: [c].
    ``programs``: how many programs share the rows (default one per row)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-contiguous matrix, got shape {tuple(logits.shape)}, "
                         f"strides {logits.stride()}")
    rows, columns = logits.shape
    target = target.reshape(-1).contiguous()
    weight = valid.to(torch.float32).contiguous()
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        grid = (min(rows, programs or rows),)
        _softmax_cross_entropy_rows[grid](logits, target, weight, loss, rows, columns, logits.stride(0),
                                          BLOCK=block, num_warps=num_warps)
    return loss.sum(), logits

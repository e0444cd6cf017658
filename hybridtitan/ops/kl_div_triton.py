"""One chunk of the distillation KL (and cross-entropy) in a Triton kernel of our own (GPUs: CUDA, ROCm), as
``cross_entropy_triton`` is for the cross-entropy.

What follows the two models' logit GEMMs is memory traffic: each row's log-sum-exp of the student's and the
teacher's logits (at temperature T), then the KL and the gradient of the student's logits,
T (p_s - p_t) (+ the cross-entropy's p_s - onehot at T = 1). Each program owns whole rows: one pass reads both
rows and keeps running maxima and sums, a second reads them again (from the L2 cache, close behind) and writes the
gradient over the student's logits, which are not needed after. In base 2 (x * log2(e), exp2) like the
cross-entropy's kernel. The gradient of the output weight stays a bfloat16 GEMM with float32 accumulation
(``cross_entropy._accumulate``); FLA's fused KL accumulates it in float32 GEMMs instead (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BLOCK = 8192
NUM_WARPS = 16


@triton.jit
def _kl_rows(s_ptr, t_ptr, target_ptr, weight_ptr, kl_ptr, ce_ptr, n_rows, n_cols, s_stride, t_stride, inv_t,
             grad_scale, ce_weight, HAS_CE: tl.constexpr, BLOCK: tl.constexpr):
    """Per row r (w = weight[r]): kl[r] = w * KL(p_t || p_s) at temperature 1 / inv_t;
    s_r <- w * (grad_scale * (p_s - p_t) + ce_weight * (p_s - onehot)); with HAS_CE (inv_t = 1) also
    ce[r] = w * (lse(s_r) - s_r[target])."""
    columns = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        s_base = s_ptr + tl.cast(row, tl.int64) * s_stride
        t_base = t_ptr + tl.cast(row, tl.int64) * t_stride
        w = tl.load(weight_ptr + row)
        target = tl.load(target_ptr + row)
        target_logit = tl.load(s_base + target).to(tl.float32)  # before the second pass overwrites it
        ms = tl.zeros([], dtype=tl.float32) - float("inf")
        ss = tl.zeros([], dtype=tl.float32)
        mt = tl.zeros([], dtype=tl.float32) - float("inf")
        st = tl.zeros([], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            idx = start + columns
            mask = idx < n_cols
            xs = tl.load(s_base + idx, mask=mask, other=-float("inf")).to(tl.float32) * (inv_t * LOG2E)
            xt = tl.load(t_base + idx, mask=mask, other=-float("inf")).to(tl.float32) * (inv_t * LOG2E)
            ms_new = tl.maximum(ms, tl.max(xs, axis=0))
            ss = ss * tl.exp2(ms - ms_new) + tl.sum(tl.exp2(xs - ms_new), axis=0)
            ms = ms_new
            mt_new = tl.maximum(mt, tl.max(xt, axis=0))
            st = st * tl.exp2(mt - mt_new) + tl.sum(tl.exp2(xt - mt_new), axis=0)
            mt = mt_new
        lse_s = ms + tl.log2(ss)
        lse_t = mt + tl.log2(st)
        kl = tl.zeros([], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            idx = start + columns
            mask = idx < n_cols
            log_ps = tl.load(s_base + idx, mask=mask, other=0.0).to(tl.float32) * (inv_t * LOG2E) - lse_s
            log_pt = tl.load(t_base + idx, mask=mask, other=0.0).to(tl.float32) * (inv_t * LOG2E) - lse_t
            p_s = tl.exp2(log_ps)
            p_t = tl.exp2(log_pt)
            kl += tl.sum(tl.where(mask, p_t * (log_pt - log_ps), 0.0), axis=0)
            grad = grad_scale * (p_s - p_t)
            if HAS_CE:
                grad += ce_weight * (p_s - tl.where(idx == target, 1.0, 0.0))
            tl.store(s_base + idx, (w * grad).to(s_ptr.dtype.element_ty), mask=mask)
        tl.store(kl_ptr + row, w * kl * LN2)
        if HAS_CE:
            tl.store(ce_ptr + row, w * (lse_s / LOG2E - target_logit))


def kl_chunk(s_logits: torch.Tensor, t_logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
             temperature: float, kl_scale: float, ce_weight: float, *, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """The signature of ``kl_div.kl_chunk``: (summed KL_T, summed cross-entropy, d loss / d student logits
    written over ``s_logits``). The cross-entropy only at temperature 1 (``applies``)."""
    if not applies(temperature, ce_weight):
        raise ValueError("the KL kernel takes the cross-entropy at temperature 1 only")
    for name, x in (("student", s_logits), ("teacher", t_logits)):
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"{name} logits must be a row-contiguous matrix, got strides {x.stride()}")
    rows, columns = s_logits.shape
    weight = valid.to(torch.float32).contiguous()
    kl = torch.empty(rows, dtype=torch.float32, device=s_logits.device)
    ce = torch.zeros(rows, dtype=torch.float32, device=s_logits.device)
    if rows:
        _kl_rows[(rows,)](s_logits, t_logits, target.reshape(-1).contiguous(), weight, kl, ce, rows, columns,
                          s_logits.stride(0), t_logits.stride(0), 1.0 / temperature, kl_scale / temperature,
                          ce_weight, HAS_CE=bool(ce_weight), BLOCK=block, num_warps=num_warps)
    return kl.sum(), ce.sum(), s_logits


def applies(temperature: float, ce_weight: float) -> bool:
    """Whether the kernel computes this loss: the KL at any temperature, with the cross-entropy at 1 only."""
    return not ce_weight or temperature == 1

"""The mixers' short causal convolution (+ SiLU) over whole sequences, in Triton kernels of our own (CUDA, ROCm).

Each mixer convolves the q, k, v (or x, B, C) block of its fused input projection, channel by channel, over the
last W (4) positions. FLA 0.6.0's kernels read the input twice in the forward pass and ran the backward far below
the memory's speed, and the recurrent kernels after them copied the strided q, k, v views of their output into
contiguous tensors (docs/findings.md). Here:

- the forward pass reads the projection's column block as it lies (a strided view) and writes each of q, k, v
  as its own contiguous tensor, so nothing downstream copies them; the pre-activation is not kept;
- the backward pass forms the pre-activation again from x, reads the three output gradients where they are (no
  concatenation) and writes the pre-activation's gradient (float32) with, per block of positions, partial sums
  for d weight / d bias (added up by one small reduction: deterministic, no atomics); a second kernel turns it
  into d x.

A program owns BT positions x BD channels of one sequence; the W shifted reads of x overlap and come from cache.
Documents packed into a row (cu_seqlens) and decoding with a state stay with FLA's kernels (``ops``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Each kernel is tuned over channels per program (BD) and warps, once per channel count (autotune). Positions per
# program are fixed: in the backward pass they set the rows of the weight-gradient partial sums.
BT_FWD = 64
BT_BWD = 32
_CONFIGS = [triton.Config({"BD": bd}, num_warps=warps)
            for bd, warps in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8), (256, 8))]


def _row_alignment(*strides: int) -> int:
    """The largest of 16, 8, 4, 2, 1 dividing every stride (elements): tells the kernels how the rows start, so
    that their loads are vectorised (a projection's column block has the projection's row stride, e.g. 1160)."""
    for align in (16, 8, 4, 2):
        if all(s % align == 0 for s in strides):
            return align
    return 1


@triton.jit
def _rows(t, stride, ALIGN: tl.constexpr):
    """Element offsets of rows t (64-bit: long sequences times a wide projection's row stride pass 2^31)."""
    return tl.multiple_of(t.to(tl.int64) * stride, ALIGN)


@triton.jit
def _block(n_channels, c0, BT: tl.constexpr, BD: tl.constexpr):
    """This program's sequence (64-bit), positions t, channels d of its block (and whether they exist), and those
    channels' index c in x and the weight."""
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT)
    d = i_d * BD + tl.arange(0, BD)
    return i_b, t, d, d < n_channels, c0 + d


@triton.autotune(configs=_CONFIGS, key=["n_channels", "ALIGN"])
@triton.jit
def _short_conv_fwd(x_ptr, w_ptr, b_ptr, y_ptr, T, n_channels, c0, x_sb, x_st, y_sb, y_st,
                    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ALIGN: tl.constexpr,
                    BT: tl.constexpr, BD: tl.constexpr):
    """y[b, t, d] = act(sum_s w[c0 + d, W-1-s] x[b, t-s, c0 + d] (+ bias)), x zero before t = 0."""
    i_b, t, d, d_ok, c = _block(n_channels, c0, BT, BD)
    x_base = x_ptr + i_b * x_sb
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for s in tl.static_range(W):
        ts = t - s
        m = ((ts >= 0) & (ts < T))[:, None] & d_ok[None, :]
        xs = tl.load(x_base + _rows(ts, x_st, ALIGN)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        ws = tl.load(w_ptr + c * W + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)
        acc += xs * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    m = (t < T)[:, None] & d_ok[None, :]
    y = y_ptr + i_b * y_sb + t.to(tl.int64)[:, None] * y_st + d[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.autotune(configs=_CONFIGS, key=["n_channels", "ALIGN"])
@triton.jit
def _short_conv_bwd_pre(x_ptr, w_ptr, b_ptr, dy_ptr, dpre_ptr, dw_ptr, db_ptr, T, n_channels, c0, n_total,
                        x_sb, x_st, dy_sb, dy_st,
                        W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ALIGN: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr):
    """The pre-activation's gradient (formed from x again) into dpre [B, T, n_total] (float32), and this block's
    rows' share of d weight [W, n_total] / d bias [n_total]: one partial row per program along positions,
    b * cdiv(T, BT) + i_t."""
    i_b, t, d, d_ok, c = _block(n_channels, c0, BT, BD)
    x_base = x_ptr + i_b * x_sb
    m = (t < T)[:, None] & d_ok[None, :]
    g = tl.load(dy_ptr + i_b * dy_sb + t.to(tl.int64)[:, None] * dy_st + d[None, :], mask=m, other=0.0)
    g = g.to(tl.float32)
    if SILU:
        pre = tl.zeros([BT, BD], dtype=tl.float32)
        for s in tl.static_range(W):
            ts = t - s
            ms = ((ts >= 0) & (ts < T))[:, None] & d_ok[None, :]
            xs = tl.load(x_base + _rows(ts, x_st, ALIGN)[:, None] + c[None, :], mask=ms, other=0.0)
            pre += xs.to(tl.float32) * tl.load(w_ptr + c * W + (W - 1 - s), mask=d_ok, other=0.0)[None, :]
        if HAS_BIAS:
            pre += tl.load(b_ptr + c, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        sig = tl.sigmoid(pre)
        g = g * sig * (1 + pre * (1 - sig))
    tl.store(dpre_ptr + (i_b * T + t.to(tl.int64))[:, None] * n_total + c[None, :], g, mask=m)
    row = i_b * tl.cdiv(T, BT) + tl.program_id(0)
    for s in tl.static_range(W):
        ts = t - s
        ms = ((ts >= 0) & (ts < T))[:, None] & d_ok[None, :]
        xs = tl.load(x_base + _rows(ts, x_st, ALIGN)[:, None] + c[None, :], mask=ms, other=0.0).to(tl.float32)
        tl.store(dw_ptr + (row * W + (W - 1 - s)) * n_total + c, tl.sum(g * xs, axis=0), mask=d_ok)
    if HAS_BIAS:
        tl.store(db_ptr + row * n_total + c, tl.sum(g, axis=0), mask=d_ok)


@triton.autotune(configs=_CONFIGS, key=["n_channels"])
@triton.jit
def _short_conv_bwd_x(dpre_ptr, w_ptr, dx_ptr, T, n_channels, W: tl.constexpr, BT: tl.constexpr,
                      BD: tl.constexpr):
    """d x[t] = sum_j w[:, W-1-j] dpre[t + j] (x[t] reaches y[t + j]); dpre and dx are [B, T, n_channels]."""
    i_b, t, c, c_ok, _ = _block(n_channels, 0, BT, BD)
    base = i_b * T * n_channels
    dx = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        tj = t + j
        g = tl.load(dpre_ptr + base + tj.to(tl.int64)[:, None] * n_channels + c[None, :],
                    mask=(tj < T)[:, None] & c_ok[None, :], other=0.0)
        dx += g * tl.load(w_ptr + c * W + (W - 1 - j), mask=c_ok, other=0.0).to(tl.float32)[None, :]
    m = (t < T)[:, None] & c_ok[None, :]
    tl.store(dx_ptr + base + t.to(tl.int64)[:, None] * n_channels + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=m)


class ShortConv(torch.autograd.Function):
    """x [B, T, D] (channels contiguous, rows may be strided), weight [D, W], bias [D] or None -> one contiguous
    [B, T, n] output per entry of ``sizes`` (they sum to D), in channel order."""

    @staticmethod
    def forward(ctx, x, weight, bias, silu: bool, sizes: tuple[int, ...]):
        B, T, D = x.shape
        if sum(sizes) != D or weight.shape[0] != D or min(sizes) < 1:
            raise ValueError(f"output sizes {sizes} and weight {tuple(weight.shape)} must cover the {D} channels")
        if x.stride(-1) != 1:
            x = x.contiguous()
        weight = weight.contiguous()
        align = _row_alignment(x.stride(0), x.stride(1))
        outputs, c0 = [], 0
        for n in sizes:
            y = torch.empty(B, T, n, dtype=x.dtype, device=x.device)
            if B and T:
                grid = lambda meta, n=n: (triton.cdiv(T, BT_FWD), triton.cdiv(n, meta["BD"]), B)  # noqa: E731
                _short_conv_fwd[grid](
                    x, weight, bias if bias is not None else weight, y, T, n, c0, x.stride(0), x.stride(1),
                    y.stride(0), y.stride(1), W=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu,
                    ALIGN=align, BT=BT_FWD)
            outputs.append(y)
            c0 += n
        ctx.save_for_backward(x, weight, bias)
        ctx.silu, ctx.sizes = silu, sizes
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        x, weight, bias = ctx.saved_tensors
        B, T, D = x.shape
        W = weight.shape[1]
        rows = B * triton.cdiv(T, BT_BWD)
        dpre = torch.empty(B, T, D, dtype=torch.float32, device=x.device)
        dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
        # every (row, channel) is written once: the blocks of ``sizes`` cover the channels
        dw_part = torch.empty(rows, W, D, dtype=torch.float32, device=x.device)
        db_part = torch.empty(rows, D, dtype=torch.float32, device=x.device) if bias is not None else dw_part
        align = _row_alignment(x.stride(0), x.stride(1))
        c0 = 0
        for n, dy in zip(ctx.sizes, grads):
            if dy is None:  # an output that took no part in the loss
                dy = torch.zeros(B, T, n, dtype=x.dtype, device=x.device)
            elif dy.stride(-1) != 1:
                dy = dy.contiguous()
            if B and T:
                grid = lambda meta, n=n: (triton.cdiv(T, BT_BWD), triton.cdiv(n, meta["BD"]), B)  # noqa: E731
                _short_conv_bwd_pre[grid](
                    x, weight, bias if bias is not None else weight, dy, dpre, dw_part, db_part, T, n, c0, D,
                    x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), W=W, HAS_BIAS=bias is not None,
                    SILU=ctx.silu, ALIGN=align, BT=BT_BWD)
            c0 += n
        if B and T:
            grid = lambda meta: (triton.cdiv(T, BT_FWD), triton.cdiv(D, meta["BD"]), B)  # noqa: E731
            _short_conv_bwd_x[grid](dpre, weight, dx, T, D, W=W, BT=BT_FWD)
        dw = dw_part.sum(0).t().to(weight.dtype)
        db = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dw, db, None, None


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
               sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return ShortConv.apply(x, weight, bias, silu, tuple(sizes))

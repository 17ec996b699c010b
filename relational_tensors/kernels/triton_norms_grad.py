"""Gradients of the row-wise operators: ``norm_grad`` (dx of rmsnorm and layernorm), ``norm_weight_grad``
(a block's partial sum of dy·x̂ over its rows) and ``softmax_grad``.  fp32 inside (fp64 for float64).

The weight gradient reduces over rows without atomics, so every run gives the same bits: per-row
statistics go to scratch, then each program sums a fixed chunk of rows for a tile of columns in row
order, and a last pass adds the chunks' partials in chunk order (skipped when there is one chunk)."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.core.dtypes import itemsize
from relational_tensors.kernels.common import DevBuf, Ptr, acc_type
from relational_tensors.kernels.scratch import PARTIAL_ROWS, weight_grad_chunks, weight_grad_scratch

__all__ = ["norm_grad", "norm_weight_grad", "softmax_grad"]

STATS_ROWS = 16     # rows per program of the statistics pass
PARTIAL_COLS = 256  # columns per program of a chunk's sum: 512 bytes of a 16-bit row per load


def _block(d: int) -> int:
    return min(8192, triton.next_power_of_2(max(d, 16)))


@triton.jit
def _xhat_g(x_ptr, w_ptr, dy_ptr, base, cols, mask, mean, r, ACC: tl.constexpr):
    """x̂ = (x - mean)·r and g = dy·w of one tile of a row."""
    xhat = (tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(ACC) - mean) * r
    dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(ACC)
    return xhat, dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC)


@triton.jit
def _norm_grad_kernel(x_ptr, w_ptr, dy_ptr, out_ptr, d, eps, LAYER: tl.constexpr, BLOCK_D: tl.constexpr,
                      ONE_PASS: tl.constexpr, ACC: tl.constexpr):
    # dx = (g - x̂·mean(g·x̂) - [layernorm] mean(g)) · r with g = dy·w, x̂ = (x - [layernorm] mean(x))·r
    row = tl.program_id(0).to(tl.int64)
    base = row * d
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(ACC)
        if LAYER:
            x = tl.where(mask, x - tl.sum(x, axis=0) / d, 0.0)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
        xhat = x * r
        g = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(ACC) * \
            tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC)
        dx = g - xhat * (tl.sum(g * xhat, axis=0) / d)
        if LAYER:
            dx = dx - tl.sum(g, axis=0) / d
        tl.store(out_ptr + base + cols, (dx * r).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mean = 0.0
        if LAYER:
            acc = tl.zeros([BLOCK_D], dtype=ACC)
            for c0 in range(0, d, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                acc += tl.load(x_ptr + base + cols, mask=cols < d, other=0.0).to(ACC)
            mean = tl.sum(acc, axis=0) / d
        acc = tl.zeros([BLOCK_D], dtype=ACC)
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            mask = cols < d
            x = tl.where(mask, tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(ACC) - mean, 0.0)
            acc += x * x
        r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / d + eps)
        acc = tl.zeros([BLOCK_D], dtype=ACC)
        acc_g = tl.zeros([BLOCK_D], dtype=ACC)
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            mask = cols < d
            xhat, g = _xhat_g(x_ptr, w_ptr, dy_ptr, base, cols, mask, mean, r, ACC)
            acc += tl.where(mask, g * xhat, 0.0)
            acc_g += g
        c1 = tl.sum(acc, axis=0) / d
        c2 = tl.sum(acc_g, axis=0) / d
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            mask = cols < d
            xhat, g = _xhat_g(x_ptr, w_ptr, dy_ptr, base, cols, mask, mean, r, ACC)
            dx = g - xhat * c1
            if LAYER:
                dx = dx - c2
            tl.store(out_ptr + base + cols, (dx * r).to(out_ptr.dtype.element_ty), mask=mask)


def norm_grad(x: DevBuf, w: DevBuf, dy: DevBuf, out: DevBuf, layer: bool, eps: float) -> None:
    """out = ∂(rmsnorm or layernorm)/∂x applied to dy, for contiguous x, dy, out [..., d] and w [d]."""
    if not x.shape == dy.shape == out.shape or w.shape != (x.shape[-1],):
        raise ValueError(f"norm_grad needs x, dy, out [..., d] of one shape and w [d]; got {x.shape}, {dy.shape}, "
                         f"{out.shape} and {w.shape}")
    d = x.shape[-1]
    rows = x.size // d if d else 0
    if rows:
        block = _block(d)
        _norm_grad_kernel[(rows,)](Ptr(x), Ptr(w), Ptr(dy), Ptr(out), d, float(eps), LAYER=bool(layer),
                                   BLOCK_D=block, ONE_PASS=block >= d, ACC=acc_type(x.dtype),
                                   num_warps=8 if block >= 2048 else 4)


@triton.jit
def _row_stats_kernel(x_ptr, stats_ptr, rows, d, eps, LAYER: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # stats[row] = (mean or 0, r = 1 / sqrt(mean((x - mean)²) + eps)) for BLOCK_R rows
    r_idx = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r_idx < rows
    mean = tl.zeros([BLOCK_R], dtype=ACC)
    if LAYER:
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=ACC)
        for c0 in range(0, d, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = rmask[:, None] & (cols < d)[None, :]
            acc += tl.load(x_ptr + r_idx[:, None] * d + cols[None, :], mask=mask, other=0.0).to(ACC)
        mean = tl.sum(acc, axis=1) / d
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=ACC)
    for c0 in range(0, d, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < d)[None, :]
        x = tl.load(x_ptr + r_idx[:, None] * d + cols[None, :], mask=mask, other=0.0).to(ACC)
        x = tl.where(mask, x - mean[:, None], 0.0)
        acc += x * x
    r = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / d + eps)
    tl.store(stats_ptr + 2 * r_idx, mean.to(stats_ptr.dtype.element_ty), mask=rmask)
    tl.store(stats_ptr + 2 * r_idx + 1, r.to(stats_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _weight_partial_kernel(x_ptr, dy_ptr, stats_ptr, dst_ptr, rows, d, per_chunk, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # dst[chunk, cols] = Σ over the chunk's rows, in order of row tiles, of dy · (x - mean) · r
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < d
    acc = tl.zeros([BLOCK_C], dtype=ACC)
    start = chunk * per_chunk
    for r0 in range(0, per_chunk, BLOCK_R):
        r_idx = start + r0 + tl.arange(0, BLOCK_R)
        rmask = r_idx < rows
        mask = rmask[:, None] & cmask[None, :]
        mean = tl.load(stats_ptr + 2 * r_idx, mask=rmask, other=0.0)
        r = tl.load(stats_ptr + 2 * r_idx + 1, mask=rmask, other=0.0)
        offs = r_idx[:, None] * d + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
        acc += tl.sum(tl.where(mask, dy * ((x - mean[:, None]) * r[:, None]), 0.0), axis=0)
    tl.store(dst_ptr + chunk * d + cols, acc.to(dst_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _chunk_sum_kernel(part_ptr, out_ptr, chunks, d, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < d
    acc = tl.zeros([BLOCK_C], dtype=ACC)
    for c in range(0, chunks):
        acc += tl.load(part_ptr + c * d + cols, mask=cmask, other=0.0).to(ACC)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def norm_weight_grad(x: DevBuf, dy: DevBuf, out: DevBuf, scratch: DevBuf, layer: bool, eps: float) -> None:
    """out[d] = Σ over the rows of contiguous x, dy [..., d] of dy · x̂ (x̂ normalized as rmsnorm or layernorm
    does), in a fixed order; ``scratch`` holds ``weight_grad_scratch(rows, d)`` elements of the compute dtype."""
    if x.shape != dy.shape or out.shape != (x.shape[-1],):
        raise ValueError(f"norm_weight_grad needs x, dy [..., d] of one shape and out [d]; got {x.shape}, "
                         f"{dy.shape} and {out.shape}")
    d = x.shape[-1]
    if not d:
        return
    rows = x.size // d
    acc = acc_type(x.dtype)
    work = "float64" if x.dtype == "float64" else "float32"
    need = weight_grad_scratch(rows, d)
    if scratch.size * itemsize(scratch.dtype) < need * itemsize(work):
        raise ValueError(f"norm_weight_grad needs {need} {work} elements of scratch for {rows} rows of {d}; "
                         f"got {scratch.size} {scratch.dtype}")
    if not rows:
        from relational_tensors.kernels.triton_copy import fill

        fill(out, 0.0)
        return
    stats = Ptr(scratch.ptr, work)
    _row_stats_kernel[(triton.cdiv(rows, STATS_ROWS),)](Ptr(x), stats, rows, d, float(eps), LAYER=bool(layer),
                                                        BLOCK_R=STATS_ROWS, BLOCK_C=128, ACC=acc)
    chunks = weight_grad_chunks(rows)
    per_chunk = triton.cdiv(rows, chunks)
    per_chunk = triton.cdiv(per_chunk, PARTIAL_ROWS) * PARTIAL_ROWS
    partials = Ptr(scratch.ptr + 2 * rows * itemsize(work), work) if chunks > 1 else Ptr(out)
    _weight_partial_kernel[(chunks, triton.cdiv(d, PARTIAL_COLS))](
        Ptr(x), Ptr(dy), stats, partials, rows, d, per_chunk, BLOCK_R=PARTIAL_ROWS, BLOCK_C=PARTIAL_COLS, ACC=acc)
    if chunks > 1:
        _chunk_sum_kernel[(triton.cdiv(d, 1024),)](partials, Ptr(out), chunks, d, BLOCK_C=1024, ACC=acc)


@triton.jit
def _softmax_grad_kernel(y_ptr, dy_ptr, out_ptr, n, inner, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    # viewed as [outer, n, inner]; one program per line: out = y · (dy - Σ dy·y)
    pid = tl.program_id(0).to(tl.int64)
    o = pid // inner
    i = pid % inner
    base = o * n * inner + i
    acc = tl.zeros([BLOCK_N], dtype=ACC)
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < n
        y = tl.load(y_ptr + base + cols * inner, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + base + cols * inner, mask=mask, other=0.0).to(ACC)
        acc += dy * y
    s = tl.sum(acc, axis=0)
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < n
        y = tl.load(y_ptr + base + cols * inner, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + base + cols * inner, mask=mask, other=0.0).to(ACC)
        tl.store(out_ptr + base + cols * inner, (y * (dy - s)).to(out_ptr.dtype.element_ty), mask=mask)


def softmax_grad(y: DevBuf, dy: DevBuf, out: DevBuf, axis: int) -> None:
    """out = y · (dy - Σ_axis dy·y) for contiguous y, dy, out of one shape (y a softmax along ``axis``)."""
    if not y.shape == dy.shape == out.shape:
        raise ValueError(f"softmax_grad needs y, dy and out of one shape; got {y.shape}, {dy.shape}, {out.shape}")
    n = y.shape[axis]
    inner = 1
    for s in y.shape[axis + 1:]:
        inner *= s
    lines = y.size // n if n else 0
    if lines:
        _softmax_grad_kernel[(lines,)](Ptr(y), Ptr(dy), Ptr(out), n, inner, BLOCK_N=_block(n), ACC=acc_type(y.dtype))

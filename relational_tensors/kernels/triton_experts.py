"""Sparse experts' kernels (``sql_specs/experts.py``): the routed pairs sorted by expert, and products over
each expert's rows.

``route_index`` is a counting sort with one program per expert (and one for the ids no expert holds):
it counts the pairs routed to lower experts (its rows' start), then walks the pairs in order with a
running count, so the sort is stable (token order, then rank) and needs no atomics.  Each program writes
the map asked for at its pairs' rows.

``grouped_matmul`` gives each program a tile of rows and of output columns; it multiplies the tile by
each expert its rows hold (from the least to the greatest group id in the tile, with the other rows
masked to zero), so rows sorted by expert cost about one product per tile, and rows in any order stay
correct.  ``grouped_weight_grad`` gives each program an expert and a tile of its ``[h, f]`` gradient; it
finds the span of rows of that expert and adds ``xsᵀ · dy`` over it, a fixed number of rows at a time
in row order (the same bits every run).  Both accumulate in float32 (float32 inputs without TF32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr

__all__ = ["route_index", "grouped_matmul", "grouped_weight_grad"]

BLOCK = 1024  # pairs per step of the counting sort
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit
def _route_kernel(ids_ptr, out_ptr, n_pairs, k, experts, WHAT: tl.constexpr, BLOCK_P: tl.constexpr):
    e = tl.program_id(0)  # experts: the pairs whose id no expert holds
    start = 0
    for p0 in range(0, n_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=0).to(tl.int64)
        key = tl.where((ids >= 0) & (ids < experts), ids, experts)
        start += tl.sum(((key < e) & (p < n_pairs)).to(tl.int32), axis=0)
    seen = 0
    for p0 in range(0, n_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        live = p < n_pairs
        ids = tl.load(ids_ptr + p, mask=live, other=0).to(tl.int64)
        key = tl.where((ids >= 0) & (ids < experts), ids, experts)
        mine = live & (key == e)
        rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        row = (start + seen + rank).to(tl.int64)
        if WHAT == 0:  # token
            tl.store(out_ptr + row, (p // k).to(tl.int64), mask=mine)
        elif WHAT == 1:  # dest
            tl.store(out_ptr + p, row, mask=mine)
        else:  # group
            tl.store(out_ptr + row, key, mask=mine)
        seen += tl.sum(mine.to(tl.int32), axis=0)


def route_index(ids: DevBuf, out: DevBuf, experts: int, what: str) -> None:
    """``out`` = the ``what`` map (token, dest or group) of the router's choices ``ids [t, k]`` (contiguous)."""
    n = ids.size
    if n:
        _route_kernel[(experts + 1,)](Ptr(ids), Ptr(out), n, ids.shape[1], experts,
                                      WHAT=("token", "dest", "group").index(what), BLOCK_P=BLOCK)


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, n_rows, n_h, n_f, n_e, e0,
                       sxr, sxh, swe, swh, swf, sgr, sor, sof,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    rmask = rows < n_rows
    cmask = cols < n_f
    g = tl.load(g_ptr + rows * sgr, mask=rmask, other=-1).to(tl.int64) - e0
    valid = rmask & (g >= 0) & (g < n_e)
    lo = tl.min(tl.where(valid, g, n_e), axis=0)
    hi = tl.max(tl.where(valid, g, -1), axis=0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for e in range(lo, hi + 1):
        sel = valid & (g == e)
        for k0 in range(0, n_h, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < n_h
            x = tl.load(x_ptr + rows[:, None] * sxr + ks[None, :] * sxh, mask=sel[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(w_ptr + e * swe + ks[:, None] * swh + cols[None, :] * swf,
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rows[:, None] * sor + cols[None, :] * sof, acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def grouped_matmul(xs: DevBuf, w: DevBuf, group: DevBuf, out: DevBuf, e0: int, trans_w: bool) -> None:
    """``out[r] = xs[r] @ w[group[r] - e0]`` (``trans_w``: ``w`` is ``[e, f, h]``), zeros where the group is not
    one of the block's experts ``[e0, e0 + w.shape[0])``."""
    n_rows, n_h = xs.shape
    n_f = out.shape[1]
    swe, a, b = w.strides
    swh, swf = (b, a) if trans_w else (a, b)
    if n_rows and n_f:
        grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_f, BLOCK_N))
        _grouped_mm_kernel[grid](Ptr(xs), Ptr(w), Ptr(group), Ptr(out), n_rows, n_h, n_f, w.shape[0], e0,
                                 xs.strides[0], xs.strides[1], swe, swh, swf, group.strides[0], out.strides[0],
                                 out.strides[1], BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, IEEE=xs.dtype == "float32")


@triton.jit
def _grouped_wg_kernel(x_ptr, d_ptr, g_ptr, out_ptr, n_rows, n_h, n_f, e0,
                       sxr, sxh, sdr, sdf, sgr, soe, soh, sof,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, IEEE: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    fs = tl.program_id(2).to(tl.int64) * BN + tl.arange(0, BN)
    hmask = hs < n_h
    fmask = fs < n_f
    first = n_rows
    last = -1
    for p0 in range(0, n_rows, BP):
        p = p0 + tl.arange(0, BP)
        mine = (p < n_rows) & (tl.load(g_ptr + p * sgr, mask=p < n_rows, other=-1).to(tl.int64) == e + e0)
        first = tl.minimum(first, tl.min(tl.where(mine, p, n_rows), axis=0))
        last = tl.maximum(last, tl.max(tl.where(mine, p, -1), axis=0))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(first, last + 1, BK):
        rs = r0 + tl.arange(0, BK)
        rmask = (rs <= last) & (tl.load(g_ptr + rs * sgr, mask=rs <= last, other=-1).to(tl.int64) == e + e0)
        xt = tl.load(x_ptr + rs[None, :] * sxr + hs[:, None] * sxh, mask=rmask[None, :] & hmask[:, None], other=0.0)
        d = tl.load(d_ptr + rs[:, None] * sdr + fs[None, :] * sdf, mask=rmask[:, None] & fmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, d, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, d, acc)
    tl.store(out_ptr + e * soe + hs[:, None] * soh + fs[None, :] * sof, acc.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None] & fmask[None, :])


def grouped_weight_grad(xs: DevBuf, dy: DevBuf, group: DevBuf, out: DevBuf, e0: int) -> None:
    """``out[e] = Σ xs[r]ᵀ dy[r]`` over the rows ``r`` whose group is ``e0 + e``."""
    n_rows, n_h = xs.shape
    n_e, _, n_f = out.shape
    if n_e and n_h and n_f:
        grid = (n_e, triton.cdiv(n_h, BLOCK_M), triton.cdiv(n_f, BLOCK_N))
        _grouped_wg_kernel[grid](Ptr(xs), Ptr(dy), Ptr(group), Ptr(out), n_rows, n_h, n_f, e0,
                                 xs.strides[0], xs.strides[1], dy.strides[0], dy.strides[1], group.strides[0],
                                 out.strides[0], out.strides[1], out.strides[2], BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                                 BP=BLOCK, IEEE=xs.dtype == "float32")

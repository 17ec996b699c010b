"""Sparse experts' kernels (``sql_specs/experts.py``): the routed pairs sorted by expert, and products over
each expert's rows.

``route_index`` is a counting sort with one program per expert (and one for the ids no expert holds):
it counts the pairs routed to lower experts (its rows' start), then walks the pairs in order with a
running count, so the sort is stable (token order, then rank) and needs no atomics.  Each program writes
the map asked for at its pairs' rows.

``capacity_route`` is the same counting sort within each group of tokens, one program per (group,
expert), cut at the capacity: each program writes its expert's slots (the ``pair`` map, -1 past its last
pair) or its pairs' slots (the ``slot`` map, -1 past the capacity).  ``routed_gather`` copies rows: each
program a tile of (group, destination) rows and of the width, zeros where the index is -1 or outside the
block's rows.

``grouped_matmul`` gives each program a tile of rows and of output columns; it multiplies the tile by
each expert its rows hold (from the least to the greatest group id in the tile, with the other rows
masked to zero), so rows sorted by expert cost about one product per tile, and rows in any order stay
correct.  ``grouped_weight_grad`` first finds each expert's span of rows (first and last, into scratch:
one scan of the group ids per expert), then gives each program an expert and a tile of its ``[h, f]``
gradient, adding ``xsᵀ · dy`` over the span a fixed number of rows at a time in row order (the same bits
every run).  Both accumulate in float32 (float32 inputs without TF32), visit their tiles in groups of row
tiles (operands shared in L2), and take the fastest of a few tile shapes, timed on the first launch of
each shape class as the attention kernels do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, chosen_config, is_interpreted

__all__ = ["route_index", "grouped_matmul", "grouped_weight_grad", "capacity_route", "routed_gather"]

BLOCK = 1024  # pairs per step of the counting sort (and group ids per step of the spans' scan)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried on the first launch of each shape class, the
# fastest kept; float32 (IEEE products) on smaller tiles.  The last is the interpreter's.
CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
           (128, 64, 64, 4, 4), (64, 64, 32, 4, 3)]
IEEE_CONFIGS = [(64, 64, 32, 4, 3), (64, 64, 32, 4, 2), (32, 32, 32, 4, 2)]
_chosen: dict[tuple, tuple[int, ...]] = {}


@triton.jit
def _pairs(ids_ptr, p, n_pairs, experts, e):
    """The expert key of the pairs ``p`` (``experts`` for an id no expert holds), which of them are expert
    ``e``'s, and each one's rank among those in the block."""
    live = p < n_pairs
    ids = tl.load(ids_ptr + p, mask=live, other=0).to(tl.int64)
    key = tl.where((ids >= 0) & (ids < experts), ids, experts)
    mine = live & (key == e)
    return key, live, mine, tl.cumsum(mine.to(tl.int32), axis=0) - 1


@triton.jit
def _route_kernel(ids_ptr, out_ptr, n_pairs, k, experts, WHAT: tl.constexpr, BLOCK_P: tl.constexpr):
    e = tl.program_id(0)  # experts: the pairs whose id no expert holds
    start = 0
    for p0 in range(0, n_pairs, BLOCK_P):
        key, live, _, _ = _pairs(ids_ptr, p0 + tl.arange(0, BLOCK_P), n_pairs, experts, e)
        start += tl.sum(((key < e) & live).to(tl.int32), axis=0)
    seen = 0
    for p0 in range(0, n_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        key, _, mine, rank = _pairs(ids_ptr, p, n_pairs, experts, e)
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
def _swizzle(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """Tile ``pid`` of a 1-D grid as (row tile, column tile), ``GROUP_M`` row tiles at a time, so the
    programs running together share their operands in L2."""
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, n_rows, n_h, n_f, n_e, e0,
                       sxr, sxh, swe, swh, swf, sgr, sor, sof,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    pm, pn = _swizzle(tl.program_id(0), tl.cdiv(n_rows, BM), tl.cdiv(n_f, BN), GROUP_M)
    rows = pm.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pn.to(tl.int64) * BN + tl.arange(0, BN)
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
            if EVEN_K:
                x = tl.load(x_ptr + rows[:, None] * sxr + ks[None, :] * sxh, mask=sel[:, None], other=0.0)
                w = tl.load(w_ptr + e * swe + ks[:, None] * swh + cols[None, :] * swf, mask=cmask[None, :],
                            other=0.0)
            else:
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


def _pick(key: tuple, configs: Sequence[tuple[int, ...]], launch: Callable[[tuple[int, ...]], None]) -> tuple[int, ...]:
    """The fastest of ``configs`` for this shape class, timed once on the first eager launch; the
    interpreter takes the smallest."""
    if is_interpreted(_grouped_mm_kernel):
        return configs[-1]
    return chosen_config(_chosen, key, configs, launch, lambda cfg: False, f"{key[0]} kernel")


def _shape_class(n: int) -> int:
    """Rows rounded up to a power of two: one choice of tiles per class of block sizes."""
    return 1 << max(n - 1, 0).bit_length()


def grouped_matmul(xs: DevBuf, w: DevBuf, group: DevBuf, out: DevBuf, e0: int, trans_w: bool) -> None:
    """``out[r] = xs[r] @ w[group[r] - e0]`` (``trans_w``: ``w`` is ``[e, f, h]``), zeros where the group is not
    one of the block's experts ``[e0, e0 + w.shape[0])``."""
    n_rows, n_h = xs.shape
    n_f = out.shape[1]
    swe, a, b = w.strides
    swh, swf = (b, a) if trans_w else (a, b)
    if not (n_rows and n_f):
        return
    ieee = xs.dtype == "float32"
    args = (Ptr(xs), Ptr(w), Ptr(group), Ptr(out), n_rows, n_h, n_f, w.shape[0], e0, xs.strides[0], xs.strides[1],
            swe, swh, swf, group.strides[0], out.strides[0], out.strides[1])

    def launch(cfg: tuple[int, ...]) -> None:
        bm, bn, bk, warps, stages = cfg
        grid = (triton.cdiv(n_rows, bm) * triton.cdiv(n_f, bn),)
        _grouped_mm_kernel[grid](*args, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=n_h % bk == 0, IEEE=ieee,
                                 num_warps=warps, num_stages=stages)

    key = ("grouped_matmul", _shape_class(n_rows), n_h, n_f, w.shape[0], trans_w, xs.dtype)
    launch(_pick(key, IEEE_CONFIGS if ieee else CONFIGS, launch))


@triton.jit
def _spans_kernel(g_ptr, out_ptr, n_rows, e0, sgr, BP: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    first = n_rows
    last = -1
    for p0 in range(0, n_rows, BP):
        p = p0 + tl.arange(0, BP)
        mine = (p < n_rows) & (tl.load(g_ptr + p * sgr, mask=p < n_rows, other=-1).to(tl.int64) == e + e0)
        first = tl.minimum(first, tl.min(tl.where(mine, p, n_rows), axis=0))
        last = tl.maximum(last, tl.max(tl.where(mine, p, -1), axis=0))
    tl.store(out_ptr + 2 * e, first)
    tl.store(out_ptr + 2 * e + 1, last)


@triton.jit
def _grouped_wg_kernel(x_ptr, d_ptr, g_ptr, span_ptr, out_ptr, n_h, n_f, e0,
                       sxr, sxh, sdr, sdf, sgr, soe, soh, sof,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       IEEE: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)
    pm, pn = _swizzle(tl.program_id(0), tl.cdiv(n_h, BM), tl.cdiv(n_f, BN), GROUP_M)
    hs = pm.to(tl.int64) * BM + tl.arange(0, BM)
    fs = pn.to(tl.int64) * BN + tl.arange(0, BN)
    hmask = hs < n_h
    fmask = fs < n_f
    first = tl.load(span_ptr + 2 * e)
    last = tl.load(span_ptr + 2 * e + 1)
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


def grouped_weight_grad(xs: DevBuf, dy: DevBuf, group: DevBuf, out: DevBuf, e0: int, scratch: DevBuf) -> None:
    """``out[e] = Σ xs[r]ᵀ dy[r]`` over the rows ``r`` whose group is ``e0 + e``, in row order (``scratch``:
    ``kernels.scratch.grouped_weight_grad_scratch(experts)`` int64 elements, each expert's first and last
    row)."""
    n_rows, n_h = xs.shape
    n_e, _, n_f = out.shape
    if not (n_e and n_h and n_f):
        return
    _spans_kernel[(n_e,)](Ptr(group), Ptr(scratch), n_rows, e0, group.strides[0], BP=BLOCK)
    ieee = xs.dtype == "float32"
    args = (Ptr(xs), Ptr(dy), Ptr(group), Ptr(scratch), Ptr(out), n_h, n_f, e0, xs.strides[0], xs.strides[1],
            dy.strides[0], dy.strides[1], group.strides[0], out.strides[0], out.strides[1], out.strides[2])

    def launch(cfg: tuple[int, ...]) -> None:
        bm, bn, bk, warps, stages = cfg
        grid = (triton.cdiv(n_h, bm) * triton.cdiv(n_f, bn), n_e)
        _grouped_wg_kernel[grid](*args, BM=bm, BN=bn, BK=bk, GROUP_M=8, IEEE=ieee, num_warps=warps,
                                 num_stages=stages)

    key = ("grouped_weight_grad", _shape_class(n_rows), n_h, n_f, n_e, xs.dtype)
    launch(_pick(key, IEEE_CONFIGS if ieee else CONFIGS, launch))


@triton.jit
def _capacity_kernel(ids_ptr, out_ptr, n_pairs, experts, capacity, WHAT: tl.constexpr, BLOCK_P: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1)  # experts: the pairs whose id no expert holds (dropped)
    seen = 0
    for p0 in range(0, n_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        key, _, mine, rank = _pairs(ids_ptr + g * n_pairs, p, n_pairs, experts, e)
        rank = seen + rank
        kept = mine & (rank < capacity) & (key < experts)
        slot = e.to(tl.int64) * capacity + rank
        if WHAT == 0:  # slot of each pair, -1 where dropped
            tl.store(out_ptr + g * n_pairs + p, tl.where(kept, slot, -1), mask=mine)
        else:  # the pair of each slot
            tl.store(out_ptr + g * experts * capacity + slot, p.to(tl.int64), mask=kept)
        seen += tl.sum(mine.to(tl.int32), axis=0)
    if WHAT == 1:
        if e < experts:  # the expert's slots past its last pair hold none
            row = out_ptr + g * experts * capacity + e.to(tl.int64) * capacity
            for c0 in range(0, capacity, BLOCK_P):
                c = c0 + tl.arange(0, BLOCK_P)
                tl.store(row + c, tl.full([BLOCK_P], -1, tl.int64), mask=(c < capacity) & (c >= seen))


def capacity_route(ids: DevBuf, out: DevBuf, experts: int, capacity: int, what: str) -> None:
    """``out`` = the ``what`` map (slot or pair) of the router's choices per group ``ids [g, t, k]``
    (contiguous), each expert taking ``capacity`` pairs of a group first come first served."""
    groups = ids.shape[0]
    n = ids.size // groups if groups else 0
    if groups and (n or what == "pair"):
        _capacity_kernel[(groups, experts + (what == "slot"))](Ptr(ids), Ptr(out), n, experts, capacity,
                                                              WHAT=("slot", "pair").index(what),
                                                              BLOCK_P=BLOCK)


@triton.jit
def _routed_gather_kernel(x_ptr, idx_ptr, out_ptr, n_m, n_h, per, r0, n_r, sxg, sxr, sxh, sig, sim, sog, som, soh,
                          BM: tl.constexpr, BH: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    ms = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    hs = tl.program_id(2).to(tl.int64) * BH + tl.arange(0, BH)
    mmask = ms < n_m
    hmask = hs < n_h
    index = tl.load(idx_ptr + g * sig + ms * sim, mask=mmask, other=-1).to(tl.int64)
    src = tl.where(index >= 0, index // per - r0, -1)
    mine = mmask & (src >= 0) & (src < n_r)
    rows = tl.load(x_ptr + g * sxg + src[:, None] * sxr + hs[None, :] * sxh, mask=mine[:, None] & hmask[None, :],
                   other=0.0)
    tl.store(out_ptr + g * sog + ms[:, None] * som + hs[None, :] * soh, rows, mask=mmask[:, None] & hmask[None, :])


def routed_gather(x: DevBuf, index: DevBuf, out: DevBuf, per: int, r0: int) -> None:
    """``out[g, i] = x[g, index[g, i] // per - r0]`` where that row is in the block, zeros elsewhere."""
    groups, n_m, n_h = out.shape
    if not (groups and n_m and n_h):
        return
    bh = min(256, triton.next_power_of_2(n_h))
    bm = max(1, min(64, 8192 // bh))
    grid = (groups, triton.cdiv(n_m, bm), triton.cdiv(n_h, bh))
    _routed_gather_kernel[grid](Ptr(x), Ptr(index), Ptr(out), n_m, n_h, per, r0, x.shape[1], *x.strides,
                                *index.strides, *out.strides, BM=bm, BH=bh)

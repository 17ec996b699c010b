"""Routing kernels: top-k positions along a row, the values at given positions, and one-hot rows.

``topk`` gives each row to one program, which holds the row whole (the launcher sends longer rows to the host) and
picks the best remaining entry ``k`` times: NaN above every number (first when the largest are asked for,
last otherwise), and among equal values the lower position, as the operator's NumPy kernel ranks them.
``one_hot`` writes ``out[r, j] = ids[r] == c0 + j`` over a block of classes ``[c0, c0 + width)``."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr

__all__ = ["topk", "one_hot", "take_along"]

BLOCK = 1024


@triton.jit
def _topk_kernel(x_ptr, out_ptr, n, stride_row, K: tl.constexpr, LARGEST: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    valid = cols < n
    x = tl.load(x_ptr + row * stride_row + cols, mask=valid, other=0.0)
    if x_ptr.dtype.element_ty != tl.float64:
        x = x.to(tl.float32)  # 16-bit values compared as the float32 values they are (exact)
    nan = x != x
    key = x if LARGEST else -x
    left = valid
    for r in tl.static_range(K):
        numbers = left & ~nan
        nans = left & nan
        score = tl.where(numbers, key, float("-inf"))
        best = tl.max(score, axis=0)
        at_number = tl.min(tl.where(numbers & (score == best), cols, BLOCK_N), axis=0)
        at_nan = tl.min(tl.where(nans, cols, BLOCK_N), axis=0)
        has_number = at_number < BLOCK_N
        has_nan = at_nan < BLOCK_N
        if LARGEST:
            pick = tl.where(has_nan, at_nan, at_number)
        else:
            pick = tl.where(has_number, at_number, at_nan)
        tl.store(out_ptr + row * K + r, pick.to(tl.int64))
        left = left & (cols != pick)


def topk(x: DevBuf, out: DevBuf, k: int, largest: bool) -> None:
    """out[r, :] = the positions of row r's ``k`` best entries, best first (x and out contiguous)."""
    n = x.shape[-1]
    rows = out.size // k
    if rows:
        _topk_kernel[(rows,)](Ptr(x), Ptr(out), n, n, K=k, LARGEST=largest,
                              BLOCK_N=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)


@triton.jit
def _one_hot_kernel(ids_ptr, out_ptr, total, width, c0, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < total
    row = offs // width
    col = offs % width
    ids = tl.load(ids_ptr + row, mask=mask, other=-1)
    hit = ids == col + c0
    tl.store(out_ptr + offs, tl.where(hit, 1.0, 0.0).to(out_ptr.dtype.element_ty), mask=mask)


def one_hot(ids: DevBuf, out: DevBuf, c0: int) -> None:
    """out[r, j] = (ids[r] == c0 + j) in out's dtype; ids contiguous, out a contiguous [rows, width]."""
    total = out.size
    if total:
        _one_hot_kernel[(triton.cdiv(total, BLOCK),)](Ptr(ids), Ptr(out), total, out.shape[-1], c0, BLOCK_SIZE=BLOCK)


@triton.jit
def _take_along_kernel(x_ptr, ids_ptr, out_ptr, total, k, n_block, c0, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < total
    row = offs // k
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int64) - c0
    mine = mask & (ids >= 0) & (ids < n_block)
    x = tl.load(x_ptr + row * n_block + ids, mask=mine, other=0.0)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def take_along(x: DevBuf, ids: DevBuf, out: DevBuf, c0: int) -> None:
    """out[r, j] = x[r, ids[r, j] - c0] where the id lies in x's block of positions [c0, c0 + n), else 0
    (all contiguous)."""
    total = out.size
    if total:
        _take_along_kernel[(triton.cdiv(total, BLOCK),)](Ptr(x), Ptr(ids), Ptr(out), total, out.shape[-1],
                                                          x.shape[-1], c0, BLOCK_SIZE=BLOCK)

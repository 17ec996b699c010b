"""Data-movement kernels: strided box copy (decompose, recompose, slice, concat,
permute, reshape, copies between views), the log-sum-exp merge of attention
partials and the embedding gather.  Sum, max and min ⊕ use the strided binary
kernel of ``triton_elementwise``."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.core.dtypes import itemsize
from relational_tensors.kernels.common import DevBuf, Ptr, merge_dims, outer_split, pad4

__all__ = ["copy_box", "lse_merge", "embedding", "fill"]

BLOCK = 1024


@triton.jit
def index4(offs, size_1, size_2, size_3):
    """The 4-D index (i0, i1, i2, i3) of each flat offset into a row-major [*, size_1, size_2, size_3]."""
    i3 = offs % size_3
    rest = offs // size_3
    i2 = rest % size_2
    rest = rest // size_2
    return rest // size_1, rest % size_1, i2, i3


@triton.jit
def _copy4_kernel(src_ptr, dst_ptr, n,
                  size_1, size_2, size_3,
                  stride_s0, stride_s1, stride_s2, stride_s3,
                  stride_d0, stride_d1, stride_d2, stride_d3,
                  BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = index4(offs, size_1, size_2, size_3)
    src_off = i0 * stride_s0 + i1 * stride_s1 + i2 * stride_s2 + i3 * stride_s3
    dst_off = i0 * stride_d0 + i1 * stride_d1 + i2 * stride_d2 + i3 * stride_d3
    x = tl.load(src_ptr + src_off, mask=mask)
    tl.store(dst_ptr + dst_off, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy6_kernel(src_ptr, dst_ptr, n, size_1, size_2, size_3, size_4, size_5,
                  stride_s0, stride_s1, stride_s2, stride_s3, stride_s4, stride_s5,
                  stride_d0, stride_d1, stride_d2, stride_d3, stride_d4, stride_d5,
                  BLOCK_SIZE: tl.constexpr):
    # the permutations of a patch embedding (b, c, h/p, p, w/p, p) and other rank-5/6 views
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i5 = offs % size_5
    rest = offs // size_5
    i4 = rest % size_4
    rest = rest // size_4
    i3 = rest % size_3
    rest = rest // size_3
    i2 = rest % size_2
    rest = rest // size_2
    i1 = rest % size_1
    i0 = rest // size_1
    src_off = (i0 * stride_s0 + i1 * stride_s1 + i2 * stride_s2 + i3 * stride_s3 + i4 * stride_s4
               + i5 * stride_s5)
    dst_off = (i0 * stride_d0 + i1 * stride_d1 + i2 * stride_d2 + i3 * stride_d3 + i4 * stride_d4
               + i5 * stride_d5)
    x = tl.load(src_ptr + src_off, mask=mask)
    tl.store(dst_ptr + dst_off, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, rows, cols, col_blocks, size_1, size_2,
                      stride_s0, stride_s1, stride_s2, stride_d0, stride_d1, stride_d2,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # rows of a contiguous innermost dimension: index arithmetic once per row, vector loads along it;
    # a 1-D grid (row block, column block) so no grid dimension overflows on huge copies
    pid = tl.program_id(0).to(tl.int64)
    r = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    i2 = r % size_2
    rest = r // size_2
    i1 = rest % size_1
    i0 = rest // size_1
    src_row = i0 * stride_s0 + i1 * stride_s1 + i2 * stride_s2
    dst_row = i0 * stride_d0 + i1 * stride_d1 + i2 * stride_d2
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(src_ptr + src_row[:, None] + c[None, :], mask=mask)
    tl.store(dst_ptr + dst_row[:, None] + c[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


def copy_box(src: DevBuf, dst: DevBuf) -> None:
    """dst[...] = src[...] for two views of one shape (any strides; past rank 6 after merging, one launch
    per index of the leading dimensions)."""
    if src.shape != dst.shape:
        raise ValueError(f"copy_box needs equal shapes; got {src.shape} and {dst.shape}")
    n = src.size
    if n == 0:
        return
    if len(merge_dims(src.shape, src.strides, dst.strides)[0]) > 4:
        _copy_high_rank(src, dst)
        return
    shape, (ss, ds) = pad4(src.shape, src.strides, dst.strides)
    if ss[3] == 1 and ds[3] == 1 and shape[3] >= 64:  # the usual case: contiguous rows
        rows = shape[0] * shape[1] * shape[2]
        block_c = min(1024, triton.next_power_of_2(shape[3]))
        block_r = max(1, 4096 // block_c)
        col_blocks = triton.cdiv(shape[3], block_c)
        grid = (triton.cdiv(rows, block_r) * col_blocks,)
        _copy_rows_kernel[grid](Ptr(src), Ptr(dst), rows, shape[3], col_blocks, shape[1], shape[2], ss[0], ss[1],
                                ss[2], ds[0], ds[1], ds[2], BLOCK_R=block_r, BLOCK_C=block_c)
        return
    grid = (triton.cdiv(n, BLOCK),)
    _copy4_kernel[grid](Ptr(src), Ptr(dst), n, shape[1], shape[2], shape[3], *ss, *ds, BLOCK_SIZE=BLOCK)


def _copy_high_rank(src: DevBuf, dst: DevBuf) -> None:
    si, di = itemsize(src.dtype), itemsize(dst.dtype)
    for (so, do), shape, (ss, ds) in outer_split(src.shape, (src.strides, dst.strides), 6):
        n = shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * shape[5]
        _copy6_kernel[(triton.cdiv(n, BLOCK),)](Ptr(src.ptr + so * si, src.dtype), Ptr(dst.ptr + do * di, dst.dtype),
                                                n, *shape[1:], *ss, *ds, BLOCK_SIZE=BLOCK)


@triton.jit
def _lse_merge_kernel(o1_ptr, l1_ptr, o2_ptr, l2_ptr, o_ptr, l_ptr, n, d, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    row = offs // d
    l1 = tl.load(l1_ptr + row, mask=mask, other=float("-inf"))
    l2 = tl.load(l2_ptr + row, mask=mask, other=float("-inf"))
    top = tl.maximum(l1, l2)
    safe = tl.where(top == float("-inf"), 0.0, top)
    w1 = tl.exp(l1 - safe)
    w2 = tl.exp(l2 - safe)
    total = w1 + w2
    o1 = tl.load(o1_ptr + offs, mask=mask).to(tl.float32)
    o2 = tl.load(o2_ptr + offs, mask=mask).to(tl.float32)
    denom = tl.where(total > 0, total, 1.0)
    o = (o1 * w1 + o2 * w2) / denom
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=mask)
    lse = tl.where(total > 0, safe + tl.log(denom), float("-inf"))
    tl.store(l_ptr + row, lse, mask=mask & (offs % d == 0))


def lse_merge(a: tuple[DevBuf, DevBuf], b: tuple[DevBuf, DevBuf], out: tuple[DevBuf, DevBuf]) -> None:
    """Merge two attention partials (out [..., d], lse [...]) over disjoint key sets."""
    n = out[0].size
    d = out[0].shape[-1]
    if n:
        _lse_merge_kernel[(triton.cdiv(n, BLOCK),)](Ptr(a[0]), Ptr(a[1]), Ptr(b[0]), Ptr(b[1]), Ptr(out[0]),
                                                   Ptr(out[1]), n, d, BLOCK_SIZE=BLOCK)


@triton.jit
def _embedding_kernel(table_ptr, ids_ptr, out_ptr, d, v0, v1, stride_t, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.load(ids_ptr + row).to(tl.int64)
    mine = (idx >= v0) & (idx < v1)
    local = tl.where(mine, idx - v0, 0)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cmask = cols < d
        x = tl.load(table_ptr + local * stride_t + cols, mask=cmask & mine, other=0.0)
        tl.store(out_ptr + row * d + cols, x.to(out_ptr.dtype.element_ty), mask=cmask)


def embedding(table: DevBuf, ids: DevBuf, out: DevBuf, v0: int) -> None:
    """out[r, :] = table[ids[r] - v0, :] where v0 <= ids[r] < v0 + rows(table), else 0."""
    rows = ids.size
    d = table.shape[1]
    if rows:
        _embedding_kernel[(rows,)](Ptr(table), Ptr(ids), Ptr(out), d, v0, v0 + table.shape[0], table.strides[0],
                                   BLOCK_D=min(1024, triton.next_power_of_2(d)))


@triton.jit
def _put_rows_kernel(ids_ptr, values_ptr, out_ptr, n, d, r0, r1, stride_o, BLOCK_I: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    idx = tl.load(ids_ptr + i).to(tl.int64)
    # a later occurrence of the same id writes the row instead: the last one wins, as in NumPy and torch
    later = 0
    for j0 in range(0, n, BLOCK_I):
        j = j0 + tl.arange(0, BLOCK_I)
        other = tl.load(ids_ptr + j, mask=(j < n) & (j > i), other=-1).to(tl.int64)
        later += tl.sum((other == idx).to(tl.int32), axis=0)
    mine = (idx >= r0) & (idx < r1) & (later == 0)
    local = tl.where(mine, idx - r0, 0)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cmask = (cols < d) & ((cols * 0 + mine.to(tl.int32)) != 0)  # as a vector (Triton's interpreter needs it)
        v = tl.load(values_ptr + i * d + cols, mask=cmask, other=0.0)
        tl.store(out_ptr + local * stride_o + cols, v.to(out_ptr.dtype.element_ty), mask=cmask)


def put_rows(x: DevBuf, ids: DevBuf, values: DevBuf, out: DevBuf, r0: int) -> None:
    """out = x with row ``ids[i] - r0`` replaced by ``values[i]`` for the ids in [r0, r0 + rows(out)) (the
    last of repeated ids); x, values and out contiguous within a row, as [rows, d] and [n, d].  Where out
    is x itself (a state's block written in place) only the written rows move."""
    if not out.size:
        return
    if x.ptr != out.ptr:
        copy_box(x, out)
    n = ids.size
    rows = out.shape[0]
    d = out.size // rows
    if n and d:
        _put_rows_kernel[(n,)](Ptr(ids), Ptr(values), Ptr(out), n, d, r0, r0 + rows, out.strides[0],
                               BLOCK_I=min(1024, triton.next_power_of_2(n)),
                               BLOCK_D=min(1024, triton.next_power_of_2(d)))


@triton.jit
def _fill_kernel(out_ptr, n, value, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offs, tl.full([BLOCK_SIZE], value, tl.float32).to(out_ptr.dtype.element_ty), mask=offs < n)


def fill(out: DevBuf, value: float) -> None:
    """out[...] = value (contiguous)."""
    n = out.size
    if n:
        _fill_kernel[(triton.cdiv(n, BLOCK),)](Ptr(out), n, float(value), BLOCK_SIZE=BLOCK)

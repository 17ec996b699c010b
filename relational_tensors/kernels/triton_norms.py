"""Row-wise kernels: RMSNorm, LayerNorm, softmax and reductions; one program per row, fp32 inside (fp64 for
float64)."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, acc_type
from relational_tensors.kernels.scratch import MIDDLE_BLOCK, partial_dtype, reduce_chunks

__all__ = ["rmsnorm", "layernorm", "softmax", "row_reduce", "middle_reduce"]


def _block(d: int) -> int:
    return min(8192, triton.next_power_of_2(max(d, 16)))


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, d, eps, BLOCK_D: tl.constexpr, ONE_PASS: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * d
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(ACC)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC)
        tl.store(out_ptr + base + cols, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_D], dtype=ACC)
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + base + cols, mask=cols < d, other=0.0).to(ACC)
            acc += x * x
        r = tl.rsqrt(tl.sum(acc, axis=0) / d + eps)
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            mask = cols < d
            x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(ACC)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC)
            tl.store(out_ptr + base + cols, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: DevBuf, w: DevBuf, out: DevBuf, eps: float) -> None:
    """out = x / sqrt(mean(x², -1) + eps) * w, one read and one write of x when a row fits a block."""
    d = x.shape[-1]
    rows = x.size // d
    if rows:
        block = _block(d)
        _rmsnorm_kernel[(rows,)](Ptr(x), Ptr(w), Ptr(out), d, float(eps), BLOCK_D=block, ONE_PASS=block >= d,
                                 ACC=acc_type(x.dtype),
                                 num_warps=8 if block >= 2048 else 4)


@triton.jit
def _layernorm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, d, eps, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * d
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        acc += tl.load(x_ptr + base + cols, mask=cols < d, other=0.0).to(ACC)
    mean = tl.sum(acc, axis=0) / d
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + base + cols, mask=cols < d, other=0.0).to(ACC)
        diff = tl.where(cols < d, x - mean, 0.0)
        acc += diff * diff
    r = tl.rsqrt(tl.sum(acc, axis=0) / d + eps)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        mask = cols < d
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(ACC)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(ACC)
        tl.store(out_ptr + base + cols, ((x - mean) * r * w + b).to(out_ptr.dtype.element_ty), mask=mask)


def layernorm(x: DevBuf, w: DevBuf, b: DevBuf, out: DevBuf, eps: float) -> None:
    d = x.shape[-1]
    rows = x.size // d
    if rows:
        _layernorm_kernel[(rows,)](Ptr(x), Ptr(w), Ptr(b), Ptr(out), d, float(eps), BLOCK_D=_block(d),
                                   ACC=acc_type(x.dtype))


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, n, inner, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    # x viewed as [outer, n, inner]; one program per (outer, inner) line of n elements
    pid = tl.program_id(0).to(tl.int64)
    o = pid // inner
    i = pid % inner
    base = o * n * inner + i
    top = tl.full([BLOCK_N], float("-inf"), dtype=ACC)
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + base + cols * inner, mask=cols < n, other=float("-inf")).to(ACC)
        top = tl.maximum(top, x)
    m = tl.max(top, axis=0)
    acc = tl.zeros([BLOCK_N], dtype=ACC)
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + base + cols * inner, mask=cols < n, other=float("-inf")).to(ACC)
        acc += tl.exp(x - m)
    total = tl.sum(acc, axis=0)
    for c0 in range(0, n, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < n
        x = tl.load(x_ptr + base + cols * inner, mask=mask, other=float("-inf")).to(ACC)
        tl.store(out_ptr + base + cols * inner, (tl.exp(x - m) / total).to(out_ptr.dtype.element_ty), mask=mask)


def softmax(x: DevBuf, out: DevBuf, axis: int) -> None:
    """Softmax along ``axis`` of contiguous x."""
    n = x.shape[axis]
    inner = 1
    for s in x.shape[axis + 1:]:
        inner *= s
    lines = x.size // n if n else 0
    if lines:
        _softmax_kernel[(lines,)](Ptr(x), Ptr(out), n, inner, BLOCK_N=_block(n), ACC=acc_type(x.dtype))


OPS = {"sum": 0, "max": 1, "min": 2, "logsumexp": 3}  # a reduction's code (OP)
NEUTRAL = (0.0, float("-inf"), float("inf"), float("-inf"))  # what each reads where a block is masked


@triton.jit
def _fold(acc, total, x, OP: tl.constexpr):
    """One step of a running reduction per lane: a sum, max or min in ``acc``; for logsumexp (3) ``acc`` a
    running maximum and ``total`` the sum of exponentials below it."""
    if OP == 0:
        acc = acc + x
    elif OP == 1:
        acc = tl.maximum(acc, x)
    elif OP == 2:
        acc = tl.minimum(acc, x)
    else:
        top = tl.maximum(acc, x)
        safe = tl.where(top == float("-inf"), 0.0, top)
        total = total * tl.exp(acc - safe) + tl.exp(x - safe)
        acc = top
    return acc, total


@triton.jit
def _row_reduce_kernel(x_ptr, out_ptr, n, chunk, chunks, count, OP: tl.constexpr, NEUTRAL: tl.constexpr,
                       BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """out[row * chunks + c] = reduce(x[row, c * chunk : (c + 1) * chunk]) (a logsumexp chunk gives its
    own log-sum-exp, a sum is divided by ``count``)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    start = part * chunk
    end = tl.minimum(start + chunk, n)
    acc = tl.full([BLOCK_N], NEUTRAL, dtype=ACC)
    total = tl.zeros([BLOCK_N], dtype=ACC)
    for c0 in range(start, end, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        xv = tl.load(x_ptr + row * n + cols, mask=cols < end, other=NEUTRAL).to(ACC)
        acc, total = _fold(acc, total, xv, OP)
    if OP == 0:
        r = tl.sum(acc, axis=0) / count  # an integer count: exact up to 2**24 in float32
    elif OP == 1:
        r = tl.max(acc, axis=0)
    elif OP == 2:
        r = tl.min(acc, axis=0)
    else:
        top = tl.max(acc, axis=0)
        safe = tl.where(top == float("-inf"), 0.0, top)
        r = safe + tl.log(tl.sum(total * tl.exp(acc - safe), axis=0))
    tl.store(out_ptr + row * chunks + part, r.to(out_ptr.dtype.element_ty))


def row_reduce(x: DevBuf, out: DevBuf, op: str, count: int = 1, partials: DevBuf | None = None) -> None:
    """out[r] = reduce(x[r, :]) for contiguous x viewed as [rows, n]; op in sum, max, min, logsumexp (a sum is
    divided by ``count``: a mean passes the length of the whole reduced axes).  Few long rows are reduced in
    :func:`reduce_chunks` chunks into ``partials`` (at least rows x chunks of :func:`partial_dtype`), then
    the partials of each row in a second pass, in a fixed order: the same bits every run."""
    rows = out.size
    n = x.size // rows if rows else 0
    if not (rows and n):
        return
    code = OPS[op]
    kind = dict(OP=code, NEUTRAL=NEUTRAL[code], ACC=acc_type(x.dtype))
    chunks = reduce_chunks(rows, n)
    if chunks == 1 or partials is None:
        _row_reduce_kernel[(rows, 1)](Ptr(x), Ptr(out), n, n, 1, int(count), BLOCK_N=_block(n), **kind)
        return
    chunk = -(-n // chunks)
    block = _block(chunk)
    chunk = -(-chunk // block) * block  # whole blocks per chunk
    chunks = -(-n // chunk)
    parts = DevBuf(partials.ptr, (rows, chunks), partial_dtype(x.dtype), partials.device)
    _row_reduce_kernel[(rows, chunks)](Ptr(x), Ptr(parts), n, chunk, chunks, 1, BLOCK_N=block, **kind)
    _row_reduce_kernel[(rows, 1)](Ptr(parts), Ptr(out), chunks, chunks, 1, int(count), BLOCK_N=_block(chunks),
                                  **kind)


@triton.jit
def _middle_reduce_kernel(x_ptr, out_ptr, n, inner, count, OP: tl.constexpr, NEUTRAL: tl.constexpr,
                          BLOCK_I: tl.constexpr, ACC: tl.constexpr):
    """out[o, i] = reduce(x[o, :, i]) over contiguous x [outer, n, inner]: each program a block of ``i`` of
    one ``o``, the reduced axis walked in order (coalesced loads, the same bits every run)."""
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < inner
    base = x_ptr + o * n * inner + cols
    acc = tl.full([BLOCK_I], NEUTRAL, dtype=ACC)
    total = tl.zeros([BLOCK_I], dtype=ACC)
    for j in range(0, n):
        acc, total = _fold(acc, total, tl.load(base + j * inner, mask=mask, other=NEUTRAL).to(ACC), OP)
    if OP == 0:
        r = acc / count
    elif OP == 3:
        r = tl.where(acc == float("-inf"), 0.0, acc) + tl.log(total)
    else:
        r = acc
    tl.store(out_ptr + o * inner + cols, r.to(out_ptr.dtype.element_ty), mask=mask)


def middle_reduce(x: DevBuf, out: DevBuf, op: str, outer: int, n: int, inner: int, count: int = 1) -> None:
    """out[o, i] = reduce(x[o, :, i]) for contiguous x viewed as [outer, n, inner] (a reduction over axes that
    are not last, without moving them last); ops and ``count`` as :func:`row_reduce`."""
    if not (outer and n and inner):
        return
    block = min(MIDDLE_BLOCK, triton.next_power_of_2(inner))
    _middle_reduce_kernel[(outer, triton.cdiv(inner, block))](Ptr(x), Ptr(out), n, inner, int(count), OP=OPS[op],
                                                              NEUTRAL=NEUTRAL[OPS[op]], BLOCK_I=block,
                                                              ACC=acc_type(x.dtype), num_warps=4 if block >= 512 else 2)

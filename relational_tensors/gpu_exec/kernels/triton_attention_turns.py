"""The one-pass attention backward's order of additions (``triton_attention_grad.attention_dkvq``): which
key tiles visit each query tile, and the turns the key tiles take to add their parts of its dq.

A key tile's program visits the query tiles in ``_span`` of its keys' query ranges; both ends of those
ranges grow with the key, so the key tiles that visit one query tile are one run of consecutive tiles,
[first, last].  ``_visits_kernel`` finds them per query tile (and zeroes its locks and the programs'
ticket counter); in ``_dq_turn`` key tile n waits until the tile's lock has counted last - n
predecessors, adds its part to the float32 accumulator, and passes the turn on; tile ``first`` writes dq.

The turns run from the last key tile down.  A program walks its query tiles upward from the first one
its keys reach, and under a causal mask key tile n + 1 starts one query tile later than tile n: with the
turns going down, tile n + 1 reaches each query tile a step before tile n does, so in steady state no
tile waits.  Going up, each tile would reach a query tile a step before its predecessor there and wait
for it at every one, for every query head of its group: a wavefront that ran the key tiles nearly in
series (measured 4.6 times slower than the dq pass and the dk|dv pass apart, README "Decisions").
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__: list[str] = []


@triton.jit
def _span(lo_min, lo_max, hi_min, hi_max, n, BLOCK: tl.constexpr):
    """The tiles of ``BLOCK`` positions in [0, n) that a set of ranges [lo, hi) reaches: some range
    sees [start, end); every range sees the tiles in [full_lo, full_hi) whole."""
    start = (tl.maximum(lo_min, 0) // BLOCK) * BLOCK
    end = tl.minimum(hi_max, n)
    full_lo = tl.maximum(((tl.maximum(lo_max, 0) + BLOCK - 1) // BLOCK) * BLOCK, start)
    full_hi = tl.maximum((tl.minimum(hi_min, n) // BLOCK) * BLOCK, full_lo)
    full_hi = tl.minimum(full_hi, tl.maximum(end, full_lo))
    return start, end, full_lo, full_hi


@triton.jit
def _dq_turn(dqp, rows, m0, n_tile, dq_base, stride_ds, acc_base, lock_base, first_ptr, last_ptr, sq, scale, dd,
             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Add this key tile's part of query tile m0's dq in descending key-tile order: wait until the key tiles
    above it that see the tile have added theirs (the tile's lock counts them), add, and pass the turn on;
    the first key tile that sees it writes dq itself.  The sum's order is fixed, so dq has the same bits on
    every run."""
    m = m0 // BLOCK_M
    turn = tl.load(last_ptr + m) - n_tile
    lock = lock_base + m
    mask = (rows[:, None] < sq) & (dd[None, :] < D)
    acc_ptrs = acc_base + rows[:, None].to(tl.int64) * BLOCK_D + dd[None, :]
    if turn > 0:
        seen = tl.atomic_add(lock, 0, sem="acquire")
        while seen != turn:
            seen = tl.atomic_add(lock, 0, sem="acquire")
        tl.debug_barrier()  # no thread reads before the turn is this program's
        dqp += tl.load(acc_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    if n_tile == tl.load(first_ptr + m):
        dqp = dqp * scale
        tl.store(dq_base + rows[:, None].to(tl.int64) * stride_ds + dd[None, :], dqp.to(dq_base.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(acc_ptrs, dqp, mask=mask, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's part stored before the turn passes
        tl.atomic_xchg(lock, turn + 1, sem="release")


@triton.jit
def _visits_kernel(kqlo_ptr, kqhi_ptr, first_ptr, last_ptr, lock_ptr, ticket_ptr, dq_ptr, sq, skv, hq, q_offset,
                   k_offset, n_bh,
                   stride_db, stride_ds, stride_dh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Per query tile m of ``_dkv_kernel`` with WRITE_DQ: the first and last key tiles that visit it (the key
    tiles whose query span, ``_span`` as the kernel computes it, holds row m·BLOCK_M; one range of key tiles,
    as both ends of the spans grow with the key), and its locks set to zero for every (batch, head); the first
    program sets the tickets back to zero.  A tile that no key tile visits sees none of these keys: its dq
    rows are zeros, written here."""
    m = tl.program_id(0)
    if m == 0:
        tl.store(ticket_ptr, 0)
    m0 = m * BLOCK_M
    n_blocks = tl.cdiv(skv, BLOCK_N)
    first = tl.full([CHUNK], 2147483647, tl.int32)
    last = tl.full([CHUNK], -1, tl.int32)
    for c in range(0, n_blocks, CHUNK):
        n = c + tl.arange(0, CHUNK)
        valid = n < n_blocks
        key0 = k_offset + tl.where(valid, n * BLOCK_N, 0)
        key1 = k_offset + tl.where(valid, tl.minimum(n * BLOCK_N + BLOCK_N, skv) - 1, 0)
        lo0 = tl.load(kqlo_ptr + key0) - q_offset
        lo1 = tl.load(kqlo_ptr + key1) - q_offset
        hi0 = tl.load(kqhi_ptr + key0) - q_offset
        hi1 = tl.load(kqhi_ptr + key1) - q_offset
        start, end, _, _ = _span(lo0, lo1, hi0, hi1, sq, BLOCK_M)
        visits = valid & (start <= m0) & (m0 < end)
        first = tl.minimum(first, tl.where(visits, n, 2147483647))
        last = tl.maximum(last, tl.where(visits, n, -1))
    tl.store(first_ptr + m, tl.min(first, axis=0))
    tl.store(last_ptr + m, tl.max(last, axis=0))
    if tl.max(last, axis=0) < 0:
        rows = m0 + tl.arange(0, BLOCK_M)
        dd = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < sq) & (dd[None, :] < D)
        for bh in range(0, n_bh):
            b = bh // hq
            h = bh % hq
            tl.store(dq_ptr + b.to(tl.int64) * stride_db + rows[:, None].to(tl.int64) * stride_ds + h * stride_dh
                     + dd[None, :], tl.zeros([BLOCK_M, BLOCK_D], dq_ptr.dtype.element_ty), mask=mask)
    m_tiles = tl.cdiv(sq, BLOCK_M)
    for c in range(0, n_bh, CHUNK):
        bh = c + tl.arange(0, CHUNK)
        tl.store(lock_ptr + bh.to(tl.int64) * m_tiles + m, tl.zeros([CHUNK], tl.int32), mask=bh < n_bh)

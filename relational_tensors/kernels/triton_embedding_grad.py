"""The embedding table's gradient over one block: ``out[v - v0, :] = Σ dy[t, :]`` over the tokens t whose id v
lies in the block's vocabulary rows, summed in token order, so every run gives the same bits (no float
atomics).

The tokens are grouped by id with a sort of the keys ``(id - v0) · T + t`` (T tokens; ids outside the block
sort last): each block of keys is sorted in registers, then sorted runs are merged pairwise by a bitonic
network (a mirrored compare-exchange, half-cleaners while their distance spans blocks, and a sort of each
block).  Then the rows of dy of each id's run of keys are added in token order, a fixed number of keys
at a time, in pieces of at most ``RUN_CHUNK`` keys that start at a run's first key or at a multiple of
``RUN_CHUNK`` (so a run of many tokens, as a small vocabulary's, such as T5's 32 relative-position
buckets over a million positions, is summed by many programs, not by one walking it all).  A run within
one piece writes its row at once; a longer one's pieces write float32 partial rows to scratch, and a
second pass adds them, in order, into the row.  The order of additions depends only on the ids: the same
bits every run, no atomics; each row is written once, so a 16-bit table is rounded once, from a float32
sum, as the NumPy kernel rounds it.  Rows no token names are zero."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.kernels import scratch as scratch_sizes
from relational_tensors.kernels.common import DevBuf, Ptr, acc_type
from relational_tensors.kernels.scratch import padded_tokens

__all__ = ["embedding_grad"]

SORT_BLOCK = 1024   # keys sorted in registers by one program
BLOCK_E = 128       # embedding columns per program of the sums
BLOCK_K = 16        # keys of a run added per step
SENTINEL = 2**63 - 1


@triton.jit
def _keys_kernel(ids_ptr, keys_ptr, n_tok, n_pad, v0, n_v, BLOCK: tl.constexpr):
    # keys of one block of positions, sorted: (id - v0) · n_tok + t, the sentinel for ids not in [v0, v0 + n_v)
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pmask = pos < n_tok
    ids = tl.load(ids_ptr + pos, mask=pmask, other=-1).to(tl.int64)
    local = ids - v0
    mine = pmask & (local >= 0) & (local < n_v)
    keys = tl.where(mine, local * n_tok + pos, 9223372036854775807)
    keys = tl.sort(keys)
    tl.store(keys_ptr + pos, keys, mask=pos < n_pad)


@triton.jit
def _mirror_kernel(keys_ptr, run, BLOCK: tl.constexpr):
    # merge step of two sorted runs of length ``run``: compare-exchange i with its mirror in the pair of runs
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # one per pair of elements
    pair = q // run
    i = q % run
    a = pair * 2 * run + i
    b = pair * 2 * run + 2 * run - 1 - i
    ka = tl.load(keys_ptr + a)
    kb = tl.load(keys_ptr + b)
    tl.store(keys_ptr + a, tl.minimum(ka, kb))
    tl.store(keys_ptr + b, tl.maximum(ka, kb))


@triton.jit
def _half_clean_kernel(keys_ptr, dist, BLOCK: tl.constexpr):
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = (q // dist) * 2 * dist + q % dist
    b = a + dist
    ka = tl.load(keys_ptr + a)
    kb = tl.load(keys_ptr + b)
    tl.store(keys_ptr + a, tl.minimum(ka, kb))
    tl.store(keys_ptr + b, tl.maximum(ka, kb))


@triton.jit
def _block_sort_kernel(keys_ptr, BLOCK: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(keys_ptr + pos, tl.sort(tl.load(keys_ptr + pos)))


@triton.jit
def _row_of(keys_ptr, at, n_tok):
    """The id row of the sorted key at ``at`` (< n_tok), -1 for the sentinel."""
    key = tl.load(keys_ptr + at)
    return tl.where(key == 9223372036854775807, -1, key // n_tok)


@triton.jit
def _position(keys_ptr, i, n_tok, CHUNK):
    """Sorted position ``i``: its id row, whether its key is an id's, whether it starts the id's run, its
    chunk, and whether the run goes on past the chunk's end."""
    key = tl.load(keys_ptr + i)
    row = key // n_tok
    prev = tl.load(keys_ptr + i - 1, mask=i > 0, other=-1)
    valid = key != 9223372036854775807
    starts = valid & ((i == 0) | (prev // n_tok != row))
    chunk = i // CHUNK
    boundary = (chunk + 1) * CHUNK
    on = boundary < n_tok
    goes_on = on & (_row_of(keys_ptr, tl.where(on, boundary, 0), n_tok) == row)
    return row, valid, starts, chunk, goes_on


@triton.jit
def _run_sum_kernel(keys_ptr, dy_ptr, out_ptr, part_ptr, n_tok, n_e, CHUNK, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, ACC: tl.constexpr):
    # a program per sorted position; one that starts a run, or sits at a multiple of CHUNK inside one, sums
    # that id's rows of dy from there up to the run's end or the next multiple of CHUNK, BLOCK_K keys at a
    # time (the grouping, so the order of additions, depends only on the ids)
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < n_e
    row, valid, starts, chunk, goes_on = _position(keys_ptr, i, n_tok, CHUNK)
    aligned = valid & (i % CHUNK == 0)
    if starts | aligned:
        limit = tl.minimum((chunk + 1) * CHUNK, n_tok)
        acc = tl.zeros([BLOCK_E], dtype=ACC)
        j = i
        more = True
        while more:
            at = j + tl.arange(0, BLOCK_K)
            k = tl.load(keys_ptr + at, mask=at < limit, other=9223372036854775807)
            same = (at < limit) & (k // n_tok == row)  # a prefix of these keys: they are sorted
            rows = tl.load(dy_ptr + (k % n_tok)[:, None] * n_e + cols[None, :], mask=same[:, None] & cmask[None, :],
                           other=0.0).to(ACC)
            acc += tl.sum(rows, axis=0)
            j += BLOCK_K
            more = tl.min(same.to(tl.int32), axis=0) == 1  # every key was this id's: the piece may go on
        if starts & (goes_on == 0):  # the whole run: its row
            tl.store(out_ptr + row * n_e + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        else:  # a piece: the chunk's first (aligned) or the one that starts inside it and goes on
            which = tl.where(aligned, 0, 1)
            tl.store(part_ptr + (chunk * 2 + which) * n_e + cols, acc, mask=cmask)


@triton.jit
def _run_join_kernel(keys_ptr, out_ptr, part_ptr, n_tok, n_e, CHUNK, BLOCK_E: tl.constexpr, ACC: tl.constexpr):
    # a program per sorted position; one that starts a run that goes past its chunk adds the run's pieces in
    # order: its own (aligned or not), then the first piece of every later chunk the run reaches
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < n_e
    row, _, starts, chunk, goes_on = _position(keys_ptr, i, n_tok, CHUNK)
    if starts & goes_on:
        which = tl.where(i % CHUNK == 0, 0, 1)
        acc = tl.load(part_ptr + (chunk * 2 + which) * n_e + cols, mask=cmask, other=0.0).to(ACC)
        c = chunk + 1
        more = True
        while more:
            acc += tl.load(part_ptr + (c * 2) * n_e + cols, mask=cmask, other=0.0).to(ACC)
            nxt = (c + 1) * CHUNK
            inside = nxt < n_tok
            more = inside & (_row_of(keys_ptr, tl.where(inside, nxt, 0), n_tok) == row)
            c += 1
        tl.store(out_ptr + row * n_e + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def embedding_grad(ids: DevBuf, dy: DevBuf, out: DevBuf, scratch: DevBuf, v0: int) -> None:
    """out [n_v, n_e] = the rows v0.. of the table's gradient from contiguous ids [...] and dy [..., n_e]:
    row v - v0 sums dy over the tokens whose id is v, in token order.  ``scratch`` holds
    ``kernels.scratch.embedding_grad_scratch(ids.size)`` int64 elements."""
    from relational_tensors.kernels.triton_copy import fill

    n_tok = ids.size
    n_v, n_e = out.shape
    if dy.shape != (*ids.shape, n_e):
        raise ValueError(f"embedding_grad needs dy of shape ids.shape + ({n_e},) = {(*ids.shape, n_e)}; got "
                         f"{dy.shape}")
    n_pad = padded_tokens(n_tok)
    need = scratch_sizes.embedding_grad_scratch(n_tok, n_e)
    if scratch.nbytes < need * 8:
        raise ValueError(f"embedding_grad needs {need} 8-byte elements of scratch for {n_tok} ids of {n_e} columns; "
                         f"got {scratch.size} {scratch.dtype}")
    fill(out, 0.0)
    if not (n_tok and n_v and n_e):
        return
    keys = Ptr(scratch.ptr, "int64")
    block = min(SORT_BLOCK, n_pad)
    _keys_kernel[(n_pad // block,)](Ptr(ids), keys, n_tok, n_pad, int(v0), n_v, BLOCK=block)
    run = block
    while run < n_pad:  # merge sorted runs of ``run`` keys into runs of twice that
        pairs = n_pad // 2
        step = min(SORT_BLOCK, pairs)
        _mirror_kernel[(pairs // step,)](keys, run, BLOCK=step)
        dist = run // 2
        while dist >= block:
            _half_clean_kernel[(pairs // step,)](keys, dist, BLOCK=step)
            dist //= 2
        _block_sort_kernel[(n_pad // block,)](keys, BLOCK=block)
        run *= 2
    acc = acc_type(dy.dtype)
    parts = Ptr(scratch.ptr + n_pad * 8, "float64" if acc == tl.float64 else "float32")  # after the keys
    grid = (n_tok, triton.cdiv(n_e, BLOCK_E))
    chunk = scratch_sizes.RUN_CHUNK
    _run_sum_kernel[grid](keys, Ptr(dy), Ptr(out), parts, n_tok, n_e, chunk, BLOCK_K=BLOCK_K, BLOCK_E=BLOCK_E,
                          ACC=acc)
    if n_tok > chunk:  # runs that cross a chunk's end: their pieces added
        _run_join_kernel[grid](keys, Ptr(out), parts, n_tok, n_e, chunk, BLOCK_E=BLOCK_E, ACC=acc)

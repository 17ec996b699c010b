"""The embedding table's gradient over one block: ``out[v - v0, :] = Σ dy[t, :]`` over the tokens t whose id v
lies in the block's vocabulary rows, summed in token order, so every run gives the same bits (no float
atomics).

The tokens are grouped by id with a sort of the keys ``(id - v0) · T + t`` (T tokens; ids outside the block
sort last): each block of keys is sorted in registers, then sorted runs are merged pairwise by a bitonic
network (a mirrored compare-exchange, half-cleaners while their distance spans blocks, and a sort of each
block).  Then one program per sorted position that starts a run of one id adds that run's rows of dy,
a fixed number of keys at a time in token order (the keys keep it within an id), and writes the row
once, so a 16-bit table is rounded once, from a float32 sum, as the NumPy kernel rounds it.  Rows no
token names are zero."""

from __future__ import annotations

import triton
import triton.language as tl

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
def _run_sum_kernel(keys_ptr, dy_ptr, out_ptr, n_tok, n_e, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                    ACC: tl.constexpr):
    # a program per sorted position; the one that starts the run of an id sums that id's rows of dy, BLOCK_K
    # keys at a time from the run's start (the grouping, so the order of additions, depends only on the ids)
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < n_e
    key = tl.load(keys_ptr + i)
    row = key // n_tok
    prev = tl.load(keys_ptr + i - 1, mask=i > 0, other=-1)
    starts = (key != 9223372036854775807) & ((i == 0) | (prev // n_tok != row))
    if starts:
        acc = tl.zeros([BLOCK_E], dtype=ACC)
        j = i
        more = True
        while more:
            at = j + tl.arange(0, BLOCK_K)
            k = tl.load(keys_ptr + at, mask=at < n_tok, other=9223372036854775807)
            same = (at < n_tok) & (k // n_tok == row)  # a prefix of these keys: they are sorted
            rows = tl.load(dy_ptr + (k % n_tok)[:, None] * n_e + cols[None, :], mask=same[:, None] & cmask[None, :],
                           other=0.0).to(ACC)
            acc += tl.sum(rows, axis=0)
            j += BLOCK_K
            more = tl.min(same.to(tl.int32), axis=0) == 1  # every key was this id's: the run may go on
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
    if scratch.nbytes < n_pad * 8:
        raise ValueError(f"embedding_grad needs {n_pad} int64 elements of scratch for {n_tok} ids; got "
                         f"{scratch.size} {scratch.dtype}")
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
    _run_sum_kernel[(n_tok, triton.cdiv(n_e, BLOCK_E))](keys, Ptr(dy), Ptr(out), n_tok, n_e, BLOCK_K=BLOCK_K,
                                                        BLOCK_E=BLOCK_E, ACC=acc_type(dy.dtype))

"""Cross-entropy over a block of the vocabulary: the per-token loss partial ``cross_entropy``, the logits'
gradient ``cross_entropy_grad`` and the ``token_count`` of the targets that count.  fp32 inside (fp64 for
float64).

A block reads only its own slice of the logits: the loss partial gathers one logit per token (the target's,
where this block holds it), and the gradient recomputes ``exp(logits - lse)`` tile by tile from the row's
log-sum-exp, so no float32 copy of the block's logits is made.  A target outside ``[0, vocab)`` that is
not ``ignore_index`` gives NaN (the NumPy kernels refuse it with an error; a kernel cannot raise)."""

from __future__ import annotations

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, acc_type

__all__ = ["cross_entropy", "cross_entropy_grad", "token_count"]

BLOCK_T = 256    # tokens per program of the loss
BLOCK_V = 1024   # vocabulary entries per program of the gradient


@triton.jit
def _target_state(t, vocab, ignore, HAS_IGNORE: tl.constexpr):
    """(whether the target counts, whether it is out of range and not ignored)."""
    if HAS_IGNORE:
        valid = t != ignore
    else:
        valid = t == t
    bad = valid & ((t < 0) | (t >= vocab))
    return valid & ~bad, bad


@triton.jit
def _cross_entropy_kernel(logits_ptr, lse_ptr, tgt_ptr, out_ptr, n_tok, n_v, v0, vocab, ignore,
                          HAS_IGNORE: tl.constexpr, ADD_LSE: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    # out = -logits[target] where this block holds the target, + lse in the block holding entry 0
    tok = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tmask = tok < n_tok
    t = tl.load(tgt_ptr + tok, mask=tmask, other=0).to(tl.int64)
    valid, bad = _target_state(t, vocab, ignore, HAS_IGNORE)
    mine = tmask & valid & (t >= v0) & (t < v0 + n_v)
    picked = tl.load(logits_ptr + tok * n_v + (t - v0), mask=mine, other=0.0).to(ACC)
    out = tl.where(mine, -picked, 0.0)
    if ADD_LSE:
        lse = tl.load(lse_ptr + tok, mask=tmask, other=0.0).to(ACC)
        out = out + tl.where(valid, lse, 0.0)
    out = tl.where(bad, float("nan"), out)
    tl.store(out_ptr + tok, out.to(out_ptr.dtype.element_ty), mask=tmask)


def cross_entropy(logits: DevBuf, lse: DevBuf, targets: DevBuf, out: DevBuf, v0: int, vocab: int,
                  ignore_index: int | None) -> None:
    """The loss partial of one block: contiguous logits [..., n_v] holding vocabulary entries [v0, v0 + n_v) of
    ``vocab``, lse, targets and out [...]."""
    if logits.shape[:-1] != targets.shape or lse.shape != targets.shape or out.shape != targets.shape:
        raise ValueError(f"cross_entropy needs logits [..., v] and lse, targets, out [...]; got {logits.shape}, "
                         f"{lse.shape}, {targets.shape}, {out.shape}")
    n_tok = targets.size
    if n_tok:
        _cross_entropy_kernel[(triton.cdiv(n_tok, BLOCK_T),)](
            Ptr(logits), Ptr(lse), Ptr(targets), Ptr(out), n_tok, logits.shape[-1], int(v0), int(vocab),
            0 if ignore_index is None else int(ignore_index), HAS_IGNORE=ignore_index is not None, ADD_LSE=v0 == 0,
            BLOCK=BLOCK_T, ACC=acc_type(logits.dtype))


@triton.jit
def _cross_entropy_grad_kernel(logits_ptr, lse_ptr, tgt_ptr, dloss_ptr, out_ptr, n_v, v0, vocab, ignore,
                               HAS_IGNORE: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    # out[tok, v] = (exp(logits - lse) - [v0 + v == target]) · dloss, zero at ignored targets
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < n_v
    t = tl.load(tgt_ptr + tok).to(tl.int64)
    valid, bad = _target_state(t, vocab, ignore, HAS_IGNORE)
    lse = tl.load(lse_ptr + tok).to(ACC)
    dl = tl.where(valid, tl.load(dloss_ptr + tok).to(ACC), 0.0)
    dl = tl.where(bad, float("nan"), dl)
    x = tl.load(logits_ptr + tok * n_v + cols, mask=cmask, other=0.0).to(ACC)
    g = tl.exp(x - lse) - tl.where(v0 + cols == t, 1.0, 0.0)
    tl.store(out_ptr + tok * n_v + cols, (g * dl).to(out_ptr.dtype.element_ty), mask=cmask)


def cross_entropy_grad(logits: DevBuf, lse: DevBuf, targets: DevBuf, dloss: DevBuf, out: DevBuf, v0: int, vocab: int,
                       ignore_index: int | None) -> None:
    """The logits' gradient of one block: contiguous logits and out [..., n_v] (vocabulary entries from v0),
    lse, targets and dloss [...]."""
    if logits.shape != out.shape or logits.shape[:-1] != targets.shape or lse.shape != targets.shape or \
            dloss.shape != targets.shape:
        raise ValueError(f"cross_entropy_grad needs logits and out [..., v] and lse, targets, dloss [...]; got "
                         f"{logits.shape}, {out.shape}, {lse.shape}, {targets.shape}, {dloss.shape}")
    n_tok, n_v = targets.size, logits.shape[-1]
    if n_tok and n_v:
        block = min(BLOCK_V, triton.next_power_of_2(n_v))
        _cross_entropy_grad_kernel[(n_tok, triton.cdiv(n_v, block))](
            Ptr(logits), Ptr(lse), Ptr(targets), Ptr(dloss), Ptr(out), n_v, int(v0), int(vocab),
            0 if ignore_index is None else int(ignore_index), HAS_IGNORE=ignore_index is not None, BLOCK=block,
            ACC=acc_type(logits.dtype))


@triton.jit
def _token_count_kernel(tgt_ptr, out_ptr, n, ignore, HAS_IGNORE: tl.constexpr, BLOCK: tl.constexpr,
                        ACC: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < n
        if HAS_IGNORE:
            t = tl.load(tgt_ptr + offs, mask=mask, other=0).to(tl.int64)
            acc += (mask & (t != ignore)).to(tl.int64)
        else:
            acc += mask.to(tl.int64)
    tl.store(out_ptr, tl.sum(acc, axis=0).to(ACC).to(out_ptr.dtype.element_ty))


def token_count(targets: DevBuf, out: DevBuf, ignore_index: int | None) -> None:
    """out[0] = the number of contiguous ``targets`` that are not ``ignore_index``: counted exactly in integers,
    converted through the compute dtype (exact to 2**24 tokens in float32)."""
    if out.size != 1:
        raise ValueError(f"token_count writes one element; got out of shape {out.shape}")
    _token_count_kernel[(1,)](Ptr(targets), Ptr(out), targets.size, 0 if ignore_index is None else int(ignore_index),
                              HAS_IGNORE=ignore_index is not None, BLOCK=1024, ACC=acc_type(out.dtype))

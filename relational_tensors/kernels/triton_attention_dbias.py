"""The gradient of attention's additive bias on one function spec's blocks.

The bias is added to the scaled scores, so its gradient is the scores' own: dS = P ∘ (dO·vᵀ − Δ), P
recomputed from q, k, the bias and the rows' saved log-sum-exp (``triton_attention_grad``'s layouts).
The bias block is [b or 1, hq or 1, sq, skv]; where it is broadcast over batch rows or query heads, the
score gradients of all of them are summed into it.  A program per (bias batch row, bias head, query
tile, key tile) walks the batch rows and heads it sums, in order (none where a block has no batch row or
head: zeros), accumulating in float32 (float64 for float64): the same bits every run, no atomics.  Every
pair of the block is written, 0 where no row sees the key (the NumPy kernel's ``dbias`` form).  The
wrapper allocates nothing: it can be captured in a
CUDA graph.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, acc_type
from relational_tensors.kernels.triton_attention import LOG2E, extra_scores
from relational_tensors.kernels.triton_attention_grad import (
    _check,
    _grad_arguments,
    _load_rows,
    _mm,
    _padding_arguments,
    _row_limits,
    _widths,
)

__all__ = ["attention_dbias"]


@triton.jit
def _dbias_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, lo_ptr, hi_ptr,
                  nb, sq, skv, hq, group, q_offset, k_offset, qk_scale, out_b, out_h, sob, soh, sor, soc,
                  stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  stride_gb, stride_gs, stride_gh, stride_lb, stride_ls, stride_lh, stride_tb, stride_ts, stride_th,
                  stride_ob, stride_os, stride_oh, kp_ptr, klim_ptr, stride_kpb, stride_kpk, klim_b0,
                  mask_ptr, smb, smh, smr, smc, bias_ptr, sbb, sbh, sbr, sbc, cap2,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
                  LIMITS: tl.constexpr, BITS: tl.constexpr, MASK: tl.constexpr, BIAS: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    m_blocks = tl.cdiv(sq, BLOCK_M)
    n_blocks = tl.cdiv(skv, BLOCK_N)
    pid = tl.program_id(0).to(tl.int64)
    pid_n = pid % n_blocks
    pid_m = pid // n_blocks % m_blocks
    pid_o = pid // (n_blocks * m_blocks)
    ob = pid_o // out_h  # this program's bias batch row and head
    oh = pid_o % out_h
    per_b = nb // out_b  # the batch rows and query heads summed into it: all of them where it is broadcast
    per_h = hq // out_h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < sq
    cmask = cols < skv
    inside = rmask[:, None] & cmask[None, :]
    dd = tl.arange(0, BLOCK_D)
    dvv = tl.arange(0, BLOCK_DV)
    abs_cols = k_offset + cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for b in range(ob * per_b, ob * per_b + per_b):
        lo, hi = _row_limits(lo_ptr, hi_ptr, klim_ptr, q_offset + rows, rmask, klim_b0 + b, LIMITS)
        visible = (abs_cols[None, :] >= lo[:, None]) & (abs_cols[None, :] < hi[:, None]) & inside
        if BITS:
            real = tl.load(kp_ptr + b * stride_kpb + cols * stride_kpk, mask=cmask, other=0)
            visible = visible & (real != 0)[None, :]
        for h in range(oh * per_h, oh * per_h + per_h):
            hk = h // group
            q = _load_rows(q_ptr + b * stride_qb + h * stride_qh, rows, stride_qs, dd, sq, D, BLOCK_D, True)
            do = _load_rows(do_ptr + b * stride_gb + h * stride_gh, rows, stride_gs, dvv, sq, DV, BLOCK_DV, True)
            k = _load_rows(k_ptr + b * stride_kb + hk * stride_kh, cols, stride_ks, dd, skv, D, BLOCK_D, True)
            v = _load_rows(v_ptr + b * stride_vb + hk * stride_vh, cols, stride_vs, dvv, skv, DV, BLOCK_DV, True)
            lse = tl.load(lse_ptr + b * stride_lb + rows.to(tl.int64) * stride_ls + h * stride_lh, mask=rmask,
                          other=0.0).to(ACC) * LOG2E
            delta = tl.load(delta_ptr + b * stride_tb + rows.to(tl.int64) * stride_ts + h * stride_th, mask=rmask,
                            other=0.0).to(ACC)
            zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            s, _ = extra_scores(_mm(q, tl.trans(k), zero, IEEE) * qk_scale, visible, rows, cols, inside,
                                mask_ptr + b * smb + h * smh, smr, smc, bias_ptr + b * sbb + h * sbh, sbr, sbc, cap2,
                                MASK, BIAS, SOFTCAP, False)
            p = tl.where(s == float("-inf"), 0.0, tl.exp2(s - lse[:, None]))
            acc += p * (_mm(do, tl.trans(v), zero, IEEE) - delta[:, None])
    tl.store(out_ptr + ob * sob + oh * soh + rows[:, None].to(tl.int64) * sor + cols[None, :] * soc,
             acc.to(out_ptr.dtype.element_ty), mask=inside)


# (BLOCK_M, BLOCK_N, num_warps): the tensor cores' tiles for 16-bit inputs, small ones in IEEE float32
_CONFIG = {False: (64, 64, 4), True: (32, 32, 4)}


def attention_dbias(q: DevBuf, k: DevBuf, v: DevBuf, do: DevBuf, lse: DevBuf, delta: DevBuf, out: DevBuf,
                    row_lo: DevBuf, row_hi: DevBuf, q_offset: int, k_offset: int, scale: float, bias: DevBuf,
                    mask: DevBuf | None = None, key_padding: DevBuf | None = None, limits: DevBuf | None = None,
                    limits_batch: int = 0, softcap: float | None = None) -> None:
    """dbias of blocks q, k, v, dO (with the rows' full lse and Δ) into ``out``, a block of the bias's
    shape [b or 1, hq or 1, sq, skv]; ``bias`` is the forward's, and key padding, key limits, a mask and a
    softcap as the forward kernel takes them (``triton_attention.launch_arguments``).  The bias is added
    after the softcap, so its gradient is the capped scores' own."""
    _check("attention_dbias", {"q": q, "k": k, "v": v, "dO": do})
    nb, sq, hq, d = q.shape
    skv, hkv, dvn = k.shape[1], k.shape[2], v.shape[3]
    ob, oh = out.shape[0], out.shape[1]
    if len(out.shape) != 4 or tuple(out.shape[2:]) != (sq, skv) or ob not in (1, nb) or oh not in (1, hq):
        raise ValueError(f"attention_dbias writes a [b|1, hq|1, {sq}, {skv}] block (b={nb}, hq={hq}); got "
                         f"{out.shape}")
    if out.size == 0:
        return
    ieee = q.dtype in ("float32", "float64")
    block_m, block_n, warps = _CONFIG[ieee]
    pad_args, pad_consts = _padding_arguments(row_lo, key_padding, limits, limits_batch, mask, bias, sq, skv,
                                              softcap)
    sob, soh, sor, soc = (0 if n == 1 else st for n, st in zip(out.shape, out.strides))
    grid = (triton.cdiv(sq, block_m) * triton.cdiv(skv, block_n) * ob * oh,)
    _dbias_kernel[grid](Ptr(q), Ptr(k), Ptr(v), Ptr(do), Ptr(lse), Ptr(delta), Ptr(out), Ptr(row_lo), Ptr(row_hi),
                        nb, sq, skv, hq, hq // max(hkv, 1), q_offset, k_offset, float(scale) * math.log2(math.e),
                        ob, oh, sob, soh, sor, soc, *_grad_arguments(q, k, v, do, lse, delta, out), *pad_args,
                        D=d, DV=dvn, BLOCK_D=_widths(d), BLOCK_DV=_widths(dvn), BLOCK_M=block_m, BLOCK_N=block_n,
                        IEEE=ieee, ACC=acc_type(q.dtype), num_warps=warps, **pad_consts)

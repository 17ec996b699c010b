"""FlashAttention-2-style backward of attention on one function spec's blocks: the log-sum-exp of the
scores, Δ = rowsum(dO·O), dq, and dk with dv.

Layouts as in the forward (``triton_attention``): q, dO [b, sq, hq, d], k, v [b, skv, hkv, d]
(GQA: query head h reads kv head h // g), lse and Δ [b, sq, hq] (float32 for 16-bit inputs), the
block's absolute query rows from ``q_offset`` and keys from ``k_offset``.  Which keys a row sees is
one range per absolute row, [row_lo[r], row_hi[r]) (causal prefixes, windows and packed sequences);
both ends are non-decreasing in r, so the rows that see a key c are one range too,
[key_qlo[c], key_qhi[c]).  P is recomputed from q, k and the saved lse, never stored:

* ``attention_dq``: a program per (batch, query head, query tile) walks the key tiles its rows can
  see: dS = P ∘ (dO·vᵀ - Δ), dq = scale · dS·k.
* ``attention_dkv``: a program per (batch, kv head, key tile) walks the query tiles that can see its
  keys (from ``key_qlo``/``key_qhi``), for every query head of its group: dv = Pᵀ·dO, dk = scale ·
  dSᵀ·q, written side by side into one [b, skv, hkv, d + d_v] block (or one of them alone).  Where
  those programs are too few to fill a GPU (one kv head of a long sequence: a head-sharded plan's
  block) and the caller gives scratch (``dkv_scratch``), the group's query heads are split among
  programs: each writes float32 partials, summed in split order by a second pass (the same bits
  every run).
* ``attention_lse``: the forward's running maximum and sum without the values.
* ``attention_delta``: row dot products.

Tiles that every row of a query tile sees whole (every key of a key tile, for dk|dv) run without
masks; tiles no row sees are skipped.  16-bit inputs go through the tensor cores with P and dS
rounded to the input type and float32 accumulation (as FlashAttention-2 does); float32 multiplies in
IEEE float32, float64 in float64 (the scale passes as a float32 scalar).  On Hopper, tiles load
through tensor descriptors (TMA) where the blocks allow it, as the forward kernel does.  No wrapper
allocates: every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, acc_type, chosen_config
from relational_tensors.kernels.scratch import dkv_scratch, dkv_splits
from relational_tensors.kernels.triton_attention import extra_arguments, extra_scores, interpreted

__all__ = ["attention_lse", "attention_delta", "attention_dq", "attention_dkv", "Config"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages, loads): loads 0 through pointers, 1 through tensor descriptors
# (TMA), 2 (dk|dv only) through tensor descriptors with k and v loaded again for every query tile, where
# holding them in registers would spill
Config = tuple[int, int, int, int, int]
# past every row and key index: the limits of masked rows and hidden keys.  2**30, not int32's max, so that
# the tile arithmetic on it (minus an offset, plus a block less one) cannot wrap around: wrapped, a key
# hidden by padding made its tile look whole to rows past the block's end, which then ran unmasked
_BIG = tl.constexpr(1 << 30)


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
def _row_limits(lo_ptr, hi_ptr, klim_ptr, abs_rows, rmask, batch, LIMITS: tl.constexpr):
    """Each row's keys [lo, hi) (absolute), within its batch row's key limits where there are some (key
    lengths, or the first and one-past-last real key of padding)."""
    lo = tl.load(lo_ptr + abs_rows, mask=rmask, other=_BIG)
    hi = tl.load(hi_ptr + abs_rows, mask=rmask, other=-_BIG)
    if LIMITS:
        lo = tl.maximum(lo, tl.load(klim_ptr + batch * 2))
        hi = tl.minimum(hi, tl.load(klim_ptr + batch * 2 + 1))
    return lo, hi


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 (and float64) multiply exactly, not in TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_rows(base, rows, stride, cols, n_rows, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
               MASKED: tl.constexpr):
    """A tile [rows, cols] of a [n_rows, WIDTH] matrix whose rows are ``stride`` apart (zeros outside)."""
    ptrs = base + rows[:, None].to(tl.int64) * stride + cols[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < WIDTH), other=0.0)
    elif BLOCK_W == WIDTH:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=cols[None, :] < WIDTH, other=0.0)


# ------------------------------------------------------------------------------------------- lse


@triton.jit
def _lse_tile(l_i, m_i, q, k_base, stride_ks, n0, skv, lo, hi, k_offset, qk_scale, dd, k_desc, krow, kcol,
              kp_base, stride_kpk, rows, rmask, mask_base, smr, smc, bias_base, sbr, sbc, cap2,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, BITS: tl.constexpr,
              MASK: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    if TMA:
        k = k_desc.load([krow + n0, kcol])
    else:
        k = _load_rows(k_base, cols, stride_ks, dd, skv, D, BLOCK_D, MASKED)
    s = _mm(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=l_i.dtype), IEEE) * qk_scale
    if MASKED:
        abs_cols = k_offset + cols
        visible = (abs_cols[None, :] >= lo[:, None]) & (abs_cols[None, :] < hi[:, None]) & (cols[None, :] < skv)
        if BITS:
            visible = visible & (tl.load(kp_base + cols * stride_kpk, mask=cols < skv, other=0) != 0)[None, :]
        s, _ = extra_scores(s, visible, rows, cols, rmask[:, None] & (cols[None, :] < skv), mask_base, smr, smc,
                            bias_base, sbr, sbc, cap2, MASK, BIAS, SOFTCAP, False)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
    return l_i, m_new


@triton.jit
def _lse_kernel(q_ptr, k_ptr, lse_ptr, lo_ptr, hi_ptr, sq, skv, hq, group, q_offset, k_offset, qk_scale,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_lb, stride_ls, stride_lh,
                kp_ptr, klim_ptr, stride_kpb, stride_kpk, klim_b0, mask_ptr, smb, smh, smr, smc,
                bias_ptr, sbb, sbh, sbr, sbc, cap2, q_desc, k_desc,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                IEEE: tl.constexpr, ACC: tl.constexpr, TMA: tl.constexpr, LIMITS: tl.constexpr, BITS: tl.constexpr,
                MASK: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    m_blocks = tl.cdiv(sq, BLOCK_M)
    pid = tl.program_id(0).to(tl.int64)
    nbh = tl.num_programs(0).to(tl.int64) // m_blocks
    pid_m = m_blocks - 1 - pid // nbh  # heads of a row tile side by side, the last (longest) tiles first
    pid_bh = pid % nbh
    b = pid_bh // hq
    h = pid_bh % hq
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < sq
    dd = tl.arange(0, BLOCK_D)
    if TMA:
        q = q_desc.load([(b * sq + pid_m * BLOCK_M).to(tl.int32), (h * D).to(tl.int32)])
    else:
        q = _load_rows(q_ptr + b * stride_qb + h * stride_qh, rows, stride_qs, dd, sq, D, BLOCK_D, True)
    lo, hi = _row_limits(lo_ptr, hi_ptr, klim_ptr, q_offset + rows, rmask, klim_b0 + b, LIMITS)
    start, end, full_lo, full_hi = _span(tl.min(lo, axis=0) - k_offset, tl.max(tl.where(rmask, lo, -_BIG), axis=0)
                                         - k_offset, tl.min(tl.where(rmask, hi, _BIG), axis=0) - k_offset,
                                         tl.max(hi, axis=0) - k_offset, skv, BLOCK_N)
    if BITS or MASK or BIAS or SOFTCAP:  # padding, masks, a bias or a softcap: every tile takes the masked path
        full_lo = tl.maximum(end, start)
        full_hi = full_lo
    mask_base = mask_ptr + b * smb + h * smh  # (strides 0 on broadcast dimensions)
    bias_base = bias_ptr + b * sbb + h * sbh
    kp_base = kp_ptr + b * stride_kpb
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    krow = (b * skv).to(tl.int32)
    kcol = (hk * D).to(tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    for n0 in range(start, tl.minimum(full_lo, end), BLOCK_N):
        l_i, m_i = _lse_tile(l_i, m_i, q, k_base, stride_ks, n0, skv, lo, hi, k_offset, qk_scale, dd, k_desc, krow,
                             kcol, kp_base, stride_kpk, rows, rmask, mask_base, smr, smc, bias_base, sbr, sbc, cap2,
                             D, BLOCK_D, BLOCK_M, BLOCK_N, True, IEEE, TMA, BITS, MASK, BIAS, SOFTCAP)
    for n0 in range(full_lo, full_hi, BLOCK_N):
        l_i, m_i = _lse_tile(l_i, m_i, q, k_base, stride_ks, n0, skv, lo, hi, k_offset, qk_scale, dd, k_desc, krow,
                             kcol, kp_base, stride_kpk, rows, rmask, mask_base, smr, smc, bias_base, sbr, sbc, cap2,
                             D, BLOCK_D, BLOCK_M, BLOCK_N, False, IEEE, TMA, BITS, MASK, BIAS, SOFTCAP)
    for n0 in range(tl.maximum(full_hi, tl.minimum(full_lo, end)), end, BLOCK_N):
        l_i, m_i = _lse_tile(l_i, m_i, q, k_base, stride_ks, n0, skv, lo, hi, k_offset, qk_scale, dd, k_desc, krow,
                             kcol, kp_base, stride_kpk, rows, rmask, mask_base, smr, smc, bias_base, sbr, sbc, cap2,
                             D, BLOCK_D, BLOCK_M, BLOCK_N, True, IEEE, TMA, BITS, MASK, BIAS, SOFTCAP)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i > 0, (m_fin + tl.log2(tl.where(l_i > 0, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + b * stride_lb + rows.to(tl.int64) * stride_ls + h * stride_lh,
             lse.to(lse_ptr.dtype.element_ty), mask=rmask)


# ------------------------------------------------------------------------------------------- Δ


@triton.jit
def _delta_kernel(o_ptr, do_ptr, out_ptr, n_rows, s, h, dv,
                  stride_ob, stride_os, stride_oh, stride_od, stride_gb, stride_gs, stride_gh, stride_gd,
                  stride_tb, stride_ts, stride_th,
                  BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    hi = r % h
    si = (r // h) % s
    bi = r // (h * s)
    o_row = bi * stride_ob + si * stride_os + hi * stride_oh
    g_row = bi * stride_gb + si * stride_gs + hi * stride_gh
    acc = tl.zeros([BLOCK_R], dtype=ACC)
    for c0 in range(0, dv, BLOCK_DV):
        cols = c0 + tl.arange(0, BLOCK_DV)
        mask = rmask[:, None] & (cols[None, :] < dv)
        o = tl.load(o_ptr + o_row[:, None] + cols[None, :] * stride_od, mask=mask, other=0.0).to(ACC)
        g = tl.load(do_ptr + g_row[:, None] + cols[None, :] * stride_gd, mask=mask, other=0.0).to(ACC)
        acc += tl.sum(o * g, axis=1)
    tl.store(out_ptr + bi * stride_tb + si * stride_ts + hi * stride_th, acc.to(out_ptr.dtype.element_ty),
             mask=rmask)


# ------------------------------------------------------------------------------------------- dq


@triton.jit
def _dq_tile(acc, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, skv, lo, hi, k_offset, qk_scale,
             dd, dvv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
             mask_base, smr, smc, bias_base, sbr, sbc, cap2,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
             TMA: tl.constexpr, BITS: tl.constexpr, MASK: tl.constexpr, BIAS: tl.constexpr,
             SOFTCAP: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    if TMA:
        k = k_desc.load([krow + n0, kcol])
        v = v_desc.load([krow + n0, vcol])
    else:
        k = _load_rows(k_base, cols, stride_ks, dd, skv, D, BLOCK_D, MASKED)
        v = _load_rows(v_base, cols, stride_vs, dvv, skv, DV, BLOCK_DV, MASKED)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc.dtype)
    s = _mm(q, tl.trans(k), zero, IEEE)
    slope = 1.0  # (a softcap's tiles all take the masked path)
    if MASKED:
        abs_cols = k_offset + cols
        visible = (abs_cols[None, :] >= lo[:, None]) & (abs_cols[None, :] < hi[:, None]) & (cols[None, :] < skv)
        if BITS:
            visible = visible & (tl.load(kp_base + cols * stride_kpk, mask=cols < skv, other=0) != 0)[None, :]
        if MASK or BIAS or SOFTCAP:
            s2, slope = extra_scores(s * qk_scale, visible, rows, cols, rmask[:, None] & (cols[None, :] < skv),
                                     mask_base, smr, smc, bias_base, sbr, sbc, cap2, MASK, BIAS, SOFTCAP, False)
            p = tl.where(s2 == float("-inf"), 0.0, tl.exp2(s2 - lse2[:, None]))
        else:
            p = tl.where(visible, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
    else:
        p = tl.exp2(s * qk_scale - lse2[:, None])
    dp = _mm(do, tl.trans(v), zero, IEEE)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:  # (every tile is masked then) the capped scores' gradient through tanh
        ds = ds * slope
    if IEEE:
        return _mm(ds, k, acc, IEEE)
    else:
        return _mm(ds.to(k.dtype), k, acc, IEEE)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, lo_ptr, hi_ptr,
               sq, skv, hq, group, q_offset, k_offset, scale, qk_scale,
               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               stride_gb, stride_gs, stride_gh, stride_lb, stride_ls, stride_lh, stride_tb, stride_ts, stride_th,
               stride_ob, stride_os, stride_oh, kp_ptr, klim_ptr, stride_kpb, stride_kpk, klim_b0,
               mask_ptr, smb, smh, smr, smc, bias_ptr, sbb, sbh, sbr, sbc, cap2, q_desc, k_desc, v_desc, do_desc,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
               TMA: tl.constexpr, LIMITS: tl.constexpr, BITS: tl.constexpr, MASK: tl.constexpr,
               BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    m_blocks = tl.cdiv(sq, BLOCK_M)
    pid = tl.program_id(0).to(tl.int64)
    nbh = tl.num_programs(0).to(tl.int64) // m_blocks
    pid_m = m_blocks - 1 - pid // nbh  # heads of a row tile side by side (their kv heads shared in L2)
    pid_bh = pid % nbh
    b = pid_bh // hq
    h = pid_bh % hq
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < sq
    dd = tl.arange(0, BLOCK_D)
    dvv = tl.arange(0, BLOCK_DV)
    if TMA:  # rows past sq read the next batch row (or zeros): never stored
        qrow = (b * sq + pid_m * BLOCK_M).to(tl.int32)
        q = q_desc.load([qrow, (h * D).to(tl.int32)])
        do = do_desc.load([qrow, (h * DV).to(tl.int32)])
    else:
        q = _load_rows(q_ptr + b * stride_qb + h * stride_qh, rows, stride_qs, dd, sq, D, BLOCK_D, True)
        do = _load_rows(do_ptr + b * stride_gb + h * stride_gh, rows, stride_gs, dvv, sq, DV, BLOCK_DV, True)
    lse = tl.load(lse_ptr + b * stride_lb + rows.to(tl.int64) * stride_ls + h * stride_lh, mask=rmask, other=0.0)
    lse2 = lse.to(ACC) * 1.4426950408889634
    delta = tl.load(delta_ptr + b * stride_tb + rows.to(tl.int64) * stride_ts + h * stride_th, mask=rmask,
                    other=0.0).to(ACC)
    lo, hi = _row_limits(lo_ptr, hi_ptr, klim_ptr, q_offset + rows, rmask, klim_b0 + b, LIMITS)
    start, end, full_lo, full_hi = _span(tl.min(lo, axis=0) - k_offset, tl.max(tl.where(rmask, lo, -_BIG), axis=0)
                                         - k_offset, tl.min(tl.where(rmask, hi, _BIG), axis=0) - k_offset,
                                         tl.max(hi, axis=0) - k_offset, skv, BLOCK_N)
    if BITS or MASK or BIAS or SOFTCAP:  # padding, masks, a bias or a softcap: every tile takes the masked path
        full_lo = tl.maximum(end, start)
        full_hi = full_lo
    mask_base = mask_ptr + b * smb + h * smh  # (strides 0 on broadcast dimensions)
    bias_base = bias_ptr + b * sbb + h * sbh
    kp_base = kp_ptr + b * stride_kpb
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    krow = (b * skv).to(tl.int32)
    kcol = (hk * D).to(tl.int32)
    vcol = (hk * DV).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    for n0 in range(start, tl.minimum(full_lo, end), BLOCK_N):
        acc = _dq_tile(acc, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, skv, lo, hi, k_offset,
                       qk_scale, dd, dvv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
                       mask_base, smr, smc, bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                       True, IEEE, TMA, BITS, MASK, BIAS, SOFTCAP)
    for n0 in range(full_lo, full_hi, BLOCK_N):
        acc = _dq_tile(acc, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, skv, lo, hi, k_offset,
                       qk_scale, dd, dvv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
                       mask_base, smr, smc, bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                       False, IEEE, TMA, BITS, MASK, BIAS, SOFTCAP)
    for n0 in range(tl.maximum(full_hi, tl.minimum(full_lo, end)), end, BLOCK_N):
        acc = _dq_tile(acc, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, skv, lo, hi, k_offset,
                       qk_scale, dd, dvv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
                       mask_base, smr, smc, bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                       True, IEEE, TMA, BITS, MASK, BIAS, SOFTCAP)
    acc = acc * scale
    tl.store(dq_ptr + b * stride_ob + rows[:, None].to(tl.int64) * stride_os + h * stride_oh + dd[None, :],
             acc.to(dq_ptr.dtype.element_ty), mask=rmask[:, None] & (dd[None, :] < D))


# ------------------------------------------------------------------------------------------- dk, dv


@triton.jit
def _dkv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_gs, stride_ls, stride_ts,
              m0, sq, q_offset, kqlo, kqhi, qk_scale, dd, dvv, q_desc, do_desc, qrow, qcol, gcol,
              k_desc, v_desc, krow, kcol, vcol, cols, cmask, mask_base, smr, smc, bias_base, sbr, sbc, cap2,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WRITE_DK: tl.constexpr,
              WRITE_DV: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, RELOAD: tl.constexpr,
              MASK: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    if RELOAD:  # k and v through the tensor cores' shared memory for every tile, not held in registers
        k = k_desc.load([krow, kcol])
        v = v_desc.load([krow, vcol])
    rows = m0 + tl.arange(0, BLOCK_M)
    if TMA:  # rows past sq read the next batch row (or zeros): their P is masked to 0
        q = q_desc.load([qrow + m0, qcol])
        do = do_desc.load([qrow + m0, gcol])
    else:
        q = _load_rows(q_base, rows, stride_qs, dd, sq, D, BLOCK_D, MASKED)
        do = _load_rows(do_base, rows, stride_gs, dvv, sq, DV, BLOCK_DV, MASKED)
    if MASKED:
        lse = tl.load(lse_base + rows.to(tl.int64) * stride_ls, mask=rows < sq, other=0.0)
    else:
        lse = tl.load(lse_base + rows.to(tl.int64) * stride_ls)
    zero = tl.zeros([BLOCK_N, BLOCK_M], dtype=dk.dtype)
    st = _mm(k, tl.trans(q), zero, IEEE)  # scores transposed: [keys, rows]
    slope = 1.0  # (a softcap's tiles all take the masked path)
    lse2 = lse.to(dk.dtype) * 1.4426950408889634
    if MASKED:
        abs_rows = q_offset + rows
        visible = (abs_rows[None, :] >= kqlo[:, None]) & (abs_rows[None, :] < kqhi[:, None]) & (rows[None, :] < sq)
        if MASK or BIAS or SOFTCAP:
            st2, slope = extra_scores(st * qk_scale, visible, rows, cols, cmask[:, None] & (rows[None, :] < sq),
                                      mask_base, smr, smc, bias_base, sbr, sbc, cap2, MASK, BIAS, SOFTCAP, True)
            pt = tl.where(st2 == float("-inf"), 0.0, tl.exp2(st2 - lse2[None, :]))
        else:
            pt = tl.where(visible, tl.exp2(st * qk_scale - lse2[None, :]), 0.0)
    else:
        pt = tl.exp2(st * qk_scale - lse2[None, :])
    if WRITE_DV:
        if IEEE:
            dv = _mm(pt, do, dv, IEEE)
        else:
            dv = _mm(pt.to(do.dtype), do, dv, IEEE)
    if WRITE_DK:
        if MASKED:
            delta = tl.load(delta_base + rows.to(tl.int64) * stride_ts, mask=rows < sq, other=0.0)
        else:
            delta = tl.load(delta_base + rows.to(tl.int64) * stride_ts)
        dpt = _mm(v, tl.trans(do), zero, IEEE)
        dst = pt * (dpt - delta.to(dk.dtype)[None, :])
        if SOFTCAP:  # (every tile is masked then) the capped scores' gradient through tanh
            dst = dst * slope
        if not IEEE:
            dst = dst.to(q.dtype)
        dk = _mm(dst, q, dk, IEEE)
    return dk, dv


@triton.jit
def _dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, out_ptr, kqlo_ptr, kqhi_ptr,
                sq, skv, hkv, group, stride_split, q_offset, k_offset, scale, qk_scale,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_gb, stride_gs, stride_gh, stride_lb, stride_ls, stride_lh, stride_tb, stride_ts, stride_th,
                stride_ob, stride_os, stride_oh, kp_ptr, klim_ptr, stride_kpb, stride_kpk, klim_b0,
                mask_ptr, smb, smh, smr, smc, bias_ptr, sbb, sbh, sbr, sbc, cap2, q_desc, k_desc, v_desc, do_desc,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_DK: tl.constexpr, WRITE_DV: tl.constexpr,
                IEEE: tl.constexpr, ACC: tl.constexpr, TMA: tl.constexpr, RELOAD: tl.constexpr,
                SPLITS: tl.constexpr, LIMITS: tl.constexpr, BITS: tl.constexpr, MASK: tl.constexpr,
                BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    n_blocks = tl.cdiv(skv, BLOCK_N)
    pid = tl.program_id(0).to(tl.int64)
    nbh = tl.num_programs(0).to(tl.int64) // n_blocks
    pid_n = pid // nbh  # kv heads (and their splits) of a key tile side by side, the first key tiles (under
    pid_bh = pid % nbh  # a causal mask the ones the most queries see) first
    b = pid_bh // (hkv * SPLITS)  # SPLITS a constant: the unsplit pass keeps its registers
    hk = pid_bh // SPLITS % hkv
    part = pid_bh % SPLITS  # this program's share of the group's query heads
    per = group // SPLITS
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < skv
    dd = tl.arange(0, BLOCK_D)
    dvv = tl.arange(0, BLOCK_DV)
    krow = (b * skv + n0).to(tl.int32)
    kcol = (hk * D).to(tl.int32)
    vcol = (hk * DV).to(tl.int32)
    if TMA:  # keys past skv read the next batch row (or zeros): never stored
        k = k_desc.load([krow, kcol])
        v = v_desc.load([krow, vcol])
    else:
        k = _load_rows(k_ptr + b * stride_kb + hk * stride_kh, cols, stride_ks, dd, skv, D, BLOCK_D, True)
        v = _load_rows(v_ptr + b * stride_vb + hk * stride_vh, cols, stride_vs, dvv, skv, DV, BLOCK_DV, True)
    # the rows that see key c are [key_qlo[c], key_qhi[c]), both ends non-decreasing in c
    kqlo = tl.load(kqlo_ptr + k_offset + cols, mask=cmask, other=_BIG)
    kqhi = tl.load(kqhi_ptr + k_offset + cols, mask=cmask, other=-_BIG)
    if LIMITS or BITS:
        # a key outside its batch row's limits, or padding, is seen by no row: its range is emptied, and the
        # tile's span is taken over what is left (no tile is whole where one key is hidden)
        hidden = cols < 0
        if LIMITS:
            abs_cols = k_offset + cols
            hidden = hidden | (abs_cols < tl.load(klim_ptr + (klim_b0 + b) * 2)) | \
                (abs_cols >= tl.load(klim_ptr + (klim_b0 + b) * 2 + 1))
        if BITS:
            hidden = hidden | (tl.load(kp_ptr + b * stride_kpb + cols * stride_kpk, mask=cmask, other=0) == 0)
        kqlo = tl.where(hidden, _BIG, kqlo)
        kqhi = tl.where(hidden, -_BIG, kqhi)
        start, end, full_lo, full_hi = _span(tl.min(kqlo, axis=0) - q_offset,
                                             tl.max(tl.where(cmask, kqlo, -_BIG), axis=0) - q_offset,
                                             tl.min(tl.where(cmask, kqhi, _BIG), axis=0) - q_offset,
                                             tl.max(kqhi, axis=0) - q_offset, sq, BLOCK_M)
    else:
        first = k_offset + n0
        last = k_offset + tl.minimum(n0 + BLOCK_N, skv) - 1
        start, end, full_lo, full_hi = _span(tl.load(kqlo_ptr + first) - q_offset,
                                             tl.load(kqlo_ptr + last) - q_offset,
                                             tl.load(kqhi_ptr + first) - q_offset,
                                             tl.load(kqhi_ptr + last) - q_offset, sq, BLOCK_M)
    if MASK or BIAS or SOFTCAP:  # masks, a bias or a softcap: every tile takes the masked path
        full_lo = tl.maximum(end, start)
        full_hi = full_lo
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    qrow = (b * sq).to(tl.int32)
    for j in range(part * per, part * per + per):  # the query heads of this kv head (its share of them)
        h = hk * group + j
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_gb + h * stride_gh
        lse_base = lse_ptr + b * stride_lb + h * stride_lh
        delta_base = delta_ptr + b * stride_tb + h * stride_th
        mask_base = mask_ptr + b * smb + h * smh  # (strides 0 on broadcast dimensions)
        bias_base = bias_ptr + b * sbb + h * sbh
        qcol = (h * D).to(tl.int32)
        gcol = (h * DV).to(tl.int32)
        for m0 in range(start, tl.minimum(full_lo, end), BLOCK_M):
            dk, dv = _dkv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_gs, stride_ls,
                               stride_ts, m0, sq, q_offset, kqlo, kqhi, qk_scale, dd, dvv, q_desc, do_desc, qrow,
                               qcol, gcol, k_desc, v_desc, krow, kcol, vcol, cols, cmask, mask_base, smr, smc,
                               bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True,
                               WRITE_DK, WRITE_DV, IEEE, TMA, RELOAD, MASK, BIAS,
                               SOFTCAP)
        for m0 in range(full_lo, full_hi, BLOCK_M):
            dk, dv = _dkv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_gs, stride_ls,
                               stride_ts, m0, sq, q_offset, kqlo, kqhi, qk_scale, dd, dvv, q_desc, do_desc, qrow,
                               qcol, gcol, k_desc, v_desc, krow, kcol, vcol, cols, cmask, mask_base, smr, smc,
                               bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False,
                               WRITE_DK, WRITE_DV, IEEE, TMA, RELOAD, MASK, BIAS,
                               SOFTCAP)
        for m0 in range(tl.maximum(full_hi, tl.minimum(full_lo, end)), end, BLOCK_M):
            dk, dv = _dkv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_gs, stride_ls,
                               stride_ts, m0, sq, q_offset, kqlo, kqhi, qk_scale, dd, dvv, q_desc, do_desc, qrow,
                               qcol, gcol, k_desc, v_desc, krow, kcol, vcol, cols, cmask, mask_base, smr, smc,
                               bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True,
                               WRITE_DK, WRITE_DV, IEEE, TMA, RELOAD, MASK, BIAS,
                               SOFTCAP)
    if LIMITS or BITS:  # a hidden key's gradients are 0 by definition, whatever its tiles summed
        dk = tl.where(hidden[:, None], 0.0, dk)
        dv = tl.where(hidden[:, None], 0.0, dv)
    out_rows = out_ptr + part * stride_split + b * stride_ob + cols[:, None].to(tl.int64) * stride_os + hk * stride_oh
    if WRITE_DK:
        dk = dk * scale
        tl.store(out_rows + dd[None, :], dk.to(out_ptr.dtype.element_ty), mask=cmask[:, None] & (dd[None, :] < D))
    if WRITE_DV:
        if WRITE_DK:  # dv after dk on the last axis
            out_rows += D
        tl.store(out_rows + dvv[None, :], dv.to(out_ptr.dtype.element_ty), mask=cmask[:, None] & (dvv[None, :] < DV))


@triton.jit
def _sum_splits_kernel(src_ptr, out_ptr, rows, skv, hkv, width, splits, stride_split, stride_ob, stride_os, stride_oh,
                       BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """out[b, s, h, :] = the sum over splits of the float32 partials [splits, b, s, h, width], in order."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (r[:, None] < rows) & (c[None, :] < width)
    src = src_ptr + r[:, None] * width + c[None, :]
    acc = tl.load(src, mask=mask, other=0.0)
    for i in range(1, splits):
        acc += tl.load(src + i * stride_split, mask=mask, other=0.0)
    b = r // (skv * hkv)
    at = b * stride_ob + (r // hkv % skv) * stride_os + (r % hkv) * stride_oh
    tl.store(out_ptr + at[:, None] + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- wrappers


# (BLOCK_M, BLOCK_N, num_warps, num_stages, loads) tried on the first launch of each shape class, the fastest
# kept; TMA ones only where tensor descriptors work (Hopper or newer, whole power-of-two heads, aligned
# contiguous blocks).  dk|dv holds two [BLOCK_N, d] float32 accumulators, so it takes narrower tiles and 8
# warps: compiled for sm_90 at d = 128 in bfloat16, (32, 64, 8, 2|3, TMA) keep everything in registers
# and (64, 64, 8, 3, TMA) spills 56 bytes, where the 4-warp and 128-key tiles spill hundreds.
ROW_CONFIGS: dict[str, list[Config]] = {  # lse and dq: a program per query tile, walking key tiles
    "lse": [(64, 64, 4, 3, 0), (128, 64, 8, 3, 0), (128, 128, 8, 3, 0), (64, 64, 4, 3, 1), (128, 64, 8, 3, 1),
            (128, 128, 8, 3, 1)],
    "dq": [(64, 64, 4, 2, 0), (128, 64, 8, 2, 0), (64, 64, 8, 2, 0), (128, 32, 4, 3, 0), (64, 64, 4, 3, 1),
           (128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (128, 64, 8, 4, 1), (64, 64, 8, 2, 1), (128, 32, 8, 2, 1)],
    "dkv": [(32, 64, 4, 3, 0), (32, 64, 4, 4, 0), (32, 64, 4, 5, 0), (64, 64, 4, 3, 0), (64, 64, 8, 2, 0),
            (32, 128, 4, 3, 0), (32, 128, 8, 2, 0), (32, 128, 8, 3, 0), (64, 128, 8, 3, 0), (32, 64, 4, 3, 1),
            (32, 64, 8, 2, 1), (32, 64, 8, 3, 1), (64, 64, 8, 2, 1), (64, 64, 8, 3, 1), (32, 128, 8, 3, 1),
            (64, 128, 8, 3, 1), (32, 64, 4, 3, 2), (64, 64, 8, 3, 2)],
}
IEEE_CONFIGS: dict[str, list[Config]] = {  # float32 and float64: no tensor cores, small tiles
    "lse": [(32, 32, 4, 2, 0), (16, 32, 4, 2, 0)],
    "dq": [(16, 32, 4, 2, 0), (32, 32, 8, 2, 0), (16, 16, 4, 2, 0)],
    "dkv": [(32, 32, 8, 1, 0), (16, 16, 4, 2, 0), (32, 32, 8, 2, 0)],
}
_chosen: dict[tuple, Config] = {}


def _tma_views(bufs: tuple[DevBuf, ...]) -> tuple | None:
    """Each buffer as a 2-D [batch * tokens, heads * head dim] view for tensor descriptors, or None where
    descriptors cannot address them exactly (the forward kernel's conditions)."""
    if interpreted() or bufs[0].dtype not in ("float16", "bfloat16"):
        return None
    from relational_tensors.core.dtypes import numpy_dtype
    from relational_tensors.kernels.triton_attention import _DescBase, _tma_device

    if not _tma_device(bufs[0].device):
        return None
    views = []
    for buf in bufs:
        nb, s, h, d = buf.shape
        if (not buf.is_contiguous or d != triton.next_power_of_2(d) or d < 16 or buf.ptr % 16
                or (h * d * numpy_dtype(buf.dtype).itemsize) % 16 or nb * s >= 2**31 or nb * s == 0):
            return None
        views.append((_DescBase(buf), [nb * s, h * d], [h * d, 1]))
    return tuple(views)


def _descriptors(tma: tuple | None, blocks: tuple[int, ...], widths: tuple[int, ...]) -> tuple:
    """Tensor descriptors of ``tma``'s views with tiles [block, width] (Nones without TMA)."""
    if tma is None:
        return (None,) * len(blocks)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(base, shape, strides, [bl, w])
                 for (base, shape, strides), bl, w in zip(tma, blocks, widths))


def _pick(key: tuple, configs: list[Config], tma: tuple | None, launch: Callable[[Config], None]) -> Config:
    """The fastest config for this key (:func:`~relational_tensors.kernels.common.fastest_config`),
    chosen once; the interpreter takes the first config without tensor descriptors."""
    usable = [c for c in configs if not c[4] or tma is not None]
    if interpreted():
        return usable[0]
    return chosen_config(_chosen, key, usable, launch, lambda cfg: bool(cfg[4]),
                         f"attention gradient kernel (key {key})")


def _check(name: str, bufs: dict[str, DevBuf]) -> None:
    bad = {n: b.strides for n, b in bufs.items() if b.shape[-1] > 1 and b.strides[-1] != 1}
    if bad:
        raise ValueError(f"{name} needs blocks whose last axis is contiguous; got strides {bad}")


def _strides3(buf: DevBuf) -> tuple[int, int, int]:
    """Element strides of batch, position and head (a [b, s, h] or [b, s, h, d] block)."""
    s = buf.strides
    return s[0], s[1], s[2]


def _widths(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _padding_arguments(fallback: DevBuf, key_padding: DevBuf | None, limits: DevBuf | None,
                       limits_batch: int, mask: DevBuf | None, bias: DevBuf | None, rows: int,
                       keys: int, softcap: float | None = None) -> tuple[tuple, dict]:
    """(kernel arguments, constexprs) of key padding (bool [b, skv], this block's keys), per-batch key
    limits (int32 [B, 2], absolute; row ``limits_batch + b``), a boolean mask and an additive bias
    ([b|1, hq|1, rows, keys]) and a softcap (``triton_attention.extra_arguments``), as the forward kernel
    takes them."""
    args = (Ptr(key_padding) if key_padding is not None else Ptr(fallback),
            Ptr(limits) if limits is not None else Ptr(fallback),
            key_padding.strides[0] if key_padding is not None else 0,
            key_padding.strides[1] if key_padding is not None else 0, limits_batch)
    extra_args, extra_consts = extra_arguments(fallback, mask, bias, rows, keys, softcap)
    return (*args, *extra_args), dict(LIMITS=limits is not None, BITS=key_padding is not None, **extra_consts)


def _shape_key(kind: str, q: DevBuf, k: DevBuf, dv: int, tma: tuple | None, *extra: object) -> tuple:
    nb, sq, hq, d = q.shape
    return (kind, d, dv, q.dtype, tma is not None, triton.next_power_of_2(sq), triton.next_power_of_2(k.shape[1]),
            nb * hq, *extra)


def attention_lse(q: DevBuf, k: DevBuf, lse: DevBuf, row_lo: DevBuf, row_hi: DevBuf, q_offset: int, k_offset: int,
                  scale: float, config: Config | None = None, key_padding: DevBuf | None = None,
                  limits: DevBuf | None = None, limits_batch: int = 0, mask: DevBuf | None = None,
                  bias: DevBuf | None = None, softcap: float | None = None) -> None:
    """lse [b, sq, hq] = log Σ_visible exp(scale · q·k) of blocks q, k (-inf where a row sees no key).

    ``config`` fixes (BLOCK_M, BLOCK_N, num_warps, num_stages, loads) instead of timing the candidates;
    key padding, key limits, a mask, a bias and a softcap as the forward kernel takes them
    (``triton_attention.launch_arguments``)."""
    _check("attention_lse", {"q": q, "k": k})
    nb, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if lse.size == 0:
        return
    if skv == 0:
        raise ValueError("attention_lse with no keys is handled by the caller (-inf)")
    ieee = q.dtype in ("float32", "float64")
    block_d = _widths(d)
    args = (Ptr(q), Ptr(k), Ptr(lse), Ptr(row_lo), Ptr(row_hi), sq, skv, hq, hq // hkv, q_offset, k_offset,
            float(scale) * math.log2(math.e), *q.strides[:3], *k.strides[:3], *_strides3(lse))
    pad_args, pad_consts = _padding_arguments(row_lo, key_padding, limits, limits_batch, mask, bias, sq, skv,
                                              softcap)
    args = (*args, *pad_args)
    consts = dict(D=d, BLOCK_D=block_d, IEEE=ieee, ACC=acc_type(q.dtype), **pad_consts)
    tma = _tma_views((q, k))

    def launch(cfg: Config) -> None:
        bm, bn, warps, stages, want_tma = cfg
        use_tma = bool(want_tma) and tma is not None  # a fixed config may ask for TMA where it cannot be used
        descs = _descriptors(tma if use_tma else None, (bm, bn), (block_d, block_d))
        _lse_kernel[(triton.cdiv(sq, bm) * nb * hq,)](*args, *descs, **consts, BLOCK_M=bm, BLOCK_N=bn,
                                                      TMA=use_tma, num_warps=warps, num_stages=stages)

    launch(config or _pick(_shape_key("lse", q, k, 0, tma, *pad_consts.values()),
                           (IEEE_CONFIGS if ieee else ROW_CONFIGS)["lse"], tma, launch))


def attention_delta(o: DevBuf, do: DevBuf, out: DevBuf) -> None:
    """out [b, s, h] = Σ_d o·dO over blocks o, dO [b, s, h, d_v] (any strides), accumulated in float32
    (float64 for float64)."""
    if o.shape != do.shape or tuple(out.shape) != tuple(o.shape[:3]):
        raise ValueError(f"attention_delta takes o, dO [b, s, h, d] and out [b, s, h]; got {o.shape}, {do.shape}, "
                         f"{out.shape}")
    n_rows = out.size
    if n_rows == 0:
        return
    nb, s, h, dv = o.shape
    block_dv = min(128, _widths(dv))
    block_r = max(1, min(128, 4096 // block_dv))
    _delta_kernel[(triton.cdiv(n_rows, block_r),)](Ptr(o), Ptr(do), Ptr(out), n_rows, s, h, dv, *o.strides,
                                                   *do.strides, *_strides3(out), BLOCK_R=block_r, BLOCK_DV=block_dv,
                                                   ACC=acc_type(o.dtype), num_warps=4)


def _grad_arguments(q: DevBuf, k: DevBuf, v: DevBuf, do: DevBuf, lse: DevBuf, delta: DevBuf,
                    out: DevBuf) -> tuple:
    return (*q.strides[:3], *k.strides[:3], *v.strides[:3], *do.strides[:3], *_strides3(lse), *_strides3(delta),
            *_strides3(out))


def attention_dq(q: DevBuf, k: DevBuf, v: DevBuf, do: DevBuf, lse: DevBuf, delta: DevBuf, dq: DevBuf,
                 row_lo: DevBuf, row_hi: DevBuf, q_offset: int, k_offset: int, scale: float,
                 config: Config | None = None, key_padding: DevBuf | None = None, limits: DevBuf | None = None,
                 limits_batch: int = 0, mask: DevBuf | None = None, bias: DevBuf | None = None,
                 softcap: float | None = None) -> None:
    """dq [b, sq, hq, d] of blocks q, k, v, dO with the rows' full lse and Δ (a key block's partial); key
    padding, key limits, a mask, a bias and a softcap as the forward kernel takes them."""
    _check("attention_dq", {"q": q, "k": k, "v": v, "dO": do, "dq": dq})
    nb, sq, hq, d = q.shape
    skv, hkv, dvn = k.shape[1], k.shape[2], v.shape[3]
    if dq.size == 0:
        return
    if skv == 0:
        raise ValueError("attention_dq with no keys is handled by the caller (zeros)")
    ieee = q.dtype in ("float32", "float64")
    block_d, block_dv = _widths(d), _widths(dvn)
    args = (Ptr(q), Ptr(k), Ptr(v), Ptr(do), Ptr(lse), Ptr(delta), Ptr(dq), Ptr(row_lo), Ptr(row_hi),
            sq, skv, hq, hq // hkv, q_offset, k_offset, float(scale), float(scale) * math.log2(math.e),
            *_grad_arguments(q, k, v, do, lse, delta, dq))
    pad_args, pad_consts = _padding_arguments(row_lo, key_padding, limits, limits_batch, mask, bias, sq, skv,
                                              softcap)
    args = (*args, *pad_args)
    consts = dict(D=d, DV=dvn, BLOCK_D=block_d, BLOCK_DV=block_dv, IEEE=ieee, ACC=acc_type(q.dtype), **pad_consts)
    tma = _tma_views((q, k, v, do))

    def launch(cfg: Config) -> None:
        bm, bn, warps, stages, want_tma = cfg
        use_tma = bool(want_tma) and tma is not None  # a fixed config may ask for TMA where it cannot be used
        descs = _descriptors(tma if use_tma else None, (bm, bn, bn, bm), (block_d, block_d, block_dv, block_dv))
        _dq_kernel[(triton.cdiv(sq, bm) * nb * hq,)](*args, *descs, **consts, BLOCK_M=bm, BLOCK_N=bn,
                                                     TMA=use_tma, num_warps=warps, num_stages=stages)

    launch(config or _pick(_shape_key("dq", q, k, dvn, tma, *pad_consts.values()),
                           (IEEE_CONFIGS if ieee else ROW_CONFIGS)["dq"], tma, launch))


def attention_dkv(q: DevBuf, k: DevBuf, v: DevBuf, do: DevBuf, lse: DevBuf, delta: DevBuf, out: DevBuf,
                  key_qlo: DevBuf, key_qhi: DevBuf, q_offset: int, k_offset: int, scale: float,
                  dk: bool = True, dv: bool = True, config: Config | None = None,
                  scratch: DevBuf | None = None, key_padding: DevBuf | None = None, limits: DevBuf | None = None,
                  limits_batch: int = 0, mask: DevBuf | None = None, bias: DevBuf | None = None,
                  softcap: float | None = None) -> None:
    """dk and dv of blocks q, k, v, dO (a query block's partial) into ``out`` [b, skv, hkv, width]: dk in
    [..., :d] and dv after it (width d + d_v), or only the one asked for.  With ``scratch`` (at least
    ``dkv_scratch(...)`` float32 elements) a group's query heads are split among programs where
    ``dkv_splits`` says so.  Key padding, key limits, a mask, a bias and a softcap as the forward kernel
    takes them: a hidden key's dk and dv are 0."""
    _check("attention_dkv", {"q": q, "k": k, "v": v, "dO": do, "out": out})
    nb, sq, hq, d = q.shape
    skv, hkv, dvn = k.shape[1], k.shape[2], v.shape[3]
    width = (d if dk else 0) + (dvn if dv else 0)
    if width == 0 or tuple(out.shape) != (nb, skv, hkv, width):
        raise ValueError(f"attention_dkv writes [b, skv, hkv, {width}] (dk={dk}, dv={dv}); got out {out.shape}")
    if out.size == 0:
        return
    if sq == 0:
        raise ValueError("attention_dkv with no query rows is handled by the caller (zeros)")
    ieee = q.dtype in ("float32", "float64")
    block_d, block_dv = _widths(d), _widths(dvn)
    group = hq // hkv
    splits = 1 if scratch is None else dkv_splits(nb, skv, hkv, group)
    target, stride_split = out, 0  # the split pass writes each share's partials [b, skv, hkv, width] apart
    if scratch is not None and splits > 1:
        need = dkv_scratch(nb, skv, hkv, group, width)
        if scratch.nbytes < need * 4:
            raise ValueError(f"attention_dkv split {splits} ways needs {need} float32 elements of scratch; got "
                             f"{scratch.nbytes} bytes")
        target = DevBuf(scratch.ptr, (nb, skv, hkv, width), "float32", scratch.device)
        stride_split = nb * skv * hkv * width
    args = (Ptr(q), Ptr(k), Ptr(v), Ptr(do), Ptr(lse), Ptr(delta), Ptr(target), Ptr(key_qlo), Ptr(key_qhi),
            sq, skv, hkv, group, stride_split, q_offset, k_offset, float(scale),
            float(scale) * math.log2(math.e), *_grad_arguments(q, k, v, do, lse, delta, target))
    pad_args, pad_consts = _padding_arguments(key_qlo, key_padding, limits, limits_batch, mask, bias, sq, skv,
                                              softcap)
    args = (*args, *pad_args)
    consts = dict(D=d, DV=dvn, BLOCK_D=block_d, BLOCK_DV=block_dv, WRITE_DK=dk, WRITE_DV=dv, IEEE=ieee,
                  ACC=acc_type(q.dtype), **pad_consts)
    tma = _tma_views((q, k, v, do))

    def launch(cfg: Config) -> None:
        bm, bn, warps, stages, want_tma = cfg
        use_tma = bool(want_tma) and tma is not None  # a fixed config may ask for TMA where it cannot be used
        descs = _descriptors(tma if use_tma else None, (bm, bn, bn, bm), (block_d, block_d, block_dv, block_dv))
        _dkv_kernel[(triton.cdiv(skv, bn) * nb * hkv * splits,)](*args, *descs, **consts, BLOCK_M=bm, BLOCK_N=bn,
                                                                 TMA=use_tma, RELOAD=use_tma and want_tma == 2,
                                                                 SPLITS=splits, num_warps=warps, num_stages=stages)
        if splits > 1:  # the partials summed in split order into out
            rows, bw = nb * skv * hkv, min(128, triton.next_power_of_2(width))
            _sum_splits_kernel[(triton.cdiv(rows, 32), triton.cdiv(width, bw))](
                Ptr(target), Ptr(out), rows, skv, hkv, width, splits, stride_split, *_strides3(out),
                BLOCK_R=32, BLOCK_W=bw, num_warps=4)

    launch(config or _pick(_shape_key("dkv", q, k, dvn, tma, dk, dv, splits, *pad_consts.values()),
                           (IEEE_CONFIGS if ieee else ROW_CONFIGS)["dkv"], tma, launch))

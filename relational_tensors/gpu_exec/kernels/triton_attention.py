"""FlashAttention-style forward pass on one function spec's blocks.

q [b, sq, hq, d], k/v [b, skv, hkv, d] (GQA: query head h reads kv head h // g),
absolute query rows start at ``q_offset`` and keys at ``k_offset``.  Each query
row r may see the keys in [row_lo[r], row_hi[r]) (causal prefixes and packed
sequences are both encoded there), so a causal query block that starts at row r
and a key block of a seq_kv split need no special case.  Tiles skip the key
range no row of theirs can see.  With ``lse`` the log-sum-exp of every row is
written too, for the ⊕ that merges key blocks.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relational_tensors.gpu_exec.kernels.common import DevBuf, Ptr

__all__ = ["attention"]

LOG2E = 1.4426950408889634


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lo_ptr, hi_ptr,
                      sq, skv, hq, group, q_offset, k_offset, qk_scale,
                      stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs,
                      stride_ob, stride_os,
                      D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // hq
    h = pid_bh % hq
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < sq
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + rows[:, None].to(tl.int64) * stride_qs + h * D + dq[None, :],
                mask=rmask[:, None] & (dq[None, :] < D), other=0.0)
    abs_rows = q_offset + rows
    lo = tl.load(lo_ptr + abs_rows, mask=rmask, other=2147483647)
    hi = tl.load(hi_ptr + abs_rows, mask=rmask, other=0)
    start = tl.maximum(tl.min(lo, axis=0) - k_offset, 0)
    end = tl.minimum(tl.max(hi, axis=0) - k_offset, skv)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < end
        kt = tl.load(k_ptr + b * stride_kb + cols[None, :].to(tl.int64) * stride_ks + hk * D + dq[:, None],
                     mask=cmask[None, :] & (dq[:, None] < D), other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * qk_scale
        abs_cols = k_offset + cols
        visible = (abs_cols[None, :] >= lo[:, None]) & (abs_cols[None, :] < hi[:, None]) & cmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * stride_vb + cols[:, None].to(tl.int64) * stride_vs + hk * DV + dv[None, :],
                    mask=cmask[:, None] & (dv[None, :] < DV), other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    denom = tl.where(l_i > 0, l_i, 1.0)
    out = acc / denom[:, None]
    tl.store(o_ptr + b * stride_ob + rows[:, None].to(tl.int64) * stride_os + h * DV + dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))
    if WRITE_LSE:
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(l_i > 0, (m_fin + tl.log2(denom)) / 1.4426950408889634, float("-inf"))
        tl.store(lse_ptr + (b * sq + rows) * hq + h, lse, mask=rmask)


def attention(q: DevBuf, k: DevBuf, v: DevBuf, out: DevBuf, lse: DevBuf | None, row_lo: DevBuf, row_hi: DevBuf,
              q_offset: int, k_offset: int, scale: float) -> None:
    """Attention of contiguous blocks q, k, v into ``out`` (and ``lse`` [b, sq, hq] float32 if given)."""
    nb, sq, hq, d = q.shape
    skv, hkv, dvn = k.shape[1], k.shape[2], v.shape[3]
    if out.size == 0:
        return
    if skv == 0 or hkv == 0:
        raise ValueError("attention with no keys is handled by the caller (zero output, -inf lse)")
    ieee = q.dtype == "float32"
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dvn))
    big = block_d >= 128
    block_m = 64 if ieee else 128
    block_n = 32 if ieee else (64 if big else 64)
    grid = (triton.cdiv(sq, block_m), nb * hq)
    _attention_kernel[grid](
        Ptr(q), Ptr(k), Ptr(v), Ptr(out), Ptr(lse) if lse is not None else Ptr(out), Ptr(row_lo), Ptr(row_hi),
        sq, skv, hq, hq // hkv, q_offset, k_offset, scale * math.log2(math.e),
        q.strides[0], q.strides[1], k.strides[0], k.strides[1], v.strides[0], v.strides[1],
        out.strides[0], out.strides[1],
        D=d, DV=dvn, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=block_m, BLOCK_N=block_n,
        WRITE_LSE=lse is not None, IEEE=ieee, num_warps=8 if big else 4, num_stages=3 if not ieee else 2,
    )

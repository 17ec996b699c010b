"""Attention of a few query rows over a long key cache ("flash decoding"): the keys split across programs.

A decode step's attention has one query row per sequence (a few with speculative tokens), so the forward
kernel's grid of (row block, query head) has as few programs as there are heads and each walks the whole
cache alone.  Here one program serves a (batch row, kv head, key split): all ``group`` query heads that
read that kv head and all ``sq`` rows make the rows of its tile (the cache is read once per kv head, not
once per query head), and its split of the keys is walked in tiles with the online softmax.  Each split
writes its normalized partial output and its log-sum-exp (float32, in the launch's scratch); a second
kernel merges the splits, weighting each by exp(lse − max).  Where one split fills the GPU (a large batch)
the first kernel writes the output itself.

Query row r may see the keys [row_lo[r], row_hi[r]) (absolute positions: causal, windows and packed
sequences, as ``triton_attention``), and ``key_padding`` (bool [b, skv], True for a real key) hides keys
per batch row.  Masks, biases, softcaps and per-batch key lengths take the general kernel.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relational_tensors.kernels import scratch as sizes
from relational_tensors.kernels.common import DevBuf, Ptr
from relational_tensors.kernels.triton_attention import online_softmax

__all__ = ["decode_attention"]

LOG2E = tl.constexpr(1.4426950408889634)
@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, po_ptr, pl_ptr, lo_ptr, hi_ptr, kp_ptr,
                  nb, sq, skv, hq, hkv, group, q_offset, k_offset, qk_scale, per_split,
                  stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs,
                  stride_ob, stride_os, stride_kpb, stride_kpk,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr,
                  DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    b = pid // hkv
    hk = pid % hkv
    m = tl.arange(0, BLOCK_M)
    mmask = m < group * sq
    r = m % sq  # the query position of tile row m
    h = hk * group + m // sq  # and its query head
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + r[:, None].to(tl.int64) * stride_qs + h[:, None] * D + dq[None, :],
                mask=mmask[:, None] & (dq[None, :] < D), other=0.0)
    lo = tl.load(lo_ptr + q_offset + r, mask=mmask, other=2147483647)
    hi = tl.load(hi_ptr + q_offset + r, mask=mmask, other=-2147483647)
    # the keys of this split that some row sees
    start = tl.maximum(split * per_split, tl.min(tl.where(mmask, lo, 2147483647), axis=0) - k_offset)
    end = tl.minimum(tl.minimum(split * per_split + per_split, skv),
                     tl.max(tl.where(mmask, hi, -2147483647), axis=0) - k_offset)
    start = tl.maximum(start, 0)
    k_base = k_ptr + b * stride_kb + hk * D
    v_base = v_ptr + b * stride_vb + hk * DV
    kp_base = kp_ptr + b * stride_kpb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < end
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_ks + dq[:, None],
                     mask=cmask[None, :] & (dq[:, None] < D), other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        abs_cols = k_offset + cols
        visible = (abs_cols[None, :] >= lo[:, None]) & (abs_cols[None, :] < hi[:, None]) & cmask[None, :]
        if BITS:
            real = tl.load(kp_base + cols * stride_kpk, mask=cmask, other=0)
            visible = visible & (real != 0)[None, :]
        p, m_i, l_i, acc = online_softmax(tl.where(visible, s * qk_scale, float("-inf")), m_i, l_i, acc)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vs + dv[None, :],
                    mask=cmask[:, None] & (dv[None, :] < DV), other=0.0)
        if IEEE:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    denom = tl.where(l_i > 0, l_i, 1.0)
    out = acc / denom[:, None]
    lse2 = tl.where(l_i > 0, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(denom), float("-inf"))
    if DIRECT:  # one split: the output itself
        tl.store(o_ptr + b * stride_ob + r[:, None].to(tl.int64) * stride_os + h[:, None] * DV + dv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & (dv[None, :] < DV))
        if WRITE_LSE:
            tl.store(lse_ptr + (b * sq + r) * hq + h, lse2 / LOG2E, mask=mmask)
    else:  # partials [splits, nb, sq, hq, DV] and [splits, nb, sq, hq]
        row = ((split * nb + b) * sq + r) * hq + h
        tl.store(po_ptr + row[:, None] * DV + dv[None, :], out, mask=mmask[:, None] & (dv[None, :] < DV))
        tl.store(pl_ptr + row, lse2, mask=mmask)


@triton.jit
def _merge_kernel(po_ptr, pl_ptr, o_ptr, lse_ptr, nb, sq, hq, splits, stride_ob, stride_os,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b, r, h)
    h = row % hq
    r = (row // hq) % sq
    b = row // (hq * sq)
    s = tl.arange(0, BLOCK_S)
    smask = s < splits
    per_split = nb * sq * hq
    lse2 = tl.load(pl_ptr + s * per_split + row, mask=smask, other=float("-inf"))
    top = tl.max(lse2, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse2 - top)  # 0 for a split that saw no key
    total = tl.sum(w, axis=0)
    dv = tl.arange(0, BLOCK_DV)
    parts = tl.load(po_ptr + (s[:, None] * per_split + row) * DV + dv[None, :],
                    mask=smask[:, None] & (dv[None, :] < DV), other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + r * stride_os + h * DV + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)
    if WRITE_LSE:
        tl.store(lse_ptr + row, tl.where(total > 0, (top + tl.log2(total)) / LOG2E, float("-inf")))


def decode_attention(q: DevBuf, k: DevBuf, v: DevBuf, out: DevBuf, lse: DevBuf | None, row_lo: DevBuf,
                     row_hi: DevBuf, q_offset: int, k_offset: int, scale: float, key_padding: DevBuf | None,
                     scratch: DevBuf | None) -> None:
    """Attention of contiguous blocks q [b, sq, hq, d] (hq // hkv · sq at most ``DECODE_ROWS``), k and v [b,
    skv, hkv, d] into ``out`` (and ``lse`` [b, sq, hq] float32 if given), the keys split as
    ``kernels.scratch.decode_splits`` says; ``scratch`` holds ``decode_scratch`` float32 elements."""
    nb, sq, hq, d = q.shape
    skv, hkv, dvn = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    if out.size == 0:
        return
    if group * sq > sizes.DECODE_ROWS:
        raise ValueError(f"decode attention holds at most {sizes.DECODE_ROWS} query rows per kv head; got "
                         f"{group} × {sq}")
    splits, per = sizes.decode_splits(nb, hkv, skv)
    direct = splits == 1
    if not direct:
        need = splits * nb * sq * hq * (dvn + 1)
        if scratch is None or scratch.size < need or scratch.dtype != "float32":
            raise ValueError(f"decode attention needs {need} float32 elements of scratch; got {scratch}")
        po = scratch
        pl = DevBuf(scratch.ptr + splits * nb * sq * hq * dvn * 4, (splits * nb * sq * hq,), "float32",
                    scratch.device)
    else:
        po = pl = out
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dvn))
    width = 4 if q.dtype == "float32" else 2
    # a stage's K and V tiles within 32 KB of shared memory (fewer keys for wide heads), three stages of them,
    # two where even those are wider
    full = sizes.DECODE_BLOCK_N
    block_n = full if (block_d + block_dv) * full * width <= 32768 else full // 2
    stages = 3 if (block_d + block_dv) * block_n * width <= 32768 else 2
    scale = float(scale)
    _split_kernel[(nb * hkv, splits)](
        Ptr(q), Ptr(k), Ptr(v), Ptr(out), Ptr(lse) if lse is not None else Ptr(out), Ptr(po), Ptr(pl),
        Ptr(row_lo), Ptr(row_hi), Ptr(key_padding) if key_padding is not None else Ptr(row_lo),
        nb, sq, skv, hq, hkv, group, q_offset, k_offset, scale * math.log2(math.e), per,
        q.strides[0], q.strides[1], k.strides[0], k.strides[1], v.strides[0], v.strides[1],
        out.strides[0], out.strides[1], key_padding.strides[0] if key_padding is not None else 0,
        key_padding.strides[1] if key_padding is not None else 0,
        D=d, DV=dvn, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=max(16, triton.next_power_of_2(group * sq)),
        BLOCK_N=block_n, BITS=key_padding is not None, IEEE=q.dtype == "float32", DIRECT=direct,
        WRITE_LSE=lse is not None, num_warps=4, num_stages=stages)
    if not direct:
        _merge_kernel[(nb * sq * hq,)](Ptr(po), Ptr(pl), Ptr(out), Ptr(lse) if lse is not None else Ptr(out),
                                       nb, sq, hq, splits, out.strides[0], out.strides[1], DV=dvn,
                                       BLOCK_DV=block_dv, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                                       WRITE_LSE=lse is not None, num_warps=4)

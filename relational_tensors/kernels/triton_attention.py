"""FlashAttention-style forward pass on one function spec's blocks.

q [b, sq, hq, d], k/v [b, skv, hkv, d] (GQA: query head h reads kv head h // g),
absolute query rows start at ``q_offset`` and keys at ``k_offset``.  Each query
row r may see the keys in [row_lo[r], row_hi[r]) (causal prefixes and packed
sequences are both encoded there), so a causal query block that starts at row r
and a key block of a seq_kv split need no special case.  A tile of rows visits
only the keys some row of it can see; key tiles that every row sees entirely
run without masks.  With ``lse`` the log-sum-exp of every row is written too,
for the ⊕ that merges key blocks.

A boolean ``mask`` and an additive ``bias`` ([b or 1, hq or 1, sq, skv] blocks, any strides) are read
tile by tile beside the scores (``extra_arguments``): every tile is masked then, and a bias is added in
float32 after the scale, as SDPA adds its float mask.
"""

from __future__ import annotations

import math
from functools import cache

import triton
import triton.language as tl

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.kernels.common import DevBuf, Ptr, chosen_config, is_interpreted

__all__ = ["attention", "padding_limits", "extra_arguments", "online_softmax"]

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh through one exp2 (saturates to ±1 without overflow: 2 / inf is 0)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def extra_scores(s, visible, rows, cols, inside, mask_base, smr, smc, bias_base, sbr, sbc, cap2,
                 MASK: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr, TRANS: tl.constexpr):
    """Scores ``s`` (scaled, in log2 units) soft-capped, then with a boolean mask's and an additive bias's
    tile applied: -inf where a pair is not ``visible`` or the mask hides it, plus bias · log2(e) elsewhere.
    Returns them with the softcap's slope 1 - tanh² (what the scores' gradient is multiplied by; 1.0
    without one).  ``cap2`` is the softcap in log2 units; ``TRANS``: the tile is [keys, rows] (the dk|dv
    pass), not [rows, keys]; ``inside`` bounds the loads."""
    slope = 1.0
    if SOFTCAP:
        t = _tanh(s / cap2)
        s = cap2 * t
        slope = 1.0 - t * t
    if TRANS:
        r = rows[None, :].to(tl.int64)
        c = cols[:, None].to(tl.int64)
    else:
        r = rows[:, None].to(tl.int64)
        c = cols[None, :].to(tl.int64)
    if MASK:
        visible = visible & (tl.load(mask_base + r * smr + c * smc, mask=inside, other=0) != 0)
    if BIAS:
        s = s + tl.load(bias_base + r * sbr + c * sbc, mask=inside, other=0.0).to(s.dtype) * LOG2E
    return tl.where(visible, s, float("-inf")), slope


@triton.jit
def online_softmax(s, m_i, l_i, acc):
    """A tile of scores ``s`` (log2 units, -inf where hidden) into the running row maximum ``m_i``, sum ``l_i``
    and output ``acc``, rescaled to the new maximum: (the tile's weights p, m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def _tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, end, lo, hi, k_offset, qk_scale,
          dq, dv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
          mask_base, smr, smc, bias_base, sbr, sbc, cap2,
          D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, KT: tl.constexpr,
          NEG_SCALE: tl.constexpr, TMA: tl.constexpr, BITS: tl.constexpr, MASK: tl.constexpr,
          BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        cmask = cols < end
    if TMA:  # the tensor-memory accelerator copies the tile: no address arithmetic in registers
        kt = tl.trans(k_desc.load([krow + n0, kcol]))
    elif KT:  # rows of K as stored, transposed in registers
        if MASKED:
            k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_ks + dq[None, :],
                        mask=cmask[:, None] & (dq[None, :] < D), other=0.0)
        elif BLOCK_D == D:
            k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_ks + dq[None, :])
        else:
            k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_ks + dq[None, :], mask=dq[None, :] < D, other=0.0)
        kt = tl.trans(k)
    elif MASKED:
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_ks + dq[:, None],
                     mask=cmask[None, :] & (dq[:, None] < D), other=0.0)
    elif BLOCK_D == D:
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_ks + dq[:, None])
    else:
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_ks + dq[:, None], mask=dq[:, None] < D, other=0.0)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    if MASKED:
        abs_cols = k_offset + cols
        visible = (abs_cols[None, :] >= lo[:, None]) & (abs_cols[None, :] < hi[:, None]) & cmask[None, :]
        if BITS:  # key padding: the real keys of this batch row (every tile is masked then)
            real = tl.load(kp_base + cols * stride_kpk, mask=cmask, other=0)
            visible = visible & (real != 0)[None, :]
        if MASK or BIAS or SOFTCAP:  # a softcap, a mask's bits and a bias's values (every tile is masked then)
            s, _ = extra_scores(s * qk_scale, visible, rows, cols, rmask[:, None] & cmask[None, :], mask_base, smr,
                                smc, bias_base, sbr, sbc, cap2, MASK, BIAS, SOFTCAP, False)
        else:
            s = tl.where(visible, s * qk_scale, float("-inf"))
        p, m_i, l_i, acc = online_softmax(s, m_i, l_i, acc)
    else:  # every row sees every key of the tile: the maximum is finite, scale and shift are one FMA
        if NEG_SCALE:
            m_new = tl.maximum(m_i, tl.min(s, axis=1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
        p = tl.exp2(s * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, axis=1)
    if TMA:
        v = v_desc.load([krow + n0, vcol])
    elif MASKED:
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vs + dv[None, :],
                    mask=cmask[:, None] & (dv[None, :] < DV), other=0.0)
    elif BLOCK_DV == DV:
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vs + dv[None, :])
    else:
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vs + dv[None, :], mask=dv[None, :] < DV, other=0.0)
    if IEEE:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)  # accumulate in place: no second accumulator and add
    return acc, l_i, m_i


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lo_ptr, hi_ptr, kp_ptr, klim_ptr,
                      sq, skv, hq, group, q_offset, k_offset, qk_scale,
                      stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs,
                      stride_ob, stride_os, stride_kpb, stride_kpk, klim_b0,
                      mask_ptr, smb, smh, smr, smc, bias_ptr, sbb, sbh, sbr, sbc, cap2, q_desc, k_desc, v_desc,
                      D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WRITE_LSE: tl.constexpr, IEEE: tl.constexpr, KT: tl.constexpr, HEADS_INNER: tl.constexpr,
                      NEG_SCALE: tl.constexpr, TMA: tl.constexpr, LIMITS: tl.constexpr, BITS: tl.constexpr,
                      MASK: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    m_blocks = tl.cdiv(sq, BLOCK_M)  # a 1-D grid: (row block, batch·head) never overflows a grid dimension
    pid = tl.program_id(0).to(tl.int64)
    if HEADS_INNER:
        # the heads of one row block run side by side (the query heads of a kv group read the same keys
        # from L2), last row blocks first (under a causal mask they have the most keys: no long tail)
        nbh = tl.num_programs(0).to(tl.int64) // m_blocks
        pid_m = m_blocks - 1 - pid // nbh
        pid_bh = pid % nbh
    else:
        pid_m = pid % m_blocks
        pid_bh = pid // m_blocks
    b = pid_bh // hq
    h = pid_bh % hq
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < sq
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    if TMA:  # rows past sq belong to the next batch row (or are zeros past the end): masked at the store
        q = q_desc.load([(b * sq + pid_m * BLOCK_M).to(tl.int32), (h * D).to(tl.int32)])
    else:
        q = tl.load(q_ptr + b * stride_qb + rows[:, None].to(tl.int64) * stride_qs + h * D + dq[None, :],
                    mask=rmask[:, None] & (dq[None, :] < D), other=0.0)
    abs_rows = q_offset + rows
    lo = tl.load(lo_ptr + abs_rows, mask=rmask, other=2147483647)
    hi = tl.load(hi_ptr + abs_rows, mask=rmask, other=-2147483647)
    if LIMITS:  # this batch row's keys lie in [klo, khi) (absolute): key lengths, or padding's first and last
        klo = tl.load(klim_ptr + (klim_b0 + b) * 2)
        khi = tl.load(klim_ptr + (klim_b0 + b) * 2 + 1)
        lo = tl.maximum(lo, klo)
        hi = tl.minimum(hi, khi)
    lo_min = tl.min(tl.where(rmask, lo, 2147483647), axis=0) - k_offset
    lo_max = tl.max(tl.where(rmask, lo, -2147483647), axis=0) - k_offset
    hi_min = tl.min(tl.where(rmask, hi, 2147483647), axis=0) - k_offset
    hi_max = tl.max(tl.where(rmask, hi, -2147483647), axis=0) - k_offset
    start = (tl.maximum(lo_min, 0) // BLOCK_N) * BLOCK_N
    end = tl.minimum(hi_max, skv)
    # tiles every row sees whole: no masks there
    full_lo = tl.maximum(((tl.maximum(lo_max, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, start)
    full_hi = tl.maximum((tl.minimum(hi_min, skv) // BLOCK_N) * BLOCK_N, full_lo)
    full_hi = tl.minimum(full_hi, tl.maximum(end, full_lo))
    if BITS or MASK or BIAS or SOFTCAP:  # padding, masks, a bias or a softcap: every tile takes the masked path
        full_lo = tl.maximum(end, start)
        full_hi = full_lo
    mask_base = mask_ptr + b * smb + h * smh  # (strides 0 on broadcast dimensions)
    bias_base = bias_ptr + b * sbb + h * sbh
    k_base = k_ptr + b * stride_kb + hk * D
    v_base = v_ptr + b * stride_vb + hk * DV
    krow = (b * skv).to(tl.int32)
    kcol = (hk * D).to(tl.int32)
    vcol = (hk * DV).to(tl.int32)
    kp_base = kp_ptr + b * stride_kpb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, tl.minimum(full_lo, end), BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, end, lo, hi, k_offset,
                              qk_scale, dq, dv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
                              mask_base, smr, smc, bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True,
                              IEEE, KT, NEG_SCALE, TMA, BITS, MASK, BIAS, SOFTCAP)
    for n0 in range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, end, lo, hi, k_offset,
                              qk_scale, dq, dv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
                              mask_base, smr, smc, bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False,
                              IEEE, KT, NEG_SCALE, TMA, BITS, MASK, BIAS, SOFTCAP)
    for n0 in range(tl.maximum(full_hi, tl.minimum(full_lo, end)), end, BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, end, lo, hi, k_offset,
                              qk_scale, dq, dv, k_desc, v_desc, krow, kcol, vcol, kp_base, stride_kpk, rows, rmask,
                              mask_base, smr, smc, bias_base, sbr, sbc, cap2, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True,
                              IEEE, KT, NEG_SCALE, TMA, BITS, MASK, BIAS, SOFTCAP)
    denom = tl.where(l_i > 0, l_i, 1.0)
    out = acc / denom[:, None]
    tl.store(o_ptr + b * stride_ob + rows[:, None].to(tl.int64) * stride_os + h * DV + dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))
    if WRITE_LSE:
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(l_i > 0, (m_fin + tl.log2(denom)) / 1.4426950408889634, float("-inf"))
        tl.store(lse_ptr + (b * sq + rows) * hq + h, lse, mask=rmask)


@triton.jit
def _padding_limits_kernel(kp_ptr, out_ptr, skv, stride_b, stride_k, k_offset, BLOCK: tl.constexpr):
    """Per batch row of a key-padding block: [first real key, last real key + 1) as absolute positions
    (an empty [k_offset, k_offset) where no key is real)."""
    b = tl.program_id(0).to(tl.int64)
    first = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    last = tl.full([BLOCK], -1, dtype=tl.int32)
    for c0 in range(0, skv, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        real = tl.load(kp_ptr + b * stride_b + cols * stride_k, mask=cols < skv, other=0) != 0
        first = tl.minimum(first, tl.where(real, cols, 2147483647))
        last = tl.maximum(last, tl.where(real, cols, -1))
    lo = tl.min(first, axis=0)
    hi = tl.max(last, axis=0) + 1
    lo = tl.where(hi > 0, lo, 0)
    tl.store(out_ptr + b * 2, (lo + k_offset).to(tl.int32))
    tl.store(out_ptr + b * 2 + 1, (hi + k_offset).to(tl.int32))


def padding_limits(key_padding: DevBuf, out: DevBuf, k_offset: int) -> None:
    """``out`` (int32 [b, 2]) = each batch row's first and one-past-last real key of ``key_padding``
    (bool [b, skv], the keys from absolute position ``k_offset``), the bounds the forward kernel skips
    tiles outside of."""
    nb, skv = key_padding.shape
    if nb:
        _padding_limits_kernel[(nb,)](Ptr(key_padding), Ptr(out), skv, key_padding.strides[0],
                                      key_padding.strides[1], k_offset,
                                      BLOCK=min(1024, triton.next_power_of_2(max(skv, 1))))


# (BLOCK_M, BLOCK_N, num_warps, num_stages, KT, HEADS_INNER, TMA) tried on the first launch of each shape
# class: the fastest on an H200 at 8K and 128K tokens (bench/gpu_kernels.py --sweep, written to
# bench/results/gpu_kernels_sweep.json).  TMA configurations only where tensor descriptors work (Hopper or
# newer, whole heads, aligned contiguous blocks); the pointer ones serve everything else.
CONFIGS = [(64, 64, 4, 3, 1, 1, 0), (128, 64, 8, 3, 1, 0, 0), (128, 64, 8, 3, 1, 1, 0), (128, 128, 8, 3, 1, 1, 0),
           (128, 128, 8, 3, 0, 1, 0), (64, 64, 4, 3, 1, 1, 1), (128, 64, 8, 4, 1, 1, 1), (128, 128, 8, 3, 1, 1, 1)]
IEEE_CONFIGS = [(64, 32, 4, 2, 0, 1, 0), (32, 32, 4, 2, 0, 1, 0)]
_chosen: dict[tuple, tuple[int, ...]] = {}


class _DescBase:
    """What a Triton tensor descriptor needs of its base: ``data_ptr()`` and a NumPy dtype."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, buf: DevBuf) -> None:
        self._ptr, self.dtype = buf.ptr, numpy_dtype(buf.dtype)

    def data_ptr(self) -> int:
        return self._ptr


@cache
def _tma_device(device: int) -> bool:
    """Tensor descriptors (TMA) need compute capability 9.0 or more and a Triton that has them."""
    import cupy

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    with cupy.cuda.Device(device):
        return int(cupy.cuda.Device().compute_capability) >= 90


def _tma_views(q: DevBuf, k: DevBuf, v: DevBuf) -> tuple | None:
    """Each of q, k, v as a 2-D [batch * tokens, heads * head dim] view for tensor descriptors, or None
    where descriptors cannot address them exactly."""
    if q.dtype not in ("float16", "bfloat16") or interpreted() or not _tma_device(q.device):
        return None
    views = []
    for buf in (q, k, v):
        nb, s, h, d = buf.shape
        itemsize = numpy_dtype(buf.dtype).itemsize
        if (not buf.is_contiguous or d != triton.next_power_of_2(d) or d < 16 or buf.ptr % 16
                or (h * d * itemsize) % 16 or nb * s >= 2**31 or nb * s == 0):
            return None
        views.append((_DescBase(buf), [nb * s, h * d], [h * d, 1]))
    return tuple(views)


def _launch(cfg: tuple[int, ...], args: tuple, consts: dict, sq: int, nbh: int, tma: tuple | None = None) -> None:
    bm, bn, warps, stages, kt, heads_inner, use_tma = cfg
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        assert tma is not None  # _pick skips the descriptor configs when there are no views
        (qb, qs, qst), (kb, ks, kst), (vb, vs, vst) = tma
        descs = (TensorDescriptor(qb, qs, qst, [bm, consts["BLOCK_D"]]),
                 TensorDescriptor(kb, ks, kst, [bn, consts["BLOCK_D"]]),
                 TensorDescriptor(vb, vs, vst, [bn, consts["BLOCK_DV"]]))
    else:
        descs = (None, None, None)
    _attention_kernel[(triton.cdiv(sq, bm) * nbh,)](*args, *descs, **consts, BLOCK_M=bm, BLOCK_N=bn, KT=bool(kt),
                                                  HEADS_INNER=bool(heads_inner), TMA=bool(use_tma),
                                                  num_warps=warps, num_stages=stages)


@cache
def interpreted() -> bool:
    """Whether the attention kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were
    defined): no timing there, and no tensor descriptors."""
    return is_interpreted(_attention_kernel)


def _pick(key: tuple, args: tuple, consts: dict, sq: int, nbh: int, tma: tuple | None) -> tuple[int, ...]:
    """The fastest config for this key (:func:`~relational_tensors.kernels.common.fastest_config`),
    chosen once; tensor-descriptor configs only where the blocks allow them.  The interpreter takes the
    first config without descriptors."""
    if interpreted():
        return next(c for c in (IEEE_CONFIGS if consts["IEEE"] else CONFIGS) if not c[6])
    configs = [c for c in (IEEE_CONFIGS if consts["IEEE"] else CONFIGS) if not c[6] or tma is not None]
    return chosen_config(_chosen, key, configs, lambda cfg: _launch(cfg, args, consts, sq, nbh, tma),
                         lambda cfg: bool(cfg[6]), "attention kernel")


def _broadcast_strides(buf: DevBuf) -> tuple[int, ...]:
    """Element strides of a [b|1, hq|1, rows, keys] mask or bias block, 0 along its broadcast dimensions."""
    return tuple(0 if n == 1 else st for n, st in zip(buf.shape, buf.strides))


def extra_arguments(fallback: DevBuf, mask: DevBuf | None, bias: DevBuf | None, rows: int,
                    keys: int, softcap: float | None = None) -> tuple[tuple, dict]:
    """(kernel arguments, constexprs) of a boolean mask and an additive bias, blocks [b or 1, hq or 1,
    rows, keys] of any strides (a broadcast dimension's stride is taken as 0), and a softcap, as every
    attention kernel takes them: pointer and four strides each, the softcap in log2 units, then the
    ``MASK``, ``BIAS`` and ``SOFTCAP`` switches."""
    args: list = []
    for buf in (mask, bias):
        if buf is None:
            args += [Ptr(fallback), 0, 0, 0, 0]
            continue
        if len(buf.shape) != 4 or tuple(buf.shape[2:]) != (rows, keys):
            raise ValueError(f"an attention mask or bias block is [b|1, hq|1, {rows}, {keys}]; got {buf.shape}")
        args += [Ptr(buf), *_broadcast_strides(buf)]
    args.append(float(softcap) * math.log2(math.e) if softcap is not None else 1.0)
    return tuple(args), dict(MASK=mask is not None, BIAS=bias is not None, SOFTCAP=softcap is not None)


def launch_arguments(q: DevBuf, k: DevBuf, v: DevBuf, out: DevBuf, lse: DevBuf | None, row_lo: DevBuf,
                     row_hi: DevBuf, q_offset: int, k_offset: int, scale: float,
                     key_padding: DevBuf | None = None, limits: DevBuf | None = None,
                     limits_batch: int = 0, mask: DevBuf | None = None, bias: DevBuf | None = None,
                     softcap: float | None = None) -> tuple[tuple, dict, tuple, tuple | None]:
    """(positional arguments, constexprs, configuration key, tensor-descriptor views or None) of one
    launch; :func:`_launch` adds the configuration.  bench/gpu_kernels.py times configurations
    through this too.  ``key_padding`` (bool [b, skv], True for a real key, the keys of this block) masks
    keys in every tile; ``limits`` (int32 [B, 2], absolute key positions) bounds batch row
    ``limits_batch + b``'s keys to [limits[.., 0], limits[.., 1]), so tiles outside are skipped; ``mask``,
    ``bias`` and ``softcap`` as :func:`extra_arguments` takes them."""
    nb, sq, hq, d = q.shape
    skv, hkv, dvn = k.shape[1], k.shape[2], v.shape[3]
    scale = float(scale)  # a NumPy scalar would make NEG_SCALE a NumPy bool, which Triton refuses
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dvn))
    args = (Ptr(q), Ptr(k), Ptr(v), Ptr(out), Ptr(lse) if lse is not None else Ptr(out), Ptr(row_lo), Ptr(row_hi),
            Ptr(key_padding) if key_padding is not None else Ptr(row_lo),
            Ptr(limits) if limits is not None else Ptr(row_lo),
            sq, skv, hq, hq // hkv, q_offset, k_offset, scale * math.log2(math.e),
            q.strides[0], q.strides[1], k.strides[0], k.strides[1], v.strides[0], v.strides[1],
            out.strides[0], out.strides[1], key_padding.strides[0] if key_padding is not None else 0,
            key_padding.strides[1] if key_padding is not None else 0, limits_batch)
    extra_args, extra_consts = extra_arguments(row_lo, mask, bias, sq, skv, softcap)
    args = (*args, *extra_args)
    consts = dict(D=d, DV=dvn, BLOCK_D=block_d, BLOCK_DV=block_dv, WRITE_LSE=lse is not None,
                  IEEE=q.dtype == "float32", NEG_SCALE=bool(scale < 0), LIMITS=limits is not None,
                  BITS=key_padding is not None, **extra_consts)
    tma = _tma_views(q, k, v)
    key = (d, dvn, q.dtype, lse is not None, scale < 0, tma is not None, triton.next_power_of_2(sq),
           triton.next_power_of_2(skv), nb * hq, limits is not None, key_padding is not None, mask is not None,
           bias is not None, softcap is not None)
    return args, consts, key, tma


def attention(q: DevBuf, k: DevBuf, v: DevBuf, out: DevBuf, lse: DevBuf | None, row_lo: DevBuf, row_hi: DevBuf,
              q_offset: int, k_offset: int, scale: float, key_padding: DevBuf | None = None,
              limits: DevBuf | None = None, limits_batch: int = 0, mask: DevBuf | None = None,
              bias: DevBuf | None = None, softcap: float | None = None) -> None:
    """Attention of contiguous blocks q, k, v into ``out`` (and ``lse`` [b, sq, hq] float32 if given); key
    padding, per-batch key limits, a mask, a bias and a softcap as :func:`launch_arguments` takes them."""
    nb, sq, hq = q.shape[:3]
    if out.size == 0:
        return
    if k.shape[1] == 0 or k.shape[2] == 0:
        raise ValueError("attention with no keys is handled by the caller (zero output, -inf lse)")
    args, consts, key, tma = launch_arguments(q, k, v, out, lse, row_lo, row_hi, q_offset, k_offset, scale,
                                              key_padding, limits, limits_batch, mask, bias, softcap)
    _launch(_pick(key, args, consts, sq, nb * hq, tma), args, consts, sq, nb * hq, tma)

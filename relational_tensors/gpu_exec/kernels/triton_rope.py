"""Rotary embedding on x[batch, seq, heads, d_head] with positions from the block's offset."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relational_tensors.gpu_exec.kernels.common import DevBuf, Ptr

__all__ = ["rope"]


@triton.jit
def _rope_kernel(x_ptr, out_ptr, start_ptr, seq, heads, half, s_offset, log2_base,
                 BLOCK_H: tl.constexpr):
    # one program per (batch, position, head); angles in float64 so long sequences stay exact
    pid = tl.program_id(0).to(tl.int64)
    s = (pid // heads) % seq
    pos_abs = s_offset + s
    pos = (pos_abs - tl.load(start_ptr + pos_abs)).to(tl.float64)
    base = pid * (2 * half)
    i = tl.arange(0, BLOCK_H)
    mask = i < half
    inv = tl.exp2(-(2.0 * i.to(tl.float64) / (2 * half)) * log2_base)
    ang = pos * inv
    c = tl.cos(ang).to(tl.float32)
    sn = tl.sin(ang).to(tl.float32)
    x1 = tl.load(x_ptr + base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + i, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + half + i, (x2 * c + x1 * sn).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: DevBuf, out: DevBuf, seq_start: DevBuf, s_offset: int, base: float) -> None:
    """Rotate-half RoPE of contiguous x; ``seq_start[p]`` is the start of the packed sequence holding
    absolute position p (all zeros without packing); x's positions start at ``s_offset``."""
    b, s, h, d = x.shape
    if x.size:
        half = d // 2
        _rope_kernel[(b * s * h,)](Ptr(x), Ptr(out), Ptr(seq_start), s, h, half, s_offset, math.log2(base),
                                   BLOCK_H=triton.next_power_of_2(max(half, 1)))

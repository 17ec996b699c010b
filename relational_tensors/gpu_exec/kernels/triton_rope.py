"""Rotary embedding on x[batch, seq, heads, d_head] with positions from the block's offset."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relational_tensors.gpu_exec.kernels.common import DevBuf, Ptr

__all__ = ["rope"]

BLOCK_R = 16  # (batch, position, head) rows per program


@triton.jit
def _rope_kernel(x_ptr, out_ptr, start_ptr, n_rows, seq, heads, half, s_offset, log2_base,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    s = (rows // heads) % seq
    pos_abs = s_offset + s
    pos = (pos_abs - tl.load(start_ptr + pos_abs, mask=rmask, other=0)).to(tl.float64)
    i = tl.arange(0, BLOCK_H)
    imask = i < half
    inv = tl.exp2(-(2.0 * i.to(tl.float64) / (2 * half)) * log2_base)
    # the angle in float64, reduced to [0, 2pi) there, so long sequences keep their precision
    ang = pos[:, None] * inv[None, :]
    two_pi = 6.283185307179586
    ang = (ang - two_pi * tl.floor(ang / two_pi)).to(tl.float32)
    c = tl.cos(ang)
    sn = tl.sin(ang)
    mask = rmask[:, None] & imask[None, :]
    base = rows[:, None] * (2 * half) + i[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + base, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + half, (x2 * c + x1 * sn).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: DevBuf, out: DevBuf, seq_start: DevBuf, s_offset: int, base: float) -> None:
    """Rotate-half RoPE of contiguous x; ``seq_start[p]`` is the start of the packed sequence holding
    absolute position p (all zeros without packing); x's positions start at ``s_offset``."""
    b, s, h, d = x.shape
    rows = b * s * h
    if rows:
        half = d // 2
        _rope_kernel[(triton.cdiv(rows, BLOCK_R),)](Ptr(x), Ptr(out), Ptr(seq_start), rows, s, h, half, s_offset,
                                                    math.log2(base), BLOCK_R=BLOCK_R,
                                                    BLOCK_H=triton.next_power_of_2(max(half, 1)))

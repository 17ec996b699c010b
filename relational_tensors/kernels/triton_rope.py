"""Rotary embedding on x[batch, seq, heads, d_head]: with positions from the block's offset (``rope``; the
inverse rotation, the angles negated, is the gradient of a rotation), or by cos and sin tables the graph
computed (``rope_table``; its transpose is its gradient)."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from relational_tensors.kernels.common import DevBuf, Ptr, acc_type

__all__ = ["rope", "rope_table"]

BLOCK_S = 32  # (batch, position) rows per program; the angles of a row serve all its heads


@triton.jit
def _rotate_heads(x_ptr, out_ptr, p, mask, i, h0, heads, heads_per, half, c1, c2, s1, s2, TRANSPOSED: tl.constexpr,
                  ACC: tl.constexpr):
    """Rows ``p`` (flattened batch, position) of heads h0 .. h0 + heads_per - 1: (x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂),
    or with ``TRANSPOSED`` (x₁·c₁ + x₂·s₂, x₂·c₂ − x₁·s₁), the halves' tables given per row and frequency."""
    row = p[:, None] * (heads * 2 * half) + i[None, :]
    for j in range(0, heads_per):
        h = h0 + j
        hmask = mask & (i * 0 + h < heads)[None, :]  # compared as a vector (Triton's interpreter needs it)
        base = row + h * (2 * half)
        x1 = tl.load(x_ptr + base, mask=hmask, other=0.0).to(ACC)
        x2 = tl.load(x_ptr + base + half, mask=hmask, other=0.0).to(ACC)
        if TRANSPOSED:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(out_ptr + base, y1.to(out_ptr.dtype.element_ty), mask=hmask)
        tl.store(out_ptr + base + half, y2.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _rope_kernel(x_ptr, out_ptr, start_ptr, inv_ptr, n_pos, seq, heads, half, s_offset, log2_base, heads_per,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, INVERSE: tl.constexpr, ACC: tl.constexpr,
                 ROUNDED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    groups = tl.cdiv(heads, heads_per)
    p = (pid // groups) * BLOCK_S + tl.arange(0, BLOCK_S)  # flattened (batch, position)
    h0 = (pid % groups) * heads_per
    pmask = p < n_pos
    pos_abs = s_offset + p % seq
    pos = pos_abs - tl.load(start_ptr + pos_abs, mask=pmask, other=0)
    i = tl.arange(0, BLOCK_H)
    imask = i < half
    if ROUNDED:
        # a module's frequencies held in a 16-bit (or float32) buffer, read as it holds them, and the angle
        # their float32 product with the position, as the module computes it
        inv = tl.load(inv_ptr + i, mask=imask, other=0.0)
        ang = pos.to(tl.float32)[:, None] * inv[None, :]
    else:
        inv64 = tl.exp2(-(2.0 * i.to(tl.float64) / (2 * half)) * log2_base)
        # the angle in float64, reduced to [0, 2pi) there, so long sequences keep their precision; once per
        # position and frequency, then applied to every head of this program
        ang64 = pos.to(tl.float64)[:, None] * inv64[None, :]
        two_pi = 6.283185307179586
        ang = (ang64 - two_pi * tl.floor(ang64 / two_pi)).to(tl.float32)
    c = tl.cos(ang).to(ACC)
    sn = tl.sin(ang).to(ACC)
    if INVERSE:
        sn = -sn
    _rotate_heads(x_ptr, out_ptr, p, pmask[:, None] & imask[None, :], i, h0, heads, heads_per, half, c, c, sn, sn,
                  False, ACC)


def _grid(n_pos: int, heads: int) -> tuple[int, tuple[int]]:
    """(heads per program, grid) over ``n_pos`` rows of ``heads`` heads: enough programs to fill the GPU
    (about 1024), as many heads per program as that allows."""
    blocks = triton.cdiv(n_pos, BLOCK_S)
    heads_per = max(1, min(heads, blocks * heads // 1024))
    return heads_per, (blocks * triton.cdiv(heads, heads_per),)


def rope(x: DevBuf, out: DevBuf, seq_start: DevBuf, s_offset: int, base: float, inverse: bool = False,
         inv_freq: DevBuf | None = None) -> None:
    """Rotate-half RoPE of contiguous x; ``seq_start[p]`` is the start of the packed sequence holding
    absolute position p (all zeros without packing); x's positions start at ``s_offset``; ``inverse``
    rotates by the negated angles; ``inv_freq`` (float32, d // 2) gives rounded frequencies
    (``sql_specs.rope.rounded_frequencies``), whose angles are formed in float32."""
    b, s, h, d = x.shape
    n_pos = b * s
    if n_pos and h:
        half = d // 2
        heads_per, grid = _grid(n_pos, h)
        _rope_kernel[grid](Ptr(x), Ptr(out), Ptr(seq_start), Ptr(inv_freq if inv_freq is not None else seq_start),
                           n_pos, s, h, half, s_offset, math.log2(base), heads_per,
                           BLOCK_S=BLOCK_S, BLOCK_H=triton.next_power_of_2(max(half, 1)), INVERSE=bool(inverse),
                           ACC=acc_type(x.dtype), ROUNDED=inv_freq is not None)


@triton.jit
def _rope_table_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_pos, seq, heads, half, cos_rows, sin_rows, heads_per,
                       BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, INVERSE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    groups = tl.cdiv(heads, heads_per)
    p = (pid // groups) * BLOCK_S + tl.arange(0, BLOCK_S)  # flattened (batch, position)
    h0 = (pid % groups) * heads_per
    pmask = p < n_pos
    i = tl.arange(0, BLOCK_H)
    mask = pmask[:, None] & (i < half)[None, :]
    # each table's row: per (batch, position), or per position where the batch shares the table
    crow = tl.where(cos_rows == n_pos, p, p % seq)[:, None] * (2 * half) + i[None, :]
    srow = tl.where(sin_rows == n_pos, p, p % seq)[:, None] * (2 * half) + i[None, :]
    c1 = tl.load(cos_ptr + crow, mask=mask, other=0.0).to(ACC)
    c2 = tl.load(cos_ptr + crow + half, mask=mask, other=0.0).to(ACC)
    s1 = tl.load(sin_ptr + srow, mask=mask, other=0.0).to(ACC)
    s2 = tl.load(sin_ptr + srow + half, mask=mask, other=0.0).to(ACC)
    _rotate_heads(x_ptr, out_ptr, p, mask, i, h0, heads, heads_per, half, c1, c2, s1, s2, INVERSE, ACC)


def rope_table(x: DevBuf, cos: DevBuf, sin: DevBuf, out: DevBuf, inverse: bool = False) -> None:
    """``x·cos + rotate_half(x)·sin`` of contiguous x[b, s, h, d] by contiguous tables cos and sin
    [b or 1, s, d] (``inverse``: the transposed rotation), computed in float32 and rounded once."""
    b, s, h, d = x.shape
    n_pos = b * s
    if n_pos and h:
        half = d // 2
        heads_per, grid = _grid(n_pos, h)
        _rope_table_kernel[grid](Ptr(x), Ptr(cos), Ptr(sin), Ptr(out), n_pos, s, h, half, cos.shape[0] * s,
                                 sin.shape[0] * s, heads_per,
                                 BLOCK_S=BLOCK_S, BLOCK_H=triton.next_power_of_2(max(half, 1)),
                                 INVERSE=bool(inverse), ACC=acc_type(x.dtype))

"""Counter-based random kernels: train-mode dropout and uniform/Bernoulli tensors, Philox4x32-10 with the key
and counter layout of ``sql_specs.random`` (so each block computes, bit for bit, what the NumPy kernel
computes for it).  The seed and offset are read from the generator-state buffer on the device: no host
sync, and a captured CUDA graph draws new values when a new state is loaded."""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from relational_tensors.core.dtypes import itemsize
from relational_tensors.kernels.common import DevBuf, Ptr, acc_type, contiguous_strides, outer_split
from relational_tensors.kernels.triton_copy import index4
from relational_tensors.sql_specs.random import (
    PHILOX_M,
    PHILOX_ROUNDS,
    PHILOX_W,
    UNIFORM_BITS,
    dropout_scale,
    keep_threshold,
)

__all__ = ["dropout", "random"]

BLOCK = 1024
# the generator's constants, as the Triton constants a kernel may read
_M0 = tl.constexpr(PHILOX_M[0])
_M1 = tl.constexpr(PHILOX_M[1])
_W0 = tl.constexpr(PHILOX_W[0])
_W1 = tl.constexpr(PHILOX_W[1])
_ROUNDS = tl.constexpr(PHILOX_ROUNDS)
_DIST = {"uniform": 0, "bernoulli": 1}


@triton.jit
def _philox_word(g, rng_ptr, stream):
    """The first Philox4x32-10 output word (uint32) at the global flat indices ``g`` (int64), under the
    (seed, offset) the int64 buffer ``rng_ptr`` holds and the site's ``stream``."""
    seed = tl.load(rng_ptr)
    offset = tl.load(rng_ptr + 1)
    k0 = seed.to(tl.uint32)  # an int64 -> uint32 conversion keeps the low 32 bits
    k1 = (seed >> 32).to(tl.uint32)
    c0 = g.to(tl.uint32)
    c1 = (g >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    c2 = (zero + stream).to(tl.uint32)  # a scalar argument may come as int32, int64 or a constexpr 1
    c3 = zero + offset.to(tl.uint32)
    m0 = zero + _M0
    m1 = zero + _M1
    for r in tl.static_range(_ROUNDS):
        if r > 0:  # the key is bumped between rounds
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0


@triton.jit
def _index(offs, size_1, size_2, size_3, FLAT: tl.constexpr):
    """The 4-D index of each flat offset; a piece that merged to one dimension (``FLAT``: a whole tensor or
    a block of whole rows) skips the 64-bit divisions."""
    if FLAT:
        zero = tl.zeros_like(offs)
        return zero, zero, zero, offs
    return index4(offs, size_1, size_2, size_3)


@triton.jit
def _dropout_kernel(x_ptr, out_ptr, rng_ptr, n, size_1, size_2, size_3,
                    sx0, sx1, sx2, sx3, so0, so1, so2, so3, sg0, sg1, sg2, sg3, g_base,
                    stream, threshold, scale_bits, FLAT: tl.constexpr, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = _index(offs, size_1, size_2, size_3, FLAT)
    g = g_base + i0 * sg0 + i1 * sg1 + i2 * sg2 + i3 * sg3  # the flat index in the whole tensor
    word = _philox_word(g, rng_ptr, stream)
    keep = ((word >> 8) >= (tl.zeros_like(word) + threshold)).to(ACC)
    scale = scale_bits.to(tl.float64, bitcast=True).to(ACC)
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3, mask=mask, other=0).to(ACC)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3, ((x * keep) * scale).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _random_kernel(out_ptr, rng_ptr, n, size_1, size_2, size_3, so0, so1, so2, so3, sg0, sg1, sg2, sg3, g_base,
                   stream, threshold, DIST: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr,
                   FLAT: tl.constexpr, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = _index(offs, size_1, size_2, size_3, FLAT)
    g = g_base + i0 * sg0 + i1 * sg1 + i2 * sg2 + i3 * sg3
    word = _philox_word(g, rng_ptr, stream)
    if DIST == 0:  # uniform, truncated to BITS significand bits: exact in the output dtype
        v = (word >> (32 - BITS)).to(ACC) * SCALE  # SCALE = 2^-BITS
    else:  # bernoulli: 1 where u < p
        v = tl.where((word >> 8) < (tl.zeros_like(word) + threshold), 1.0, 0.0).to(ACC)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3, v.to(out_ptr.dtype.element_ty), mask=mask)


def _global_strides(full_shape: tuple[int, ...], lower: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Row-major strides of the whole tensor, and the flat index of the block's first element."""
    strides = contiguous_strides(tuple(full_shape))
    return strides, sum(lo * s for lo, s in zip(lower, strides))


def _check(what: str, out: DevBuf, rng: DevBuf, lower: tuple[int, ...], full_shape: tuple[int, ...]) -> None:
    if rng.dtype != "int64" or rng.size != 2:
        raise ValueError(f"{what} reads an int64 generator state of 2 elements; got {rng.dtype} of shape {rng.shape}")
    if len(lower) != len(out.shape) or len(full_shape) != len(out.shape) or any(
            lo < 0 or lo + n > s for lo, n, s in zip(lower, out.shape, full_shape)):
        raise ValueError(f"{what}: a block of shape {out.shape} at {lower} does not lie in a tensor of shape "
                         f"{full_shape}")


def dropout(x: DevBuf, rng: DevBuf, out: DevBuf, lower: tuple[int, ...], full_shape: tuple[int, ...], p: float,
            stream: int) -> None:
    """out = (x · keep) · 1/(1-p) for the block of x at ``lower`` in a tensor of ``full_shape``; keep from
    Philox at each element's flat index in the whole tensor (any strides; out may alias x)."""
    _check("dropout", out, rng, lower, full_shape)
    if x.shape != out.shape:
        raise ValueError(f"dropout: x block {x.shape} and out block {out.shape} differ")
    if not out.size:
        return
    gstrides, base = _global_strides(full_shape, lower)
    scale_bits = struct.unpack("<q", struct.pack("<d", dropout_scale(p)))[0]  # passed exactly, as float64 bits
    sizes = (itemsize(x.dtype), itemsize(out.dtype), 1)
    for offs, shape, (sx, so, sg) in outer_split(out.shape, (x.strides, out.strides, gstrides), 4):
        px, po = (Ptr(v.ptr + o * size, v.dtype) for v, o, size in zip((x, out), offs, sizes))
        m = shape[0] * shape[1] * shape[2] * shape[3]
        _dropout_kernel[(triton.cdiv(m, BLOCK),)](px, po, Ptr(rng), m, shape[1], shape[2], shape[3], *sx, *so, *sg,
                                                 base + offs[2], int(stream), keep_threshold(p), scale_bits,
                                                 FLAT=shape[:3] == (1, 1, 1), BLOCK_SIZE=BLOCK,
                                                 ACC=acc_type(out.dtype))


def random(rng: DevBuf, out: DevBuf, lower: tuple[int, ...], full_shape: tuple[int, ...], stream: int,
           distribution: str, p: float) -> None:
    """out = the block at ``lower`` of a ``full_shape`` tensor of uniform [0, 1) values (truncated to the
    dtype's ``UNIFORM_BITS``) or Bernoulli(p) 1.0/0.0 values."""
    _check("random", out, rng, lower, full_shape)
    if not out.size:
        return
    gstrides, base = _global_strides(full_shape, lower)
    bits = UNIFORM_BITS[out.dtype]
    for offs, shape, (so, sg) in outer_split(out.shape, (out.strides, gstrides), 4):
        m = shape[0] * shape[1] * shape[2] * shape[3]
        _random_kernel[(triton.cdiv(m, BLOCK),)](Ptr(out.ptr + offs[0] * itemsize(out.dtype), out.dtype), Ptr(rng),
                                                m, shape[1], shape[2], shape[3], *so, *sg, base + offs[1],
                                                int(stream), keep_threshold(p), DIST=_DIST[distribution],
                                                BITS=bits, SCALE=2.0**-bits, FLAT=shape[:3] == (1, 1, 1),
                                                BLOCK_SIZE=BLOCK,
                                                ACC=acc_type(out.dtype))

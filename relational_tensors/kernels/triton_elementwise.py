"""Elementwise kernels: unary ops, broadcasting binaries, SwiGLU, casts, and the boolean masks
(comparisons, logic, ``where``, casts to bool). fp32 math inside (fp64 for float64, and exact integer
arithmetic in the binaries); comparisons in the operands' own dtype."""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from relational_tensors.core.dtypes import itemsize
from relational_tensors.kernels.common import DevBuf, Ptr, acc_type, outer_split
from relational_tensors.kernels.triton_copy import index4

__all__ = ["unary", "binary", "swiglu", "unary_math", "binary_math", "UNARY_CODES", "BINARY_CODES",
           "MASK_CODES", "compare", "where", "to_bool", "logical_not"]

BLOCK = 1024
UNARY_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "sigmoid": 4, "tanh": 5, "exp": 6, "log": 7,
               "neg": 8, "abs": 9, "sqrt": 10, "rsqrt": 11, "square": 12, "scale": 13, "add_scalar": 14,
               "pow": 15, "cast": 16, "fill": 17, "log1p": 18, "expm1": 19, "erf": 20, "sin": 21, "cos": 22,
               "detach": 16, "floor": 23}
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3, "maximum": 4, "minimum": 5, "eq": 6, "logaddexp": 7}


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def unary_math(x, arg, OP: tl.constexpr):
    """Unary op code ``OP`` of ``x`` (already in its compute type), ``arg`` its scalar: the arithmetic of every
    unary kernel, the fused ones (``triton_fused``) included, so that they compute the same bits."""
    if OP == 0:
        y = tl.maximum(x, 0.0)
    elif OP == 1:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif OP == 2:
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif OP == 3:
        y = x * tl.sigmoid(x)
    elif OP == 4:
        y = tl.sigmoid(x)
    elif OP == 5:
        y = _tanh(x)
    elif OP == 6:
        y = tl.exp(x)
    elif OP == 7:
        y = tl.log(x)
    elif OP == 8:
        y = -x
    elif OP == 9:
        y = tl.abs(x)
    elif OP == 10:
        y = tl.sqrt(x)
    elif OP == 11:
        y = tl.rsqrt(x)
    elif OP == 12:
        y = x * x
    elif OP == 13:
        y = x * arg
    elif OP == 14:
        y = x + arg
    elif OP == 15:
        y = tl.exp2(arg * tl.log2(x))
    elif OP == 17:
        y = tl.zeros_like(x) + arg
    elif OP == 18:  # log(1 + x) with the rounding of 1 + x corrected (Goldberg's formula), plain log far from 0
        u = 1.0 + x
        y = tl.where(u == 1.0, x, tl.where(tl.abs(x) > 1.0, tl.log(u), tl.log(u) * (x / (u - 1.0))))
    elif OP == 19:  # exp(x) - 1 with the same correction through u = exp(x), plain exp(x) - 1 far from 0
        u = tl.exp(x)
        y = tl.where(u == 1.0, x, tl.where(tl.abs(x) > 1.0, u - 1.0, (u - 1.0) * (x / tl.log(u))))
    elif OP == 20:
        y = tl.erf(x)
    elif OP == 21:
        y = tl.sin(x)
    elif OP == 22:
        y = tl.cos(x)
    elif OP == 23:
        y = tl.floor(x)
    else:
        y = x
    return y


@triton.jit
def _unary_kernel(x_ptr, out_ptr, n, arg, OP: tl.constexpr, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0).to(ACC)
    y = unary_math(x, arg, OP)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def unary(x: DevBuf, out: DevBuf, op: str, arg: float = 0.0) -> None:
    """out = op(x) elementwise on contiguous views (``cast`` converts exactly, without fp32)."""
    n = x.size
    if not n:
        return
    grid = (triton.cdiv(n, BLOCK),)
    if op == "cast":
        _cast_kernel[grid](Ptr(x), Ptr(out), n, BLOCK_SIZE=BLOCK)
    else:
        _unary_kernel[grid](Ptr(x), Ptr(out), n, float(arg), OP=UNARY_CODES[op], BLOCK_SIZE=BLOCK,
                            ACC=acc_type(out.dtype))


@triton.jit
def binary_math(x, y, OP: tl.constexpr, ACC: tl.constexpr):
    """Binary op code ``OP`` of ``x`` and ``y`` (already in the compute type ``ACC``): the arithmetic of every
    binary kernel, the fused ones included."""
    if OP == 0:
        r = x + y
    elif OP == 1:
        r = x - y
    elif OP == 2:
        r = x * y
    elif OP == 3:
        r = x / y
    elif OP == 4:
        r = tl.maximum(x, y)
    elif OP == 5:
        r = tl.minimum(x, y)
    elif OP == 6:  # equal, or both NaN
        r = tl.where((x == y) | ((x != x) & (y != y)), 1.0, 0.0).to(ACC)
    else:  # log(e^x + e^y), -inf where both are
        top = tl.maximum(x, y)
        safe = tl.where(top == float("-inf"), 0.0, top)
        r = tl.where(top == float("-inf"), top, safe + tl.log(tl.exp(x - safe) + tl.exp(y - safe)))
    return r


@triton.jit
def _binary_kernel(x_ptr, y_ptr, out_ptr, n, size_1, size_2, size_3,
                   sx0, sx1, sx2, sx3, sy0, sy1, sy2, sy3, so0, so1, so2, so3,
                   OP: tl.constexpr, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = index4(offs, size_1, size_2, size_3)
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3, mask=mask).to(ACC)
    y = tl.load(y_ptr + i0 * sy0 + i1 * sy1 + i2 * sy2 + i3 * sy3, mask=mask).to(ACC)
    r = binary_math(x, y, OP, ACC)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3, r.to(out_ptr.dtype.element_ty), mask=mask)


def binary(x: DevBuf, y: DevBuf, out: DevBuf, op: str) -> None:
    """out = x op y with NumPy broadcasting (x and y broadcast to out's shape); any strides, so the ⊕ of
    an exchange reads atoms and writes pieces in place inside larger blocks (out may alias x)."""
    _broadcast_launch(_binary_kernel, out, (x, y), OP=BINARY_CODES[op], ACC=acc_type(out.dtype, exact_ints=True))


# comparisons (in the operands' own dtype, IEEE: NaN compares unequal) and the logic of booleans (any nonzero
# byte is true); the result is a boolean byte, 0 or 1
MASK_CODES = {"equal": 0, "not_equal": 1, "less": 2, "less_equal": 3, "greater": 4, "greater_equal": 5,
              "logical_and": 6, "logical_or": 7, "logical_xor": 8}


@triton.jit
def _mask_kernel(x_ptr, y_ptr, out_ptr, n, size_1, size_2, size_3,
                 sx0, sx1, sx2, sx3, sy0, sy1, sy2, sy3, so0, so1, so2, so3,
                 OP: tl.constexpr, WIDEN: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = index4(offs, size_1, size_2, size_3)
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3, mask=mask)
    y = tl.load(y_ptr + i0 * sy0 + i1 * sy1 + i2 * sy2 + i3 * sy3, mask=mask)
    if WIDEN:  # 16-bit floats compared as the float32 values they are exactly
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    if OP == 0:  # NaN equals nothing, itself included (spelled out: compilers may compare bits)
        r = (x == y) & (x == x) & (y == y)
    elif OP == 1:
        r = ~((x == y) & (x == x) & (y == y))
    elif OP == 2:
        r = x < y
    elif OP == 3:
        r = x <= y
    elif OP == 4:
        r = x > y
    elif OP == 5:
        r = x >= y
    elif OP == 6:
        r = (x != 0) & (y != 0)
    elif OP == 7:
        r = (x != 0) | (y != 0)
    else:
        r = (x != 0) ^ (y != 0)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3, r.to(tl.int8), mask=mask)


@triton.jit
def _where_kernel(c_ptr, x_ptr, y_ptr, out_ptr, n, size_1, size_2, size_3,
                  sc0, sc1, sc2, sc3, sx0, sx1, sx2, sx3, sy0, sy1, sy2, sy3, so0, so1, so2, so3,
                  BLOCK_SIZE: tl.constexpr, KEEP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = index4(offs, size_1, size_2, size_3)
    c = tl.load(c_ptr + i0 * sc0 + i1 * sc1 + i2 * sc2 + i3 * sc3, mask=mask, other=0) != 0
    o = out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3
    if KEEP == 1:  # out is y: only the elements x replaces are read and written
        tl.store(o, tl.load(x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3, mask=mask & c), mask=mask & c)
    elif KEEP == 2:  # out is x
        keep = mask & (c == 0)
        tl.store(o, tl.load(y_ptr + i0 * sy0 + i1 * sy1 + i2 * sy2 + i3 * sy3, mask=keep), mask=keep)
    else:
        x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3, mask=mask)
        y = tl.load(y_ptr + i0 * sy0 + i1 * sy1 + i2 * sy2 + i3 * sy3, mask=mask)
        tl.store(o, tl.where(c, x, y), mask=mask)


@triton.jit
def _bool_kernel(x_ptr, out_ptr, n, NOT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if NOT:
        r = x == 0
    else:
        r = x != 0
    tl.store(out_ptr + offs, r.to(tl.int8), mask=mask)


def _broadcast_strides(v: DevBuf, out: DevBuf) -> tuple[int, ...]:
    """``v``'s strides broadcast to ``out``'s shape: 0 along the dimensions it broadcasts."""
    pad = len(out.shape) - len(v.shape)
    return tuple(0 if i < pad or (v.shape[i - pad] == 1 and n_out != 1) else v.strides[i - pad]
                 for i, n_out in enumerate(out.shape))


def _broadcast_launch(kernel: Any, out: DevBuf, ins: tuple[DevBuf, ...], **consts: Any) -> None:
    """Launch ``kernel`` over ``out`` with ``ins`` broadcast to it (any strides; out may alias an input), a
    rank-4 piece at a time: the kernel takes the inputs' and out's pointers, the piece's size, and the
    inputs' and out's four strides each."""
    if not out.size:
        return
    bufs = (*ins, out)
    sizes = tuple(itemsize(v.dtype) for v in bufs)
    for offs, shape, strides in outer_split(out.shape, tuple(_broadcast_strides(v, out) for v in bufs), 4):
        ptrs = [Ptr(v.ptr + o * size, v.dtype) for v, o, size in zip(bufs, offs, sizes)]
        m = shape[0] * shape[1] * shape[2] * shape[3]
        kernel[(triton.cdiv(m, BLOCK),)](*ptrs, m, shape[1], shape[2], shape[3], *(x for st in strides for x in st),
                                         BLOCK_SIZE=BLOCK, **consts)


def compare(x: DevBuf, y: DevBuf, out: DevBuf, op: str) -> None:
    """out (bool) = x op y for a comparison or the logic of two booleans (``MASK_CODES``), broadcast."""
    _broadcast_launch(_mask_kernel, out, (x, y), OP=MASK_CODES[op], WIDEN=x.dtype in ("bfloat16", "float16"))


def where(cond: DevBuf, x: DevBuf, y: DevBuf, out: DevBuf) -> None:
    """out = x where cond, else y (x, y and out of one dtype), broadcast.  Where out is y itself (a state's
    block written in place: a key/value cache taking a step's new rows), only the elements x replaces are
    read and written; likewise where out is x."""
    keep = next((k for k, v in ((1, y), (2, x))
                 if v.ptr == out.ptr and v.shape == out.shape and v.strides == out.strides), 0)
    _broadcast_launch(_where_kernel, out, (cond, x, y), KEEP=keep)


def to_bool(x: DevBuf, out: DevBuf) -> None:
    """out (bool) = x != 0 on contiguous views: the cast to a boolean (NaN is true, as in NumPy)."""
    if x.size:
        _bool_kernel[(triton.cdiv(x.size, BLOCK),)](Ptr(x), Ptr(out), x.size, NOT=False, BLOCK_SIZE=BLOCK)


def logical_not(x: DevBuf, out: DevBuf) -> None:
    """out (bool) = not x on contiguous boolean views."""
    if x.size:
        _bool_kernel[(triton.cdiv(x.size, BLOCK),)](Ptr(x), Ptr(out), x.size, NOT=True, BLOCK_SIZE=BLOCK)


@triton.jit
def _swiglu_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(ACC)
    b = tl.load(b_ptr + offs, mask=mask).to(ACC)
    tl.store(out_ptr + offs, (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(a: DevBuf, b: DevBuf, out: DevBuf) -> None:
    """out = silu(a) * b in one pass."""
    n = out.size
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](Ptr(a), Ptr(b), Ptr(out), n, BLOCK_SIZE=BLOCK,
                                                 ACC=acc_type(out.dtype))

"""Gradients of the elementwise operators: ``unary_grad`` (dy·f'(x)), ``binary_grad`` (dy·∂(x op y)/∂x_k with
broadcast operands) and ``swiglu_grad``.  fp32 inside (fp64 for float64)."""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from relational_tensors.core.dtypes import itemsize
from relational_tensors.kernels.common import DevBuf, Ptr, acc_type, outer_split
from relational_tensors.kernels.triton_copy import index4

__all__ = ["unary_grad", "binary_grad", "swiglu_grad", "UNARY_GRAD_CODES", "BINARY_GRAD_CODES"]

BLOCK = 1024
UNARY_GRAD_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "sigmoid": 4, "tanh": 5, "exp": 6, "log": 7,
                    "abs": 8, "sqrt": 9, "rsqrt": 10, "square": 11, "pow": 12, "log1p": 13, "expm1": 14, "erf": 15,
                    "sin": 16, "cos": 17}
BINARY_GRAD_CODES = {"mul": 0, "div": 1, "maximum": 2, "minimum": 3}


@triton.jit
def _power(x, e, E_INT: tl.constexpr, E_ODD: tl.constexpr):
    """x ** e as NumPy gives it: |x|^e through exp and log, the sign of an odd integer power, NaN for a negative
    base and a fractional power, 0 ** 0 = 1."""
    ax = tl.abs(x)
    p = tl.exp(e * tl.log(ax))
    p = tl.where(e == 0.0, 1.0, p)
    if E_INT:
        if E_ODD:
            p = tl.where(x < 0.0, -p, p)
    else:
        p = tl.where(x < 0.0, float("nan"), p)
    return p


@triton.jit
def _unary_grad_kernel(x_ptr, dy_ptr, out_ptr, n, arg_hi, arg_lo, OP: tl.constexpr, E_INT: tl.constexpr,
                       E_ODD: tl.constexpr, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0).to(ACC)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
    if OP == 0:
        d = tl.where(x > 0.0, 1.0, 0.0).to(ACC)
    elif OP == 1:  # Φ(x) + x·φ(x)
        d = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif OP == 2:  # with s = σ(2u): tanh(u) = 2s - 1 and 1 - tanh(u)² = 4s(1 - s)
        s = tl.sigmoid(2.0 * (0.7978845608028654 * (x + 0.044715 * x * x * x)))
        d = s + 2.0 * x * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    elif OP == 3:
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    elif OP == 4:
        s = tl.sigmoid(x)
        d = s * (1.0 - s)
    elif OP == 5:
        s = tl.sigmoid(2.0 * x)
        d = 4.0 * s * (1.0 - s)
    elif OP == 6:
        d = tl.exp(x)
    elif OP == 7:
        d = 1.0 / x
    elif OP == 8:
        d = tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0)).to(ACC)
    elif OP == 9:
        d = 0.5 / tl.sqrt(x)
    elif OP == 10:
        d = -0.5 / (x * tl.sqrt(x))
    elif OP == 11:
        d = 2.0 * x
    elif OP == 13:
        d = 1.0 / (1.0 + x)
    elif OP == 14:
        d = tl.exp(x)
    elif OP == 15:
        d = tl.exp(-x * x) * 1.1283791670955126
    elif OP == 16:
        d = tl.cos(x)
    elif OP == 17:
        d = -tl.sin(x)
    else:  # pow: a · x^(a - 1), the exponent given as two floats (a float64 one keeps 48 bits)
        a = tl.full([BLOCK_SIZE], arg_hi, ACC) + tl.full([BLOCK_SIZE], arg_lo, ACC)
        d = a * _power(x, a - 1.0, E_INT, E_ODD)
    tl.store(out_ptr + offs, (dy * d).to(out_ptr.dtype.element_ty), mask=mask)


def unary_grad(x: DevBuf, dy: DevBuf, out: DevBuf, op: str, arg: float = 0.0) -> None:
    """out = dy · f'(x) for the unary ``op`` (``arg`` its scalar) on contiguous views of one shape."""
    if not x.shape == dy.shape == out.shape:
        raise ValueError(f"unary_grad needs x, dy and out of one shape; got {x.shape}, {dy.shape}, {out.shape}")
    n = x.size
    if not n:
        return
    hi = float(np.float32(arg))
    lo = float(np.float32(arg - hi)) if x.dtype == "float64" else 0.0
    e = float(arg) - 1.0
    e_int = math.isfinite(e) and e == math.floor(e)
    _unary_grad_kernel[(triton.cdiv(n, BLOCK),)](Ptr(x), Ptr(dy), Ptr(out), n, hi, lo, OP=UNARY_GRAD_CODES[op],
                                                 E_INT=e_int, E_ODD=e_int and e % 2 == 1, BLOCK_SIZE=BLOCK,
                                                 ACC=acc_type(x.dtype))


@triton.jit
def _binary_grad_kernel(x_ptr, y_ptr, dy_ptr, out_ptr, n, size_1, size_2, size_3,
                        sx0, sx1, sx2, sx3, sy0, sy1, sy2, sy3, sd0, sd1, sd2, sd3, so0, so1, so2, so3,
                        OP: tl.constexpr, WRT: tl.constexpr, BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    i0, i1, i2, i3 = index4(offs, size_1, size_2, size_3)
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3, mask=mask, other=1.0).to(ACC)
    y = tl.load(y_ptr + i0 * sy0 + i1 * sy1 + i2 * sy2 + i3 * sy3, mask=mask, other=1.0).to(ACC)
    dy = tl.load(dy_ptr + i0 * sd0 + i1 * sd1 + i2 * sd2 + i3 * sd3, mask=mask, other=0.0).to(ACC)
    if OP == 0:
        if WRT == 0:
            d = y
        else:
            d = x
    elif OP == 1:
        if WRT == 0:
            d = 1.0 / y
        else:
            d = -x / (y * y)
    else:  # maximum, minimum: 1 where this operand wins, 1/2 at ties
        if WRT == 0:
            mine = x
            other = y
        else:
            mine = y
            other = x
        if OP == 2:
            wins = mine > other
        else:
            wins = mine < other
        d = tl.where(wins, 1.0, tl.where(mine == other, 0.5, 0.0)).to(ACC)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + i2 * so2 + i3 * so3, (dy * d).to(out_ptr.dtype.element_ty), mask=mask)


def binary_grad(x: DevBuf, y: DevBuf, dy: DevBuf, out: DevBuf, op: str, wrt: int) -> None:
    """out = dy · ∂(x op y)/∂(x if wrt == 0 else y), x and y broadcast like NumPy to the shape of dy and out
    (the sum over an operand's broadcast dimensions is a separate reduction)."""
    if dy.shape != out.shape:
        raise ValueError(f"binary_grad needs dy and out of one shape; got {dy.shape} and {out.shape}")
    n = out.size
    if not n:
        return

    def bstrides(v: DevBuf) -> tuple[int, ...]:  # stride 0 along broadcast dimensions
        pad = len(out.shape) - len(v.shape)
        if pad < 0:
            raise ValueError(f"binary_grad operand of shape {v.shape} does not broadcast to {out.shape}")
        res = []
        for i, n_out in enumerate(out.shape):
            if i < pad or (v.shape[i - pad] == 1 and n_out != 1):
                res.append(0)
            elif v.shape[i - pad] != n_out:
                raise ValueError(f"binary_grad operand of shape {v.shape} does not broadcast to {out.shape}")
            else:
                res.append(v.strides[i - pad])
        return tuple(res)

    views = (out, x, y, dy)
    sizes = tuple(itemsize(v.dtype) for v in views)
    strides = (out.strides, bstrides(x), bstrides(y), dy.strides)
    for offs, shape, (so, sx, sy, sd) in outer_split(out.shape, strides, 4):
        po, px, py, pd = (Ptr(v.ptr + o * size, v.dtype) for v, o, size in zip(views, offs, sizes))
        m = shape[0] * shape[1] * shape[2] * shape[3]
        _binary_grad_kernel[(triton.cdiv(m, BLOCK),)](px, py, pd, po, m, shape[1], shape[2], shape[3], *sx, *sy, *sd,
                                                      *so, OP=BINARY_GRAD_CODES[op], WRT=int(wrt), BLOCK_SIZE=BLOCK,
                                                      ACC=acc_type(dy.dtype))


@triton.jit
def _swiglu_grad_kernel(a_ptr, b_ptr, dy_ptr, out_ptr, other_ptr, n, WRT: tl.constexpr, BOTH: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, ACC: tl.constexpr):
    # out = da (WRT 0) or db (WRT 1); with BOTH the other one into other_ptr, from the same loads
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(ACC)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
    s = tl.sigmoid(a)
    if WRT == 0 or BOTH:  # dy · b · silu'(a)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(ACC)
        da = dy * b * (s * (1.0 + a * (1.0 - s)))
        if WRT == 0:
            tl.store(out_ptr + offs, da.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(other_ptr + offs, da.to(other_ptr.dtype.element_ty), mask=mask)
    if WRT == 1 or BOTH:  # dy · silu(a)
        db = dy * (a * s)
        if WRT == 1:
            tl.store(out_ptr + offs, db.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(other_ptr + offs, db.to(other_ptr.dtype.element_ty), mask=mask)


def swiglu_grad(a: DevBuf, b: DevBuf, dy: DevBuf, out: DevBuf, wrt: int, other: DevBuf | None = None) -> None:
    """out = ∂(silu(a)·b)/∂(a if wrt == 0 else b) applied to dy, contiguous views of one shape; with ``other``
    the gradient with respect to the other operand into it too, from one read of a, b and dy."""
    if not a.shape == b.shape == dy.shape == out.shape or (other is not None and other.shape != out.shape):
        raise ValueError(f"swiglu_grad needs a, b, dy and out (and other) of one shape; got {a.shape}, {b.shape}, "
                         f"{dy.shape}, {out.shape}" + (f", {other.shape}" if other is not None else ""))
    n = out.size
    if n:
        _swiglu_grad_kernel[(triton.cdiv(n, BLOCK),)](Ptr(a), Ptr(b), Ptr(dy), Ptr(out),
                                                      Ptr(other if other is not None else out), n, WRT=int(wrt),
                                                      BOTH=other is not None, BLOCK_SIZE=BLOCK,
                                                      ACC=acc_type(a.dtype))

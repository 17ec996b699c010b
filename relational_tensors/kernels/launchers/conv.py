"""Convolutions: cuDNN where its frontend is installed and has an engine for the block (16-bit, ungrouped:
``kernels.cudnn_conv``), else im2col into scratch and one cuBLAS GEMM per group (grouped convolutions
contract CuPy arrays, which allocates); their gradients likewise by cuDNN, else as one GEMM per kernel
position (grouped ones on host copies); pooling and its gradient in Triton kernels."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from relational_tensors.core.dtypes import float32_to_bf16_bits
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels import cudnn_conv
from relational_tensors.kernels.launchers.base import _computable, host_kernel, launcher


def _conv_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """im2col columns [batch, in_channels, *kernel, *out] of one function spec (groups == 1)."""
    if op.groups != 1:
        return None
    x, out = f.inputs[0], f.output
    return (x.shape[0], x.shape[1], *op.kernel_size, *out.shape[2:]), op.input_types[0].dtype


# grouped: the contractions over CuPy arrays (which allocate); else im2col in scratch and cuBLAS
@launcher("conv", scratch=_conv_scratch, allocates=lambda op: op.groups != 1,
          host_forms="grouped and depthwise convolutions (CuPy, per group)")
def _conv(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """im2col into scratch (one strided copy per kernel position), then one strided-batched cuBLAS GEMM:
    out[n] [f, o] = w [f, c·k] @ cols[n] [c·k, o] for every batch row n, float32 accumulation; nothing
    allocated, so it is captured with the rest.  A 1×1 convolution of stride 1 reads its contiguous input
    block as the columns, with no copy.  Grouped convolutions run the contractions over CuPy arrays instead."""
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.blas import matmul
    from relational_tensors.kernels.common import DevBuf, contiguous_strides

    x, w = ins
    if op.groups != 1:
        _conv_dense(op, f, ins, out, stream)
        return
    if x.shape[1] == 0 or out.size == 0:
        tc.fill(out, 0.0)
        return
    # a 1×1 convolution without padding is always the GEMM (cuDNN chose a legacy engine 2-4x slower than it
    # for ResNet-50's strided ones on an H100: bench/results/h100_2026-12-07d)
    pointwise = set(op.kernel_size) == {1} and not any(op.padding)
    if not pointwise and cudnn_conv.fprop(op, x, w, out, f.inputs[0], f.output, consts.get("scratch"), stream):
        return
    rank = op.rank
    n, c = x.shape[:2]
    kernel, n_out = op.kernel_size, out.shape[2:]
    ck, positions = c * math.prod(kernel), math.prod(n_out)

    def gemm(cols: Any) -> None:  # one strided-batched GEMM: the weights shared by every batch row's columns
        matmul(DevBuf(w.ptr, (w.shape[0], ck), w.dtype, w.device),
               DevBuf(cols.ptr, (n, ck, positions), cols.dtype, cols.device),
               DevBuf(out.ptr, (n, out.shape[1], positions), out.dtype, out.device), stream)

    box, obox = f.inputs[0], f.output
    whole = False  # whether the one tap of a 1×1 convolution reaches every output position
    if pointwise:
        _, size, src = _tap(op, (0,) * rank, x, box, obox.lower[2:], n_out)
        whole = size == list(n_out)
        if whole and src.strides == contiguous_strides(src.shape):  # stride 1: the block is the columns
            gemm(src)
            return
    cols = consts["scratch"]
    if not whole:
        tc.fill(cols, 0.0)  # the padding
    for kk in itertools.product(*(range(k) for k in kernel)):
        dst_lo, size, src = _tap(op, kk, x, box, obox.lower[2:], n_out)
        if src is None:
            continue
        dst = cols.sub((0, 0, *kk, *dst_lo), (n, c, *((1,) * rank), *size))
        dst = DevBuf(dst.ptr, (n, c, *size), dst.dtype, dst.device, (*dst.strides[:2], *dst.strides[2 + rank:]))
        tc.copy_box(src, dst)
    gemm(cols)


def _tap(op: Any, kk: tuple[int, ...], x: Any, box: Any, o0: Sequence[int], n_out: Sequence[int]) -> tuple:
    """Kernel position ``kk`` against an input block ``x`` (at ``box``) and output positions from ``o0`` (``n_out``
    of them): (the first output position whose tap lands in the block, relative to ``o0``; how many do, per
    dimension; the view of ``x`` they read, every ``stride``-th row, or None where none does)."""
    from relational_tensors.kernels.common import DevBuf

    first, size, src_lo = [], [], []
    for i in range(op.rank):
        s, p, d = op.stride[i], op.padding[i], op.dilation[i]
        lo, hi = box.lower[2 + i], box.upper[2 + i]
        shift = p - kk[i] * d  # output o reads input o·s - shift
        j_lo = max(0, -(-(lo + shift) // s) - o0[i])
        j_hi = min(n_out[i], -(-(hi + shift) // s) - o0[i])
        size.append(max(0, j_hi - j_lo))
        src_lo.append((o0[i] + j_lo) * s - shift - lo)
        first.append(j_lo)
    if 0 in size:
        return first, size, None
    n, c = x.shape[:2]
    src = x.sub((0, 0, *src_lo), (n, c, *size))
    return first, size, DevBuf(src.ptr, src.shape, src.dtype, src.device,
                               (*x.strides[:2], *(st * op.stride[i] for i, st in enumerate(x.strides[2:]))))


class _Room:
    """Views carved one after another out of a task's scratch, each aligned to 256 bytes."""

    def __init__(self, scratch: Any) -> None:
        self.scratch, self.used = scratch, 0

    def take(self, shape: tuple[int, ...], dtype: str) -> Any:
        from relational_tensors.kernels.common import DevBuf

        buf = DevBuf(self.scratch.ptr + self.used, tuple(shape), dtype, self.scratch.device)
        self.used += _aligned(buf.nbytes)
        if self.used > self.scratch.nbytes:
            raise ValueError(f"conv_grad's scratch holds {self.scratch.nbytes} bytes; its views need {self.used}")
        return buf


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def _swap01(buf: Any) -> Any:
    """The view of ``buf`` with its first two dimensions swapped."""
    return buf.permuted((1, 0, *range(2, len(buf.shape))))


def _conv_grad_views(op: Any, f: FunctionSpec) -> list[tuple[tuple[int, ...], str]]:
    """The scratch views of a conv_grad block, in order (``_conv_dx`` and ``_conv_dw`` carve them alike)."""
    wide = "float32" if op.input_types[0].dtype in ("float16", "bfloat16") else op.input_types[0].dtype
    dtype = op.input_types[0].dtype
    k = op.kernel_size
    if op.part == "dw":
        x, dy = f.inputs
        n, c, fo, n_out = x.shape[0], x.shape[1], dy.shape[1], dy.shape[2:]
        return [((fo, n, *n_out), dtype), ((c, n, *n_out), dtype), ((math.prod(k), fo, c), wide)]
    dy, w = f.inputs
    n, fo, c, n_out = dy.shape[0], dy.shape[1], w.shape[1], dy.shape[2:]
    span = op.span(f)
    return [((fo, n, *n_out), dtype), ((fo, c), dtype), ((c, n, *n_out), wide),
            ((n, c, *(b - a for a, b in span)), wide)]


def _conv_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    if op.groups != 1:
        return None
    from relational_tensors.core.dtypes import itemsize

    need = sum(_aligned(math.prod(shape) * itemsize(dtype)) for shape, dtype in _conv_grad_views(op, f))
    return (need // 4,), "float32"


@launcher("conv_grad", scratch=_conv_grad_scratch, allocates=lambda op: op.groups != 1,
          host_forms="grouped and depthwise convolutions (the NumPy kernel on host copies)")
def _conv_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """A convolution's gradients as GEMMs over the kernel positions, float32 accumulation, nothing allocated
    (captured with the rest): dw one GEMM per position (dy against that position's im2col columns, batch and
    positions contracted); dx one GEMM per position (the position's weights against dy) added into the
    padded rows its taps reach (col2im), then the block's own rows.  Grouped convolutions run the NumPy
    kernel on host copies."""
    if op.groups != 1:
        host_kernel(op, f, ins, out, stream)
        return
    (_conv_dw if op.part == "dw" else _conv_dx)(op, f, ins, out, consts, stream)


def _conv_dw(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import blas
    from relational_tensors.kernels import triton_copy as tc

    x, dy = ins
    if 0 in (*x.shape[:2], *dy.shape):
        tc.fill(out, 0.0)
        return
    if cudnn_conv.wgrad(op, x, dy, out, f.inputs[0], f.inputs[1], consts.get("scratch"), stream):
        return
    n, c, fo, n_out = x.shape[0], x.shape[1], dy.shape[1], dy.shape[2:]
    room = _Room(consts["scratch"])
    dyt, cols, dwk = (room.take(shape, dtype) for shape, dtype in _conv_grad_views(op, f))
    tc.copy_box(_swap01(dy), dyt)  # [f, n, positions]: batch and positions one contracted run
    q = n * math.prod(n_out)
    for t, kk in enumerate(itertools.product(*(range(k) for k in op.kernel_size))):
        first, size, src = _tap(op, kk, x, f.inputs[0], f.inputs[1].lower[2:], n_out)
        tc.fill(cols, 0.0)  # the taps that land in the padding
        if src is not None:
            tc.copy_box(src, _swap01(cols.sub((0, 0, *first), (c, n, *size))))
        into = _flat(dwk.sub((t, 0, 0), (1, fo, c)), (fo, c))
        done = blas.einsum_gemm(_flat(dyt, (fo, q)), _flat(cols, (c, q)), into, ("f", "q"), ("c", "q"), ("f", "c"),
                                stream)
        assert done, "a GEMM of contiguous matrices"
    k = op.kernel_size
    tc.copy_box(_flat(dwk, (*k, fo, c)).permuted((len(k), len(k) + 1, *range(len(k)))), out)


def _conv_dx(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import blas
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels import triton_elementwise as te

    dy, w = ins
    if cudnn_conv.dgrad(op, dy, w, out, op.span(f), f.output, consts.get("scratch"), stream):
        return
    tc.fill(out, 0.0)
    if 0 in (*dy.shape, w.shape[1]):
        return
    n, fo, c, n_out = dy.shape[0], dy.shape[1], w.shape[1], dy.shape[2:]
    room = _Room(consts["scratch"])
    dyt, wk, part, buf = (room.take(shape, dtype) for shape, dtype in _conv_grad_views(op, f))
    tc.copy_box(_swap01(dy), dyt)
    tc.fill(buf, 0.0)
    q = n * math.prod(n_out)
    rank = op.rank
    for kk in itertools.product(*(range(k) for k in op.kernel_size)):
        tap = w.sub((0, 0, *kk), (fo, c, *((1,) * rank)))
        tc.copy_box(_flat_view(tap, (fo, c)), wk)
        done = blas.einsum_gemm(wk, _flat(dyt, (fo, q)), _flat(part, (c, q)), ("f", "c"), ("f", "q"), ("c", "q"),
                                stream)
        assert done, "a GEMM of contiguous matrices"
        # the rows this position's taps reach: o·stride + kk·dilation from the span's start
        reach = buf.sub((0, 0, *(kk[i] * op.dilation[i] for i in range(rank))), (n, c, *n_out))
        reach = _strided(reach, (*buf.strides[:2], *(buf.strides[2 + i] * op.stride[i] for i in range(rank))))
        te.binary(reach, _swap01(part), reach, "add")
    lower, shape, start = [], [], []
    for i, (lo, hi) in enumerate(op.span(f)):  # the block's rows that some window reaches
        r = f.output.interval(2 + i)
        a = max(r.lo, lo)
        b = max(a, min(r.hi, hi))
        lower.append(a - lo)
        start.append(a - r.lo)
        shape.append(b - a)
    if 0 not in shape:
        tc.copy_box(buf.sub((0, 0, *lower), (n, c, *shape)), out.sub((0, 0, *start), (n, c, *shape)))


def _flat(buf: Any, shape: tuple[int, ...]) -> Any:
    """A contiguous buffer seen with another shape of the same size."""
    from relational_tensors.kernels.common import DevBuf

    return DevBuf(buf.ptr, tuple(shape), buf.dtype, buf.device)


def _flat_view(buf: Any, shape: tuple[int, ...]) -> Any:
    """A view whose trailing unit dimensions are dropped (its strides kept for the rest)."""
    from relational_tensors.kernels.common import DevBuf

    return DevBuf(buf.ptr, tuple(shape), buf.dtype, buf.device, buf.strides[: len(shape)])


def _strided(buf: Any, strides: tuple[int, ...]) -> Any:
    from relational_tensors.kernels.common import DevBuf

    return DevBuf(buf.ptr, buf.shape, buf.dtype, buf.device, tuple(strides))


def _conv_dense(op: Any, f: FunctionSpec, ins: list, out: Any, stream: int) -> None:
    """The operator's contractions over CuPy arrays (float32 for 16 bits): grouped convolutions."""
    import cupy

    with cupy.cuda.ExternalStream(stream):
        y = op.dense(_computable(ins[0]), _computable(ins[1]), f, cupy)
        dst = out.cupy()
        dst[...] = float32_to_bf16_bits(y, cupy) if out.dtype == "bfloat16" else y.astype(dst.dtype)


@launcher("pool")
def _pool(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Max or average pooling: each output position's window read in place (``kernels.triton_pool``)."""
    from relational_tensors.kernels.triton_pool import pool

    pool(ins[0], out, f.inputs[0].lower[2:], f.output.lower[2:], op.input_types[0].shape[2:], op.op,
         op.kernel_size, op.stride, op.padding, op.count_include_pad)


@launcher("pool_grad")
def _pool_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """The pooling gradient gathered per input position from the windows that cover it (max: from each
    window's winner, found again from x); no atomics."""
    from relational_tensors.kernels.triton_pool import pool_grad

    pool_grad(ins[0], ins[1], out, f.inputs[0].lower[2:], f.inputs[1].lower[2:], f.output.lower[2:],
              op.input_types[0].shape[2:], op.op, op.kernel_size, op.stride, op.padding, op.count_include_pad)

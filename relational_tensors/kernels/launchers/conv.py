"""Convolutions: im2col into scratch and one cuBLAS GEMM per group (grouped convolutions contract CuPy
arrays, which allocates); pooling and its gradient in Triton kernels."""

from __future__ import annotations

import itertools
import math
from typing import Any

from relational_tensors.core.dtypes import float32_to_bf16_bits
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import _computable, launcher


def _conv_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """im2col columns [batch, in_channels, *kernel, *out] of one function spec (groups == 1)."""
    if op.groups != 1:
        return None
    x, out = f.inputs[0], f.output
    return (x.shape[0], x.shape[1], *op.kernel_size, *out.shape[2:]), op.input_types[0].dtype


# grouped: the contractions over CuPy arrays (which allocate); else im2col in scratch and cuBLAS
@launcher("conv", scratch=_conv_scratch, allocates=lambda op: op.groups != 1)
def _conv(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """im2col into scratch (one strided copy per kernel position), then one strided-batched cuBLAS GEMM:
    out[n] [f, o] = w [f, c·k] @ cols[n] [c·k, o] for every batch row n, float32 accumulation; nothing
    allocated, so it is captured with the rest.  Grouped convolutions run the contractions over CuPy arrays instead."""
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.blas import matmul
    from relational_tensors.kernels.common import DevBuf

    x, w = ins
    if op.groups != 1:
        _conv_dense(op, f, ins, out, stream)
        return
    if x.shape[1] == 0 or out.size == 0:
        tc.fill(out, 0.0)
        return
    rank = op.rank
    cols = consts["scratch"]
    n, c = x.shape[:2]
    kernel, n_out = op.kernel_size, out.shape[2:]
    tc.fill(cols, 0.0)  # the padding
    box, obox = f.inputs[0], f.output
    ck = c * math.prod(kernel)
    for kk in itertools.product(*(range(k) for k in kernel)):
        src_lo, dst_lo, size = [], [], []
        for i in range(rank):
            s, p, d = op.stride[i], op.padding[i], op.dilation[i]
            lo, hi, o0 = box.lower[2 + i], box.upper[2 + i], obox.lower[2 + i]
            shift = p - kk[i] * d  # output o reads input o·s - shift
            j_lo = max(0, -(-(lo + shift) // s) - o0)
            j_hi = min(n_out[i], -(-(hi + shift) // s) - o0)
            size.append(max(0, j_hi - j_lo))
            src_lo.append((o0 + j_lo) * s - shift - lo)
            dst_lo.append(j_lo)
        if 0 in size:
            continue
        src = x.sub((0, 0, *src_lo), (n, c, *size))
        src = DevBuf(src.ptr, src.shape, src.dtype, src.device,
                     (*x.strides[:2], *(st * op.stride[i] for i, st in enumerate(x.strides[2:]))))
        dst = cols.sub((0, 0, *kk, *dst_lo), (n, c, *((1,) * rank), *size))
        dst = DevBuf(dst.ptr, (n, c, *size), dst.dtype, dst.device, (*dst.strides[:2], *dst.strides[2 + rank:]))
        tc.copy_box(src, dst)
    positions = math.prod(n_out)
    # one strided-batched GEMM: the weights shared by every batch row's columns
    matmul(DevBuf(w.ptr, (w.shape[0], ck), w.dtype, w.device),
           DevBuf(cols.ptr, (n, ck, positions), cols.dtype, cols.device),
           DevBuf(out.ptr, (n, out.shape[1], positions), out.dtype, out.device), stream)


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

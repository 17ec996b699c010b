"""The GPU concrete kernel of each operator kind: which kernel runs a function spec's blocks.

Each launcher receives the operator, the function spec, device views of its
input blocks and of its output block (an lse partial is an (out, lse) pair),
per-operator constants already on the device, and the stream; it launches
without allocating.  ``ALLOCATING_KINDS`` names the kinds that fall back to CuPy
routines which allocate (they keep a program out of CUDA-graph capture).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from relational_tensors.core.dtypes import bf16_bits_to_float32, compute_dtype, float32_to_bf16_bits, numpy_dtype
from relational_tensors.gpu_exec.kernels import flash
from relational_tensors.gpu_exec.kernels import triton_copy as tc
from relational_tensors.gpu_exec.kernels import triton_elementwise as te
from relational_tensors.gpu_exec.kernels import triton_norms as tn
from relational_tensors.gpu_exec.kernels.blas import matmul
from relational_tensors.gpu_exec.kernels.common import DevBuf
from relational_tensors.gpu_exec.kernels.triton_attention import attention
from relational_tensors.gpu_exec.kernels.triton_rope import rope

__all__ = ["LAUNCHERS", "op_constants", "scratch_shape", "ALLOCATING_KINDS"]

ALLOCATING_KINDS = frozenset({"einsum", "sql"})  # run through cupy.einsum / broadcasting, which allocate


def _matmul(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    a, b = ins
    if a.shape[-1] == 0:
        tc.fill(out, 0.0)
    else:
        matmul(a, b, out, stream)


def _einsum_like(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    import cupy

    bf16 = out.dtype == "bfloat16"
    arrays = [b.cupy() for b in ins]
    dst = out.cupy()
    with cupy.cuda.ExternalStream(stream):
        if op.kind == "einsum":
            letters, res = op._parsed()
            sub = ",".join("".join(x) for x in letters) + "->" + "".join(res)
            work = compute_dtype(out.dtype)  # 16-bit floats in float32, float64 stays float64
            operands = [bf16_bits_to_float32(a, cupy) if b.dtype == "bfloat16" else a.astype(work)
                        for a, b in zip(arrays, ins)]
            result = cupy.einsum(sub, *operands)
            dst[...] = float32_to_bf16_bits(result, cupy) if bf16 else result.astype(dst.dtype)
        else:  # SQL operators: the NumPy kernel, run with CuPy arrays through the same expressions
            host = op.kernel([cupy.asnumpy(a).view(numpy_dtype("bfloat16")) if b.dtype == "bfloat16"
                              else cupy.asnumpy(a) for a, b in zip(arrays, ins)], f)
            host = np.ascontiguousarray(np.asarray(host).astype(numpy_dtype(out.dtype), copy=False))
            dst.set(host.view(np.uint16) if bf16 else host)


SCALAR_UFUNCS = {"scale": "multiply", "add_scalar": "add", "pow": "power"}


def _unary(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    if out.dtype == "float64" and op.op in SCALAR_UFUNCS:
        # Triton passes a Python float as a float32 argument: a float64 scalar goes through CuPy
        import cupy

        with cupy.cuda.ExternalStream(stream):
            getattr(cupy, SCALAR_UFUNCS[op.op])(ins[0].cupy(), float(op.arg), out=out.cupy())
        return
    te.unary(ins[0], out, op.op, 0.0 if op.op == "cast" else float(op.arg))


def _binary(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    te.binary(ins[0], ins[1], out, op.op)


def _swiglu(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    te.swiglu(ins[0], ins[1], out)


def _rmsnorm(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    tn.rmsnorm(ins[0], ins[1], out, op.eps)


def _layernorm(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    tn.layernorm(ins[0], ins[1], ins[2], out, op.eps)


def _softmax(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    tn.softmax(ins[0], out, op.axis % len(ins[0].shape))


def _reduce(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    x = ins[0]
    axes = op._axes()
    keep = [d for d in range(len(x.shape)) if d not in axes]
    count = math.prod(op.input_types[0].shape[a] for a in axes) if op.op == "mean" else 1  # of the whole axes
    src = x
    if keep + list(axes) != list(range(len(x.shape))):
        scratch = consts["scratch"]
        src = scratch.as_dtype(x.dtype)
        src = DevBuf(src.ptr, tuple(x.shape[d] for d in keep + list(axes)), x.dtype, x.device)
        tc.copy_box(x.permuted(tuple(keep + list(axes))), src)
    tn.row_reduce(src, out, "sum" if op.op == "mean" else op.op, count)


def _rope(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    rope(ins[0], out, consts["seq_start"], f.inputs[0].lower[1], op.base)


def _reshape(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    x = ins[0]
    tc.copy_box(DevBuf(x.ptr, out.shape, x.dtype, x.device), out)


def _permute(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    tc.copy_box(ins[0].permuted(op.perm), out)


def _slice(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    tc.copy_box(ins[0], out)


def _concat(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    axis = op._axis()
    at = 0
    for blk in ins:
        n = blk.shape[axis]
        if n and blk.size:
            lower = tuple(at if d == axis else 0 for d in range(len(out.shape)))
            tc.copy_box(blk, out.sub(lower, blk.shape))
        at += n


def _embedding(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    tc.embedding(ins[0], ins[1], out, f.inputs[0].lower[0])


def _attention(op: Any, f: Any, ins: list, out: Any, consts: dict, stream: int) -> None:
    q, k, v = ins
    o, lse = out if isinstance(out, tuple) else (out, None)
    if k.shape[1] == 0:  # this query block sees none of these keys
        tc.fill(o, 0.0)
        if lse is not None:
            tc.fill(lse, float("-inf"))
        return
    if "flash" in consts:  # a library FlashAttention kernel computes this block exactly
        flash.attention(q, k, v, o, consts["flash"], op.causal, op.softmax_scale, stream)
        return
    attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], f.inputs[0].lower[1], f.inputs[1].lower[1],
              op.softmax_scale)


LAUNCHERS: dict[str, Callable[..., None]] = {
    "matmul": _matmul, "einsum": _einsum_like, "sql": _einsum_like, "unary": _unary, "binary": _binary,
    "swiglu": _swiglu, "rmsnorm": _rmsnorm, "layernorm": _layernorm, "softmax": _softmax, "reduce": _reduce,
    "rope": _rope, "reshape": _reshape, "permute": _permute, "slice": _slice, "concat": _concat,
    "embedding": _embedding, "attention": _attention,
}


def op_constants(op: Any) -> dict[str, np.ndarray]:
    """Host arrays an operator's kernels read on every device that runs it."""
    if op.kind == "attention":
        rows = np.arange(op.input_types[0].shape[1])
        lo, hi = op._key_limits(rows)
        return {"row_lo": lo.astype(np.int32), "row_hi": hi.astype(np.int32)}
    if op.kind == "rope":
        from relational_tensors.sql_specs.packing import sequence_bounds

        length = op.input_types[0].shape[1]
        start, _ = sequence_bounds(np.arange(length), op.seq_ends, length)
        return {"seq_start": start.astype(np.int32)}
    return {}


def scratch_shape(op: Any, f: Any) -> tuple[tuple[int, ...], str] | None:
    """Scratch a function spec's kernel needs besides its output (a transposed copy for reductions)."""
    if op.kind == "reduce":
        return f.inputs[0].shape, op.input_types[0].dtype
    return None

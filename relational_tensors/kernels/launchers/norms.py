"""Norms, softmax and reductions, and their gradients (Triton kernels; a reduction over a non-last axis
reads a transposed copy in scratch)."""

from __future__ import annotations

import math
from typing import Any

from relational_tensors.core.dtypes import itemsize
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import launcher


@launcher("rmsnorm")
def _rmsnorm(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_norms as tn

    tn.rmsnorm(ins[0], ins[1], out, op.eps)


@launcher("layernorm")
def _layernorm(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_norms as tn

    tn.layernorm(ins[0], ins[1], ins[2], out, op.eps)


@launcher("softmax")
def _softmax(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_norms as tn

    tn.softmax(ins[0], out, op.axis % len(ins[0].shape))


def _reduce_layout(op: Any, shape: tuple[int, ...]) -> tuple[list[int], tuple[int, ...], bool]:
    """The kept and reduced axes of a block of ``shape``, and whether the reduced ones must be moved last."""
    axes = op._axes()
    keep = [d for d in range(len(shape)) if d not in axes]
    return keep, axes, keep + list(axes) != list(range(len(shape)))


def _in_place(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(outer, n, inner)`` where the reduced ``axes`` are one run of consecutive axes, not last, that
    ``kernels.scratch.reduces_in_place`` reduces where they lie; else None."""
    from relational_tensors.kernels.scratch import reduces_in_place

    if not axes or list(axes) != list(range(axes[0], axes[-1] + 1)) or axes[-1] == len(shape) - 1:
        return None
    outer, n, inner = (math.prod(shape[:axes[0]]), math.prod(shape[axes[0]:axes[-1] + 1]),
                       math.prod(shape[axes[-1] + 1:]))
    return (outer, n, inner) if reduces_in_place(outer, n, inner) else None


def _reduce_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """Room for the input with its reduced axes moved last (when they are not already), then for the
    partials of a chunked reduction (few long rows), in elements of the input's dtype."""
    from relational_tensors.kernels.scratch import partial_dtype, reduce_chunks

    shape, dtype = f.inputs[0].shape, op.input_types[0].dtype
    keep, axes, moved = _reduce_layout(op, shape)
    if _in_place(shape, axes) is not None:
        return None
    rows = math.prod(shape[d] for d in keep)
    n = math.prod(shape[d] for d in axes)
    chunks = reduce_chunks(rows, n) if rows and n else 1
    room = math.prod(shape) if moved else 0
    if chunks > 1:
        room += -(-rows * chunks * itemsize(partial_dtype(dtype)) // itemsize(dtype)) + 8  # + alignment
    return ((room,), dtype) if room else None


@launcher("reduce", scratch=_reduce_scratch)
def _reduce(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels import triton_norms as tn
    from relational_tensors.kernels.common import DevBuf

    x = ins[0]
    keep, axes, moved = _reduce_layout(op, x.shape)
    count = math.prod(op.input_types[0].shape[a] for a in axes) if op.op == "mean" else 1  # of the whole axes
    walk = _in_place(x.shape, axes)
    if walk is not None:  # the reduced axes walked where they lie
        tn.middle_reduce(x, out, "sum" if op.op == "mean" else op.op, *walk, count=count)
        return
    scratch = consts.get("scratch")
    src, used = x, 0
    if moved:
        assert scratch is not None  # _reduce_scratch gave room for the move
        src = DevBuf(scratch.ptr, tuple(x.shape[d] for d in keep + list(axes)), x.dtype, x.device)
        tc.copy_box(x.permuted(tuple(keep + list(axes))), src)
        used = x.size * itemsize(x.dtype)
    partials = None  # a chunked reduction's partials: after the moved input, 8-byte aligned
    if scratch is not None and scratch.ptr + -(-used // 8) * 8 < scratch.ptr + scratch.nbytes:
        at = scratch.ptr + -(-used // 8) * 8
        partials = DevBuf(at, ((scratch.ptr + scratch.nbytes - at) // 8,), "float64", x.device)
    tn.row_reduce(src, out, "sum" if op.op == "mean" else op.op, count, partials)


@launcher("softmax_grad")
def _softmax_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_norms_grad as tng

    tng.softmax_grad(ins[0], ins[1], out, op.axis % len(ins[0].shape))


@launcher("norm_grad")
def _norm_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_norms_grad as tng

    tng.norm_grad(ins[0], ins[1], ins[2], out, op.norm == "layer", op.eps)


def _norm_weight_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str]:
    """Per-row statistics and per-chunk partial sums, in the compute dtype."""
    from relational_tensors.kernels.scratch import weight_grad_scratch

    shape = f.inputs[0].shape
    rows = math.prod(shape[:-1])
    return (weight_grad_scratch(rows, shape[-1]),), "float64" if op.input_types[0].dtype == "float64" else "float32"


@launcher("norm_weight_grad", scratch=_norm_weight_grad_scratch)
def _norm_weight_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_norms_grad as tng

    tng.norm_weight_grad(ins[0], ins[1], out, consts["scratch"], op.norm == "layer", op.eps)

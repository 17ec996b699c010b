"""Elementwise operators and their gradients: unary, binary, comparisons and logic, ``where``, SwiGLU, rope,
dropout and random draws (Triton kernels; integer gradients and a few float64 forms on CuPy or host
copies)."""

from __future__ import annotations

from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import host_kernel, launcher
from relational_tensors.sql_specs.elementwise import COMPARISONS, LOGICAL

SCALAR_UFUNCS = {"scale": "multiply", "add_scalar": "add", "pow": "power"}


def _host_unary(op: Any) -> bool:
    """A unary on booleans other than a cast or ``logical_not`` runs on host copies (none is built today)."""
    return "bool" in (op.input_types[0].dtype, op.output_type.dtype) and op.op not in ("cast", "logical_not")


@launcher("full")
def _full(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc

    if out.dtype == "float64":  # Triton passes a Python float as a float32 argument
        import cupy

        with cupy.cuda.ExternalStream(stream):
            out.cupy().fill(float(op.value))
        return
    tc.fill(out, op.value)


@launcher("unary", allocates=_host_unary,
          host_forms="a unary on booleans other than a cast or logical_not (the NumPy kernel on host copies)")
def _unary(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise as te

    if _host_unary(op):
        host_kernel(op, f, ins, out, stream)
        return
    if op.op == "logical_not":
        te.logical_not(ins[0], out)
        return
    if out.dtype == "bool" and ins[0].dtype != "bool":  # nonzero is true
        te.to_bool(ins[0], out)
        return
    if out.dtype == "float64" and op.op in SCALAR_UFUNCS:
        # Triton passes a Python float as a float32 argument: a float64 scalar goes through CuPy
        import cupy

        with cupy.cuda.ExternalStream(stream):
            getattr(cupy, SCALAR_UFUNCS[op.op])(ins[0].cupy(), float(op.arg), out=out.cupy())
        return
    te.unary(ins[0], out, op.op, 0.0 if op.op == "cast" else float(op.arg))


@launcher("binary")
def _binary(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise as te

    if op.op in COMPARISONS or op.op in LOGICAL:  # a boolean mask, compared in the operands' own dtype
        te.compare(ins[0], ins[1], out, op.op)
        return
    te.binary(ins[0], ins[1], out, op.op)


@launcher("where")
def _where(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise as te

    te.where(ins[0], ins[1], ins[2], out)


@launcher("swiglu")
def _swiglu(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise as te

    te.swiglu(ins[0], ins[1], out)


def _rope_constants(op: Any) -> dict[str, np.ndarray]:
    from relational_tensors.sql_specs.packing import sequence_bounds
    from relational_tensors.sql_specs.rope import rounded_frequencies

    length = op.input_types[0].shape[1]
    start, _ = sequence_bounds(np.arange(length), op.seq_ends, length)
    if op.freq_dtype is None:
        return {"seq_start": start.astype(np.int32)}
    return {"seq_start": start.astype(np.int32),
            "inv_freq": rounded_frequencies(op.input_types[0].shape[3], op.base, op.freq_dtype)}


@launcher("rope", constants=_rope_constants)
def _rope(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels.triton_rope import rope

    rope(ins[0], out, consts["seq_start"], f.inputs[0].lower[1], op.base, op.inverse, consts.get("inv_freq"))


@launcher("rope_table")
def _rope_table(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels.triton_rope import rope_table

    rope_table(ins[0], ins[1], ins[2], out, op.inverse)


@launcher("dropout")
def _dropout(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_random as tr

    # the block's place in the whole tensor fixes its draws; the state is read on the device
    tr.dropout(ins[0], ins[1], out, f.output.lower, op.output_type.shape, float(op.p), op.stream)


@launcher("random")
def _random(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_random as tr

    tr.random(ins[0], out, f.output.lower, op.output_type.shape, op.stream, op.distribution, float(op.p))


@launcher("unary_grad")
def _unary_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise_grad as teg

    teg.unary_grad(ins[0], ins[1], out, op.op, float(op.arg))


@launcher("binary_grad", allocates=lambda op: op.output_type.dtype not in FLOAT_DTYPES,
          host_forms="integer operands (the NumPy kernel on host copies)")
def _binary_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise_grad as teg

    if out.dtype not in ("float16", "bfloat16", "float32", "float64"):  # integer operands: on host copies
        host_kernel(op, f, ins, out, stream)
        return
    teg.binary_grad(ins[0], ins[1], ins[2], out, op.op, op.wrt)


@launcher("swiglu_grad")
def _swiglu_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_elementwise_grad as teg

    if isinstance(out, tuple):  # (this gradient, the sibling task's): both from one pass
        teg.swiglu_grad(ins[0], ins[1], ins[2], out[0], op.wrt, other=out[1])
    else:
        teg.swiglu_grad(ins[0], ins[1], ins[2], out, op.wrt)

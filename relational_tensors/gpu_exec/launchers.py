"""The GPU launcher of each operator kind, in a registry keyed by kind.

A launcher receives the operator, the function spec, device views of its input blocks and of its
output block (an lse partial is an (out, lse) pair), per-operator constants already on the device,
and the stream; it launches without allocating (an operator whose kernel allocates says so with
``Operator.gpu_allocates``).  Registration imports neither CuPy nor Triton: each launcher imports
its kernels when it first runs, so the registry can be read (and checked complete) on a machine
without a GPU.

>>> from relational_tensors.sql_specs import OPERATORS
>>> sorted(set(OPERATORS) - set(LAUNCHERS))
[]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import (
    bf16_bits_to_float32,
    compute_dtype,
    float32_to_bf16_bits,
    itemsize,
    numpy_dtype,
)
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.errors import ExecError
from relational_tensors.sql_specs.base import Operator

__all__ = ["Launcher", "LAUNCHERS", "launcher", "launcher_for", "op_constants", "scratch_shape", "task_scratch",
           "scratch_bytes", "kernel_scratch"]

LaunchFn = Callable[[Any, FunctionSpec, list, Any, dict, int], None]
Constants = Callable[[Any], dict[str, np.ndarray]]
Scratch = Callable[[Any, FunctionSpec], tuple[tuple[int, ...], str] | None]  # None: no scratch for this one


@dataclass(frozen=True)
class Launcher:
    """How one operator kind runs on a GPU: the launch, and what it needs set up before it.

    ``constants`` gives host arrays its kernels read on every device that runs the operator (copied
    to each device once); ``scratch`` the shape and dtype of scratch one function spec needs besides
    its output."""

    kind: str
    launch: LaunchFn
    constants: Constants | None = None
    scratch: Scratch | None = None


LAUNCHERS: dict[str, Launcher] = {}


def launcher(*kinds: str, constants: Constants | None = None,
             scratch: Scratch | None = None) -> Callable[[LaunchFn], LaunchFn]:
    """Decorator: ``fn`` launches the GPU kernel of the operator ``kinds``."""
    def register(fn: LaunchFn) -> LaunchFn:
        for kind in kinds:
            old = LAUNCHERS.get(kind)
            if old is not None and old.launch is not fn:
                raise ValueError(f"a GPU launcher for operator kind {kind!r} is registered twice")
            LAUNCHERS[kind] = Launcher(kind, fn, constants, scratch)
        return fn
    return register


def launcher_for(kind: str) -> Launcher:
    """The launcher of ``kind``; an operator without one is refused by name."""
    found = LAUNCHERS.get(kind)
    if found is None:
        raise ExecError(f"operator kind {kind!r} has no GPU launcher (registered: {sorted(LAUNCHERS)}); "
                        "register one with @launcher in relational_tensors/gpu_exec/launchers.py, or run on "
                        "device='cpu:N'.")
    return found


def op_constants(op: Operator) -> dict[str, np.ndarray]:
    """Host arrays an operator's kernels read on every device that runs it."""
    make = launcher_for(op.kind).constants
    return make(op) if make is not None else {}


def scratch_shape(op: Operator, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """Scratch a function spec's kernel needs besides its output (a transposed copy for reductions)."""
    make = launcher_for(op.kind).scratch
    return make(op, f) if make is not None else None


def task_scratch(graph: Any, dag: Any) -> dict[int, tuple[tuple[int, ...], str]]:
    """Kernel task -> the scratch its kernel needs (``scratch_shape``), for the tasks that need some."""
    out = {}
    for t in dag.tasks:
        if t.kind == "kernel" and t.op is not None:
            op = graph.nodes[t.op].op
            if op is None:
                continue
            need = scratch_shape(op, t.kernel.function)
            if need is not None:
                out[t.id] = need
    return out


def scratch_bytes(needs: dict[int, tuple[tuple[int, ...], str]]) -> dict[int, int]:
    """``task_scratch``'s needs in bytes, for the memory plan."""
    return {t: math.prod(shape) * itemsize(dtype) for t, (shape, dtype) in needs.items()}


def kernel_scratch(graph: Any, dag: Any) -> dict[int, int]:
    """Kernel task -> bytes of scratch the GPU executor gives it (``task_scratch``), for the liveness of a
    GPU plan: computed without Triton or CuPy (``kernels.scratch``), so any machine can count it."""
    return scratch_bytes(task_scratch(graph, dag))


# ------------------------------------------------------------------ the launchers, by family


@launcher("matmul")
def _matmul(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.blas import matmul

    a, b = ins
    if a.shape[-1] == 0:
        tc.fill(out, 0.0)
    else:
        matmul(a, b, out, stream)


def host_kernel(op: Any, f: FunctionSpec, ins: list, out: Any, stream: int) -> None:
    """Run the operator's NumPy kernel on host copies of its blocks and copy the result back: the GPU path
    of the operators without a device kernel yet (they declare ``gpu_allocates``, which keeps a program that
    uses them out of CUDA-graph capture)."""
    import cupy

    with cupy.cuda.ExternalStream(stream):
        host = op.kernel([cupy.asnumpy(b.cupy()).view(numpy_dtype("bfloat16")) if b.dtype == "bfloat16"
                          else cupy.asnumpy(b.cupy()) for b in ins], f)
        # an operator with a log-sum-exp returns (block, lse); out is that pair only where the ⊕ needs it
        pairs = zip(out, host) if isinstance(out, tuple) else [(out, host[0] if isinstance(host, tuple) else host)]
        for buf, value in pairs:
            value = np.ascontiguousarray(np.asarray(value).astype(numpy_dtype(buf.dtype), copy=False))
            buf.cupy().set(value.view(np.uint16) if buf.dtype == "bfloat16" else value)


FLOATS = ("float16", "bfloat16", "float32", "float64")


@launcher("einsum")
def _einsum(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """A two-operand einsum that is a (batched) matrix product, the matmul gradients among them, is one
    cuBLAS GEMM on the blocks as they lie (nothing allocated, so it is captured); any other einsum runs
    through CuPy in the compute dtype."""
    import cupy

    from relational_tensors.gpu_exec.kernels.blas import einsum_gemm

    letters, res = op._parsed()
    if len(ins) == 2 and out.dtype in FLOATS and (out.size == 0 or ins[0].size == 0 or ins[1].size == 0):
        if out.size:  # an empty contraction
            from relational_tensors.gpu_exec.kernels import triton_copy as tc

            tc.fill(out, 0.0)
        return
    if len(ins) == 2 and einsum_gemm(ins[0], ins[1], out, letters[0], letters[1], res, stream):
        return
    bf16 = out.dtype == "bfloat16"
    arrays = [b.cupy() for b in ins]
    dst = out.cupy()
    with cupy.cuda.ExternalStream(stream):
        sub = ",".join("".join(x) for x in letters) + "->" + "".join(res)
        work = compute_dtype(out.dtype)  # 16-bit floats in float32, float64 stays float64
        operands = [bf16_bits_to_float32(a, cupy) if b.dtype == "bfloat16" else a.astype(work)
                    for a, b in zip(arrays, ins)]
        result = cupy.einsum(sub, *operands)
        dst[...] = float32_to_bf16_bits(result, cupy) if bf16 else result.astype(dst.dtype)


# operators whose GPU kernel is their NumPy kernel on host copies (SQL operators evaluate arbitrary
# expressions; the gradient operators without device kernels yet)
HOST_KINDS = ("sql", "pad", "where", "conv_grad", "pool", "pool_grad")


@launcher(*HOST_KINDS)
def _host(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    host_kernel(op, f, ins, out, stream)


SCALAR_UFUNCS = {"scale": "multiply", "add_scalar": "add", "pow": "power"}


@launcher("unary")
def _unary(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_elementwise as te

    if "bool" in (out.dtype, ins[0].dtype):  # masks: built once per call, on host copies
        host_kernel(op, f, ins, out, stream)
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
    from relational_tensors.gpu_exec.kernels import triton_elementwise as te

    if op.op not in te.BINARY_CODES:  # comparisons and logic make boolean masks: on host copies
        host_kernel(op, f, ins, out, stream)
        return
    te.binary(ins[0], ins[1], out, op.op)


@launcher("swiglu")
def _swiglu(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_elementwise as te

    te.swiglu(ins[0], ins[1], out)


@launcher("rmsnorm")
def _rmsnorm(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_norms as tn

    tn.rmsnorm(ins[0], ins[1], out, op.eps)


@launcher("layernorm")
def _layernorm(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_norms as tn

    tn.layernorm(ins[0], ins[1], ins[2], out, op.eps)


@launcher("softmax")
def _softmax(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_norms as tn

    tn.softmax(ins[0], out, op.axis % len(ins[0].shape))


def _reduce_layout(op: Any, shape: tuple[int, ...]) -> tuple[list[int], tuple[int, ...], bool]:
    """The kept and reduced axes of a block of ``shape``, and whether the reduced ones must be moved last."""
    axes = op._axes()
    keep = [d for d in range(len(shape)) if d not in axes]
    return keep, axes, keep + list(axes) != list(range(len(shape)))


def _reduce_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """Room for the input with its reduced axes moved last (when they are not already), then for the
    partials of a chunked reduction (few long rows), in elements of the input's dtype."""
    from relational_tensors.gpu_exec.kernels.scratch import partial_dtype, reduce_chunks

    shape, dtype = f.inputs[0].shape, op.input_types[0].dtype
    keep, axes, moved = _reduce_layout(op, shape)
    rows = math.prod(shape[d] for d in keep)
    n = math.prod(shape[d] for d in axes)
    chunks = reduce_chunks(rows, n) if rows and n else 1
    room = math.prod(shape) if moved else 0
    if chunks > 1:
        room += -(-rows * chunks * itemsize(partial_dtype(dtype)) // itemsize(dtype)) + 8  # + alignment
    return ((room,), dtype) if room else None


@launcher("reduce", scratch=_reduce_scratch)
def _reduce(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels import triton_norms as tn
    from relational_tensors.gpu_exec.kernels.common import DevBuf

    x = ins[0]
    keep, axes, moved = _reduce_layout(op, x.shape)
    count = math.prod(op.input_types[0].shape[a] for a in axes) if op.op == "mean" else 1  # of the whole axes
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


def _rope_constants(op: Any) -> dict[str, np.ndarray]:
    from relational_tensors.sql_specs.packing import sequence_bounds

    length = op.input_types[0].shape[1]
    start, _ = sequence_bounds(np.arange(length), op.seq_ends, length)
    return {"seq_start": start.astype(np.int32)}


@launcher("rope", constants=_rope_constants)
def _rope(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels.triton_rope import rope

    if op.freq_dtype is not None:  # rounded frequencies: no device kernel yet
        host_kernel(op, f, ins, out, stream)
        return
    rope(ins[0], out, consts["seq_start"], f.inputs[0].lower[1], op.base, op.inverse)


@launcher("dropout")
def _dropout(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_random as tr

    # the block's place in the whole tensor fixes its draws; the state is read on the device
    tr.dropout(ins[0], ins[1], out, f.output.lower, op.output_type.shape, float(op.p), op.stream)


@launcher("random")
def _random(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_random as tr

    tr.random(ins[0], out, f.output.lower, op.output_type.shape, op.stream, op.distribution, float(op.p))


@launcher("reshape")
def _reshape(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.common import DevBuf

    x = ins[0]
    tc.copy_box(DevBuf(x.ptr, out.shape, x.dtype, x.device), out)


@launcher("permute")
def _permute(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc

    tc.copy_box(ins[0].permuted(op.perm), out)


@launcher("expand")
def _expand(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """A broadcast copy: the input block read with stride 0 along the dimensions it repeats."""
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.common import DevBuf

    x = ins[0]
    strides = tuple(0 if a == 1 and n != 1 else s for a, n, s in zip(x.shape, out.shape, x.strides))
    tc.copy_box(DevBuf(x.ptr, out.shape, x.dtype, x.device, strides), out)


@launcher("slice")
def _slice(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc

    tc.copy_box(ins[0], out)


@launcher("concat")
def _concat(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc

    axis = op._axis()
    at = 0
    for blk in ins:
        n = blk.shape[axis]
        if n and blk.size:
            lower = tuple(at if d == axis else 0 for d in range(len(out.shape)))
            tc.copy_box(blk, out.sub(lower, blk.shape))
        at += n


@launcher("embedding")
def _embedding(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc

    tc.embedding(ins[0], ins[1], out, f.inputs[0].lower[0])


# ------------------------------------------------------------------ the gradient operators


@launcher("unary_grad")
def _unary_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_elementwise_grad as teg

    teg.unary_grad(ins[0], ins[1], out, op.op, float(op.arg))


@launcher("binary_grad")
def _binary_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_elementwise_grad as teg

    if out.dtype not in ("float16", "bfloat16", "float32", "float64"):  # integer operands: on host copies
        host_kernel(op, f, ins, out, stream)
        return
    teg.binary_grad(ins[0], ins[1], ins[2], out, op.op, op.wrt)


@launcher("swiglu_grad")
def _swiglu_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_elementwise_grad as teg

    if isinstance(out, tuple):  # (this gradient, the sibling task's): both from one pass
        teg.swiglu_grad(ins[0], ins[1], ins[2], out[0], op.wrt, other=out[1])
    else:
        teg.swiglu_grad(ins[0], ins[1], ins[2], out, op.wrt)


@launcher("softmax_grad")
def _softmax_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_norms_grad as tng

    tng.softmax_grad(ins[0], ins[1], out, op.axis % len(ins[0].shape))


@launcher("norm_grad")
def _norm_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_norms_grad as tng

    tng.norm_grad(ins[0], ins[1], ins[2], out, op.norm == "layer", op.eps)


def _norm_weight_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str]:
    """Per-row statistics and per-chunk partial sums, in the compute dtype."""
    from relational_tensors.gpu_exec.kernels.scratch import weight_grad_scratch

    shape = f.inputs[0].shape
    rows = math.prod(shape[:-1])
    return (weight_grad_scratch(rows, shape[-1]),), "float64" if op.input_types[0].dtype == "float64" else "float32"


@launcher("norm_weight_grad", scratch=_norm_weight_grad_scratch)
def _norm_weight_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_norms_grad as tng

    tng.norm_weight_grad(ins[0], ins[1], out, consts["scratch"], op.norm == "layer", op.eps)


def _embedding_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str]:
    """The sort keys of the block's token ids."""
    from relational_tensors.gpu_exec.kernels.scratch import embedding_grad_scratch

    return (embedding_grad_scratch(f.inputs[0].volume),), "int64"


@launcher("embedding_grad", scratch=_embedding_grad_scratch)
def _embedding_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels.triton_embedding_grad import embedding_grad

    embedding_grad(ins[0], ins[1], out, consts["scratch"], f.output.lower[0])


@launcher("cross_entropy")
def _cross_entropy(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_cross_entropy as tce

    tce.cross_entropy(ins[0], ins[1], ins[2], out, f.inputs[0].lower[-1], op.input_types[0].shape[-1],
                      op.ignore_index)


@launcher("cross_entropy_grad")
def _cross_entropy_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_cross_entropy as tce

    tce.cross_entropy_grad(ins[0], ins[1], ins[2], ins[3], out, f.inputs[0].lower[-1], op.input_types[0].shape[-1],
                           op.ignore_index)


@launcher("token_count")
def _token_count(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_cross_entropy as tce

    tce.token_count(ins[0], out, op.ignore_index)


def _attention_constants(op: Any) -> dict[str, np.ndarray]:
    rows = np.arange(op.input_types[0].shape[1])
    lo, hi = op._key_limits(rows)
    return {"row_lo": lo.astype(np.int32), "row_hi": hi.astype(np.int32)}


def _computable(b: Any) -> Any:
    """A block as a CuPy array in its compute dtype (16-bit floats as float32; bool and float64 as they are),
    for the operators whose GPU path is their own NumPy-style code over CuPy."""
    import cupy

    a = b.cupy()
    if b.dtype == "bfloat16":
        return bf16_bits_to_float32(a, cupy)
    return a if b.dtype == "bool" else a.astype(compute_dtype(b.dtype), copy=False)


def _dense_attention(op: Any, f: FunctionSpec, ins: list, out: Any, stream: int) -> None:
    """The operator's chunked kernel with CuPy arrays (float32 scores, cuBLAS contractions): the GPU path of
    key padding, masks and biases, which the Triton kernel's per-row key ranges cannot express."""
    import cupy

    with cupy.cuda.ExternalStream(stream):
        o, lse = op.dense([_computable(b) for b in ins], f, cupy)
        for buf, value in (zip(out, (o, lse)) if isinstance(out, tuple) else [(out, o)]):
            dst = buf.cupy()
            dst[...] = float32_to_bf16_bits(value.astype(cupy.float32), cupy) if buf.dtype == "bfloat16" \
                else value.astype(dst.dtype)


def _conv_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """im2col columns [batch, in_channels, *kernel, *out] of one function spec (groups == 1)."""
    if op.groups != 1:
        return None
    x, out = f.inputs[0], f.output
    return (x.shape[0], x.shape[1], *op.kernel_size, *out.shape[2:]), op.input_types[0].dtype


@launcher("conv", scratch=_conv_scratch)
def _conv(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """im2col into scratch (one strided copy per kernel position), then one strided-batched cuBLAS GEMM:
    out[n] [f, o] = w [f, c·k] @ cols[n] [c·k, o] for every batch row n, float32 accumulation; nothing
    allocated, so it is captured with the rest.  Grouped convolutions run the contractions over CuPy arrays instead."""
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.blas import matmul
    from relational_tensors.gpu_exec.kernels.common import DevBuf

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


@launcher("attention", constants=_attention_constants)
def _attention(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import flash
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.triton_attention import attention

    if op.extras or op.key_lengths is not None:  # key padding, masks and biases: dense chunks on the device
        _dense_attention(op, f, ins, out, stream)
        return
    q, k, v = ins
    o, lse = out if isinstance(out, tuple) else (out, None)
    if k.shape[1] == 0:  # this query block sees none of these keys
        tc.fill(o, 0.0)
        if lse is not None:
            tc.fill(lse, float("-inf"))
        return
    if "flash" in consts:  # a library FlashAttention kernel computes this block exactly
        flash.attention(q, k, v, o, consts["flash"], op.is_causal, op.softmax_scale, stream)
        return
    attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], f.inputs[0].lower[1], f.inputs[1].lower[1],
              op.softmax_scale)


# ------------------------------------------------------------------ the attention backward


def key_query_limits(row_lo: np.ndarray, row_hi: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key c, the rows [qlo[c], qhi[c]) that see it, from every row's keys [row_lo[r], row_hi[r]) (both
    ends non-decreasing in r, so the rows that see a key are one range, and its ends non-decreasing in c).

    >>> key_query_limits(np.array([0, 0, 0, 2]), np.array([1, 2, 3, 4]), 4)
    (array([0, 1, 2, 3]), array([3, 3, 4, 4]))
    """
    keys = np.arange(n_keys)
    return np.searchsorted(row_hi, keys, side="right"), np.searchsorted(row_lo, keys, side="right")


def _attention_grad_constants(op: Any) -> dict[str, np.ndarray]:
    lo, hi = op._key_limits(np.arange(op.input_types[0].shape[1]))
    qlo, qhi = key_query_limits(lo, hi, op.input_types[1].shape[1])
    return {"row_lo": lo.astype(np.int32), "row_hi": hi.astype(np.int32), "key_qlo": qlo.astype(np.int32),
            "key_qhi": qhi.astype(np.int32)}


def _host_form(op: Any) -> bool:
    """Whether an attention-backward operator runs its NumPy kernel on host copies whatever its blocks: key
    padding, masks, biases and key lengths (which per-row key ranges cannot express), the bias gradient and
    float64 (no float64 attention on GPUs)."""
    return (bool(op.extras) or op.key_lengths is not None or getattr(op, "part", "") == "dbias"
            or op.input_types[0].dtype == "float64")


def _grad_on_host(op: Any, bufs: list) -> bool:
    """Whether an attention-backward block runs on host copies: a host form (``_host_form``), or blocks
    whose last axis is not contiguous."""
    return _host_form(op) or any(b.shape[-1] > 1 and b.strides[-1] != 1 for b in bufs)


@launcher("attention_lse", constants=_attention_grad_constants)
def _attention_lse(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.triton_attention_grad import attention_lse

    if _grad_on_host(op, [*ins[:2], out]):
        host_kernel(op, f, ins, out, stream)
        return
    q, k = ins[:2]
    if k.shape[1] == 0:  # this query block sees none of these keys
        tc.fill(out, float("-inf"))
        return
    attention_lse(q, k, out, consts["row_lo"], consts["row_hi"], f.inputs[0].lower[1], f.inputs[1].lower[1],
                  op.softmax_scale)


@launcher("attention_delta")
def _attention_delta(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels.triton_attention_grad import attention_delta

    attention_delta(ins[0], ins[1], out)


def _attention_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """float32 partials of a dk|dv pass that splits its query heads (``kernels.scratch.dkv_splits``)."""
    from relational_tensors.gpu_exec.kernels.scratch import dkv_scratch

    if op.part not in ("dk", "dv", "dkv") or _host_form(op):
        return None
    (nb, _, hq, d), (_, skv, hkv, _), dv = f.inputs[0].shape, f.inputs[1].shape, f.inputs[2].shape[3]
    width = (d if op.part in ("dk", "dkv") else 0) + (dv if op.part in ("dv", "dkv") else 0)
    need = dkv_scratch(nb, skv, hkv, hq // hkv, width) if hkv else 0
    return ((need,), "float32") if need else None


@launcher("attention_grad", constants=_attention_grad_constants, scratch=_attention_grad_scratch)
def _attention_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.gpu_exec.kernels import triton_copy as tc
    from relational_tensors.gpu_exec.kernels.triton_attention_grad import attention_dkv, attention_dq

    if _grad_on_host(op, [*ins[:4], out]):
        host_kernel(op, f, ins, out, stream)
        return
    q, k, v, do, lse, delta = ins[:6]
    q_offset, k_offset = f.inputs[0].lower[1], f.inputs[1].lower[1]
    if op.part == "dq":
        if k.shape[1] == 0:  # these rows see none of these keys
            tc.fill(out, 0.0)
            return
        attention_dq(q, k, v, do, lse, delta, out, consts["row_lo"], consts["row_hi"], q_offset, k_offset,
                     op.softmax_scale)
        return
    if q.shape[1] == 0:  # no row of this query block sees these keys
        tc.fill(out, 0.0)
        return
    attention_dkv(q, k, v, do, lse, delta, out, consts["key_qlo"], consts["key_qhi"], q_offset, k_offset,
                  op.softmax_scale, dk=op.part in ("dk", "dkv"), dv=op.part in ("dv", "dkv"),
                  scratch=consts.get("scratch"))

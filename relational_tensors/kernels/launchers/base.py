"""The registry of GPU launchers, keyed by operator kind, and what every family of launchers shares.

A launcher receives the operator, the function spec, device views of its input blocks and of its
output block (an lse partial is an (out, lse) pair), per-operator constants already on the device,
and the stream; it launches without allocating, unless its ``allocates`` says so (for the kind, or
per operator), which keeps a program that uses it out of CUDA-graph capture.  Registration imports
neither CuPy nor Triton: each launcher imports its kernels when it first runs, so the registry can be
read (and checked complete) on a machine without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import bf16_bits_to_float32, compute_dtype, itemsize, numpy_dtype, partial_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.errors import ExecError
from relational_tensors.kernels.common import align
from relational_tensors.sql_specs.base import Operator

__all__ = ["Launcher", "LAUNCHERS", "launcher", "launcher_for", "op_constants", "scratch_shape", "task_scratch",
           "scratch_bytes", "kernel_scratch", "allocates", "host_kernel", "HOST_KINDS", "FLOATS", "widens"]

LaunchFn = Callable[[Any, FunctionSpec, list, Any, dict, int], None]
Constants = Callable[[Any], dict[str, np.ndarray]]
Scratch = Callable[[Any, FunctionSpec], tuple[tuple[int, ...], str] | None]  # None: no scratch for this one
Allocates = Callable[[Any], bool]  # per operator: whether its kernel allocates


@dataclass(frozen=True)
class Launcher:
    """How one operator kind runs on a GPU: the launch, and what it needs set up before it.

    ``constants`` gives host arrays its kernels read on every device that runs the operator (copied
    to each device once); ``scratch`` the shape and dtype of scratch one function spec needs besides
    its output; ``allocates`` whether its kernels allocate device memory (True or False for every
    operator of the kind, or a rule reading the operator's parameters); ``host_forms`` which forms of the
    kind run off the device kernels (on host copies, or allocating CuPy code): every launcher that may
    allocate says which, and why."""

    kind: str
    launch: LaunchFn
    constants: Constants | None = None
    scratch: Scratch | None = None
    allocates: bool | Allocates = False
    host_forms: str = ""

    @property
    def gpu_form(self) -> str:
        """Where the kind runs on GPUs: ``kernel`` (every form in device kernels, captured), ``kernel except
        <forms>``, or ``host: <forms>`` (every form on host copies)."""
        if self.allocates is False:
            return "kernel"
        if self.allocates is True:
            return f"host: {self.host_forms}"
        return f"kernel except {self.host_forms}"

    def allocates_for(self, op: Any) -> bool:
        """Whether this launch of ``op`` allocates (which keeps its program out of CUDA-graph capture)."""
        return bool(self.allocates(op)) if callable(self.allocates) else self.allocates


LAUNCHERS: dict[str, Launcher] = {}


def launcher(*kinds: str, constants: Constants | None = None, scratch: Scratch | None = None,
             allocates: bool | Allocates = False, widen: bool = True,
             host_forms: str = "") -> Callable[[LaunchFn], LaunchFn]:
    """Decorator: ``fn`` launches the GPU kernel of the operator ``kinds``; with ``widen`` (unless it writes
    every dtype itself, as the host kernels do) its bfloat16 partials go through float32 (``_widening``).
    A launcher that may allocate names the forms that do in ``host_forms``."""
    def register(fn: LaunchFn) -> LaunchFn:
        wrapped = _WIDENED.setdefault(fn, _widening(fn) if widen else fn)
        for kind in kinds:
            old = LAUNCHERS.get(kind)
            if old is not None and old.launch is not wrapped:
                raise ValueError(f"a GPU launcher for operator kind {kind!r} is registered twice")
            LAUNCHERS[kind] = Launcher(kind, wrapped, constants, scratch, allocates, host_forms)
        return fn
    return register


_WIDENED: dict[LaunchFn, LaunchFn] = {}


def widens(op: Any, out_dtype: str) -> bool:
    """Whether a kernel of ``op`` writing a block of ``out_dtype`` writes a partial wider than its kernels
    compute: a bfloat16 operator's float64 partial (``core.dtypes.partial_dtype``), which the GPU kernels
    (cuBLAS, Triton) compute in float32 and a widening copy writes."""
    return op.output_type.dtype == "bfloat16" and out_dtype == partial_dtype("bfloat16") != "float32"


def _aligned(nbytes: int) -> int:
    """Where the widened block starts after a kernel's own scratch: at the arena's alignment, so the kernel
    (cuBLAS, cuDNN, Triton with vector loads) may write it as it writes any block."""
    return align(nbytes)


def _first_replaced(out: Any, by: Any) -> Any:
    return (_first_replaced(out[0], by), *out[1:]) if isinstance(out, tuple) else by


def _widening(fn: LaunchFn) -> LaunchFn:
    """``fn``, writing a bfloat16 operator's float64 partial through float32: the kernel writes its block into
    the tail of the task's scratch (``task_scratch`` adds it), a copy widens it into the partial."""
    def launch(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
        first = out
        while isinstance(first, tuple):  # an lse partial's (block, lse); a sibling's output beside it
            first = first[0]
        if not widens(op, first.dtype):
            fn(op, f, ins, out, consts, stream)
            return
        from relational_tensors.kernels import triton_copy as tc
        from relational_tensors.kernels.common import DevBuf

        room = consts["scratch"]
        own = scratch_shape(op, f)
        skip = _aligned(math.prod(own[0]) * itemsize(own[1])) if own is not None else 0
        narrow = DevBuf(room.ptr + skip, first.shape, "float32", first.device)
        inner = dict(consts)
        if own is not None:
            inner["scratch"] = DevBuf(room.ptr, tuple(own[0]), own[1], room.device)
        else:
            inner.pop("scratch")
        fn(op, f, ins, _first_replaced(out, narrow), inner, stream)
        tc.copy_box(narrow, first)  # float32 -> float64, exact

    launch.__name__ = launch.__qualname__ = getattr(fn, "__name__", "launch")
    launch.__doc__ = fn.__doc__
    return launch


def launcher_for(kind: str) -> Launcher:
    """The launcher of ``kind``; an operator without one is refused by name."""
    found = LAUNCHERS.get(kind)
    if found is None:
        raise ExecError(f"operator kind {kind!r} has no GPU launcher (registered: {sorted(LAUNCHERS)}); "
                        "register one with @launcher in a module of relational_tensors/kernels/launchers/, or run on "
                        "device='cpu:N'.")
    return found


def op_constants(op: Operator) -> dict[str, np.ndarray]:
    """Host arrays an operator's kernels read on every device that runs it."""
    make = launcher_for(op.kind).constants
    return make(op) if make is not None else {}


def allocates(op: Operator) -> bool:
    """Whether the GPU kernel of ``op`` allocates (see :class:`Launcher`)."""
    return launcher_for(op.kind).allocates_for(op)


def scratch_shape(op: Operator, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """Scratch a function spec's kernel needs besides its output (a transposed copy for reductions)."""
    make = launcher_for(op.kind).scratch
    return make(op, f) if make is not None else None


def task_scratch(dag: Any) -> dict[int, tuple[tuple[int, ...], str]]:
    """Kernel task -> the scratch its kernel needs (``scratch_shape``), for the tasks that need some."""
    out = {}
    for t in dag.tasks:
        if t.kind == "kernel" and t.op is not None:
            op = dag.nodes[t.op].op
            if op is None:
                continue
            need = scratch_shape(op, t.kernel.function)
            buf = dag.buffers[t.outputs[0]]
            if widens(op, buf.dtype) and op.kind not in HOST_KINDS:
                # a float32 block for the kernel to write before it is widened (``_widening``), after the
                # kernel's own scratch
                skip = _aligned(math.prod(need[0]) * itemsize(need[1])) if need is not None else 0
                need = ((skip // 4 + math.prod(buf.box.shape),), "float32")
            if need is not None:
                out[t.id] = need
    return out


def scratch_bytes(needs: dict[int, tuple[tuple[int, ...], str]]) -> dict[int, int]:
    """``task_scratch``'s needs in bytes, for the memory plan."""
    return {t: math.prod(shape) * itemsize(dtype) for t, (shape, dtype) in needs.items()}


def kernel_scratch(dag: Any) -> dict[int, int]:
    """Kernel task -> bytes of scratch the GPU executor gives it (``task_scratch``), for the liveness of a
    GPU plan: computed without Triton or CuPy (``kernels.scratch``), so any machine can count it."""
    return scratch_bytes(task_scratch(dag))


def host_kernel(op: Any, f: FunctionSpec, ins: list, out: Any, stream: int) -> None:
    """Run the operator's NumPy kernel on host copies of its blocks and copy the result back: the GPU path
    of the operators without a device kernel yet (their launchers allocate, which keeps a program that uses
    them out of CUDA-graph capture)."""
    import cupy

    first = out[0] if isinstance(out, tuple) else out
    with cupy.cuda.ExternalStream(stream):
        blocks = [cupy.asnumpy(b.cupy()).view(numpy_dtype("bfloat16")) if b.dtype == "bfloat16"
                  else cupy.asnumpy(b.cupy()) for b in ins]
        # a partial (wider than the output) computed as the NumPy executor computes it, not rounded first
        host = op.kernel(blocks, f) if first.dtype == op.output_type.dtype else \
            op.partial_kernel(blocks, f, first.dtype)
        # an operator with a log-sum-exp returns (block, lse); out is that pair only where the ⊕ needs it
        pairs = zip(out, host) if isinstance(out, tuple) else [(out, host[0] if isinstance(host, tuple) else host)]
        for buf, value in pairs:
            value = np.ascontiguousarray(np.asarray(value).astype(numpy_dtype(buf.dtype), copy=False))
            buf.cupy().set(value.view(np.uint16) if buf.dtype == "bfloat16" else value)


FLOATS = ("float16", "bfloat16", "float32", "float64")


# operators whose GPU kernel is their NumPy kernel on host copies (SQL operators evaluate arbitrary
# expressions)
HOST_KINDS = ("sql",)


@launcher(*HOST_KINDS, allocates=True, widen=False,
          host_forms="an operator defined by SQL evaluates its expression with its NumPy kernel")
def _host(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    host_kernel(op, f, ins, out, stream)


def _computable(b: Any) -> Any:
    """A block as a CuPy array in its compute dtype (16-bit floats as float32; bool and float64 as they are),
    for the operators whose GPU path is their own NumPy-style code over CuPy."""
    import cupy

    a = b.cupy()
    if b.dtype == "bfloat16":
        return bf16_bits_to_float32(a, cupy)
    return a if b.dtype == "bool" else a.astype(compute_dtype(b.dtype), copy=False)


"""Inputs read in place: ``compileGraph(graph, device, bind={name: array})``.

A bound input is a constant of the program that stays in the caller's array.  Each of its blocks whose
elements form one contiguous run of the array (a block of leading rows, or the whole tensor), on the device
the array lives on, is read from the array itself: the executor's view points into it and the arena keeps no
room for it (``plan_memory``'s ``external``).  The other blocks (split along a later dimension, on another
device) are copied from the array once, when the program is made.  Nothing the program runs writes a bound
block: states are never bound (a step writes their next value), and a load of a bound input is refused.

What the caller promises: the array stays alive (the program holds a reference) and unchanged while the
program is used.  A write into it would reach the blocks read in place and not the copied ones.

The use is memory: programs over the same weights (a decoder's prefill and decode step) share one copy of
them instead of one each.

>>> from relational_tensors.core.types import Box
>>> contiguous_offset(Box((2, 0), (4, 8)), (6, 8)), contiguous_offset(Box((0, 0), (6, 4)), (6, 8))
(16, None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relational_tensors.core.types import Box
from relational_tensors.errors import ExecError

__all__ = ["contiguous_offset", "check_bind", "gpu_bindings", "place_copied"]


def contiguous_offset(box: Box, shape: tuple[int, ...]) -> int | None:
    """The element offset of ``box`` in a C-contiguous array of ``shape`` where the box's elements are one
    contiguous run of the array (every dimension after the last partial one whole, every one before it a
    single index), else None."""
    partial = [i for i, (lo, hi, n) in enumerate(zip(box.lower, box.upper, shape)) if (lo, hi) != (0, n)]
    if partial and any(box.upper[i] - box.lower[i] != 1 for i in range(partial[-1])):
        return None
    offset, stride = 0, 1
    for lo, n in zip(reversed(box.lower), reversed(shape)):
        offset += lo * stride
        stride *= n
    return offset


def check_bind(input_nodes: Any, bind: Mapping[str, Any]) -> None:
    """Refuse a ``bind`` that names no input of the program, or a state (whose next value a step writes)."""
    if not isinstance(bind, Mapping) or not all(isinstance(k, str) for k in bind):
        raise ExecError(f"bind maps graph input names to the arrays the program reads in place; got "
                        f"{type(bind).__name__}.")
    nodes = {n.name: n for n in input_nodes}
    unknown = sorted(set(bind) - set(nodes))
    if unknown:
        raise ExecError(f"bind names inputs of the program; {unknown} are not among its inputs "
                        f"({sorted(nodes)[:12]}{' ...' if len(nodes) > 12 else ''}).")
    states = sorted(n for n in bind if nodes[n].role == "state")
    if states:
        raise ExecError(f"a bound input is a constant the program reads in place, and a step writes a state's "
                        f"next value; got states {states}. Load them instead (cg.load).")
    for name, value in bind.items():
        want = nodes[name].type
        shape = tuple(getattr(value, "shape", ()))
        if shape != want.shape:
            raise ExecError(f"bound input {name!r} must have shape {want.shape}; got {shape}.")
        have = str(getattr(value, "dtype", "")).replace("torch.", "")
        if have != want.dtype:
            raise ExecError(f"bound input {name!r} is read in place, so its array must be {want.dtype}; got "
                            f"{have or type(value).__name__}. Cast it first (a bound array is never converted).")


def gpu_bindings(cp: Any, dag: Any, bind: Mapping[str, Any], phys: Any, keeps: Any) -> tuple[dict[str, Any],
                                                                                         dict[int, Any]]:
    """The GPU executor's bound inputs (``check_bind`` passed when the program was compiled): (name -> (the
    given array, its CuPy view)), and (block buffer -> the ``DevBuf`` in the array it is read from) for the
    blocks read in place (the module's rule; a block start also aligned as the arena's are).  ``phys``:
    logical device -> GPU; ``keeps(device)``: whether this executor holds that logical device's memory."""
    from relational_tensors.core.dtypes import itemsize
    from relational_tensors.kernels.common import ALIGN, DevBuf
    from relational_tensors.runtime.cupy_staging import _as_device_array

    arrays: dict[str, Any] = {}
    bound: dict[int, Any] = {}
    for name, value in bind.items():
        value = value.detach() if hasattr(value, "detach") else value  # (a torch tensor that requires grad)
        arr = _as_device_array(cp, value)
        if arr is None:
            raise ExecError(f"bound input {name!r} is read in place on the GPUs: give a CUDA array (a torch CUDA "
                            f"tensor, a CuPy array); got {type(value).__name__}.")
        arrays[name] = (value, arr)
        t = dag.node(name).type
        if not arr.flags.c_contiguous:
            continue  # every block copied
        for box, b in dag.inputs.get(name, ()):
            buf = dag.buffers[b]
            if not keeps(buf.device) or buf.parent is not None or phys[buf.device] != arr.device.id:
                continue
            offset = contiguous_offset(box, t.shape)
            if offset is None:
                continue
            ptr = arr.data.ptr + offset * itemsize(t.dtype)
            if ptr % ALIGN == 0:
                bound[b] = DevBuf(ptr, box.shape, t.dtype, arr.device.id)
    return arrays, bound


def place_copied(cp: Any, dag: Any, arrays: Mapping[str, Any], bound: Mapping[int, Any], views: Mapping[int, Any],
                 keeps: Any) -> None:
    """Copy the blocks of bound inputs that are not read in place from their arrays into the arena (once)."""
    gpus = set()
    for name, (_, arr) in arrays.items():
        src = arr.view(cp.uint16) if dag.node(name).type.dtype == "bfloat16" else arr
        for box, b in dag.inputs.get(name, ()):
            if b in bound or not keeps(dag.buffers[b].device):
                continue
            view = views[b]
            gpus.add(view.device)
            with cp.cuda.Device(view.device):
                view.cupy()[...] = src[box.slices()]
    for d in gpus:
        cp.cuda.Device(d).synchronize()

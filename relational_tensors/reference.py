"""Single-device NumPy evaluation: the reference every decomposed result is checked against,
and the executor of one join-agg spec (join -> aggregate -> recompose) that proves a spec right.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from relational_tensors.core.dtypes import itemsize, numpy_dtype, partial_dtype
from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.types import TensorType
from relational_tensors.errors import ExecError
from relational_tensors.frontend.graph import Graph
from relational_tensors.sql_specs.base import Operator

__all__ = ["reference", "execute_spec", "run_operator", "coerce_feed", "check_feed_names", "refuse_out_of_range",
           "refuse_overflow", "STALE_OUTPUTS", "check_loaded"]

STALE_OUTPUTS = ("the saved outputs are stale: inputs were loaded after the last execute(), or it did not finish; "
                 "run cg.execute() before offloading.")


def coerce_feed(name: str, value: Any, t: TensorType) -> np.ndarray:
    """``value`` as an array of type ``t``; floats convert among float dtypes, ints among int dtypes."""
    a = np.asarray(value)
    if a.shape != t.shape:
        raise ExecError(f"input {name!r} must have shape {t.shape}; got {a.shape}.")
    want = numpy_dtype(t.dtype)
    if (a.dtype.kind == "b") != (want.kind == "b"):
        hint = ("Pass a boolean array (e.g. mask != 0)." if want.kind == "b" else
                "Convert it first (e.g. mask.astype(np.float32)), or declare the input bool.")
        raise ExecError(f"input {name!r} must be {t.dtype}; got an array of dtype {a.dtype}. {hint}")
    if want.kind == "b":
        return a
    is_int = want.kind in "iu"
    known = a.dtype.kind in "iuf" or a.dtype == numpy_dtype("bfloat16")  # bfloat16 is a float, of kind "V"
    if (a.dtype.kind in "iu") != is_int or not known:
        raise ExecError(f"input {name!r} must be {t.dtype}; got an array of dtype {a.dtype}. Convert it first.")
    if a.dtype == want:
        return a
    if is_int:
        refuse_out_of_range(name, a, t.dtype)
        return a.astype(want)
    with np.errstate(over="ignore"):
        out = a.astype(want)
    refuse_overflow(name, a, out.astype(np.float32) if t.dtype == "bfloat16" else out, t.dtype)
    return out


def refuse_out_of_range(name: str, a: Any, dtype: str) -> None:
    """Refuse integers that ``dtype`` cannot hold (they would wrap), naming one of them.  ``a`` is a
    NumPy or CuPy integer array."""
    have, want = np.iinfo(a.dtype), np.iinfo(numpy_dtype(dtype))
    if a.size == 0 or (have.min >= want.min and have.max <= want.max):
        return
    lo, hi = int(a.min()), int(a.max())
    if lo < want.min or hi > want.max:
        bad = lo if lo < want.min else hi
        raise ExecError(f"input {name!r} is {dtype}, which holds integers in [{want.min}, {want.max}]; got {bad}. "
                        f"Feed values that fit, or declare the input with a wider dtype.")


def refuse_overflow(name: str, a: Any, converted: Any, dtype: str, xp: Any = np) -> None:
    """Refuse finite floats that became infinite in ``dtype`` (NaN and infinities pass as they are),
    naming one of them.  ``a`` and ``converted`` are arrays of the array module ``xp`` (NumPy or CuPy;
    a bfloat16 ``converted`` is given as float32 values)."""
    if a.size == 0 or (a.dtype.itemsize <= itemsize(dtype) and dtype != "bfloat16"):
        return
    lost = xp.isfinite(a) & ~xp.isfinite(converted)
    if bool(lost.any()):
        bad = float(a[lost].ravel()[0])
        largest = float(ml_dtypes.finfo(numpy_dtype(dtype)).max)
        raise ExecError(f"input {name!r} is {dtype}, whose largest finite value is {largest:g}; got {bad:g}, which "
                        "would become infinite. Scale the values, or declare the input with a wider dtype.")


def check_loaded(loaded: bool, resident: set[str], inputs: Collection[str]) -> None:
    """Refuse to execute before every input has a value (the executors' shared rule): nothing loaded
    yet, or inputs loaded one at a time with some still absent.  ``resident`` holds names of ``inputs``
    only, so comparing sizes settles the common case without a walk (it runs before every replay)."""
    if not loaded:
        raise ExecError("load the inputs first: cg.load({name: array, ...}).")
    if len(resident) < len(inputs):
        missing = [n for n in inputs if n not in resident]
        raise ExecError(f"inputs {missing} have no value yet; load them before execute: cg.load(name, array).")


def check_feed_names(graph: Graph, feeds: Mapping[str, Any], needed: Iterable[str]) -> dict[str, Any]:
    """Graph inputs by name, after checking that ``feeds`` names only inputs and covers ``needed``."""
    names = {n.name: n for n in graph.inputs}
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise ExecError(f"feeds name no graph input: {unknown}; inputs are {sorted(names)}.")
    for name in needed:
        if name not in feeds:
            node = names[name]
            raise ExecError(f"missing a value for input {name!r} of shape {node.type.shape} ({node.type.dtype}).")
    return names


def execute_spec(op: Operator, spec: JoinAggSpec, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Run ``spec`` of ``op`` on whole input arrays: join, aggregate with ⊕, recompose."""
    partials: dict[Any, list[Any]] = defaultdict(list)
    made = spec.output_multiplicity()
    wide = partial_dtype(spec.output_type.dtype)
    for f in spec.functions:
        blocks = [a[box.slices()] for a, box in zip(inputs, f.inputs)]
        partials[f.output].append(op.kernel(blocks, f) if made[f.output] == 1 else op.partial_kernel(blocks, f, wide))
    out = np.empty(spec.output_type.shape, dtype=numpy_dtype(spec.output_type.dtype))
    for box, parts in partials.items():
        out[box.slices()] = spec.aggregation.finalize(spec.aggregation.combine(parts))
    return out


def run_operator(op: Operator, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """``op`` on whole inputs as one function specification."""
    return execute_spec(op, op.spec(), inputs)


def reference(graph: Graph, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Evaluate ``graph`` on one device with NumPy; returns saved name -> array.

    >>> import relational_tensors as rt
    >>> g = rt.Graph(); x = g.input("x", [2, 2]); _ = g.save(g.unary(x, "scale", 3.0), name="y")
    >>> rt.reference(g, {"x": np.eye(2)})["y"].tolist()
    [[3.0, 0.0], [0.0, 3.0]]
    """
    if not graph.outputs:
        raise ExecError("the graph saves no output; call g.save(tensor, name=...) on the results you want.")
    check_feed_names(graph, feeds, [n.name for n in graph.inputs])
    values: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        if node.op is None:
            values[node.id] = coerce_feed(node.name, feeds[node.name], node.type)
        else:
            values[node.id] = run_operator(node.op, [values[i] for i in node.inputs])
    return {name: values[i] for name, i in graph.outputs.items()}

"""Single-device NumPy evaluation: the reference every decomposed result is checked against,
and the executor of one join-agg spec (join -> aggregate -> recompose) that proves a spec right.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.types import TensorType
from relational_tensors.errors import ExecError
from relational_tensors.frontend.graph import Graph
from relational_tensors.sql_specs.base import Operator

__all__ = ["reference", "execute_spec", "run_operator", "coerce_feed", "check_feed_names"]


def coerce_feed(name: str, value: Any, t: TensorType) -> np.ndarray:
    """``value`` as an array of type ``t``; floats convert among float dtypes, ints among int dtypes."""
    a = np.asarray(value)
    if a.shape != t.shape:
        raise ExecError(f"input {name!r} must have shape {t.shape}; got {a.shape}.")
    want = numpy_dtype(t.dtype)
    is_int = want.kind in "iu"
    known = a.dtype.kind in "iuf" or a.dtype == numpy_dtype("bfloat16")  # bfloat16 is a float, of kind "V"
    if (a.dtype.kind in "iu") != is_int or not known:
        raise ExecError(f"input {name!r} must be {t.dtype}; got an array of dtype {a.dtype}. Convert it first.")
    return a.astype(want, copy=False)


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
    for f in spec.functions:
        blocks = [a[box.slices()] for a, box in zip(inputs, f.inputs)]
        partials[f.output].append(op.kernel(blocks, f))
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

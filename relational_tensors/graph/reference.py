"""Single-device NumPy evaluation: the reference every decomposed result is checked against,
and the executor of one join-agg spec (join -> aggregate -> recompose) that proves a spec right.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype, partial_dtype
from relational_tensors.core.feeds import check_feed_names, coerce_feed
from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.errors import ExecError
from relational_tensors.graph.graph import Graph
from relational_tensors.sql_specs.base import Operator

__all__ = ["reference", "execute_spec", "run_operator"]

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
    check_feed_names(graph.inputs, feeds, [n.name for n in graph.inputs])
    values: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        if node.op is None:
            values[node.id] = coerce_feed(node.name, feeds[node.name], node.type)
        else:
            values[node.id] = run_operator(node.op, [values[i] for i in node.inputs])
    return {name: values[i] for name, i in graph.outputs.items()}

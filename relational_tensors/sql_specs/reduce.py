"""Reductions ``sum``, ``max``, ``min``, ``mean`` and ``logsumexp`` over one or more axes.

A reduced axis may be split anywhere: each block reduces its part and ⊕
(sum, max, min or logsumexp) combines the blocks.  ``mean`` is a sum whose blocks
each divide by the full extent, so their ⊕-sum is the mean.

Gradients: sum and mean repeat the output's gradient along the reduced axes;
max and min give it to the elements equal to the result, split evenly among
ties (torch's rule for ``amax``); logsumexp gives it weighted by softmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.aggregation import AGGREGATIONS, Aggregation
from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import normalize_axis
from relational_tensors.sql_specs.grad import build, expand_to, reshape_to

__all__ = ["ReduceOp"]



def _logsumexp(x: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    top = np.max(x, axis=axis, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    out = safe + np.log(np.sum(np.exp(x - safe), axis=axis, keepdims=True))
    return out if keepdims else np.squeeze(out, axis)


_NUMPY: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.sum,
                                               "logsumexp": _logsumexp}


@register
@dataclass(frozen=True, eq=True)
class ReduceOp(IndexedOp):
    """Reduce ``axes`` of x with ``op`` in {sum, max, min, mean, logsumexp}.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = ReduceOp((T.zero((4, 6)),), "max", (1,)); op.signature(), str(op.aggregation)
    ('d0 d1 -> d0', 'max')
    """

    kind = "reduce"
    op: str = "sum"
    axes: tuple[int, ...] = (-1,)
    keepdims: bool = False

    @property
    def aggregation(self) -> Aggregation:  # type: ignore[override]
        return AGGREGATIONS["sum" if self.op == "mean" else self.op]

    def _axes(self) -> tuple[int, ...]:
        (x,) = self.input_types
        axes = tuple(sorted({normalize_axis(self.op, a, x) for a in self.axes}))
        if not axes:
            raise GraphError(f"{self.op} needs at least one axis; got axes={self.axes!r}.")
        return axes

    def infer(self) -> TensorType:
        if self.op not in _NUMPY:
            raise GraphError(f"unknown reduction {self.op!r}; supported: {sorted(_NUMPY)}.")
        (x,) = self.input_types
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"{self.op} needs a floating tensor; got dtype {x.dtype}. Cast it first.")
        axes = self._axes()
        if len(axes) != len(self.axes):  # numpy refuses a repeated axis too: -1 and rank-1 are one axis
            raise GraphError(f"{self.op} takes each axis once; got axes={self.axes!r} for shape {x.shape}.")
        if self.keepdims:
            shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
            return TensorType.zero(shape, x.dtype, x.names)
        keep = [d for d in range(x.rank) if d not in axes]
        if not keep:
            return TensorType.zero((1,), x.dtype, ("d0",))
        return TensorType.zero(tuple(x.shape[d] for d in keep), x.dtype, tuple(x.names[d] for d in keep))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (self.input_types[0].names,)

    def dims_out(self) -> tuple[str | None, ...]:
        x = self.input_types[0]
        axes = self._axes()
        if len(axes) != len(self.axes):  # numpy refuses a repeated axis too: -1 and rank-1 are one axis
            raise GraphError(f"{self.op} takes each axis once; got axes={self.axes!r} for shape {x.shape}.")
        if self.keepdims:
            return tuple(None if d in axes else n for d, n in enumerate(x.names))
        kept = tuple(n for d, n in enumerate(x.names) if d not in axes)
        return kept if kept else (None,)

    def params(self) -> dict[str, object]:
        return {"op": self.op, "axes": self._axes(), "keepdims": self.keepdims}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        (x,) = blocks
        axes = self._axes()
        out = _NUMPY[self.op](self._compute(x), axis=axes, keepdims=True)
        if self.op == "mean":
            out = out / math.prod(self.input_types[0].shape[a] for a in axes)
        return self._result(out.reshape(f.output.shape))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        (x,) = inputs
        t = x.type
        axes = self._axes()
        kept = t.with_(shape=tuple(1 if d in axes else n for d, n in enumerate(t.shape)))
        dy = reshape_to(b, cotangent, kept)
        if self.op == "sum":
            return (expand_to(b, dy, t),)
        if self.op == "mean":
            return (expand_to(b, build(b, "unary", (dy,), op="scale", arg=1.0 / math.prod(t.shape[a] for a in axes)),
                              t),)
        y = reshape_to(b, output, kept)
        if self.op == "logsumexp":  # dy · exp(x - y)
            weights = build(b, "unary", (build(b, "binary", (x, y), op="sub"),), op="exp")
            return (build(b, "binary", (weights, dy), op="mul"),)
        hit = build(b, "binary", (x, y), op="eq")  # max and min: the elements equal to the result
        share = build(b, "binary", (dy, build(b, "reduce", (hit,), op="sum", axes=axes, keepdims=True)), op="div")
        return (build(b, "binary", (hit, share), op="mul"),)

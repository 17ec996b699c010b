"""Reductions ``sum``, ``max``, ``min`` and ``mean`` over one or more axes.

A reduced axis may be split anywhere: each block reduces its part and ⊕
(sum, max or min) combines the blocks.  ``mean`` is a sum whose blocks each
divide by the full extent, so their ⊕-sum is the mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from relational_tensors.core.aggregation import AGGREGATIONS, Aggregation
from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import IndexedOp, register
from relational_tensors.sql_specs.common import normalize_axis

__all__ = ["ReduceOp"]

_NUMPY: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.sum}


@register
@dataclass(frozen=True, eq=True)
class ReduceOp(IndexedOp):
    """Reduce ``axes`` of x with ``op`` in {sum, max, min, mean}.

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

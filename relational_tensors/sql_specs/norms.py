"""Row-wise operators over a last (or given) axis: ``softmax``, ``rmsnorm``, ``layernorm``.

The normalized axis is not shardable (a row needs all of its elements); every
other index splits anywhere, and the weight vectors are read whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import IndexedOp, SameIndicesOp, register
from relational_tensors.sql_specs.common import finite_number, normalize_axis, same_dtype

__all__ = ["SoftmaxOp", "RmsnormOp", "LayernormOp"]


def _need_float(kind: str, t: TensorType) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise GraphError(f"{kind} needs a floating tensor; got dtype {t.dtype}. Cast it first.")


@register
@dataclass(frozen=True, eq=True)
class SoftmaxOp(SameIndicesOp):
    """Softmax along ``axis``; that axis is not shardable.

    >>> from relational_tensors.core.types import TensorType as T
    >>> [s.name for s in SoftmaxOp((T.zero((4, 6)),), -1).shardable()]
    ['d0']
    """

    kind = "softmax"
    axis: int = -1

    def infer(self) -> TensorType:
        (x,) = self.input_types
        _need_float(self.kind, x)
        normalize_axis(self.kind, self.axis, x)
        return x

    def unshardable(self) -> frozenset[str]:
        x = self.input_types[0]
        return frozenset({x.names[normalize_axis(self.kind, self.axis, x)]})

    def params(self) -> dict[str, object]:
        return {"axis": normalize_axis(self.kind, self.axis, self.input_types[0])}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 5.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x = self._compute(blocks[0])
        axis = normalize_axis(self.kind, self.axis, self.input_types[0])
        z = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return self._result(z / np.sum(z, axis=axis, keepdims=True))


@dataclass(frozen=True, eq=True)
class _LastAxisNorm(IndexedOp):
    """Shared shape rules of the norms: x[..., d] with weight vectors [d]."""

    eps: float = 1e-6

    def infer(self) -> TensorType:
        x, *ws = self.input_types
        _need_float(self.kind, x)
        same_dtype(self.kind, self.input_types)
        for w in ws:
            if w.shape != (x.shape[-1],):
                raise GraphError(
                    f"{self.kind} weights must have shape [d] = ({x.shape[-1]},) for x of shape {x.shape}; "
                    f"got {w.shape}."
                )
        finite_number(f"{self.kind} eps", self.eps, at_least=0)
        return x

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        x = self.input_types[0]
        return (x.names, *((x.names[-1],),) * (len(self.input_types) - 1))

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names

    def unshardable(self) -> frozenset[str]:
        return frozenset({self.input_types[0].names[-1]})

    def params(self) -> dict[str, object]:
        return {"eps": self.eps}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 4.0 * output.volume


@register
@dataclass(frozen=True, eq=True)
class RmsnormOp(_LastAxisNorm):
    """``x / sqrt(mean(x², -1) + eps) * w``.

    >>> from relational_tensors.core.types import TensorType as T
    >>> RmsnormOp((T.zero((2, 8)), T.zero((8,))), 1e-5).signature()
    'd0 d1, d1 -> d0 d1'
    """

    kind = "rmsnorm"

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, w = (self._compute(b) for b in blocks)
        r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return self._result(x * r * w)


@register
@dataclass(frozen=True, eq=True)
class LayernormOp(_LastAxisNorm):
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last axis.

    >>> from relational_tensors.core.types import TensorType as T
    >>> LayernormOp((T.zero((2, 8)), T.zero((8,)), T.zero((8,)))).output_type.shape
    (2, 8)
    """

    kind = "layernorm"
    eps: float = 1e-5

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, w, b = (self._compute(t) for t in blocks)
        mu = np.mean(x, axis=-1, keepdims=True)
        var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
        return self._result((x - mu) / np.sqrt(var + self.eps) * w + b)

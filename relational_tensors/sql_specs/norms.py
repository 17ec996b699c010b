"""Row-wise operators over a last (or given) axis: ``softmax``, ``rmsnorm``, ``layernorm``, and their
gradient operators ``softmax_grad``, ``norm_grad`` (of x) and ``norm_weight_grad`` (of the scale).

The normalized axis is not shardable (a row needs all of its elements); every
other index splits anywhere, and the weight vectors are read whole.  The
gradient of a weight vector read by every row is a ⊕-sum over the rows: each
block of rows gives its partial sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, SameIndicesOp, register
from relational_tensors.sql_specs.common import finite_number, normalize_axis, same_dtype
from relational_tensors.sql_specs.grad import SECOND_ORDER, build

__all__ = ["SoftmaxOp", "RmsnormOp", "LayernormOp", "SoftmaxGradOp", "NormGradOp", "NormWeightGradOp"]



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

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        return (build(b, "softmax_grad", (output, cotangent), axis=self.axis),)


@register
@dataclass(frozen=True, eq=True)
class SoftmaxGradOp(SameIndicesOp):
    """``y · (dy - Σ_axis dy·y)`` from the softmax output y and its gradient dy; the axis is not shardable.

    >>> from relational_tensors.core.types import TensorType as T
    >>> SoftmaxGradOp((T.zero((4, 6)), T.zero((4, 6))), -1).signature()
    'd0 d1, d0 d1 -> d0 d1'
    """

    kind = "softmax_grad"
    gradient = SECOND_ORDER
    axis: int = -1

    def infer(self) -> TensorType:
        y, dy = self.input_types
        _need_float(self.kind, y)
        if y.shape != dy.shape:
            raise GraphError(f"softmax_grad needs y and dy of one shape; got {y.shape} and {dy.shape}.")
        same_dtype(self.kind, self.input_types)
        normalize_axis(self.kind, self.axis, y)
        return y

    def unshardable(self) -> frozenset[str]:
        y = self.input_types[0]
        return frozenset({y.names[normalize_axis(self.kind, self.axis, y)]})

    def params(self) -> dict[str, object]:
        return {"axis": normalize_axis(self.kind, self.axis, self.input_types[0])}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 4.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        y, dy = (self._compute(a) for a in blocks)
        axis = normalize_axis(self.kind, self.axis, self.input_types[0])
        return self._result(y * (dy - np.sum(dy * y, axis=axis, keepdims=True)))


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

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x, w = inputs
        dx = build(b, "norm_grad", (x, w, cotangent), norm="rms", eps=self.eps) if wanted[0] else None
        dw = build(b, "norm_weight_grad", (x, cotangent), norm="rms", eps=self.eps) if wanted[1] else None
        return dx, dw


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

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x, w, _ = inputs
        dx = build(b, "norm_grad", (x, w, cotangent), norm="layer", eps=self.eps) if wanted[0] else None
        dw = build(b, "norm_weight_grad", (x, cotangent), norm="layer", eps=self.eps) if wanted[1] else None
        rows = tuple(range(x.type.rank - 1))
        db = (build(b, "reduce", (cotangent,), op="sum", axes=rows) if rows else cotangent) if wanted[2] else None
        return dx, dw, db


def _normalized(norm: str, x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """x̂ (x scaled, and centred for layernorm) and the row scale r = 1 / sqrt(var + eps)."""
    if norm == "layer":
        x = x - np.mean(x, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r, r


@dataclass(frozen=True, eq=True)
class _NormGradBase(IndexedOp):
    """Shared rules of the norm gradients: x[..., d] and dy[..., d], the last axis whole."""

    gradient = SECOND_ORDER
    norm: str = "rms"
    eps: float = 1e-6

    def _check(self, x: TensorType, dy: TensorType) -> None:
        if self.norm not in ("rms", "layer"):
            raise GraphError(f"{self.kind} takes norm 'rms' or 'layer'; got {self.norm!r}.")
        if x.shape != dy.shape:
            raise GraphError(f"{self.kind} needs x and dy of one shape; got {x.shape} and {dy.shape}.")
        _need_float(self.kind, x)
        same_dtype(self.kind, self.input_types)
        finite_number(f"{self.kind} eps", self.eps, at_least=0)

    def unshardable(self) -> frozenset[str]:
        return frozenset({self.input_types[0].names[-1]})

    def params(self) -> dict[str, object]:
        return {"norm": self.norm, "eps": self.eps}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 8.0 * inputs[0].volume


@register
@dataclass(frozen=True, eq=True)
class NormGradOp(_NormGradBase):
    """The gradient of rmsnorm or layernorm with respect to x, from x, the scale w and dy.

    >>> from relational_tensors.core.types import TensorType as T
    >>> NormGradOp((T.zero((2, 8)), T.zero((8,)), T.zero((2, 8))), "rms").signature()
    'd0 d1, d1, d0 d1 -> d0 d1'
    """

    kind = "norm_grad"

    def infer(self) -> TensorType:
        x, w, dy = self.input_types
        self._check(x, dy)
        if w.shape != (x.shape[-1],):
            raise GraphError(f"{self.kind} needs w of shape ({x.shape[-1]},) for x of shape {x.shape}; got {w.shape}.")
        return x

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        x = self.input_types[0]
        return (x.names, (x.names[-1],), x.names)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, w, dy = (self._compute(a) for a in blocks)
        xhat, r = _normalized(self.norm, x, self.eps)
        g = dy * w
        dx = g - xhat * np.mean(g * xhat, axis=-1, keepdims=True)
        if self.norm == "layer":
            dx = dx - np.mean(g, axis=-1, keepdims=True)
        return self._result(dx * r)


@register
@dataclass(frozen=True, eq=True)
class NormWeightGradOp(_NormGradBase):
    """The gradient of rmsnorm's or layernorm's scale: Σ over rows of dy · x̂; the rows are aggregated
    with ⊕ = sum, so any split of them gives partial sums.

    >>> from relational_tensors.core.types import TensorType as T
    >>> NormWeightGradOp((T.zero((2, 8)), T.zero((2, 8))), "layer").signature()
    'd0 d1, d0 d1 -> d1'
    """

    kind = "norm_weight_grad"

    def infer(self) -> TensorType:
        x, dy = self.input_types
        self._check(x, dy)
        return TensorType.zero((x.shape[-1],), x.dtype, (x.names[-1],))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        names = self.input_types[0].names
        return (names, names)

    def dims_out(self) -> tuple[str | None, ...]:
        return (self.input_types[0].names[-1],)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, dy = (self._compute(a) for a in blocks)
        xhat, _ = _normalized(self.norm, x, self.eps)
        rows = tuple(range(x.ndim - 1))
        return self._result(np.sum(dy * xhat, axis=rows))

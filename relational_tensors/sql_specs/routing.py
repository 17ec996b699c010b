"""Routing's selections: top-k positions and one-hot rows.

Top-k selection: the indices of the ``k`` largest (or smallest) entries along the last axis, best first,
NaN above every number, as ``torch.topk`` ranks them; among equal values the lower index first (torch
promises no order there).

Mixture-of-experts routing is its main use: each token's router scores over the experts pick the
experts it is sent to.  The leading indices (tokens) split anywhere; the selected axis and the ``k``
positions stay whole, since a block of choices does not know the others' values.  The indices are
integers, so no gradient flows through them; the selected *values* are read back from the input with
the indices by ``take_along`` (``g.topk`` gives both), and their gradient flows through that read.

``one_hot`` turns ids into rows of zeros with a one at the id: the indicator a routing mask or a
combine weight is built from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import positive_count
from relational_tensors.sql_specs.grad import build

__all__ = ["TopkOp", "OneHotOp", "TakeAlongOp"]


@register
@dataclass(frozen=True, eq=True)
class TopkOp(IndexedOp):
    """``topk(x[..., n], k) -> int64 [..., k]``: positions along the last axis, best first (ties: the lower
    position first).

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = TopkOp((T.zero((6, 8)),), 2); op.signature(), op.output_type.shape
    ('t0 choices -> t0 k', (6, 2))
    """

    kind = "topk"
    k: int = 1
    largest: bool = True
    gradient = "its outputs are integer positions; the values they select carry the gradient"

    def infer(self) -> TensorType:
        (x,) = self.input_types
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"topk ranks floating values; got dtype {x.dtype} for shape {x.shape}. Cast it first.")
        if x.rank < 1:
            raise GraphError("topk needs a tensor with at least one axis; got a scalar.")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= x.shape[-1]:
            raise GraphError(f"topk takes k in [1, {x.shape[-1]}] (the last axis' size); got k={self.k!r}.")
        names = (*x.names[:-1], "topk") if "topk" not in x.names[:-1] else None
        return TensorType.zero((*x.shape[:-1], self.k), "int64", names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return ((*(f"t{n}" for n in range(self.input_types[0].rank - 1)), "choices"),)

    def dims_out(self) -> tuple[str | None, ...]:
        return (*(f"t{n}" for n in range(self.input_types[0].rank - 1)), "k")

    def unshardable(self) -> frozenset[str]:
        return frozenset({"choices", "k"})

    def params(self) -> dict[str, object]:
        return {"k": self.k, "largest": self.largest}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(inputs[0].volume * self.k)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x = np.asarray(blocks[0], np.float64)
        nan = np.isnan(x)  # ranked above every number, as torch ranks it: first when largest, last when not
        value = np.where(nan, 0.0, -x if self.largest else x)
        position = np.broadcast_to(np.arange(x.shape[-1]), x.shape)
        order = np.lexsort((position, value, ~nan if self.largest else nan), axis=-1)
        return np.ascontiguousarray(order[..., : self.k]).astype(np.int64)


@register
@dataclass(frozen=True, eq=True)
class OneHotOp(IndexedOp):
    """``one_hot(ids[...], classes) -> [..., classes]`` in ``dtype`` (floating, or bool): 1 where the class is
    the id, else 0.

    Both the ids and the classes split anywhere: a block of classes ``[c0, c1)`` marks the ids it holds,
    as a vocabulary-parallel embedding does.  An id outside ``[0, classes)`` gives a row of zeros
    (``torch.nn.functional.one_hot`` refuses it; a routing sentinel is such an id).

    >>> from relational_tensors.core.types import TensorType as T
    >>> OneHotOp((T.zero((6, 2), "int64"),), 8).signature()
    't0 t1 -> t0 t1 classes'
    """

    kind = "one_hot"
    classes: int = 1
    dtype: str = "float32"
    gradient = "its input is integer ids"

    def infer(self) -> TensorType:
        (ids,) = self.input_types
        if ids.dtype not in ("int32", "int64"):
            raise GraphError(f"one_hot takes int32 or int64 ids; got dtype {ids.dtype} for shape {ids.shape}.")
        positive_count("one_hot's number of classes", self.classes)
        if self.dtype not in FLOAT_DTYPES and self.dtype != "bool":
            raise GraphError(f"one_hot writes a floating or boolean tensor; got dtype {self.dtype!r}. Supported: "
                             f"{sorted(FLOAT_DTYPES | {'bool'})}.")
        names = (*ids.names, "classes") if "classes" not in ids.names else None
        return TensorType.zero((*ids.shape, self.classes), self.dtype, names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (tuple(f"t{n}" for n in range(self.input_types[0].rank)),)

    def dims_out(self) -> tuple[str | None, ...]:
        return (*self.dims_in()[0], "classes")

    def params(self) -> dict[str, object]:
        return {"classes": self.classes, "dtype": self.dtype}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        (ids,) = blocks
        c0, c1 = f.output.lower[-1], f.output.upper[-1]
        return self._result(np.asarray(ids)[..., None] == np.arange(c0, c1))


@register
@dataclass(frozen=True, eq=True)
class TakeAlongOp(IndexedOp):
    """``take_along(x[..., n], ids[..., k]) -> [..., k]``: ``out[..., j] = x[..., ids[..., j]]`` (torch's
    ``gather`` along the last axis; top-k's values).

    The leading indices split anywhere, and so does ``choices``: a block of positions gives the values of the
    ids it holds and zeros elsewhere, ⊕ = sum puts them together (as the embedding's vocabulary does).
    Infinities and NaN are read as they are.  The gradient adds each output's gradient to the position it
    read (``dx[..., n] = Σ_j dy[..., j] where ids[..., j] = n``, a selection: an infinite dy stays where it
    belongs).

    >>> from relational_tensors.core.types import TensorType as T
    >>> TakeAlongOp((T.zero((6, 8)), T.zero((6, 2), "int64"))).signature()
    't0 choices, t0 k -> t0 k'
    """

    kind = "take_along"

    def infer(self) -> TensorType:
        x, ids = self.input_types
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"take_along reads a floating tensor; got dtype {x.dtype}. Cast it first.")
        if ids.dtype not in ("int32", "int64"):
            raise GraphError(f"take_along takes int32 or int64 ids; got dtype {ids.dtype} for shape {ids.shape}.")
        if x.rank < 1 or ids.rank != x.rank or ids.shape[:-1] != x.shape[:-1]:
            raise GraphError(f"take_along needs ids with x's leading shape and a last axis of their own; got x "
                             f"{x.shape} and ids {ids.shape}.")
        return TensorType.zero(ids.shape, x.dtype, ids.names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        lead = tuple(f"t{n}" for n in range(self.input_types[0].rank - 1))
        return (*lead, "choices"), (*lead, "k")

    def dims_out(self) -> tuple[str | None, ...]:
        return self.dims_in()[1]

    def unshardable(self) -> frozenset[str]:
        return frozenset({"k"})

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, ids = blocks
        c0, c1 = f.inputs[0].lower[-1], f.inputs[0].upper[-1]
        ids = np.asarray(ids, np.int64)
        n = self.input_types[0].shape[-1]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise ExecError(f"take_along ids must lie in [0, {n}); got values from {int(ids.min())} to "
                            f"{int(ids.max())}.")
        mine = (ids >= c0) & (ids < c1)
        got = np.take_along_axis(x, np.clip(ids - c0, 0, max(c1 - c0 - 1, 0)), axis=-1)
        return self._result(np.where(mine, got, np.zeros((), got.dtype)))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x, ids = inputs
        if not wanted[0]:
            return None, None
        # dy picked where the one-hot is set and summed over k; a product with the one-hot would make
        # inf · 0 = NaN across the row
        hot = build(b, "one_hot", (ids,), classes=x.type.shape[-1], dtype="bool")  # [..., k, n]
        dy = build(b, "reshape", (cotangent,), shape=(*cotangent.type.shape, 1))
        picked = build(b, "where", (hot, dy, build(b, "unary", (dy,), op="fill", arg=0.0)))
        return build(b, "reduce", (picked,), op="sum", axes=(x.type.rank - 1,)), None

"""Embedding lookup: ``out[..., e] = table[ids[...], e]``.

The token indices and the embedding width split anywhere.  The vocabulary
splits too (vocabulary-parallel embedding): each block returns the rows of the
ids it holds and zeros elsewhere, and ⊕ = sum puts them together.

The table's gradient ``embedding_grad`` scatter-adds each token's output
gradient into its row: the vocabulary splits (a block adds only the ids it
holds) and the tokens split with ⊕ = sum (each block of tokens gives a partial
table).

``put_rows(x, ids, values)`` is ``x`` with the rows of its first axis at ``ids`` replaced by ``values``
(torch's ``x[ids] = values``, ``index_copy``): where an id repeats, its last occurrence's values are
written.  The rows and every other axis of x split (a block writes the ids it holds); the ids do not.  Its
gradient is the output's gradient with the written rows zeroed (for x) and read at ids (for values), as
torch's ``index_put`` computes it.  Producing a state's next value, it writes the state's block in place,
so only the written rows move (``physical.views``: a key/value cache taking a step's rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import positive_count
from relational_tensors.sql_specs.grad import build

__all__ = ["EmbeddingOp", "EmbeddingGradOp", "PutRowsOp", "check_ids"]


def check_ids(ids: np.ndarray, vocab: int, what: str = "embedding ids") -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ExecError(
            f"{what} must lie in [0, {vocab}); got values from {int(ids.min())} to {int(ids.max())}."
        )


@register
@dataclass(frozen=True, eq=True)
class EmbeddingOp(IndexedOp):
    """``embedding(table[vocab, embed], ids[...]) -> [..., embed]``.

    >>> from relational_tensors.core.types import TensorType as T
    >>> EmbeddingOp((T.zero((100, 8)), T.zero((2, 5), "int64"))).signature()
    'vocab embed, t0 t1 -> t0 t1 embed'
    """

    kind = "embedding"

    def infer(self) -> TensorType:
        table, ids = self.input_types
        if table.rank != 2:
            raise GraphError(f"embedding needs a table of shape [vocab, embed]; got {table.shape}.")
        if ids.dtype not in ("int32", "int64"):
            raise GraphError(f"embedding ids must be int32 or int64; got dtype {ids.dtype} for shape {ids.shape}.")
        if table.dtype not in FLOAT_DTYPES:
            raise GraphError(f"embedding tables must be floating; got dtype {table.dtype}.")
        return TensorType.zero((*ids.shape, table.shape[1]), table.dtype, (*ids.names, table.names[1])
                               if table.names[1] not in ids.names else None)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        ids = self.input_types[1]
        return (("vocab", "embed"), tuple(f"t{n}" for n in range(ids.rank)))

    def dims_out(self) -> tuple[str | None, ...]:
        return (*self.dims_in()[1], "embed")

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(output.volume)

    def kernel_bytes(self, input_bytes: Sequence[float], output_bytes: float) -> float:
        """A lookup reads the rows it gathers (at most the output's bytes), not its whole block of the table."""
        table, ids = input_bytes
        return min(table, output_bytes) + ids + output_bytes

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        table, ids = blocks
        check_ids(ids, self.input_types[0].shape[0])
        v0, v1 = f.inputs[0].lower[0], f.inputs[0].upper[0]
        mine = (ids >= v0) & (ids < v1)
        rows = table[np.clip(ids - v0, 0, max(v1 - v0 - 1, 0))]
        out = np.where(mine[..., None], rows, np.zeros((), dtype=table.dtype))
        return out.astype(numpy_dtype(self.output_type.dtype), copy=False)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        table, ids = inputs
        return (build(b, "embedding_grad", (ids, cotangent), vocab=table.type.shape[0]), None)


@register
@dataclass(frozen=True, eq=True)
class EmbeddingGradOp(IndexedOp):
    """``embedding_grad(ids[...], dy[..., embed]) -> [vocab, embed]``: row v is the sum of dy over the tokens
    whose id is v.

    >>> from relational_tensors.core.types import TensorType as T
    >>> EmbeddingGradOp((T.zero((2, 5), "int64"), T.zero((2, 5, 8))), 100).signature()
    't0 t1, t0 t1 embed -> vocab embed'
    """

    kind = "embedding_grad"
    vocab: int = 1

    def infer(self) -> TensorType:
        ids, dy = self.input_types
        if ids.dtype not in ("int32", "int64"):
            raise GraphError(f"embedding_grad ids must be int32 or int64; got dtype {ids.dtype}.")
        if dy.shape[:-1] != ids.shape or dy.dtype not in FLOAT_DTYPES:
            raise GraphError(f"embedding_grad needs dy of shape ids.shape + [embed] = {ids.shape} + [embed], "
                             f"floating; got {dy}.")
        positive_count("embedding_grad's vocabulary size", self.vocab)
        return TensorType.zero((self.vocab, dy.shape[-1]), dy.dtype, ("vocab", "embed"))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        tokens = tuple(f"t{n}" for n in range(self.input_types[0].rank))
        return (tokens, (*tokens, "embed"))

    def dims_out(self) -> tuple[str | None, ...]:
        return ("vocab", "embed")

    def params(self) -> dict[str, object]:
        return {"vocab": self.vocab}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(inputs[1].volume)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        ids, dy = blocks
        check_ids(ids, self.vocab)
        v0, v1 = f.output.lower[0], f.output.upper[0]
        out = np.zeros(f.output.shape, dtype=np.dtype(self._compute(dy[:0]).dtype))
        flat = ids.reshape(-1)
        mine = (flat >= v0) & (flat < v1)
        np.add.at(out, flat[mine] - v0, self._compute(dy).reshape(-1, dy.shape[-1])[mine])
        return self._result(out)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        """Each row's sum reaches every row it sums: ``dy``'s gradient is the cotangent's rows at ids (the
        scatter's transpose, a lookup); the rows ``x[ids] = v`` writes get theirs this way."""
        ids, _ = inputs
        return (None, build(b, "embedding", (cotangent, ids)) if wanted[1] else None)


@register
@dataclass(frozen=True, eq=True)
class PutRowsOp(IndexedOp):
    """``put_rows(x[rows, ...], ids[n], values[n, ...]) -> [rows, ...]``: x with row ``ids[i]`` replaced by
    ``values[i]`` (the last i where ids repeat).

    >>> from relational_tensors.core.types import TensorType as T
    >>> PutRowsOp((T.zero((10, 2, 4)), T.zero((3,), "int64"), T.zero((3, 2, 4)))).signature()
    'rows r1 r2, t, t r1 r2 -> rows r1 r2'
    """

    kind = "put_rows"

    def infer(self) -> TensorType:
        x, ids, values = self.input_types
        if x.rank < 1:
            raise GraphError(f"put_rows writes rows of a tensor of rank 1 or more; got a scalar {x}.")
        if ids.dtype not in ("int32", "int64") or ids.rank != 1:
            raise GraphError(f"put_rows takes ids as an int32 or int64 vector; got {ids}.  Flatten them first.")
        if values.shape != (ids.shape[0], *x.shape[1:]) or values.dtype != x.dtype:
            raise GraphError(f"put_rows needs values of shape [len(ids), *x.shape[1:]] = "
                             f"{(ids.shape[0], *x.shape[1:])} in x's dtype {x.dtype}; got {values}.")
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"put_rows writes floating tensors; got dtype {x.dtype}.")
        return TensorType.zero(x.shape, x.dtype, self.dims_out())  # type: ignore[arg-type]

    def _rest(self) -> tuple[str, ...]:
        return tuple(f"r{i}" for i in range(1, self.input_types[0].rank))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (("rows", *self._rest()), ("t",), ("t", *self._rest()))

    def dims_out(self) -> tuple[str | None, ...]:
        return ("rows", *self._rest())

    def unshardable(self) -> frozenset[str]:
        return frozenset({"t"})  # a block of ids would write its rows and keep x's elsewhere: not a ⊕

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(inputs[2].volume)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, ids, values = blocks
        check_ids(ids, self.input_types[0].shape[0], "put_rows ids (rows of x)")
        r0, r1 = f.output.lower[0], f.output.upper[0]
        out = np.array(x, dtype=numpy_dtype(self.output_type.dtype), copy=True)
        mine = (ids >= r0) & (ids < r1)
        out[ids[mine] - r0] = values[mine]  # NumPy assigns in order: the last of equal ids stays
        return out

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        _, ids, values = inputs
        dx = None
        if wanted[0]:
            dx = build(b, "put_rows", (cotangent, ids, build(b, "unary", (values,), op="fill", arg=0.0)))
        dvalues = None
        if wanted[2]:
            rest = cotangent.type.shape[1:]
            table = build(b, "reshape", (cotangent,), shape=(cotangent.type.shape[0], math.prod(rest)))
            dvalues = build(b, "reshape", (build(b, "embedding", (table, ids)),), shape=(ids.type.shape[0], *rest))
        return dx, None, dvalues

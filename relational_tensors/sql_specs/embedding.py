"""Embedding lookup: ``out[..., e] = table[ids[...], e]``.

The token indices and the embedding width split anywhere.  The vocabulary
splits too (vocabulary-parallel embedding): each block returns the rows of the
ids it holds and zeros elsewhere, and ⊕ = sum puts them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.sql_specs.base import IndexedOp, register

__all__ = ["EmbeddingOp"]


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

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        table, ids = blocks
        vocab = self.input_types[0].shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ExecError(
                f"embedding ids must lie in [0, {vocab}); got values from {int(ids.min())} to {int(ids.max())}."
            )
        v0, v1 = f.inputs[0].lower[0], f.inputs[0].upper[0]
        mine = (ids >= v0) & (ids < v1)
        rows = table[np.clip(ids - v0, 0, max(v1 - v0 - 1, 0))]
        out = np.where(mine[..., None], rows, np.zeros((), dtype=table.dtype))
        return out.astype(numpy_dtype(self.output_type.dtype), copy=False)

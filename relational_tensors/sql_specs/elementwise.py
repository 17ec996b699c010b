"""Elementwise operators: ``unary``, ``binary`` (broadcasting add/sub/mul/div/...) and ``swiglu``.

Every index can be split anywhere and nothing is aggregated: a block of the
output needs the same block of each input (a broadcast dimension is read whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, canonical_dtype, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import IndexedOp, SameIndicesOp, register
from relational_tensors.sql_specs.common import finite_number, same_dtype

__all__ = ["UnaryOp", "BinaryOp", "SwigluOp", "UNARY_FUNCTIONS", "BINARY_FUNCTIONS", "silu", "gelu"]

# an object array for an array of rank >= 1 (a 0-d array or a scalar gives a bare float)
_erf: Callable[[np.ndarray], np.ndarray] = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x·Φ(x), with the error function."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


# name -> f(x, arg); ``arg`` is the scalar of unary(x, op, arg)
UNARY_FUNCTIONS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "relu": lambda x, a: np.maximum(x, 0),
    "gelu": lambda x, a: gelu(x),
    "gelu_tanh": lambda x, a: _gelu_tanh(x),
    "silu": lambda x, a: silu(x),
    "sigmoid": lambda x, a: 1.0 / (1.0 + np.exp(-x)),
    "tanh": lambda x, a: np.tanh(x),
    "exp": lambda x, a: np.exp(x),
    "log": lambda x, a: np.log(x),
    "neg": lambda x, a: -x,
    "abs": lambda x, a: np.abs(x),
    "sqrt": lambda x, a: np.sqrt(x),
    "rsqrt": lambda x, a: 1.0 / np.sqrt(x),
    "square": lambda x, a: x * x,
    "scale": lambda x, a: x * a,
    "add_scalar": lambda x, a: x + a,
    "pow": lambda x, a: x**a,
    "cast": lambda x, a: x,
}

BINARY_FUNCTIONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
}


@register
@dataclass(frozen=True, eq=True)
class UnaryOp(SameIndicesOp):
    """``f(x)`` elementwise, for f in UNARY_FUNCTIONS (``cast`` takes the target dtype as its arg).

    >>> from relational_tensors.core.types import TensorType as T
    >>> UnaryOp((T.zero((2, 3)),), "scale", 0.5).signature()
    'd0 d1 -> d0 d1'
    """

    kind = "unary"
    op: str = "relu"
    arg: float | str = 0.0

    def infer(self) -> TensorType:
        (x,) = self.input_types
        if self.op not in UNARY_FUNCTIONS:
            raise GraphError(f"unknown unary op {self.op!r}; supported: {sorted(UNARY_FUNCTIONS)}.")
        if self.op == "cast":
            return x.with_(dtype=canonical_dtype(self.arg))
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"unary {self.op!r} needs a floating tensor; got dtype {x.dtype}. Cast it first.")
        if not isinstance(self.arg, (int, float)):
            raise GraphError(f"unary {self.op!r} takes a number as arg; got {self.arg!r}.")
        finite_number(f"the arg of unary {self.op!r}", self.arg)
        return x

    def params(self) -> dict[str, object]:
        return {"op": self.op, "arg": self.arg}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        (x,) = blocks
        if self.op == "cast":
            return np.asarray(x).astype(numpy_dtype(self.output_type.dtype))
        return self._result(UNARY_FUNCTIONS[self.op](self._compute(x), float(self.arg)))  # type: ignore[arg-type]


def broadcast_dims(kind: str, types: Sequence[TensorType]
                   ) -> tuple[tuple[int, ...], tuple[tuple[str | None, ...], ...], tuple[str, ...]]:
    """NumPy broadcasting of ``types``: the output shape, each input's index per dimension, the output names."""
    rank = max(t.rank for t in types)
    shape = []
    for d in range(rank):
        sizes = {t.shape[d - rank + t.rank] for t in types if d - rank + t.rank >= 0}
        big = sizes - {1}
        if len(big) > 1:
            raise GraphError(
                f"{kind} broadcasts like NumPy: sizes must match or be 1 in each dimension; got shapes "
                f"{[t.shape for t in types]} (dimension {d - rank} has sizes {sorted(sizes)})."
            )
        shape.append(big.pop() if big else 1)
    widest = next(t for t in types if t.rank == rank)
    names = widest.names
    dims = []
    for t in types:
        off = rank - t.rank
        dims.append(tuple(names[off + d] if t.shape[d] == shape[off + d] else None for d in range(t.rank)))
    return tuple(shape), tuple(dims), names


@register
@dataclass(frozen=True, eq=True)
class BinaryOp(IndexedOp):
    """``x op y`` elementwise with NumPy broadcasting (add, sub, mul, div, maximum, minimum).

    >>> from relational_tensors.core.types import TensorType as T
    >>> BinaryOp((T.zero((4, 3)), T.zero((3,))), "add").signature()
    'd0 d1, d1 -> d0 d1'
    """

    kind = "binary"
    op: str = "add"

    def infer(self) -> TensorType:
        if self.op not in BINARY_FUNCTIONS:
            raise GraphError(f"unknown binary op {self.op!r}; supported: {sorted(BINARY_FUNCTIONS)}.")
        dtype = same_dtype(self.op, self.input_types)
        if self.op == "div" and dtype not in FLOAT_DTYPES:
            raise GraphError(f"div needs floating tensors (integer division would truncate); got dtype {dtype}. "
                             "Cast the operands to a float dtype first.")
        shape, _, names = broadcast_dims(self.op, self.input_types)
        return TensorType.zero(shape, dtype, names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return broadcast_dims(self.op, self.input_types)[1]

    def dims_out(self) -> tuple[str | None, ...]:
        return self.output_type.names

    def params(self) -> dict[str, object]:
        return {"op": self.op}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, y = (self._compute(b) for b in blocks)
        return self._result(BINARY_FUNCTIONS[self.op](x, y))


@register
@dataclass(frozen=True, eq=True)
class SwigluOp(IndexedOp):
    """``silu(a) * b`` for a and b of one shape: the gate of a SwiGLU FFN in one pass.

    >>> from relational_tensors.core.types import TensorType as T
    >>> SwigluOp((T.zero((4, 8)), T.zero((4, 8)))).output_type.shape
    (4, 8)
    """

    kind = "swiglu"

    def infer(self) -> TensorType:
        a, b = self.input_types
        if a.shape != b.shape:
            raise GraphError(f"swiglu needs a and b of one shape; got {a.shape} and {b.shape}.")
        if same_dtype(self.kind, self.input_types) not in FLOAT_DTYPES:
            raise GraphError(f"swiglu needs floating tensors; got dtype {a.dtype}. Cast them first.")
        return a

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        names = self.input_types[0].names
        return (names, names)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        a, b = (self._compute(x) for x in blocks)
        return self._result(silu(a) * b)

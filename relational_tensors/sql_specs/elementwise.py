"""Elementwise operators: ``unary``, ``binary`` (broadcasting add/sub/mul/div/..., comparisons and
boolean logic), ``where`` and ``swiglu``, and their gradient operators ``unary_grad``, ``binary_grad``
and ``swiglu_grad``.

Every index can be split anywhere and nothing is aggregated: a block of the
output needs the same block of each input (a broadcast dimension is read whole).
A gradient of a broadcast operand is the gradient of the result summed over the
dimensions it was broadcast along.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, canonical_dtype, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, SameIndicesOp, register
from relational_tensors.sql_specs.common import finite_number, same_dtype
from relational_tensors.sql_specs.grad import SECOND_ORDER, build, reduce_to

__all__ = ["FullOp", "UnaryOp", "BinaryOp", "WhereOp", "SwigluOp", "UnaryGradOp", "BinaryGradOp", "SwigluGradOp",
           "UNARY_FUNCTIONS",
           "BINARY_FUNCTIONS", "COMPARISONS", "LOGICAL", "UNARY_DERIVATIVES", "silu", "gelu"]

# an object array for an array of rank >= 1 (a 0-d array or a scalar gives a bare float)
_erf: Callable[[np.ndarray], np.ndarray] = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x·Φ(x), with the error function."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _dgelu(x: np.ndarray) -> np.ndarray:
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))
    return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _dgelu_tanh(x: np.ndarray) -> np.ndarray:
    c = math.sqrt(2.0 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)


def _dsilu(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


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
    "fill": lambda x, a: np.full_like(x, a),  # the constant ``arg`` in x's shape (a gradient's seed)
    "logical_not": lambda x, a: np.logical_not(x),  # booleans only
    "log1p": lambda x, a: np.log1p(x),
    "expm1": lambda x, a: np.expm1(x),
    "erf": lambda x, a: np.asarray(_erf(x), dtype=x.dtype),
    "sin": lambda x, a: np.sin(x),
    "cos": lambda x, a: np.cos(x),
    "detach": lambda x, a: x,  # the identity, through which no gradient flows (torch's detach)
    "floor": lambda x, a: np.floor(x),  # its gradient is zero (torch's), built in UnaryOp.vjp
}

# name -> f'(x, arg), for the functions whose gradient is dy·f'(x) (the others are built in UnaryOp.vjp);
# where f is not differentiable the derivative takes torch's value: relu'(0) = abs'(0) = 0
UNARY_DERIVATIVES: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "relu": lambda x, a: (x > 0).astype(x.dtype),
    "gelu": lambda x, a: _dgelu(x),
    "gelu_tanh": lambda x, a: _dgelu_tanh(x),
    "silu": lambda x, a: _dsilu(x),
    "sigmoid": lambda x, a: _sigmoid(x) * (1.0 - _sigmoid(x)),
    "tanh": lambda x, a: 1.0 - np.tanh(x) ** 2,
    "exp": lambda x, a: np.exp(x),
    "log": lambda x, a: 1.0 / x,
    "abs": lambda x, a: np.sign(x),
    "sqrt": lambda x, a: 0.5 / np.sqrt(x),
    "rsqrt": lambda x, a: -0.5 / (x * np.sqrt(x)),
    "square": lambda x, a: 2.0 * x,
    "pow": lambda x, a: a * x ** (a - 1.0),
    "log1p": lambda x, a: 1.0 / (1.0 + x),
    "expm1": lambda x, a: np.exp(x),
    "erf": lambda x, a: np.exp(-x * x) * (2.0 / math.sqrt(math.pi)),
    "sin": lambda x, a: np.cos(x),
    "cos": lambda x, a: -np.sin(x),
}

BINARY_FUNCTIONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    # 1 where equal or both NaN, else 0 (no gradient): a max or min's winners, NaN included (torch gives a NaN
    # maximum's gradient to the NaN entries)
    "eq": lambda x, y: ((x == y) | (np.isnan(x) & np.isnan(y))).astype(np.result_type(x, y)),
}
# comparisons of two tensors of one dtype, and the logic of two booleans: a boolean result, no gradient
COMPARISONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "equal": np.equal, "not_equal": np.not_equal, "less": np.less, "less_equal": np.less_equal,
    "greater": np.greater, "greater_equal": np.greater_equal,
}
LOGICAL: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
}
BINARY_FUNCTIONS.update(COMPARISONS)
BINARY_FUNCTIONS.update(LOGICAL)


@register
@dataclass(frozen=True, eq=True)
class FullOp(IndexedOp):
    """A tensor of ``shape`` and ``dtype`` filled with ``value``, read from nothing: the seed of a gradient,
    which then waits for no other operator (a fill of the loss would wait for the whole forward pass).

    >>> FullOp((), (2, 3), 1.0).signature()
    ' -> d0 d1'
    """

    kind = "full"
    gradient = "it has no inputs"
    shape: tuple[int, ...] = ()
    value: float = 0.0
    dtype: str = "float32"
    names: tuple[str, ...] | None = None

    def infer(self) -> TensorType:
        if self.input_types:
            raise GraphError(f"full takes no inputs; got {len(self.input_types)}.")
        dtype = canonical_dtype(self.dtype)
        if dtype not in FLOAT_DTYPES:
            raise GraphError(f"full makes a floating tensor; got dtype {self.dtype!r}.")
        finite_number("the value of full", self.value)
        return TensorType.zero(self.shape, dtype, self.names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return ()

    def dims_out(self) -> tuple[str | None, ...]:
        return tuple(f"d{i}" for i in range(len(self.shape)))

    def params(self) -> dict[str, object]:
        return {"shape": tuple(self.shape), "value": self.value, "dtype": self.dtype, "names": self.names}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        return np.full(f.output.shape, self.value, dtype=numpy_dtype(self.output_type.dtype))


@register
@dataclass(frozen=True, eq=True)
class UnaryOp(SameIndicesOp):
    """``f(x)`` elementwise, for f in UNARY_FUNCTIONS (``cast`` takes the target dtype as its arg).

    >>> from relational_tensors.core.types import TensorType as T
    >>> UnaryOp((T.zero((2, 3)),), "scale", 0.5).signature()
    'd0 d1 -> d0 d1'
    """

    kind = "unary"
    accepts_bool = True  # cast and logical_not; the rest refuse them below
    op: str = "relu"
    arg: float | str = 0.0

    def infer(self) -> TensorType:
        (x,) = self.input_types
        if self.op not in UNARY_FUNCTIONS:
            raise GraphError(f"unknown unary op {self.op!r}; supported: {sorted(UNARY_FUNCTIONS)}.")
        if self.op == "cast":
            return x.with_(dtype=canonical_dtype(self.arg))
        if self.op == "logical_not":
            if x.dtype != "bool":
                raise GraphError(f"unary 'logical_not' needs a boolean tensor; got dtype {x.dtype}. Compare it "
                                 "first (e.g. g.binary(x, zero, 'not_equal')).")
            return x
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
        if self.op == "logical_not":
            return np.logical_not(x)
        return self._result(UNARY_FUNCTIONS[self.op](self._compute(x), float(self.arg)))  # type: ignore[arg-type]

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any, wanted: tuple[bool, ...]) -> Grads:
        (x,) = inputs
        if self.op in ("fill", "logical_not", "detach") or "bool" in (x.type.dtype, self.output_type.dtype):
            return (None,)  # a boolean carries no gradient, and a detached value none by definition
        if self.op == "cast":
            return (build(b, "unary", (cotangent,), op="cast", arg=x.type.dtype),)
        if self.op == "add_scalar":
            return (cotangent,)
        if self.op == "floor":
            return (build(b, "unary", (cotangent,), op="fill", arg=0.0),)
        if self.op in ("neg", "scale"):
            return (build(b, "unary", (cotangent,), op=self.op, arg=self.arg),)
        return (build(b, "unary_grad", (x, cotangent), op=self.op, arg=self.arg),)


@register
@dataclass(frozen=True, eq=True)
class UnaryGradOp(SameIndicesOp):
    """``dy · f'(x)`` elementwise: the gradient of ``unary(x, op, arg)``.

    >>> from relational_tensors.core.types import TensorType as T
    >>> UnaryGradOp((T.zero((2, 3)), T.zero((2, 3))), "silu").signature()
    'd0 d1, d0 d1 -> d0 d1'
    """

    kind = "unary_grad"
    gradient = SECOND_ORDER
    op: str = "relu"
    arg: float = 0.0

    def infer(self) -> TensorType:
        x, dy = self.input_types
        if self.op not in UNARY_DERIVATIVES:
            raise GraphError(f"unary_grad takes one of {sorted(UNARY_DERIVATIVES)}; got {self.op!r}.")
        if x.shape != dy.shape or same_dtype(self.kind, self.input_types) not in FLOAT_DTYPES:
            raise GraphError(f"unary_grad needs x and dy of one shape and float dtype; got {x} and {dy}.")
        return x

    def params(self) -> dict[str, object]:
        return {"op": self.op, "arg": self.arg}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 4.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, dy = (self._compute(a) for a in blocks)
        return self._result(dy * UNARY_DERIVATIVES[self.op](x, float(self.arg)))


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
    """``x op y`` elementwise with NumPy broadcasting (add, sub, mul, div, maximum, minimum), a comparison
    (``COMPARISONS``: a boolean result) or the logic of two booleans (``LOGICAL``).

    >>> from relational_tensors.core.types import TensorType as T
    >>> BinaryOp((T.zero((4, 3)), T.zero((3,))), "add").signature()
    'd0 d1, d1 -> d0 d1'
    """

    kind = "binary"
    accepts_bool = True  # the comparisons and logic; arithmetic refuses booleans below
    op: str = "add"

    def infer(self) -> TensorType:
        if self.op not in BINARY_FUNCTIONS:
            raise GraphError(f"unknown binary op {self.op!r}; supported: {sorted(BINARY_FUNCTIONS)}.")
        dtype = same_dtype(self.op, self.input_types)
        if self.op in LOGICAL and dtype != "bool":
            raise GraphError(f"{self.op} takes boolean tensors; got dtype {dtype}. Compare them first "
                             "(g.binary(x, y, 'not_equal')).")
        if dtype == "bool" and self.op not in LOGICAL and self.op not in ("equal", "not_equal"):
            raise GraphError(f"binary {self.op!r} does not take boolean tensors; got dtype bool. Use "
                             f"{sorted(LOGICAL)}, or cast them (g.cast(x, 'float32')).")
        if self.op in COMPARISONS or self.op in LOGICAL:
            dtype = "bool"
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
        if self.output_type.dtype == "bool":  # compared in the inputs' own dtype (bfloat16 included)
            return BINARY_FUNCTIONS[self.op](*(np.asarray(b) for b in blocks))
        x, y = (self._compute(b) for b in blocks)
        return self._result(BINARY_FUNCTIONS[self.op](x, y))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any, wanted: tuple[bool, ...]) -> Grads:
        x, y = inputs
        if self.op == "eq" or self.output_type.dtype == "bool":
            return (None, None)
        grads: list[Any] = []
        for k, (t, other) in enumerate(((x, y), (y, x))):
            if not wanted[k]:
                grads.append(None)
                continue
            if self.op == "add" or (self.op == "sub" and k == 0):
                g = cotangent
            elif self.op == "sub":
                g = build(b, "unary", (cotangent,), op="neg")
            elif self.op == "mul":
                g = build(b, "binary", (cotangent, other), op="mul")
            elif self.op == "div" and k == 0:
                g = build(b, "binary", (cotangent, y), op="div")
            else:  # d(x/y)/dy, maximum, minimum
                g = build(b, "binary_grad", (x, y, cotangent), op=self.op, wrt=k)
            grads.append(reduce_to(b, g, t.type))
        return tuple(grads)


@register
@dataclass(frozen=True, eq=True)
class BinaryGradOp(IndexedOp):
    """The gradient of ``binary(x, y, op)`` with respect to operand ``wrt`` before the sum over its broadcast
    dimensions: ``dy · ∂(x op y)/∂x_wrt`` in the shape of the result.  At ties of maximum and minimum the
    gradient is split evenly between the operands (torch's rule).

    >>> from relational_tensors.core.types import TensorType as T
    >>> BinaryGradOp((T.zero((4, 3)), T.zero((3,)), T.zero((4, 3))), "div", 1).signature()
    'd0 d1, d1, d0 d1 -> d0 d1'
    """

    kind = "binary_grad"
    gradient = SECOND_ORDER
    op: str = "div"
    wrt: int = 1

    def infer(self) -> TensorType:
        if self.op not in ("mul", "div", "maximum", "minimum") or self.wrt not in (0, 1):
            raise GraphError(f"binary_grad takes op mul, div, maximum or minimum and wrt 0 or 1; got {self.op!r}, "
                             f"wrt={self.wrt!r}.")
        dtype = same_dtype(self.kind, self.input_types)
        shape, _, names = broadcast_dims(self.kind, self.input_types)
        if shape != self.input_types[2].shape:
            raise GraphError(f"binary_grad needs dy in the broadcast shape {shape}; got {self.input_types[2].shape}.")
        return TensorType.zero(shape, dtype, names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return broadcast_dims(self.kind, self.input_types)[1]

    def dims_out(self) -> tuple[str | None, ...]:
        return self.output_type.names

    def params(self) -> dict[str, object]:
        return {"op": self.op, "wrt": self.wrt}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, y, dy = (self._compute(a) for a in blocks)
        if self.op == "mul":
            d = y if self.wrt == 0 else x
        elif self.op == "div":
            d = 1.0 / y if self.wrt == 0 else -x / (y * y)
        else:
            mine, other = (x, y) if self.wrt == 0 else (y, x)
            wins = mine > other if self.op == "maximum" else mine < other
            d = np.where(wins, 1.0, np.where(mine == other, 0.5, 0.0)).astype(x.dtype)
        return self._result(np.broadcast_to(dy * d, dy.shape))


@register
@dataclass(frozen=True, eq=True)
class WhereOp(IndexedOp):
    """``where(cond, x, y)``: x where the boolean cond holds, else y, with NumPy broadcasting of all three
    (``masked_fill`` is a where with a scalar).  Its gradient flows to x where cond holds and to y elsewhere.

    >>> from relational_tensors.core.types import TensorType as T
    >>> WhereOp((T.zero((4, 1), "bool"), T.zero((4, 3)), T.zero((3,)))).signature()
    'd0 1, d0 d1, d1 -> d0 d1'
    """

    kind = "where"
    accepts_bool = True

    def infer(self) -> TensorType:
        if len(self.input_types) != 3:
            raise GraphError(f"where takes cond, x and y; got {len(self.input_types)} tensors.")
        cond, x, y = self.input_types
        if cond.dtype != "bool":
            raise GraphError(f"where needs a boolean condition; got dtype {cond.dtype} of shape {cond.shape}. "
                             "Compare it first (g.binary(c, zero, 'not_equal')).")
        dtype = same_dtype(self.kind, (x, y))
        shape, _, names = broadcast_dims(self.kind, self.input_types)
        return TensorType.zero(shape, dtype, names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return broadcast_dims(self.kind, self.input_types)[1]

    def dims_out(self) -> tuple[str | None, ...]:
        return self.output_type.names

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        cond, x, y = (np.asarray(b) for b in blocks)
        return self._result(np.where(cond, x, y))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any, wanted: tuple[bool, ...]) -> Grads:
        cond, x, y = inputs
        zero = build(b, "unary", (cotangent,), op="fill", arg=0.0)
        grads: list[Any] = [None]
        for k, t in ((1, x), (2, y)):
            if not wanted[k]:
                grads.append(None)
                continue
            g = build(b, "where", (cond, cotangent, zero) if k == 1 else (cond, zero, cotangent))
            grads.append(reduce_to(b, g, t.type))
        return tuple(grads)


@register
@dataclass(frozen=True, eq=True)
class SwigluOp(SameIndicesOp):
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

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        a, b = (self._compute(x) for x in blocks)
        return self._result(silu(a) * b)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any, wanted: tuple[bool, ...]) -> Grads:
        return tuple(build(b, "swiglu_grad", (*inputs, cotangent), wrt=k) if w else None
                     for k, w in enumerate(wanted))


@register
@dataclass(frozen=True, eq=True)
class SwigluGradOp(SameIndicesOp):
    """The gradient of ``swiglu(a, b)`` with respect to a (``wrt=0``: dy·b·silu'(a)) or b (dy·silu(a)).

    >>> from relational_tensors.core.types import TensorType as T
    >>> SwigluGradOp((T.zero((4, 8)),) * 3, 1).output_type.shape
    (4, 8)
    """

    kind = "swiglu_grad"
    gradient = SECOND_ORDER
    wrt: int = 0

    def infer(self) -> TensorType:
        a, b, dy = self.input_types
        if not a.shape == b.shape == dy.shape or self.wrt not in (0, 1):
            raise GraphError(f"swiglu_grad needs a, b and dy of one shape and wrt 0 or 1; got {a.shape}, {b.shape}, "
                             f"{dy.shape}, wrt={self.wrt!r}.")
        same_dtype(self.kind, self.input_types)
        return a

    def params(self) -> dict[str, object]:
        return {"wrt": self.wrt}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        a, b, dy = (self._compute(x) for x in blocks)
        return self._result(dy * b * _dsilu(a) if self.wrt == 0 else dy * silu(a))

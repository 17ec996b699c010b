"""What every abstract operator provides, and the registry of operators.

An operator *describes*: its named indices, which of them are shardable, its ⊕,
the join-agg spec for any interval request, its FLOPs, and a NumPy concrete
kernel that runs on sub-boxes.  It never moves data and never searches; that is
the optimizer's and the exchange's job.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from relational_tensors.core.aggregation import SUM, Aggregation
from relational_tensors.core.dtypes import compute_dtype, numpy_dtype
from relational_tensors.core.spec import FunctionSpec, IntervalRequest, JoinAggSpec, ShardableIndex
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import GraphError, SpecError

__all__ = ["Operator", "IndexedOp", "SameIndicesOp", "OPERATORS", "register", "Choice", "Handle", "Builder",
           "Grads"]

Choice = Mapping[str, Interval]  # the interval of each requested index in one function spec

OPERATORS: dict[str, type[Operator]] = {}

# the dtype ``Operator._result`` writes while a partial kernel runs (None: the output's dtype)
_RESULT_DTYPE: ContextVar[str | None] = ContextVar("result_dtype", default=None)


class Handle(Protocol):
    """A tensor of the graph a gradient is built in (``graph.graph.Tensor``)."""

    id: int  # the node that makes it

    @property
    def type(self) -> TensorType: ...


class Builder(Protocol):
    """The graph a gradient is appended to: ``apply`` appends one operator applied to earlier tensors;
    ``producer`` says which operator (None for a graph input) made a tensor, from which tensors."""

    def apply(self, op: Operator, *operands: Any, name: str | None = None) -> Any: ...

    def producer(self, t: Any) -> tuple[Operator | None, tuple[Any, ...]]: ...


Grads = tuple[Any, ...]  # per input: its gradient (a Handle), or None where none flows or none is wanted


def register(cls: type[Operator]) -> type[Operator]:
    """Class decorator: list an operator kind in ``OPERATORS``."""
    old = OPERATORS.get(cls.kind)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"operator kind {cls.kind!r} registered twice")
    OPERATORS[cls.kind] = cls
    return cls


@dataclass(frozen=True, eq=True)
class Operator:
    """An abstract operator over zero-bounded tensors, with one output.

    Subclasses are frozen dataclasses: their fields are the input types and the
    operator's parameters; ``infer`` validates them (raising GraphError) and
    returns the output type.
    """

    kind: ClassVar[str] = "?"
    aggregation: ClassVar[Aggregation] = SUM
    # how the kernel model prices its kernels: "matmul", "attention" or "compute" (the roofline's
    # compute rate, or memory traffic when that is slower); see machine.kernel_model
    cost_family: ClassVar[str] = "compute"
    # it takes boolean tensors (masks): layout operators, comparisons and logic, where, attention's masks;
    # every other kind refuses them by rule (a sum of booleans or a matmul of them says cast first)
    accepts_bool: ClassVar[bool] = False

    input_types: tuple[TensorType, ...]
    output_type: TensorType = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not self.accepts_bool:
            for k, t in enumerate(self.input_types):
                if t.dtype == "bool":
                    raise GraphError(
                        f"{self.kind} does not take boolean tensors; input {k} is bool of shape {t.shape}. "
                        "Cast it first (g.cast(x, 'float32') or 'int64'), or use where/the comparisons.")
        object.__setattr__(self, "output_type", self.infer())

    # --- description -------------------------------------------------------
    def infer(self) -> TensorType:
        raise NotImplementedError

    def shardable(self) -> tuple[ShardableIndex, ...]:
        """Shardable indices in declared order (inherited ones included, never requested)."""
        raise NotImplementedError

    def requestable(self) -> tuple[ShardableIndex, ...]:
        return tuple(s for s in self.shardable() if s.requestable)

    def signature(self) -> str:
        """A one-line, einsum-like picture of the operator's indices."""
        return self.kind

    def params(self) -> dict[str, Any]:
        return {}

    def interval_candidates(self, index: ShardableIndex, n: int) -> list[tuple[Interval, ...]]:
        """The interval lists offered for ``n`` intervals of ``index`` (near-equal by default)."""
        iv = index.near_equal(n)
        return [iv] if iv is not None else []

    # --- decomposition -----------------------------------------------------
    def input_box(self, k: int, choice: Choice) -> Box:
        raise NotImplementedError

    def output_box(self, choice: Choice) -> Box:
        raise NotImplementedError

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(output.volume)

    def kernel_bytes(self, input_bytes: Sequence[float], output_bytes: float) -> float:
        """The bytes a kernel of this operator moves, given its input blocks' and output block's sizes: every
        byte of each by default (what the kernel model prices); an operator reading only part of an input
        (a lookup's rows) says so."""
        return float(sum(input_bytes)) + output_bytes

    def box_maker(self) -> Callable[[Choice], tuple[tuple[Box, ...], Box]]:
        """(input blocks, output block) of a choice: ``input_box`` and ``output_box``, or a faster
        equivalent that works out once what every function spec of one ``spec`` call shares."""
        n = len(self.input_types)
        return lambda choice: (tuple(self.input_box(k, choice) for k in range(n)), self.output_box(choice))

    def spec(self, request: IntervalRequest | None = None) -> JoinAggSpec:
        """The join-agg spec for ``request`` (index name -> intervals); absent indices stay whole."""
        request = dict(request or {})
        idx = self.requestable()
        known = {s.name for s in idx}
        unknown = sorted(set(request) - known)
        if unknown:
            raise SpecError(
                f"{self.kind} can be split only on {sorted(known) or 'no index'}; got a request for {unknown}."
            )
        lists = [s.check(request[s.name]) if s.name in request else (Interval(0, s.extent),) for s in idx]
        functions = []
        boxes = self.box_maker()
        for coords in itertools.product(*(range(len(ivs)) for ivs in lists)):
            choice = {s.name: ivs[c] for s, ivs, c in zip(idx, lists, coords)}
            ins, out = boxes(choice)
            functions.append(FunctionSpec(ins, out, coords, self.flops(ins, out)))
        split = tuple((s.name, len(ivs)) for s, ivs in zip(idx, lists))
        return JoinAggSpec(self.input_types, self.output_type, tuple(functions), self.aggregation, split)

    # --- gradient ------------------------------------------------------------
    # "yes": ``vjp`` builds the gradient; otherwise why there is none (the registry prints it)
    gradient: ClassVar[str] = "yes"

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        """Append to ``b`` the operators that compute, for each input ``k`` with ``wanted[k]``, the gradient
        of a scalar loss with respect to that input from ``cotangent``, its gradient with respect to the
        output (a tensor of the output's type).  Returns one tensor or None per input."""
        raise GraphError(f"{self.kind} has no gradient: {self.gradient}.")

    # --- concrete kernel ---------------------------------------------------
    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> Any:
        """Run on the projected input blocks of ``f``; return the (partial) output block."""
        raise NotImplementedError

    # helpers for kernels
    # a sum of products (einsum, SQL join, convolution): its bfloat16 NumPy kernel computes in float64
    contraction: ClassVar[bool] = False

    def _compute(self, a: np.ndarray) -> np.ndarray:
        return a.astype(self._compute_dtype(), copy=False)

    def _compute_dtype(self) -> np.dtype:
        """The dtype this kernel computes in: the output's compute dtype, or the partial dtype while a
        partial kernel runs when that is wider (a bfloat16 partial is computed in float64: float32 has
        bfloat16's range, so a partial sum would overflow where the whole one might not).  A bfloat16
        contraction computes in float64 whole too: in float32 a sum of products near bfloat16's max
        overflows or not, to +inf, -inf or NaN, by BLAS's order of summation, which changes with the
        block's shape; in float64 no sum of products of two or three bfloat16 values overflows."""
        dt = compute_dtype(self.output_type.dtype)
        if self.contraction and self.output_type.dtype == "bfloat16":
            return np.dtype(np.float64)
        wide = _RESULT_DTYPE.get()
        if wide is not None and numpy_dtype(wide).kind == "f" and numpy_dtype(wide).itemsize > dt.itemsize:
            return numpy_dtype(wide)
        return dt

    def partial_kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec, dtype: str) -> Any:
        """``kernel``, with its (partial) output block in ``dtype``, not rounded to the output's dtype (an
        unaggregated partial of a 16-bit operator is kept in float32)."""
        token = _RESULT_DTYPE.set(dtype)
        try:
            return self.kernel(blocks, f)
        finally:
            _RESULT_DTYPE.reset(token)

    def _result(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a).astype(numpy_dtype(_RESULT_DTYPE.get() or self.output_type.dtype), copy=False)


@dataclass(frozen=True, eq=True)
class IndexedOp(Operator):
    """An operator whose every dimension is one named index (or a broadcast unit dimension).

    Subclasses give ``dims_in()`` and ``dims_out()`` (one index name per
    dimension, None for a broadcast size-1 dimension) and ``unshardable()``;
    boxes follow from the chosen intervals.  Indices that are not in the output
    are aggregated with ⊕.
    """

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        raise NotImplementedError

    def dims_out(self) -> tuple[str | None, ...]:
        raise NotImplementedError

    def unshardable(self) -> frozenset[str]:
        return frozenset()

    def extents(self) -> dict[str, int]:
        ext: dict[str, int] = {}
        types = (*self.input_types, self.output_type)
        for dims, t in zip((*self.dims_in(), self.dims_out()), types):
            for name, size in zip(dims, t.shape):
                if name is not None:
                    ext.setdefault(name, size)
        return ext

    def index_order(self) -> tuple[str, ...]:
        """Every index in order of first appearance, inputs first (``i j k`` for a matmul)."""
        seen: dict[str, None] = {}
        for name in (*(n for dims in self.dims_in() for n in dims), *self.dims_out()):
            if name is not None:
                seen.setdefault(name)
        return tuple(seen)

    def shardable(self) -> tuple[ShardableIndex, ...]:
        ext = self.extents()
        skip = self.unshardable()
        return tuple(ShardableIndex(n, ext[n]) for n in self.index_order() if n not in skip)

    def signature(self) -> str:
        def fmt(dims: Sequence[str | None]) -> str:
            return " ".join(n if n is not None else "1" for n in dims)
        return ", ".join(fmt(d) for d in self.dims_in()) + " -> " + fmt(self.dims_out())

    @staticmethod
    def _box(dims: Sequence[str | None], shape: Sequence[int], choice: Choice) -> Box:
        """The block of a tensor with indices ``dims`` and ``shape``: the chosen interval of each index, whole
        along the others (and along broadcast dimensions, ``None``)."""
        lower, upper = [], []
        for name, size in zip(dims, shape):
            iv = choice.get(name) if name is not None else None
            lower.append(0 if iv is None else iv.lo)
            upper.append(size if iv is None else iv.hi)
        return Box._made(tuple(lower), tuple(upper))

    def input_box(self, k: int, choice: Choice) -> Box:
        return self._box(self.dims_in()[k], self.input_types[k].shape, choice)

    def box_maker(self) -> Callable[[Choice], tuple[tuple[Box, ...], Box]]:
        if type(self).input_box is not IndexedOp.input_box or type(self).output_box is not IndexedOp.output_box:
            return super().box_maker()  # a subclass with boxes of its own
        # the indices and shapes of every input and the output, worked out once for the whole spec
        ins = tuple(zip(self.dims_in(), (t.shape for t in self.input_types)))
        out = (self.dims_out(), self.output_type.shape)
        box = IndexedOp._box
        return lambda choice: (tuple(box(d, s, choice) for d, s in ins), box(*out, choice))

    def output_box(self, choice: Choice) -> Box:
        return self._box(self.dims_out(), self.output_type.shape, choice)

    def index_sizes(self, inputs: tuple[Box, ...], output: Box) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for dims, box in zip((*self.dims_in(), self.dims_out()), (*inputs, output)):
            for name, size in zip(dims, box.shape):
                if name is not None:
                    sizes[name] = size
        return sizes

    def iteration_volume(self, inputs: tuple[Box, ...], output: Box) -> int:
        return math.prod(self.index_sizes(inputs, output).values())


@dataclass(frozen=True, eq=True)
class SameIndicesOp(IndexedOp):
    """Inputs whose indices are all the first input's and the output's, dimension for dimension (unary
    ops, softmax, rope, swiglu, their gradients): subclasses say only which of them cannot be split."""

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (self.input_types[0].names,) * len(self.input_types)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names

"""Data-layout operators: ``reshape``, ``permute``, ``slice``, ``concat``, ``pad`` and ``expand``.

None of them computes; their specs say which input block each output block
is made of, so the optimizer can keep a split through a layout change.  Their
gradients are layout operators too: the inverse reshape or permutation, a slice
padded back with zeros (``pad``), the slices of a concatenation, and the sum of a
repeated (``expand``) tensor over its repeated dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.spec import FunctionSpec, ShardableIndex
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Choice, Grads, IndexedOp, Operator, register
from relational_tensors.sql_specs.common import names_or_default, normalize_axis, same_dtype
from relational_tensors.sql_specs.grad import build, reduce_to

__all__ = ["ReshapeOp", "PermuteOp", "SliceOp", "ConcatOp", "PadOp", "ExpandOp", "reshape_groups"]


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source and destination dimensions with equal products.

    >>> reshape_groups([2, 12], [2, 3, 4])
    [([0], [0]), ([1], [1, 2])]
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi: list[int] = []
        gj: list[int] = []
        pa = pb = 1
        if i < len(src):
            gi.append(i)
            pa *= src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pb *= dst[j]
            j += 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= src[i]
                i += 1
            else:
                gj.append(j)
                pb *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _lead(dims: list[int], shape: Sequence[int]) -> tuple[int | None, int]:
    """The first dimension of size > 1 in a group and the product of the dimensions after it."""
    for n, d in enumerate(dims):
        if shape[d] > 1:
            return d, math.prod(shape[e] for e in dims[n + 1:])
    return None, 1


@register
@dataclass(frozen=True, eq=True)
class ReshapeOp(Operator):
    """Row-major reshape.  Each run of dimensions whose sizes multiply to the same
    product on both sides is one index, split in units that are whole rows on
    both sides (for [b, s, h·d] -> [b, s, h, d] that is one head).

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = ReshapeOp((T.zero((2, 4, 12)),), (2, 4, 3, 4))
    >>> [(s.name, s.extent) for s in op.shardable()]
    [('d0', 2), ('d1', 4), ('d2', 3)]
    """

    kind = "reshape"
    accepts_bool = True
    shape: tuple[int, ...] = ()
    names: tuple[str, ...] | None = None

    def infer(self) -> TensorType:
        (x,) = self.input_types
        if any(not isinstance(s, int) or s <= 0 for s in self.shape) or math.prod(self.shape) != x.volume:
            raise GraphError(
                f"reshape must preserve the number of elements; got {x.shape} ({x.volume} elements) -> "
                f"{self.shape} "
                f"({math.prod(self.shape) if all(isinstance(s, int) for s in self.shape) else '?'} elements)."
            )
        if self.names is not None:
            return TensorType.zero(self.shape, x.dtype, self.names)
        out = [f"d{n}" for n in range(len(self.shape))]
        for gi, gj in reshape_groups(x.shape, self.shape):
            if len(gi) == 1 and len(gj) == 1:
                out[gj[0]] = x.names[gi[0]]
        return TensorType.zero(self.shape, x.dtype, names_or_default(out))

    def _units(self) -> list[tuple[list[int], list[int], str | None, int, int]]:
        """Per group: source dims, destination dims, index name, unit size, extent in units."""
        x, y = self.input_types[0], self.output_type
        res = []
        for gi, gj in reshape_groups(x.shape, y.shape):
            _, r_in = _lead(gi, x.shape)
            lead_out, r_out = _lead(gj, y.shape)
            total = math.prod(y.shape[d] for d in gj)
            unit = math.lcm(r_in, r_out)
            name = y.names[lead_out] if lead_out is not None else None
            res.append((gi, gj, name, unit, total // unit))
        return res

    def shardable(self) -> tuple[ShardableIndex, ...]:
        return tuple(ShardableIndex(name, ext) for _, _, name, _, ext in self._units() if name is not None and ext > 1)

    def signature(self) -> str:
        x = self.input_types[0]
        parts = []
        for gi, gj, _name, _unit, _ext in self._units():
            src = "·".join(x.names[d] for d in gi)
            dst = "·".join(self.output_type.names[d] for d in gj)
            parts.append(f"({src} -> {dst})")
        return " ".join(parts)

    def params(self) -> dict[str, object]:
        return {"shape": self.shape}

    def _box(self, side: int, choice: Choice) -> Box:
        t = self.input_types[0] if side == 0 else self.output_type
        ivs = [Interval(0, s) for s in t.shape]
        for gi, gj, name, unit, _ in self._units():
            if name is None or name not in choice:
                continue
            dims = gi if side == 0 else gj
            lead, rest = _lead(dims, t.shape)
            iv = choice[name]
            assert lead is not None
            ivs[lead] = Interval(iv.lo * unit // rest, iv.hi * unit // rest)
        return Box.from_intervals(ivs)

    def input_box(self, k: int, choice: Choice) -> Box:
        return self._box(0, choice)

    def output_box(self, choice: Choice) -> Box:
        return self._box(1, choice)

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 0.0

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        return np.ascontiguousarray(blocks[0]).reshape(f.output.shape)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        return (build(b, "reshape", (cotangent,), shape=inputs[0].type.shape),)


@register
@dataclass(frozen=True, eq=True)
class PermuteOp(IndexedOp):
    """Reorder dimensions: output dimension n is input dimension ``perm[n]``.

    >>> from relational_tensors.core.types import TensorType as T
    >>> PermuteOp((T.zero((2, 3, 4)),), (2, 0, 1)).output_type.shape
    (4, 2, 3)
    """

    kind = "permute"
    accepts_bool = True
    perm: tuple[int, ...] = ()

    def infer(self) -> TensorType:
        (x,) = self.input_types
        if sorted(self.perm) != list(range(x.rank)):
            raise GraphError(f"permute needs a permutation of 0..{x.rank - 1}; got {self.perm} for shape {x.shape}.")
        return TensorType.zero(tuple(x.shape[d] for d in self.perm), x.dtype, tuple(x.names[d] for d in self.perm))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (self.input_types[0].names,)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.output_type.names

    def params(self) -> dict[str, object]:
        return {"perm": self.perm}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 0.0

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        return np.ascontiguousarray(np.transpose(blocks[0], self.perm))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        inverse = [0] * len(self.perm)
        for n, d in enumerate(self.perm):
            inverse[d] = n
        return (build(b, "permute", (cotangent,), perm=tuple(inverse)),)


@dataclass(frozen=True, eq=True)
class _AlongAxis(Operator):
    """Slice, concat and pad: every output index splits anywhere, and an output block reads, of each
    input, the part of its window on the axis that the block covers."""

    accepts_bool = True

    def shardable(self) -> tuple[ShardableIndex, ...]:
        return tuple(ShardableIndex(n, s) for n, s in zip(self.output_type.names, self.output_type.shape))

    def output_box(self, choice: Choice) -> Box:
        y = self.output_type
        return Box.from_intervals(choice.get(n, Interval(0, s)) for n, s in zip(y.names, y.shape))

    def window(self, choice: Choice, axis: int, lo: int, hi: int) -> Box:
        """The input box of an input that fills output positions [lo, hi) of ``axis`` (empty if the block
        covers none of them)."""
        ivs = list(self.output_box(choice).intervals())
        part = ivs[axis].intersect(Interval(lo, hi))
        ivs[axis] = part.shift(-lo) if part.size else Interval(0, 0)
        return Box.from_intervals(ivs)

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 0.0


@register
@dataclass(frozen=True, eq=True)
class SliceOp(_AlongAxis):
    """``x[..., start:stop, ...]`` along one axis; every index splits anywhere.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = SliceOp((T.zero((4, 10)),), 1, 2, 7)
    >>> str(op.input_box(0, {"d1": op.shardable()[1].near_equal(2)[1]}))
    '[0,4)x[5,7)'
    """

    kind = "slice"
    axis: int = 0
    start: int = 0
    stop: int = 0

    def infer(self) -> TensorType:
        (x,) = self.input_types
        axis = normalize_axis(self.kind, self.axis, x)
        n = x.shape[axis]
        if not (isinstance(self.start, int) and isinstance(self.stop, int) and 0 <= self.start < self.stop <= n):
            raise GraphError(
                f"slice needs 0 <= start < stop <= {n} on axis {axis} of shape {x.shape}; "
                f"got start={self.start}, stop={self.stop}."
            )
        shape = list(x.shape)
        shape[axis] = self.stop - self.start
        return TensorType.zero(shape, x.dtype, x.names)

    def signature(self) -> str:
        axis = normalize_axis(self.kind, self.axis, self.input_types[0])
        names = " ".join(self.output_type.names)
        return f"{names} -> {names} (axis {axis} offset {self.start})"

    def params(self) -> dict[str, object]:
        return {"axis": normalize_axis(self.kind, self.axis, self.input_types[0]), "start": self.start,
                "stop": self.stop}

    def input_box(self, k: int, choice: Choice) -> Box:
        axis = normalize_axis(self.kind, self.axis, self.input_types[0])
        return self.window(choice, axis, -self.start, self.output_type.shape[axis])

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        return np.array(blocks[0], copy=True)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x = inputs[0].type
        axis = normalize_axis(self.kind, self.axis, x)
        return (build(b, "pad", (cotangent,), axis=axis, start=self.start, size=x.shape[axis]),)


@register
@dataclass(frozen=True, eq=True)
class ConcatOp(_AlongAxis):
    """Concatenate along ``axis``; a block of the output reads the parts of each input it overlaps.

    >>> from relational_tensors.core.types import TensorType as T
    >>> ConcatOp((T.zero((2, 3)), T.zero((2, 5))), 1).output_type.shape
    (2, 8)
    """

    kind = "concat"
    axis: int = 0

    def _axis(self) -> int:
        return normalize_axis(self.kind, self.axis, self.input_types[0])

    def infer(self) -> TensorType:
        if not self.input_types:
            raise GraphError("concat needs at least one tensor; got none.")
        first = self.input_types[0]
        axis = self._axis()
        for t in self.input_types[1:]:
            if t.rank != first.rank or any(a != b for d, (a, b) in enumerate(zip(t.shape, first.shape)) if d != axis):
                raise GraphError(
                    f"concat along axis {axis} needs equal shapes off that axis; "
                    f"got {[t.shape for t in self.input_types]}."
                )
        dtype = same_dtype(self.kind, self.input_types)
        shape = list(first.shape)
        shape[axis] = sum(t.shape[axis] for t in self.input_types)
        return TensorType.zero(shape, dtype, first.names)

    def signature(self) -> str:
        names = " ".join(self.output_type.names)
        return ", ".join([names] * len(self.input_types)) + f" -> {names} (axis {self._axis()})"

    def params(self) -> dict[str, object]:
        return {"axis": self._axis()}

    def offsets(self) -> list[int]:
        axis = self._axis()
        return [0, *np.cumsum([t.shape[axis] for t in self.input_types]).tolist()]

    def input_box(self, k: int, choice: Choice) -> Box:
        off = self.offsets()
        return self.window(choice, self._axis(), off[k], off[k + 1])

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        return np.concatenate([b for b in blocks if b.size or b.shape[self._axis()]], axis=self._axis())

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        off = self.offsets()
        return tuple(build(b, "slice", (cotangent,), axis=self._axis(), start=off[k], stop=off[k + 1]) if w else None
                     for k, w in enumerate(wanted))


@register
@dataclass(frozen=True, eq=True)
class PadOp(_AlongAxis):
    """x placed at ``start`` along ``axis`` of a tensor of extent ``size`` there, zeros elsewhere (the
    gradient of a slice); every output index splits anywhere.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = PadOp((T.zero((4, 5)),), 1, 2, 10)
    >>> op.output_type.shape, str(op.input_box(0, {"d1": op.shardable()[1].near_equal(2)[1]}))
    ((4, 10), '[0,4)x[3,5)')
    """

    kind = "pad"
    axis: int = 0
    start: int = 0
    size: int = 0

    def infer(self) -> TensorType:
        (x,) = self.input_types
        axis = normalize_axis(self.kind, self.axis, x)
        n = x.shape[axis]
        if not (isinstance(self.start, int) and isinstance(self.size, int) and 0 <= self.start
                and self.start + n <= self.size):
            raise GraphError(f"pad needs 0 <= start and start + {n} <= size on axis {axis} of shape {x.shape}; "
                             f"got start={self.start!r}, size={self.size!r}.")
        shape = list(x.shape)
        shape[axis] = self.size
        return TensorType.zero(shape, x.dtype, x.names)

    def signature(self) -> str:
        names = " ".join(self.output_type.names)
        return f"{names} -> {names} (axis {normalize_axis(self.kind, self.axis, self.input_types[0])} " \
               f"offset {self.start}, zeros elsewhere)"

    def params(self) -> dict[str, object]:
        return {"axis": normalize_axis(self.kind, self.axis, self.input_types[0]), "start": self.start,
                "size": self.size}

    def input_box(self, k: int, choice: Choice) -> Box:
        axis = normalize_axis(self.kind, self.axis, self.input_types[0])
        return self.window(choice, axis, self.start, self.start + self.input_types[0].shape[axis])

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        axis = normalize_axis(self.kind, self.axis, self.input_types[0])
        out = np.zeros(f.output.shape, dtype=blocks[0].dtype)
        x = blocks[0]
        if x.size:
            at = f.inputs[0].lower[axis] + self.start - f.output.lower[axis]
            index = [slice(None)] * out.ndim
            index[axis] = slice(at, at + x.shape[axis])
            out[tuple(index)] = x
        return out

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x = inputs[0].type
        axis = normalize_axis(self.kind, self.axis, x)
        return (build(b, "slice", (cotangent,), axis=axis, start=self.start, stop=self.start + x.shape[axis]),)


@register
@dataclass(frozen=True, eq=True)
class ExpandOp(IndexedOp):
    """x repeated along its size-1 dimensions to ``shape`` (NumPy's ``broadcast_to`` at equal rank).

    >>> from relational_tensors.core.types import TensorType as T
    >>> ExpandOp((T.zero((4, 1)),), (4, 6)).signature()
    'd0 1 -> d0 d1'
    """

    kind = "expand"
    accepts_bool = True
    shape: tuple[int, ...] = ()  # on GPUs a broadcast copy (stride 0 along the repeated dimensions)

    def infer(self) -> TensorType:
        (x,) = self.input_types
        shape = tuple(self.shape)
        if len(shape) != x.rank or any(a not in (1, s) for a, s in zip(x.shape, shape)):
            raise GraphError(f"expand repeats size-1 dimensions at equal rank; got {x.shape} -> {shape}.")
        return TensorType.zero(shape, x.dtype, x.names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        x = self.input_types[0]
        return (tuple(n if a == s else None for n, a, s in zip(x.names, x.shape, self.shape)),)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.output_type.names

    def params(self) -> dict[str, object]:
        return {"shape": tuple(self.shape)}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 0.0

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        return np.array(np.broadcast_to(blocks[0], f.output.shape), copy=True)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        return (reduce_to(b, cotangent, inputs[0].type),)

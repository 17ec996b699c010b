"""Intervals, boxes and tensor types (section 3.1 of the paper).

A tensor type has a rank, lower and upper bounds, a dtype and a name per
dimension.  Users build zero-bounded types; projections keep their offsets so a
sub-tensor always knows where it sits inside the whole.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from relational_tensors.core.dtypes import canonical_dtype, itemsize
from relational_tensors.errors import GraphError, SpecError

__all__ = ["Interval", "Box", "TensorType", "tensorDesc", "MAX_TENSOR_BYTES"]

# the largest tensor a graph may declare: its byte count (and every count derived from it) fits an int64
MAX_TENSOR_BYTES = 1 << 62


@dataclass(frozen=True, slots=True, order=True)
class Interval:
    """The half-open integer range ``[lo, hi)``.

    >>> Interval(2, 5).size, Interval(2, 5).intersect(Interval(4, 9))
    (3, Interval(lo=4, hi=5))
    """

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.hi < self.lo:
            raise SpecError(f"an interval needs lo <= hi; got [{self.lo}, {self.hi}).")

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def intersect(self, other: Interval) -> Interval:
        lo, hi = max(self.lo, other.lo), min(self.hi, other.hi)
        return Interval(lo, max(lo, hi))

    def shift(self, by: int) -> Interval:
        return Interval(self.lo + by, self.hi + by)

    def __str__(self) -> str:
        return f"[{self.lo},{self.hi})"


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular index set: the product of one interval per dimension.

    >>> b = Box((0, 4), (2, 8)); b.shape, b.volume
    ((2, 4), 8)
    """

    lower: tuple[int, ...]
    upper: tuple[int, ...]
    # derived once: shapes and volumes are read far more often than boxes are made
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    volume: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.lower) != len(self.upper) or any(hi < lo for lo, hi in zip(self.lower, self.upper)):
            raise SpecError(f"a box needs lower <= upper per dimension; got {self.lower} .. {self.upper}.")
        shape = tuple(hi - lo for lo, hi in zip(self.lower, self.upper))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "volume", math.prod(shape))

    @staticmethod
    def from_intervals(intervals: Iterable[Interval]) -> Box:
        ivs = tuple(intervals)  # each interval is ordered already
        return Box._made(tuple(i.lo for i in ivs), tuple(i.hi for i in ivs))

    @staticmethod
    def of_shape(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def rank(self) -> int:
        return len(self.lower)

    @property
    def is_empty(self) -> bool:
        return any(hi == lo for lo, hi in zip(self.lower, self.upper))

    def interval(self, dim: int) -> Interval:
        return Interval(self.lower[dim], self.upper[dim])

    def intervals(self) -> tuple[Interval, ...]:
        return tuple(Interval(lo, hi) for lo, hi in zip(self.lower, self.upper))

    def contains(self, other: Box) -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.lower, self.upper, other.lower, other.upper))

    @staticmethod
    def _made(lower: tuple[int, ...], upper: tuple[int, ...]) -> Box:
        """A box from bounds already known to be ordered (the planner's inner loops make millions)."""
        box = object.__new__(Box)
        shape = tuple(map(operator.sub, upper, lower))
        _SET_LOWER(box, lower)
        _SET_UPPER(box, upper)
        _SET_SHAPE(box, shape)
        _SET_VOLUME(box, math.prod(shape))
        return box

    def intersect(self, other: Box) -> Box:
        lower = tuple(map(max, self.lower, other.lower))
        return Box._made(lower, tuple(map(max, lower, map(min, self.upper, other.upper))))

    def overlap_volume(self, other: Box) -> int:
        """The volume of the intersection, without making it."""
        return math.prod(max(0, min(b, d) - max(a, c)) for a, b, c, d in zip(self.lower, self.upper, other.lower,
                                                                            other.upper))

    def overlaps(self, other: Box) -> bool:
        return all(max(a, c) < min(b, d) for a, b, c, d in zip(self.lower, self.upper, other.lower, other.upper))

    def slices(self, within: Box | None = None) -> tuple[slice, ...]:
        """Index of this box inside an array that holds ``within`` (default: origin 0)."""
        origin = within.lower if within is not None else (0,) * self.rank
        return tuple(slice(lo - o, hi - o) for lo, hi, o in zip(self.lower, self.upper, origin))

    def __str__(self) -> str:
        return "x".join(str(i) for i in self.intervals())


# the slots' own setters: what a frozen dataclass's __post_init__ does, without its __setattr__ check
_SET_LOWER, _SET_UPPER, _SET_SHAPE, _SET_VOLUME = (vars(Box)[name].__set__ for name in ("lower", "upper", "shape",
                                                                                        "volume"))


@dataclass(frozen=True, slots=True)
class TensorType:
    """Rank, bounds, named indices and dtype of a tensor.

    >>> t = TensorType.zero((4, 6), "float32", ("rows", "cols")); t.shape, t.nbytes
    ((4, 6), 96)
    """

    lower: tuple[int, ...]
    upper: tuple[int, ...]
    dtype: str
    names: tuple[str, ...]
    # derived once: the planner reads shapes and boxes of types in its innermost loops
    shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    box: Box = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (len(self.lower) == len(self.upper) == len(self.names)):
            raise GraphError(
                f"a tensor type needs one lower bound, upper bound and name per dimension; "
                f"got lower={self.lower}, upper={self.upper}, names={self.names}."
            )
        if len(set(self.names)) != len(self.names):
            raise GraphError(f"the dimension names of a tensor must be distinct; got {self.names}.")
        box = Box(self.lower, self.upper)
        object.__setattr__(self, "box", box)
        object.__setattr__(self, "shape", box.shape)

    @staticmethod
    def zero(shape: Sequence[int], dtype: object = "float32", names: Sequence[str] | None = None) -> TensorType:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise GraphError(f"a tensor shape is a sequence of positive integers; got {shape!r}.")
        given = tuple(shape)
        try:
            sizes = tuple(operator.index(s) for s in given if not isinstance(s, bool))
        except TypeError:
            sizes = ()
        if len(sizes) != len(given) or any(s <= 0 for s in sizes):
            raise GraphError(
                f"tensor dimensions must be positive integers; got shape {given}. "
                "Give every dimension a size of at least 1."
            )
        if isinstance(names, str):
            raise GraphError(f"dimension names are a sequence of strings, one per dimension; got {names!r}.")
        names = tuple(names) if names is not None else tuple(f"d{i}" for i in range(len(sizes)))
        if len(names) != len(sizes):
            raise GraphError(f"give one name per dimension; got shape {sizes} and names {names}.")
        if not all(isinstance(n, str) and n for n in names):
            raise GraphError(f"dimension names must be non-empty strings; got {names}.")
        t = TensorType((0,) * len(sizes), sizes, canonical_dtype(dtype), names)
        if t.nbytes > MAX_TENSOR_BYTES:
            raise GraphError(f"a tensor may hold at most 2**62 bytes ({MAX_TENSOR_BYTES:,}); got shape {sizes} of "
                             f"{t.dtype}, {t.nbytes:,} bytes. Use smaller dimensions.")
        return t

    @property
    def rank(self) -> int:
        return len(self.upper)

    @property
    def volume(self) -> int:
        return self.box.volume

    @property
    def nbytes(self) -> int:
        return self.volume * itemsize(self.dtype)

    def with_(self, *, shape: Sequence[int] | None = None, dtype: str | None = None,
              names: Sequence[str] | None = None) -> TensorType:
        shape = tuple(shape) if shape is not None else self.shape
        if names is None:
            names = self.names if len(shape) == self.rank else None
        return TensorType.zero(shape, dtype or self.dtype, names)

    def __str__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"{self.dtype}[{dims}]"


def tensorDesc(shape: Sequence[int], dtype: object = "float32", names: Sequence[str] | None = None) -> TensorType:
    """The paper's spelling of a zero-bounded tensor type.

    >>> tensorDesc([8, 16], "float16").shape
    (8, 16)
    """
    return TensorType.zero(shape, dtype, names)

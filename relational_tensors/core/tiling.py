"""Tilings (section 3.1): sets of disjoint boxes that cover a tensor type.

A grid of per-dimension breakpoints is the canonical, hashable form; every
tiling our operators produce is a grid.  The overlay of two grids merges their
breakpoints dimension by dimension, and its cells are the atoms of section 5.3.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relational_tensors.core.types import Box, Interval
from relational_tensors.errors import SpecError

__all__ = ["Tiling", "check_tiles", "as_grid"]


@dataclass(frozen=True, slots=True)
class Tiling:
    """A grid tiling: per dimension, the increasing breakpoints from lower to upper bound.

    >>> t = Tiling(((0, 2, 4), (0, 6))); t.counts, len(t.boxes())
    ((2, 1), 2)
    >>> str(t.overlay(Tiling(((0, 1, 4), (0, 3, 6)))))
    '[0,1,2,4]x[0,3,6]'
    """

    breaks: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for b in self.breaks:
            if len(b) < 2 or any(x >= y for x, y in zip(b, b[1:])):
                raise SpecError(f"tiling breakpoints must increase strictly with at least two per dimension; got {b}.")

    @staticmethod
    def whole(box: Box) -> Tiling:
        return Tiling(tuple(zip(box.lower, box.upper)))

    @staticmethod
    def from_intervals(per_dim: Sequence[Sequence[Interval]]) -> Tiling:
        return Tiling(tuple((ivs[0].lo, *(i.hi for i in ivs)) for ivs in per_dim))

    @staticmethod
    def from_boxes(boxes: Iterable[Box], space: Box) -> Tiling:
        """The grid formed by ``boxes``; raises SpecError unless they tile ``space`` as a grid."""
        distinct = set(boxes)
        grid = as_grid(distinct, space)
        if grid is not None:
            return grid
        distinct_sorted = sorted(distinct, key=lambda b: (b.lower, b.upper))
        check_tiles(distinct_sorted, space)
        breaks = tuple(tuple(sorted({b.lower[d] for b in distinct} | {space.upper[d]}))
                       for d in range(space.rank))
        tiling = Tiling(breaks)
        if len(distinct) != tiling.num_blocks:
            raise SpecError(
                f"the output blocks tile the tensor but do not form a grid; got {len(distinct)} blocks "
                f"against a {'x'.join(map(str, tiling.counts))} grid. Operators must produce grid tilings."
            )
        return tiling

    @property
    def rank(self) -> int:
        return len(self.breaks)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(b) - 1 for b in self.breaks)

    @property
    def num_blocks(self) -> int:
        return math.prod(self.counts)

    @property
    def space(self) -> Box:
        return Box(tuple(b[0] for b in self.breaks), tuple(b[-1] for b in self.breaks))

    def intervals(self, dim: int) -> tuple[Interval, ...]:
        b = self.breaks[dim]
        return tuple(Interval(x, y) for x, y in zip(b, b[1:]))

    def boxes(self) -> tuple[Box, ...]:
        """Every block, in row-major order of the grid."""
        per_dim = [self.intervals(d) for d in range(self.rank)]
        return tuple(Box.from_intervals(c) for c in itertools.product(*per_dim))

    def overlay(self, other: Tiling) -> Tiling:
        if self.space != other.space:
            raise SpecError(f"only tilings of the same space overlay; got {self.space} and {other.space}.")
        return Tiling(tuple(tuple(sorted(set(a) | set(b))) for a, b in zip(self.breaks, other.breaks)))

    def refines(self, other: Tiling) -> bool:
        """True when every block of ``other`` is a union of blocks of this tiling."""
        return all(set(b) <= set(a) for a, b in zip(self.breaks, other.breaks))

    def __str__(self) -> str:
        return "x".join("[" + ",".join(map(str, b)) + "]" for b in self.breaks)

    def shape_str(self) -> str:
        """The grid's counts, e.g. ``2x1x4``."""
        return "x".join(map(str, self.counts))


def check_tiles(boxes: Sequence[Box], space: Box) -> None:
    """Raise SpecError unless ``boxes`` are pairwise disjoint, inside ``space`` and cover it."""
    for b in boxes:
        if b.rank != space.rank or not space.contains(b):
            raise SpecError(f"a block must lie inside the tensor; got {b} outside {space}.")
    for a, b in itertools.combinations(boxes, 2):
        if a.overlaps(b):
            raise SpecError(f"the blocks of a tiling must be disjoint; got {a} and {b}, which overlap.")
    covered = sum(b.volume for b in boxes)
    if covered != space.volume:
        raise SpecError(
            f"the blocks of a tiling must cover the tensor; got {covered} of {space.volume} elements of {space} "
            "covered."
        )


def as_grid(boxes: Iterable[Box], space: Box) -> Tiling | None:
    """The grid tiling whose cells are exactly ``boxes``, or None if they are not one.

    Linear in the number of boxes: distinct boxes that each span one cell of the
    grid of their own breakpoints, as many as the grid has cells, are that grid.

    >>> str(as_grid([Box((0,), (2,)), Box((2,), (5,))], Box((0,), (5,))))
    '[0,2,5]'
    """
    distinct = set(boxes)
    rank = space.rank
    if any(b.rank != rank for b in distinct):
        return None
    breaks = []
    for d in range(rank):
        pts = sorted({b.lower[d] for b in distinct} | {b.upper[d] for b in distinct})
        if not pts or pts[0] != space.lower[d] or pts[-1] != space.upper[d] or len(pts) < 2:
            return None
        breaks.append(pts)
    if len(distinct) != math.prod(len(b) - 1 for b in breaks):
        return None
    pos = [{x: n for n, x in enumerate(b)} for b in breaks]
    for box in distinct:
        for d in range(rank):
            if pos[d][box.upper[d]] != pos[d][box.lower[d]] + 1:
                return None
    return Tiling(tuple(tuple(b) for b in breaks))

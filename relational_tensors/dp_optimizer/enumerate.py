"""Every interval request of an operator for p processors.

A request gives each requestable index a number of intervals, the numbers
multiplying to p, and then one of the interval lists the operator offers for
that number (near-equal, and for causal attention also equal-work).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from relational_tensors.core.spec import ShardableIndex
from relational_tensors.core.types import Interval
from relational_tensors.sql_specs.base import Operator

__all__ = ["count_assignments", "interval_requests", "factorizations"]


def factorizations(p: int, slots: int) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of ``slots`` positive integers whose product is ``p``.

    >>> sorted(factorizations(4, 2))
    [(1, 4), (2, 2), (4, 1)]
    """
    if slots == 0:
        if p == 1:
            yield ()
        return
    for d in range(1, p + 1):
        if p % d == 0:
            for rest in factorizations(p // d, slots - 1):
                yield (d, *rest)


def count_assignments(op: Operator, p: int) -> list[tuple[int, ...]]:
    """Interval counts per requestable index with product ``p`` that the legal positions allow."""
    idx = op.requestable()
    return [c for c in factorizations(p, len(idx)) if all(n <= s.max_intervals() for n, s in zip(c, idx))]


def interval_requests(op: Operator, p: int) -> Iterator[dict[str, tuple[Interval, ...]]]:
    """Every request (index -> intervals) for ``p`` function specs; indices split once are left out."""
    idx: tuple[ShardableIndex, ...] = op.requestable()
    for counts in count_assignments(op, p):
        options = []
        for s, n in zip(idx, counts):
            options.append([None] if n == 1 else op.interval_candidates(s, n))
        for combo in itertools.product(*options):
            yield {s.name: ivs for s, ivs in zip(idx, combo) if ivs is not None}

"""Planning repeated layers once: the switch for sharing work between operators of one class.

Deep models repeat one block many times.  Operators that are equal (same kind, parameters and input
types) and read the same kinds of inputs get the same candidate specs, costs and eligibility, so the
planner works their candidates out once per class (``candidates``), solves a piece of the DP once per
*context* (its members' classes and tree shape, and for every edge across its boundary the class and
chosen spec of the operator on the other side: ``select``), memoizes the refinement's local steps the
same way (``refine``), and lowers an operator once per geometry (its spec, its producers' specs and
placements, the blocks already loaded: ``physical.lower``), replaying the recorded tasks with fresh
buffer ids for the others.  Every shared result is a pure function of its key, so a plan made with
sharing is the plan made without it, task for task; ``sharing(False)`` turns it off (the tests compare).

>>> from relational_tensors.dp_optimizer import repeats
>>> with repeats.sharing(False):
...     repeats.enabled()
False
>>> repeats.enabled()
True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["enabled", "sharing"]

_enabled = True


def enabled() -> bool:
    """Whether planning shares work between operators (and pieces) of one class."""
    return _enabled


@contextmanager
def sharing(on: bool) -> Iterator[None]:
    """Plan with sharing between repeated operators turned on or off inside the block."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    try:
        yield
    finally:
        _enabled = before

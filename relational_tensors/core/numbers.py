"""What counts as a number where a user gives one: a real number that is not a bool (JSON's ``true`` is no
bandwidth, ``True`` no epsilon), and an integer that is not a bool.

>>> is_number(2.5), is_number(True), is_number("3"), is_integer(3), is_integer(3.0)
(True, False, False, True, False)
"""

from __future__ import annotations

import numbers
from typing import TypeGuard

__all__ = ["is_number", "is_integer"]


def is_number(x: object) -> TypeGuard[float]:
    """A real number that is not a bool (NaN and infinities included: callers bound the range).  float and
    int are tested first, as they are what the planners pass (an ABC check costs more, and a large
    topology checks thousands of numbers)."""
    t = type(x)
    return t is float or t is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def is_integer(x: object) -> TypeGuard[int]:
    """An integer that is not a bool (NumPy's integers included)."""
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))

"""Small validation helpers shared by the operator modules."""

from __future__ import annotations

import math
from collections.abc import Sequence

from relational_tensors.core.numbers import is_number
from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError

__all__ = ["same_dtype", "names_or_default", "normalize_axis", "finite_number"]


def same_dtype(kind: str, types: Sequence[TensorType]) -> str:
    dtypes = [t.dtype for t in types]
    if len(set(dtypes)) > 1:
        raise GraphError(
            f"{kind} needs inputs of one dtype; got {dtypes} for shapes {[t.shape for t in types]}. "
            "Insert g.unary(x, 'cast', '<dtype>') to convert one of them."
        )
    return dtypes[0]


def names_or_default(names: Sequence[str]) -> tuple[str, ...] | None:
    """``names`` if they are distinct, else None (the type then takes default names)."""
    names = tuple(names)
    return names if len(set(names)) == len(names) else None


def normalize_axis(kind: str, axis: int, t: TensorType) -> int:
    if not isinstance(axis, int) or not -t.rank <= axis < t.rank:
        raise GraphError(f"{kind} axis must lie in [-{t.rank}, {t.rank}); got axis={axis!r} for shape {t.shape}.")
    return axis % t.rank


def positive_count(what: str, value: object) -> int:
    """``value``, refused unless it is an int (not a bool) of at least 1: a number of classes, experts, rows.

    >>> positive_count("one_hot's classes", 8)
    8
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GraphError(f"{what} must be a positive int; got {value!r}.")
    return value


def finite_number(what: str, value: object, above: float | None = None, at_least: float | None = None) -> float:
    """``value`` as a float, refused unless it is a real finite number (not a bool, a string or None),
    greater than ``above`` and at least ``at_least`` where those are given.

    >>> finite_number("rope base", 500, above=0)
    500.0
    """
    x = float(value) if is_number(value) else math.nan
    if not math.isfinite(x) or (above is not None and not x > above) or (at_least is not None and not x >= at_least):
        bound = f" > {above:g}" if above is not None else f" >= {at_least:g}" if at_least is not None else ""
        raise GraphError(f"{what} must be a finite number{bound}; got {value!r}.")
    return x

"""Packed sequences: validation of ``seq_ends`` and per-position sequence bounds."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from relational_tensors.errors import GraphError

__all__ = ["check_seq_ends", "sequence_bounds"]


def check_seq_ends(kind: str, seq_ends: Sequence[int] | None, length: int) -> tuple[int, ...] | None:
    """``seq_ends`` as a tuple of strictly increasing ends that finish exactly at ``length``.

    >>> check_seq_ends("rope", [3, 5, 9], 9)
    (3, 5, 9)
    """
    if seq_ends is None:
        return None
    try:
        ends = tuple(operator.index(e) for e in seq_ends)
    except TypeError:
        raise GraphError(f"{kind} seq_ends must be a list of integers; got {seq_ends!r}.") from None
    if not ends or any(b <= a for a, b in zip((0, *ends), ends)):
        raise GraphError(
            f"{kind} seq_ends must be positive and strictly increasing (the end of each packed sequence); "
            f"got {list(ends)}."
        )
    if ends[-1] > length:
        raise GraphError(
            f"{kind} seq_ends must not run past the sequence of length {length}; got last end {ends[-1]} "
            f"in {list(ends)}."
        )
    if ends[-1] != length:
        raise GraphError(
            f"{kind} seq_ends must end exactly at the sequence length {length} (every token belongs to a "
            f"packed sequence); got last end {ends[-1]}. Append {length} to seq_ends."
        )
    return ends


def sequence_bounds(positions: np.ndarray, seq_ends: tuple[int, ...] | None,
                    length: int) -> tuple[np.ndarray, np.ndarray]:
    """For each position, the start and end of the packed sequence that holds it.

    >>> s, e = sequence_bounds(np.arange(5), (2, 5), 5); s.tolist(), e.tolist()
    ([0, 0, 2, 2, 2], [2, 2, 5, 5, 5])
    """
    if seq_ends is None:
        return np.zeros_like(positions), np.full_like(positions, length)
    ends = np.asarray(seq_ends)
    starts = np.concatenate(([0], ends[:-1]))
    which = np.searchsorted(ends, positions, side="right")
    return starts[which], ends[which]

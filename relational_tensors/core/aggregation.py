"""The aggregations ⊕ that combine partial outputs of a join-agg spec.

⊕ is per operator: ``sum`` for contractions, ``max``/``min`` for those
reductions, ``logsumexp`` (log(e^a + e^b)) for a log-sum-exp reduction split
over its reduced axis, and ``lse`` for attention split over the key sequence,
whose partials are pairs ``(out, lse)`` merged by their log-sum-exp weights.
Each ⊕ is associative and commutative, so partials combine in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Aggregation", "SUM", "MAX", "MIN", "LSE", "LOGSUMEXP", "AGGREGATIONS", "lse_merge", "logaddexp"]


def logaddexp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log(e^a + e^b) elementwise, -inf where both are -inf.

    >>> round(float(logaddexp(np.zeros(1), np.zeros(1))[0]), 6)
    0.693147
    """
    return np.logaddexp(a, b)


def lse_merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Merge two attention partials over disjoint key sets.

    ``out`` is [..., d] normalised within its key set, ``lse`` [...] the
    log-sum-exp of its scores (-inf where no key was visible).

    >>> o, l = lse_merge((np.ones((1, 2)), np.zeros(1)), (np.zeros((1, 2)), np.zeros(1)))
    >>> o.tolist(), round(float(l[0]), 6)
    ([[0.5, 0.5]], 0.693147)
    """
    (oa, la), (ob, lb) = a, b
    top = np.maximum(la, lb)
    safe = np.where(np.isfinite(top), top, 0.0)
    wa, wb = np.exp(la - safe), np.exp(lb - safe)
    total = wa + wb
    lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    denom = np.where(total > 0, total, 1.0)[..., None]
    out = (oa * wa[..., None] + ob * wb[..., None]) / denom
    return out.astype(oa.dtype, copy=False), lse.astype(la.dtype, copy=False)


@dataclass(frozen=True, slots=True)
class Aggregation:
    """One ⊕: its name, how partials combine, and how the combined partial becomes the output block.

    >>> SUM.combine([np.ones(2), np.ones(2)]).tolist()
    [2.0, 2.0]
    """

    name: str

    def combine(self, parts: Sequence[Any]) -> Any:
        if not parts:
            raise ValueError("⊕ needs at least one partial")
        acc = parts[0]
        for part in parts[1:]:
            acc = self.pair(acc, part)
        return acc

    def pair(self, a: Any, b: Any) -> Any:
        if self.name == "sum":
            return a + b
        if self.name == "max":
            return np.maximum(a, b)
        if self.name == "min":
            return np.minimum(a, b)
        if self.name == "lse":
            return lse_merge(a, b)
        if self.name == "logsumexp":
            return logaddexp(a, b)
        raise ValueError(f"unknown aggregation {self.name}")

    def finalize(self, part: Any) -> np.ndarray:
        """The output block carried by a combined partial."""
        return part[0] if self.name == "lse" else part

    @property
    def partial_extra(self) -> float:
        """Extra elements a partial carries per output row of the last axis (the lse scalar)."""
        return 1.0 if self.name == "lse" else 0.0

    def __str__(self) -> str:
        return self.name


SUM = Aggregation("sum")
MAX = Aggregation("max")
MIN = Aggregation("min")
LSE = Aggregation("lse")
LOGSUMEXP = Aggregation("logsumexp")
AGGREGATIONS = {a.name: a for a in (SUM, MAX, MIN, LSE, LOGSUMEXP)}

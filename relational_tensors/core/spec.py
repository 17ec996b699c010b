"""Shardable indices, function specifications and join-agg specs (section 3.2-3.3).

An operator is decomposed by handing it intervals for its shardable indices;
it answers with a join-agg spec holding one function specification per
combination of intervals.  The spec checks the tiling condition on
construction, so a spec that exists is a spec that is right about its outputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from relational_tensors.core.aggregation import Aggregation
from relational_tensors.core.tiling import Tiling
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import SpecError

__all__ = ["ANY", "ShardableIndex", "FunctionSpec", "JoinAggSpec", "IntervalRequest", "BALANCE_TOLERANCE"]

ANY = "any"
BALANCE_TOLERANCE = 0.10  # function specs whose FLOPs differ by more than this are unbalanced

IntervalRequest = Mapping[str, Sequence[Interval]]


@dataclass(frozen=True, slots=True)
class ShardableIndex:
    """A named index an operator lets the optimizer split.

    ``positions`` is ``"any"`` or the explicit interior positions where a cut is
    legal (packed sequences: their ends).  An inherited index (GQA's
    ``heads_q``) is never requested: its intervals follow ``inherits``.

    >>> ShardableIndex("i", 10).near_equal(3)
    (Interval(lo=0, hi=4), Interval(lo=4, hi=7), Interval(lo=7, hi=10))
    >>> ShardableIndex("s", 10, positions=(2, 9)).near_equal(2)
    (Interval(lo=0, hi=2), Interval(lo=2, hi=10))
    """

    name: str
    extent: int
    positions: str | tuple[int, ...] = ANY
    inherits: str | None = None

    def __post_init__(self) -> None:
        if self.positions != ANY:
            pos = tuple(cast("Sequence[int]", self.positions))  # not ANY: the explicit positions
            if any(not 0 < x < self.extent for x in pos) or list(pos) != sorted(set(pos)):
                raise SpecError(
                    f"legal positions of index {self.name!r} must increase strictly inside (0, {self.extent}); "
                    f"got {pos}."
                )
            object.__setattr__(self, "positions", pos)

    @property
    def requestable(self) -> bool:
        return self.inherits is None

    def legal_cuts(self) -> range | tuple[int, ...]:
        return range(1, self.extent) if self.positions == ANY else self.positions  # type: ignore[return-value]

    def max_intervals(self) -> int:
        return len(self.legal_cuts()) + 1

    def near_equal(self, n: int) -> tuple[Interval, ...] | None:
        """``n`` intervals as equal as the legal positions allow, or None if ``n`` is impossible."""
        if n < 1 or n > self.max_intervals():
            return None
        if self.positions == ANY:
            base, extra = divmod(self.extent, n)  # like numpy.array_split: the first `extra` get one more
            cuts = [k * base + min(k, extra) for k in range(n + 1)]
            return tuple(Interval(a, b) for a, b in zip(cuts, cuts[1:]))
        legal = list(self.legal_cuts())
        chosen: list[int] = []
        start = 0  # index into legal of the first still-usable position
        for k in range(1, n):
            ideal = k * self.extent / n
            stop = len(legal) - (n - 1 - k)  # leave room for the cuts still to come
            best = min(range(start, stop), key=lambda t: (abs(legal[t] - ideal), t))
            chosen.append(legal[best])
            start = best + 1
        cuts = [0, *chosen, self.extent]
        return tuple(Interval(a, b) for a, b in zip(cuts, cuts[1:]))

    def check(self, intervals: Sequence[Interval]) -> tuple[Interval, ...]:
        """Raise SpecError unless ``intervals`` tile [0, extent) in order, cutting only at legal positions."""
        ivs = tuple(intervals)
        if not ivs or ivs[0].lo != 0 or ivs[-1].hi != self.extent or any(
            a.hi != b.lo for a, b in zip(ivs, ivs[1:])
        ) or any(i.size == 0 for i in ivs):
            raise SpecError(
                f"intervals of index {self.name!r} must be non-empty, in order and tile [0, {self.extent}); "
                f"got {[str(i) for i in ivs]}."
            )
        if self.positions != ANY:
            bad = [i.lo for i in ivs[1:] if i.lo not in self.positions]  # type: ignore[operator]
            if bad:
                raise SpecError(
                    f"index {self.name!r} may be cut only at {list(self.positions)}; got cuts at {bad}. "
                    "Choose intervals whose ends are legal positions."
                )
        return ivs


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One function specification: the input projections and the output block of one kernel call.

    ``coords`` says which interval of each requested index it belongs to, and
    ``flops`` how much work the concrete kernel does on it.
    """

    inputs: tuple[Box, ...]
    output: Box
    coords: tuple[int, ...] = ()
    flops: float = 0.0

    def __str__(self) -> str:
        return " x ".join(str(b) for b in self.inputs) + f" -> {self.output}"


@dataclass(frozen=True, slots=True)
class JoinAggSpec:
    """A set of function specifications whose distinct output blocks tile the output.

    ``split`` records how many intervals each requested index got, in the
    operator's declared order; ``aggregation`` is the operator's ⊕.
    """

    input_types: tuple[TensorType, ...]
    output_type: TensorType
    functions: tuple[FunctionSpec, ...]
    aggregation: Aggregation
    split: tuple[tuple[str, int], ...] = ()
    output_tiling: Tiling = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.functions:
            raise SpecError("a join-agg spec needs at least one function specification; got none.")
        nin = len(self.input_types)
        for f in self.functions:
            if len(f.inputs) != nin:
                raise SpecError(f"every function spec needs {nin} input blocks; got {len(f.inputs)} in {f}.")
            for k, (box, t) in enumerate(zip(f.inputs, self.input_types)):
                if box.rank != t.rank or not t.box.contains(box):
                    raise SpecError(f"input {k} block {box} is not a projection of {t.box} (in {f}).")
            if f.output.is_empty or not self.output_type.box.contains(f.output):
                raise SpecError(f"output block {f.output} must be a non-empty projection of {self.output_type.box}.")
        tiling = Tiling.from_boxes((f.output for f in self.functions), self.output_type.box)
        object.__setattr__(self, "output_tiling", tiling)

    @property
    def p(self) -> int:
        return len(self.functions)

    @property
    def split_text(self) -> str:
        return ",".join(f"{n}={c}" for n, c in self.split)

    def input_blocks(self, k: int) -> tuple[Box, ...]:
        """The distinct blocks of input ``k`` that the function specs read (``in_k(J)``)."""
        return tuple(dict.fromkeys(f.inputs[k] for f in self.functions))

    def output_multiplicity(self) -> Counter[Box]:
        """How many function specs produce each output block (m in the aggregation cost)."""
        return Counter(f.output for f in self.functions)

    @property
    def total_flops(self) -> float:
        return float(sum(f.flops for f in self.functions))

    @property
    def imbalance(self) -> float:
        """max/min FLOPs over the function specs, minus one (0 = perfectly balanced)."""
        flops = [f.flops for f in self.functions]
        lo, hi = min(flops), max(flops)
        if hi == 0:
            return 0.0
        return float("inf") if lo == 0 else hi / lo - 1.0

    @property
    def balanced(self) -> bool:
        return self.imbalance <= BALANCE_TOLERANCE + 1e-12

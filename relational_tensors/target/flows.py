"""An event-driven fluid model of data moving through shared resources.

Each *flow* moves a number of bytes and, while it moves, draws bandwidth from a
tuple of *resources* (a link direction, a switch port, a bridge, a GPU's HBM),
each with a capacity in bytes/s.  Rates follow max-min fairness, computed by
progressive filling: every unfrozen flow's rate rises at the same pace until a
resource it uses is full or the flow reaches its own cap; then it is frozen and
the rest keep rising.  Rates are recomputed whenever a flow begins drawing
bandwidth or finishes, so between two such events every rate is constant and
completion times are exact.

A flow may wait a start latency before it draws anything; a zero-byte flow
completes when its latency is over.  Times are in seconds, sizes in bytes.

Every capacity, size, latency and time the engine is given must be a finite
number, and it refuses to loop without progress: an event step that neither
moves the clock nor finishes a flow (a NaN rate, a flow that can never finish)
raises :class:`ExchangeError` naming the flows, so that no caller can hang.

The engine knows nothing about exchange programs: the ExProg simulator and the
whole-plan simulator both drive it with the same five calls.

>>> net = FlowNetwork({"link": 10.0})
>>> net.start("a", ("link",), 10.0, now=0.0)
>>> net.start("b", ("link",), 30.0, now=0.0)
>>> net.active()
{'a': 5.0, 'b': 5.0}
>>> t = net.next_completion(); t, net.advance_to(t)
(2.0, ['a'])
>>> t = net.next_completion(); t, net.advance_to(t)
(4.0, ['b'])
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from relational_tensors.core.numbers import is_number
from relational_tensors.errors import ExchangeError

__all__ = ["FlowNetwork"]

_K = TypeVar("_K", bound=Hashable)  # what the caller keys its flows by

_REL = 1e-12  # relative slack when comparing event times and residual capacities


def _slack(t: float) -> float:
    """How far apart two event times may be and still be one time: relative, and at least 1e-12 s
    (events of a microsecond-scale program are a few picoseconds apart in rounding only)."""
    return _REL * max(1.0, abs(t))


@dataclass(slots=True)
class _Flow:
    resources: tuple[str, ...]
    remaining: float
    cap: float
    ready_at: float  # start time plus latency: when the flow begins drawing bandwidth
    rate: float = 0.0


class FlowNetwork(Generic[_K]):
    """Resources with capacities, and the flows currently crossing them.

    ``now`` is the network's clock; it only moves forward, through
    :meth:`advance_to`.
    """

    def __init__(self, capacities: Mapping[str, float], now: float = 0.0) -> None:
        bad = {r: c for r, c in capacities.items() if not (is_number(c) and 0 < c < math.inf)}
        if bad:
            raise ExchangeError(f"every resource needs a finite positive capacity in bytes/s; got {bad}. "
                                "A link that never contends is left off the flows' resources.")
        if not (is_number(now) and math.isfinite(now)):
            raise ExchangeError(f"the network's clock starts at a finite time; got now={now!r}.")
        self.capacities: dict[str, float] = dict(capacities)
        self.now = float(now)
        self._flows: dict[_K, _Flow] = {}
        self._stale = False  # flows started since the rates were last allocated

    # ---------------------------------------------------------------- public calls

    def start(self, key: _K, resources: Iterable[str], nbytes: float, now: float,
              latency: float = 0.0, cap: float = math.inf) -> None:
        """Add a flow of ``nbytes`` over ``resources`` at time ``now`` (the network's clock).

        It draws nothing for ``latency`` seconds, then at most ``cap`` bytes/s.  A
        resource listed twice is used once.
        """
        if key in self._flows:
            raise ExchangeError(f"a flow keyed {key!r} is already in the network; give each flow its own key.")
        if not abs(now - self.now) <= _slack(self.now):  # the slack advance_to allows past its target; NaN too
            raise ExchangeError(
                f"flows start at the network's clock; got now={now!r} while the clock is {self.now!r}. "
                "Call advance_to(now) first and handle the flows it completes.")
        res = tuple(dict.fromkeys(resources))
        unknown = [r for r in res if r not in self.capacities]
        if unknown:
            raise ExchangeError(f"flow {key!r} uses unknown resources {unknown}; known: {sorted(self.capacities)}.")
        for what, value in (("nbytes", nbytes), ("latency", latency)):
            if not (is_number(value) and 0 <= value < math.inf):  # NaN fails the comparisons
                raise ExchangeError(f"flow {key!r} needs {what} to be a finite number >= 0; got {what}={value!r}.")
        if not (is_number(cap) and cap > 0):
            raise ExchangeError(f"flow {key!r} needs cap to be a number of bytes/s > 0 (inf for no cap); "
                                f"got cap={cap!r}.")
        self._flows[key] = _Flow(res, float(nbytes), float(cap), self.now + float(latency))
        self._stale = True  # rates are a function of the flows present: the flows started together share one allocation

    def next_completion(self) -> float | None:
        """When the next flow will finish if no other flow starts; None when the network is empty."""
        if not self._flows:
            return None
        self._fresh()
        t = self._next_event()
        if t is not None and self._finishing_by(t + _slack(t)):
            return t  # the next event finishes a flow: no need to step a copy of the network to it
        probe = self._clone()
        while True:
            t = probe._next_event()
            if t is None:  # flows remain, and none of them will ever start or finish
                raise probe._no_progress("no flow can ever finish")
            if probe._step(t):
                return t

    def advance_to(self, t: float) -> list[_K]:
        """Move the clock to ``t``; the keys of the flows that finished by then, in finishing order."""
        if not (is_number(t) and math.isfinite(t)):
            raise ExchangeError(f"the clock moves to a finite time only; got t={t!r} while it is at {self.now!r}.")
        if t < self.now - _slack(self.now):
            raise ExchangeError(f"the clock only moves forward; got t={t!r} while it is at {self.now!r}.")
        self._fresh()
        done: list[_K] = []
        while True:
            te = self._next_event()
            if te is None:
                if self._flows:
                    raise self._no_progress("no flow can ever finish")
                break
            if te > t + _slack(t):
                break
            done.extend(self._step(te))
        self._drain(max(t, self.now))
        return done

    def active(self) -> dict[_K, float]:
        """Every unfinished flow and its current rate in bytes/s (0.0 while it waits out its latency)."""
        self._fresh()
        return {k: f.rate for k, f in self._flows.items()}

    def rate(self, key: _K) -> float:
        """The current rate of one unfinished flow."""
        if key not in self._flows:
            raise ExchangeError(f"no unfinished flow is keyed {key!r}.")
        self._fresh()
        return self._flows[key].rate

    def __len__(self) -> int:
        return len(self._flows)

    # ---------------------------------------------------------------- internals

    def _fresh(self) -> None:
        """Allocate the rates if flows started since they were last allocated."""
        if self._stale:
            self._allocate()

    def _clone(self) -> FlowNetwork[_K]:
        other: FlowNetwork[_K] = FlowNetwork.__new__(FlowNetwork)
        other.capacities = self.capacities
        other.now = self.now
        other._stale = False
        other._flows = {k: _Flow(f.resources, f.remaining, f.cap, f.ready_at, f.rate) for k, f in self._flows.items()}
        return other

    def _finish_time(self, f: _Flow) -> float:
        if f.ready_at > self.now:
            return f.ready_at if f.remaining == 0 else math.inf
        if f.remaining == 0 or f.rate == math.inf:
            return self.now
        return self.now + f.remaining / f.rate if f.rate > 0 else math.inf

    def _finishing_by(self, limit: float) -> list[_K]:
        """The flows that finish by ``limit``, in the network's order (``_finish_time`` inlined: the
        whole-plan simulator asks at every event, over thousands of flows)."""
        now, out = self.now, []
        for k, f in self._flows.items():
            if f.ready_at > now:
                if f.remaining == 0 and f.ready_at <= limit:
                    out.append(k)
            elif f.remaining == 0 or f.rate == math.inf or (f.rate > 0 and now + f.remaining / f.rate <= limit):
                out.append(k)
        return out

    def _next_event(self) -> float | None:
        """The next time a flow starts drawing bandwidth or finishes."""
        now, t = self.now, math.inf
        for f in self._flows.values():  # min over ready times ahead and finish times (_finish_time inlined)
            if f.ready_at > now:
                t = min(t, f.ready_at)
            elif f.remaining == 0 or f.rate == math.inf:
                t = min(t, now)
            elif f.rate > 0:
                t = min(t, now + f.remaining / f.rate)
        return None if t == math.inf else t

    def _drain(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            for f in self._flows.values():
                if f.ready_at <= self.now and f.rate > 0:
                    rest = f.remaining - f.rate * dt
                    f.remaining = 0.0 if rest <= 0 else rest  # not max(0.0, rest): a NaN stays NaN, not done
            self.now = t

    def _step(self, t: float) -> list[_K]:
        """Advance to the event time ``t``: finish what ends there, then reallocate."""
        before = self.now
        ending = self._finishing_by(t + _slack(t))
        self._drain(max(t, self.now))
        if not ending and self.now == before:  # an event that is no event (a NaN time): it would repeat forever
            raise self._no_progress(f"the next event time is {t!r}")
        for k in ending:
            del self._flows[k]
        self._allocate()
        return ending

    def _no_progress(self, why: str) -> ExchangeError:
        """The error of a simulation that cannot move on, naming the flows that hold it up."""
        stuck = {k: f for k, f in self._flows.items() if not math.isfinite(self._finish_time(f))
                 or not (math.isfinite(f.remaining) and f.rate == f.rate)}
        flows = stuck or self._flows
        shown = ", ".join(f"{k!r} (rate {f.rate!r} B/s, {f.remaining!r} bytes left)" for k, f in
                          list(flows.items())[:8]) + (f" and {len(flows) - 8} more" if len(flows) > 8 else "")
        return ExchangeError(
            f"the flow simulation made no progress at t={self.now!r}: {why}, so no flow finishes and the clock "
            f"cannot move; flows involved: {shown}. A rate, size or time that is not a finite number reached "
            "the flow engine: check the topology's capacities and latencies and the sizes of the transfers.")

    def _allocate(self) -> None:
        """Max-min fair rates by progressive filling over the flows that are drawing bandwidth."""
        self._stale = False
        live = {k: f for k, f in self._flows.items() if f.ready_at <= self.now and f.remaining > 0}
        for f in self._flows.values():
            f.rate = 0.0
        residual = {r: self.capacities[r] for f in live.values() for r in f.resources}
        unfrozen = set(live)
        while unfrozen:
            users: dict[str, int] = {}
            for k in unfrozen:
                for r in live[k].resources:
                    users[r] = users.get(r, 0) + 1
            step = min([residual[r] / n for r, n in users.items()] +
                       [live[k].cap - live[k].rate for k in unfrozen])
            if step == math.inf:  # no resource and no cap: the flow is instantaneous
                for k in unfrozen:
                    live[k].rate = math.inf
                break
            for k in unfrozen:
                live[k].rate += step
            for r, n in users.items():
                residual[r] -= step * n
            full = {r for r in users if residual[r] <= _REL * 1e3 * self.capacities[r]}
            unfrozen = {k for k in unfrozen
                        if not (full.intersection(live[k].resources)
                                or live[k].rate >= live[k].cap * (1 - _REL * 1e3))}

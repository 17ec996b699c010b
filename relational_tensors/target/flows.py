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
whole-plan simulator both drive it with the same five calls.  Flows live in
arrays (one slot per flow, resources as integer indices), so each event costs a
few vector operations over the flows rather than a Python pass per flow: the
whole-plan simulator of a 72-GPU plan has thousands of flows at once.

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
from typing import Generic, TypeVar

import numpy as np

from relational_tensors.core.numbers import is_number
from relational_tensors.errors import ExchangeError

__all__ = ["FlowNetwork"]

_K = TypeVar("_K", bound=Hashable)  # what the caller keys its flows by

_REL = 1e-12  # relative slack when comparing event times and residual capacities
_FULL = _REL * 1e3  # a resource with less than this share of its capacity left is full


def _slack(t: float) -> float:
    """How far apart two event times may be and still be one time: relative, and at least 1e-12 s
    (events of a microsecond-scale program are a few picoseconds apart in rounding only)."""
    return _REL * max(1.0, abs(t))


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
        self._index = {r: i for i, r in enumerate(self.capacities)}
        self._caps = np.array(list(self.capacities.values()), dtype=np.float64)
        self.now = float(now)
        self._slot: dict[_K, int] = {}  # key -> its slot in the arrays
        self._keys: list[_K | None] = []
        self._free: list[int] = []
        self._order = 0  # start order: flows that finish together are reported in it
        n = 16
        self._res = np.full((n, 1), -1, dtype=np.int64)  # each flow's resources, -1 padded
        self._remaining = np.zeros(n)
        self._cap = np.full(n, math.inf)
        self._ready = np.zeros(n)  # start time plus latency: when the flow begins drawing bandwidth
        self._rate = np.zeros(n)
        self._seq = np.zeros(n, dtype=np.int64)
        self._alive = np.zeros(n, dtype=bool)
        self._stale = False  # flows started since the rates were last allocated
        self._version = 0  # bumped whenever a flow's state changes (the finish times' cache key)
        self._times_key: tuple[float, int] | None = None
        self._times = np.zeros(0)

    # ---------------------------------------------------------------- public calls

    def start(self, key: _K, resources: Iterable[str], nbytes: float, now: float,
              latency: float = 0.0, cap: float = math.inf) -> None:
        """Add a flow of ``nbytes`` over ``resources`` at time ``now`` (the network's clock).

        It draws nothing for ``latency`` seconds, then at most ``cap`` bytes/s.  A
        resource listed twice is used once.
        """
        if key in self._slot:
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
        i = self._take_slot(len(res))
        self._slot[key] = i
        self._keys[i] = key
        self._res[i] = -1
        self._res[i, :len(res)] = [self._index[r] for r in res]
        self._remaining[i], self._cap[i], self._ready[i] = float(nbytes), float(cap), self.now + float(latency)
        self._rate[i], self._seq[i], self._alive[i] = 0.0, self._order, True
        self._order += 1
        self._version += 1
        self._stale = True  # rates are a function of the flows present: the flows started together share one allocation

    def next_completion(self) -> float | None:
        """When the next flow will finish if no other flow starts; None when the network is empty."""
        if not self._slot:
            return None
        self._fresh()
        t = self._next_event()
        if t is not None and self._finishing_by(t + _slack(t)).size:
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
                if self._slot:
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
        return {k: float(self._rate[i]) for k, i in self._slot.items()}

    def rate(self, key: _K) -> float:
        """The current rate of one unfinished flow."""
        if key not in self._slot:
            raise ExchangeError(f"no unfinished flow is keyed {key!r}.")
        self._fresh()
        return float(self._rate[self._slot[key]])

    def __len__(self) -> int:
        return len(self._slot)

    # ---------------------------------------------------------------- internals

    def _take_slot(self, width: int) -> int:
        if width > self._res.shape[1]:
            pad = np.full((self._res.shape[0], width - self._res.shape[1]), -1, dtype=np.int64)
            self._res = np.concatenate([self._res, pad], axis=1)
        if self._free:
            return self._free.pop()
        i = len(self._keys)
        self._keys.append(None)
        if i >= self._remaining.size:  # grow every array by doubling
            n = 2 * self._remaining.size
            self._res = np.concatenate([self._res, np.full_like(self._res, -1)])
            for name, fill in (("_remaining", 0.0), ("_cap", math.inf), ("_ready", 0.0), ("_rate", 0.0)):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.full(n - old.size, fill)]))
            self._seq = np.concatenate([self._seq, np.zeros(n - self._seq.size, dtype=np.int64)])
            self._alive = np.concatenate([self._alive, np.zeros(n - self._alive.size, dtype=bool)])
        return i

    def _fresh(self) -> None:
        """Allocate the rates if flows started since they were last allocated."""
        if self._stale:
            self._allocate()

    def _clone(self) -> FlowNetwork[_K]:
        other: FlowNetwork[_K] = FlowNetwork.__new__(FlowNetwork)
        other.__dict__.update(self.__dict__)
        for name in ("_res", "_remaining", "_cap", "_ready", "_rate", "_seq", "_alive"):
            setattr(other, name, getattr(self, name).copy())
        other._slot, other._keys, other._free = dict(self._slot), list(self._keys), list(self._free)
        other._stale = False
        other._times_key = None
        return other

    def _finish_times(self) -> np.ndarray:
        """When each slot's flow finishes at its current rate (inf for free slots and stalled flows); kept
        until the clock, a rate, a remainder or the set of flows changes (an event asks twice)."""
        key = (self.now, self._version)
        if self._times_key == key:
            return self._times
        self._times = self._compute_finish_times()
        self._times_key = key
        return self._times

    def _compute_finish_times(self) -> np.ndarray:
        now, rem, rate = self.now, self._remaining, self._rate
        ready = self._ready <= now
        with np.errstate(divide="ignore", invalid="ignore"):
            moving = np.where(rate > 0, now + rem / np.where(rate > 0, rate, 1.0), math.inf)
        at_once = (rem == 0) | (rate == math.inf)
        t = np.where(ready, np.where(at_once, now, moving), np.where(rem == 0, self._ready, math.inf))
        return np.where(self._alive, t, math.inf)

    def _finishing_by(self, limit: float) -> np.ndarray:
        """The slots of the flows that finish by ``limit``, in start order."""
        slots = np.flatnonzero(self._finish_times() <= limit)
        return slots[np.argsort(self._seq[slots], kind="stable")]

    def _next_event(self) -> float | None:
        """The next time a flow starts drawing bandwidth or finishes."""
        if not self._slot:
            return None
        waiting = self._alive & (self._ready > self.now)
        t = min(float(self._finish_times().min()), float(self._ready[waiting].min()) if waiting.any() else math.inf)
        return None if t == math.inf else t

    def _drain(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            moving = self._alive & (self._ready <= self.now) & (self._rate > 0)
            rest = self._remaining[moving] - self._rate[moving] * dt
            self._remaining[moving] = np.where(rest <= 0, 0.0, rest)  # a NaN stays NaN, not done
            self.now = t
            self._version += 1

    def _step(self, t: float) -> list[_K]:
        """Advance to the event time ``t``: finish what ends there, then reallocate."""
        before = self.now
        ending = self._finishing_by(t + _slack(t))
        self._drain(max(t, self.now))
        if not ending.size and self.now == before:  # an event that is no event (a NaN time): it would repeat forever
            raise self._no_progress(f"the next event time is {t!r}")
        keys = []
        for i in ending.tolist():
            key = self._keys[i]
            keys.append(key)
            del self._slot[key]  # type: ignore[arg-type]
            self._keys[i] = None
            self._alive[i] = False
            self._free.append(i)
        self._version += 1
        self._allocate()
        return keys  # type: ignore[return-value]

    def _no_progress(self, why: str) -> ExchangeError:
        """The error of a simulation that cannot move on, naming the flows that hold it up."""
        finish = self._finish_times()
        flows = dict(self._slot)
        stuck = {k: i for k, i in flows.items() if not math.isfinite(finish[i])
                 or not (math.isfinite(self._remaining[i]) and self._rate[i] == self._rate[i])}
        flows = stuck or flows
        shown = ", ".join(f"{k!r} (rate {float(self._rate[i])!r} B/s, {float(self._remaining[i])!r} bytes left)"
                          for k, i in list(flows.items())[:8]) + (f" and {len(flows) - 8} more" if len(flows) > 8
                                                                  else "")
        return ExchangeError(
            f"the flow simulation made no progress at t={self.now!r}: {why}, so no flow finishes and the clock "
            f"cannot move; flows involved: {shown}. A rate, size or time that is not a finite number reached "
            "the flow engine: check the topology's capacities and latencies and the sizes of the transfers.")

    def _allocate(self) -> None:
        """Max-min fair rates by progressive filling over the flows that are drawing bandwidth: every
        unfrozen flow's rate rises by the same step, the largest that fills no resource past its capacity
        and no flow past its cap; flows on a full resource or at their cap freeze; repeat."""
        self._stale = False
        self._version += 1
        self._rate[self._alive] = 0.0
        live = np.flatnonzero(self._alive & (self._ready <= self.now) & (self._remaining > 0))
        if not live.size:
            return
        residual = self._caps.copy()
        res = self._res[live]
        on = res >= 0
        unfrozen = np.ones(live.size, dtype=bool)
        n_res = self._caps.size
        while unfrozen.any():
            mine = res[unfrozen]
            users = np.bincount(mine[on[unfrozen]], minlength=n_res)
            used = users > 0
            flows = live[unfrozen]
            step = float((self._cap[flows] - self._rate[flows]).min())
            if used.any():
                step = min(step, float((residual[used] / users[used]).min()))
            if step == math.inf:  # no resource and no cap: the flow is instantaneous
                self._rate[flows] = math.inf
                break
            self._rate[flows] += step
            residual[used] -= step * users[used]
            full = used & (residual <= _FULL * self._caps)
            hit = (full[np.where(on[unfrozen], mine, 0)] & on[unfrozen]).any(axis=1)
            capped = self._rate[flows] >= self._cap[flows] * (1 - _FULL)
            unfrozen[unfrozen] = ~(hit | capped)

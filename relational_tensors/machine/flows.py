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
whole-plan simulator of a 72-GPU plan has thousands of flows at once.  The
filling keeps one level for every unfrozen flow and per resource its residual
and users, so a filling step is a few operations over the resources, and the
rates are allocated once per event time: after the flows that finish there and
the flows that start there, which share one allocation.

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
        nres = len(self.capacities)
        self._none = nres  # the index that pads a flow's resources: a resource without capacity or users
        # per resource, plus the padding one: its capacity, and the residual at or below which it is full
        self._caps = np.array([*self.capacities.values(), math.inf], dtype=np.float64)
        self._full_at = _FULL * self._caps
        self._full_at[nres] = -math.inf
        self._routes: dict[tuple[str, ...], tuple[list[int], float]] = {}  # resources -> (indices, least capacity)
        self.now = float(now)
        # the flows fill slots 0 .. len-1 of the arrays, in no particular order (a finished flow's slot
        # takes the last flow's); their start order breaks ties
        self._slot: dict[_K, int] = {}  # key -> its slot in the arrays
        self._keys: list[_K] = []  # slot -> key
        self._order = 0  # start order: flows that finish together are reported in it
        # flows started since the arrays were last written: (resource indices, bytes, cap, ready time,
        # the most bytes/s it could ever get); they take the slots after the written ones
        self._pending: list[tuple[list[int], float, float, float, float]] = []
        n = 16
        # each flow's resources, padded; 16-bit where they fit, as grouping the pairs by resource sorts them
        self._index_type = np.int16 if nres < np.iinfo(np.int16).max else np.int64
        self._res = np.full((n, 1), nres, dtype=self._index_type)
        self._remaining = np.zeros(n)
        self._cap = np.full(n, math.inf)
        self._ready = np.zeros(n)  # start time plus latency: when the flow begins drawing bandwidth
        self._rate = np.zeros(n)
        self._peak = np.full(n, math.inf)  # no rate exceeds this: its cap, and each resource's capacity
        self._seq = np.zeros(n, dtype=np.int64)
        # the rates are to be allocated anew, when next asked for: flows finished or began drawing
        # bandwidth.  They are a function of the flows drawing bandwidth, so starting a flow that
        # waits out a latency first (it draws nothing yet) leaves them as they are
        self._stale = False
        # a flow ran out of bytes while the clock moved between events (an event's slack): it stops
        # drawing bandwidth at the next allocation, which the next step or start makes
        self._drained = False
        self._capped = False  # a flow with a finite cap has started
        self._version = 0  # bumped whenever a flow's state changes (the finish times' cache key)
        self._times_key: tuple[float, int] | None = None
        self._times = np.zeros(0)
        self._next = math.inf  # with _times: the next time a flow starts drawing bandwidth or finishes
        # what next_completion's look-ahead found: (version, time, the network stepped to it, the keys
        # its last step finished); advance_to takes it over instead of taking the same steps again
        self._ahead: tuple[int, float, FlowNetwork[_K], list[_K]] | None = None

    # ---------------------------------------------------------------- public calls

    def start(self, key: _K, resources: Iterable[str], nbytes: float, now: float,
              latency: float = 0.0, cap: float = math.inf) -> None:
        """Add a flow of ``nbytes`` over ``resources`` at time ``now`` (the network's clock).

        It draws nothing for ``latency`` seconds, then at most ``cap`` bytes/s.  A
        resource listed twice is used once.
        """
        slot = self._slot
        if key in slot:
            raise ExchangeError(f"a flow keyed {key!r} is already in the network; give each flow its own key.")
        clock = self.now
        if now != clock and not abs(now - clock) <= _slack(clock):  # the slack advance_to allows; NaN too
            raise ExchangeError(
                f"flows start at the network's clock; got now={now!r} while the clock is {clock!r}. "
                "Call advance_to(now) first and handle the flows it completes.")
        try:
            route = self._routes.get(resources)  # type: ignore[call-overload]
        except TypeError:  # not hashable: a list, a generator
            route = None
        if route is None:
            route = self._route(key, resources)
        if not (is_number(nbytes) and 0 <= nbytes < math.inf and is_number(latency) and 0 <= latency < math.inf
                and is_number(cap) and cap > 0):  # NaN fails the comparisons
            for what, value in (("nbytes", nbytes), ("latency", latency)):
                if not (is_number(value) and 0 <= value < math.inf):
                    raise ExchangeError(f"flow {key!r} needs {what} to be a finite number >= 0; "
                                        f"got {what}={value!r}.")
            raise ExchangeError(f"flow {key!r} needs cap to be a number of bytes/s > 0 (inf for no cap); "
                                f"got cap={cap!r}.")
        ids, least = route
        nbytes, cap = float(nbytes), float(cap)
        ready = clock + float(latency)
        slot[key] = len(self._keys)
        self._keys.append(key)
        self._pending.append((ids, nbytes, cap, ready, least if least < cap else cap))
        self._order += 1
        self._version += 1
        if cap < math.inf:
            self._capped = True
        if (ready <= clock and nbytes > 0) or self._drained:  # the flows drawing bandwidth changed
            self._stale = True  # (the flows started together share one allocation)

    def _route(self, key: _K, resources: Iterable[str]) -> tuple[list[int], float]:
        """A flow's resources as indices (each once), and the least capacity among them; kept per tuple."""
        res = tuple(dict.fromkeys(resources))
        unknown = [r for r in res if r not in self.capacities]
        if unknown:
            raise ExchangeError(f"flow {key!r} uses unknown resources {unknown}; known: {sorted(self.capacities)}.")
        route = ([self._index[r] for r in res], min((self.capacities[r] for r in res), default=math.inf))
        if type(resources) is tuple:
            self._routes[resources] = route
        return route

    def next_completion(self) -> float | None:
        """When the next flow will finish if no other flow starts; None when the network is empty."""
        if not self._slot:
            return None
        t = self._next_event()
        if t is not None and (self._times <= t + _slack(t)).any():
            return t  # the next event finishes a flow: no need to step a copy of the network to it
        version = self._version
        probe = self._clone()
        while True:
            t = probe._next_event()
            if t is None:  # flows remain, and none of them will ever start or finish
                raise probe._no_progress("no flow can ever finish")
            keys = probe._step(t)
            if keys:
                self._ahead = (version, t, probe, keys)  # what advance_to(t) would do first
                return t

    def advance_to(self, t: float) -> list[_K]:
        """Move the clock to ``t``; the keys of the flows that finished by then, in finishing order."""
        if not (is_number(t) and math.isfinite(t)):
            raise ExchangeError(f"the clock moves to a finite time only; got t={t!r} while it is at {self.now!r}.")
        if t < self.now - _slack(self.now):
            raise ExchangeError(f"the clock only moves forward; got t={t!r} while it is at {self.now!r}.")
        done: list[_K] = []
        limit = t + _slack(t)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self._version and ahead[1] <= limit:
            # the look-ahead took the steps this loop starts with (each of its events is by ``limit``)
            self.__dict__.update(ahead[2].__dict__)
            done.extend(ahead[3])
            if self._stale and self._quiet_until(limit):
                self._drain(max(t, self.now))
                return done
        while True:
            te = self._next_event()
            if te is None:
                if self._slot:
                    raise self._no_progress("no flow can ever finish")
                break
            if te > limit:
                break
            done.extend(self._step(te))
            if self._stale and self._quiet_until(limit):
                break  # no event left by ``limit``: the next allocation waits for the flows that start now
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

    @property
    def _alive(self) -> np.ndarray:
        """Which slots of the arrays hold a flow (the first ``len(self)``), as a mask over all of them."""
        self._write_pending()
        alive = np.zeros(self._remaining.size, dtype=bool)
        alive[:len(self._keys)] = True
        return alive

    def _write_pending(self) -> None:
        """Write the flows started since the last call into their slots, growing the arrays as needed."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        n = len(self._keys)
        lo = n - len(pending)
        width = max(len(p[0]) for p in pending)
        if width > self._res.shape[1]:
            pad = np.full((self._res.shape[0], width - self._res.shape[1]), self._none, dtype=self._index_type)
            self._res = np.concatenate([self._res, pad], axis=1)
        if n > self._remaining.size:  # grow every array by doubling
            size = max(2 * self._remaining.size, n)
            grow = size - self._remaining.size
            self._res = np.concatenate([self._res, np.full((grow, self._res.shape[1]), self._none,
                                                           dtype=self._index_type)])
            for name, fill in (("_remaining", 0.0), ("_cap", math.inf), ("_ready", 0.0), ("_rate", 0.0),
                               ("_peak", math.inf)):
                setattr(self, name, np.concatenate([getattr(self, name), np.full(grow, fill)]))
            self._seq = np.concatenate([self._seq, np.zeros(grow, dtype=np.int64)])
        ids, nbytes, caps, ready, peak = zip(*pending)
        block = self._res[lo:n]
        block[:] = self._none
        if all(len(i) == width for i in ids):
            block[:, :width] = ids
        else:
            for row, i in zip(block, ids):
                row[:len(i)] = i
        self._remaining[lo:n] = nbytes
        self._cap[lo:n] = caps
        self._ready[lo:n] = ready
        self._peak[lo:n] = peak
        self._rate[lo:n] = 0.0
        self._seq[lo:n] = np.arange(self._order - len(pending), self._order)

    def _remove(self, slots: list[int]) -> None:
        """Free the (distinct, written) slots: the last flows move into the freed slots before them."""
        n = len(self._keys)
        gone = set(slots)
        keep = n - len(gone)
        holes = sorted(i for i in gone if i < keep)
        if holes:
            movers = [j for j in range(keep, n) if j not in gone]
            for a in (self._res, self._remaining, self._cap, self._ready, self._rate, self._peak, self._seq):
                a[holes] = a[movers]
            keys, slot = self._keys, self._slot
            for i, j in zip(holes, movers):
                key = keys[j]
                keys[i] = key
                slot[key] = i
        del self._keys[keep:]

    def _fresh(self) -> None:
        """Write the flows started since, and allocate the rates if the flows drawing bandwidth changed."""
        if self._pending:
            self._write_pending()
        if self._stale:
            self._allocate()

    def _clone(self) -> FlowNetwork[_K]:
        self._fresh()
        other: FlowNetwork[_K] = FlowNetwork.__new__(FlowNetwork)
        other.__dict__.update(self.__dict__)
        n = max(len(self._keys), 1)
        for name in ("_res", "_remaining", "_cap", "_ready", "_rate", "_peak", "_seq"):
            setattr(other, name, getattr(self, name)[:n].copy())
        other._slot, other._keys, other._pending = dict(self._slot), list(self._keys), []
        other._times_key = None
        other._ahead = None
        return other

    def _finish_times(self) -> np.ndarray:
        """When each flow finishes at its current rate (inf for stalled flows), by slot; kept until the
        clock, a rate, a remainder or the set of flows changes (an event asks twice)."""
        self._fresh()
        key = (self.now, self._version)
        if self._times_key == key:
            return self._times
        n = len(self._keys)
        now, rem, rate, ready_at = self.now, self._remaining[:n], self._rate[:n], self._ready[:n]
        ready = ready_at <= now
        with np.errstate(divide="ignore", invalid="ignore"):
            moving = np.where(rate > 0, now + rem / np.where(rate > 0, rate, 1.0), math.inf)
        empty = rem == 0
        at_once = empty | (rate == math.inf)
        self._times = np.where(ready, np.where(at_once, now, moving), np.where(empty, ready_at, math.inf))
        # a waiting flow's next event is when it starts drawing bandwidth (a zero-byte one's: also its end)
        self._next = float(np.where(ready, self._times, ready_at).min()) if n else math.inf
        self._times_key = key
        return self._times

    def _finishing_by(self, limit: float) -> np.ndarray:
        """The slots of the flows that finish by ``limit``, in start order."""
        slots = np.flatnonzero(self._finish_times() <= limit)
        if slots.size > 1:
            slots = slots[np.argsort(self._seq[slots], kind="stable")]
        return slots

    def _next_event(self) -> float | None:
        """The next time a flow starts drawing bandwidth or finishes."""
        if not self._slot:
            return None
        self._finish_times()
        t = self._next
        return None if t == math.inf else t

    def _quiet_until(self, limit: float) -> bool:
        """Whether no flow can start drawing bandwidth or finish by ``limit``, whatever rates the next
        allocation gives (none exceeds a flow's peak); False when unsure."""
        if self._pending:
            self._write_pending()
        n = len(self._keys)
        if not n:
            return False
        now, ready_at = self.now, self._ready[:n]
        with np.errstate(divide="ignore", invalid="ignore"):
            soonest = np.where(ready_at > now, ready_at, now + self._remaining[:n] / (self._peak[:n] * (1 + 1e-6)))
        return bool(soonest.min() > limit)  # NaN: unsure

    def _drain(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            self._fresh()
            n = len(self._keys)
            rem, rate, ready_at = self._remaining[:n], self._rate[:n], self._ready[:n]
            moving = (ready_at <= self.now) & (rate > 0)
            rest = rem[moving] - rate[moving] * dt
            done = rest <= 0
            rem[moving] = np.where(done, 0.0, rest)  # a NaN stays NaN, not done
            if done.any():
                self._drained = True
            self.now = t
            self._version += 1

    def _step(self, t: float) -> list[_K]:
        """Advance to the event time ``t``: finish what ends there.  The rates are allocated anew when
        next asked for: after the flows that start at ``t``, which share that allocation."""
        before = self.now
        ending = self._finishing_by(t + _slack(t)).tolist()
        self._drain(max(t, self.now))
        if not ending and self.now == before:  # an event that is no event (a NaN time): it would repeat forever
            raise self._no_progress(f"the next event time is {t!r}")
        keys = [self._keys[i] for i in ending]
        for key in keys:
            del self._slot[key]
        if ending:
            self._remove(ending)
        self._version += 1
        self._stale = True  # flows finished or began drawing bandwidth at t
        return keys

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
        and no flow past its cap; flows on a full resource or at their cap freeze; repeat.

        Every unfrozen flow has the same rate, the sum of the steps so far, so the filling keeps that
        one level, per resource its residual capacity and its unfrozen users, and per flow the level it
        froze at: a step costs a few operations over the resources, and freezing a flow touches only
        the resources it uses."""
        self._stale = self._drained = False
        self._version += 1
        n = len(self._keys)
        rates = self._rate[:n]
        rates.fill(0.0)
        live = ((self._ready[:n] <= self.now) & (self._remaining[:n] > 0)).nonzero()[0]
        m = live.size
        if not m:
            return
        res = self._res[live]
        nres = self._none + 1
        width = res.shape[1]
        flat = res.ravel()
        counts = np.bincount(flat, minlength=nres)
        users = counts.astype(np.float64)  # unfrozen flows on each resource
        order = np.argsort(flat, kind="stable")
        by_resource = order // width if width > 1 else order  # each (flow, resource) pair's flow, by resource
        first = [0, *counts.cumsum().tolist()]  # resource r's pairs: by_resource[first[r]:first[r + 1]]
        on: np.ndarray | None = None  # each pair's resource, by resource (made when several fill at once)
        residual = self._caps.copy()  # the padding resource's stays inf: never the bottleneck, never full
        full_at = self._full_at
        if self._capped:
            caps = self._cap[live]
            capped_at = caps * (1 - _FULL)
        level = np.empty(m)
        unfrozen = np.ones(m, dtype=bool)
        left = m
        filled = 0.0  # every unfrozen flow's rate
        with np.errstate(divide="ignore", invalid="ignore"):  # a resource nobody uses: inf / 0
            while left:
                step = float((residual / users).min())
                if self._capped:
                    step = min(float(caps[unfrozen].min()) - filled, step)
                if step == math.inf:  # no resource and no cap: the flow is instantaneous
                    level[unfrozen] = math.inf
                    break
                filled += step
                residual -= step * users
                full = (residual <= full_at).nonzero()[0]
                if full.size == 1:
                    r = int(full[0])
                    frozen = by_resource[first[r]:first[r + 1]]
                    frozen = frozen[unfrozen[frozen]]
                else:
                    if on is None:
                        on = flat[order]
                    hit = np.zeros(nres, dtype=bool)
                    hit[full] = True
                    freeze = np.zeros(m, dtype=bool)
                    freeze[by_resource[hit[on]]] = True
                    frozen = (freeze & unfrozen).nonzero()[0]
                if self._capped:
                    frozen = np.union1d(frozen, (unfrozen & (filled >= capped_at)).nonzero()[0])
                residual[full] = math.inf  # each of its users freezes now: it is never full again
                level[frozen] = filled
                unfrozen[frozen] = False
                left -= frozen.size
                users -= np.bincount(res[frozen].ravel(), minlength=nres)
        rates[live] = level

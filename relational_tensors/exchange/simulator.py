"""The hardware simulator of section 5.2: how long an exchange program takes on a topology.

The program body is a set.  An action ``X @ s -> D`` becomes eligible the
moment site ``s`` holds pairwise-disjoint aggregates that union to ``X``, and
every eligible action runs at once.  It is a two-stage pipeline:

1. aggregation at ``s``: reading the ``m`` parts and writing ``X``, ``(m+1)·|X|``
   bytes through the site's HBM resource ``hbm(s)`` (shared with every other
   aggregation at ``s``).  Skipped when ``X`` is already at ``s``; when another
   action is already aggregating ``X`` at ``s``, it waits for that result instead
   of doing the work twice.  The result materializes ``X`` at ``s``.
2. one flow of ``|X|`` bytes per destination over the topology's route, with the
   route's latency; arrival materializes ``X`` at the destination.  The ``k``
   flows of a multicast share the source's egress, so on a switch each gets
   ``1/k`` of it.

An action without destinations is stage 1 alone; an action whose source is a
partition runs at every site of it.  The size of an aggregate is the size of
its atoms (copies of one block, so they share one size).  The run ends when
nothing more can fire; it is valid when every action fired and every OUT
requirement holds.  Kernel launches are not charged: moving and combining bytes
is the whole cost.

>>> from relational_tensors.exchange.ast import Action, ExProg, InAtom, Requirement
>>> AB = frozenset("AB")
>>> prog = ExProg((0, 1), inputs=(InAtom("A", 0), InAtom("B", 1)), outputs=(Requirement(AB, (1,)),),
...               body=frozenset({Action(frozenset("A"), 0, (1,)), Action(AB, 1)}))
>>> r = simulate(prog, "dgx-a100")
>>> r.valid, round(r.time * 1e3, 3), [e.kind for e in r.trace]
(True, 5.265, ['transfer', 'aggregate'])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg, aggregate_text, exact_cover
from relational_tensors.exchange.closure import free_sites, membership_moves, memberships
from relational_tensors.machine.flows import FlowNetwork
from relational_tensors.machine.machines import get_topology
from relational_tensors.machine.topology import Topology

__all__ = ["TraceEntry", "SimResult", "simulate", "MAX_EXHAUSTIVE"]

MAX_EXHAUSTIVE = 5040  # up to this many memberships (7 partitions of one GPU over 7) every one is simulated
_MAX_SCAN = 5040       # beyond it: how many choices to scan for a valid starting point of the local search
_MAX_ROUNDS = 64       # and how many improving moves the local search may make
_TOL = 1e-9            # relative: times closer than this are ties


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One stage of one action at one site: an aggregation (``dest`` None) or a transfer to ``dest``."""

    action: Action
    kind: str  # "aggregate" or "transfer"
    site: int
    dest: int | None
    start: float
    end: float
    bytes: int


@dataclass(frozen=True)
class SimResult:
    """The completion time of a program, what ran when, and whether it reached OUT.

    ``membership`` gives every partition's sites.  ``unfired`` lists the
    (action, site) pairs that never became eligible and ``unmet`` the
    (aggregate, site) requirements of OUT that did not hold.  ``search`` says how
    the membership was found: ``"fixed"`` (given, or no partition declared by
    size), ``"exhaustive"`` or ``"local"`` (see :func:`simulate`).
    """

    time: float
    trace: tuple[TraceEntry, ...]
    membership: Mapping[str, tuple[int, ...]] = field(hash=False)
    valid: bool
    unfired: tuple[tuple[Action, int], ...] = ()
    unmet: tuple[tuple[frozenset[str], int], ...] = ()
    search: str = "fixed"

    @property
    def busy(self) -> float:
        """The summed duration of every stage: the tie-breaker between equally fast memberships."""
        return sum(e.end - e.start for e in self.trace)


def simulate(prog: ExProg, topology: Topology | str,
             membership: Mapping[str, tuple[int, ...]] | None = None) -> SimResult:
    """Simulate ``prog`` on ``topology`` (a :class:`Topology` or a registered name).

    Partitions declared by size take their sites from ``membership``.  When it
    is None, the choice is searched: with at most :data:`MAX_EXHAUSTIVE`
    possible memberships every one is simulated; beyond that a local search
    (swap two sites between partitions, or a partition site with a free GPU)
    starts from the first valid choice.  The fastest valid run wins, ties going
    to the smaller summed stage time, then to the earlier choice.  With no valid
    choice the first choice's (invalid) run is returned; a local search that finds
    no valid start among the first choices raises ExchangeError instead.
    """
    top = get_topology(topology) if isinstance(topology, str) else topology
    _check_program(prog, top)
    actions = sorted(prog.body, key=_action_key)
    sized = [p for p in prog.partitions if p.members is None]
    if membership is not None or not sized:
        return _run(prog, top, _full_membership(prog, top, membership or {}), actions)
    count = _count_memberships(prog)
    if count == 0:
        raise ExchangeError(
            f"no membership fits the sized partitions {[(p.name, p.size) for p in sized]} into the GPUs "
            f"{prog.gpus} left by the explicit partitions; shrink the partitions or declare more GPUs.")
    if count <= MAX_EXHAUSTIVE:
        best: SimResult | None = None
        for choice in memberships(prog):
            full = _full_membership(prog, top, choice)
            if _closure_valid(prog, full, actions):
                best = _better(best, _run(prog, top, full, actions, "exhaustive"))
        first = _full_membership(prog, top, next(memberships(prog)))
        return best or _run(prog, top, first, actions, "exhaustive")
    start = next((full for choice in itertools.islice(memberships(prog), _MAX_SCAN)
                  if _closure_valid(prog, full := _full_membership(prog, top, choice), actions)), None)
    if start is None:
        raise ExchangeError(
            f"none of the first {_MAX_SCAN} of {count} memberships of {[p.name for p in sized]} makes the "
            "program valid; pass membership= explicitly.")
    best = _run(prog, top, start, actions, "local")
    for _ in range(_MAX_ROUNDS):
        step = None
        for full in _neighbours(prog, best.membership):
            if _closure_valid(prog, full, actions):
                step = _better(step, _run(prog, top, full, actions, "local"))
        if step is None or _better(best, step) is best:
            break
        best = step
    return best


def _count_memberships(prog: ExProg) -> int:
    count, left = 1, len(free_sites(prog))
    for p in prog.partitions:
        if p.members is None:
            count *= math.comb(left, p.size) if p.size <= left else 0
            left -= p.size
    return count


def _better(a: SimResult | None, b: SimResult) -> SimResult:
    """The better of two runs: valid, then faster, then less summed stage time; ``a`` on a tie."""
    if a is None:
        return b
    if a.valid != b.valid:
        return a if a.valid else b
    if b.time < a.time * (1 - _TOL):
        return b
    if b.time <= a.time * (1 + _TOL) and b.busy < a.busy * (1 - _TOL):
        return b
    return a


def _neighbours(prog: ExProg, membership: Mapping[str, tuple[int, ...]]) -> Iterator[dict[str, tuple[int, ...]]]:
    """Memberships one move away: two sized partitions swap a site, or one trades a site for a free GPU."""
    used = {s for sites in membership.values() for s in sites}
    free = [g for g in free_sites(prog) if g not in used]
    for _, moved, _ in membership_moves(membership, [p.name for p in prog.partitions if p.members is None], free):
        yield moved


# ------------------------------------------------------------------------ checks


def _place_key(place: int | str) -> tuple[int, int, str]:
    return (0, place, "") if isinstance(place, int) else (1, 0, place)


def _action_key(a: Action) -> tuple:
    return (aggregate_text(a.aggregate), _place_key(a.source), tuple(_place_key(d) for d in a.dests))


def _check_program(prog: ExProg, top: Topology) -> None:
    """Sites within GPUS and the topology, partitions declared, aggregates of one atom size."""
    outside = sorted(set(prog.gpus) - set(top.sites))
    if outside:
        raise ExchangeError(f"GPUS {prog.gpus} names sites {outside} that topology {top.name!r} lacks "
                            f"(it has {top.sites}); pick a larger topology or fewer GPUs.")
    names = {p.name for p in prog.partitions}
    used: list[tuple[str, int | str]] = [("IN", a.site) for a in prog.inputs]
    used += [("OUT", t) for r in prog.outputs for t in r.targets]
    for a in prog.body:
        used += [(f"action {aggregate_text(a.aggregate)} @ {a.source}", p) for p in (a.source, *a.dests)]
    used += [(f"partition {p.name}", s) for p in prog.partitions for s in (p.members or ())]
    for where, place in used:
        if isinstance(place, str):
            if place not in names:
                raise ExchangeError(f"{where} names partition {place!r}, which PARTITIONS does not declare "
                                    f"(declared: {sorted(names)}).")
        elif place not in prog.gpus:
            raise ExchangeError(f"{where} names site {place}, which is not in GPUS {prog.gpus}; add it to GPUS.")
    sizes: dict[str, set[int]] = {}
    for inp in prog.inputs:
        sizes.setdefault(inp.atom, set()).add(inp.size)
    uneven = {atom: s for atom, s in sizes.items() if len(s) > 1}
    if uneven:
        raise ExchangeError(f"an atom has one size wherever it lives; got {uneven}.")
    for agg in [a.aggregate for a in prog.body] + [r.aggregate for r in prog.outputs]:
        distinct = {next(iter(sizes[x])) for x in agg if x in sizes}
        if len(distinct) > 1:
            raise ExchangeError(
                f"the atoms of aggregate {aggregate_text(agg)} are copies of one block and need one size; "
                f"got sizes {sorted(distinct)} bytes.")


def _full_membership(prog: ExProg, top: Topology,
                     given: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every partition's sites: explicit ones as declared, sized ones from ``given`` (checked)."""
    names = {p.name for p in prog.partitions}
    extra = sorted(set(given) - names)
    if extra:
        raise ExchangeError(f"membership names partitions {extra} that PARTITIONS does not declare.")
    full: dict[str, tuple[int, ...]] = {}
    for p in prog.partitions:
        sites = tuple(p.members) if p.members is not None else tuple(given.get(p.name, ()))
        if p.members is not None and p.name in given and tuple(given[p.name]) != sites:
            raise ExchangeError(f"partition {p.name} is declared as {sites}; membership says {given[p.name]}.")
        if len(sites) != p.size or len(set(sites)) != p.size or not set(sites) <= set(prog.gpus):
            raise ExchangeError(f"partition {p.name} needs {p.size} distinct sites from GPUS {prog.gpus}; "
                                f"got {sites or 'none'} (pass membership={{{p.name!r}: (...)}}).")
        full[p.name] = sites
    seen: dict[int, str] = {}
    for name, sites in full.items():
        for s in sites:
            if s in seen:
                raise ExchangeError(f"partitions are disjoint; site {s} is in both {seen[s]} and {name}.")
            seen[s] = name
    outside = sorted(set(seen) - set(top.sites))
    if outside:
        raise ExchangeError(f"membership uses sites {outside} that topology {top.name!r} lacks.")
    return full


def _sites(prog: ExProg, place: int | str, membership: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    return (place,) if isinstance(place, int) else membership[place]


def _instances(prog: ExProg, membership: Mapping[str, tuple[int, ...]],
               actions: list[Action]) -> list[tuple[Action, int]]:
    return [(a, s) for a in actions for s in _sites(prog, a.source, membership)]


def _dests(prog: ExProg, action: Action, site: int, membership: Mapping[str, tuple[int, ...]]) -> list[int]:
    out = dict.fromkeys(d for place in action.dests for d in _sites(prog, place, membership))
    return [d for d in out if d != site]


def _closure_valid(prog: ExProg, membership: Mapping[str, tuple[int, ...]], actions: list[Action]) -> bool:
    """Untimed validity, judged by the closure of Definition 5.5 (the one judge of validity)."""
    from relational_tensors.exchange.closure import check

    sized = {name: sites for name, sites in membership.items()
             if (part := prog.partition(name)) is not None and part.members is None}
    try:
        check(prog.with_body(actions), sized)
    except ExchangeError:
        return False
    return True


# ------------------------------------------------------------------------ the timed run


def _run(prog: ExProg, top: Topology, membership: dict[str, tuple[int, ...]], actions: list[Action],
         search: str = "fixed") -> SimResult:
    sizes = prog.atom_sizes()
    net: FlowNetwork[tuple] = FlowNetwork(top.capacities())  # keyed ("aggregate", X, s) or ("transfer", action, s, d)
    state: dict[int, set[frozenset[str]]] = {g: set() for g in prog.gpus}
    for a in prog.inputs:
        state[a.site].add(frozenset({a.atom}))
    waiting: dict[int, list[tuple[Action, int]]] = {}
    for inst in _instances(prog, membership, actions):
        waiting.setdefault(inst[1], []).append(inst)
    aggregating: dict[tuple[frozenset[str], int], list[Action]] = {}
    started: dict[tuple, tuple[Action, float, int]] = {}
    trace: list[TraceEntry] = []

    def size(agg: frozenset[str]) -> int:
        return sizes[next(iter(agg))]

    def send(action: Action, s: int, now: float) -> None:
        for d in _dests(prog, action, s, membership):
            route = top.route(s, d)
            key = ("transfer", action, s, d)
            net.start(key, route.resources, size(action.aggregate), now, latency=route.latency)
            started[key] = (action, now, size(action.aggregate))

    def fire(sites: set[int], now: float) -> None:
        for s in sorted(sites):
            still = []
            for action, site in waiting.get(s, ()):
                x = action.aggregate
                cover = exact_cover(x, state[s])
                if cover is None:
                    still.append((action, site))
                elif x in state[s]:
                    send(action, s, now)
                elif (x, s) in aggregating:
                    aggregating[(x, s)].append(action)
                else:
                    nbytes = (len(cover) + 1) * size(x)
                    key = ("aggregate", x, s)
                    net.start(key, (top.hbm(s),), nbytes, now)
                    started[key] = (action, now, nbytes)
                    aggregating[(x, s)] = [action]
            waiting[s] = still

    fire(set(waiting), 0.0)
    while (t := net.next_completion()) is not None:
        changed: set[int] = set()
        for key in net.advance_to(t):
            action, t0, nbytes = started.pop(key)
            if key[0] == "aggregate":
                _, x, s = key
                trace.append(TraceEntry(action, "aggregate", s, None, t0, t, nbytes))
                state[s].add(x)
                changed.add(s)
                for waiter in aggregating.pop((x, s)):
                    send(waiter, s, t)
            else:
                _, _, s, d = key
                trace.append(TraceEntry(action, "transfer", s, d, t0, t, nbytes))
                state[d].add(action.aggregate)
                changed.add(d)
        fire(changed, t)

    unfired = tuple(inst for s in sorted(waiting) for inst in waiting[s])
    unmet = tuple((r.aggregate, s) for r in prog.outputs for t in r.targets
                  for s in _sites(prog, t, membership) if r.aggregate not in state[s])
    trace.sort(key=lambda e: (e.start, e.end, e.site, -1 if e.dest is None else e.dest, _action_key(e.action)))
    valid = not unfired and not unmet and _closure_valid(prog, membership, actions)
    return SimResult(max((e.end for e in trace), default=0.0), tuple(trace), membership,
                     valid, unfired, unmet, search)

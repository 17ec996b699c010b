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
>>> from relational_tensors.machine.machines import get_topology
>>> r = simulate(prog, get_topology("dgx-a100"))
>>> r.valid, round(r.time * 1e3, 3), [e.kind for e in r.trace]
(True, 5.265, ['transfer', 'aggregate'])

A program with partitions declared by size runs under the membership it is given;
:func:`~relational_tensors.exchange.membership.fastest_membership` searches for the best one.
:func:`better` is the one order on runs, for that search and the body search alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg, aggregate_text, exact_cover
from relational_tensors.exchange.closure import check
from relational_tensors.machine.flows import FlowNetwork
from relational_tensors.machine.topology import Topology

__all__ = ["TraceEntry", "SimResult", "simulate", "better", "check_topology", "TIME_TOL", "BUSY_TOL"]

TIME_TOL = 1e-9   # relative: a run must be this much faster to count as faster
BUSY_TOL = 1e-6   # relative: and a run no slower this much less busy to count as less busy


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
    the membership was found: ``"fixed"`` (given to :func:`simulate`, or no partition
    declared by size), ``"exhaustive"`` or ``"local"`` (see
    :func:`~relational_tensors.exchange.membership.fastest_membership`).
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
        """The summed duration of every stage: the tie-breaker between equally fast runs."""
        return sum(e.end - e.start for e in self.trace)


def better(a: SimResult | None, b: SimResult) -> bool:
    """Whether run ``b`` beats run ``a`` (every run beats None).

    A valid run beats an invalid one.  Between two of the same validity, ``b`` wins when it is
    faster by more than :data:`TIME_TOL` (relative), or when it is no slower at all and its summed
    stage time (:attr:`SimResult.busy`) is lower by more than :data:`BUSY_TOL`.  Anything else is a
    tie, and a tie keeps ``a``: the run found first.  "No slower at all" makes a search that only
    takes better runs never end slower than it started, and the busy tolerance keeps it from
    taking runs that differ from the current one by float rounding alone.

    >>> from relational_tensors.machine.machines import get_topology
    >>> from relational_tensors.exchange.text import parse
    >>> top = get_topology("dgx-a100")
    >>> direct = simulate(parse("GPUS: 0 1 2\\nIN: A @ 0\\nOUT: A @ 1, 2\\nA @ 0 -> 1, 2"), top)
    >>> relayed = simulate(parse("GPUS: 0 1 2\\nIN: A @ 0\\nOUT: A @ 1, 2\\nA @ 0 -> 1; A @ 1 -> 2"), top)
    >>> better(direct, relayed), better(relayed, direct), better(direct, direct)  # relayed: one latency more
    (False, True, False)
    """
    if a is None:
        return True
    if a.valid != b.valid:
        return b.valid
    if b.time < a.time * (1 - TIME_TOL):
        return True
    return b.time <= a.time and b.busy < a.busy * (1 - BUSY_TOL)


def check_topology(topology: object, where: str) -> Topology:
    """``topology``, when it is a :class:`Topology`; ExchangeError otherwise (a name is resolved by the caller)."""
    if isinstance(topology, Topology):
        return topology
    shown = f"the {type(topology).__name__} {topology!r}"
    fix = f"pass get_topology({topology!r})" if isinstance(topology, str) else "build one with get_topology(name)"
    raise ExchangeError(f"{where} takes a Topology; got {shown}; {fix} "
                        "(from relational_tensors.machine.machines).")


def simulate(prog: ExProg, topology: Topology,
             membership: Mapping[str, tuple[int, ...]] | None = None) -> SimResult:
    """Simulate ``prog`` on ``topology`` under ``membership``.

    ``membership`` gives the partitions declared by size their sites; it may be left out when
    there are none.  To choose it, call
    :func:`~relational_tensors.exchange.membership.fastest_membership` instead.
    """
    top = check_topology(topology, "simulate")
    _check_program(prog, top)
    actions = sorted(prog.body, key=_action_key)
    return _run(prog, top, _full_membership(prog, top, membership or {}), actions)


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
                                f"got {sites or 'none'}; pass membership={{{p.name!r}: (...)}}, or call "
                                "fastest_membership(prog, topology) to choose one.")
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
    sized = {name: sites for name, sites in membership.items()
             if (part := prog.partition(name)) is not None and part.members is None}
    try:
        check(prog.with_body(actions), sized)
    except ExchangeError:
        return False
    return True


# ------------------------------------------------------------------------ the timed run


def _run(prog: ExProg, top: Topology, membership: dict[str, tuple[int, ...]], actions: list[Action]) -> SimResult:
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
    return SimResult(max((e.end for e in trace), default=0.0), tuple(trace), membership, valid, unfired, unmet)

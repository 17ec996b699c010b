"""Exchange-program search (section 5.4): rewrite the naive body, keep what the simulator likes.

The search starts from the naive program of :mod:`~relational_tensors.physical.lower`
(each reader gathers the atoms of what it needs and aggregates them itself) and
climbs with the paper's rewrite rules, each applied to one action of the body:

``fission`` / ``fusion``
    ``X @ s -> D1, D2`` ⇄ ``X @ s -> D1; X @ s -> D2``.
``relay`` / ``relay-elimination``
    ``X @ s -> d`` ⇄ ``X @ s -> r; X @ r -> d``: around a slow link or a shared bridge.
``pushdown`` / ``pullup``
    ``X @ r -> d; Y @ r -> d`` ⇄ ``X+Y @ r -> d``.  Pushdown also takes the two-hop form
    ``X @ q -> d; Y @ r -> d`` ⇒ ``X @ q -> r; X+Y @ r -> d``, which grows a reduction
    tree by one edge.
``substitution``
    draw the copy of ``X`` at a site from another site that holds ``X`` or can form it.
``swap`` / ``move``
    the membership of partitions declared by size: two trade a site, or one takes a free GPU.

A proposal is tidied before it is judged: actions that never fire are dropped, a
requirement that a rewrite broke is fetched again from the best-connected site holding
it (or gathered there, as naive does), and actions whose results nothing uses are
deleted.  Each round rewrites a few actions drawn by how late they finish in the
current run, ranks the proposals by a contention bound (the busiest resource's load,
then the total load), and judges the best few: checked by
:func:`~relational_tensors.exchange.closure.check` under their membership, costed by
:func:`~relational_tensors.exchange.simulator.simulate`.  The first that beats the
current program (faster, or as fast with less summed stage time) replaces it.
Membership moves are proposed in the first round and after every round that found
nothing.  The search ends after a few fruitless rounds in a row, after ``max_steps``
judged proposals, or when ``budget_s`` is spent.  Only improvements are taken, so
the result is never slower than naive; for one seed it is deterministic unless the
time budget is what stops it.  A program whose naive run is within 0.1% of its
:func:`lower_bound` (the busiest endpoint's unavoidable bytes over its bandwidth) is
not searched: no body could gain more.

:class:`~relational_tensors.exchange.searcher.Searcher` searches the programs of one
lowering under one step limit for all of them; :mod:`~relational_tensors.exchange.bound`
gives the lower bound.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg, aggregate_text, exact_cover
from relational_tensors.exchange.bound import at_bound, lower_bound
from relational_tensors.exchange.closure import check, membership_moves, memberships
from relational_tensors.exchange.naive import Membership, naive_body
from relational_tensors.exchange.simulator import SimResult, simulate
from relational_tensors.machine.machines import get_topology
from relational_tensors.machine.topology import Topology

__all__ = ["SearchResult", "search_program", "lower_bound", "RULES"]

RULES = ("fission", "fusion", "relay", "relay-elimination", "pushdown", "pullup", "substitution", "swap", "move")

_TOL = 1e-9        # relative: simulated times closer than this are ties
_PER_ROUND = 6     # proposals judged per round, best-ranked first
_HOT = 5           # actions rewritten per round, drawn by how late they finish
_PATIENCE = 3      # fruitless rounds in a row before the search stops
_BRANCH = 3        # relay sites and substitute sources tried per destination

_Pair = tuple[frozenset, int]                 # (aggregate, site)
_Sites = dict[str, tuple[int, ...]]            # a membership


class _Step(NamedTuple):
    """An action whose places are all sites: what the search rewrites (naive writes only sites)."""

    aggregate: frozenset
    source: int
    dests: tuple[int, ...] = ()

    def action(self) -> Action:
        return Action(self.aggregate, self.source, self.dests)


def _step(a: Action) -> _Step:
    dests = tuple(d for d in a.dests if isinstance(d, int))
    if not isinstance(a.source, int) or len(dests) != len(a.dests):
        raise ExchangeError(f"the search rewrites actions between sites; got {a} with a partition as a place")
    return _Step(a.aggregate, a.source, dests)


def _key(step: _Step) -> tuple:
    """The printing order of actions (``text.action_key``) for actions between sites."""
    return (len(step.aggregate), aggregate_text(step.aggregate), step.source, step.dests)


def _actions(body: Iterable[_Step]) -> frozenset[Action]:
    return frozenset(s.action() for s in body)


@dataclass(frozen=True)
class SearchResult:
    """The searched body and membership, their simulated time, and naive's.

    ``steps`` counts the proposals judged (tidied and checked), ``evaluated`` the ones
    simulated; ``accepted`` names the rule of every improving move, in order.
    """

    body: frozenset[Action]
    membership: dict[str, tuple[int, ...]]
    time: float
    naive_time: float
    steps: int
    evaluated: int
    accepted: tuple[str, ...] = ()
    elapsed: float = field(default=0.0, compare=False)
    out_of_time: bool = field(default=False, compare=False)  # the wall-clock budget, not the steps, stopped it
    at_bound: bool = False  # naive is within bound.NEAR of the lower bound: not searched

    @property
    def speedup(self) -> float:
        """``naive_time / time`` (1.0 when both are zero)."""
        return self.naive_time / self.time if self.time > 0 else 1.0




# --- the fixed part of one search ------------------------------------------------------------------------

class _Problem:
    """The preamble, the topology's tables and the partitions: nothing here changes during a search."""

    def __init__(self, prog: ExProg, top: Topology, free_moves: bool) -> None:
        self.prog = prog.with_body(())
        self.top = top
        self.sizes = prog.atom_sizes()
        self.sites = tuple(prog.gpus)
        self.sized = [p for p in prog.partitions if p.members is None]
        self.explicit = {p.name: tuple(p.members) for p in prog.partitions if p.members is not None}
        self.free_moves = free_moves
        caps = top.capacities()
        self.hbm = {s: (top.hbm(s), 1.0 / caps[top.hbm(s)]) for s in self.sites}
        self.route: dict[tuple[int, int], tuple[tuple[str, float], ...]] = {}
        self.bw: dict[tuple[int, int], float] = {}
        for s in self.sites:
            for d in self.sites:
                if s != d:
                    self.route[(s, d)] = tuple((r, 1.0 / caps[r]) for r in top.route(s, d).resources)
                    self.bw[(s, d)] = top.bandwidth(s, d)
        self._keys: dict[_Step, tuple] = {}

    def key(self, step: _Step) -> tuple:
        """``_key``, remembered: bodies are sorted often and share most actions."""
        k = self._keys.get(step)
        if k is None:
            k = self._keys[step] = _key(step)
        return k

    def size(self, agg: frozenset) -> int:
        return self.sizes[next(iter(agg))]

    def out_pairs(self, membership: Mapping[str, tuple[int, ...]]) -> list[_Pair]:
        pairs: dict[_Pair, None] = {}
        for r in self.prog.outputs:
            for t in r.targets:
                for s in self.prog.sites_of(t, membership):
                    pairs[(r.aggregate, s)] = None
        return list(pairs)

    def nearest(self, holders: Iterable[int], target: int) -> int:
        """The holder with the fastest lone link to ``target`` (lowest site on ties)."""
        return min(holders, key=lambda h: (-self.bw.get((h, target), float("inf")), h))

    def add_load(self, load: dict[str, float], act: _Step, sign: float = 1.0) -> None:
        """The seconds ``act``'s transfers keep each resource of their routes busy."""
        nbytes = sign * self.size(act.aggregate)
        for d in act.dests:
            for name, inv in self.route[(act.source, d)]:
                load[name] += nbytes * inv


# --- firing with provenance ------------------------------------------------------------------------------

@dataclass
class _Fired:
    """The closure of a concrete body, with who first produced each pair and from which parts."""

    actions: list[_Step]
    held: dict[int, set[frozenset]]
    producer: dict[_Pair, int | None]   # None: the pair is an IN atom
    covers: dict[int, list[frozenset]]
    order: list[int]                    # firing order (indices into actions)
    unmet: list[_Pair]


def _cover(agg: frozenset, held: set[frozenset]) -> list[frozenset] | None:
    if agg in held:
        return [agg]
    parts = [p for p in held if p <= agg]
    if not parts or frozenset().union(*parts) != agg:
        return None
    return exact_cover(agg, parts)


def _fire(problem: _Problem, actions: list[_Step], out_pairs: list[_Pair]) -> _Fired:
    """The closure by worklist (an action is retried when its source gains something), with provenance."""
    held: dict[int, set[frozenset]] = defaultdict(set)
    producer: dict[_Pair, int | None] = {}
    for a in problem.prog.inputs:
        agg = frozenset({a.atom})
        held[a.site].add(agg)
        producer[(agg, a.site)] = None
    watchers: dict[int, list[int]] = defaultdict(list)
    for i, act in enumerate(actions):
        watchers[act.source].append(i)
    pending = set(range(len(actions)))
    covers: dict[int, list[frozenset]] = {}
    order: list[int] = []
    changed = set(held)
    while changed and pending:
        ready = sorted({i for s in changed for i in watchers.get(s, ()) if i in pending})
        changed = set()
        for i in ready:
            act = actions[i]
            cover = _cover(act.aggregate, held[act.source])
            if cover is None:
                continue
            pending.discard(i)
            covers[i] = cover
            order.append(i)
            for site in (act.source, *act.dests):
                if act.aggregate not in held[site]:
                    held[site].add(act.aggregate)
                    producer[(act.aggregate, site)] = i
                    changed.add(site)
    unmet = [(x, s) for x, s in out_pairs if x not in held.get(s, ())]
    return _Fired(actions, held, producer, covers, order, unmet)


def _canon(act: _Step) -> _Step:
    dests = tuple(sorted({d for d in act.dests if d != act.source}))
    return act if dests == act.dests else _Step(act.aggregate, act.source, dests)


def _repair(problem: _Problem, fired: _Fired) -> list[_Step]:
    """Actions that deliver every unmet requirement: from the nearest holder, else gathered there."""
    extra: list[_Step] = []
    held = fired.held
    for agg, t in fired.unmet:
        holders = [s for s in problem.sites if agg in held.get(s, ())]
        if holders:
            extra.append(_Step(agg, problem.nearest(holders, t), (t,)))
            continue
        for atom in sorted(agg):
            one = frozenset({atom})
            if one not in held.get(t, ()):
                extra.append(_Step(one, problem.nearest([s for s in problem.sites if one in held.get(s, ())], t),
                                    (t,)))
        if len(agg) > 1:
            extra.append(_Step(agg, t))
    return extra


def _prune(fired: _Fired, out_pairs: list[_Pair]) -> list[_Step]:
    """Keep only what a requirement needs, walking back from OUT in reverse firing order.

    A pair is needed when OUT asks for it or a kept action aggregates it at its source;
    an action is kept for the needed pairs it produced first, and loses the destinations
    nothing needs.  What is kept still fires exactly as before, so it stays valid.
    """
    needed = set(out_pairs)
    kept: list[_Step] = []
    for i in reversed(fired.order):
        act = fired.actions[i]
        x, s = act.aggregate, act.source
        mine = [d for d in (s, *act.dests) if fired.producer.get((x, d)) == i and (x, d) in needed]
        if not mine:
            continue
        needed.update((c, s) for c in fired.covers[i])
        kept.append(_Step(x, s, tuple(d for d in act.dests if d in mine)))
    return kept


def _tidy(problem: _Problem, actions: Iterable[_Step], membership: _Sites) -> frozenset[_Step] | None:
    """Drop what never fires, re-deliver what a rewrite broke, delete what nothing needs."""
    acts = sorted({_canon(a) for a in actions}, key=problem.key)
    pairs = problem.out_pairs(membership)
    fired = _fire(problem, acts, pairs)
    if fired.unmet:
        acts = sorted(set(acts) | set(_repair(problem, fired)), key=problem.key)
        fired = _fire(problem, acts, pairs)
        if fired.unmet:
            return None
    return frozenset(_prune(fired, pairs))


# --- the current program ---------------------------------------------------------------------------------

class _State:
    """The current program with its closure, simulated run and resource loads."""

    def __init__(self, problem: _Problem, body: frozenset[_Step], membership: _Sites, sim: SimResult) -> None:
        self.problem = problem
        self.body = body
        self.membership = membership
        self.sim = sim
        self.actions = sorted(body, key=problem.key)
        self.fired = _fire(problem, self.actions, problem.out_pairs(membership))
        self.by_source: dict[tuple[frozenset, int], list[_Step]] = defaultdict(list)
        self.into: dict[int, list[_Step]] = defaultdict(list)
        for a in self.actions:
            self.by_source[(a.aggregate, a.source)].append(a)
            for d in a.dests:
                self.into[d].append(a)
        # what each site aggregates or must hold: pushdown only pays when X+Y is part of one of these
        self.wanted: dict[int, list[frozenset]] = defaultdict(list)
        for x, s in problem.out_pairs(membership):
            self.wanted[s].append(x)
        for a in self.actions:
            self.wanted[a.source].append(a.aggregate)
        # aggregations: (aggregate, site) -> (HBM resource, seconds of reading the parts and writing X)
        self.forms: dict[_Pair, tuple[str, float]] = {}
        self.load: dict[str, float] = defaultdict(float)
        for i, a in enumerate(self.actions):
            problem.add_load(self.load, a)
            cover = self.fired.covers.get(i, ())
            if len(cover) > 1 and self.fired.producer.get((a.aggregate, a.source)) == i:
                name, inv = problem.hbm[a.source]
                self.forms[(a.aggregate, a.source)] = (name, (len(cover) + 1) * problem.size(a.aggregate) * inv)
                self.load[name] += self.forms[(a.aggregate, a.source)][1]

    def holds(self, agg: frozenset, site: int) -> bool:
        return agg in self.fired.held.get(site, ())

    def can_form(self, agg: frozenset, site: int) -> bool:
        return _cover(agg, self.fired.held.get(site, set())) is not None

    def parts(self, agg: frozenset, site: int) -> list[frozenset]:
        """What ``agg`` was formed from at ``site`` ([] when it arrived whole or is an IN atom)."""
        i = self.fired.producer.get((agg, site))
        if i is None or self.fired.actions[i].source != site:
            return []
        cover = self.fired.covers[i]
        return cover if len(cover) > 1 else []

    def finish(self) -> dict[_Step, float]:
        """When each action's last stage ends in the current run."""
        end: dict[_Step, float] = {}
        for e in self.sim.trace:
            step = _step(e.action)
            end[step] = max(end.get(step, 0.0), e.end)
        return end

    def bound(self, body: frozenset[_Step]) -> tuple[float, float]:
        """(busiest resource's load, total load) of ``body``, from this program's loads and the difference."""
        problem = self.problem
        delta: dict[str, float] = defaultdict(float)
        # in printing order: the loads are float sums, and a set's order would change their last bits (and
        # so which of two proposals of equal bound ranks first) with the hash seed
        gone = sorted(self.body - body, key=problem.key)
        new = sorted(body - self.body, key=problem.key)
        for a in gone:
            problem.add_load(delta, a, -1.0)
        formed = {(a.aggregate, a.source) for a in new}
        for a in gone:
            pair = (a.aggregate, a.source)
            if pair in self.forms and pair not in formed:
                name, seconds = self.forms[pair]
                delta[name] -= seconds
        for a in new:
            problem.add_load(delta, a)
            pair = (a.aggregate, a.source)
            if len(a.aggregate) > 1 and pair not in self.forms and not self.holds(*pair):
                name, inv = problem.hbm[a.source]
                delta[name] += 3 * problem.size(a.aggregate) * inv  # most often two parts
        peak = max((v + delta.get(r, 0.0) for r, v in self.load.items()), default=0.0)
        peak = max([peak, *(v for r, v in delta.items() if r not in self.load)])
        return peak, sum(self.load.values()) + sum(delta.values())


# --- proposals -------------------------------------------------------------------------------------------

class _Edit:
    """A body being rewritten: actions are values, so changing one is removing it and adding another."""

    def __init__(self, problem: _Problem, body: frozenset[_Step]) -> None:
        self.problem = problem
        self.acts = set(body)

    def drop_dest(self, act: _Step, d: int) -> None:
        self.acts.discard(act)
        self.acts.add(_Step(act.aggregate, act.source, tuple(x for x in act.dests if x != d)))

    def send(self, agg: frozenset, source: int, d: int) -> None:
        """``agg @ source`` also reaches ``d``, joining an existing multicast when there is one."""
        same = [a for a in self.acts if a.aggregate == agg and a.source == source]
        if not same:
            self.acts.add(_Step(agg, source, (d,)))
            return
        old = min(same, key=self.problem.key)
        self.acts.discard(old)
        self.acts.add(_Step(agg, source, tuple(sorted({*old.dests, d}))))

    def body(self) -> frozenset[_Step]:
        return frozenset(self.acts)


def _body_moves(problem: _Problem, state: _State, act: _Step, rng: random.Random
                ) -> Iterator[tuple[str, frozenset[_Step], bool]]:
    """Every rule applied to one action: (rule, raw body, whether only tidying shows its gain)."""
    x, s, body = act.aggregate, act.source, state.body
    sites = problem.sites
    parts = state.parts(x, s)
    # multicast fission and fusion
    if len(act.dests) > 1:
        for d in act.dests:
            e = _Edit(problem, body)
            e.drop_dest(act, d)
            e.acts.add(_Step(x, s, (d,)))
            yield "fission", e.body(), False
    twins = [b for b in state.by_source.get((x, s), ()) if b != act]
    if twins:
        e = _Edit(problem, body)
        e.acts -= {act, *twins}
        e.acts.add(_Step(x, s, tuple(sorted({d for b in (act, *twins) for d in b.dests}))))
        yield "fusion", e.body(), False
    # the site X came from, when it arrived at s by a transfer
    former = state.fired.producer.get((x, s))
    origin = state.fired.actions[former].source if former is not None else None
    for d in act.dests:
        # relay introduction: the fastest two-hop detours first
        relays = [r for r in sites if r not in (s, d)]
        relays.sort(key=lambda r: (-min(problem.bw[(s, r)], problem.bw[(r, d)]), rng.random()))
        for r in relays[:_BRANCH]:
            e = _Edit(problem, body)
            e.drop_dest(act, d)
            if not state.holds(x, r):
                e.send(x, s, r)
            e.acts.add(_Step(x, r, (d,)))
            yield "relay", e.body(), False
        # source substitution; drawing from the site X came from is relay elimination
        others = [q for q in sites if q not in (s, d) and (state.holds(x, q) or state.can_form(x, q))]
        others.sort(key=lambda q: (q != origin, -problem.bw[(q, d)], rng.random()))
        for q in others[:_BRANCH]:
            e = _Edit(problem, body)
            e.drop_dest(act, d)
            e.send(x, q, d)
            yield ("relay-elimination" if q == origin and origin != s else "substitution"), e.body(), True
        # aggregation pushdown: one hop when both leave from s, two when Y leaves from elsewhere
        goal = [w for w in state.wanted.get(d, ()) if x < w]
        for other in state.into.get(d, ()):
            y, q = other.aggregate, other.source
            if other == act or x & y or not any((x | y) <= w for w in goal):
                continue
            e = _Edit(problem, body)
            e.drop_dest(act, d)
            e.drop_dest(other, d)
            if q != s:
                e.send(x, s, q)
            e.send(x | y, q, d)
            yield "pushdown", e.body(), False
        # aggregation pullup: send the parts X was formed from, aggregate at d
        if parts:
            e = _Edit(problem, body)
            e.drop_dest(act, d)
            e.send(parts[0], s, d)
            e.send(frozenset().union(*parts[1:]), s, d)
            e.acts.add(_Step(x, d))
            yield "pullup", e.body(), False
    # X formed at s, drawn whole from another site holding it instead (the gathering at s goes)
    if parts and former is not None and state.fired.actions[former] == act:
        holders = [q for q in sites if q != s and state.holds(x, q)]
        for q in sorted(holders, key=lambda q: (-problem.bw[(q, s)], q))[:_BRANCH]:
            e = _Edit(problem, body)
            e.acts.discard(act)
            for d in (s, *act.dests):
                e.send(x, q, d)
            yield "substitution", e.body(), True


def _relabel(state: _State, swap: Mapping[int, int]) -> list[_Step]:
    """The body with sites exchanged by ``swap``, except a source that holds its aggregate from IN."""
    out = []
    for a in state.actions:
        pinned = state.fired.producer.get((a.aggregate, a.source), 0) is None
        source = a.source if pinned else swap.get(a.source, a.source)
        out.append(_Step(a.aggregate, source, tuple(swap.get(d, d) for d in a.dests)))
    return out


def _membership_moves(problem: _Problem, state: _State, hot_sites: set[int]
                      ) -> Iterator[tuple[str, _Sites, dict[int, int]]]:
    """Partitions declared by size trade a site (swap), or one takes a free GPU instead (move)."""
    m = state.membership
    used = {s for sites in m.values() for s in sites} | {s for sites in problem.explicit.values() for s in sites}
    free = [g for g in problem.sites if g not in used] if problem.free_moves else []
    for kind, membership, swap in membership_moves(m, [p.name for p in problem.sized], free):
        if any(s in hot_sites for s in swap):
            yield kind, membership, swap


@dataclass
class _Proposal:
    rule: str
    body: frozenset[_Step]
    membership: _Sites
    bound: tuple[float, float]
    tidy: bool   # the body is raw: tidy it before judging


def _proposals(problem: _Problem, state: _State, rng: random.Random, placement: bool,
               late: Callable[[], bool]) -> list[_Proposal]:
    """This round's proposals, lowest bound first (ties in a seeded random order); fewer when ``late()``
    says the time budget ran out while they were being tidied (large programs take long to tidy)."""
    end = state.finish()
    makespan = state.sim.time or 1.0
    movers = [a for a in state.actions if a.dests or state.parts(a.aggregate, a.source)]
    weights = [(end.get(a, 0.0) / makespan) ** 4 + 1e-3 for a in movers]
    hot: list[_Step] = []
    while movers and len(hot) < _HOT:
        i = rng.choices(range(len(movers)), weights)[0]
        hot.append(movers.pop(i))
        weights.pop(i)
    out: dict[frozenset[_Step], _Proposal] = {}
    for act in hot:
        for rule, body, exact in _body_moves(problem, state, act, rng):
            if body in out or body == state.body:
                continue
            if exact:
                if late():
                    break
                tidied = _tidy(problem, body, state.membership)
                if tidied is not None and tidied != state.body:
                    out[body] = _Proposal(rule, tidied, state.membership, state.bound(tidied), False)
            else:
                out[body] = _Proposal(rule, body, state.membership, state.bound(body), True)
    found = list(out.values())
    if placement:
        hot_sites = {s for a in hot for s in (a.source, *a.dests)}
        for rule, membership, swap in _membership_moves(problem, state, hot_sites):
            if late():
                break
            tidied = _tidy(problem, _relabel(state, swap), membership)
            if tidied is not None:
                found.append(_Proposal(rule, tidied, membership, state.bound(tidied), False))
    ties = [rng.random() for _ in found]
    order = sorted(range(len(found)), key=lambda i: (found[i].bound, ties[i]))
    return [found[i] for i in order]


# --- the search ------------------------------------------------------------------------------------------

def _better(a: SimResult, b: SimResult) -> bool:
    """Whether run ``b`` beats run ``a``: faster, or as fast with less summed stage time."""
    if b.time < a.time * (1 - _TOL):
        return True
    return b.time <= a.time and b.busy < a.busy * (1 - 1e-6)  # never a hair slower: time only falls


def search_program(prog: ExProg, topology: Topology | str, membership: Membership | None = None, *,
                   seed: int = 0, budget_s: float = 0.5, max_steps: int | None = None,
                   free_moves: bool = True, known: tuple[SimResult, float] | None = None) -> SearchResult:
    """Search bodies (and the sites of partitions declared by size) for the fastest simulated program.

    ``prog`` is a preamble (its body is ignored), ``membership`` the starting sites of its
    partitions declared by size (None: the first choice).  The search starts from
    ``naive_body`` and never returns anything slower.  ``free_moves=False`` keeps the set
    of sites the sized partitions use (swaps only), as lowering needs when other readers
    sit outside the program.  A program whose naive run is within 0.1% of its :func:`lower_bound`
    is returned as naive builds it, unsearched (``at_bound``).  ``known``: the simulated run of the
    naive body under that membership and the lower bound, when the caller has them already.

    >>> from relational_tensors.exchange.text import parse
    >>> prog = parse('''GPUS: 0, 1, 4, 5
    ... PARTITIONS: FA {size 1}, FB {size 1}
    ... IN: A @ 0 (size: 100 MB), B @ 1 (size: 100 MB)
    ... OUT: A @ FA, B @ FB''')
    >>> r = search_program(prog, "dgx-v100", {"FA": (5,), "FB": (4,)}, max_steps=50)
    >>> r.membership, round(r.naive_time * 1e3, 2), r.time  # the readers move to their data
    ({'FA': (0,), 'FB': (1,)}, 12.7, 0.0)
    >>> r = search_program(prog, "dgx-v100", {"FA": (5,), "FB": (4,)}, max_steps=50, free_moves=False)
    >>> r.membership, round(r.time * 1e3, 2)  # swapped: 0->4 and 1->5 are double NVLinks, not the bridge
    ({'FA': (4,), 'FB': (5,)}, 2.0)
    """
    t0 = time.perf_counter()
    top = get_topology(topology) if isinstance(topology, str) else topology
    problem = _Problem(prog, top, free_moves)
    given = dict(membership) if membership is not None else next(memberships(prog), {})
    missing = [p.name for p in problem.sized if p.name not in given]
    if missing:
        raise ExchangeError(f"the membership gives no sites to the partitions declared by size {missing}; got "
                            f"{given}; pass a starting membership for every one (or None for the first choice)")
    start = {p.name: tuple(given[p.name]) for p in problem.sized}
    naive = naive_body(problem.prog, start)
    base, bound = known or (simulate(problem.prog.with_body(naive), top, start), -1.0)
    if not base.valid:
        raise ExchangeError(f"the naive program is not valid with membership {start}: unmet requirements "
                            f"{base.unmet[:3]}; every atom a requirement names must be in IN")
    if at_bound(base.time, bound if known else lower_bound(problem.prog, top, start, free_moves=free_moves)):
        return SearchResult(naive, start, base.time, base.time, 0, 0, (), time.perf_counter() - t0, False, True)
    body = frozenset(map(_step, naive))
    rng = random.Random(seed)
    state = _State(problem, body, start, base)
    seen: set[tuple[frozenset[_Step], tuple]] = {(body, tuple(sorted(start.items())))}
    steps = evaluated = 0
    accepted: list[str] = []
    idle = 0

    timed_out = False

    def late() -> bool:
        return time.perf_counter() - t0 > budget_s

    def spent() -> bool:
        nonlocal timed_out
        if max_steps is not None and steps >= max_steps:
            return True
        timed_out = late()
        return timed_out

    while state.sim.time > 0 and idle < _PATIENCE and not spent():
        placement = bool(problem.sized) and (idle > 0 or not accepted)
        improved = False
        tried = 0
        for prop in _proposals(problem, state, rng, placement, late):
            if tried >= _PER_ROUND or spent():
                break
            tidied = _tidy(problem, prop.body, prop.membership) if prop.tidy else prop.body
            if tidied is None:
                continue
            key = (tidied, tuple(sorted(prop.membership.items())))
            if key in seen:
                continue
            seen.add(key)
            steps += 1
            tried += 1
            full = problem.prog.with_body(_actions(tidied))
            try:
                check(full, prop.membership)
            except ExchangeError:
                continue  # tidying keeps proposals valid; the check keeps the search honest regardless
            sim = simulate(full, top, prop.membership)
            evaluated += 1
            if sim.valid and _better(state.sim, sim):
                state = _State(problem, tidied, prop.membership, sim)
                accepted.append(prop.rule)
                improved = True
                break
        idle = 0 if improved else idle + 1
    return SearchResult(_actions(state.body), dict(state.membership), state.sim.time, base.time, steps, evaluated,
                        tuple(accepted), time.perf_counter() - t0, timed_out)


# --- lowering --------------------------------------------------------------------------------------------

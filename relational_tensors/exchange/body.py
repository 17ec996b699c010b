"""The body the exchange search rewrites, and what it knows about it while it does.

A body is a set of :class:`Step` (actions between sites).  :class:`Problem` holds what stays fixed
during one search (the preamble, the topology's tables, the partitions); :class:`State` is the current
program: its body, membership, closure with provenance (who first produced each pair, from which parts),
simulated run and resource loads.  The rewrite rules (:mod:`~relational_tensors.exchange.rules`) read a
state and build bodies with :class:`Edit`; :func:`tidy` makes a rewritten body deliver OUT again and drops
what nothing needs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg, aggregate_text, exact_cover
from relational_tensors.exchange.simulator import SimResult
from relational_tensors.machine.topology import Topology

__all__ = ["Pair", "Sites", "Step", "as_step", "to_actions", "Problem", "Fired", "fire", "tidy", "State", "Edit"]

Pair = tuple[frozenset, int]                 # (aggregate, site)
Sites = dict[str, tuple[int, ...]]            # a membership


class Step(NamedTuple):
    """An action whose places are all sites: what the search rewrites (naive writes only sites)."""

    aggregate: frozenset
    source: int
    dests: tuple[int, ...] = ()

    def action(self) -> Action:
        return Action(self.aggregate, self.source, self.dests)


def as_step(a: Action) -> Step:
    """``a`` as a step; ExchangeError when a place of it is a partition."""
    dests = tuple(d for d in a.dests if isinstance(d, int))
    if not isinstance(a.source, int) or len(dests) != len(a.dests):
        raise ExchangeError(f"the search rewrites actions between sites; got {a} with a partition as a place")
    return Step(a.aggregate, a.source, dests)


def _key(step: Step) -> tuple:
    """The printing order of actions (``text.action_key``) for actions between sites."""
    return (len(step.aggregate), aggregate_text(step.aggregate), step.source, step.dests)


def to_actions(body: Iterable[Step]) -> frozenset[Action]:
    """The actions of a body of steps."""
    return frozenset(s.action() for s in body)


# --- the fixed part of one search ------------------------------------------------------------------------

class Problem:
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
        self._keys: dict[Step, tuple] = {}

    def key(self, step: Step) -> tuple:
        """``_key``, remembered: bodies are sorted often and share most actions."""
        k = self._keys.get(step)
        if k is None:
            k = self._keys[step] = _key(step)
        return k

    def size(self, agg: frozenset) -> int:
        return self.sizes[next(iter(agg))]

    def out_pairs(self, membership: Mapping[str, tuple[int, ...]]) -> list[Pair]:
        pairs: dict[Pair, None] = {}
        for r in self.prog.outputs:
            for t in r.targets:
                for s in self.prog.sites_of(t, membership):
                    pairs[(r.aggregate, s)] = None
        return list(pairs)

    def nearest(self, holders: Iterable[int], target: int) -> int:
        """The holder with the fastest lone link to ``target`` (lowest site on ties)."""
        return min(holders, key=lambda h: (-self.bw.get((h, target), float("inf")), h))

    def add_load(self, load: dict[str, float], act: Step, sign: float = 1.0) -> None:
        """The seconds ``act``'s transfers keep each resource of their routes busy."""
        nbytes = sign * self.size(act.aggregate)
        for d in act.dests:
            for name, inv in self.route[(act.source, d)]:
                load[name] += nbytes * inv


# --- firing with provenance ------------------------------------------------------------------------------

@dataclass
class Fired:
    """The closure of a concrete body, with who first produced each pair and from which parts."""

    actions: list[Step]
    held: dict[int, set[frozenset]]
    producer: dict[Pair, int | None]   # None: the pair is an IN atom
    covers: dict[int, list[frozenset]]
    order: list[int]                    # firing order (indices into actions)
    unmet: list[Pair]


def _cover(agg: frozenset, held: set[frozenset]) -> list[frozenset] | None:
    if agg in held:
        return [agg]
    parts = [p for p in held if p <= agg]
    if not parts or frozenset().union(*parts) != agg:
        return None
    return exact_cover(agg, parts)


def fire(problem: Problem, actions: list[Step], out_pairs: list[Pair]) -> Fired:
    """The closure by worklist (an action is retried when its source gains something), with provenance."""
    held: dict[int, set[frozenset]] = defaultdict(set)
    producer: dict[Pair, int | None] = {}
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
    return Fired(actions, held, producer, covers, order, unmet)


def _canon(act: Step) -> Step:
    dests = tuple(sorted({d for d in act.dests if d != act.source}))
    return act if dests == act.dests else Step(act.aggregate, act.source, dests)


def _repair(problem: Problem, fired: Fired) -> list[Step]:
    """Actions that deliver every unmet requirement: from the nearest holder, else gathered there."""
    extra: list[Step] = []
    held = fired.held
    for agg, t in fired.unmet:
        holders = [s for s in problem.sites if agg in held.get(s, ())]
        if holders:
            extra.append(Step(agg, problem.nearest(holders, t), (t,)))
            continue
        for atom in sorted(agg):
            one = frozenset({atom})
            if one not in held.get(t, ()):
                extra.append(Step(one, problem.nearest([s for s in problem.sites if one in held.get(s, ())], t),
                                    (t,)))
        if len(agg) > 1:
            extra.append(Step(agg, t))
    return extra


def _prune(fired: Fired, out_pairs: list[Pair]) -> list[Step]:
    """Keep only what a requirement needs, walking back from OUT in reverse firing order.

    A pair is needed when OUT asks for it or a kept action aggregates it at its source;
    an action is kept for the needed pairs it produced first, and loses the destinations
    nothing needs.  What is kept still fires exactly as before, so it stays valid.
    """
    needed = set(out_pairs)
    kept: list[Step] = []
    for i in reversed(fired.order):
        act = fired.actions[i]
        x, s = act.aggregate, act.source
        mine = [d for d in (s, *act.dests) if fired.producer.get((x, d)) == i and (x, d) in needed]
        if not mine:
            continue
        needed.update((c, s) for c in fired.covers[i])
        kept.append(Step(x, s, tuple(d for d in act.dests if d in mine)))
    return kept


def tidy(problem: Problem, actions: Iterable[Step], membership: Sites) -> frozenset[Step] | None:
    """Drop what never fires, re-deliver what a rewrite broke, delete what nothing needs."""
    acts = sorted({_canon(a) for a in actions}, key=problem.key)
    pairs = problem.out_pairs(membership)
    fired = fire(problem, acts, pairs)
    if fired.unmet:
        acts = sorted(set(acts) | set(_repair(problem, fired)), key=problem.key)
        fired = fire(problem, acts, pairs)
        if fired.unmet:
            return None
    return frozenset(_prune(fired, pairs))


# --- the current program ---------------------------------------------------------------------------------

class State:
    """The current program with its closure, simulated run and resource loads."""

    def __init__(self, problem: Problem, body: frozenset[Step], membership: Sites, sim: SimResult) -> None:
        self.problem = problem
        self.body = body
        self.membership = membership
        self.sim = sim
        self.actions = sorted(body, key=problem.key)
        self.fired = fire(problem, self.actions, problem.out_pairs(membership))
        self.by_source: dict[tuple[frozenset, int], list[Step]] = defaultdict(list)
        self.into: dict[int, list[Step]] = defaultdict(list)
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
        self.forms: dict[Pair, tuple[str, float]] = {}
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

    def finish(self) -> dict[Step, float]:
        """When each action's last stage ends in the current run."""
        end: dict[Step, float] = {}
        for e in self.sim.trace:
            s = as_step(e.action)
            end[s] = max(end.get(s, 0.0), e.end)
        return end

    def bound(self, body: frozenset[Step]) -> tuple[float, float]:
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


# --- rewriting a body ------------------------------------------------------------------------------------

class Edit:
    """A body being rewritten: actions are values, so changing one is removing it and adding another."""

    def __init__(self, problem: Problem, body: frozenset[Step]) -> None:
        self.problem = problem
        self.acts = set(body)

    def drop_dest(self, act: Step, d: int) -> None:
        self.acts.discard(act)
        self.acts.add(Step(act.aggregate, act.source, tuple(x for x in act.dests if x != d)))

    def send(self, agg: frozenset, source: int, d: int) -> None:
        """``agg @ source`` also reaches ``d``, joining an existing multicast when there is one."""
        same = [a for a in self.acts if a.aggregate == agg and a.source == source]
        if not same:
            self.acts.add(Step(agg, source, (d,)))
            return
        old = min(same, key=self.problem.key)
        self.acts.discard(old)
        self.acts.add(Step(agg, source, tuple(sorted({*old.dests, d}))))

    def body(self) -> frozenset[Step]:
        return frozenset(self.acts)

"""The rewrite rules of the exchange search (section 5.4): one function per rule, and :data:`RULES`.

A rule takes the current program (a :class:`~relational_tensors.exchange.body.State`), one action of
its body and the search's random source (it breaks ties between equally linked sites), and returns the
programs it rewrites that action into: a list of :class:`Rewrite` (a raw body, and the membership it
runs under, new for the membership rules).  A rule that does not apply returns ``[]``.  A raw body may
leave a requirement unmet or keep what nothing needs any more: the search tidies it
(:func:`~relational_tensors.exchange.body.tidy`, which fetches the one again and drops the other) before
judging it, so a rule only has to keep the value of every transfer right.  The search tries the rules
in the order of :data:`RULES`: the body rules, then the membership rules, which it tries only in some
rounds (:data:`MEMBERSHIP_RULES`).  :func:`apply` applies one rule to a whole program.

Each rule has a fixture, ``tests/fixtures/exchange_rules/<rule>.txt``: a small program before and after.

>>> [rule_name(rule) for rule in RULES]
['fission', 'fusion', 'relay', 'relay-elimination', 'substitution', 'pushdown', 'pullup', 'swap', 'move']
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import NamedTuple

from relational_tensors.exchange.ast import ExProg
from relational_tensors.exchange.body import Edit, Problem, Sites, State, Step, as_step, to_actions
from relational_tensors.exchange.closure import membership_moves
from relational_tensors.exchange.simulator import check_topology, simulate
from relational_tensors.machine.topology import Topology

__all__ = ["Rewrite", "Rule", "RULES", "MEMBERSHIP_RULES", "rule_name", "apply", "fission", "fusion", "relay",
           "relay_elimination", "substitution", "pushdown", "pullup", "swap", "move"]

BRANCH = 3  # relay sites, and substitute sources, tried per destination


class Rewrite(NamedTuple):
    """A program a rule proposes: a raw body, the membership it runs under, and how to rank it."""

    body: frozenset[Step]
    membership: Sites
    tidy_first: bool = False  # rank it by its tidied body: only tidying shows its gain


Rule = Callable[[State, Step, random.Random], list[Rewrite]]


def _edit(state: State) -> Edit:
    return Edit(state.problem, state.body)


def _origin(state: State, act: Step) -> int | None:
    """The site ``act``'s aggregate came from, when it arrived at ``act``'s source by a transfer."""
    former = state.fired.producer.get((act.aggregate, act.source))
    if former is None:
        return None
    origin = state.fired.actions[former].source
    return None if origin == act.source else origin


# --- the body rules ---------------------------------------------------------------------------------------

def fission(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """``X @ s -> D`` ⇒ ``X @ s -> D - {d}; X @ s -> d`` for each ``d`` of a multicast.

    Valid: both actions send the same aggregate from the same site, so they fire when the multicast
    did and reach the same sites.  The lone transfer can then be rewritten on its own.
    """
    if len(act.dests) < 2:
        return []
    out = []
    for d in act.dests:
        e = _edit(state)
        e.drop_dest(act, d)
        e.acts.add(Step(act.aggregate, act.source, (d,)))
        out.append(Rewrite(e.body(), state.membership))
    return out


def fusion(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """``X @ s -> D1; X @ s -> D2`` ⇒ ``X @ s -> D1 ∪ D2``: every action of ``X`` at ``s`` becomes one.

    Valid: the actions form and send the same aggregate from the same site, so they fire together;
    the union reaches every site one of them reached.  (The inverse of :func:`fission`.)
    """
    x, s = act.aggregate, act.source
    twins = [b for b in state.by_source.get((x, s), ()) if b != act]
    if not twins:
        return []
    e = _edit(state)
    e.acts -= {act, *twins}
    e.acts.add(Step(x, s, tuple(sorted({d for b in (act, *twins) for d in b.dests}))))
    return [Rewrite(e.body(), state.membership)]


def relay(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """``X @ s -> d`` ⇒ ``X @ s -> r; X @ r -> d``: around a slow link or a shared bridge.

    For each destination, the :data:`BRANCH` relays ``r`` with the fastest two hops (the slower of
    the two lone links), ties in random order.  ``X @ s -> r`` is left out when ``r`` holds ``X``
    already.  Valid: ``r`` forwards ``X`` whole once it holds it, so ``d`` receives the same value.
    """
    x, s = act.aggregate, act.source
    problem = state.problem
    out = []
    for d in act.dests:
        relays = [r for r in problem.sites if r not in (s, d)]
        relays.sort(key=lambda r: (-min(problem.bw[(s, r)], problem.bw[(r, d)]), rng.random()))
        for r in relays[:BRANCH]:
            e = _edit(state)
            e.drop_dest(act, d)
            if not state.holds(x, r):
                e.send(x, s, r)
            e.acts.add(Step(x, r, (d,)))
            out.append(Rewrite(e.body(), state.membership))
    return out


def relay_elimination(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """``X @ q -> s; X @ s -> d`` ⇒ ``X @ q -> d``: ``d`` draws ``X`` from the site it came from.

    Applies when ``X`` arrived at ``s`` by a transfer from ``q``.  Valid: ``q`` holds ``X`` (it sent
    it), so ``d`` receives the same value one hop sooner.  ``X @ q -> s`` stays in the raw body;
    tidying drops it when nothing else at ``s`` needs ``X``.  (The inverse of :func:`relay`.)
    """
    origin = _origin(state, act)
    if origin is None:
        return []
    out = []
    for d in act.dests:
        if d == origin:
            continue
        e = _edit(state)
        e.drop_dest(act, d)
        e.send(act.aggregate, origin, d)
        out.append(Rewrite(e.body(), state.membership, tidy_first=True))
    return out


def substitution(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """Draw a copy of ``X`` from another site that holds ``X`` or can form it.

    ``X @ s -> d`` ⇒ ``X @ q -> d`` for the best-linked sites ``q`` to ``d`` (:data:`BRANCH` per
    destination, one fewer when :func:`relay_elimination` takes the site ``X`` came from; ties in
    random order).  And when ``act`` is what forms ``X`` at ``s`` from parts, ``X @ s -> D`` ⇒
    ``X @ q -> s, D`` from the best-linked sites ``q`` that hold ``X`` whole: the gathering at ``s``
    goes.  Valid: ``q`` sends the same aggregate; tidying drops the transfers that fed the old source
    when nothing else needs them (which is why it is ranked tidied).
    """
    x, s = act.aggregate, act.source
    problem = state.problem
    origin = _origin(state, act)
    out = []
    for d in act.dests:
        others = [q for q in problem.sites
                  if q not in (s, d, origin) and (state.holds(x, q) or state.can_form(x, q))]
        others.sort(key=lambda q: (-problem.bw[(q, d)], rng.random()))
        room = BRANCH - 1 if origin is not None and origin != d else BRANCH
        for q in others[:room]:
            e = _edit(state)
            e.drop_dest(act, d)
            e.send(x, q, d)
            out.append(Rewrite(e.body(), state.membership, tidy_first=True))
    former = state.fired.producer.get((x, s))
    if state.parts(x, s) and former is not None and state.fired.actions[former] == act:
        holders = [q for q in problem.sites if q != s and state.holds(x, q)]
        for q in sorted(holders, key=lambda q: (-problem.bw[(q, s)], q))[:BRANCH]:
            e = _edit(state)
            e.acts.discard(act)
            for d in (s, *act.dests):
                e.send(x, q, d)
            out.append(Rewrite(e.body(), state.membership, tidy_first=True))
    return out


def pushdown(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """``X @ s -> d; Y @ q -> d`` ⇒ ``X @ s -> q; X+Y @ q -> d`` (``X+Y @ s -> d`` when ``q = s``).

    Applies when ``X`` and ``Y`` are disjoint and ``d`` needs an aggregate holding both (OUT asks
    for one there, or an action forms one there): ``d`` receives one block instead of two, and a
    reduction tree grows by one edge.  Valid: ``q`` holds ``Y`` and receives ``X``, disjoint parts
    covering ``X+Y``; a requirement of ``X`` or ``Y`` alone at ``d`` is fetched again by tidying.
    """
    x, s = act.aggregate, act.source
    out = []
    for d in act.dests:
        goal = [w for w in state.wanted.get(d, ()) if x < w]
        for other in state.into.get(d, ()):
            y, q = other.aggregate, other.source
            if other == act or x & y or not any((x | y) <= w for w in goal):
                continue
            e = _edit(state)
            e.drop_dest(act, d)
            e.drop_dest(other, d)
            if q != s:
                e.send(x, s, q)
            e.send(x | y, q, d)
            out.append(Rewrite(e.body(), state.membership))
    return out


def pullup(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """``X @ s -> d``, ``X`` formed at ``s`` from parts ``P1, ..., Pk`` ⇒ ``P1 @ s -> d;
    P2+...+Pk @ s -> d; X @ d``: send the parts and aggregate at ``d``.  (The inverse of :func:`pushdown`.)

    Valid: the parts are disjoint and cover ``X``, so ``d`` forms the same ``X``; ``s`` holds them all,
    so it can form their union too.
    """
    x, s = act.aggregate, act.source
    parts = state.parts(x, s)
    if not parts:
        return []
    out = []
    for d in act.dests:
        e = _edit(state)
        e.drop_dest(act, d)
        e.send(parts[0], s, d)
        e.send(frozenset().union(*parts[1:]), s, d)
        e.acts.add(Step(x, d))
        out.append(Rewrite(e.body(), state.membership))
    return out


# --- the membership rules ---------------------------------------------------------------------------------

def _relabel(state: State, exchanged: Mapping[int, int]) -> frozenset[Step]:
    """The body with sites exchanged, except a source that holds its aggregate from IN."""
    out = set()
    for a in state.actions:
        pinned = state.fired.producer.get((a.aggregate, a.source), 0) is None
        source = a.source if pinned else exchanged.get(a.source, a.source)
        out.add(Step(a.aggregate, source, tuple(exchanged.get(d, d) for d in a.dests)))
    return frozenset(out)


def _moved(state: State, act: Step, kind: str) -> list[Rewrite]:
    """The membership moves of ``kind`` that exchange a site of ``act``, each with the relabelled body."""
    problem = state.problem
    if not problem.sized or (kind == "move" and not problem.free_moves):
        return []
    m = state.membership
    used = {s for sites in m.values() for s in sites} | {s for sites in problem.explicit.values() for s in sites}
    free = [g for g in problem.sites if g not in used] if kind == "move" else []
    mine = {act.source, *act.dests}
    return [Rewrite(_relabel(state, exchanged), membership, tidy_first=True)
            for k, membership, exchanged in membership_moves(m, [p.name for p in problem.sized], free)
            if k == kind and mine & set(exchanged)]


def swap(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """Two partitions declared by size trade sites, one of them a site of ``act``; the body follows.

    The body's sites are exchanged too (but a source holding its aggregate from IN stays: the data
    does not move).  Valid once tidied: what the exchange broke is fetched again.
    """
    return _moved(state, act, "swap")


def move(state: State, act: Step, rng: random.Random) -> list[Rewrite]:
    """A partition declared by size trades a site of ``act`` for a GPU no partition uses; the body follows.

    Only when the search may move partitions (``free_moves``); valid once tidied, as for :func:`swap`.
    """
    return _moved(state, act, "move")


RULES: tuple[Rule, ...] = (fission, fusion, relay, relay_elimination, substitution, pushdown, pullup, swap, move)
MEMBERSHIP_RULES: frozenset[Rule] = frozenset({swap, move})  # tried only in the first round and after fruitless ones


def rule_name(rule: Rule) -> str:
    """The rule's name as the search reports it (``relay-elimination``)."""
    return rule.__name__.replace("_", "-")


def apply(rule: Rule, prog: ExProg, topology: Topology, membership: Mapping[str, tuple[int, ...]] | None = None,
          *, free_moves: bool = True, seed: int = 0) -> list[tuple[ExProg, dict[str, tuple[int, ...]]]]:
    """``rule`` applied at every action of ``prog``'s body (in printing order): each raw program it
    proposes, once, with its membership.  ``membership`` gives the partitions declared by size their sites.

    >>> from relational_tensors.exchange.text import parse, to_text
    >>> from relational_tensors.machine.machines import get_topology
    >>> prog = parse("GPUS: 0, 1, 2\\nIN: A @ 0\\nOUT: A @ 1, 2\\nA @ 0 -> 1, 2")
    >>> [to_text(p).splitlines()[-2:] for p, _ in apply(fission, prog, get_topology("dgx-a100"))]
    [['A @ 0 -> 1', 'A @ 0 -> 2']]
    """
    top = check_topology(topology, "apply")
    sites = {name: tuple(s) for name, s in (membership or {}).items()}
    state = State(Problem(prog, top, free_moves), frozenset(map(as_step, prog.body)), sites,
                  simulate(prog, top, sites))
    rng = random.Random(seed)
    out: dict[tuple, tuple[ExProg, dict[str, tuple[int, ...]]]] = {}
    for act in state.actions:
        for rw in rule(state, act, rng):
            key = (rw.body, tuple(sorted(rw.membership.items())))
            out.setdefault(key, (prog.with_body(to_actions(rw.body)), dict(rw.membership)))
    return list(out.values())

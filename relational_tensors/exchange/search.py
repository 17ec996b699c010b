"""Exchange-program search (section 5.4): rewrite the naive body, keep what the simulator likes.

The search starts from the naive program of :mod:`~relational_tensors.physical.lower`
(each reader gathers the atoms of what it needs and aggregates them itself) and
climbs with the paper's rewrite rules, :data:`~relational_tensors.exchange.rules.RULES`,
each a function of :mod:`~relational_tensors.exchange.rules` applied to one action of the body:

``fission`` / ``fusion``
    ``X @ s -> D1, D2`` ⇄ ``X @ s -> D1; X @ s -> D2``.
``relay`` / ``relay-elimination``
    ``X @ s -> d`` ⇄ ``X @ s -> r; X @ r -> d``: around a slow link or a shared bridge.
``substitution``
    draw the copy of ``X`` at a site from another site that holds ``X`` or can form it.
``pushdown`` / ``pullup``
    ``X @ r -> d; Y @ r -> d`` ⇄ ``X+Y @ r -> d``.  Pushdown also takes the two-hop form
    ``X @ q -> d; Y @ r -> d`` ⇒ ``X @ q -> r; X+Y @ r -> d``, which grows a reduction
    tree by one edge.
``swap`` / ``move``
    the membership of partitions declared by size: two trade a site, or one takes a free GPU.

A proposal is tidied before it is judged (:func:`~relational_tensors.exchange.body.tidy`):
actions that never fire are dropped, a requirement that a rewrite broke is fetched again
from the best-connected site holding it (or gathered there, as naive does), and actions
whose results nothing uses are deleted.  Each round rewrites a few actions drawn by how
late they finish in the current run, trying every rule of ``RULES`` in order on each,
ranks the proposals by a contention bound (the busiest resource's load, then the total
load), and judges the best few: checked by
:func:`~relational_tensors.exchange.closure.check` under their membership, costed by
:func:`~relational_tensors.exchange.simulator.simulate`.  The first that beats the
current program by :func:`~relational_tensors.exchange.simulator.better` (faster, or no
slower with less summed stage time) replaces it.  The membership rules are tried in the
first round and after every round that found nothing.  The search ends after a few
fruitless rounds in a row, after ``max_steps`` judged proposals, or when ``budget_s`` is
spent.  Only improvements are taken, so the result is never slower than naive; for one
seed it is deterministic unless the time budget is what stops it.  A program whose naive
run is within 0.1% of its :func:`lower_bound` (the busiest endpoint's unavoidable bytes
over its bandwidth) is not searched: no body could gain more.

:class:`~relational_tensors.exchange.searcher.Searcher` searches the programs of one
lowering under one step limit for all of them; :mod:`~relational_tensors.exchange.bound`
gives the lower bound.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg
from relational_tensors.exchange.body import Problem, Sites, State, Step, as_step, tidy, to_actions
from relational_tensors.exchange.bound import at_bound, lower_bound
from relational_tensors.exchange.closure import check, memberships
from relational_tensors.exchange.naive import Membership, naive_body
from relational_tensors.exchange.rules import MEMBERSHIP_RULES, RULES, rule_name
from relational_tensors.exchange.simulator import SimResult, better, check_topology, simulate
from relational_tensors.machine.topology import Topology

__all__ = ["SearchResult", "search_program", "lower_bound", "RULES"]

_PER_ROUND = 6     # proposals judged per round, best-ranked first
_HOT = 5           # actions rewritten per round, drawn by how late they finish
_PATIENCE = 3      # fruitless rounds in a row before the search stops


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


# --- proposals -------------------------------------------------------------------------------------------

@dataclass
class _Proposal:
    rule: str
    body: frozenset[Step]
    membership: Sites
    bound: tuple[float, float]
    tidy: bool   # the body is raw: tidy it before judging


def _hot(state: State, rng: random.Random) -> list[Step]:
    """The actions to rewrite this round: :data:`_HOT` of those that move or form something, drawn by
    how late they finish in the current run (the latest far more often)."""
    end = state.finish()
    makespan = state.sim.time or 1.0
    movers = [a for a in state.actions if a.dests or state.parts(a.aggregate, a.source)]
    weights = [(end.get(a, 0.0) / makespan) ** 4 + 1e-3 for a in movers]
    hot: list[Step] = []
    while movers and len(hot) < _HOT:
        i = rng.choices(range(len(movers)), weights)[0]
        hot.append(movers.pop(i))
        weights.pop(i)
    return hot


def _proposals(problem: Problem, state: State, rng: random.Random, placement: bool,
               late: Callable[[], bool]) -> list[_Proposal]:
    """This round's proposals: every rule of ``RULES`` (the membership rules only when ``placement``) at
    each hot action, lowest bound first (ties in a seeded random order); fewer when ``late()`` says the
    time budget ran out while they were being tidied (large programs take long to tidy)."""
    hot = _hot(state, rng)
    here = (state.body, tuple(sorted(state.membership.items())))
    seen = {here}
    found: list[_Proposal] = []
    for rule in RULES:
        if rule in MEMBERSHIP_RULES and not placement:
            continue
        name = rule_name(rule)
        for act in hot:
            for rw in rule(state, act, rng):
                key = (rw.body, tuple(sorted(rw.membership.items())))
                if key in seen:
                    continue
                seen.add(key)
                if not rw.tidy_first:
                    found.append(_Proposal(name, rw.body, rw.membership, state.bound(rw.body), True))
                    continue
                if late():
                    break
                tidied = tidy(problem, rw.body, rw.membership)
                if tidied is not None and (tidied, key[1]) != here:
                    found.append(_Proposal(name, tidied, rw.membership, state.bound(tidied), False))
    ties = [rng.random() for _ in found]
    order = sorted(range(len(found)), key=lambda i: (found[i].bound, ties[i]))
    return [found[i] for i in order]


# --- the search ------------------------------------------------------------------------------------------

def search_program(prog: ExProg, topology: Topology, membership: Membership | None = None, *,
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
    >>> from relational_tensors.machine.machines import get_topology
    >>> v100 = get_topology("dgx-v100")
    >>> prog = parse('''GPUS: 0, 1, 4, 5
    ... PARTITIONS: FA {size 1}, FB {size 1}
    ... IN: A @ 0 (size: 100 MB), B @ 1 (size: 100 MB)
    ... OUT: A @ FA, B @ FB''')
    >>> r = search_program(prog, v100, {"FA": (5,), "FB": (4,)}, max_steps=50)
    >>> r.membership, round(r.naive_time * 1e3, 2), r.time  # the readers move to their data
    ({'FA': (0,), 'FB': (1,)}, 12.7, 0.0)
    >>> r = search_program(prog, v100, {"FA": (5,), "FB": (4,)}, max_steps=50, free_moves=False)
    >>> r.membership, round(r.time * 1e3, 2)  # swapped: 0->4 and 1->5 are double NVLinks, not the bridge
    ({'FA': (4,), 'FB': (5,)}, 2.0)
    """
    t0 = time.perf_counter()
    top = check_topology(topology, "search_program")
    problem = Problem(prog, top, free_moves)
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
    body = frozenset(map(as_step, naive))
    rng = random.Random(seed)
    state = State(problem, body, start, base)
    seen: set[tuple[frozenset[Step], tuple]] = {(body, tuple(sorted(start.items())))}
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
            tidied = tidy(problem, prop.body, prop.membership) if prop.tidy else prop.body
            if tidied is None:
                continue
            key = (tidied, tuple(sorted(prop.membership.items())))
            if key in seen:
                continue
            seen.add(key)
            steps += 1
            tried += 1
            full = problem.prog.with_body(to_actions(tidied))
            try:
                check(full, prop.membership)
            except ExchangeError:
                continue  # tidying keeps proposals valid; the check keeps the search honest regardless
            sim = simulate(full, top, prop.membership)
            evaluated += 1
            if better(state.sim, sim):
                state = State(problem, tidied, prop.membership, sim)
                accepted.append(prop.rule)
                improved = True
                break
        idle = 0 if improved else idle + 1
    return SearchResult(to_actions(state.body), dict(state.membership), state.sim.time, base.time, steps, evaluated,
                        tuple(accepted), time.perf_counter() - t0, timed_out)

"""Refinement of a complete choice: the DP is exact on trees, not across the tensors it cuts.

A training graph reads every forward activation again in the backward, so most of its tensors have
several consumers and Algorithm 1 fixes the pieces one after another, each seeing only the pieces fixed
before it, never the readers of its root that come later.  ``refine`` then lowers the whole-plan cost
(``plan.plan_cost``, plus the DP's price on resident bytes) by block coordinate descent, in sweeps:

* each piece in turn is solved again exactly, by the tree DP of Algorithm 1, with every operator
  outside it fixed: now its root's and members' readers in other pieces count too;
* then each operator in turn takes the eligible spec that is cheapest given its neighbours' specs (its
  own cost, its inputs' repartitions, and its readers' repartitions).

A step is taken only if it lowers the cost, so the result is never worse than the DP's; sweeps stop
when one changes nothing.  ``bench/dp_gap.py`` measures both against the exact optimum.
"""

from __future__ import annotations

from collections.abc import Sequence

from relational_tensors.dp_optimizer import repeats
from relational_tensors.dp_optimizer.candidates import Candidates
from relational_tensors.dp_optimizer.trees import Piece
from relational_tensors.graph.graph import Graph

__all__ = ["refine"]

_MAX_SWEEPS = 32


def refine(graph: Graph, cands: Candidates, choice: dict[int, int], memory_price: float = 0.0,
           pieces: Sequence[Piece] = ()) -> dict[int, int]:
    """``choice`` improved piece by piece (``pieces``: the DP's) and operator by operator until a sweep
    changes nothing."""
    nodes = graph.nodes
    choice = dict(choice)
    # every priced edge, carried ones (a state's readers, from the operator of its value) included
    consumers: dict[int, list[tuple[int, int]]] = {v: [] for v in choice}
    inputs: dict[int, list[tuple[int, int]]] = {v: [] for v in choice}
    for (v, k), u in sorted(cands.sources.items()):
        if u in choice and v in choice:
            consumers[u].append((v, k))
            inputs[v].append((k, u))
    carried = cands.carried
    eligible = {v: [s for s, c in enumerate(cands.by_op[v]) if c.eligible] for v in choice}

    def outside(v: int, s: int, inside: set[int]) -> float:
        """v's own cost on spec s and its edges to operators outside ``inside`` (fixed at their specs)."""
        c = cands.by_op[v][s]
        total = c.local_cost + memory_price * c.resident_bytes
        for k, u in inputs[v]:
            if u not in inside or (v, k) in carried:
                # a carried edge inside the piece is no tree edge: priced at the current choice of its
                # other end (itself, on a self-loop)
                tiling = c.output_tiling if u == v else cands.by_op[u][choice[u]].output_tiling
                total += cands.edge_price(v, k, tiling, c.required[k])
        for w, k in consumers[v]:
            if w not in inside:
                total += cands.edge_price(w, k, c.output_tiling, cands.by_op[w][choice[w]].required[k])
        return total

    def resolve(pc: Piece) -> bool:
        """Piece ``pc`` solved exactly with the rest fixed; True if that lowered the cost."""
        inside = set(pc.members)
        child_edges = {v: [(k, u) for k, u in inputs[v] if u in inside and u != pc.root
                           and consumers[u] == [(v, k)] and (v, k) not in carried] for v in pc.members}
        best: dict[int, dict[int, float]] = {}
        via: dict[int, dict[int, dict[int, int]]] = {}  # v -> spec -> input pos -> the child's spec
        per_tiling: dict[int, dict[int, tuple[float, int]]] = {}  # u -> output tiling -> (cost, spec)
        now = 0.0
        for v in pc.members:  # topological: children first
            best[v], via[v] = {}, {}
            for s in eligible[v]:
                c = cands.by_op[v][s]
                total = outside(v, s, inside)
                picks = {}
                for k, u in child_edges[v]:
                    cost, spec = min(((t + cands.edge_price(v, k, tiling, c.required[k]), sp)
                                      for tiling, (t, sp) in per_tiling[u].items()), key=lambda x: x[0])
                    total += cost
                    picks[k] = spec
                best[v][s], via[v][s] = total, picks
            tilings: dict[int, tuple[float, int]] = {}
            for s, cost in best[v].items():
                tiling = cands.by_op[v][s].output_tiling
                if tiling not in tilings or cost < tilings[tiling][0]:
                    tilings[tiling] = (cost, s)
            per_tiling[v] = tilings
            now += outside(v, choice[v], inside) + sum(
                cands.edge_price(v, k, cands.by_op[u][choice[u]].output_tiling,
                                 cands.by_op[v][choice[v]].required[k]) for k, u in child_edges[v])
        root = pc.root
        top = min(best[root], key=lambda s: best[root][s])
        if not best[root][top] < now - 1e-12 * max(abs(now), 1.0):
            return False
        proposal = dict(choice)
        stack = [(root, top)]
        while stack:
            v, s = stack.pop()
            proposal[v] = s
            stack.extend((nodes[v].inputs[k], spec) for k, spec in via[v][s].items())
        if pc_carried[pc.piece_id]:  # the tree DP priced those edges at their other end's old spec
            before, after = terms(pc.members, choice), terms(pc.members, proposal)
            if not after < before - 1e-12 * max(abs(before), 1.0):
                return False
        choice.update(proposal)
        return True

    def terms(members: Sequence[int], ch: dict[int, int]) -> float:
        """The part of the whole-plan cost under ``ch`` that depends on ``members``' specs."""
        total, seen = 0.0, set()
        for v in members:
            c = cands.by_op[v][ch[v]]
            total += c.local_cost + memory_price * c.resident_bytes
            for w, k, u in [(v, k, u) for k, u in inputs[v]] + [(w, k, v) for w, k in consumers[v]]:
                if (w, k) not in seen:
                    seen.add((w, k))
                    total += cands.edge_price(w, k, cands.by_op[u][ch[u]].output_tiling,
                                              cands.by_op[w][ch[w]].required[k])
        return total

    pc_carried = {pc.piece_id: any((w, k) in carried and u in pc.members for v in pc.members
                                   for w, k, u in [(v, k, u) for k, u in inputs[v]]) for pc in pieces}

    def around(v: int, s: int) -> float:
        """The terms of the cost that depend on operator v's spec, with v on spec s."""
        c = cands.by_op[v][s]
        total = c.local_cost + memory_price * c.resident_bytes
        for k, u in inputs[v]:
            tiling = c.output_tiling if u == v else cands.by_op[u][choice[u]].output_tiling
            total += cands.edge_price(v, k, tiling, c.required[k])
        for w, k in consumers[v]:
            if w != v:  # a self-loop is counted once, above
                total += cands.edge_price(w, k, c.output_tiling, cands.by_op[w][choice[w]].required[k])
        return total

    # equal neighbourhoods (the identical layers of a deep model) take equal steps: a piece's re-solve and an
    # operator's best spec are memoized by everything they read (classes, current specs, edge positions)
    share = repeats.enabled() and cands.classes.keys() >= cands.by_op.keys()  # classes: see Candidates
    classes = cands.classes
    solved: dict[object, tuple[bool, tuple[int, ...]]] = {}
    stepped: dict[object, int] = {}

    def piece_key(pc: Piece) -> object:
        index = {v: j for j, v in enumerate(pc.members)}
        return index[pc.root], tuple(
            (classes[v], choice[v],
             tuple((k, index[u], (v, k) in carried) if u in index else (k, classes[u], choice[u], (v, k) in carried)
                   for k, u in inputs[v]),
             tuple((index[w], k) if w in index else (classes[w], choice[w], k) for w, k in consumers[v]))
            for v in pc.members)

    def step(pc: Piece) -> bool:
        if not share:
            return resolve(pc)
        key = piece_key(pc)
        known = solved.get(key)
        if known is None:
            known = solved[key] = (resolve(pc), tuple(choice[v] for v in pc.members))
        elif known[0]:
            choice.update(zip(pc.members, known[1]))
        return known[0]

    def best_spec(v: int) -> int:
        now = around(v, choice[v])
        best, best_cost = choice[v], now
        for s in eligible[v]:
            cost = around(v, s)
            if cost < best_cost - 1e-12 * max(abs(now), 1.0):
                best, best_cost = s, cost
        return best

    order = sorted(choice)
    for _ in range(_MAX_SWEEPS):
        changed = False
        for pc in pieces:
            if len(pc.members) > 1:
                changed |= step(pc)
        for v in order:
            if len(eligible[v]) < 2:
                continue
            if share:
                key = (classes[v], choice[v],
                       tuple((k, None) if u == v else (k, classes[u], choice[u]) for k, u in inputs[v]),
                       tuple((classes[w], choice[w], k) for w, k in consumers[v] if w != v))
                best = stepped.get(key)
                if best is None:
                    best = stepped[key] = best_spec(v)
            else:
                best = best_spec(v)
            if best != choice[v]:
                choice[v] = best
                changed = True
        if not changed:
            break
    return choice

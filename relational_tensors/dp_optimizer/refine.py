"""Local refinement of a complete choice: the DP is exact on trees, not across the tensors it cuts.

A training graph reads every forward activation again in the backward, so most of its tensors have
several consumers and Algorithm 1 fixes the pieces one after another, each seeing only the pieces fixed
before it.  ``refine`` then lowers the whole-plan cost (``plan.plan_cost``, plus the DP's price on
resident bytes) by coordinate descent: each operator in turn takes the eligible spec that is cheapest
given every neighbour's current spec (its own cost, the repartition of each input from its producer,
and the repartition of each consumer's read of its output), until a sweep changes nothing.  Every step
lowers the cost, so the result is never worse than the DP's, and it is a local optimum for single
operator changes.  ``bench/dp_gap.py`` measures both against the exact optimum.
"""

from __future__ import annotations

from relational_tensors.dp_optimizer.candidates import Candidates
from relational_tensors.frontend.graph import Graph

__all__ = ["refine"]

_MAX_SWEEPS = 32


def refine(graph: Graph, cands: Candidates, choice: dict[int, int], memory_price: float = 0.0) -> dict[int, int]:
    """``choice`` improved operator by operator until no single change lowers the cost."""
    nodes = graph.nodes
    choice = dict(choice)
    consumers: dict[int, list[tuple[int, int]]] = {v: [] for v in choice}
    for v in choice:
        for k, u in enumerate(nodes[v].inputs):
            if u in consumers:
                consumers[u].append((v, k))
    eligible = {v: [s for s, c in enumerate(cands.by_op[v]) if c.eligible] for v in choice}

    def around(v: int, s: int) -> float:
        """The terms of the cost that depend on operator v's spec, with v on spec s."""
        c = cands.by_op[v][s]
        total = c.local_cost + memory_price * c.resident_bytes
        for k, u in enumerate(nodes[v].inputs):
            if u in choice:
                total += cands.edge_price(v, k, cands.by_op[u][choice[u]].output_tiling, c.required[k])
        for w, k in consumers[v]:
            total += cands.edge_price(w, k, c.output_tiling, cands.by_op[w][choice[w]].required[k])
        return total

    order = sorted(choice)
    for _ in range(_MAX_SWEEPS):
        changed = False
        for v in order:
            if len(eligible[v]) < 2:
                continue
            now = around(v, choice[v])
            best, best_cost = choice[v], now
            for s in eligible[v]:
                cost = around(v, s)
                if cost < best_cost - 1e-12 * max(abs(now), 1.0):
                    best, best_cost = s, cost
            if best != choice[v]:
                choice[v] = best
                changed = True
        if not changed:
            break
    return choice

"""The exact optimum of the plan cost, as a mixed-integer program solved by HiGHS (through SciPy).

The objective is the DP's: each operator's spec cost (plus the price on resident bytes) and each edge's
repartition price for the pair (producer's output tiling, tiling the reader needs).  Variables: one
binary x[v, s] per operator and eligible spec, and one y[e, s, t] per edge, producer spec s and reader
spec t, tied to both by marginal constraints (Σ_t y = x[u, s], Σ_s y = x[v, t]), so the y of an
integral x are its outer products and the program is exact.  ``selector="exact"`` uses it; the bench
``bench/dp_gap.py`` measures the DP against it.  SciPy is an optional dependency (``pip install scipy``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from relational_tensors.dp_optimizer.candidates import Candidates
from relational_tensors.errors import PlanError
from relational_tensors.graph.graph import Graph

__all__ = ["exact_choice"]


def _scipy() -> Any:
    try:
        from scipy import optimize, sparse
    except ImportError:
        raise PlanError("selector='exact' solves a mixed-integer program with SciPy's HiGHS, and SciPy is not "
                        "installed; pip install scipy, or use selector='dp'.") from None
    return optimize, sparse


def exact_choice(graph: Graph, cands: Candidates, memory_price: float = 0.0,
                 time_limit_s: float = 600.0) -> tuple[dict[int, int], float]:
    """The spec of each operator that minimizes the plan cost, and the solver's seconds."""
    optimize, sparse = _scipy()
    t0 = time.perf_counter()
    ops = sorted(cands.by_op)
    col: dict[tuple, int] = {}
    cost: list[float] = []
    elig = {v: [c.spec_id for c in cands.eligible(v)] for v in ops}
    for v in ops:
        if not elig[v]:
            raise PlanError(f"operator {graph.nodes[v].name!r} has no eligible spec (none fits in memory).")
        for s in elig[v]:
            c = cands.by_op[v][s]
            col[("x", v, s)] = len(cost)
            cost.append(c.local_cost + memory_price * c.resident_bytes)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []

    def row(entries: list[tuple[int, float]], b: float) -> None:
        for c, a in entries:
            rows.append(len(rhs))
            cols.append(c)
            vals.append(a)
        rhs.append(b)

    for v in ops:
        row([(col[("x", v, s)], 1.0) for s in elig[v]], 1.0)
    for (v, k), u in sorted(cands.sources.items()):  # carried edges (a state's readers) included
        if u == v:  # a self-loop (an update reading the state it writes): a term of v's own spec
            for t in elig[v]:
                c = cands.by_op[v][t]
                cost[col[("x", v, t)]] += cands.edge_price(v, k, c.output_tiling, c.required[k])
            continue
        for s in elig[u]:
            for t in elig[v]:
                col[("y", v, k, s, t)] = len(cost)
                cost.append(cands.edge_price(v, k, cands.by_op[u][s].output_tiling, cands.by_op[v][t].required[k]))
        for s in elig[u]:
            row([(col[("y", v, k, s, t)], 1.0) for t in elig[v]] + [(col[("x", u, s)], -1.0)], 0.0)
        for t in elig[v]:
            row([(col[("y", v, k, s, t)], 1.0) for s in elig[u]] + [(col[("x", v, t)], -1.0)], 0.0)
    a = sparse.coo_array((vals, (rows, cols)), shape=(len(rhs), len(cost))).tocsr()
    objective = np.array(cost)
    objective /= max(float(np.abs(objective).max()), 1e-300)  # seconds are ~1e-4: scaled, tolerances are relative
    integrality = np.array([1 if key[0] == "x" else 0 for key in col], dtype=np.int8)
    res = optimize.milp(objective, constraints=optimize.LinearConstraint(a, rhs, rhs), integrality=integrality,
                        bounds=optimize.Bounds(0, 1), options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9})
    if res.status != 0 or res.x is None:
        raise PlanError(f"the exact selector's program did not solve ({res.message}); use selector='dp'.")
    choice = {v: max(elig[v], key=lambda s: res.x[col[("x", v, s)]]) for v in ops}
    return choice, time.perf_counter() - t0

"""The DP's plan cost against the exact optimum on small random training graphs (forward + backward).

The DP (Algorithm 1 on the pieces left after cutting every multi-consumer tensor) is exact on trees;
a training graph is a DAG whose every forward activation is read again by the backward, so the DP is a
heuristic there.  The exact optimum of the same objective (each operator's spec cost plus each edge's
repartition price, ``dp_optimizer.plan.plan_cost``) is found by a mixed-integer program solved with
SciPy's HiGHS: one binary per (operator, eligible spec), one pair variable per (edge, producer spec,
consumer spec) tied to both by marginal constraints.

    python bench/dp_gap.py [--graphs 30] [--p 4] [--cost-model paper] [--json bench/results/dp_gap.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

import relational_tensors as rt
from relational_tensors.dp_optimizer.plan import plan_cost
from relational_tensors.dp_optimizer.refine import refine


def random_training_graph(rng: np.random.Generator) -> rt.Graph:
    """A small random model (norms, MLP or SwiGLU layers, optionally attention, residuals) with a
    cross-entropy or mean-squared-error loss and the gradient of every parameter."""
    g = rt.Graph()
    tokens, d = int(rng.integers(6, 40)), int(rng.integers(4, 24))
    x = g.input("x", [tokens, d])
    for layer in range(int(rng.integers(1, 3))):
        pre = f"l{layer}."
        h = g.rmsnorm(x, g.parameter(pre + "norm", [d]), 1e-5)
        if rng.random() < 0.4:  # attention over the tokens as one sequence
            heads = int(rng.choice([1, 2]))
            dh = 4
            q = g.reshape(g.matmul(h, g.parameter(pre + "wq", [d, heads * dh])), [1, tokens, heads, dh])
            k = g.reshape(g.matmul(h, g.parameter(pre + "wk", [d, heads * dh])), [1, tokens, heads, dh])
            v = g.reshape(g.matmul(h, g.parameter(pre + "wv", [d, heads * dh])), [1, tokens, heads, dh])
            a = g.reshape(g.attention(q, k, v, causal=True), [tokens, heads * dh])
            x = g.add(x, g.matmul(a, g.parameter(pre + "wo", [heads * dh, d])))
            continue
        f = int(rng.integers(d, 3 * d))
        if rng.random() < 0.5:
            inner = g.unary(g.matmul(h, g.parameter(pre + "w1", [d, f])), "gelu")
        else:
            inner = g.swiglu(g.matmul(h, g.parameter(pre + "w1", [d, f])), g.matmul(h, g.parameter(pre + "w3", [d, f])))
        x = g.add(x, g.matmul(inner, g.parameter(pre + "w2", [f, d])))
    if rng.random() < 0.6:
        vocab = int(rng.integers(8, 64))
        logits = g.matmul(x, g.parameter("head", [d, vocab]))
        loss = g.cross_entropy(logits, g.input("t", [tokens], "int64"))
    else:
        loss = g.mse(x, g.input("target", [tokens, d]))
    g.save(loss, name="loss")
    params = g.trainable()
    for p, dp in zip(params, g.grad(loss, params)):
        g.save(dp, name=f"grad.{p.name}")
    return g


def exact_optimum(graph: rt.Graph, cands) -> tuple[float, dict[int, int], float]:
    """The minimum of ``plan_cost`` over every combination of eligible specs, with its choice and the seconds."""
    t0 = time.perf_counter()
    ops = [n.id for n in graph.operators]
    col: dict[tuple, int] = {}
    cost: list[float] = []

    def var(key: tuple, c: float) -> int:
        col[key] = len(cost)
        cost.append(c)
        return col[key]

    elig = {v: [s for s, c in enumerate(cands.by_op[v]) if c.eligible] for v in ops}
    for v in ops:
        for s in elig[v]:
            var(("x", v, s), cands.by_op[v][s].local_cost)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries: list[tuple[int, float]], b: float) -> None:
        r = len(lo)
        for c, a in entries:
            rows.append(r)
            cols.append(c)
            vals.append(a)
        lo.append(b)
        hi.append(b)

    for v in ops:
        row([(col[("x", v, s)], 1.0) for s in elig[v]], 1.0)
    for v in ops:
        for k, u in enumerate(graph.nodes[v].inputs):
            if graph.nodes[u].op is None:
                continue
            for s in elig[u]:
                for t in elig[v]:
                    price = cands.edge_price(v, k, cands.by_op[u][s].output_tiling, cands.by_op[v][t].required[k])
                    var(("y", v, k, s, t), price)
            for s in elig[u]:
                row([(col[("y", v, k, s, t)], 1.0) for t in elig[v]] + [(col[("x", u, s)], -1.0)], 0.0)
            for t in elig[v]:
                row([(col[("y", v, k, s, t)], 1.0) for s in elig[u]] + [(col[("x", v, t)], -1.0)], 0.0)
    n = len(cost)
    a = coo_array((vals, (rows, cols)), shape=(len(lo), n)).tocsr()
    integrality = np.array([1 if key[0] == "x" else 0 for key in col], dtype=np.int8)
    res = milp(np.array(cost), constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options={"time_limit": 600})
    if res.status != 0:
        raise RuntimeError(f"the MILP did not solve: {res.message}")
    choice = {v: next(s for s in elig[v] if res.x[col[("x", v, s)]] > 0.5) for v in ops}
    return plan_cost(graph, cands, choice), choice, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphs", type=int, default=30)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost-model", default="paper")
    ap.add_argument("--tactic", default="tree")
    ap.add_argument("--json", default="bench/results/dp_gap.json")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    for i in range(args.graphs):
        g = random_training_graph(rng)
        cg = rt.compileGraph(g, device=f"cpu:{args.p}", cost_model=args.cost_model, tactic=args.tactic,
                             memory_per_device=1 << 40)
        dp = cg.plan.cost
        t0 = time.perf_counter()
        refined = plan_cost(g, cg.plan.candidates, refine(g, cg.plan.candidates, cg.plan.choice))
        refine_s = time.perf_counter() - t0
        best, _, seconds = exact_optimum(g, cg.plan.candidates)
        gap = dp / best - 1.0 if best > 0 else 0.0
        rgap = refined / best - 1.0 if best > 0 else 0.0
        rows.append({"graph": i, "ops": len(g.operators), "dp_cost": dp, "refined_cost": refined, "exact_cost": best,
                     "gap": gap, "refined_gap": rgap, "milp_s": round(seconds, 3), "refine_s": round(refine_s, 4)})
        print(f"graph {i:2d}: {len(g.operators):3d} ops  dp {dp:.6g}  refined {refined:.6g}  exact {best:.6g}  "
              f"gap {100 * gap:6.2f}% -> {100 * rgap:6.2f}%  (MILP {seconds:.2f} s)")
        assert dp >= best * (1 - 1e-9) and refined >= best * (1 - 1e-9), "nothing beats the exact optimum"
    gaps = [r["gap"] for r in rows]
    rgaps = [r["refined_gap"] for r in rows]
    summary = {"p": args.p, "cost_model": args.cost_model, "tactic": args.tactic, "graphs": len(rows),
               "mean_gap": statistics.mean(gaps), "worst_gap": max(gaps),
               "optimal": sum(1 for x in gaps if x <= 1e-9),
               "refined_mean_gap": statistics.mean(rgaps), "refined_worst_gap": max(rgaps),
               "refined_optimal": sum(1 for x in rgaps if x <= 1e-9),
               "mean_ops": statistics.mean(r["ops"] for r in rows)}
    print(json.dumps(summary, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"summary": summary, "graphs": rows}, indent=2))


if __name__ == "__main__":
    main()

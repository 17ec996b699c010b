"""The DP's plan cost against the exact optimum on small random training graphs (forward + backward).

The DP (Algorithm 1 on the pieces left after cutting every multi-consumer tensor) is exact on trees;
a training graph is a DAG whose every forward activation is read again by the backward, so the DP is a
heuristic there.  The exact optimum of the same objective (each operator's spec cost plus each edge's
repartition price, ``dp_optimizer.plan.plan_cost``) is found by the mixed-integer program of
``dp_optimizer.exact`` (SciPy's HiGHS), the ``selector="exact"`` of the compiler.

    python bench/dp_gap.py [--graphs 30] [--p 4] [--cost-model paper] [--json bench/results/dp_gap.json]
    python bench/dp_gap.py --training-block     # the LLaMA-3-8B-shaped training block at p = 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import relational_tensors as rt
from relational_tensors.dp_optimizer.exact import exact_choice
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
    """The minimum of ``plan_cost`` over every combination of eligible specs, its choice and the seconds."""
    choice, seconds = exact_choice(graph, cands)
    return plan_cost(graph, cands, choice), choice, seconds


def training_block(path: str) -> None:
    """Algorithm 1, the refined plan and the exact optimum on the 8B-shaped training block, p = 8."""
    from relational_tensors.graph.models import LLAMA3_8B, llama_training_graph

    g = llama_training_graph(1, 8192, dtype="float16", vocab=128256, **LLAMA3_8B)
    rows = []
    for cost_model in ("paper", "calibrated"):
        raw = rt.compileGraph(g, device="cpu:8", memory_per_device=141 << 30, refine=False, cost_model=cost_model)
        refined = plan_cost(g, raw.plan.candidates, refine(g, raw.plan.candidates, raw.plan.choice, pieces=raw.pieces))
        best, _, seconds = exact_optimum(g, raw.plan.candidates)
        rows.append({"cost_model": cost_model, "ops": len(g.operators), "dp_cost": raw.plan.cost,
                     "refined_cost": refined, "exact_cost": best, "gap": raw.plan.cost / best - 1,
                     "refined_gap": refined / best - 1, "milp_s": seconds})
        print(json.dumps(rows[-1]))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rows, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--training-block", action="store_true")
    ap.add_argument("--graphs", type=int, default=30)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost-model", default="paper")
    ap.add_argument("--tactic", default="tree")
    ap.add_argument("--json", default="bench/results/dp_gap.json")
    args = ap.parse_args()
    if args.training_block:
        training_block("bench/results/dp_gap_training_block.json")
        return
    rng = np.random.default_rng(args.seed)
    rows = []
    for i in range(args.graphs):
        g = random_training_graph(rng)
        cg = rt.compileGraph(g, device=f"cpu:{args.p}", cost_model=args.cost_model, tactic=args.tactic,
                             memory_per_device=1 << 40, refine=False)  # Algorithm 1 alone; refined below
        dp = cg.plan.cost
        t0 = time.perf_counter()
        refined = plan_cost(g, cg.plan.candidates, refine(g, cg.plan.candidates, cg.plan.choice, pieces=cg.pieces))
        refine_s = time.perf_counter() - t0
        best, _, seconds = exact_optimum(g, cg.plan.candidates)
        gap = dp / best - 1.0 if best > 0 else 0.0
        rgap = refined / best - 1.0 if best > 0 else 0.0
        rows.append({"graph": i, "ops": len(g.operators), "dp_cost": dp, "refined_cost": refined, "exact_cost": best,
                     "gap": gap, "refined_gap": rgap, "milp_s": round(seconds, 3), "refine_s": round(refine_s, 4)})
        print(f"graph {i:2d}: {len(g.operators):3d} ops  dp {dp:.6g}  refined {refined:.6g}  exact {best:.6g}  "
              f"gap {100 * gap:6.2f}% -> {100 * rgap:6.2f}%  (MILP {seconds:.2f} s)")
        assert dp >= best * (1 - 1e-7) and refined >= best * (1 - 1e-7), "nothing beats the exact optimum"
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

"""dk and dv of attention as one operator ("packed": dk and dv side by side, one pass over the scores,
then two slices) or as two ("separate": each recomputes the scores and reads every input): planning
time, the plan's cost, the bytes moved between devices, the FLOPs of the gradient operators, and the
simulated step time, side by side on the LLaMA-3-8B-shaped training graph at p = 8.

    python bench/attention_grad.py [--rounds 10] [--tokens 8192] [--json bench/results/attention_grad.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import relational_tensors as rt
from relational_tensors.dp_optimizer.candidates import specs_for
from relational_tensors.graph.models import LLAMA3_8B, llama_training_graph
from relational_tensors.sql_specs import attention

H200_MEMORY = 141 * (1 << 30)


def measure(mode: str, tokens: int, rounds: int, cost_model: str) -> dict:
    attention.KV_GRADIENTS["mode"] = mode
    g = llama_training_graph(1, tokens, dtype="bfloat16", vocab=128256, **LLAMA3_8B)
    specs_for.cache_clear()
    for _ in range(2):  # warm-ups
        cg = rt.compileGraph(g, device="cpu:8", memory_per_device=H200_MEMORY, cost_model=cost_model)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cg = rt.compileGraph(g, device="cpu:8", memory_per_device=H200_MEMORY, cost_model=cost_model)
        times.append(time.perf_counter() - t0)
    grads = [n for n in g.operators if n.kind == "attention_grad"]
    flops = sum(f.flops for n in grads for f in cg.plan.spec(n.id).functions)
    return {"mode": mode, "ops": len(g.operators), "compile_mean_s": statistics.mean(times),
            "compile_min_s": min(times), "plan_cost": cg.plan.cost, "bytes_moved": cg.dag.bytes_moved(),
            "attention_grad_ops": len(grads), "attention_grad_flops": flops,
            "simulated_step_s": cg.simulate(), "splits": {n.name: cg.plan.split(n.id) for n in grads}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cost-model", default="calibrated")
    ap.add_argument("--json", default="bench/results/attention_grad.json")
    args = ap.parse_args()
    rows = [measure(mode, args.tokens, args.rounds, args.cost_model) for mode in ("packed", "separate")]
    attention.KV_GRADIENTS["mode"] = "packed"
    for r in rows:
        print(json.dumps(r, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"tokens": args.tokens, "cost_model": args.cost_model, "rows": rows},
                                          indent=2))
    print("| kv gradient | ops | compile, warm mean (s) | plan cost | bytes moved | attention-grad GFLOP | "
          "simulated step (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ops']} | {r['compile_mean_s']:.3f} | {r['plan_cost']:.4g} | "
              f"{r['bytes_moved'] / 1e9:.2f} GB | {r['attention_grad_flops'] / 1e9:.0f} | "
              f"{1e3 * r['simulated_step_s']:.2f} |")


if __name__ == "__main__":
    main()

"""Planning time of the logical optimizer (issue: catalog and DP).

Compiles the LLaMA-3-8B-shaped block (d_model 4096, 32/8 heads, head dim 128,
FFN 14336, float16) at p = 8 for the paper's five token workloads, and a
32-layer stack of such blocks, with 2 warm-ups and 10 timed rounds each
(the warm-ups also fill the per-operator spec cache, as repeated compilation
in one process does; the cold first compile is reported separately).

    python bench/compile_time.py [--rounds 10] [--layers 32]
    python bench/compile_time.py --grad [--rounds 10]
    python bench/compile_time.py --step [--rounds 10] [--layers 32]

``--grad`` times forward + backward instead: the block as a language model's training graph
(embedding, the block, final norm, LM head over a 128,256-entry vocabulary, cross-entropy, and the
gradient of every parameter; ``models.llama_training_graph``) for the same workloads.  ``--step`` times
the whole training step: the same graph with the parameters as states and AdamW's update (bfloat16), for
the workloads and for a stack of ``--layers`` blocks at 8K tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

from common import WORKLOADS  # the paper's five token workloads (bench/common.py)

import relational_tensors as rt
from relational_tensors.dp_optimizer.candidates import specs_for
from relational_tensors.models import LLAMA3_8B, llama_block, llama_training_graph

VOCAB = 128256  # LLaMA 3's

# pinned so that plans do not depend on the memory of the host that compiles them (an H200's 141 GiB)
H200_MEMORY = 141 * (1 << 30)


def timed(build, rounds: int, warmups: int = 2) -> dict[str, float]:
    specs_for.cache_clear()
    g = build()
    t0 = time.perf_counter()
    cg = rt.compileGraph(g, device="cpu:8", memory_per_device=H200_MEMORY)
    cold = time.perf_counter() - t0
    for _ in range(warmups - 1):
        rt.compileGraph(g, device="cpu:8", memory_per_device=H200_MEMORY)
    logical = ("target", "candidates", "pieces", "catalog", "select", "check")
    times, plans = [], []
    for _ in range(rounds):  # each timed compile also reports its passes: the logical ones are the planning
        cg = None  # the previous plan is released (and collected) before the clock starts: one plan at a time
        gc.collect()
        t0 = time.perf_counter()
        cg = rt.compileGraph(g, device="cpu:8", memory_per_device=H200_MEMORY)
        times.append(time.perf_counter() - t0)
        plans.append(sum(v for k, v in cg.timings.items() if k in logical))
    return {"cold_s": cold, "mean_s": statistics.mean(times), "min_s": min(times), "max_s": max(times),
            "plan_mean_s": statistics.mean(plans), "ops": len(g.operators),
            "passes": {k: round(v, 4) for k, v in cg.timings.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--grad", action="store_true", help="forward + backward (training graphs)")
    ap.add_argument("--step", action="store_true", help="forward + backward + AdamW (training steps)")
    args = ap.parse_args()
    results = {}
    for name, (b, s) in WORKLOADS.items():
        if args.step:
            key = f"train step {name}"
            results[key] = timed(lambda b=b, s=s: llama_training_graph(b, s, dtype="bfloat16", vocab=VOCAB,
                                                                       optimizer="adamw", **LLAMA3_8B), args.rounds)
        elif args.grad:
            key = f"train block {name}"
            results[key] = timed(lambda b=b, s=s: llama_training_graph(b, s, dtype="float16", vocab=VOCAB,
                                                                       **LLAMA3_8B), args.rounds)
        else:
            key = f"block {name}"
            results[key] = timed(lambda b=b, s=s: llama_block(b, s, dtype="float16", **LLAMA3_8B), args.rounds)
        print(key, results[key])
    if args.step:
        stack = f"train step, {args.layers} layers 8K"
        results[stack] = timed(lambda: llama_training_graph(1, 8192, dtype="bfloat16", vocab=VOCAB, layers=args.layers,
                                                            optimizer="adamw", **LLAMA3_8B), 2, warmups=1)
        print(stack, results[stack])
    elif not args.grad:
        stack = f"{args.layers} layers 8K"
        results[stack] = timed(lambda: llama_block(1, 8192, dtype="float16", layers=args.layers, **LLAMA3_8B),
                               max(2, args.rounds // 5), warmups=1)
        print(stack, results[stack])
    out = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}",
           "python": platform.python_version(), "p": 8, "results": results}
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    stem = "compile_time_step" if args.step else "compile_time_grad" if args.grad else "compile_time"
    Path(f"bench/results/{stem}.json").write_text(json.dumps(out, indent=2))
    lines = ["| graph | ops | compile, cold (s) | compile, warm mean (s) | of which logical planning (s) |",
             "|---|---|---|---|---|"]
    for k, r in results.items():
        lines.append(f"| {k} | {r['ops']} | {r['cold_s']:.3f} | {r['mean_s']:.3f} | {r['plan_mean_s']:.3f} |")
    Path(f"bench/results/{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The plan of the LLaMA-3-8B-shaped block as a training graph at p = 8: the split the optimizer chose for
each matmul of the forward and each contraction and attention operator of the backward, as a Markdown
table (docs/training.md shows it).

    python bench/plan_training.py [--tokens 8192] [--cost-model paper] [--out bench/results/plan_training.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, llama_training_graph

H200_MEMORY = 141 * (1 << 30)
SHOWN = ("matmul", "einsum", "attention", "attention_lse", "attention_delta", "attention_grad", "embedding",
         "embedding_grad", "cross_entropy", "cross_entropy_grad", "norm_weight_grad")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cost-model", default="paper")
    ap.add_argument("--out", default="bench/results/plan_training.md")
    args = ap.parse_args()
    g = llama_training_graph(1, args.tokens, dtype="float16", vocab=128256, **LLAMA3_8B)
    cg = rt.compileGraph(g, device="cpu:8", memory_per_device=H200_MEMORY, cost_model=args.cost_model)
    lines = ["| operator | kind | computes | split | repartitions in |", "|---|---|---|---|---|"]
    for n in g.operators:
        if n.kind not in SHOWN:
            continue
        assert n.op is not None  # g.operators: the nodes that have an operator
        what = n.op.signature() if n.kind in ("matmul", "einsum") else ""
        if n.kind == "attention_grad":
            what = n.op.params()["part"]
        moved = [g.nodes[n.inputs[k]].name for c, k in cg.plan.repartitions() if c == n.name]
        lines.append(f"| {n.name} | {n.kind} | {what} | {cg.plan.split(n.id)} | {', '.join(moved) or '-'} |")
    text = "\n".join(lines) + "\n"
    total = (f"{len(g.operators)} operators; plan cost {cg.plan.cost:,.0f} elements; "
             f"{cg.dag.bytes_moved() / 1e9:.2f} GB between devices per step\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n" + total)
    print(text + "\n" + total)


if __name__ == "__main__":
    main()

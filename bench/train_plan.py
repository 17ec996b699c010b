"""A training step planned under a memory limit: a 4-layer LLaMA-3-8B-shaped model (embedding, 4 blocks,
LM head over 128,256 entries, cross-entropy), bfloat16 parameters and activations, AdamW with float32
master weights and moments, 8K tokens, planned for 8 H200s (simulated) with ``memory_per_device`` = 8 GiB,
under which replicated parameters, master weights and moments do not fit.  The table says how each kind of
tensor is laid out over the devices, the predicted step time, and each device's peak memory by category.

    python bench/train_plan.py [--layers 4] [--memory 8GiB] [--keep-states auto] [--out bench/results/train_plan.md]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import relational_tensors as rt
from relational_tensors.cli.main import parse_bytes
from relational_tensors.graph.models import LLAMA3_8B, llama_training_graph


def layout(cg: rt.CompiledGraph, name: str) -> str:
    """How a state's kept blocks lie on the devices (replicated, sharded k ways, or both), with how the
    plan keeps it (as read or sharded) and its DTensor-style placement."""
    row = next(r for r in cg.state_layouts() if r["state"] == name)
    return f"{row['kept']} {row['placement']}: {_blocks(cg, name)}"


def _blocks(cg: rt.CompiledGraph, name: str) -> str:
    blocks = cg.dag.inputs[name]
    shape = cg.graph.node(name).type.shape
    boxes = Counter((box.lower, box.upper) for box, _ in blocks)
    devices = len({cg.dag.buffers[b].device for _, b in blocks})
    if len(boxes) == 1 and all(hi - lo == s for lo, hi, s in zip(*next(iter(boxes)), shape)):
        return f"replicated on {devices}"
    copies = max(boxes.values())
    return f"sharded {len(boxes)} ways" + (f", {copies} copies" if copies > 1 else "") + f" over {devices}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--memory", type=parse_bytes, default=8 << 30)
    ap.add_argument("--keep-states", default="auto", choices=["auto", "as read", "sharded"])
    ap.add_argument("--out", default="bench/results/train_plan.md")
    args = ap.parse_args()
    g = llama_training_graph(1, args.tokens, dtype="bfloat16", vocab=128256, layers=args.layers,
                             optimizer="adamw", master_dtype="float32", **LLAMA3_8B)
    state_bytes = sum(n.type.nbytes for n in g.inputs if n.role == "state")
    t0 = time.perf_counter()
    cg = rt.compileGraph(g, device=8, topology="hgx-h200", memory_per_device=args.memory,
                         keep_states=args.keep_states)
    planned = time.perf_counter() - t0
    kinds: dict[str, Counter] = {}
    categories = g.memory_categories()
    for n in g.inputs:
        if n.role != "state":
            continue
        kind = categories[n.id]
        if kind == "optimizer state":
            kind = "master weights" if n.name.endswith(".master") else "moments" if "exp_avg" in n.name else "step"
        kinds.setdefault(kind, Counter())[layout(cg, n.name)] += 1
    peak = cg.memory()
    cats = cg.memory_by_category()
    lines = [f"{len(g.operators)} operators; states {state_bytes / 2**30:.1f} GiB in all "
             f"(replicated they would need that on every device); planned in {planned:.1f} s; "
             f"predicted step {1e3 * cg.simulate():.1f} ms on hgx-h200 (simulated)", "",
             "| tensors | layouts (count) |", "|---|---|"]
    for kind, c in kinds.items():
        lines.append(f"| {kind} | " + "; ".join(f"{k} ({v})" for k, v in c.most_common()) + " |")
    order = sorted({k for c in cats.values() for k in c})
    lines += ["", "| device | peak (GiB) | " + " | ".join(order) + " |", "|---|---|" + "---|" * len(order)]
    for d in sorted(peak):
        lines.append(f"| {d} | {peak[d] / 2**30:.2f} | " +
                     " | ".join(f"{cats.get(d, {}).get(k, 0) / 2**30:.2f}" for k in order) + " |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"peak": peak, "by_category": cats, "planned_s": planned, "step_s": cg.simulate(),
         "layouts": {k: dict(v) for k, v in kinds.items()}}, indent=2))
    print(text)


if __name__ == "__main__":
    main()

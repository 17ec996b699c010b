"""Hand-written parallel plans against the optimizer's, in one catalog, on two machines (simulated).

Each workload is planned for 8 devices of each topology with the calibrated cost model, once freely
(the optimizer's plan) and once under each hand plan of ``rt.plans`` (the hand plan's constraints; what
they leave open is still the optimizer's), and every compilation is simulated on its topology, which
records ``compilations.predicted_seconds``.  The table is one named query over the catalog file
(``sql/queries/plan_times.sql``):

* ``block 8K``: the LLaMA-3-8B-shaped block, one sequence of 8192 tokens, bfloat16: Megatron tensor
  parallelism, and with sequence parallelism;
* ``block 8x1K``: the same block on 8 sequences of 1024: data parallelism, and Megatron TP;
* ``step 8x1K``: a 4-layer LLaMA-3-8B-shaped training step (embedding, 4 blocks, LM head over 128,256
  entries, cross-entropy, AdamW with float32 master weights and moments) on 8 sequences of 1024:
  DDP (states replicated), FSDP (states sharded), Megatron TP (states as their readers read them).

    python bench/hand_plans.py [--catalog /tmp/hand_plans.duckdb] [--layers 4] [--out bench/results/hand_plans.md]
    relational-tensors query /tmp/hand_plans.duckdb plan_times     # the same table from the file
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import write_table  # bench/common.py

import relational_tensors as rt
from relational_tensors.catalog import Catalog
from relational_tensors.graph.models import LLAMA3_8B, llama_block, llama_training_graph

TOPOLOGIES = ("hgx-h200", "dgx-a100")


def workloads(layers: int) -> list[tuple[str, rt.Graph, tuple[str, ...]]]:
    return [
        ("block 8K", llama_block(1, 8192, dtype="bfloat16", **LLAMA3_8B), ("megatron_tp", "sequence_parallel")),
        ("block 8x1K", llama_block(8, 1024, dtype="bfloat16", **LLAMA3_8B), ("data_parallel", "megatron_tp")),
        (f"step {layers}L 8x1K", llama_training_graph(8, 1024, dtype="bfloat16", vocab=128256, layers=layers,
                                                      optimizer="adamw", master_dtype="float32", **LLAMA3_8B),
         ("ddp", "fsdp", "megatron_tp")),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--catalog", default="/tmp/hand_plans.duckdb")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--out", default="bench/results/hand_plans.md")
    args = ap.parse_args()
    Path(args.catalog).unlink(missing_ok=True)
    catalog = Catalog(args.catalog)
    timings = []
    for name, g, plans in workloads(args.layers):
        for plan in ("optimizer", *plans):
            constraints = None if plan == "optimizer" else rt.plans.PLANS[plan](g, args.p)
            for topology in TOPOLOGIES:
                t0 = time.perf_counter()
                cg = rt.compileGraph(g, device=args.p, topology=topology, cost_model="calibrated",
                                     catalog=catalog, label=f"{name}: {plan}", constraints=constraints)
                planned = time.perf_counter() - t0
                step = cg.simulate()
                timings.append(dict(label=f"{name}: {plan}", topology=topology, planned_s=planned,
                                    simulated_ms=1e3 * step, constraints=len(constraints or {})))
                print(f"{name}: {plan} on {topology}: planned in {planned:.1f} s, {1e3 * step:.2f} ms", flush=True)
    table = catalog.query("plan_times")
    cols = table.column_names[:5]
    lines = ["| plan | " + " | ".join(cols[1:]) + " |", "|---|" + "---|" * (len(cols) - 1)]
    for row in table.to_pylist():
        lines.append(f"| {row['label']} | " + " | ".join(f"{row[c]:.2f}" if row[c] is not None else "-"
                                                          for c in cols[1:]) + " |")
    write_table(args.out, lines, timings)


if __name__ == "__main__":
    main()

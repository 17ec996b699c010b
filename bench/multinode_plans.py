"""A training step on 2, 4 and 8 HGX H200 nodes (InfiniBand rails), simulated: the optimizer's plan
against the hand plans of ``rt.plans`` that a multi-node run uses.

The workload is the LLaMA-3-8B-shaped training step (embedding, ``--layers`` blocks, LM head over 128,256
entries, cross-entropy, AdamW with float32 master weights and moments, bfloat16) on one sequence of
``--seq`` tokens per GPU (a global batch that grows with the machine, as data parallelism scales).  Each
plan is compiled with the calibrated cost model for all the machine's GPUs and simulated on the machine:

* ``optimizer``: no constraint;
* ``fsdp``: data parallelism, every state sharded over all GPUs (ZeRO-3);
* ``megatron_dp``: tensor parallelism inside each node of 8, data parallelism across nodes, states
  replicated across nodes;
* ``fsdp_tp``: the same splits with every state sharded over all GPUs (torchtitan's 2-D);
* ``ddp``: data parallelism, every state replicated (refused where it does not fit).

Reported per plan: the simulated step, the peak memory of the fullest GPU, the bytes that cross between
nodes per step (copies whose source and destination GPUs are in different nodes) and the planning time.
Pipeline stages are not among the plans.

    python bench/multinode_plans.py [--machines 2x-hgx-h200-ib,4x-hgx-h200-ib,8x-hgx-h200-ib] [--layers 4]
        [--seq 1024] [--out bench/results/multinode_plans.md]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import header, header_markdown, write_table  # bench/common.py

import relational_tensors as rt
from relational_tensors.errors import PlanError
from relational_tensors.graph.models import LLAMA3_8B, llama_training_graph
from relational_tensors.machine.machines import get_topology

PLANS = ("optimizer", "fsdp", "megatron_dp", "fsdp_tp", "ddp")
NODE = 8  # GPUs per HGX node: device d is in node d // 8


def cross_node_bytes(cg: rt.CompiledGraph) -> int:
    dag = cg.lowered.dag
    return sum(dag.buffers[t.outputs[0]].nbytes for t in dag.tasks
               if t.kind == "copy" and t.src_device is not None and t.src_device // NODE != t.device // NODE)


def run(machine: str, plan: str, layers: int, seq: int) -> dict[str, Any]:
    p = len(get_topology(machine).sites)
    g = llama_training_graph(p, seq, dtype="bfloat16", vocab=128256, layers=layers, optimizer="adamw",
                             master_dtype="float32", **LLAMA3_8B)
    constraints = None if plan == "optimizer" else rt.plans.PLANS[plan](g, p)
    row: dict[str, Any] = dict(machine=machine, p=p, plan=plan, layers=layers, tokens=p * seq)
    t0 = time.process_time()
    try:
        cg = rt.compileGraph(g, device=f"cpu:{p}", topology=machine, cost_model="calibrated",
                             memory_per_device=141 << 30, constraints=constraints)
    except PlanError as e:  # a plan that does not fit is refused before it runs
        row.update(refused=str(e).split("\n")[0][:160])
        return row
    row["planned_cpu_s"] = time.process_time() - t0
    row["step_ms"] = 1e3 * cg.simulate()
    row["peak_gib"] = max(cg.live.peak.values()) / 2**30
    row["cross_node_gb"] = cross_node_bytes(cg) / 1e9
    row["tasks"] = len(cg.lowered.dag.tasks)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="2x-hgx-h200-ib,4x-hgx-h200-ib,8x-hgx-h200-ib")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/multinode_plans.md")
    args = ap.parse_args()
    machines = args.machines.split(",")
    rows = []
    for machine in machines:
        for plan in args.plans.split(","):
            rows.append(run(machine, plan, args.layers, args.seq))
            print(rows[-1], flush=True)
    head = header(f"The {args.layers}-layer 8B-shaped training step on several nodes", machines,
                  "cpu:<p> logical devices, priced and simulated on each machine",
                  notes=[f"one sequence of {args.seq} tokens per GPU; bfloat16, AdamW with float32 masters",
                         "cross-node GB: bytes per step copied between GPUs of different nodes"])
    head["dtype"] = "bfloat16"
    lines = [*header_markdown(head), "| machine | p | plan | step ms | peak GiB / GPU | cross-node GB / step "
             "| tasks | planned (CPU s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['machine']} | {r['p']} | {r['plan']} | refused: {r['refused']} | | | | |")
            continue
        lines.append(f"| {r['machine']} | {r['p']} | {r['plan']} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | "
                     f"{r['cross_node_gb']:.2f} | {r['tasks']} | {r['planned_cpu_s']:.1f} |")
    write_table(args.out, lines, {**head, "rows": rows})


if __name__ == "__main__":
    main()

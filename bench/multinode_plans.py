"""A training step on 2, 4 and 8 HGX H200 nodes (InfiniBand rails), simulated: the optimizer's plan
against the hand plans of ``rt.plans`` that a multi-node run uses.

The workload is the LLaMA-3-8B-shaped (``--shape 70b``: 70B-shaped) training step (embedding, ``--layers``
blocks, LM head over 128,256 entries, cross-entropy, AdamW with float32 master weights and moments,
bfloat16) on one sequence of ``--seq`` tokens per GPU (a global batch that grows with the machine, as data
parallelism scales).  Each plan is compiled with the calibrated cost model for all the machine's GPUs and
simulated on the machine:

* ``optimizer``: no constraint;
* ``fsdp``: data parallelism, every state sharded over all GPUs (ZeRO-3);
* ``megatron_dp``: tensor parallelism inside each node of 8, data parallelism across nodes, states
  replicated across nodes;
* ``fsdp_tp``: the same splits with every state sharded over all GPUs (torchtitan's 2-D);
* ``ddp``: data parallelism, every state replicated (refused where it does not fit);
* ``pipeline``: pipeline stages of one node each (``rt.Pipeline(nodes, 2 * nodes, "1f1b")``), the
  optimizer's plan inside each stage;
* ``megatron_pp``: Megatron tensor parallelism inside each node and a pipeline stage per node (the same
  pipeline), Megatron-LM's TP x PP;
* ``auto``: ``pipeline="auto"``, the planner's choice among no pipeline and 2, 4 or 8 stages
  (``driver.pipelines``), each simulated.

Reported per plan: the simulated step, the peak memory of the fullest GPU, the bytes that cross between
nodes per step (copies whose source and destination GPUs are in different nodes), the share of the GPUs'
time they compute nothing in the simulation (for a pipeline, its bubble and the transfers it waits for),
beside a pipeline's ideal bubble ((stages - 1) / (micro-batches + stages - 1), the share of a step a stage
waits when every stage takes the same time and transfers are free), and the planning time.  The result
file is written after every plan.

    python bench/multinode_plans.py [--machines 2x-hgx-h200-ib,4x-hgx-h200-ib,8x-hgx-h200-ib] [--layers 4]
        [--seq 1024] [--shape 8b|70b] [--out bench/results/multinode_plans.md]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from common import header, header_markdown, write_table  # bench/common.py

import relational_tensors as rt
from relational_tensors.errors import PlanError
from relational_tensors.graph.models import LLAMA3_8B, LLAMA3_70B, llama_training_graph
from relational_tensors.machine.machines import get_topology

PLANS = ("optimizer", "fsdp", "megatron_dp", "fsdp_tp", "ddp", "pipeline", "megatron_pp", "auto")
COMPUTE = ("kernel", "aggregate", "decompose", "recompose")  # the tasks a GPU computes
NODE = 8  # GPUs per HGX node: device d is in node d // 8


def cross_node_bytes(cg: rt.CompiledGraph) -> int:
    dag = cg.lowered.dag
    return sum(dag.buffers[t.outputs[0]].nbytes for t in dag.tasks
               if t.kind == "copy" and t.src_device is not None and t.src_device // NODE != t.device // NODE)


SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}


def run(machine: str, plan: str, layers: int, seq: int, shape: str = "8b", memory_gib: float = 141) -> dict[str, Any]:
    p = len(get_topology(machine).sites)
    g = llama_training_graph(p, seq, dtype="bfloat16", vocab=128256, layers=layers, optimizer="adamw",
                             master_dtype="float32", **SHAPES[shape])
    nodes = p // NODE
    pipeline = rt.Pipeline(nodes, 2 * nodes, "1f1b") if plan in ("pipeline", "megatron_pp") else None
    constraints = (None if plan in ("optimizer", "pipeline", "auto") else rt.plans.megatron_tp(g, NODE)
                   if plan == "megatron_pp" else rt.plans.PLANS[plan](g, p))
    row: dict[str, Any] = dict(machine=machine, p=p, plan=plan, layers=layers, tokens=p * seq)
    t0 = time.process_time()
    try:
        cg = rt.compileGraph(g, device=f"cpu:{p}", topology=machine, cost_model="calibrated",
                             memory_per_device=int(memory_gib * 2**30), constraints=constraints,
                             pipeline="auto" if plan == "auto" else pipeline)
    except PlanError as e:  # a plan that does not fit is refused before it runs
        row.update(refused=str(e).split("\n")[0][:160])
        return row
    row["planned_cpu_s"] = time.process_time() - t0
    chosen = cg.options.pipeline
    assert chosen is None or isinstance(chosen, rt.Pipeline)
    row["stages"], row["micro_batches"] = (chosen.stages, chosen.micro_batches) if chosen else (1, 1)
    row["ideal_bubble"] = (row["stages"] - 1) / (row["micro_batches"] + row["stages"] - 1)
    sim = cg.simulation()
    row["step_ms"] = 1e3 * sim.time
    busy = sum(t.end - t.start for t in sim.tasks if t.kind in COMPUTE)
    row["idle"] = 1 - busy / (p * sim.time)
    row["peak_gib"] = max(cg.live.peak.values()) / 2**30
    row["cross_node_gb"] = cross_node_bytes(cg) / 1e9
    row["tasks"] = len(cg.lowered.dag.tasks)
    row["splits"] = chosen_splits(g, cg)
    return row


# what the plan chose inside a stage: the first operator whose name ends so, or of that kind
SHOWN = ("q_proj", "attention", "o_proj", "gate_proj", "down_proj", "embedding_grad")


def chosen_splits(g: rt.Graph, cg: rt.CompiledGraph) -> str:
    """The split of a few operators of the first layer in one stage's plan (``split_text``, per stage)."""
    picks = []
    for suffix in SHOWN:
        node = next((n for n in g.operators if n.name.endswith(suffix) or n.kind == suffix), None)
        if node is not None:
            picks.append(f"{suffix} {cg.plan.candidate(node.id).spec.split_text or 'whole'}")
    return "; ".join(picks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", default="2x-hgx-h200-ib,4x-hgx-h200-ib,8x-hgx-h200-ib")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--shape", default="8b", choices=tuple(SHAPES))
    ap.add_argument("--memory-gib", type=float, default=141, help="memory per GPU the plans must fit (H200: 141)")
    ap.add_argument("--out", default="bench/results/multinode_plans.md")
    args = ap.parse_args()
    machines = args.machines.split(",")
    rows: list[dict[str, Any]] = []
    for machine in machines:
        for plan in args.plans.split(","):
            rows.append(run(machine, plan, args.layers, args.seq, args.shape, args.memory_gib))
            print(rows[-1], flush=True)
            write(args, machines, rows)  # after every plan: a long run cut off keeps what it measured


def write(args: argparse.Namespace, machines: list[str], rows: list[dict[str, Any]]) -> None:
    head = header(f"The {args.layers}-layer {args.shape.upper()}-shaped training step on several nodes", machines,
                  "cpu:<p> logical devices, priced and simulated on each machine",
                  notes=[f"one sequence of {args.seq} tokens per GPU; bfloat16, AdamW with float32 masters",
                         f"plans must fit {args.memory_gib:g} GiB per GPU",
                         "cross-node GB: bytes per step copied between GPUs of different nodes",
                         "idle: the share of the GPUs' simulated time without a kernel, ⊕ or assembly",
                         "ideal bubble: (stages - 1) / (micro-batches + stages - 1)"])
    head["dtype"] = "bfloat16"
    lines = [*header_markdown(head), "| machine | p | plan | stages x micro-batches | step ms | peak GiB / GPU "
             "| cross-node GB / step | idle | ideal bubble | tasks | planned (CPU s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['stages']} x {r['micro_batches']}" if "stages" in r else ""
        if "refused" in r:
            lines.append(f"| {r['machine']} | {r['p']} | {r['plan']} | {shape} | refused: {r['refused']} "
                         "| | | | | | |")
            continue
        lines.append(f"| {r['machine']} | {r['p']} | {r['plan']} | {shape} | {r['step_ms']:.1f} | "
                     f"{r['peak_gib']:.2f} | {r['cross_node_gb']:.2f} | {r['idle']:.0%} | {r['ideal_bubble']:.0%} "
                     f"| {r['tasks']} | {r['planned_cpu_s']:.1f} |")
    lines += ["", "Splits inside a stage (the first layer's operators; `whole`: not split):", ""]
    lines += [f"- {r['machine']}, {r['plan']}: {r['splits']}" for r in rows if r.get("splits")]
    write_table(args.out, lines, {**head, "rows": rows})

if __name__ == "__main__":
    main()

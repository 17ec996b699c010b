"""Does intra-operator parallelism across nodes still pay?  Plans simulated on shipped machine files.

The LLaMA-3-8B-shaped block (float16) at 8K and 128K tokens and the paper's matrix chains, each
planned (calibrated cost model, naive exchange programs) and simulated on: one HGX H200 node
(``hgx-h200``, 8 GPUs), two and four of them on 8 rails of 400 Gb/s InfiniBand (``2x-hgx-h200-ib``,
``4x-hgx-h200-ib``), the 72-GPU NVLink domain with H200s (``h200-nvl72``) and with GB200-class GPUs
(``gb200-nvl72``).  For each: the predicted time, the speedup over one node, the bytes that cross the
network (copies between nodes) against those inside nodes, and how many operators the plan splits
across the node boundary (function specs of one operator on GPUs of different nodes).  Everything is
simulated: no GPU runs.

    python bench/multinode.py [--graphs block8k,block128k,chainA,chainC] [--out bench/results/multinode.md]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import write_table  # bench/common.py (scripts run from the repository root)

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, llama_block, matrix_chain
from relational_tensors.machine.machines import get_topology

MACHINES = ("hgx-h200", "2x-hgx-h200-ib", "4x-hgx-h200-ib", "h200-nvl72", "gb200-nvl72")
NODE = {"hgx-h200": 8, "2x-hgx-h200-ib": 8, "4x-hgx-h200-ib": 8, "h200-nvl72": 72, "gb200-nvl72": 72}


def graph(name: str) -> rt.Graph:
    if name.startswith("block"):
        return llama_block(1, 8192 if name == "block8k" else 131072, dtype="float16", **LLAMA3_8B)
    return matrix_chain(name.removeprefix("chain"))


def case(gname: str, machine: str) -> dict:
    top = get_topology(machine)
    p, node = len(top.sites), NODE[machine]
    g = graph(gname)
    t0 = time.process_time()
    cg = rt.compileGraph(g, device=f"cpu:{p}", topology=machine, cost_model="calibrated",
                         memory_per_device=top.memory_bytes)
    planned = time.process_time() - t0
    t0 = time.process_time()
    seconds = cg.simulate()
    simulated = time.process_time() - t0
    dag = cg.dag
    inter = intra = 0
    for t in dag.tasks:
        if t.kind == "copy":
            assert t.src_device is not None  # a copy names its source device (lowering sets it on every copy)
            nbytes = dag.buffers[t.outputs[0]].nbytes
            if t.src_device // node != t.device // node:
                inter += nbytes
            else:
                intra += nbytes
    placement = cg.lowered.placement
    across = sum(1 for devices in placement.values() if len({d // node for d in devices}) > 1)
    return {"graph": gname, "machine": machine, "gpus": p, "ms": seconds * 1e3, "plan_cpu_s": planned,
            "simulate_cpu_s": simulated, "network_gb": inter / 1e9, "nvlink_gb": intra / 1e9,
            "ops": len(g.operators), "ops_across_nodes": across if p > node else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphs", default="block8k,block128k,chainA,chainC")
    ap.add_argument("--machines", default=",".join(MACHINES))
    ap.add_argument("--out", default="bench/results/multinode.md")
    args = ap.parse_args()
    rows = []
    for gname in args.graphs.split(","):
        one_node = None
        for machine in args.machines.split(","):
            r = case(gname, machine)
            if machine == "hgx-h200":
                one_node = r["ms"]
            r["speedup_vs_one_node"] = one_node / r["ms"] if one_node else None
            rows.append(r)
            print(json.dumps(r), flush=True)
    lines = ["Simulated plans on shipped machine files (calibrated cost model, naive programs), "
             f"{time.strftime('%Y-%m-%d')}", "",
             "| graph | machine | GPUs | predicted ms | vs one node | network GB | NVLink GB | ops split across "
             "nodes | plan (CPU s) | simulate (CPU s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['speedup_vs_one_node']:.2f}x" if r["speedup_vs_one_node"] else "-"
        lines.append(f"| {r['graph']} | {r['machine']} | {r['gpus']} | {r['ms']:.3f} | {vs} | {r['network_gb']:.2f} | "
                     f"{r['nvlink_gb']:.2f} | {r['ops_across_nodes']} of {r['ops']} | {r['plan_cpu_s']:.2f} | "
                     f"{r['simulate_cpu_s']:.2f} |")
    write_table(Path(args.out).with_suffix(".md"), lines, {"date": time.strftime("%Y-%m-%d"), "rows": rows})

if __name__ == "__main__":
    main()

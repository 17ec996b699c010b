"""Mixture-of-experts layers planned for 8 and 64 H200s (simulated): what the planner chose against the
hand plans of ``rt.plans`` (expert parallelism, and tensor parallelism inside the experts), each priced by
the same calibrated cost model and simulated on its machine.

Workloads (bfloat16, 8,192 tokens, the pre-norm MoE FFN layer of ``graph.moe.moe_layer_graph``; a
training step adds the loss mean(y²), every gradient and AdamW with float32 masters and moments):

* a Mixtral-8x7B-shaped layer (8 experts, top-2, 4096 wide, 14,336 intermediate) at p = 8 on hgx-h200;
* a Qwen3-30B-A3B-shaped layer (128 experts, top-8, 2048 wide, 768 intermediate) at p = 8 on hgx-h200
  and at p = 64 on 64 GPUs of h200-nvl72 (one NVLink domain).

"optimizer" is the default selector (Algorithm 1, refined), "optimizer (exact)" the exact one
(``selector="exact"``, SciPy's MILP); "cost model ms" is the plan's cost as the selectors price it.

``--experts dense`` (the default, ``moe_plans.md``) computes the experts densely (every token through
every expert, weighted by a routing weight that is zero off the router's picks): ``experts / top_k`` times
the FLOPs of a dispatch to the picked experts (4x for Mixtral, 16x for Qwen3).  ``--experts grouped``
(``moe_plans_grouped.md``) sorts the routed pairs by expert and runs each row through its own expert only
(``add_moe_ffn(experts_compute="grouped")``, the form transformers' MoE models trace to), priced under
uniform routing.  ``--experts capacity`` (``moe_plans_capacity.md``) gives each expert a capacity of 1.25
times its share of the routed pairs per group of tokens (64 groups of 128 tokens,
``add_moe_ffn(capacity_factor=1.25, experts_compute="grouped")``): the pairs gathered into
``[groups, experts, capacity, d]`` buffers, the experts' products batched GEMMs over them, so that expert
parallelism exchanges the buffers all-to-all (groups split for the dispatch, experts for the products).

    python bench/moe_plans.py [--quick] [--experts dense|grouped|capacity] [--out bench/results]
"""

from __future__ import annotations

import time
from typing import Any

from common import arguments, header, header_markdown, markdown_table, write_table  # bench/common.py

import relational_tensors as rt
from relational_tensors.graph.moe import MIXTRAL_8X7B_MOE, QWEN3_30B_A3B_MOE, moe_layer_graph
from relational_tensors.machine.machines import get_topology

# the optimizer with its default selector (Algorithm 1, refined) and with the exact one; the hand plans
PLANS = ("optimizer", "optimizer (exact)", "expert_parallel", "expert_tensor_parallel")


def workloads(quick: bool) -> list[tuple[str, dict[str, Any], int, str]]:
    rows = [("Mixtral-8x7B layer", MIXTRAL_8X7B_MOE, 8, "hgx-h200"),
            ("Qwen3-30B-A3B layer", QWEN3_30B_A3B_MOE, 8, "hgx-h200"),
            ("Qwen3-30B-A3B layer", QWEN3_30B_A3B_MOE, 64, "h200-nvl72")]
    return rows[:1] if quick else rows


def main() -> None:
    args = arguments(__doc__, lambda ap: ap.add_argument("--experts", choices=("dense", "grouped", "capacity"),
                                                         default="dense"))
    form = dict(experts_compute="grouped", capacity_factor=1.25) if args.experts == "capacity" else \
        dict(experts_compute=args.experts)
    tokens = 1024 if args.quick else 8192
    rows, data = [], []
    for name, shape, p, machine in workloads(args.quick):
        topology = get_topology(machine, gpus=p)
        for training in (False, True):
            g = moe_layer_graph(tokens, dtype="bfloat16", training=training, **form, **shape)
            what = f"{name}, {'training step' if training else 'forward'}"
            for plan in PLANS:
                constraints = None if plan.startswith("optimizer") else rt.plans.PLANS[plan](g, p)
                t0 = time.perf_counter()
                cg = rt.compileGraph(g, device=p, topology=topology, cost_model="calibrated",
                                     constraints=constraints, selector="exact" if "exact" in plan else "dp")
                planned = time.perf_counter() - t0
                ms = 1e3 * cg.simulate()
                gib = max(cg.memory().values()) / 2**30
                experts = {s for s in (cg.plan.spec(n).split for n in ("expert_gate",)) for s in s}
                row = dict(workload=what, p=p, machine=machine, plan=plan, planned_s=round(planned, 2),
                           simulated_ms=round(ms, 3), peak_gib=round(gib, 2), model_cost=cg.plan.cost,
                           expert_gate_split=",".join(f"{k}={v}" for k, v in sorted(experts) if v > 1) or "-")
                data.append(row)
                rows.append([what, p, plan, row["expert_gate_split"], f"{1e3 * cg.plan.cost:.2f}", f"{ms:.2f}",
                             f"{gib:.2f}", f"{planned:.1f}"])
                print(row, flush=True)
    forms = {"grouped": "experts grouped (the routed pairs sorted by expert, each row through its own expert)",
             "capacity": "experts with a capacity (1.25x, 64 groups): [groups, experts, capacity, d] buffers through "
                         "batched GEMMs",
             "dense": "experts computed densely (experts / top_k times a dispatch's expert FLOPs)"}
    h = header("Mixture-of-experts layers: the planner against hand EP and TP plans", ["hgx-h200", "h200-nvl72"],
               "8 and 64 simulated H200s", notes=[f"{tokens} tokens, bfloat16; " + (
                   forms[args.experts]),
                                                  "expert_gate split: the split of the first expert product "
                                                  "(its indices: experts, tokens or rows, groups, capacity, hidden "
                                                  "and ff, the intermediate features)"])
    h["dtype"] = "bfloat16"
    lines = header_markdown(h) + markdown_table(
        ["workload", "p", "plan", "expert_gate split", "cost model ms", "simulated ms", "peak GiB / device",
         "planned in s"], rows)
    name = {"dense": "moe_plans.md", "grouped": "moe_plans_grouped.md", "capacity": "moe_plans_capacity.md"}
    write_table(args.out / name[args.experts], lines, {"header": h, "rows": data})


if __name__ == "__main__":
    main()

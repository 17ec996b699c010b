"""Generation planned for 8 H200s (simulated): the decode step and the prefill of a LLaMA-3-8B-shaped model
(``graph.models.CausalLM``, 32 layers, bfloat16, no weights needed to plan), what the planner chose against
Megatron tensor parallelism (``rt.plans.megatron_tp``) and one GPU, each priced by the calibrated cost model
and simulated on hgx-h200.

Workloads: decode steps of 1, 8 and 64 sequences over a cache of 4,096 positions (the cache a state of the
plan), and the prefill of one prompt of 2,048 and of 8,192 tokens.  "ceiling ms" is the bytes a decode step
must read (weights but the embedding table, and the cache) over the machine file's HBM bandwidth.

    python bench/decode_plans.py [--quick] [--out bench/results]
"""

from __future__ import annotations

import math
import time

from common import arguments, header, header_markdown, markdown_table, write_table  # bench/common.py

import relational_tensors as rt
from relational_tensors.graph.models import CausalLM, lm_decode_graph, lm_prefill_graph
from relational_tensors.machine.machines import get_topology

CONTEXT = 4096


def model(layers: int) -> CausalLM:
    return CausalLM(vocab=128256, d_model=4096, layers=layers, n_heads=32, n_kv_heads=8, d_ff=14336,
                    dtype="bfloat16")


def ceiling_ms(lm: CausalLM, batch: int, bandwidth: float) -> float:
    shapes = lm.parameter_shapes()
    weights = 2 * sum(math.prod(s) for n, s in shapes.items() if n != "embed")
    cache = batch * CONTEXT * lm.layers * 2 * lm.n_kv_heads * lm.head_dim * 2
    return 1e3 * (weights + cache) / bandwidth


def main() -> None:
    args = arguments(__doc__)
    lm = model(4 if args.quick else 32)
    p = 8
    topology = get_topology("hgx-h200", gpus=p)
    bandwidth = topology.hbm_bandwidth
    work = [(f"decode step, batch {b}, cache {CONTEXT}", lm_decode_graph(lm, b, CONTEXT), b) for b in (1, 8, 64)]
    work += [(f"prefill, 1 x {n}", lm_prefill_graph(lm, 1, n), None) for n in ((512,) if args.quick else (2048, 8192))]
    rows, data = [], []
    for what, g, batch in work:
        for plan, devices in (("optimizer", p), ("megatron_tp", p), ("one GPU", 1)):
            constraints = rt.plans.PLANS[plan](g, p) if plan == "megatron_tp" else None
            t0 = time.perf_counter()
            cg = rt.compileGraph(g, device=devices, topology=get_topology("hgx-h200", gpus=devices),
                                 cost_model="calibrated", constraints=constraints)
            planned = time.perf_counter() - t0
            ms = 1e3 * cg.simulate()
            gib = max(cg.memory().values()) / 2**30
            split = cg.plan.split("l0.q_proj")
            ceiling = ceiling_ms(lm, batch, bandwidth) if batch else None
            row = dict(workload=what, plan=plan, p=devices, planned_s=round(planned, 2), simulated_ms=round(ms, 3),
                       peak_gib=round(gib, 2), q_proj_split=split,
                       ceiling_ms=round(ceiling / devices, 3) if ceiling else None)
            data.append(row)
            rows.append([what, plan, devices, split, f"{ms:.2f}",
                         "-" if ceiling is None else f"{ceiling / devices:.2f}", f"{gib:.2f}", f"{planned:.1f}"])
            print(row, flush=True)
    h = header("Generation planned for 8 H200s: decode steps and prefills of a LLaMA-3-8B-shaped model",
               ["hgx-h200"], "8 simulated H200s (and one)",
               notes=[f"{lm.layers} layers, bfloat16; decode over a cache of {CONTEXT} positions",
                      "q_proj split: how the first layer's query projection is split (the features of its "
                      "output, the hidden of its input, or the batch)",
                      "ceiling: the bytes a step reads over the HBM bandwidth, divided over the devices"])
    h["dtype"] = "bfloat16"
    lines = header_markdown(h) + markdown_table(
        ["workload", "plan", "p", "q_proj split", "simulated ms", "ceiling ms", "peak GiB / device", "planned in s"],
        rows)
    write_table(args.out / "decode_plans.md", lines, {"header": h, "rows": data})


if __name__ == "__main__":
    main()

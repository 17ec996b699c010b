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

``--scale`` times planning as the device count and the depth grow (``--pipeline``: with a pipeline stage
per node of eight devices and the tokens as two sequences per stage, one micro-batch each, 1F1B): every
combination of ``--p``, ``--depths``, ``--schedules`` and ``--graphs`` (``block``: the forward stack at
``--tokens`` tokens; ``train``: its training graph, forward and backward) in a subprocess of its own, so
that the peak resident set is that case's alone.  Each case reports the cold compile (the first in the process, spec
cache empty), the warm ones (``--warm`` rounds), the passes of the last, optionally a simulation of the
plan (``--simulate``), CPU seconds (the process's, all threads) and the peak RSS; and the growth
exponent of the compile time in p.

    python bench/compile_time.py --scale --p 8,16,32,64,72,128 [--depths 1] [--schedules naive]
        [--graphs block] [--warm 2] [--simulate] [--topology hgx-h200] [--out bench/results/compile_scale]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import WORKLOADS, header, header_markdown  # the paper's five token workloads (bench/common.py)

import relational_tensors as rt
from relational_tensors.dp_optimizer.candidates import specs_for
from relational_tensors.graph.models import LLAMA3_8B, LLAMA3_70B, llama_block, llama_training_graph
from relational_tensors.machine.machines import TOPOLOGIES

VOCAB = 128256  # LLaMA 3's

# pinned so that plans do not depend on the memory of the host that compiles them (an H200's 141 GiB)
H200_MEMORY = 141 * (1 << 30)


def timed(build, rounds: int, warmups: int = 2) -> dict[str, Any]:
    specs_for.cache_clear()
    g = build()
    t0 = time.perf_counter()
    cg: rt.CompiledGraph | None  # None between rounds: see below
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


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def machine_for(topology: str, p: int) -> str:
    """``auto``: one HGX H200 node up to 8 GPUs, nodes of 8 on InfiniBand rails where a machine file has
    that many (``{n}x-hgx-h200-ib``), else the H200s on one switch; any other name as given."""
    if topology != "auto":
        return topology
    if p <= 8:
        return "hgx-h200"
    rails = f"{p // 8}x-hgx-h200-ib"
    return rails if p % 8 == 0 and rails in TOPOLOGIES else "hgx-h200"


def scale_case(case: dict) -> dict:
    """One case of ``--scale``, in this process: cold compile, warm compiles, optional simulation."""
    p, layers = case["p"], case["layers"]
    stages = max(1, p // 8) if case.get("pipeline") else 1
    # a pipeline's micro-batches are slices of the batch: the same tokens as 2 sequences per stage
    batch = 2 * stages if stages > 1 else 1
    seq = case["tokens"] // batch
    shape = LLAMA3_70B if case.get("shape") == "70b" else LLAMA3_8B
    if case["graph"] == "train":
        g = llama_training_graph(batch, seq, dtype="bfloat16", vocab=VOCAB, layers=layers, **shape)
    elif case["graph"] == "step":
        g = llama_training_graph(batch, seq, dtype="bfloat16", vocab=VOCAB, layers=layers, optimizer="adamw", **shape)
    else:
        g = llama_block(batch, seq, dtype="float16", layers=layers, **shape)
    options = dict(device=f"cpu:{p}", memory_per_device=H200_MEMORY, schedule_mode=case["schedule"],
                   topology=machine_for(case["topology"], p))
    if case["schedule"] == "search":
        options.update(search_steps=case["search_steps"])
    if stages > 1:  # a stage per node of 8 devices, a micro-batch per sequence, 1F1B
        options.update(pipeline=rt.Pipeline(stages, batch, "1f1b"))
    before = _rss_mib()

    def compile_once() -> tuple[rt.CompiledGraph, float, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        cg = rt.compileGraph(g, **options)
        return cg, time.process_time() - c0, time.perf_counter() - w0

    cg: rt.CompiledGraph | None  # None between the warm compiles: see below
    cg, cold_cpu, cold_wall = compile_once()
    warm = []
    for _ in range(case["warm"]):
        cg = None
        gc.collect()
        cg, cpu, _ = compile_once()
        warm.append(cpu)
    out = {**case, "ops": len(g.operators), "cold_cpu_s": cold_cpu, "cold_wall_s": cold_wall,
           "warm_cpu_s": min(warm) if warm else None, "passes": {k: round(v, 4) for k, v in cg.timings.items()},
           "rss_graph_mib": before, "rss_peak_mib": _rss_mib(), "tasks": len(cg.lowered.dag.tasks)}
    pipe = options.get("pipeline")
    out["stages"] = f"{pipe.stages}x{pipe.micro_batches}" if isinstance(pipe, rt.Pipeline) else "-"
    if case["simulate"]:
        c0 = time.process_time()
        sim = cg.simulate()
        out["simulate_cpu_s"] = time.process_time() - c0
        out["predicted_ms"] = sim * 1e3  # seconds per execution
    return out


def _growth(rows: list[dict[str, Any]], along: str, fixed: tuple[str, ...]) -> dict[str, float]:
    """The exponent of the compile time (warm where measured, else cold) in ``along``, from the smallest to
    the largest value of it, per combination of the ``fixed`` columns that has two or more."""
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(tuple(r[k] for k in fixed), []).append(r)
    out = {}
    for key, rs in by.items():
        rs = sorted(rs, key=lambda r: r[along])
        t = [r["warm_cpu_s"] or r["cold_cpu_s"] for r in (rs[0], rs[-1])]
        if len(rs) > 1 and rs[0][along] != rs[-1][along] and all(t):
            out["/".join(map(str, key))] = math.log(t[1] / t[0]) / math.log(rs[-1][along] / rs[0][along])
    return out


def scale(args: argparse.Namespace) -> None:
    cases = [dict(p=p, layers=d, schedule=sch, graph=gr, tokens=args.tokens, warm=args.warm, simulate=args.simulate,
                  topology=args.topology, search_steps=args.search_steps, pipeline=args.pipeline, shape=args.shape)
             for gr, sch, d, p in itertools.product(args.graphs.split(","), args.schedules.split(","),
                                                    map(int, args.depths.split(",")), map(int, args.p.split(",")))]
    rows = []
    for case in cases:  # each in a fresh interpreter: its own cold start and its own peak RSS
        run = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"case {case} failed:\n{run.stderr[-3000:]}")
        r = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(json.dumps(r), flush=True)
    growth = {f"in p ({k})": e for k, e in _growth(rows, "p", ("graph", "schedule", "layers")).items()}
    growth.update({f"in layers ({k})": e for k, e in _growth(rows, "layers", ("graph", "schedule", "p")).items()})
    lines = ["| graph | shape | layers | schedule | p | machine | stages x micro-batches | ops | tasks | cold (CPU s) "
             "| warm (CPU s) | lower | liveness | verify | record | select | simulate (CPU s) | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ps = r["passes"]
        sim = f"{r['simulate_cpu_s']:.2f}" if "simulate_cpu_s" in r else "-"
        warm = f"{r['warm_cpu_s']:.2f}" if r["warm_cpu_s"] is not None else "-"
        lines.append(f"| {r['graph']} | {r.get('shape', '8b')} | {r['layers']} | {r['schedule']} | {r['p']} | "
                     f"{machine_for(r['topology'], r['p'])} | {r.get('stages', '-')} | {r['ops']} | {r['tasks']} | "
                     f"{r['cold_cpu_s']:.2f} | {warm} | {ps.get('lower', 0):.2f} | {ps.get('liveness', 0):.2f} | "
                     f"{ps.get('verify', 0):.2f} | {ps.get('record', 0):.2f} | "
                     f"{ps.get('select', 0):.2f} | {sim} | {r['rss_peak_mib']:.0f} |")
    for name, e in growth.items():
        lines.append(f"\nGrowth of the compile time {name}: exponent {e:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = header("Planning time against devices and depth", [], "cpu:<p> (logical devices, plans priced for "
                  "the machine in each row)", notes=["CPU seconds of this process (all threads); peak RSS per case"])
    head["dtype"] = "bfloat16 (train, step), float16 (block)"
    out.with_suffix(".json").write_text(json.dumps({**head, "growth": growth, "cases": rows}, indent=2))
    out.with_suffix(".md").write_text("\n".join([*header_markdown(head), *lines]) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--grad", action="store_true", help="forward + backward (training graphs)")
    ap.add_argument("--step", action="store_true", help="forward + backward + AdamW (training steps)")
    ap.add_argument("--scale", action="store_true", help="planning time against p and depth, a subprocess per case")
    ap.add_argument("--p", default="8,16,32,64,72,128")
    ap.add_argument("--depths", default="1")
    ap.add_argument("--schedules", default="naive")
    ap.add_argument("--graphs", default="block",
                    help="block (forward), train (forward + backward) and/or step (the whole training step, AdamW)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--warm", type=int, default=2, help="warm compiles after the cold one")
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--shape", default="8b", choices=("8b", "70b"), help="with --scale: LLaMA-3-8B- or 70B-shaped "
                    "layers (d_model 8192, 64/8 heads, FFN 28672)")
    ap.add_argument("--pipeline", action="store_true", help="with --scale: a pipeline stage per node of 8 devices, "
                    "2 micro-batches per stage (the tokens as 2 sequences per stage), 1F1B: what pipeline='auto' "
                    "chooses for the step across nodes")
    ap.add_argument("--topology", default="hgx-h200", help="a machine name, or auto (see machine_for)")
    ap.add_argument("--search-steps", type=int, default=None)
    ap.add_argument("--out", default="bench/results/compile_scale")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(scale_case(json.loads(args.case))))
        return
    if args.scale:
        scale(args)
        return
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

"""Where the time of a training step on logical devices goes: one profiled run's timeline, by task kind.

Plans the 8B-shaped block's training step (``gpu_train.py``'s graph, its weights and batch) for one device
and for ``p`` logical devices of one GPU, runs it three times, then once more with a CUDA event around every
task (``cg.profile()``: the same streams and waits as a run, issued eagerly).  Per task kind it reports the
count, the summed and median task time and the bytes written; per stream the time it was busy and the
step's length; and the time in which some stream ran a kernel against the time only data movement ran.
The raw timeline goes to JSON for a closer look.

An eager profile of a plan of thousands of tasks is bound by the host that issues them, so it also
records the captured step as it runs: three replays of the CUDA graph under ``torch.profiler`` (CUPTI
sees each kernel and copy of a graph), reported per kernel family (name prefix) with the GPU time
some kernel or copy ran and the time nothing did.

    python bench/gpu_step_timeline.py [--workload 8K] [--p 8] [--cost-model calibrated] [--no-eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_train import WEIGHTS, WORKLOADS, D, initial_weights, our_feeds, step_graph  # noqa: E402

import relational_tensors as rt  # noqa: E402

MOVES = ("copy", "recompose", "decompose", "aggregate", "assign")


def union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by ``spans``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(cg: rt.CompiledGraph) -> dict[str, Any]:
    prof = cg.profile()
    kinds: dict[str, list[Any]] = {}
    for t in prof.tasks:
        key = t.kind if t.kind in MOVES else "kernel"
        kinds.setdefault(key, []).append(t)
    out: dict[str, Any] = {"step_ms": prof.time * 1e3, "kinds": {}}
    for k, ts in sorted(kinds.items()):
        d = [(t.end - t.start) * 1e3 for t in ts]
        out["kinds"][k] = {"count": len(ts), "sum_ms": sum(d), "median_ms": statistics.median(d),
                           "covered_ms": union([(t.start, t.end) for t in ts]) * 1e3,
                           "gb": sum(t.bytes for t in ts) / 1e9}
    streams = sorted({t.device for t in prof.tasks})
    out["stream_busy_ms"] = {d: union([(t.start, t.end) for t in prof.tasks if t.device == d]) * 1e3
                             for d in streams}
    kernels = union([(t.start, t.end) for t in prof.tasks if t.kind not in MOVES])
    anything = union([(t.start, t.end) for t in prof.tasks])
    out["kernel_covered_ms"] = kernels * 1e3
    out["moves_only_ms"] = (anything - kernels) * 1e3
    out["idle_ms"] = (prof.time - anything) * 1e3
    out["timeline"] = [(t.task, t.kind, t.label, t.device, t.start, t.end, t.bytes) for t in prof.tasks]
    return out


def family(name: str) -> str:
    """A kernel's family: copies by direction, cuBLAS/cuDNN GEMMs as one, Triton kernels by their name."""
    low = name.lower()
    if low.startswith("memcpy") or low.startswith("memset"):
        return " ".join(name.split(" ")[:2])
    if "gemm" in low or "cutlass" in low or "sm90_xmma" in low or "nvjet" in low:
        return "gemm"
    return name.split("(")[0][:60]


def captured(cg: rt.CompiledGraph, replays: int = 3) -> dict[str, Any]:
    """The captured step's GPU timeline under CUPTI: per family count, summed and covered time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cg.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            cg.execute()
        cg.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start / 1e3, e.time_range.end / 1e3, family(e.name), e.name, e.device_resource_id)
             for e in events]
    if not spans:
        return {"events": 0}
    first, last = min(a for a, *_ in spans), max(b for _, b, *_ in spans)
    fams: dict[str, list[tuple[float, float]]] = {}
    for a, b, f, *_ in spans:
        fams.setdefault(f, []).append((a, b))
    busy = union([(a, b) for a, b, *_ in spans])
    out: dict[str, Any] = {"events": len(spans), "replays": replays, "span_ms": (last - first) / replays,
                           "busy_ms": busy / replays, "idle_ms": (last - first - busy) / replays, "families": {}}
    per = len(spans) // replays  # the last replay's events: (family, start and end in ms from its first, stream)
    tail = sorted(spans)[-per:]
    out["events_of_last"] = [(f, round(a - tail[0][0], 4), round(b - tail[0][0], 4), stream)
                             for a, b, f, _, stream in tail]
    for f, ss in sorted(fams.items(), key=lambda kv: -sum(b - a for a, b in kv[1])):
        out["families"][f] = {"count": len(ss) // replays, "sum_ms": sum(b - a for a, b in ss) / replays,
                              "covered_ms": union(ss) / replays}
    return out


def main() -> None:
    import ml_dtypes

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="8K", choices=sorted(WORKLOADS))
    ap.add_argument("--p", type=int, default=8)
    ap.add_argument("--cost-model", default="calibrated")
    ap.add_argument("--no-eager", action="store_true", help="only the captured step's timeline")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_step_timeline.json"))
    args = ap.parse_args()
    b, s = WORKLOADS[args.workload]
    rng = np.random.default_rng(1)
    w = initial_weights(D, WEIGHTS)
    x = rng.standard_normal((b, s, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
    target = rng.standard_normal((b, s, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
    g, opt = step_graph(b, s)
    feeds = our_feeds(g, opt, w, x, target)
    result = {}
    for p in (1, args.p):
        cg = rt.compileGraph(g, device="cuda:" + ",".join(["0"] * p), cost_model=args.cost_model)
        cg.load(feeds)
        for _ in range(3):
            cg.execute()
        cg.synchronize()
        result[p] = {"captured": captured(cg)}
        print(p, json.dumps({k: v for k, v in result[p]["captured"].items() if k != "events_of_last"}, indent=1),
              flush=True)
        if not args.no_eager:
            result[p] |= summarize(cg)
            print(p, json.dumps({k: v for k, v in result[p].items() if k not in ("timeline", "captured")},
                                indent=1), flush=True)
        del cg
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": args.workload, "cost_model": args.cost_model,
                                          "runs": result}))


if __name__ == "__main__":
    main()

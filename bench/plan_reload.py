"""Planning against reloading a saved plan (``rt.save_plan``, ``rt.load_plan``), side by side in one process.

For each workload: ``compileGraph`` and ``load_plan`` of the plan it saved, each 2 warm-ups and 10 timed
rounds (wall clock, in-process, warm caches), medians reported, and the reloaded plan's output checked
bit for bit against the original's where it runs here (CPU virtual devices).

    python bench/plan_reload.py [--out bench/results/plan_reload.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
from common import _cpu_model, _git, write_table  # bench/common.py

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, llama_block, llama_training_graph


def rounds(fn: Callable[[], object], warm: int = 2, timed: int = 10) -> tuple[float, object]:
    """The median seconds of ``fn`` over the timed rounds, and its last result; every result is kept
    until the end, so that no round pays for freeing the one before (a plan is ~10^5 objects)."""
    kept = [fn() for _ in range(warm)]
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        kept.append(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), kept[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/plan_reload.md")
    args = ap.parse_args()
    step = llama_training_graph(1, 8192, dtype="bfloat16", vocab=128256, layers=4, optimizer="adamw",
                                master_dtype="float32", **LLAMA3_8B)
    cases = [
        ("LLaMA-3-8B block, 8K, p=8", llama_block(1, 8192, dtype="bfloat16", **LLAMA3_8B), 8, {}),
        ("32 blocks, 8K, p=8", llama_block(1, 8192, dtype="bfloat16", layers=32, **LLAMA3_8B), 8, {}),
        ("block, 8K, p=8, calibrated + search", llama_block(1, 8192, dtype="bfloat16", **LLAMA3_8B), 8,
         {"cost_model": "calibrated", "schedule_mode": "search", "search_steps": 200}),
        ("4-layer training step, 8K, p=8", step, 8, {}),
        ("small block on cpu:4 (runs here)", llama_block(2, 64, 64, 4, 2, 96), "cpu:4", {}),
    ]
    rows: list[dict[str, Any]] = []
    folder = Path(tempfile.mkdtemp())
    for name, g, device, options in cases:
        plan_s, cg = rounds(cast(Callable[[], object], lambda g=g, device=device, options=options:
                                 rt.compileGraph(g, device=device, **options)))
        path = folder / "plan.rt"
        rt.save_plan(cg, path)
        load_s, again = rounds(cast(Callable[[], object], lambda path=path, g=g: rt.load_plan(path, g)))
        same = None
        if str(device).startswith("cpu"):
            feeds = {n.name: np.random.default_rng(0).standard_normal(n.type.shape).astype(np.float32)
                     for n in g.inputs}
            same = all(np.array_equal(a, b) for a, b in zip(cg.run(feeds).values(),  # type: ignore[attr-defined]
                                                            again.run(feeds).values()))  # type: ignore[attr-defined]
        rows.append(dict(workload=name, plan_s=plan_s, load_s=load_s, ratio=load_s / plan_s,
                         file_mb=path.stat().st_size / 1e6, bit_identical=same))
        print(rows[-1], flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"`python bench/plan_reload.py` — commit {_git()}, {date}, {_cpu_model()} ({platform.node()})", "",
             "| workload | planning (s) | reload (s) | reload / planning | file (MB) | output bit-identical |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        identical = "-" if r["bit_identical"] is None else "yes" if r["bit_identical"] else "NO"
        lines.append(f"| {r['workload']} | {r['plan_s']:.3f} | {r['load_s']:.3f} | {100 * r['ratio']:.0f}% | "
                     f"{r['file_mb']:.1f} | {identical} |")
    write_table(args.out, lines, rows)


if __name__ == "__main__":
    main()

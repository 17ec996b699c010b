"""Compile time of two checkouts of the project side by side (an A/B test of a change).

Each run is a fresh process that imports the project from one checkout and compiles the
LLaMA-3-8B-shaped 8K block (float16) for 8 virtual devices twice: the first compile is the cold one
(every cache empty), the second the warm one.  Runs alternate between the checkouts so that both
see the same machine load; the medians and their ratio are printed and written as JSON.

    python bench/compile_ab.py BASE_CHECKOUT NEW_CHECKOUT [--runs 10] [--out FILE]

(``git worktree add /tmp/base <commit>`` makes a checkout of an earlier commit.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBE = """
import json, time
import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, llama_block
g = llama_block(1, 8192, dtype="float16", **LLAMA3_8B)
times = []
for _ in range(2):
    t0 = time.perf_counter()
    rt.compileGraph(g, device="cpu:8")
    times.append(time.perf_counter() - t0)
print(json.dumps({"cold_s": times[0], "warm_s": times[1], "module": rt.__file__}))
"""


def run(checkout: Path) -> dict[str, float]:
    env = {"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True,
                         cwd=checkout)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["module"]).resolve().is_relative_to(checkout.resolve()), result["module"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(args.runs):
        for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
            runs[side].append(run(getattr(args, side)))
    summary: dict[str, Any] = {}
    for side, rows in runs.items():
        summary[side] = {k: statistics.median(r[k] for r in rows) for k in ("cold_s", "warm_s")}
    summary["ratio"] = {k: summary["new"][k] / summary["base"][k] for k in ("cold_s", "warm_s")}
    summary["machine"] = f"{platform.processor() or platform.machine()}, {platform.python_version()}"
    summary["runs"] = runs
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text)
    for side in ("base", "new"):
        print(f"{side}: cold {summary[side]['cold_s']:.3f} s, warm {summary[side]['warm_s']:.3f} s "
              f"(median of {args.runs})")
    print(f"new / base: cold {summary['ratio']['cold_s']:.3f}, warm {summary['ratio']['warm_s']:.3f}")


if __name__ == "__main__":
    main()

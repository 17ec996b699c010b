"""Experiment 2 of the paper, simulated: matrix chains A-E on 1, 4 and 8 GPUs.

Each chain (float16, the paper's fixed parenthesization) is planned by the DP
optimizer (paper cost model, naive exchange programs) for p = 1, 4, 8 GPUs of a
simulated DGX A100, and the whole-plan simulator predicts one execution.  The
paper reports about 6× from one to eight GPUs (measured, all three systems).
When ``bench/results/gpu_chains*.json`` exists, its one-GPU measurements are
shown in a separate, labelled column.

    python bench/exp2_chains.py [--quick] [--topology dgx-a100]
"""

from __future__ import annotations

from typing import Any

import common
from common import fmt, geomean

PS = (1, 4, 8)
PAPER_SPEEDUP = 6.0  # "roughly 6×" from 1 to 8 GPUs, every system


def main() -> None:
    args = common.arguments(__doc__, lambda ap: ap.add_argument("--topology", default="dgx-a100"))
    topo = args.topology
    setups = common.setups(args.quick, families=("chain",))
    measured, files = common.measured_gpu_chains()
    gpu = next(iter(measured.values()))["gpu"] if measured else "GPU"
    head = common.header(
        f"Experiment 2 (simulated): matrix chains, p = 1, 4, 8 on {topo}", [topo],
        f"p = 1, 4, 8 simulated GPUs of {topo} (no GPU used for the simulated columns)",
        measured=[f"one {gpu} ({', '.join(files)}, bench/gpu_chains.py)"] if measured else [],
        notes=["DP plan, paper cost model, naive exchange programs"]
        + (["--quick: chains " + ", ".join(s.name for s in setups)] if args.quick else []))
    rows: dict[str, dict[str, Any]] = {}
    with common.progress(len(setups) * len(PS), "exp2 plans") as advance:
        for s in setups:
            row: dict[str, Any] = {}
            for p in PS:
                cg, compile_s = common.plan(s, p, topo)
                ms = common.simulated_ms(cg, topo)
                row[f"p{p}_ms"] = ms
                row[f"p{p}_compile_s"] = compile_s
                row[f"p{p}_bytes_between_devices"] = common.bytes_moved(cg)
                row[f"p{p}_splits"] = list(common.plan_key(cg))
                advance(f"chain {s.name} p={p}: {ms:.2f} ms simulated (compiled in {compile_s:.2f} s)")
            row["speedup_1_to_8"] = row["p1_ms"] / row["p8_ms"]
            row["measured_1gpu_ours_ms"] = measured.get(s.name, {}).get("ours_ms")
            rows[s.name] = row

    keys = [f"p{p}_ms" for p in PS] + ["speedup_1_to_8", "measured_1gpu_ours_ms"]
    geo = {k: geomean(rows[s.name][k] for s in setups) for k in keys}
    report = common.Report("exp2_chains", head, args.out, quick=args.quick)
    table = [[f"chain {s.name}", *(fmt(rows[s.name][f"p{p}_ms"]) for p in PS),
              fmt(rows[s.name]["speedup_1_to_8"], 2, "×"), f"{rows[s.name]['p8_bytes_between_devices']:,}",
              fmt(rows[s.name]["measured_1gpu_ours_ms"])] for s in setups]
    table.append([f"geomean ({len(setups)})", *(fmt(geo[f"p{p}_ms"]) for p in PS),
                  fmt(geo["speedup_1_to_8"], 2, "×") + f" (paper: about {PAPER_SPEEDUP:.0f}×, measured)", "",
                  fmt(geo["measured_1gpu_ours_ms"])])
    report.table(f"Predicted time of each chain (DP plan), simulated on {topo}",
                 ["chain", *(f"p={p} (ms, simulated)" for p in PS), "speed-up 1→8 (simulated)",
                  "p=8 bytes between devices", f"1×{gpu} ours (ms, measured)"], table,
                 after=[f"Measured column: one {gpu}, read from {', '.join(files)}." if measured else
                        "Measured column: no bench/results/gpu_chains*.json here, so none."])

    def draw(plt: Any) -> Any:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for s in setups:
            ax1.plot(PS, [rows[s.name][f"p{p}_ms"] for p in PS], marker="o", label=f"chain {s.name}")
        ax1.set_xscale("log", base=2)
        ax1.set_yscale("log")
        ax1.set_xticks(PS, [str(p) for p in PS])
        ax1.set_xlabel("GPUs")
        ax1.set_ylabel("ms (simulated)")
        ax1.legend(fontsize=8)
        ax2.bar([s.name for s in setups], [rows[s.name]["speedup_1_to_8"] for s in setups])
        ax2.axhline(PAPER_SPEEDUP, color="0.3", ls="--", label="paper: about 6× (measured)")
        ax2.axhline(8, color="0.7", ls=":", label="linear")
        ax2.set_ylabel("speed-up 1→8 GPUs")
        ax2.legend(fontsize=8)
        fig.suptitle(f"Experiment 2: matrix chains, DP plan, simulated on {topo}")
        return fig

    report.write({"topology": topo, "chains": rows, "geomean": geo, "measured_files": files,
                  "paper": {"speedup_1_to_8": PAPER_SPEEDUP}}, draw)


if __name__ == "__main__":
    main()

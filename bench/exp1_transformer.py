"""Experiment 1 of the paper, simulated: the transformer block on 1, 4 and 8 GPUs.

The LLaMA-3-8B-shaped block (float16) on the five token workloads, planned by
the DP optimizer (paper cost model, naive exchange programs) for p = 1, 4, 8
GPUs of each simulated machine (``dgx-a100``, the paper's; ``hgx-h200``), and
the whole-plan simulator's predicted time of one execution.  Nothing runs on a
GPU here.  When ``bench/results/gpu_block.json`` exists, its one-GPU
measurements (ours, torch.compile and JAX, on one H200) are shown in separate,
labelled columns, and the simulated H200 p = 1 time is checked against ours;
when ``bench/results/multigpu/`` holds a multi-GPU run (``bench/multigpu.sh``),
ours and the best hand-written PyTorch at its largest GPU count are shown too.

    python bench/exp1_transformer.py [--quick]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import common
from common import fmt, geomean

TOPOLOGIES = ("dgx-a100", "hgx-h200")
PS = (1, 4, 8)
PAPER_P8_MS = {"1K": 1.21, "128K": 143.0}  # the per-workload numbers the paper states (DGX A100, measured)
PAPER_GEOMEAN_MS = 8.97


def main() -> None:
    args = common.arguments(__doc__)
    setups = common.setups(args.quick, families=("transformer",))
    measured, files = common.measured_gpu_block()
    gpu = next(iter(measured.values()))["gpu"] if measured else "GPU"
    n_multi, multi = common.measured_multigpu()
    head = common.header(
        "Experiment 1 (simulated): transformer block, p = 1, 4, 8", TOPOLOGIES,
        "p = 1, 4, 8 simulated GPUs of each topology (no GPU used for the simulated columns)",
        measured=([f"one {gpu} ({', '.join(files)}, bench/gpu_block.py on the device machine)"] if measured else [])
        + ([f"{n_multi} GPUs (results/multigpu, bench/multigpu.sh on the device machine; ours planned with the "
            f"paper cost model, PyTorch's best hand-written strategy)"] if multi else []),
        notes=["DP plan, paper cost model, naive exchange programs; each topology's plan respects its GPU memory"]
        + (["--quick: workloads " + ", ".join(s.name for s in setups)] if args.quick else []))
    rows: dict[str, dict[str, Any]] = {}
    with common.progress(len(setups) * len(TOPOLOGIES) * len(PS), "exp1 plans") as advance:
        for s in setups:
            row: dict[str, Any] = {}
            for topo in TOPOLOGIES:
                for p in PS:
                    cg, compile_s = common.plan(s, p, topo)
                    ms = common.simulated_ms(cg, topo)
                    row[f"{topo}_p{p}_ms"] = ms
                    row[f"{topo}_p{p}_compile_s"] = compile_s
                    if p == max(PS):
                        row[f"{topo}_p{p}_attention_split"] = cg.plan.split("attention")
                        row[f"{topo}_p{p}_bytes_between_devices"] = common.bytes_moved(cg)
                    advance(f"{s.name} {topo} p={p}: {ms:.2f} ms simulated (compiled in {compile_s:.2f} s)")
            m = measured.get(s.name, {})
            row["measured_1gpu_ours_ms"] = m.get("ours_ms")
            row["measured_1gpu_torch_compile_ms"] = m.get("compile_ms")
            row["measured_1gpu_torch_eager_ms"] = m.get("eager_ms")
            row["measured_1gpu_jax_ms"] = m.get("jax_ms")
            if multi:
                row[f"measured_{n_multi}gpu_ours_ms"] = multi.get(s.name, {}).get("ours_ms")
                row[f"measured_{n_multi}gpu_pytorch_best_ms"] = multi.get(s.name, {}).get("pytorch_best_ms")
            row["paper_a100_p8_ms"] = PAPER_P8_MS.get(s.name)
            rows[s.name] = row

    ms_keys = [k for k in rows[setups[0].name] if k.endswith("_ms")]
    geo = {k: geomean(rows[s.name][k] for s in setups) for k in ms_keys}
    report = common.Report("exp1_transformer", head, args.out, quick=args.quick)

    def line(name: str, get: Callable[[str], Any]) -> list[str]:
        speed = [get(f"{t}_p1_ms") / get(f"{t}_p8_ms") if get(f"{t}_p1_ms") and get(f"{t}_p8_ms") else None
                 for t in TOPOLOGIES]
        return [name, *(fmt(get(f"{t}_p{p}_ms")) for t in TOPOLOGIES for p in PS),
                *(fmt(x, 2, "×") for x in speed), fmt(get("measured_1gpu_ours_ms")),
                fmt(get("measured_1gpu_torch_compile_ms")), fmt(get("measured_1gpu_jax_ms")),
                *((fmt(get(f"measured_{n_multi}gpu_ours_ms")), fmt(get(f"measured_{n_multi}gpu_pytorch_best_ms")))
                  if multi else ()),
                fmt(get("paper_a100_p8_ms"))]

    table = [line(s.name, rows[s.name].get) for s in setups]
    geo_row = line(f"geomean ({len(setups)})", geo.get)
    if not args.quick:
        geo_row[-1] = f"{PAPER_GEOMEAN_MS}"
    table.append(geo_row)
    missing = [s.name for s in setups if rows[s.name]["measured_1gpu_ours_ms"] is None]
    if not measured:
        source = "Measured columns: no bench/results/gpu_block.json here, so none."
    else:
        source = (f"Measured columns: one {gpu}, read from {', '.join(files)}; "
                  + (f"no measurement for {', '.join(missing)}, so their geomean is blank." if missing
                     else "every workload measured."))
    report.table(
        "Predicted time of one block (DP plan) on simulated machines; measured one-GPU runs beside them",
        ["workload", *(f"{t} p={p} (ms, simulated)" for t in TOPOLOGIES for p in PS),
         *(f"{t} 1→8 (simulated)" for t in TOPOLOGIES), f"1×{gpu} ours (ms, measured)",
         f"1×{gpu} torch.compile (ms, measured)", f"1×{gpu} JAX jit (ms, measured)",
         *((f"{n_multi}×{gpu} ours (ms, measured)", f"{n_multi}×{gpu} PyTorch best (ms, measured)") if multi else ()),
         "paper DGX A100 p=8 (ms, measured)"],
        table,
        after=[source, "The paper's column is its measurement on a real DGX A100 at p = 8 (it states 1K, 128K "
                       "and the geomean of the five)."])

    slower = [f"{s.name} on {t}" for t in TOPOLOGIES for s in setups
              if rows[s.name][f"{t}_p8_ms"] > min(rows[s.name][f"{t}_p1_ms"], rows[s.name][f"{t}_p4_ms"])]
    if slower:
        report.text(f"Note: p = 8 is predicted slower than p = 1 or p = 4 for {', '.join(slower)}; the kernel "
                    "model of that topology (header) prices the smaller per-device kernels of p = 8.")
    if measured:
        check = [s.name for s in setups if rows[s.name]["measured_1gpu_ours_ms"]]
        sim = [rows[n]["hgx-h200_p1_ms"] for n in check]
        meas = [rows[n]["measured_1gpu_ours_ms"] for n in check]
        report.table(
            f"Simulator check on one GPU: hgx-h200 p = 1 (simulated) against ours on one {gpu} (measured)",
            ["workload", "simulated (ms)", "measured (ms)", "simulated / measured"],
            [[n, fmt(a), fmt(b), fmt(a / b, 3)] for n, a, b in zip(check, sim, meas)]
            + [[f"geomean ({len(check)})", fmt(geomean(sim)), fmt(geomean(meas)),
                fmt(geomean(a / b for a, b in zip(sim, meas)), 3)]])
    report.table("The p = 8 plans",
                 ["workload", *(f"{t} attention split" for t in TOPOLOGIES),
                  *(f"{t} bytes between devices" for t in TOPOLOGIES)],
                 [[s.name, *(rows[s.name][f"{t}_p8_attention_split"] for t in TOPOLOGIES),
                   *(f"{rows[s.name][f'{t}_p8_bytes_between_devices']:,}" for t in TOPOLOGIES)] for s in setups])

    def draw(plt: Any) -> Any:
        import numpy as np

        fig, ax = plt.subplots(figsize=(10, 4.5))
        names = [s.name for s in setups]
        x = np.arange(len(names))
        series = [(f"{t} p={p} (sim.)", f"{t}_p{p}_ms") for t in TOPOLOGIES for p in PS]
        width = 0.8 / (len(series) + (1 if measured else 0))
        for k, (label, key) in enumerate(series):
            ax.bar(x + k * width, [rows[n][key] for n in names], width, label=label)
        if measured:
            ax.bar(x + len(series) * width, [rows[n]["measured_1gpu_ours_ms"] or 0 for n in names], width,
                   label=f"1×{gpu} ours (measured)", color="black")
        ax.set_xticks(x + 0.4 - width / 2, names)
        ax.set_yscale("log")
        ax.set_ylabel("ms per block")
        ax.set_title("Experiment 1: LLaMA-3-8B block, DP plan, simulated (black: measured)")
        ax.legend(fontsize=7, ncol=2)
        return fig

    report.write({"workloads": rows, "geomean": geo, "measured_files": files, "measured_multigpu_gpus": n_multi,
                  "paper": {"p8_ms": PAPER_P8_MS, "geomean_ms": PAPER_GEOMEAN_MS}}, draw)


if __name__ == "__main__":
    main()

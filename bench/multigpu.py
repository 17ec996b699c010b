"""Ours on 1, 2, 4 and 8 real GPUs, and the merge of ours with the PyTorch baselines' results.

    python bench/multigpu.py ours  [--gpus 1,2,4,8] [--workloads 1K,...] [--chains A,...] [--topology T.json]
    python bench/multigpu.py train [--gpus 1,2,4,8] [--workloads 8K,4x2K,32x1K] [--topology T.json]
    python bench/multigpu.py merge [--out bench/results/multigpu]

``ours`` compiles each workload (the LLaMA-3-8B-shaped block in float16 on the paper's five token
workloads, and the chains A-E) for ``device=[0, ..., n-1]``, loads the same inputs as
``bench/gpu_block.py`` / ``bench/gpu_chains.py``, and times 2 warm-ups + 10 rounds with CUDA events
(every timed round is one CUDA-graph launch that joins every GPU's stream); it also records the
largest difference from the one-GPU output and the simulator's prediction on the topology compiled
for.  ``train`` does the same for the block's training step, ``bench/gpu_train.py``'s (same weights,
batch, MSE loss and AdamW; bfloat16 weights and activations, float32 masters and moments): 2 warm-ups
(the first one's loss recorded) + 10 timed steps, then the loss of the last step and the float32
masters after the 12 steps against the one-GPU run's; it writes ``ours_train.json``.  ``merge`` joins
``ours.json`` and ``ours_train.json`` with the baselines' ``baselines_n<N>.json`` and
``baselines_train_n<N>.json`` (written by ``bench/baselines/run.py``, the latter with ``--train``:
PyTorch DDP and FSDP2), ``topo.txt`` (``nvidia-smi topo -m``) and ``topology.json`` (from
``bench/measure_topology.py``) into ``multigpu.json``, ``.md`` and ``.png``.
``bench/multigpu.sh`` runs all of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import CHAINS, WORKLOADS, Report, Setup, bytes_moved, fmt, geomean, graph_flops, header, plan_key  # noqa: E402

import relational_tensors as rt
from relational_tensors.dp_optimizer.costs import COST_MODEL_NAMES
from relational_tensors.machine.calibrate import time_cuda, time_wall  # noqa: E402
from relational_tensors.machine.kernel_model import CALIBRATIONS
from relational_tensors.machine.topology import Topology

OUT = Path(__file__).resolve().parent / "results" / "multigpu"
GPU_COUNTS = (1, 2, 4, 8)
TRAIN_WORKLOADS = ("8K", "4x2K", "32x1K")  # bench/gpu_train.py's (batch x tokens per sequence)


def _feeds(setup: Setup, g: rt.Graph) -> dict[str, np.ndarray]:
    """The inputs ``bench/gpu_block.py`` and ``bench/gpu_chains.py`` load (drawn on every CPU core)."""
    from relational_tensors.graph.models import chain_feeds, llama_feeds

    return llama_feeds(g, seed=1) if setup.family == "transformer" else chain_feeds(g, seed=0)


def time_ours(cg: rt.CompiledGraph, warmups: int = 2, rounds: int = 10) -> tuple[list[float], str]:
    """Milliseconds of each timed round.  After the warm-ups the program is one CUDA graph launched on the
    first device's stream, which waits for every other stream, so events on that stream time all GPUs;
    a program that could not be captured is timed with the wall clock around execute + synchronize."""
    ex = cg.executor
    uncaptured = ""
    for _ in range(warmups):
        try:
            cg.execute()
        except rt.ExecError as e:  # the capture failed: the executor runs this program eagerly from now on
            if getattr(ex, "graph_exec", None) is not None or getattr(ex, "capturable", True):
                raise
            uncaptured = f"; capture failed: {e}"
            cg.execute()
    cg.synchronize()
    if getattr(ex, "graph_exec", None) is not None:
        return time_cuda(cg.execute, ex.streams[0], rounds=rounds, warmups=0), "CUDA events, CUDA graph"
    def run() -> None:
        cg.execute()
        cg.synchronize()

    return time_wall(run, rounds=rounds, warmups=0), "wall clock, eager (not captured)" + uncaptured


def _free_gpus() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _smoke_graph(setup: Setup) -> rt.Graph:
    """--smoke: the workload at toy sizes in float32 (a tiny block on at most 2 x 32 tokens, chains / 256)."""
    from relational_tensors.graph.models import llama_block, matrix_chain

    if setup.family == "transformer":
        b, _ = WORKLOADS[setup.name]
        return llama_block(min(b, 2), 32, d_model=64, n_heads=8, n_kv_heads=4, d_ff=128)
    return matrix_chain(setup.name, "float32", scale=256)


def _devices(args: argparse.Namespace) -> tuple[str, int, list[int]]:
    """The GPU's name, how many are visible, and the asked counts that fit (``--smoke``: virtual CPU devices)."""
    if args.smoke:
        visible, gpu = max(args.gpus), "cpu (smoke: toy sizes on virtual CPU devices)"
    else:
        import cupy

        visible = cupy.cuda.runtime.getDeviceCount()
        gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    skipped = [n for n in args.gpus if n > visible]
    if skipped:
        print(f"note: {visible} GPUs visible, so {skipped} GPUs are skipped", flush=True)
    return gpu, visible, [n for n in args.gpus if n <= visible]


def _planning(args: argparse.Namespace, gpu: str) -> tuple[Any, str, str | None]:
    """What plans are made against: the measured topology file when there is one (else ``hgx-h200``), its
    name, and the calibration file to use with it."""
    topology: Any = "hgx-h200"
    if args.topology and Path(args.topology).exists():
        topology = Topology.from_json(Path(args.topology))
    elif args.topology:
        print(f"note: no topology file at {args.topology}; planning against hgx-h200", flush=True)
    topo_name = topology if isinstance(topology, str) else topology.name
    # a measured topology has its own name, so the shipped calibration of its GPUs is named here
    calibration = None
    shipped = CALIBRATIONS / "hgx-h200.json"
    if not isinstance(topology, str) and "H200" in gpu and shipped.exists():
        calibration = str(shipped)
    return topology, topo_name, calibration


def _planned(row: dict[str, Any], g: rt.Graph, device: Any, topology: Any, model: str, calibration: Any) -> Any:
    """The plan of ``g``, with its compile time, predicted time and bytes between GPUs in ``row``."""
    t0 = time.perf_counter()
    cg = rt.compileGraph(g, device=device, topology=topology, cost_model=model, calibration=calibration)
    row["compile_s"] = time.perf_counter() - t0
    row["predicted_ms"] = cg.simulate() * 1e3
    row["bytes_between_gpus"] = bytes_moved(cg)
    return cg


def _device_arg(args: argparse.Namespace, n: int) -> Any:
    return f"cpu:{n}" if args.smoke else list(range(n))


def ours(args: argparse.Namespace) -> None:
    gpu, visible, counts = _devices(args)
    topology, topo_name, calibration = _planning(args, gpu)
    path = args.out / "ours.json"
    result: dict[str, Any] = {"gpu": gpu, "visible_gpus": visible,
                              "topology": topo_name, "calibration": calibration or "shipped for the topology, if any",
                              "dtype": "float16", "rounds": "2 warm-ups + 10 timed",
                              "rows": []}
    if not args.smoke:
        from common import matmul_rate

        result["matmul_tflops"] = matmul_rate() / 1e12  # one GPU, fp16 8192^3: the roofline's rate
        print(f"matmul rate {result['matmul_tflops']:.0f} TFLOP/s per GPU", flush=True)
    setups = [Setup(w, "transformer") for w in args.workloads] + [Setup(c, "chain") for c in args.chains]
    for setup in setups:
        g = _smoke_graph(setup) if args.smoke else setup.graph()
        feeds = _feeds(setup, g)
        one: np.ndarray | None = None
        for n, model in [(n, m) for n in counts for m in args.cost_model]:
            if n == 1 and model != args.cost_model[0]:
                continue  # one GPU: every cost model gives the same plan
            row: dict[str, Any] = {"workload": setup.name, "family": setup.family, "gpus": n,
                                   "cost_model": model, "flops": graph_flops(g)}
            try:
                cg = _planned(row, g, _device_arg(args, n), topology, model, calibration)
                row["splits"] = list(plan_key(cg))
                cg.load(feeds)
                times, how = time_ours(cg)
                row.update(ms=statistics.mean(times), ms_min=min(times), ms_all=times, timing=how, status="ok")
                y = cg.offload("y").astype(np.float32)
                if one is None:
                    one = y
                diff = float(np.max(np.abs(y - one)))
                row["max_abs_diff_vs_1gpu"] = diff
                row["max_rel_diff_vs_1gpu"] = diff / max(1e-6, float(np.max(np.abs(one))))
                del cg, y
            except Exception as e:  # noqa: BLE001 - record and go on with the other setups
                row.update(status="error", reason=f"{type(e).__name__}: {e}")
            if not args.smoke:
                _free_gpus()
            result["rows"].append(row)
            print(f"{setup.label:>9} x{n} {model:>10}: " + (f"{row['ms']:.3f} ms (predicted {row['predicted_ms']:.3f}, "
                                                 f"rel diff vs 1 GPU {row['max_rel_diff_vs_1gpu']:.1e})"
                                                 if row["status"] == "ok" else row["reason"]), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a crash keeps the rest
        del feeds, one
    print(f"wrote {path}")


# --- the training step -----------------------------------------------------------------------------------

def train(args: argparse.Namespace) -> None:
    """Ours: ``bench/gpu_train.py``'s training step compiled for each GPU count and cost model, timed, and
    compared with the one-GPU run (first and last loss, float32 masters after every step ran)."""
    import gpu_train as gt
    import ml_dtypes
    from baselines.block import PARAMS
    from baselines.common import SHAPES
    from baselines.train import train_batch, train_weights

    gpu, visible, counts = _devices(args)
    topology, topo_name, calibration = _planning(args, gpu)
    shape = SHAPES["tiny" if args.smoke else "llama3-8b"]
    steps = 2 + args.rounds  # the steps every run takes: 2 warm-ups and the timed ones
    path = args.out / "ours_train.json"
    result: dict[str, Any] = {"gpu": gpu, "visible_gpus": visible, "topology": topo_name,
                              "calibration": calibration or "shipped for the topology, if any",
                              "dtype": "bfloat16 weights and activations, float32 masters and moments",
                              "step": "bench/gpu_train.py's: forward, MSE against a random target in float32, "
                                      "backward, AdamW (lr, betas, eps, weight decay of gpu_train)",
                              "rounds": f"2 warm-ups + {args.rounds} timed", "steps": steps, "rows": []}
    if not args.smoke:
        from common import matmul_rate

        result["matmul_tflops"] = matmul_rate() / 1e12
        print(f"matmul rate {result['matmul_tflops']:.0f} TFLOP/s per GPU", flush=True)
    for name in args.workloads:
        b, s = gt.WORKLOADS[name]
        if args.smoke:
            b, s = min(b, 2), 32
        g, opt = gt.step_graph(b, s, shape.d_model, shape.n_heads, shape.n_kv_heads, shape.d_ff)
        x, target = train_batch(b, s, shape.d_model, 0)  # gpu_train's batch, rounded to bfloat16 as it does
        feeds = gt.our_feeds(g, opt, train_weights(shape, 0), x.astype(ml_dtypes.bfloat16),
                             target.astype(ml_dtypes.bfloat16))
        del x, target
        one: dict[str, Any] | None = None
        for n, model in [(n, m) for n in counts for m in args.cost_model]:
            if n == 1 and model != args.cost_model[0]:
                continue
            row: dict[str, Any] = {"workload": name, "gpus": n, "cost_model": model, "batch": b, "seq": s}
            if not args.smoke:
                row["flops"] = gt.block_flops(b, s)
            try:
                cg = _planned(row, g, _device_arg(args, n), topology, model, calibration)
                cg.load(feeds)
                cg.execute()  # the first warm-up; its loss is the first step's
                row["first_loss"] = float(np.asarray(cg.offload("loss")).reshape(-1)[0])
                times, how = time_ours(cg, warmups=1, rounds=args.rounds)
                row.update(ms=statistics.mean(times), ms_min=min(times), ms_all=times, timing=how, status="ok")
                row["last_loss"] = float(np.asarray(cg.offload("loss")).reshape(-1)[0])
                masters = {k: np.asarray(cg.offload(f"{k}.master"), dtype=np.float32) for k in PARAMS}
                if one is None:
                    one = {"masters": masters, "last_loss": row["last_loss"]}
                # AdamW moves an element about lr per step: the masters' difference as a fraction of that
                row["masters_max_diff_vs_1gpu_over_lr_steps"] = max(
                    float(np.max(np.abs(masters[k] - one["masters"][k]))) for k in masters) / (gt.LR * steps)
                row["last_loss_rel_diff_vs_1gpu"] = abs(row["last_loss"] - one["last_loss"]) / abs(one["last_loss"])
                del cg, masters
            except Exception as e:  # noqa: BLE001 - record and go on with the other setups
                row.update(status="error", reason=f"{type(e).__name__}: {e}")
            if not args.smoke:
                _free_gpus()
            result["rows"].append(row)
            print(f"train {name:>6} x{n} {model:>10}: "
                  + (f"{row['ms']:.3f} ms (predicted {row['predicted_ms']:.3f}, first loss {row['first_loss']:.6f}, "
                     f"last loss rel diff vs 1 GPU {row['last_loss_rel_diff_vs_1gpu']:.1e})"
                     if row["status"] == "ok" else row["reason"]), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a crash keeps the rest
        del feeds, one
    print(f"wrote {path}")


# --- merge -----------------------------------------------------------------------------------------------

def _baselines(out: Path, stem: str = "baselines_n") -> dict[int, dict[str, Any]]:
    found = {}
    for f in sorted(out.glob(f"{stem}*.json")):
        data = json.loads(f.read_text())
        found[int(data["header"]["world"])] = data
    return found


def _label(name: str) -> str:
    return name if name in WORKLOADS else f"chain {name}"


def merge(args: argparse.Namespace) -> None:
    out = args.out
    ours_data = json.loads((out / "ours.json").read_text()) if (out / "ours.json").exists() else {"rows": []}
    base = _baselines(out)
    topo_txt = (out / "topo.txt").read_text() if (out / "topo.txt").exists() else None
    topo_file = out / "topology.json"
    topo = Topology.from_json(topo_file) if topo_file.exists() else None
    names = list(dict.fromkeys([r["workload"] for r in ours_data["rows"]]
                               + [w for b in base.values() for w in b["best"]]))
    counts = sorted({r["gpus"] for r in ours_data["rows"]} | set(base))
    models = list(dict.fromkeys(r.get("cost_model", "paper") for r in ours_data["rows"])) or ["paper"]
    ok = {(r["workload"], r["gpus"], r.get("cost_model", "paper")): r for r in ours_data["rows"]
          if r.get("status") == "ok"}
    flops = {r["workload"]: r["flops"] for r in ours_data["rows"] if r.get("flops")}
    rate = ours_data.get("matmul_tflops")

    def ours_ms(w: str, n: int | None, m: str) -> float | None:
        """Ours on n GPUs planned with cost model m (one GPU: the same plan whatever the model)."""
        r = ok.get((w, n, m)) or (next((v for k, v in ok.items() if k[:2] == (w, 1)), None) if n == 1 else None)
        return r["ms"] if r else None

    # looked up at n = top too, top None when there are no GPU counts (then no key matches)
    best: dict[tuple[str, int | None], Any] = {(w, n): b for n, d in base.items() for w, b in d["best"].items()}
    every = {(r["workload"], r["strategy"], n): r for n, d in base.items() for r in d["rows"]}

    gpu = ours_data.get("gpu") or next((d["header"]["device"] for d in base.values()), "GPU")
    timing = next((r["timing"] for r in ours_data["rows"] if r.get("timing")), "not timed")
    measured = [f"ours: relational_tensors on {gpu}, compiled for {max(counts, default=0)} devices or fewer "
                f"(plans against {ours_data.get('topology', '?')}, cost models {' / '.join(models)}); {timing}"]
    for n, d in sorted(base.items()):
        h = d["header"]
        measured.append(f"PyTorch on {n}: hand-written (bench/baselines), {h['backend']}, {h['dtype']} on "
                        f"{h['device']}, torch {h['torch']}; {h['rounds']}")
    if rate:
        measured.append(f"roofline: the graph's FLOPs over n x {rate:.0f} TFLOP/s (fp16 matmul 8192^3 measured on "
                        f"one GPU in the same run)")
    ours_train = json.loads((out / "ours_train.json").read_text()) if (out / "ours_train.json").exists() else None
    base_train = _baselines(out, "baselines_train_n")
    if ours_train and ours_train["rows"]:
        how = next((r["timing"] for r in ours_train["rows"] if r.get("timing")), "not timed")
        measured.append(f"training step, ours: relational_tensors on {ours_train['gpu']}, {ours_train['dtype']}; "
                        f"{ours_train['rounds']}; {how}")
    for n, d in sorted(base_train.items()):
        h = d["header"]
        measured.append(f"training step, PyTorch on {n}: DDP and FSDP2 (bench/baselines/train.py), {h['backend']}, "
                        f"{h['dtype']} activations on {h['device']}, torch {h['torch']}; {h['rounds']}")
    report = Report("multigpu", header("Multi-GPU: ours against hand-written PyTorch", [],
                                       f"{', '.join(map(str, counts))} x {gpu}", measured,
                                       ["2 warm-ups + 10 timed rounds each unless a line above says otherwise; "
                                        "mean in ms"]), out=out)
    top = max(counts) if counts else None
    per = " / ".join(models)

    def each(value: Any, digits: int, suffix: str = "") -> str:  # one value per cost model, "a / b"
        return " / ".join(fmt(value(m), digits, suffix) for m in models)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    cols = (["workload"] + [f"ours {n}" + (f" ({per})" if n > 1 and len(models) > 1 else "") for n in counts]
            + [f"PyTorch best {n}" for n in counts]
            + [f"PyTorch / ours at {top}", f"ours 1 -> {top} speed-up", f"roofline at {top} (ms)",
               f"ours / roofline at {top}"])
    rows = []
    for w in names:
        o = [each(lambda m, n=n, w=w: ours_ms(w, n, m), 3) if n > 1 else fmt(ours_ms(w, 1, models[0]), 3)
             for n in counts]
        b = [f"{best[(w, n)]['ms']:.3f} ({best[(w, n)]['strategy']})" if (w, n) in best else "-" for n in counts]
        roof = flops[w] / (top * rate * 1e12) * 1e3 if top and rate and w in flops else None
        rows.append([_label(w), *o, *b,
                     each(lambda m, w=w: ratio(best[(w, top)]["ms"] if (w, top) in best else None,
                                               ours_ms(w, top, m)), 2, "x"),
                     each(lambda m, w=w: ratio(ours_ms(w, 1, m), ours_ms(w, top, m)), 2, "x"),
                     fmt(roof, 3), each(lambda m, w=w, roof=roof: ratio(ours_ms(w, top, m), roof), 2)])
    blocks = [w for w in names if w in WORKLOADS]
    geo_o = [each(lambda m, n=n: geomean(ours_ms(w, n, m) for w in blocks), 3) if n > 1
             else fmt(geomean(ours_ms(w, 1, models[0]) for w in blocks), 3) for n in counts]
    geo_b = [fmt(geomean(best[(w, n)]["ms"] if (w, n) in best else None for w in blocks), 3) for n in counts]
    geo_ratio = each(lambda m: geomean(ratio(best[(w, top)]["ms"] if (w, top) in best else None,
                                             ours_ms(w, top, m)) for w in blocks), 2, "x")
    rows.append(["geomean (blocks)", *geo_o, *geo_b, geo_ratio, "", "", ""])
    if names:  # a run of the training step alone has no forward results
        report.table("Mean milliseconds per run; PyTorch's best strategy per workload in brackets"
                     + (f"; ours as {per} (cost models)" if len(models) > 1 else ""), cols, rows)

    detail = []
    for (w, s, n), r in sorted(every.items(), key=lambda kv: (names.index(kv[0][0]) if kv[0][0] in names else 99,
                                                               kv[0][2], kv[0][1])):
        check = r.get("check")
        detail.append([_label(w), s, n, fmt(r.get("ms"), 3) if r["status"] == "ok" else r["status"],
                       "-" if check is None else ("ok" if check.get("ok") else "FAILED")
                       + (f" ({check['max_rel']:.1e})" if "max_rel" in check else ""),
                       r.get("reason") or r.get("note") or ""])
    if detail:
        report.table("Every PyTorch strategy", ["workload", "strategy", "GPUs", "mean (ms)", "check", "note"], detail)
    ours_detail = [[_label(r["workload"]), r["gpus"], r.get("cost_model", "paper"), fmt(r.get("ms"), 3),
                    fmt(r.get("predicted_ms"), 3), fmt(ratio(r.get("ms"), r.get("predicted_ms")), 2),
                    fmt(r.get("compile_s"), 2), f"{r.get('max_rel_diff_vs_1gpu', float('nan')):.1e}",
                    r.get("reason", "") or ("" if "graph" in r.get("timing", "graph") else r.get("timing", ""))]
                   for r in ours_data["rows"]]
    if ours_detail:
        report.table("Ours: measured against simulated, and the difference from the one-GPU output",
                     ["workload", "GPUs", "cost model", "measured (ms)",
                      f"simulated on {ours_data.get('topology')} (ms)", "measured / simulated", "compile (s)",
                      "max rel diff vs 1 GPU", "error or note"], ours_detail)
    if topo is not None:
        bw = [topo.bandwidth(s, d) for s in topo.sites for d in topo.sites if s != d]
        report.text(f"Measured topology `{topo.name}` ({topo_file.name}): {len(topo.sites)} GPUs, peer copies "
                    + (f"{min(bw) / 1e9:.0f}-{max(bw) / 1e9:.0f} GB/s, " if bw else "")
                    + f"HBM copy {topo.hbm_bandwidth / 1e9:.0f} GB/s.")
        report.text(_against_builtin(topo, topo_txt))
    if topo_txt:
        report.text("`nvidia-smi topo -m`:", "", "```", topo_txt.rstrip(), "```")

    def draw(plt: Any) -> Any:
        cols_n = min(5, max(1, len(names)))
        rows_n = (len(names) + cols_n - 1) // cols_n
        fig, axes = plt.subplots(rows_n, cols_n, figsize=(3.2 * cols_n, 2.8 * rows_n), squeeze=False)
        for ax, w in zip(axes.flat, names):
            for m in models:
                xs = [n for n in counts if ours_ms(w, n, m) is not None]
                ax.plot(xs, [ours_ms(w, n, m) for n in xs], "o-", label=f"ours ({m})" if len(models) > 1 else "ours")
            xs = [n for n in counts if (w, n) in best]
            ax.plot(xs, [best[(w, n)]["ms"] for n in xs], "s--", label="PyTorch best")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(counts, [str(n) for n in counts])
            ax.set_title(_label(w), fontsize=9)
            ax.set_xlabel("GPUs", fontsize=8)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        axes.flat[0].set_ylabel("ms per run")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        return fig

    if ours_train or base_train:
        _train_tables(report, ours_train or {"rows": []}, base_train)
    data = {"ours": ours_data, "baselines": {str(n): d for n, d in base.items()},
            "train": {"ours": ours_train, "baselines": {str(n): d for n, d in base_train.items()}},
            "topology": json.loads(topo.to_json()) if topo is not None else None, "nvidia_smi_topo": topo_txt}
    report.write(data, draw if names else None)


TRAIN_STRATEGY_NAMES = {"ddp": "DDP", "fsdp": "FSDP2"}


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _train_tables(report: Report, ours_data: dict[str, Any], base: dict[int, dict[str, Any]]) -> None:
    """The training step: ours per GPU count (per cost model above one) against PyTorch DDP and FSDP2, then
    every PyTorch row with its check, and ours' plans with their losses against the one-GPU run."""
    rows_in = ours_data["rows"]
    names = list(dict.fromkeys([r["workload"] for r in rows_in]
                               + [r["workload"] for d in base.values() for r in d["rows"]]))
    counts = sorted({r["gpus"] for r in rows_in} | set(base))
    models = list(dict.fromkeys(r["cost_model"] for r in rows_in)) or ["paper"]
    ok = {(r["workload"], r["gpus"], r["cost_model"]): r for r in rows_in if r.get("status") == "ok"}
    # looked up at n = top too, top None when there are no GPU counts (then no key matches)
    theirs: dict[tuple[str, str, int | None], Any] = {(r["workload"], r["strategy"], n): r
                                                      for n, d in base.items() for r in d["rows"]}
    rate = ours_data.get("matmul_tflops")
    flops = {r["workload"]: r["flops"] for r in rows_in if r.get("flops")}
    top = max(counts) if counts else None

    def ours_ms(w: str, n: int | None, m: str) -> float | None:
        r = ok.get((w, n, m)) or (next((v for k, v in ok.items() if k[:2] == (w, 1)), None) if n == 1 else None)
        return r["ms"] if r else None

    def torch_cell(w: str, s: str, n: int) -> str:
        r = theirs.get((w, s, n))
        if r is None:
            return "-"
        if r["status"] != "ok":
            return "n/a" if r["status"] == "not applicable" else "error"
        failed = r.get("check") is not None and not r["check"].get("ok")
        return f"{r['ms']:.2f}" + (" (check FAILED)" if failed else "")

    def best_torch(w: str, n: int | None) -> float | None:
        done = [r["ms"] for s in TRAIN_STRATEGY_NAMES if (r := theirs.get((w, s, n))) and r["status"] == "ok"
                and r.get("check", {}).get("ok", True)]
        return min(done) if done else None

    def each(value: Any, digits: int, suffix: str = "") -> str:
        return " / ".join(fmt(value(m), digits, suffix) for m in models)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    per = " / ".join(models)
    cols = (["workload"] + [f"ours {n}" + (f" ({per})" if n > 1 and len(models) > 1 else "") for n in counts]
            + [f"{label} {n}" for label in TRAIN_STRATEGY_NAMES.values() for n in counts]
            + [f"best PyTorch / ours at {top}", f"ours 1 -> {top} speed-up", f"roofline at {top} (ms)"])
    table = []
    for w in names:
        o = [each(lambda m, n=n, w=w: ours_ms(w, n, m), 2) if n > 1 else fmt(ours_ms(w, 1, models[0]), 2)
             for n in counts]
        t = [torch_cell(w, s, n) for s in TRAIN_STRATEGY_NAMES for n in counts]
        roof = flops[w] / (top * rate * 1e12) * 1e3 if top and rate and w in flops else None
        table.append([w, *o, *t, each(lambda m, w=w: ratio(best_torch(w, top), ours_ms(w, top, m)), 2, "x"),
                      each(lambda m, w=w: ratio(ours_ms(w, 1, m), ours_ms(w, top, m)), 2, "x"), fmt(roof, 2)])
    report.table("Training step (forward, MSE, backward, AdamW; bench/gpu_train.py's): mean milliseconds per step; "
                 "PyTorch n/a where data parallelism cannot split the batch (fewer sequences than GPUs)", cols, table,
                 after=["The roofline counts the forward's matmul FLOPs x 3 and attention's x 3.5 "
                        "(bench/gpu_train.py's block_flops) at the measured fp16 matmul rate."])
    detail = []
    for (w, s, n), r in sorted(theirs.items(), key=lambda kv: (names.index(kv[0][0]), kv[0][2], kv[0][1])):
        c = r.get("check")
        check = "-" if c is None else ("ok" if c.get("ok") else "FAILED") + (
            f" (moments {c['max_rel']:.1e}, params {c['params_max_over_lr_steps']:.2f} lr x steps, "
            f"first loss {c['losses'][0]:.6f})" if "max_rel" in c else "")
        ms = fmt(r.get("ms"), 2) if r["status"] == "ok" else r["status"]
        detail.append([w, TRAIN_STRATEGY_NAMES.get(s, s), n, ms, check, r.get("reason") or r.get("note") or ""])
    if detail:
        report.table("Every PyTorch training step (check: parameters and AdamW moments after the checked steps "
                     "against a single-process eager run over the whole batch)",
                     ["workload", "strategy", "GPUs", "mean (ms)", "check", "note"], detail)
    mine = [[r["workload"], r["gpus"], r["cost_model"], fmt(r.get("ms"), 2), fmt(r.get("predicted_ms"), 2),
             fmt(r.get("compile_s"), 1), fmt(r.get("first_loss"), 6),
             _sci(r.get("last_loss_rel_diff_vs_1gpu")),
             _sci(r.get("masters_max_diff_vs_1gpu_over_lr_steps")), r.get("reason", "")]
            for r in rows_in]
    if mine:
        report.table(f"Ours, training step: measured against simulated, and against the one-GPU run after "
                     f"{ours_data.get('steps', '?')} steps",
                     ["workload", "GPUs", "cost model", "measured (ms)",
                      f"simulated on {ours_data.get('topology')} (ms)", "compile (s)", "first loss",
                      "last loss rel diff vs 1 GPU",
                      "masters max diff vs 1 GPU (lr x steps)", "error"], mine)


def _against_builtin(measured: Topology, topo_txt: str | None, builtin: str = "hgx-h200") -> str:
    """The built-in topology the planner assumes, checked against the measured one and ``nvidia-smi topo -m``:
    per-pair link bandwidth and HBM rate as ratios, and whether every GPU pair is on NVLink."""
    from relational_tensors.machine.machines import get_topology

    n = len(measured.sites)
    ref = get_topology(builtin, gpus=n) if n <= 8 else get_topology(builtin)
    pairs = [(a, b) for a in measured.sites for b in measured.sites if a != b and a in ref.sites and b in ref.sites]
    ratio = [measured.bandwidth(a, b) / ref.bandwidth(a, b) for a, b in pairs]
    text = (f"Built-in `{builtin}` against this machine: it assumes {ref.bandwidth(0, 1) / 1e9:.0f} GB/s between "
            f"GPUs and {ref.hbm_bandwidth / 1e9:.0f} GB/s of HBM; measured "
            + (f"{min(ratio):.2f}-{max(ratio):.2f}x of its link rate" if ratio else "no GPU pair")
            + f" and {measured.hbm_bandwidth / ref.hbm_bandwidth:.2f}x of its HBM rate (copies, read + write).")
    if topo_txt:
        try:
            from measure_topology import parse_nvidia_smi_topo

            links = parse_nvidia_smi_topo(topo_txt)["links"]
            kinds = sorted({links[a][b] for a in range(len(links)) for b in range(len(links)) if a != b})
            text += (f" `nvidia-smi topo -m` links between GPUs: {', '.join(kinds)}"
                     + ("; every pair on NVLink, as the built-in assumes." if all(k.startswith("NV") for k in kinds)
                        else "; not every pair is on NVLink, unlike the built-in: plan with the measured file."))
        except ValueError as e:
            text += f" (`nvidia-smi topo -m` could not be read: {e})"
    return text


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    o = sub.add_parser("ours", help="compile and time ours on 1..n GPUs")
    o.add_argument("--gpus", type=_ints, default=list(GPU_COUNTS))
    o.add_argument("--workloads", type=_names, default=list(WORKLOADS))
    o.add_argument("--chains", type=_names, default=list(CHAINS))
    o.add_argument("--topology", help="a topology JSON (bench/measure_topology.py) to plan and simulate against")
    o.add_argument("--smoke", action="store_true", help="check this driver without GPUs: toy sizes on cpu:N")
    t = sub.add_parser("train", help="compile and time ours' training step (bench/gpu_train.py's) on 1..n GPUs")
    t.add_argument("--gpus", type=_ints, default=list(GPU_COUNTS))
    t.add_argument("--workloads", type=_names, default=list(TRAIN_WORKLOADS),
                   help=f"comma-separated, of {', '.join(TRAIN_WORKLOADS)} (default all)")
    t.add_argument("--topology", help="a topology JSON (bench/measure_topology.py) to plan and simulate against")
    t.add_argument("--smoke", action="store_true", help="check this driver without GPUs: a tiny block on cpu:N")
    t.add_argument("--rounds", type=int, default=10, help="timed steps after the 2 warm-ups (default 10)")
    m = sub.add_parser("merge", help="join ours and the baselines into multigpu.json/.md/.png")
    for p in (o, t):
        p.add_argument("--cost-model", type=_names, default=["paper", "calibrated"],
                       help="the planner's cost models, comma-separated: each is compiled and timed on every GPU "
                            "count above one (default paper,calibrated)")
    for p in (o, t, m):
        p.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    known = TRAIN_WORKLOADS if args.command == "train" else WORKLOADS
    bad = [w for w in getattr(args, "workloads", []) if w not in known] + \
        [c for c in getattr(args, "chains", []) if c not in CHAINS]
    bad += [m for m in getattr(args, "cost_model", []) if m not in COST_MODEL_NAMES]
    if bad:
        ap.error(f"unknown workloads, chains or cost models {bad}; known: {list(known)}, {list(CHAINS)} and "
                 f"{', '.join(COST_MODEL_NAMES)}.")
    if getattr(args, "rounds", 1) < 1:
        ap.error(f"--rounds must be >= 1; got {args.rounds}.")
    {"ours": ours, "train": train, "merge": merge}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

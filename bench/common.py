"""Shared pieces of the reproduction of the paper's section 6 (issue 6): workloads, plans, output.

Every ``bench/expN_*.py`` script builds its setups from here, compiles them with
:func:`plan`, and hands its rows to :class:`Report`, which writes
``bench/results/<stem>.json``, ``.md`` and ``.png`` under one header that says
where the numbers come from (the machine that computed them, the devices, the
dtype, and whether they are *simulated* on a named topology or *measured*).

The workloads are the paper's: the LLaMA-3-8B-shaped block (d_model 4096, 32
query heads, 8 kv heads, head dim 128, FFN 14336) in float16 on the five token
workloads, and the matrix chains A-E in their fixed parenthesizations.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import relational_tensors as rt
from relational_tensors.graph.graph import Graph
from relational_tensors.graph.models import LLAMA3_8B, llama_block, matrix_chain
from relational_tensors.machine.machines import get_topology

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
DTYPE = "float16"

# (batch, tokens per sequence) of the paper's five transformer workloads
WORKLOADS: dict[str, tuple[int, int]] = {
    "1K": (1, 1024), "8K": (1, 8192), "8x1K": (8, 1024), "128x1K": (128, 1024), "128K": (1, 131072),
}
CHAINS: tuple[str, ...] = ("A", "B", "C", "D", "E")
# --quick: two of each family (the cheapest ones that still split every way)
QUICK_WORKLOADS: tuple[str, ...] = ("1K", "8x1K")
QUICK_CHAINS: tuple[str, ...] = ("B", "C")

PAPER_SEEDS = 20  # random draws per workload in the paper's experiments 3 and 5
_STARTED = time.perf_counter()  # a command's runtime counts from the import of this module


@dataclass(frozen=True)
class Setup:
    """One workload of the paper: a transformer token workload or a matrix chain."""

    name: str
    family: str  # "transformer" or "chain"

    @property
    def label(self) -> str:
        return self.name if self.family == "transformer" else f"chain {self.name}"

    def graph(self) -> Graph:
        return _graph(self.family, self.name)


@functools.cache
def _graph(family: str, name: str) -> Graph:
    if family == "transformer":
        b, s = WORKLOADS[name]
        return llama_block(b, s, dtype=DTYPE, **LLAMA3_8B)
    return matrix_chain(name, dtype=DTYPE)


def setups(quick: bool, families: Sequence[str] = ("transformer", "chain")) -> list[Setup]:
    """The setups of the chosen families, all of them or the ``--quick`` subset."""
    out: list[Setup] = []
    if "transformer" in families:
        out += [Setup(w, "transformer") for w in (QUICK_WORKLOADS if quick else WORKLOADS)]
    if "chain" in families:
        out += [Setup(c, "chain") for c in (QUICK_CHAINS if quick else CHAINS)]
    return out


# --- planning and simulation -----------------------------------------------------------------------------

def plan(setup: Setup, p: int, topology: str, **options: Any) -> tuple[rt.CompiledGraph, float]:
    """Compile ``setup`` for ``p`` GPUs of ``topology`` (whose memory bounds the plan); returns the
    compiled graph and the seconds compilation took."""
    t0 = time.perf_counter()
    cg = rt.compileGraph(setup.graph(), device=p, topology=topology, **options)
    return cg, time.perf_counter() - t0


def simulated_ms(cg: rt.CompiledGraph, topology: str) -> float:
    """The whole-plan simulator's prediction for one execution on ``topology``, in milliseconds."""
    return cg.simulate(topology) * 1e3


def graph_flops(g: Graph) -> float:
    """Floating-point operations of one run of ``g`` on one device (each operator's own count)."""
    from relational_tensors.core.types import Box

    return float(sum(n.op.flops(tuple(Box.of_shape(g.nodes[i].type.shape) for i in n.inputs),
                                Box.of_shape(n.type.shape)) for n in g.nodes if n.op is not None))


def bytes_moved(cg: rt.CompiledGraph) -> int:
    """Bytes the plan copies between devices."""
    return cg.dag.bytes_moved()


def plan_key(cg: rt.CompiledGraph) -> tuple[str, ...]:
    """The logical plan as the split of every operator, to tell whether two compilations agree."""
    return tuple(cg.plan.split(n.id) for n in cg.graph.operators)


def planned_run(setup: Setup, p: int, topology: str, **options: Any) -> dict[str, Any]:
    """Plan ``setup`` with ``options`` and simulate it on ``topology``: the simulated time (ms), the plan's
    cost under its cost model, the compile seconds and the plan's splits.  A plan the compiler refuses
    (a random plan that does not fit the GPUs' memory, say) gives ``error`` instead of a time."""
    try:
        cg, compile_s = plan(setup, p, topology, **options)
    except rt.PlanError as e:
        return {"ms": None, "cost": None, "error": f"{type(e).__name__}: {e}"}
    return {"ms": simulated_ms(cg, topology), "cost": cg.plan.cost, "compile_s": compile_s,
            "lower_s": cg.timings.get("lower"), "splits": list(plan_key(cg))}


def schedule_options(ap: argparse.ArgumentParser, default: str) -> None:
    """``--schedule naive|search`` and ``--budget`` (seconds of exchange-program search per program)."""
    ap.add_argument("--schedule", choices=("naive", "search"), default=default,
                    help=f"exchange-program synthesis (default {default})")
    budget_option(ap)


def budget_option(ap: argparse.ArgumentParser) -> None:
    """``--budget``: seconds of exchange-program search per program (read it with :func:`search_budget`)."""
    ap.add_argument("--budget", type=float, default=0.5, help="search seconds per exchange program (default 0.5)")


def search_budget(args: argparse.Namespace) -> float:
    """The search seconds per program: ``--budget``, at most 0.1 with ``--quick``."""
    return min(args.budget, 0.1) if args.quick else args.budget


def random_plan_arguments(doc: str | None, quick_draws: int,
                          what: str) -> tuple[argparse.Namespace, int, dict[str, Any]]:
    """The command line of the random-plan experiments (3 and 5): ``--schedule``, ``--budget`` and
    ``--draws``; returns the arguments, the draws (20, or ``quick_draws`` with --quick) and the compile
    options (--quick caps the search at 0.1 s per program)."""
    def extra(ap: argparse.ArgumentParser) -> None:
        schedule_options(ap, "search")
        ap.add_argument("--draws", type=int, default=None,
                        help=f"{what} (default {PAPER_SEEDS}; --quick {quick_draws})")

    args = arguments(doc, extra)
    draws = args.draws or (quick_draws if args.quick else PAPER_SEEDS)
    args.budget = search_budget(args)
    return args, draws, {"schedule_mode": args.schedule, "search_budget_s": args.budget}


# --- statistics ------------------------------------------------------------------------------------------

def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the values given (None when any is missing or there are none)."""
    vals = list(values)
    positive = [v for v in vals if v is not None and v > 0]
    if not vals or len(positive) < len(vals):
        return None
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson's r of two samples; None when either is constant or shorter than three."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


# --- measured results of the GPU benchmarks --------------------------------------------------------------

def measured_gpu_block(results: Path = RESULTS) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """One-GPU measurements of ``bench/gpu_block.py`` (``results/gpu_block.json``, one run of every
    workload), and the files read."""
    f = results / "gpu_block.json"
    if not f.exists():
        return {}, []
    data = json.loads(f.read_text())
    rows = {name: {"gpu": data.get("gpu", "GPU"), "torch": data.get("torch"), "file": f.name,
                   **{k: v for k, v in r.items() if k.endswith("_ms") and isinstance(v, (int, float))}}
            for name, r in data.get("workloads", {}).items()}
    return rows, [f.name]


def measured_multigpu(results: Path = RESULTS, cost_model: str = "paper") -> tuple[int, dict[str, dict[str, Any]]]:
    """The largest GPU count of ``bench/multigpu.sh``'s results (``results/multigpu``) and, per workload,
    ours there (planned with ``cost_model``) and the best PyTorch baseline there; (0, {}) if no run used
    two GPUs or more."""
    folder = results / "multigpu"
    if not (folder / "ours.json").exists():
        return 0, {}
    ours = [r for r in json.loads((folder / "ours.json").read_text())["rows"] if r.get("status") == "ok"]
    n = max((r["gpus"] for r in ours), default=0)
    if n < 2:  # nothing measured on several GPUs
        return 0, {}
    base_file = folder / f"baselines_n{n}.json"
    best = json.loads(base_file.read_text())["best"] if base_file.exists() else {}
    rows: dict[str, dict[str, Any]] = {}
    for r in ours:
        if r["gpus"] == n and r.get("cost_model", "paper") == cost_model:
            rows[r["workload"]] = {"ours_ms": r["ms"], "pytorch_best_ms": best.get(r["workload"], {}).get("ms"),
                                   "pytorch_best": best.get(r["workload"], {}).get("strategy")}
    return n, rows


def measured_gpu_chains(results: Path = RESULTS) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """One-GPU measurements of ``bench/gpu_chains.py`` (``gpu_chains*.json``), merged by chain."""
    rows: dict[str, dict[str, Any]] = {}
    files = sorted(results.glob("gpu_chains*.json"), key=lambda f: f.stat().st_mtime)
    for f in files:
        data = json.loads(f.read_text())
        for name, r in data.get("workloads", {}).items():
            rows[name] = {"gpu": data.get("gpu", "GPU"), "file": f.name,
                          **{k: v for k, v in r.items() if k.endswith("_ms") and isinstance(v, (int, float))}}
    return rows, [f.name for f in files]


# --- where the numbers come from -------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> str:
    """The commit of the package's checkout, marked dirty when its source differs from it."""
    root = Path(rt.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "relational_tensors"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" (uncommitted changes in relational_tensors/)" if dirty else "")) if head else "not a git checkout"


def describe_topology(name: str) -> str:
    """One line about a simulated machine: its GPUs, memory, HBM, peak FP16 and fastest link."""
    from relational_tensors.machine.kernel_model import KernelModel

    t = get_topology(name)
    link = max((t.bandwidth(s, d) for s in t.sites for d in t.sites if s != d), default=0.0)
    # the simulator's kernel model: a shipped calibration of this machine, else default efficiencies
    source = KernelModel.from_calibration(t, None).source
    kernels = ("uncalibrated default kernel efficiencies" if source == "defaults"
               else f"kernel rates calibrated from {Path(source).name}")
    return (f"{name}: {len(t.sites)} GPUs of {t.memory_bytes / 2**30:.0f} GiB, HBM {t.hbm_bandwidth / 1e9:.0f} GB/s, "
            f"{t.flops(DTYPE) / 1e12:.0f} TFLOP/s {DTYPE} peak, links up to {link / 1e9:.0f} GB/s; {kernels}")


def header(title: str, simulated_on: Sequence[str], devices: str, measured: Sequence[str] = (),
           notes: Sequence[str] = ()) -> dict[str, Any]:
    """Where the numbers come from: the machine that computed them, the devices, the dtype, and the basis
    (``simulated on <topology>`` for every simulated machine, ``measured`` for every measured source)."""
    basis = [f"simulated on {t} ({describe_topology(t)})" for t in simulated_on]
    basis += [f"measured: {m}" for m in measured]
    return {
        "title": title,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": f"{platform.node()}: {_cpu_model()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "package": f"relational_tensors {rt.__version__} at {Path(rt.__file__).resolve().parent}, git {_git()}",
        "devices": devices,
        "dtype": DTYPE,
        "basis": basis,
        "notes": list(notes),
    }


def header_markdown(h: dict[str, Any]) -> list[str]:
    lines = [f"## {h['title']}", "", f"`{h['command']}` ({h['date']})", "",
             f"- computed on: {h['machine']}; Python {h['python']}",
             f"- package: {h['package']}",
             f"- devices: {h['devices']}",
             f"- dtype: {h['dtype']}"]
    lines += [f"- numbers: {b}" for b in h["basis"]]
    lines += [f"- note: {n}" for n in h["notes"]]
    return lines + [""]


# --- output ----------------------------------------------------------------------------------------------

def arguments(doc: str | None, extra: Callable[[argparse.ArgumentParser], Any] | None = None) -> argparse.Namespace:
    """The common command line: ``--quick`` (a smoke run) and ``--out`` (the results folder)."""
    ap = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer workloads and draws")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


@contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar over ``total`` steps; yields ``advance(message)``, which prints the message
    above the bar and moves it one step."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task(what, total=total)

        def advance(message: str) -> None:
            bar.update(task, advance=1)
            if message:
                bar.console.print(message, highlight=False)

        yield advance


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


@dataclass
class Report:
    """The results of one experiment: a header, Markdown tables with their captions, and raw data."""

    stem: str
    head: dict[str, Any]
    out: Path = RESULTS
    quick: bool = False  # a smoke run writes <stem>_quick.*, leaving the full run's files alone

    def __post_init__(self) -> None:
        self.sections: list[list[str]] = []
        if self.quick:
            self.stem += "_quick"

    def table(self, caption: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
              after: Sequence[str] = ()) -> None:
        tail = [*after, ""] if after else []
        self.sections.append([f"**{caption}**", "", *markdown_table(columns, rows), "", *tail])

    def text(self, *lines: str) -> None:
        self.sections.append([*lines, ""])

    def write(self, data: dict[str, Any], draw: Callable[[Any], Any] | None = None) -> list[Path]:
        """Write ``<stem>.json`` (header, data, runtime), ``.md`` and, when matplotlib imports, ``.png``
        (``draw(pyplot)`` returns the figure).  Prints the Markdown and returns the paths written."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.head["runtime_s"] = round(time.perf_counter() - _STARTED, 1)
        md = header_markdown(self.head) + [line for s in self.sections for line in s]
        md.append(f"Runtime of this command: {self.head['runtime_s']:.0f} s (after imports).")
        paths = [self.out / f"{self.stem}.json", self.out / f"{self.stem}.md"]
        paths[0].write_text(json.dumps({"header": self.head, **data}, indent=2, default=_jsonable) + "\n")
        paths[1].write_text("\n".join(md) + "\n")
        print("\n".join(md))
        if draw is not None:
            png = self.out / f"{self.stem}.png"
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
            except ImportError:
                print(f"note: matplotlib is not importable, so {png.name} was not drawn "
                      "(pip install matplotlib)")
            else:
                fig = draw(plt)
                basis = "; ".join(b.split(" (")[0] for b in self.head["basis"])
                fig.text(0.995, -0.01, f"{basis}; {self.head['dtype']}",  # below the axes' labels
                         ha="right", va="top", fontsize=7, color="0.4")
                fig.savefig(png, dpi=130, bbox_inches="tight")
                plt.close(fig)
                paths.append(png)
        print("wrote " + ", ".join(str(p) for p in paths))
        return paths


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (set, tuple, Path)):
        return list(value) if not isinstance(value, Path) else str(value)
    return str(value)


def write_table(out: str | Path, lines: Sequence[str], data: Any) -> None:
    """A Markdown table at ``out`` (and printed), and its data as JSON beside it (``out`` with .json)."""
    text = "\n".join(lines) + "\n"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    Path(out).with_suffix(".json").write_text(json.dumps(data, indent=2))
    print(text)


def matmul_rate() -> float:
    """This GPU's fp16 matmul rate (FLOP/s): an 8192³ product through CuPy, 2 warm-ups and 10 timed rounds
    between CUDA events; the rate rooflines are drawn at."""
    import statistics

    import cupy

    from relational_tensors.machine.calibrate import time_cuda

    a = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
    ms = statistics.mean(time_cuda(lambda: cupy.matmul(a, b), cupy.cuda.get_current_stream()))
    return 2 * 8192**3 / (ms * 1e-3)


def busy_ms_by_kind(cg: rt.CompiledGraph) -> dict[str, float]:
    """Milliseconds of task time of one profiled run (``cg.profile()``) by task kind, kernels by operator
    kind, every stream summed, largest first; and under ``recomputation`` (counted in the kinds too) the
    time of the operators a ``g.recompute()`` region makes again for the backward, where there are any."""
    kinds: dict[str, float] = {}
    again = 0.0
    for t in cg.profile().tasks:
        op = cg.dag.tasks[t.task].op
        key = "kernel:" + cg.graph.nodes[op].kind if t.kind == "kernel" and op is not None else t.kind
        kinds[key] = kinds.get(key, 0.0) + (t.end - t.start) * 1e3
        if op is not None and cg.graph.nodes[op].name.startswith("recompute."):  # autodiff's name for them
            again += (t.end - t.start) * 1e3
    out = {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    if again:
        out["recomputation"] = round(again, 4)
    return out

"""The whole-plan simulator: the task DAG on a topology, with predicted times.

Every compute task (kernel, decompose, recompose, aggregate) runs on its
device's one queue, in emission order, for ``launch latency + max(FLOPs /
(peak·efficiency), bytes / (HBM bandwidth·efficiency))`` -- a roofline with
per-kind efficiencies that a calibration file can override.  Every copy is a
flow over the topology's route for that pair of devices, sharing links with
the copies in flight (the exchange simulator's flow engine).  A task starts
when its inputs exist; the prediction is the time the last task ends.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from relational_tensors.errors import PlanError
from relational_tensors.exchange.flows import FlowNetwork
from relational_tensors.exchange.tasks import TaskDAG
from relational_tensors.exchange.topology import Topology
from relational_tensors.frontend.graph import Graph

__all__ = ["KernelModel", "PlanSimResult", "TaskTime", "simulate_plan", "write_trace"]

# Fractions of peak that real kernels reach; replaced by measured numbers from a calibration file.
DEFAULT_EFFICIENCY = {"matmul": 0.75, "attention": 0.55, "compute": 0.5, "memory": 0.8}
MATMUL_KINDS = frozenset({"matmul", "einsum", "sql"})


CALIBRATIONS = Path(__file__).resolve().parent / "calibrations"


@dataclass(frozen=True)
class KernelModel:
    """Roofline times for compute tasks on one GPU of a topology.

    ``curves`` holds measured rates by size for a kind (``matmul``, ``attention``: FLOP/s against
    FLOPs; ``memory``: bytes/s against bytes), interpolated in log-size; kinds without a curve
    use the peak rate times ``efficiency``.
    """

    topology: Topology
    efficiency: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    curves: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = "defaults"

    @staticmethod
    def from_calibration(topology: Topology, path: str | Path | None = None) -> KernelModel:
        """Load a calibration file (``relational-tensors calibrate`` writes one); by default the one
        shipped for the topology's machine, if any (a subset, ``hgx-h200[4]``, has the same GPUs)."""
        if path is None:
            shipped = CALIBRATIONS / f"{topology.machine}.json"
            if not shipped.exists():
                return KernelModel(topology)
            path = shipped
        data = json.loads(Path(path).read_text())
        eff = dict(DEFAULT_EFFICIENCY)
        eff.update({k: float(v) for k, v in data.get("efficiency", {}).items()})
        curves = {k: tuple(sorted((float(a), float(b)) for a, b in v)) for k, v in data.get("curves", {}).items()}
        return KernelModel(topology, eff, curves, str(path))

    def _rate(self, kind: str, size: float) -> float | None:
        curve = self.curves.get(kind)
        if not curve or size <= 0:
            return None
        xs = [math.log(a) for a, _ in curve]
        x = math.log(size)
        if x <= xs[0]:  # below the smallest measurement: its rate (the launch latency is charged apart)
            return curve[0][1]
        if x >= xs[-1]:
            return curve[-1][1]
        for (x0, (a0, r0)), (x1, (a1, r1)) in zip(zip(xs, curve), zip(xs[1:], curve[1:])):
            if x0 <= x <= x1:
                t = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
                return r0 + t * (r1 - r0)
        return curve[-1][1]

    def time(self, flops: float, nbytes: float, dtype: str, kind: str) -> float:
        top = self.topology
        peak = top.peak_flops.get(dtype) or top.peak_flops.get("float32") or max(top.peak_flops.values())
        family = "matmul" if kind in MATMUL_KINDS else "attention" if kind == "attention" else "compute"
        rate = self._rate(family, flops) if flops else None
        compute = flops / rate if rate else (flops / (peak * self.efficiency[family]) if flops else 0.0)
        mem_rate = self._rate("memory", nbytes) or top.hbm_bandwidth * self.efficiency["memory"]
        memory = nbytes / mem_rate
        return top.launch_latency + max(compute, memory)


@dataclass(frozen=True)
class TaskTime:
    task: int
    kind: str
    label: str
    device: int
    src_device: int | None
    start: float
    end: float
    bytes: int


@dataclass(frozen=True)
class PlanSimResult:
    time: float
    tasks: tuple[TaskTime, ...]
    topology: str

    def busy(self, kind: str | None = None) -> float:
        return sum(t.end - t.start for t in self.tasks if kind is None or t.kind == kind)


def _compute_cost(dag: TaskDAG, graph: Graph, task: Any, model: KernelModel) -> float:
    nbytes = lambda ids: sum(dag.buffers[b].nbytes for b in ids)  # noqa: E731
    out = dag.buffers[task.outputs[0]]
    if task.kind == "kernel":
        node = graph.nodes[task.op]
        f = task.payload["function"]
        return model.time(f.flops, nbytes(task.inputs) + nbytes(task.outputs), node.type.dtype, node.kind)
    if task.kind == "aggregate":
        return model.time(out.box.volume * (len(task.inputs) - 1), nbytes(task.inputs) + out.nbytes, out.dtype, "memory")
    # decompose and recompose read and write every byte they move once (a recompose moves only the
    # pieces it is given: copies and ⊕ may have written the rest of its block in place)
    moved = 2 * nbytes(task.inputs)
    return model.time(0.0, moved, out.dtype, "memory")


def simulate_plan(dag: TaskDAG, graph: Graph, topology: Topology, model: KernelModel | None = None) -> PlanSimResult:
    """Predict the run time of ``dag`` on ``topology`` (logical device d is site d)."""
    model = model or KernelModel(topology)
    sites = topology.sites
    deps = dag.producers()
    waiting_on = {tid: len(d) for tid, d in deps.items()}
    dependents: dict[int, list[int]] = {t.id: [] for t in dag.tasks}
    for tid, ds in deps.items():
        for d in ds:
            dependents[d].append(tid)
    queues: dict[int, list[int]] = {d: [] for d in range(dag.p)}
    for t in dag.tasks:
        if t.kind not in ("load", "copy"):
            queues[t.device].append(t.id)
    head = {d: 0 for d in queues}
    free_at = {d: 0.0 for d in queues}
    network = FlowNetwork(topology.capacities())
    done: set[int] = {t.id for t in dag.tasks if t.kind == "load"}
    ready_copies = [t.id for t in dag.tasks if t.kind == "copy" and waiting_on[t.id] == 0]
    heap: list[tuple[float, int]] = []
    started: dict[int, float] = {}
    times: list[TaskTime] = []
    now = 0.0

    def finish(tid: int, at: float) -> None:
        done.add(tid)
        t = dag.tasks[tid]
        times.append(TaskTime(tid, t.kind, t.label, t.device, t.src_device, started[tid], at,
                              sum(dag.buffers[b].nbytes for b in t.outputs)))
        for nxt in dependents[tid]:
            waiting_on[nxt] -= 1
            if waiting_on[nxt] == 0 and dag.tasks[nxt].kind == "copy":
                ready_copies.append(nxt)

    remaining = sum(1 for t in dag.tasks if t.kind != "load")
    while remaining:
        for tid in ready_copies:
            t = dag.tasks[tid]
            src, dst = sites[t.src_device], sites[t.device]
            route = topology.route(src, dst)
            network.start(tid, route.resources, float(dag.buffers[t.outputs[0]].nbytes), now, latency=route.latency)
            started[tid] = now
        ready_copies.clear()
        for d, queue in queues.items():
            if head[d] < len(queue) and free_at[d] <= now:
                tid = queue[head[d]]
                if tid not in started and waiting_on[tid] == 0:
                    dur = _compute_cost(dag, graph, dag.tasks[tid], model)
                    started[tid] = now
                    free_at[d] = now + dur
                    heapq.heappush(heap, (now + dur, tid))
                    head[d] += 1
        nxt_flow = network.next_completion()
        nxt_task = heap[0][0] if heap else None
        candidates = [x for x in (nxt_flow, nxt_task) if x is not None]
        if not candidates:
            stuck = [dag.tasks[q[head[d]]].label for d, q in queues.items() if head[d] < len(q)]
            raise PlanError(f"plan simulation stalled with {remaining} tasks left, e.g. {stuck[:3]}; the task "
                            "DAG has a dependency no task satisfies.")
        now = max(now, min(candidates))
        for tid in network.advance_to(now):
            finish(tid, now)
            remaining -= 1
        while heap and heap[0][0] <= now:
            _, tid = heapq.heappop(heap)
            finish(tid, now)
            remaining -= 1
    end = max((t.end for t in times), default=0.0)
    return PlanSimResult(end, tuple(sorted(times, key=lambda t: (t.start, t.task))), topology.name)


def write_trace(result: PlanSimResult, path: str | Path, device_names: Mapping[int, str] | None = None) -> Path:
    """A Chrome/Perfetto trace: one process per device, a compute track and a transfer track."""
    events: list[dict[str, Any]] = []
    devices = sorted({t.device for t in result.tasks})
    for d in devices:
        name = (device_names or {}).get(d, f"device {d}")
        events.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": name}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 1, "args": {"name": "transfers in"}})
    for t in result.tasks:
        events.append({
            "name": t.label, "cat": t.kind, "ph": "X", "pid": t.device, "tid": 1 if t.kind == "copy" else 0,
            "ts": t.start * 1e6, "dur": max((t.end - t.start) * 1e6, 0.001),
            "args": {"bytes": t.bytes, "task": t.task, **({"from": t.src_device} if t.src_device is not None else {})},
        })
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                "otherData": {"topology": result.topology, "predicted_s": result.time}}))
    return path

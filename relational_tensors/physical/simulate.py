"""The whole-plan simulator: the task DAG on a topology, with predicted times.

Every compute task (kernel, decompose, recompose, aggregate) runs on its
device's one queue, in emission order, for ``launch latency + max(FLOPs /
(peak·efficiency), bytes / (HBM bandwidth·efficiency))`` -- a roofline with
per-kind efficiencies that a calibration file can override.  Every copy is a
flow over the topology's route for that pair of devices, sharing links with
the copies in flight (the flow engine of ``target.flows``).  A task starts
when its inputs exist; the prediction is the time the last task ends.

Logical devices of one GPU (``physical``: ``cuda:0,0,0,0``) share it: their
compute tasks are flows over the GPU's compute.  A task's flow is its work at
the GPU's best rates (``KernelModel.busy_time``), drawn no faster than its
roofline time alone allows, after its launch latency: a task alone takes its
roofline time, small tasks side by side overlap, and tasks that each could
fill the GPU split it evenly.  A copy between two of them is a flow through
the GPU's memory, which reads and writes every byte (half its bandwidth,
shared by the copies in flight).

An executor that issues tasks otherwise than one kernel each says how (``Issue``): the GPU executor
runs a group of elementwise tasks as one fused kernel at the place of its last task (priced as that
last task, by the bytes the group reads and writes), and does nothing for a task another kernel does
as it goes or a reshape that keeps its input's bytes (priced at nothing).
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relational_tensors.errors import PlanError
from relational_tensors.graph.graph import Graph
from relational_tensors.machine.flows import FlowNetwork
from relational_tensors.machine.kernel_model import KernelModel
from relational_tensors.machine.pricing import combine_seconds, move_seconds
from relational_tensors.machine.topology import Route, Topology
from relational_tensors.physical.tasks import TaskDAG

__all__ = ["Issue", "PlanSimResult", "TaskTime", "simulate_plan"]

_GC_YOUNG = 100_000  # net allocations between collections of the youngest generation while simulating (Python: 700)
_WORK = 1e9  # a shared GPU's compute as a flow resource: units of work per second (a task's roofline ns)


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
class Issue:
    """How an executor issues the DAG where it is not one kernel per task: ``free``, the tasks it does
    nothing for (a fused group's members before its last, a sibling another kernel writes, a reshape
    that keeps its input's bytes); ``fused``, per fused group's last task, the bytes the group reads and
    writes and the dtype of its block."""

    free: frozenset[int] = frozenset()
    fused: Mapping[int, tuple[int, str]] = field(default_factory=dict)


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
        f = task.kernel.function
        moved = node.op.kernel_bytes([dag.buffers[b].nbytes for b in task.inputs], nbytes(task.outputs))
        return model.time(f.flops, moved, node.type.dtype, node.op.cost_family)
    if task.kind == "aggregate":
        return combine_seconds(model, out.box.volume, len(task.inputs), nbytes(task.inputs) + out.nbytes, out.dtype)
    # decompose and recompose read and write every byte they move once (a recompose moves only the
    # pieces it is given: copies and ⊕ may have written the rest of its block in place)
    return move_seconds(model, nbytes(task.inputs), out.dtype)


def _busy_cost(dag: TaskDAG, graph: Graph, task: Any, model: KernelModel, alone: float) -> float:
    """Seconds of a whole GPU that a compute task keeps busy beside others (at most ``alone`` less the
    launch latency, its time by itself)."""
    body = max(alone - model.topology.launch_latency, 0.0)
    if task.kind != "kernel":  # copies within memory: at the roofline's memory rate already
        return body
    node = graph.nodes[task.op]
    nbytes = node.op.kernel_bytes([dag.buffers[b].nbytes for b in task.inputs],
                                  sum(dag.buffers[b].nbytes for b in task.outputs))
    return min(body, model.busy_time(task.kernel.function.flops, nbytes, node.type.dtype, node.op.cost_family))


def _issued_cost(dag: TaskDAG, graph: Graph, task: Any, model: KernelModel, issue: Issue) -> float:
    """Seconds of a compute task alone, as the executor issues it."""
    if task.id in issue.free:
        return 0.0
    fused = issue.fused.get(task.id)
    if fused is not None:
        return model.time(0.0, fused[0], fused[1], "compute")
    return _compute_cost(dag, graph, task, model)


def _issued_busy(dag: TaskDAG, graph: Graph, task: Any, model: KernelModel, alone: float, issue: Issue) -> float:
    """``_busy_cost`` of a task as the executor issues it."""
    fused = issue.fused.get(task.id)
    if fused is not None:
        return min(max(alone - model.topology.launch_latency, 0.0), model.busy_time(0.0, fused[0], fused[1], "compute"))
    return _busy_cost(dag, graph, task, model, alone)


def simulate_plan(dag: TaskDAG, graph: Graph, topology: Topology, model: KernelModel | None = None,
                  physical: Sequence[int] | None = None, issue: Issue | None = None) -> PlanSimResult:
    """Predict the run time of ``dag`` on ``topology`` (logical device d is site d).  ``physical``: the GPU
    of each logical device where several share one (the module's docstring); None: a GPU each.
    ``issue``: how the executor issues the tasks, where not one kernel each (the module's docstring)."""
    if physical is not None and len(physical) != dag.p:
        raise PlanError(f"simulating a plan of {dag.p} devices needs the physical GPU of each; got {len(physical)} "
                        f"({list(physical)})")
    # a simulation makes a few objects per task and no cycles: at Python's default threshold the cyclic
    # collector would rescan the young ones every 700 allocations and, once, every object of the plan
    # (a fifth of simulating a 72-GPU plan), so it runs every _GC_YOUNG instead, as planning does
    thresholds = gc.get_threshold()
    if thresholds[0]:  # 0: the caller turned automatic collection off
        gc.set_threshold(max(thresholds[0], _GC_YOUNG), *thresholds[1:])
    try:
        return _simulate(dag, graph, topology, model or KernelModel(topology), physical, issue or Issue())
    finally:
        gc.set_threshold(*thresholds)


def _simulate(dag: TaskDAG, graph: Graph, topology: Topology, model: KernelModel,
              physical: Sequence[int] | None, issue: Issue) -> PlanSimResult:
    sites = topology.sites
    capacities = topology.capacities()
    # the GPU's compute resource of each logical device that shares its GPU (None: a GPU of its own)
    counts = Counter(physical or ())
    shared: list[str | None] = [f"compute(gpu {physical[d]})" if physical is not None and counts[physical[d]] > 1
                                else None for d in range(dag.p)]
    for d, r in enumerate(shared):
        if r is not None:
            capacities[r] = _WORK
            capacities[f"copies(gpu {physical[d]})"] = topology.hbm_bandwidth / 2  # type: ignore[index]
    tasks, buffers = dag.tasks, dag.buffers  # a task's id is its index
    deps = dag.producers()
    waiting_on = [0] * len(tasks)
    dependents: list[list[int]] = [[] for _ in tasks]
    for tid, ds in deps.items():
        waiting_on[tid] = len(ds)
        for d in ds:
            dependents[d].append(tid)
    is_copy = [t.kind == "copy" for t in tasks]
    queues: list[list[int]] = [[] for _ in range(dag.p)]
    for t in tasks:
        if t.kind not in ("load", "copy"):
            queues[t.device].append(t.id)
    head = [0] * dag.p
    free_at = [0.0] * dag.p
    # the devices whose next task may have become startable: one whose task ended, or the device of a
    # task whose last input arrived (a device is looked at again only after one of those)
    check = set(range(dag.p))
    network: FlowNetwork[int] = FlowNetwork(capacities)  # flows keyed by task id: copies, shared compute
    routes: dict[tuple[int, int], Route] = {}
    ready_copies = [t.id for t in tasks if t.kind == "copy" and waiting_on[t.id] == 0]
    heap: list[tuple[float, int]] = []
    started = [-1.0] * len(tasks)  # when each task started (-1: not yet)
    ended: list[tuple[int, float]] = []  # (task, end) in finishing order
    now = 0.0

    def finish(tid: int, at: float) -> None:
        ended.append((tid, at))
        if not is_copy[tid]:
            check.add(tasks[tid].device)
            free_at[tasks[tid].device] = at
        for nxt in dependents[tid]:
            waiting_on[nxt] -= 1
            if waiting_on[nxt] == 0:
                if is_copy[nxt]:
                    ready_copies.append(nxt)
                else:
                    check.add(tasks[nxt].device)

    remaining = sum(1 for t in tasks if t.kind != "load")
    while remaining:
        for tid in ready_copies:
            t = tasks[tid]
            assert t.src_device is not None  # a copy names its source device
            pair = (t.src_device, t.device)
            route = routes.get(pair)
            if route is None:
                if physical is not None and physical[t.src_device] == physical[t.device]:
                    route = routes[pair] = Route((f"copies(gpu {physical[t.device]})",), 0.0)
                else:
                    route = routes[pair] = topology.route(sites[t.src_device], sites[t.device])
            network.start(tid, route.resources, float(buffers[t.outputs[0]].nbytes), now, latency=route.latency)
            started[tid] = now
        ready_copies.clear()
        if check:
            for d in sorted(check):
                queue = queues[d]
                if head[d] < len(queue) and free_at[d] <= now:
                    tid = queue[head[d]]
                    if started[tid] < 0 and waiting_on[tid] == 0:
                        dur = _issued_cost(dag, graph, tasks[tid], model, issue)
                        if not 0.0 <= dur < math.inf:  # the kernel model's numbers are checked; this keeps it so
                            raise PlanError(f"plan simulation priced task {tasks[tid].label!r} at {dur} s; a "
                                            "task takes a finite, non-negative time. Check the topology and "
                                            "calibration.")
                        started[tid] = now
                        head[d] += 1
                        resource = shared[d]
                        if resource is None:
                            free_at[d] = now + dur
                            heapq.heappush(heap, (now + dur, tid))
                        else:  # a flow over the GPU's compute, with the other logical devices' tasks
                            free_at[d] = math.inf
                            latency = min(model.topology.launch_latency, dur)
                            work = _issued_busy(dag, graph, tasks[tid], model, dur, issue) * _WORK
                            body = dur - latency
                            network.start(tid, (resource,), work, now, latency=latency,
                                          cap=work / body if body > 0 and work > 0 else math.inf)
            check.clear()
        nxt_flow = network.next_completion()
        nxt_task = heap[0][0] if heap else None
        candidates = [x for x in (nxt_flow, nxt_task) if x is not None]
        if not candidates:
            stuck = [tasks[q[head[d]]].label for d, q in enumerate(queues) if head[d] < len(q)]
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
    times = []
    for start, tid, at in sorted((started[tid], tid, at) for tid, at in ended):  # by start, then task
        t = tasks[tid]
        times.append(TaskTime(tid, t.kind, t.label, t.device, t.src_device, start, at,
                              sum(buffers[b].nbytes for b in t.outputs)))
    end = max((t.end for t in times), default=0.0)
    return PlanSimResult(end, tuple(times), topology.name)

"""How a GPU rank of the distributed executor orders its two streams: which earlier tasks each task must
follow (data, the memory plan's reuses, assignments), its transfers cut into groups
(``physical.p2p.grouped_schedules``, checked together for every rank), and the events between the compute
and communication streams.  Pure functions of the plan, so that every rank computes the same schedule
(and the tests check it without a GPU)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from relational_tensors.physical.p2p import Group, check_groups, grouped_schedules, is_transfer
from relational_tensors.physical.tasks import TaskDAG
from relational_tensors.runtime.memory_plan import MemoryPlan

__all__ = ["StreamSchedule", "stream_orderings", "stream_schedule"]


def stream_orderings(dag: TaskDAG, plan: MemoryPlan) -> dict[int, set[int]]:
    """Per task, every earlier task it must follow, whichever stream either runs on: those that wrote what
    it reads, those that touched memory its outputs reuse (the memory plan's reuses, on its own device
    too, since a rank's transfers and kernels run on two streams), and, for a task that writes a state's
    kept block (an ``assign``, or a copy or assembly of its value in place), every earlier task that touched
    the block.  Loads are done before a run starts."""
    deps = dag.producers()
    kept = dag.kept_state_blocks()
    touchers: dict[int, list[int]] = defaultdict(list)
    for t in dag.tasks:
        for b in (*t.inputs, *t.outputs):
            touchers[plan.alias.get(b, b)].append(t.id)
    for t in dag.tasks:
        if t.kind == "load":
            continue
        olds = [old for b in t.outputs for old in plan.reuses.get(plan.alias.get(b, b), ())]
        olds += dag.overwrites(t, kept, plan.alias)
        deps[t.id].update(x for old in olds for x in touchers[old] if x < t.id and dag.tasks[x].kind != "load")
    return deps


@dataclass(frozen=True)
class StreamSchedule:
    """How one rank issues its tasks on its two streams: its groups of transfers in the order the
    communication stream runs them, per group the latest compute task (of this rank) it waits for, and
    per compute task the latest group it waits for (the streams are in order, so waiting for the latest
    covers the earlier ones)."""

    groups: list[Group]
    after: list[int | None]
    waits: dict[int, int]


def stream_schedule(dag: TaskDAG, plan: MemoryPlan, rank: int) -> StreamSchedule:
    """Rank ``rank``'s :class:`StreamSchedule`, after checking every rank's groups together (each rank
    computes them from the same plan, so every rank posts the groups the others expect)."""
    order = stream_orderings(dag, plan)
    groups = grouped_schedules(dag, deps=order)
    check_groups(groups)
    member = {op.task: g for g, group in enumerate(groups[rank]) for op in group}

    def issued(t: Any) -> bool:
        return t.kind != "load" and (rank in (t.src_device, t.device) if is_transfer(t) else t.device == rank)

    # a transfer's dependencies on this rank are kernels (compute stream) or transfers (earlier groups)
    after = [max((d for op in group for d in order[op.task] if d not in member and issued(dag.tasks[d])),
                 default=None) for group in groups[rank]]
    waits = {}
    for t in dag.tasks:
        if issued(t) and t.id not in member:
            on = [member[d] for d in order[t.id] if d in member]
            if on:
                waits[t.id] = max(on)
    return StreamSchedule(groups[rank], after, waits)

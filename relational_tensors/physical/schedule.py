"""The order a pipelined plan's devices run their tasks in: micro-batch by micro-batch, as the schedule says.

The lowering emits an operator's function specs together, every micro-batch of one operator before the
next operator; a stage would then finish all its micro-batches before the next stage could start any.
This pass re-emits the same tasks in another topological order: each kernel gets the rank of its
(forward or backward, micro-batch) in its stage's schedule (``gpipe``: the forwards, then the backwards;
``1f1b``: ``stages - s - 1`` forwards of warm-up on stage ``s``, then one forward and one backward in turn,
then the remaining backwards), every task the smallest of its own rank and the ranks of the tasks it feeds
(the count of a mean's tokens, made from the inputs, runs before the first micro-batch's loss needs it),
and among the tasks ready to run the smallest rank goes first.  Operators that carry no batch run when the
first of their readers needs them (the casts of weights, the gradient's seed), or after every micro-batch
when nothing ranked reads them (the optimizer's updates).  A task that writes a state's kept block in place
stays after every task that touched the block before it.
"""

from __future__ import annotations

import heapq

from relational_tensors.dp_optimizer.pipeline import PipelinedPlan
from relational_tensors.physical.tasks import Task, TaskDAG

__all__ = ["stage_slots", "pipeline_order"]


def _fold_partials(dag: TaskDAG, own: dict[int, int], root: dict[int, int], late: int) -> list[Task]:
    """``dag``'s tasks with every ⊕ of three or more partials (a weight gradient's micro-batches) as a chain
    of ⊕s of two, in the order their partials are made: each partial is folded into a running sum as soon
    as it is made and then freed, so a device holds about two partials of a block instead of one per
    micro-batch.  A fold's rank (``own``, updated; the tasks renumbered) is that of the partial it folds
    in.  The same sum, in another order of float32 additions, at about three times the ⊕'s bytes: the
    compiler folds only a plan that would not fit the memory otherwise."""
    writer: dict[int, int] = {}
    for t in dag.tasks:
        for b in t.outputs:
            writer[root.get(b, b)] = t.id

    def made_at(b: int) -> int:
        w = writer.get(root.get(b, b))
        return late if w is None else own.get(w, late)

    out: list[Task] = []
    ranks: dict[int, int] = {}
    for t in dag.tasks:
        if t.kind != "aggregate" or len(t.inputs) < 3:
            if t.id in own:
                ranks[len(out)] = own[t.id]
            t.id = len(out)
            out.append(t)
            continue
        ins = sorted(t.inputs, key=made_at)
        acc = ins[0]
        for k, b in enumerate(ins[1:], 1):
            if k == len(ins) - 1:
                into = t.outputs[0]
            else:
                last = dag.buffers[t.outputs[0]]
                into = dag.buffer(last.device, last.box, last.dtype, last.tensor, last.partial)
            ranks[len(out)] = made_at(b)
            out.append(Task(len(out), "aggregate", t.device, (acc, b), (into,), t.op, None, t.payload, t.label))
            acc = into
    own.clear()
    own.update(ranks)
    return out


def stage_slots(schedule: str, stages: int, stage: int, micro: int) -> dict[tuple[int, int], int]:
    """(phase, micro-batch) -> its rank on ``stage``; phase 0 is the forward, 1 the backward.

    >>> order = stage_slots("1f1b", 2, 0, 3)
    >>> sorted(order, key=order.get)
    [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2)]
    """
    if schedule == "gpipe":
        units = [(0, i) for i in range(micro)] + [(1, i) for i in range(micro)]
    else:
        warm = min(stages - stage - 1, micro)
        units = [(0, i) for i in range(warm)]
        f, b = warm, 0
        while f < micro:
            units += [(0, f), (1, b)]
            f, b = f + 1, b + 1
        units += [(1, i) for i in range(b, micro)]
    return {u: r for r, u in enumerate(units)}


def pipeline_order(dag: TaskDAG, plan: PipelinedPlan, fold: bool = False) -> TaskDAG:
    """``dag``'s tasks in the pipeline schedule's order (module docstring), renumbered; ``fold`` folds the
    micro-batches' partials into running sums as they are made (``_fold_partials``)."""
    pipe = plan.pipeline
    m = pipe.micro_batches
    slots = [stage_slots(pipe.schedule, pipe.stages, s, m) for s in range(pipe.stages)]
    late = 2 * m + 1  # after every micro-batch: what carries no batch, unless something earlier reads it
    own: dict[int, int] = {}  # task -> its rank, where it has one of its own
    for t in dag.tasks:
        if t.kind == "kernel" and t.op is not None:
            phase = 0 if t.op in plan.forward else 1
            mb = plan.micro_batch(t.op, t.kernel.index)
            if mb is not None:  # an operator without a batch runs as its first reader needs it
                own[t.id] = slots[plan.stage_of[t.op]][(phase, mb)]
    root = dag.view_roots()
    tasks = _fold_partials(dag, own, root, late) if fold else dag.tasks
    n = len(tasks)
    rank = [own.get(t.id, late) for t in tasks]
    # dependencies in the emitted order: a reader after every earlier writer of the bytes it reads (loads
    # included), an in-place write of a kept block after every earlier task that touched it
    kept = dag.kept_state_blocks()
    writers: dict[int, list[int]] = {}
    touched: dict[int, list[int]] = {}
    deps: list[set[int]] = [set() for _ in range(n)]
    for t in tasks:
        d = deps[t.id]
        for b in t.inputs:
            r = root.get(b, b)
            d.update(writers.get(r, ()))
            touched.setdefault(r, []).append(t.id)
        if kept and t.kind != "load":
            for r in dag.overwrites(t, kept, root):
                d.update(touched.get(r, ()))
        for b in t.outputs:
            r = root.get(b, b)
            writers.setdefault(r, []).append(t.id)
            touched.setdefault(r, []).append(t.id)
        d.discard(t.id)
    users: list[list[int]] = [[] for _ in range(n)]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    for t in reversed(tasks):  # a task runs by the first of the tasks it feeds
        if users[t.id]:
            rank[t.id] = min(rank[t.id], *(rank[u] for u in users[t.id]))
    waiting = [len(d) for d in deps]
    ready = [(rank[i], i) for i in range(n) if not waiting[i]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (rank[u], u))
    assert len(order) == n, "the task dependencies have a cycle"
    out = [tasks[i] for i in order]
    for k, t in enumerate(out):  # renumbered in place: the lowering hands its DAG over
        t.id = k
    dag.tasks = out
    return dag

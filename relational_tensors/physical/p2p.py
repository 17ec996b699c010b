"""The point-to-point schedule of a task DAG run with one process per device, and its checker.

Every ``copy`` task between two devices becomes a send on its source's rank and a receive on its
destination's rank; each rank runs its tasks in the DAG's order, so its sends and receives come in that
order too.  :func:`check_schedule` proves the schedule cannot deadlock even if every send waited for its
receive (a rendezvous, the strictest semantics a transport may have): it runs the ranks' operation lists
against each other, matching each send with its receive, and refuses a schedule in which some rank can
never go on (naming the ranks and the tasks they wait at) or a transfer with no partner.  A DAG whose
copies all follow one order shared by every rank always passes (the earliest unmatched transfer has
both of its ranks ready); the check is there so that no future change to the lowering or the executor
can break that without a test failing.

>>> from relational_tensors.core.types import Box
>>> from relational_tensors.physical.tasks import TaskDAG
>>> dag = TaskDAG(2)
>>> a, b = dag.buffer(0, Box((0,), (4,)), "float32", 0), dag.buffer(1, Box((0,), (4,)), "float32", 0)
>>> _ = dag.add("copy", 1, (a,), (b,), src_device=0)
>>> [[(op.kind, op.peer) for op in ops] for ops in schedules(dag)]
[[('send', 1)], [('recv', 0)]]
>>> check_schedule(dag)
"""

from __future__ import annotations

from dataclasses import dataclass

from relational_tensors.errors import ExchangeError
from relational_tensors.physical.tasks import TaskDAG

__all__ = ["P2POp", "schedules", "check_schedule"]


@dataclass(frozen=True, slots=True)
class P2POp:
    """One transfer seen from one rank: ``task`` the copy task (also the message tag)."""

    task: int
    kind: str  # "send" or "recv"
    peer: int  # the other rank


def schedules(dag: TaskDAG, lo: int = 0, hi: int | None = None) -> list[list[P2POp]]:
    """Per rank (device), its sends and receives in the order it runs them (tasks ``lo`` to ``hi``)."""
    out: list[list[P2POp]] = [[] for _ in range(dag.p)]
    for task in dag.tasks[lo:hi]:
        if task.kind != "copy" or task.src_device is None or task.src_device == task.device:
            continue
        out[task.src_device].append(P2POp(task.id, "send", task.device))
        out[task.device].append(P2POp(task.id, "recv", task.src_device))
    return out


def check_schedule(dag: TaskDAG, lo: int = 0, hi: int | None = None) -> None:
    """Refuse a schedule that could deadlock under rendezvous semantics or has an unmatched transfer."""
    ranks = schedules(dag, lo, hi)
    sends = {op.task: (r, op.peer) for r, ops in enumerate(ranks) for op in ops if op.kind == "send"}
    recvs = {op.task: (op.peer, r) for r, ops in enumerate(ranks) for op in ops if op.kind == "recv"}
    if sends != recvs:
        lonely = sorted(set(sends) ^ set(recvs))[:3]
        raise ExchangeError(f"the point-to-point schedule has transfers without a partner (copy tasks {lonely}): "
                            "every send needs its receive.")
    pos = [0] * dag.p
    waiting: dict[int, int] = {}  # copy task -> the rank blocked at it
    ready = list(range(dag.p))
    while ready:
        r = ready.pop()
        ops = ranks[r]
        while pos[r] < len(ops):
            op = ops[pos[r]]
            if waiting.get(op.task) == op.peer:  # the partner waits at this very transfer: both go on
                del waiting[op.task]
                pos[r] += 1
                pos[op.peer] += 1
                ready.append(op.peer)
                continue
            waiting[op.task] = r
            break
    stuck = [r for r in range(dag.p) if pos[r] < len(ranks[r])]
    if stuck:
        at = ", ".join(f"rank {r} at copy task {ranks[r][pos[r]].task} ({ranks[r][pos[r]].kind} with rank "
                       f"{ranks[r][pos[r]].peer})" for r in stuck[:4])
        raise ExchangeError(f"the point-to-point schedule can deadlock: {at} wait for each other. The ranks' "
                            "transfers must follow one order; report this with the plan (cg.save).")

"""The point-to-point schedule of a task DAG run with one process per device: its groups, and its checker.

Every ``copy`` task between two devices becomes a send on its source's rank and a receive on its
destination's rank; each rank runs its tasks in the DAG's order, so its sends and receives come in that
order too (:func:`schedules`).  :func:`grouped_schedules` cuts each rank's transfers into *groups*, each
posted as one ``torch.distributed.batch_isend_irecv`` (NCCL fuses a group into one launch): a group is a
run of transfers that the rank meets one after the other (no other task of the rank between them) of
which none depends, directly or through any other task of any rank, on another; a group never spans the
pause between the two phases of a program split in two.  The rank posts a group when it reaches its
last transfer, and whatever reads a received block comes after that.

:func:`check_schedule` proves the grouped schedule cannot deadlock even if every send waited for its
receive (a rendezvous, the strictest semantics a transport may have), and that it suits a transport
without tags (NCCL matches a pair of ranks' transfers in the order they are posted):

* every send has its receive, and the k-th send from rank a to rank b is the k-th receive of b from a;
* each rank posts its groups in order, all of a group's operations at once, and goes on to the next
  only when every one of them has completed; an operation completes once the groups holding it on both
  of its ranks are posted (NCCL progresses the operations of a group independently, those with one peer
  in the order posted, which the previous rule keeps consistent on both sides).

The checker runs the ranks' groups against each other under these rules and refuses a schedule in which
some rank can never go on, naming the ranks and the transfers they wait at.  A grouped schedule made by
:func:`grouped_schedules` always passes (the earliest transfer not yet done, in the DAG's order, sits in
the group each of its two ranks has posted, since every earlier group of theirs holds only earlier
transfers); the check is there so that no change to the lowering, the grouping or the executors can
break that without a test failing.

>>> from relational_tensors.core.types import Box
>>> from relational_tensors.physical.tasks import TaskDAG
>>> dag = TaskDAG(2)
>>> a, b = dag.buffer(0, Box((0,), (4,)), "float32", 0), dag.buffer(1, Box((0,), (4,)), "float32", 0)
>>> c, d = dag.buffer(1, Box((0,), (4,)), "float32", 0), dag.buffer(0, Box((0,), (4,)), "float32", 0)
>>> _ = dag.add("copy", 1, (a,), (b,), src_device=0)
>>> _ = dag.add("copy", 0, (c,), (d,), src_device=1)
>>> [[(op.kind, op.peer) for op in ops] for ops in schedules(dag)]
[[('send', 1), ('recv', 1)], [('recv', 0), ('send', 0)]]
>>> [[len(group) for group in groups] for groups in grouped_schedules(dag)]
[[2], [2]]
>>> check_schedule(dag)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from relational_tensors.errors import ExchangeError
from relational_tensors.physical.tasks import Task, TaskDAG

__all__ = ["P2POp", "Group", "schedules", "grouped_schedules", "check_schedule", "check_groups", "is_transfer"]


@dataclass(frozen=True, slots=True)
class P2POp:
    """One transfer seen from one rank: ``task`` the copy task (also the message tag)."""

    task: int
    kind: str  # "send" or "recv"
    peer: int  # the other rank


Group = tuple[P2POp, ...]  # transfers of one rank posted together, in the rank's order


def is_transfer(task: Task) -> bool:
    """Whether ``task`` moves a block between two devices (a send on one rank, a receive on the other)."""
    return task.kind == "copy" and task.src_device is not None and task.src_device != task.device


def schedules(dag: TaskDAG, lo: int = 0, hi: int | None = None) -> list[list[P2POp]]:
    """Per rank (device), its sends and receives in the order it runs them (tasks ``lo`` to ``hi``)."""
    out: list[list[P2POp]] = [[] for _ in range(dag.p)]
    for task in dag.tasks[lo:hi]:
        if not is_transfer(task):
            continue
        assert task.src_device is not None  # a transfer has a source
        out[task.src_device].append(P2POp(task.id, "send", task.device))
        out[task.device].append(P2POp(task.id, "recv", task.src_device))
    return out


def _ranks_of(task: Task) -> tuple[int, ...]:
    """The ranks that issue ``task`` (both ends of a transfer; a load is issued by none)."""
    if task.kind == "load":
        return ()
    if is_transfer(task):
        assert task.src_device is not None
        return (task.src_device, task.device)
    return (task.device,)


def grouped_schedules(dag: TaskDAG, lo: int = 0, hi: int | None = None,
                      deps: Mapping[int, Iterable[int]] | None = None) -> list[list[Group]]:
    """Per rank, its transfers (tasks ``lo`` to ``hi``) cut into the groups it posts together.

    ``deps`` gives, per task, the earlier tasks it must follow (default: what wrote what it reads,
    ``TaskDAG.producers``; an executor whose memory is reused passes the reuse orderings too).  A
    transfer joins the rank's open group when no other task of the rank came since the group's first
    transfer, no phase boundary lies between them, and it depends on no member, even through tasks of
    other ranks; else it opens a new group."""
    hi = len(dag.tasks) if hi is None else hi
    deps = dag.producers() if deps is None else deps
    tasks = dag.tasks[lo:hi]
    # reach[i, r]: the latest transfer of rank r (a task id) that task lo + i depends on, -1 for none;
    # the transfers of a rank come in the DAG's order, so a task depends on a member of an open group
    # exactly when its entry for that rank is at least the group's first transfer
    reach = np.full((len(tasks), dag.p), -1, dtype=np.int64)
    upto = np.full((len(tasks), dag.p), -1, dtype=np.int64)  # reach, counting the task itself
    for i, task in enumerate(tasks):
        before = [d - lo for d in deps.get(task.id, ()) if lo <= d < task.id]
        if before:
            reach[i] = upto[before].max(axis=0)
        upto[i] = reach[i]
        if is_transfer(task):
            upto[i, list(_ranks_of(task))] = task.id
    split = dag.phase_split
    out: list[list[Group]] = [[] for _ in range(dag.p)]
    open_: list[list[P2POp]] = [[] for _ in range(dag.p)]

    def close(r: int) -> None:
        if open_[r]:
            out[r].append(tuple(open_[r]))
            open_[r] = []

    for i, task in enumerate(tasks):
        if not is_transfer(task):
            for r in _ranks_of(task):
                close(r)
            continue
        assert task.src_device is not None
        for r, op in ((task.src_device, P2POp(task.id, "send", task.device)),
                      (task.device, P2POp(task.id, "recv", task.src_device))):
            group = open_[r]
            if group and (reach[i, r] >= group[0].task or (split is not None and group[0].task < split <= task.id)):
                close(r)
            open_[r].append(op)
    for r in range(dag.p):
        close(r)
    return out


def check_schedule(dag: TaskDAG, lo: int = 0, hi: int | None = None,
                   groups: Sequence[Sequence[Group]] | None = None) -> None:
    """Refuse a grouped schedule of ``dag`` (default: :func:`grouped_schedules`) that could deadlock under
    rendezvous semantics, has an unmatched transfer, or pairs a rank's transfers out of order."""
    check_groups(grouped_schedules(dag, lo, hi) if groups is None else groups)


def _describe(op: P2POp) -> str:
    return f"copy task {op.task} ({op.kind} {'to' if op.kind == 'send' else 'from'} rank {op.peer})"


def check_groups(ranks: Sequence[Sequence[Group]]) -> None:
    """Check per-rank group sequences: partners, pairwise order, and that every group gets posted.

    >>> send, recv = P2POp(0, "send", 1), P2POp(0, "recv", 0)
    >>> check_groups([[(send,)], [(recv,)]])
    >>> back, back_in = P2POp(1, "send", 0), P2POp(1, "recv", 1)
    >>> check_groups([[(back_in,), (send,)], [(back,), (recv,)]])  # each rank first receives, then sends
    >>> try:  # rank 1 sends first: both ranks wait to send
    ...     check_groups([[(send,), (back_in,)], [(back,), (recv,)]])
    ... except ExchangeError as e:
    ...     print(str(e).split(": ", 1)[1].split(" wait")[0])
    rank 0 at copy task 0 (send to rank 1) in a group of 1, rank 1 at copy task 1 (send to rank 0) in a group of 1
    """
    p = len(ranks)
    where: list[dict[int, int]] = [{} for _ in range(p)]  # rank -> copy task -> index of its group there
    ops: list[dict[int, P2POp]] = [{} for _ in range(p)]
    order: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> tasks as the sender posts them
    heard: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> tasks as the receiver posts them
    for r, groups in enumerate(ranks):
        for g, group in enumerate(groups):
            if not group:
                raise ExchangeError(f"rank {r} has an empty group of transfers (group {g}); a group holds at "
                                    "least one send or receive.")
            for op in group:
                if op.task in ops[r]:
                    raise ExchangeError(f"rank {r} posts copy task {op.task} twice; every transfer is one "
                                        "send and one receive.")
                if op.kind not in ("send", "recv") or not 0 <= op.peer < p or op.peer == r:
                    raise ExchangeError(f"rank {r}: a transfer is a send or a receive with another of the {p} "
                                        f"ranks; got {op}.")
                ops[r][op.task], where[r][op.task] = op, g
                pair = (r, op.peer) if op.kind == "send" else (op.peer, r)
                (order if op.kind == "send" else heard).setdefault(pair, []).append(op.task)
    lonely = sorted(op.task for r in range(p) for op in ops[r].values()
                    if ops[op.peer].get(op.task) != P2POp(op.task, "recv" if op.kind == "send" else "send", r))
    if lonely:
        raise ExchangeError(f"the point-to-point schedule has transfers without a partner (copy tasks {lonely[:3]}): "
                            "every send needs its receive.")
    for pair in sorted(order):
        if order[pair] != heard[pair]:
            k = next(k for k, (a, b) in enumerate(zip(order[pair], heard[pair])) if a != b)
            raise ExchangeError(f"rank {pair[0]} sends to rank {pair[1]} in another order than rank {pair[1]} receives "
                                f"(transfer {k} between them: copy task {order[pair][k]} sent, {heard[pair][k]} "
                                "expected); a transport without tags pairs them in the order posted, so both ranks "
                                "must post them in the DAG's order.")
    pos = [0] * p
    left = [len(groups[0]) if groups else 0 for groups in ranks]  # operations of the posted group not done
    done: set[int] = set()
    finished: list[int] = []  # ranks whose posted group has just completed

    def post(r: int) -> None:
        """Rank ``r`` has posted its group ``pos[r]``: pair each of its operations whose partner is posted."""
        for op in ranks[r][pos[r]]:
            q = op.peer
            if op.task in done or pos[q] >= len(ranks[q]) or pos[q] != where[q][op.task]:
                continue
            done.add(op.task)
            left[r] -= 1
            left[q] -= 1
            if left[q] == 0 and q != r:
                finished.append(q)
        if left[r] == 0:
            finished.append(r)

    for r in range(p):
        if ranks[r]:
            post(r)
    while finished:
        r = finished.pop()
        if pos[r] >= len(ranks[r]) or left[r]:
            continue
        pos[r] += 1
        if pos[r] < len(ranks[r]):
            left[r] = len(ranks[r][pos[r]])
            post(r)
    stuck = [r for r in range(p) if pos[r] < len(ranks[r])]
    if stuck:
        at = ", ".join(f"rank {r} at {_describe(next(op for op in ranks[r][pos[r]] if op.task not in done))} in a "
                       f"group of {len(ranks[r][pos[r]])}" for r in stuck[:4])
        raise ExchangeError(f"the point-to-point schedule can deadlock: {at} wait for each other. The ranks' "
                            "transfers must follow one order; report this with the plan (rt.save_plan).")

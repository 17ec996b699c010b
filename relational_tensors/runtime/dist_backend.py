"""The distributed executor: one process per device, transfers over ``torch.distributed``.

Rank ``r`` of the process group runs the tasks of device ``r`` in the DAG's order with the NumPy kernels
(a CPU rank, gloo).  A copy task between two devices is a send on the source's rank and a receive on the
destination's (tagged with the copy task's id, so a receive can only match its own send).  A rank's
transfers are cut into groups at construction (``physical.p2p.grouped_schedules``: transfers met one
after the other, none depending on another), and each group is posted as one
``torch.distributed.batch_isend_irecv`` when the rank reaches its last transfer: sends do not wait,
receives do, and the ranks' groups are proven free of deadlock for each plan before it runs
(``physical.p2p.check_schedule``).  Bytes travel as ``uint8`` tensors shared with the NumPy arrays (no
copy on either side); the receiver knows each block's shape and dtype from the plan.  Peers are named
by their rank in the process group (``group_peer``), so a plan runs the same in the default group and
in a user's subgroup.  An input a rank holds no block of need not be fed to it; an output or a state is
assembled on every rank (or on one) by broadcasting each block from its owner.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import ExecError
from relational_tensors.physical.p2p import Group, grouped_schedules, is_transfer
from relational_tensors.physical.tasks import Liveness, TaskDAG
from relational_tensors.runtime.numpy_backend import NumpyExecutor

__all__ = ["DistExecutor", "Ranks", "buffer_parts", "move_block", "first_line"]


def first_line(e: BaseException) -> str:
    """An exception's first line (torch.distributed's errors run to many)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def buffer_parts(b: Any, raw16: bool = False) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The arrays a buffer's value is: its block, and for an lse partial its float32 row per output row
    (``raw16``: bfloat16 as its uint16 bit patterns, as the GPU holds it)."""
    dtype = np.dtype(np.uint16) if raw16 and b.dtype == "bfloat16" else numpy_dtype(b.dtype)
    parts = [(b.box.shape, dtype)]
    if b.partial == "lse":
        parts.append((b.box.shape[:-1], np.dtype(np.float32)))
    return parts


def move_block(ex: Any, data: Any, owner: int, rank: int | None, what: str) -> None:
    """One block of an output or state from the rank that owns it to every rank (``rank`` None: a
    broadcast) or to ``rank`` only; ``data`` is the owner's bytes, or the bytes the others receive into."""
    try:
        if rank is None:
            ex.dist.broadcast(data, ex._global(owner), group=ex.group)
        elif owner != rank and ex.rank in (owner, rank):
            if ex.rank == owner:
                ex.dist.send(data, ex._global(rank), group=ex.group)
            else:
                ex.dist.recv(data, ex._global(owner), group=ex.group)
    except Exception as e:
        raise ExecError(f"rank {ex.rank}: gathering {what} from rank {owner} failed: {first_line(e)}.") from None


def _bytes_of(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _tag(task: Any, k: int) -> int:
    """The message tag of part ``k`` of copy task ``task`` (an lse partial is two messages)."""
    return 2 * task.id + k


class Ranks:
    """What both kinds of ranks share: which tasks are this rank's, ranks of the group as global ranks, and
    posting a group of transfers (``dist``, ``group`` and ``rank`` are set by the executor)."""

    dist: Any
    group: Any
    rank: int
    sends: list[tuple[Any, Any, Any]]  # (work, the bytes it sends, its copy task) until the run ends

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def _mine(self, task: Any) -> bool:
        if is_transfer(task):
            return self.rank in (task.src_device, task.device)
        return bool(task.device == self.rank)

    def _groups(self, groups: list[Group]) -> None:
        """Keep this rank's groups of transfers: each is posted when the rank reaches its last one."""
        self.groups = groups
        self.posts = {group[-1].task: g for g, group in enumerate(groups)}

    def _failed(self, task: Any, send: bool, e: BaseException) -> ExecError:
        peer = task.device if send else task.src_device
        verb = "send to" if send else "receive from"
        return ExecError(f"rank {self.rank}: the {verb} rank {peer} of copy task {task.id} ({task.label}) failed: "
                         f"{first_line(e)}. Every rank must run the same program; see the other ranks' errors.")

    def _post(self, parts: list[tuple[Any, bool, int, Any]]) -> list[Any]:
        """Post one group: ``parts`` are (copy task, whether this rank sends, part index, bytes), peers named
        by their rank in the group.  Returns one work per part, or fewer where the backend fuses the group
        (NCCL: one work for all of them)."""
        dist = self.dist
        ops = [dist.P2POp(dist.isend if send else dist.irecv, data, group=self.group, tag=_tag(task, k),
                          group_peer=task.device if send else task.src_device) for task, send, k, data in parts]
        try:
            return list(dist.batch_isend_irecv(ops)) if ops else []
        except Exception as e:  # a rank that died, a broken connection
            task, send, _, _ = parts[0]
            raise self._failed(task, send, e) from None

    def _wait(self, parts: list[tuple[Any, bool, int, Any]], works: list[Any]) -> None:
        """Wait for a posted group's receives (its sends are kept, with their bytes, until the run ends)."""
        if len(works) != len(parts):  # one work for the whole group
            for work in works:
                try:
                    work.wait()
                except Exception as e:
                    raise self._failed(parts[0][0], parts[0][1], e) from None
            return
        for (task, send, _, data), work in zip(parts, works):
            if send:
                self.sends.append((work, data, task))
                continue
            try:
                work.wait()
            except Exception as e:  # a rank that died, a timeout, a broken connection
                raise self._failed(task, False, e) from None

    def _finish_sends(self) -> None:
        """Wait for every send of the run (their bytes stay referenced until then)."""
        sends, self.sends = self.sends, []
        for work, _, task in sends:
            try:
                work.wait()
            except Exception as e:
                raise ExecError(f"rank {self.rank}: the send to rank {task.device} of copy task {task.id} "
                                f"({task.label}) did not complete: {first_line(e)}. Every rank must run the "
                                "same program; see the other ranks' errors.") from None

    owns_group = False  # set when device='dist' initialized the default group itself (from torchrun's environment)

    def close(self) -> None:
        """Wait until every rank is here, then tear down the process group if this run initialized it (a
        user's group is left alone).  A process that exits with gloo's threads still up can abort at the
        interpreter's exit, after its results are out; a group torn down on every rank cannot."""
        if not self.dist.is_initialized():
            return
        self.dist.barrier(group=self.group)
        if self.owns_group:
            self.dist.destroy_process_group()


class DistExecutor(Ranks, NumpyExecutor):
    """Runs this rank's share of a TaskDAG; ``load``, ``execute``, ``offload`` are called on every rank."""

    def __init__(self, dag: TaskDAG, live: Liveness, group: Any = None,
                 timeout: float | None = None) -> None:
        import torch.distributed as dist

        super().__init__(dag, live)
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != dag.p:
            raise ExecError(f"the plan is for {dag.p} devices but the process group has {self.world} ranks; plan "
                            "with device='dist' inside the launch (one rank per device).")
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.sends = []
        self._groups(grouped_schedules(dag)[self.rank])

    # --- this rank's tasks, its transfers posted group by group ----------------------------------
    def _execute(self, lo: int, hi: int) -> None:
        self.staged: list[Any] = []  # the transfers of the group being gathered
        try:
            super()._execute(lo, hi)
        finally:
            self._finish_sends()

    def _step(self, task: Any, keep: Any) -> None:
        if not is_transfer(task):
            super()._step(task, keep)
            return
        self.staged.append(task)
        if task.id in self.posts:  # the group's last transfer: post the group (its blocks are put, and
            keep(self._exchange(self.staged), self.staged)  # what its transfers read last freed, once done)
            self.staged = []

    def _exchange(self, tasks: list[Any]) -> list[tuple[int, Any]]:
        """Post one group of transfers and wait for its receives: the blocks received, by buffer."""
        import torch

        parts: list[tuple[Any, bool, int, Any]] = []
        arrays: dict[int, list[np.ndarray]] = {}
        for task in tasks:
            if task.src_device == self.rank:
                value = self._get(task.inputs[0])
                for k, part in enumerate(value if isinstance(value, tuple) else (value,)):
                    parts.append((task, True, k, _bytes_of(part)))
                continue
            for k, (shape, dtype) in enumerate(buffer_parts(self.dag.buffers[task.outputs[0]])):
                data = torch.empty(int(np.prod(shape)) * dtype.itemsize, dtype=torch.uint8)
                parts.append((task, False, k, data))
                arrays.setdefault(task.id, []).append(data.numpy().view(dtype).reshape(shape))
        self._wait(parts, self._post(parts))
        return [(task.outputs[0], tuple(arrays[task.id]) if len(arrays[task.id]) > 1 else arrays[task.id][0])
                for task in tasks if task.id in arrays]

    # --- inputs and results ----------------------------------------------------------------------
    def _holds(self, buf: int) -> bool:
        return self.dag.buffers[buf].device == self.rank

    def _assemble(self, name: str, node: Any, blocks: list[tuple[Any, int]], rank: int | None) -> np.ndarray | None:
        """The tensor ``name`` (of graph node ``node``) from its blocks, broadcast from each block's rank to
        every rank, or sent to ``rank`` only (the others get None)."""
        import torch

        out = np.empty(node.type.shape, dtype=numpy_dtype(node.type.dtype))
        seen: set[Any] = set()
        for box, buf in blocks:
            if box in seen:  # a replicated block: one copy is enough
                continue
            seen.add(box)
            owner = self.dag.buffers[buf].device
            shape, dtype = buffer_parts(self.dag.buffers[buf])[0]
            if owner == self.rank:
                value = self._get(buf)
                data = _bytes_of(np.asarray(value[0] if isinstance(value, tuple) else value, dtype=dtype))
            else:
                data = torch.empty(int(np.prod(shape)) * dtype.itemsize, dtype=torch.uint8)
            move_block(self, data, owner, rank, f"block {box} of {name!r}")
            if rank is None or self.rank == rank:
                out[box.slices()] = data.numpy().view(dtype).reshape(shape)
        return out if rank is None or self.rank == rank else None

    def offload(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        """The saved tensor ``name`` on every rank (collective: every rank calls it), or on ``rank`` only."""
        self._check_offload(name)
        return self._assemble(name, self.dag.saved_node(name), self.dag.outputs[name], rank)

    def state(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        """The current value of a state, from the blocks the ranks keep (collective, like ``offload``)."""
        if name not in self.resident:
            raise ExecError(f"state {name!r} has no value yet; load it first: cg.load({{{name!r}: array}}).")
        return self._assemble(name, self.dag.node(name), self.dag.inputs[name], rank)

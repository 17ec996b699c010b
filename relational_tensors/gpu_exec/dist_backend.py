"""The distributed executor: one process per device, transfers over ``torch.distributed``.

Rank ``r`` of the process group runs the tasks of device ``r`` in the DAG's order with the NumPy kernels
(a CPU rank, gloo).  A copy task between two devices is a send on the source's rank and a receive on the
destination's (tagged with the copy task's id, so a receive can only match its own send); sends do not
wait, receives do, and because every rank meets its transfers in the one order of the DAG, no two ranks
can wait on each other (``physical.p2p.check_schedule`` proves it for each plan before it runs).  Bytes
travel as ``uint8`` tensors shared with the NumPy arrays (no copy on either side); the receiver knows
each block's shape and dtype from the plan.  An input a rank holds no block of need not be fed to it;
an output or a state is assembled on every rank (or on one) by broadcasting each block from its owner.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import ExecError
from relational_tensors.frontend.graph import Graph
from relational_tensors.gpu_exec.numpy_backend import NumpyExecutor
from relational_tensors.physical.tasks import Liveness, TaskDAG

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


class Ranks:
    """What both kinds of ranks share: which tasks are this rank's, and ranks of the group as global ranks
    (``dist``, ``group`` and ``rank`` are set by the executor)."""

    dist: Any
    group: Any
    rank: int

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def _mine(self, task: Any) -> bool:
        if task.kind == "copy" and task.src_device is not None and task.src_device != task.device:
            return self.rank in (task.src_device, task.device)
        return bool(task.device == self.rank)

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

    def __init__(self, graph: Graph, dag: TaskDAG, live: Liveness, group: Any = None,
                 timeout: float | None = None) -> None:
        import torch.distributed as dist

        super().__init__(graph, dag, live)
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != dag.p:
            raise ExecError(f"the plan is for {dag.p} devices but the process group has {self.world} ranks; plan "
                            "with device='dist' inside the launch (one rank per device).")
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.sends: list[tuple[Any, Any, Any]] = []  # (work, the bytes it sends, its copy task) until done

    # --- which tasks are this rank's -------------------------------------------------------------
    def _outputs(self, task: Any) -> list[Any]:
        if task.kind != "copy" or task.src_device is None or task.src_device == task.device:
            return super()._outputs(task)
        if task.src_device == self.rank:
            value = self._get(task.inputs[0])
            for k, part in enumerate(value if isinstance(value, tuple) else (value,)):
                data = _bytes_of(part)
                self.sends.append((self._p2p("isend", data, task.device, task, k), data, task))
            return []  # the block is the destination's
        return [self._receive(task.outputs[0], task.src_device, task)]

    def _receive(self, buf: int, src: int, task: Any) -> Any:
        import torch

        parts = []
        for k, (shape, dtype) in enumerate(buffer_parts(self.dag.buffers[buf])):
            data = torch.empty(int(np.prod(shape)) * dtype.itemsize, dtype=torch.uint8)
            self._p2p("recv", data, src, task, k)
            parts.append(data.numpy().view(dtype).reshape(shape))
        return tuple(parts) if len(parts) > 1 else parts[0]

    def _p2p(self, how: str, data: Any, peer: int, task: Any, k: int) -> Any:
        tag = 2 * task.id + k  # an lse partial is two messages
        try:
            if how == "isend":
                return self.dist.isend(data, self._global(peer), group=self.group, tag=tag)
            self.dist.recv(data, self._global(peer), group=self.group, tag=tag)
            return None
        except Exception as e:  # a rank that died, a timeout, a broken connection
            verb = "send to" if how == "isend" else "receive from"
            raise ExecError(f"rank {self.rank}: the {verb} rank {peer} of copy task {task.id} ({task.label}) "
                            f"failed: {first_line(e)}. Every rank must run the same program; see the other "
                            "ranks' errors.") from None

    def _execute(self, lo: int, hi: int) -> None:
        try:
            super()._execute(lo, hi)
        finally:
            sends, self.sends = self.sends, []
            for work, _, task in sends:
                try:
                    work.wait()
                except Exception as e:
                    raise ExecError(f"rank {self.rank}: the send to rank {task.device} of copy task {task.id} "
                                    f"({task.label}) did not complete: {first_line(e)}. Every rank must run the "
                                    "same program; see the other ranks' errors.") from None

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
        return self._assemble(name, self.graph.nodes[self.graph.outputs[name]], self.dag.outputs[name], rank)

    def state(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        """The current value of a state, from the blocks the ranks keep (collective, like ``offload``)."""
        if name not in self.resident:
            raise ExecError(f"state {name!r} has no value yet; load it first: cg.load({{{name!r}: array}}).")
        return self._assemble(name, self.graph.node(name), self.dag.inputs[name], rank)

"""GPU ranks of the distributed executor: one process per device, CuPy/Triton kernels on its GPU.

Rank ``r`` holds only logical device ``r``'s arena and issues only its tasks, on its GPU (the CuPy
executor with every other device left out).  Two streams: the *compute* stream runs the rank's kernels
in the DAG's order; the *communication* stream runs its transfers, group by group
(``physical.p2p.grouped_schedules``, over the orderings the memory plan adds: a block written where
another lived waits for that one's last readers), each group one ``batch_isend_irecv``.  CUDA events
order the two streams, with no host synchronization per transfer: a group waits for the event of the
latest compute task any of its transfers depends on (a send's block is made, a receive's memory is
free), and a compute task waits for the event of the latest group it depends on (its block arrived, or
a send read the memory it overwrites), so compute of independent tasks proceeds while transfers are in
flight.  Every rank computes every rank's groups from the same plan and checks them
(``physical.p2p.check_groups``) before anything runs.

* ``transport="nccl"`` sends the device blocks themselves with NCCL point-to-point, one GPU per rank:
  a contiguous block is sent from (received into) its place in the arena, a strided view through a
  staging buffer packed (unpacked) on the communication stream; NCCL's own stream is ordered after the
  communication stream at each group and the communication stream after it (``Work.wait`` on the
  GPU).  The process group needs NCCL for CUDA tensors (``device="dist"`` initializes
  ``"cpu:gloo,cuda:nccl"``); results are gathered on the host over its CPU backend where it has one,
  else through the GPU.
* ``transport="gloo"`` stages each group through the host (its sends copied down once the blocks are
  made, sent over gloo, the receives uploaded on the communication stream), so several ranks may share
  one GPU: the whole multi-process GPU path runs on a one-GPU machine.  It runs eagerly.

CUDA graphs (``capture``; default: the environment variable ``RELATIONAL_TENSORS_NCCL_GRAPHS=1``): with
NCCL, the second ``execute()`` captures the whole program, transfers included, and later runs launch
the graph.  Off unless asked for, because the conditions are the environment's to meet:

* NCCL 2.9 or later and CUDA 11.3 or later (NCCL's graph support), and a torch whose NCCL process group
  can capture ``batch_isend_irecv`` (its watchdog skips work enqueued while a stream captures);
* one GPU per process (NCCL warns that several GPUs per process may deadlock in graph launches);
* capture is a collective property: both ends of every transfer capture it, and every rank launches
  the graph it captured; here every rank votes, and if one cannot capture, none does (each raises an
  ExecError and runs eagerly from then on);
* the first run is eager, so NCCL has connected every pair of peers before the capture (capturing
  transfers to a peer never used before needs NCCL's connection setup inside the capture), and the
  capture is in relaxed mode;
* inside a launched graph no watchdog runs: a rank that dies or stalls leaves the others waiting
  (``timeout=`` does not apply).

Outputs and states are assembled from every rank's blocks (collective, like the CPU ranks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import ExecError
from relational_tensors.kernels import triton_copy as tc
from relational_tensors.kernels.common import DevBuf
from relational_tensors.machine.devices import DeviceSet
from relational_tensors.physical.p2p import is_transfer
from relational_tensors.physical.tasks import Liveness, TaskDAG
from relational_tensors.runtime.cupy_backend import CupyExecutor
from relational_tensors.runtime.dist_backend import Ranks, buffer_parts, first_line, move_block
from relational_tensors.runtime.dist_streams import stream_schedule
from relational_tensors.runtime.memory_plan import ALIGN
from relational_tensors.runtime.memory_plan import align as _align

__all__ = ["DistCupyExecutor", "TRANSPORTS", "CAPTURE_ENV"]

TRANSPORTS = ("nccl", "gloo")
CAPTURE_ENV = "RELATIONAL_TENSORS_NCCL_GRAPHS"  # "1": capture the NCCL program into a CUDA graph
NCCL_GRAPHS_SINCE = (2, 9)  # the first NCCL release whose operations CUDA graphs can capture


@dataclass
class _Part:
    """One message of a transfer as this rank posts it."""

    task: Any
    send: bool
    k: int                # which part of the block (an lse partial is two)
    view: DevBuf          # where the bytes are in the arena
    stage: DevBuf | None  # a contiguous copy of a strided view (NCCL)
    data: Any = None      # NCCL: the torch bytes over view or stage, made once


@dataclass
class _Posting:
    """One group of this rank's transfers: its messages, the latest compute task it waits for, its event."""

    parts: list[_Part]
    after: int | None
    event: Any = None
    tasks: list[Any] = field(default_factory=list)


class DistCupyExecutor(Ranks, CupyExecutor):
    """This rank's share of a TaskDAG on its GPU; ``load``, ``execute``, ``offload`` on every rank."""

    def __init__(self, dag: TaskDAG, live: Liveness, devices: DeviceSet, group: Any,
                 transport: str = "nccl", attention: str = "triton", capture: bool | None = None) -> None:
        import torch.distributed as dist

        if transport not in TRANSPORTS:
            raise ExecError(f"transport is one of {TRANSPORTS}; got {transport!r}.")
        self.dist, self.group, self.transport = dist, group, transport
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world != dag.p:
            raise ExecError(f"the plan is for {dag.p} devices but the process group has {self.world} ranks.")
        backend = str(dist.get_backend(group))
        if transport == "nccl" and "nccl" not in backend:
            raise ExecError(f"transport='nccl' sends device blocks with NCCL, but the process group's backend is "
                            f"{backend!r}; initialize it with 'cpu:gloo,cuda:nccl' (device='dist' does when it "
                            "initializes the group), or give transport='gloo'.")
        if transport == "gloo" and "gloo" not in backend:
            raise ExecError(f"transport='gloo' stages transfers through the host over gloo, but the process group's "
                            f"backend is {backend!r}; give transport='nccl', or a group with a gloo backend.")
        self.host_moves = "gloo" in backend  # results gathered as host tensors (else through the GPU)
        self.gpu = devices.physical[self.rank]
        self.sends = []
        if transport == "nccl":
            import torch

            torch.cuda.set_device(self.gpu)
            # every rank's first NCCL call on the group is this collective: torch leaves a batch of
            # transfers between some of the ranks undefined when it is the group's first NCCL call
            dist.all_reduce(torch.zeros(1, device=f"cuda:{self.gpu}"), group=group)
        # the forward-written lse is left out: the two-stream schedule (dist_streams) orders tasks by the
        # buffers they name, and the forward's extra write is not among them
        super().__init__(dag, live, devices, attention, siblings=False)
        cp = self.cp
        with cp.cuda.Device(self.gpu):
            self.compute = self.streams[self.rank]
            self.comm = cp.cuda.Stream(non_blocking=True)
            # another rank's device is reached through the transfers: its stream is the communication
            # stream, so the base executor's barriers, capture fork and join cover both streams
            self.streams = [self.compute if d == self.rank else self.comm for d in range(dag.p)]
            self.compute_events = {t: cp.cuda.Event(block=False, disable_timing=True)
                                   for t in {p.after for p in self.postings if p.after is not None}}
            for posting in self.postings:
                posting.event = cp.cuda.Event(block=False, disable_timing=True)
        if transport == "nccl":
            self._nccl_buffers()
        self.capturable = self.capturable and transport == "nccl" and self._agree(_capture_wanted(capture))

    def _keeps(self, device: int) -> bool:
        return device == self.rank

    # --- the two streams and the groups of transfers ----------------------------------------------
    def _dependencies(self) -> None:
        """This rank's groups of transfers and the events between its two streams."""
        dag = self.dag
        sched = stream_schedule(dag, self.plan, self.rank)
        self._groups(sched.groups)
        self.after_group = sched.waits  # compute task -> the latest group it waits for
        self.postings: list[_Posting] = []
        for group, after in zip(sched.groups, sched.after):
            tasks = [dag.tasks[op.task] for op in group]
            parts = []
            for t in tasks:
                send = t.src_device == self.rank
                buf = t.inputs[0] if send else t.outputs[0]
                view = self.views[buf]
                views = view if isinstance(view, tuple) else (view,)
                if len(views) != len(buffer_parts(dag.buffers[buf])):
                    raise ExecError(f"copy task {t.id} ({t.label}): buffer {buf} has {len(views)} parts on the GPU "
                                    f"but {len(buffer_parts(dag.buffers[buf]))} messages; report this with the "
                                    "plan (rt.save_plan).")
                parts += [_Part(t, send, k, v, None) for k, v in enumerate(views)]
            self.postings.append(_Posting(parts, after, tasks=tasks))
        self.waits, self.events = {}, {}  # the base executor's cross-stream waits: replaced by the above

    def _nccl_buffers(self) -> None:
        """Torch tensors over every message's bytes, made once (a graph replays the same addresses): the
        block's place in the arena, or a staging buffer for a strided view, one staging area reused by
        every group (the communication stream runs them one after the other)."""
        import torch

        cp = self.cp
        need = max((sum(_align(p.view.nbytes) for p in posting.parts if not p.view.is_contiguous)
                    for posting in self.postings), default=0)
        with cp.cuda.Device(self.gpu):
            self.staging = cp.empty(max(need, ALIGN), dtype=cp.uint8)
        for posting in self.postings:
            offset = 0
            for part in posting.parts:
                where = part.view
                if not part.view.is_contiguous:
                    part.stage = DevBuf(self.staging.data.ptr + offset, part.view.shape, part.view.dtype, self.gpu)
                    offset += _align(part.view.nbytes)
                    where = part.stage
                with cp.cuda.Device(self.gpu):
                    part.data = torch.from_dlpack(where.cupy().reshape(-1).view(cp.uint8))
        self.torch_comm = torch.cuda.ExternalStream(self.comm.ptr, device=torch.device("cuda", self.gpu))

    def _agree(self, wanted: bool) -> bool:
        """Whether every rank captures (capture is collective: both ends of a transfer must)."""
        votes: list[Any] = [None] * self.world
        self.dist.all_gather_object(votes, bool(wanted and self.capturable), group=self.group)
        return all(votes)

    # --- execution -------------------------------------------------------------------------------
    def _issue_all(self, marks: dict[int, tuple[Any, Any]] | None = None, capturing: bool = False,
                   lo: int = 0, hi: int | None = None) -> None:
        """Issue this rank's tasks: kernels on the compute stream, each group of transfers on the
        communication stream when the rank reaches its last transfer, events between the two."""
        cp = self.cp
        with cp.cuda.Device(self.gpu):
            for t in self.dag.tasks[lo:hi]:
                if t.kind == "load" or not self._mine(t):
                    continue
                if is_transfer(t):
                    g = self.posts.get(t.id)
                    if g is not None:
                        self._post_group(self.postings[g], marks)
                        if capturing and not self._still_capturing(self.comm):
                            raise ExecError(f"the transfers of copy task {t.id} ({t.label}) invalidated the capture "
                                            "of the program into a CUDA graph; it runs eagerly from now on.")
                    continue
                if t.id in self.after_group:
                    self.compute.wait_event(self.postings[self.after_group[t.id]].event)
                with self.compute:
                    if marks is not None:
                        marks[t.id] = (cp.cuda.Event(), cp.cuda.Event())
                        marks[t.id][0].record(self.compute)
                    try:
                        self._run(t, self.compute)
                    except ExecError:
                        raise
                    except Exception as e:  # a CUDA, cuBLAS or Triton error: name the task
                        raise ExecError(f"rank {self.rank}: task {t.id} ({t.label}, {t.kind}) on GPU {self.gpu} "
                                        f"failed: {type(e).__name__}: {e}") from e
                    if capturing and not self._still_capturing(self.compute):
                        raise ExecError(f"task {t.id} ({t.label}, {t.kind}) invalidated the capture of the program "
                                        "into a CUDA graph; it runs eagerly from now on.")
                    if marks is not None:
                        marks[t.id][1].record(self.compute)
                if t.id in self.compute_events:
                    self.compute_events[t.id].record(self.compute)

    def _post_group(self, posting: _Posting, marks: dict[int, tuple[Any, Any]] | None) -> None:
        cp = self.cp
        if marks is not None:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.comm)
        if self.transport == "nccl":
            self._post_nccl(posting)
        else:
            self._post_host(posting)
        if marks is not None:
            end.record(self.comm)
            for t in posting.tasks:
                marks[t.id] = (start, end)
        posting.event.record(self.comm)

    def _post_nccl(self, posting: _Posting) -> None:
        """One group on the communication stream: after the compute it needs, pack, NCCL, unpack; the
        host does not wait."""
        torch = self._torch()
        with self.comm:
            if posting.after is not None:
                self.comm.wait_event(self.compute_events[posting.after])
            for part in posting.parts:
                if part.send and part.stage is not None:
                    tc.copy_box(part.view, part.stage)
            parts = [(part.task, part.send, part.k, part.data) for part in posting.parts]
            with torch.cuda.stream(self.torch_comm):
                works = self._post(parts)
                for work in works:  # the communication stream waits for NCCL's: no host wait
                    try:
                        work.wait()
                    except Exception as e:
                        raise self._failed(parts[0][0], parts[0][1], e) from None
            for part in posting.parts:
                if not part.send and part.stage is not None:
                    tc.copy_box(part.stage, part.view)

    def _post_host(self, posting: _Posting) -> None:
        """One group staged through the host (gloo): the sends' blocks copied down once made, the group
        posted, its receives waited for and uploaded on the communication stream."""
        torch = self._torch()
        cp = self.cp
        if posting.after is not None:
            self.compute_events[posting.after].synchronize()
        self.comm.synchronize()  # a block an earlier group received (and this one sends on) is uploaded
        parts: list[tuple[Any, bool, int, Any]] = []
        arrived: list[tuple[_Part, Any]] = []
        with self.comm:
            for part in posting.parts:
                if part.send:
                    host = np.ascontiguousarray(cp.asnumpy(part.view.cupy(), stream=self.comm))
                    data = torch.from_numpy(host.reshape(-1).view(np.uint8))
                else:
                    data = torch.empty(part.view.nbytes, dtype=torch.uint8)
                    arrived.append((part, data))
                parts.append((part.task, part.send, part.k, data))
            self._wait(parts, self._post(parts))
            for part, data in arrived:
                dtype = part.view.cupy().dtype
                part.view.cupy()[...] = cp.asarray(data.numpy().view(dtype).reshape(part.view.shape))

    def _torch(self) -> Any:
        import torch

        return torch

    def _capture(self, lo: int = 0, hi: int | None = None) -> Any:
        """Capture on every rank, or on none: a rank that cannot makes every rank refuse the graph."""
        error, graph = None, None
        try:
            graph = super()._capture(lo, hi)
        except ExecError as e:
            error = first_line(e)
        votes: list[Any] = [None] * self.world
        self.dist.all_gather_object(votes, error, group=self.group)
        failed = [(r, v) for r, v in enumerate(votes) if v is not None]
        if failed:
            self.graph_exec = None
            r, why = failed[0]
            raise ExecError(f"rank {self.rank}: capturing the program into a CUDA graph failed on rank {r} ({why}); "
                            "every rank runs it eagerly from now on: call execute() again.")
        return graph

    def execute(self, phase: int | None = None) -> None:
        try:
            super().execute(phase)
        finally:
            self._finish_sends()  # gloo: the host copies of the sends (NCCL's are waited for on the GPU)

    # --- inputs and results ----------------------------------------------------------------------
    def load(self, feeds: Mapping[str, Any], partial: bool = False, owned: bool = False) -> None:
        """Keep this rank's blocks of the inputs given; an input it holds none of need not be given."""
        mine = {name for name, blocks in self.dag.inputs.items()
                if any(self.dag.buffers[b].device == self.rank for _, b in blocks)}
        self.resident.update(n for n in self.dag.inputs if n not in mine)
        super().load(feeds, partial, owned)

    def _gather(self, name: str, t: Any, blocks: list[tuple[Any, int]], rank: int | None) -> np.ndarray | None:
        torch = self._torch()
        cp = self.cp
        self.synchronize()
        dtype = np.dtype(np.uint16) if t.dtype == "bfloat16" else numpy_dtype(t.dtype)
        out = np.empty(t.shape, dtype=dtype)
        seen: set[Any] = set()
        device = "cpu" if self.host_moves else f"cuda:{self.gpu}"  # a group without a CPU backend: NCCL
        for box, b in blocks:
            if box in seen:
                continue
            seen.add(box)
            owner = self.dag.buffers[b].device
            if owner == self.rank:
                view = self.views[b]
                block = (view[0] if isinstance(view, tuple) else view).cupy()
                with cp.cuda.Device(self.gpu):
                    if self.host_moves:
                        data = torch.from_numpy(np.ascontiguousarray(cp.asnumpy(block)).reshape(-1).view(np.uint8))
                    else:
                        data = torch.from_dlpack(cp.ascontiguousarray(block).reshape(-1).view(cp.uint8)).clone()
            else:
                data = torch.empty(box.volume * dtype.itemsize, dtype=torch.uint8, device=device)
            move_block(self, data, owner, rank, f"block {box} of {name!r}")
            if rank is None or self.rank == rank:
                out[box.slices()] = data.cpu().numpy().view(dtype).reshape(box.shape)
        if rank is not None and self.rank != rank:
            return None
        return out.view(numpy_dtype("bfloat16")) if t.dtype == "bfloat16" else out

    def offload(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        self._check_offload(name)
        return self._gather(name, self.dag.saved_node(name).type, self.dag.outputs[name], rank)

    def state(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        if name not in self.resident:
            raise ExecError(f"state {name!r} has no value yet; load it first: cg.load({{{name!r}: array}}).")
        return self._gather(name, self.dag.node(name).type, self.dag.inputs[name], rank)


def _capture_wanted(capture: bool | None) -> bool:
    """Whether this rank may capture NCCL transfers into a CUDA graph: asked for (``capture``, else
    $RELATIONAL_TENSORS_NCCL_GRAPHS=1) and NCCL new enough."""
    if capture is None:
        capture = os.environ.get(CAPTURE_ENV, "") == "1"
    if not capture:
        return False
    try:
        import torch

        version = tuple(int(v) for v in torch.cuda.nccl.version()[:2])
    except Exception:  # noqa: BLE001 - a torch without NCCL: no capture
        return False
    return version >= NCCL_GRAPHS_SINCE

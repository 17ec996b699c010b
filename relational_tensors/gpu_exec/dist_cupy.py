"""GPU ranks of the distributed executor: one process per device, CuPy/Triton kernels on its GPU.

Rank ``r`` holds only logical device ``r``'s arena and issues only its tasks, on its GPU (the CuPy
executor with every other device left out).  A copy between devices is a transfer between ranks:

* ``transport="gloo"`` stages it through the host (the source's block copied down after its stream
  finished, sent over gloo, uploaded into the destination's block on its stream), so several ranks may
  share one GPU: the whole multi-process GPU path runs on a one-GPU machine;
* ``transport="nccl"`` sends the device block itself with NCCL point-to-point (buffers shared with torch
  through DLPack, no copy), one GPU per rank.

Transfers synchronize the rank's stream, so a distributed GPU program runs eagerly (no CUDA graph).
Outputs and states are assembled on the host, from every rank's blocks (collective, like the CPU ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import ExecError
from relational_tensors.frontend.graph import Graph
from relational_tensors.gpu_exec.cupy_backend import CupyExecutor
from relational_tensors.gpu_exec.dist_backend import Ranks, buffer_parts, first_line, move_block
from relational_tensors.physical.tasks import Liveness, TaskDAG
from relational_tensors.target.devices import DeviceSet

__all__ = ["DistCupyExecutor", "TRANSPORTS"]

TRANSPORTS = ("nccl", "gloo")


class DistCupyExecutor(Ranks, CupyExecutor):
    """This rank's share of a TaskDAG on its GPU; ``load``, ``execute``, ``offload`` on every rank."""

    def __init__(self, graph: Graph, dag: TaskDAG, live: Liveness, devices: DeviceSet, group: Any,
                 transport: str = "nccl", attention: str = "triton") -> None:
        import torch.distributed as dist

        if transport not in TRANSPORTS:
            raise ExecError(f"transport is one of {TRANSPORTS}; got {transport!r}.")
        self.dist, self.group, self.transport = dist, group, transport
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world != dag.p:
            raise ExecError(f"the plan is for {dag.p} devices but the process group has {self.world} ranks.")
        self.sends: list[Any] = []  # (work, what it sends) until the run ends
        super().__init__(graph, dag, live, devices, attention)
        self.capturable = False  # every transfer waits for its stream: the program runs eagerly

    def _keeps(self, device: int) -> bool:
        return device == self.rank

    # --- transfers ---------------------------------------------------------------------------
    def _run(self, t: Any, stream: Any) -> None:
        if t.kind != "copy" or t.src_device is None or t.src_device == t.device:
            super()._run(t, stream)
            return
        import torch

        cp = self.cp
        src = t.src_device == self.rank
        buf = t.inputs[0] if src else t.outputs[0]
        view = self.views[buf] if buf in self.views else None
        views = (view if isinstance(view, tuple) else (view,)) if view is not None else ()
        peer = t.device if src else t.src_device
        for k, (shape, dtype) in enumerate(buffer_parts(self.dag.buffers[buf], raw16=True)):
            tag = 2 * t.id + k
            try:
                if self.transport == "nccl":
                    if src:
                        data = torch.from_dlpack(cp.ascontiguousarray(views[k].cupy()))
                        stream.synchronize()
                        self.sends.append((self.dist.isend(data, self._global(peer), self.group, tag), data))
                    else:
                        data = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, device="cuda")
                        stream.synchronize()
                        self.dist.recv(data, self._global(peer), self.group, tag)
                        views[k].cupy()[...] = cp.from_dlpack(data)
                elif src:
                    stream.synchronize()  # the block is made (the copy waited for its producer on this stream)
                    host = np.ascontiguousarray(cp.asnumpy(views[k].cupy(), stream=stream))
                    data = torch.from_numpy(host.reshape(-1).view(np.uint8))
                    self.sends.append((self.dist.isend(data, self._global(peer), self.group, tag), data))
                else:
                    data = torch.empty(int(np.prod(shape)) * dtype.itemsize, dtype=torch.uint8)
                    self.dist.recv(data, self._global(peer), self.group, tag)
                    views[k].cupy()[...] = cp.asarray(data.numpy().view(dtype).reshape(shape))
            except ExecError:
                raise
            except Exception as e:
                verb = "send to" if src else "receive from"
                raise ExecError(f"rank {self.rank}: the {verb} rank {peer} of copy task {t.id} ({t.label}) failed: "
                                f"{first_line(e)}. Every rank must run the same program; see the other ranks' "
                                "errors.") from None

    def execute(self, phase: int | None = None) -> None:
        try:
            super().execute(phase)
            self.synchronize()
        finally:
            sends, self.sends = self.sends, []
            for work, _ in sends:
                try:
                    work.wait()
                except Exception as e:
                    raise ExecError(f"rank {self.rank}: a send did not complete: {first_line(e)}.") from None

    # --- inputs and results ----------------------------------------------------------------------
    def load(self, feeds: Mapping[str, Any], partial: bool = False, owned: bool = False) -> None:
        """Keep this rank's blocks of the inputs given; an input it holds none of need not be given."""
        mine = {name for name, blocks in self.dag.inputs.items()
                if any(self.dag.buffers[b].device == self.rank for _, b in blocks)}
        self.resident.update(n for n in self.dag.inputs if n not in mine)
        super().load(feeds, partial, owned)

    def _gather(self, name: str, t: Any, blocks: list[tuple[Any, int]], rank: int | None) -> np.ndarray | None:
        import torch

        self.synchronize()
        dtype = np.dtype(np.uint16) if t.dtype == "bfloat16" else numpy_dtype(t.dtype)
        out = np.empty(t.shape, dtype=dtype)
        seen: set[Any] = set()
        for box, b in blocks:
            if box in seen:
                continue
            seen.add(box)
            owner = self.dag.buffers[b].device
            if owner == self.rank:
                view = self.views[b]
                host = np.ascontiguousarray(self.cp.asnumpy((view[0] if isinstance(view, tuple) else view).cupy()))
                data = torch.from_numpy(host.reshape(-1).view(np.uint8))
            else:
                data = torch.empty(box.volume * dtype.itemsize, dtype=torch.uint8)
            move_block(self, data, owner, rank, f"block {box} of {name!r}")
            if rank is None or self.rank == rank:
                out[box.slices()] = data.numpy().view(dtype).reshape(box.shape)
        if rank is not None and self.rank != rank:
            return None
        return out.view(numpy_dtype("bfloat16")) if t.dtype == "bfloat16" else out

    def offload(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        self._check_offload(name)
        return self._gather(name, self.graph.nodes[self.graph.outputs[name]].type, self.dag.outputs[name], rank)

    def state(self, name: str, rank: int | None = None) -> np.ndarray | None:  # type: ignore[override]
        if name not in self.resident:
            raise ExecError(f"state {name!r} has no value yet; load it first: cg.load({{{name!r}: array}}).")
        return self._gather(name, self.graph.node(name).type, self.dag.inputs[name], rank)

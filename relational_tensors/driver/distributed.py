"""One process per device: the same plan run by every rank of a ``torch.distributed`` process group.

``compileGraph(graph, device="dist")`` inside a ``torchrun`` launch (or any initialized process group)
plans for as many devices as the group has ranks: every rank checks that it holds the same graph
(equal fingerprints, else every rank refuses before anything runs), rank 0 plans, and the others load
its plan (``plan_file.dumps``, broadcast) instead of planning again; the point-to-point schedule is
checked (``physical.p2p``) and each rank gets an executor for its own device
(``runtime.dist_backend``).  ``cg.load``, ``cg.execute`` and ``cg.offload`` are then called on every
rank, in the same order.  CPU ranks use gloo.  Where no process group is initialized, the environment
``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) initializes one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import replace
from typing import Any

from relational_tensors.driver.compiled import CompiledGraph
from relational_tensors.driver.compiler import run
from relational_tensors.driver.options import CompileOptions
from relational_tensors.driver.plan_file import dumps, loads
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.graph.graph import Graph
from relational_tensors.runtime import Ranks

__all__ = ["compile_distributed", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0  # seconds a rank waits for a transfer before the run ends with an ExecError


def _group(process_group: Any, timeout: float, nccl_gpu: int | None = None) -> tuple[Any, Any, bool]:
    """torch.distributed, the process group to run in, and whether this call initialized it (the default
    group, from torchrun's environment, when none is: gloo, with NCCL for CUDA tensors on ``nccl_gpu``)."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ExecError("device='dist' runs one process per device with torch.distributed; install torch "
                        "(pip install 'relational_tensors[torch]') and launch with torchrun.") from None
    if process_group is not None:
        mesh = getattr(process_group, "get_group", None)  # a DeviceMesh: its one-dimensional group
        if not callable(mesh) and not isinstance(process_group, dist.ProcessGroup):
            raise GraphError(f"process_group takes a torch.distributed ProcessGroup or a one-dimensional DeviceMesh; "
                             f"got {type(process_group).__name__} {process_group!r}. Leave it out to run over the "
                             "launch's default group.")
        group = mesh() if callable(mesh) and getattr(process_group, "ndim", 1) == 1 else process_group
        if callable(mesh) and getattr(process_group, "ndim", 1) != 1:
            raise GraphError(f"process_group takes a process group or a one-dimensional DeviceMesh; got a mesh of "
                             f"{process_group.ndim} dimensions. Pass mesh.get_group(dim) for the axis to plan over.")
        return dist, group, False
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ExecError(f"device='dist' needs a torch.distributed launch: no process group is initialized and "
                            f"{', '.join(missing)} are not set. Run under torchrun (torchrun --nproc-per-node N "
                            "script.py), or initialize a group and pass process_group=.")
        if nccl_gpu is not None:
            import torch

            torch.cuda.set_device(nccl_gpu)
        try:
            dist.init_process_group("gloo" if nccl_gpu is None else "cpu:gloo,cuda:nccl",
                                    timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # torch's store and backend errors, whatever their class
            raise ExecError(f"rank {os.environ.get('RANK')}: the process group did not form within {timeout:g} s "
                            f"({type(e).__name__}: {_first_line(e)}); a rank exited or never started, or the ranks "
                            f"disagree on WORLD_SIZE ({os.environ.get('WORLD_SIZE')} here), MASTER_ADDR or "
                            "MASTER_PORT. Launch every rank with the same torchrun command.") from None
        return dist, None, True
    return dist, None, False


def _gpu(kind: str, transport: str | None) -> tuple[int | None, str, int]:
    """This rank's GPU (None: a CPU rank), the transport, and how many ranks of this host share a GPU,
    from ``device="dist[:cpu|:cuda]"``."""
    from relational_tensors.machine.devices import visible_gpus

    if kind not in ("dist", "dist:cpu", "dist:cuda"):
        raise GraphError(f"device names one process per device as 'dist' (GPU ranks where GPUs are visible, else "
                         f"CPU ranks), 'dist:cpu' or 'dist:cuda'; got {kind!r}.")
    gpus = 0 if kind == "dist:cpu" else visible_gpus()
    if kind == "dist:cuda" and not gpus:
        raise ExecError("device='dist:cuda' needs a visible GPU (and CuPy); none is visible here. Use 'dist:cpu'.")
    if transport not in (None, "gloo", "nccl"):
        raise GraphError(f"transport is 'nccl' (GPU ranks, one GPU each) or 'gloo' (CPU ranks, or GPU ranks "
                         f"staged through the host); got {transport!r}.")
    if not gpus:
        if transport == "nccl":
            raise GraphError("transport='nccl' is for GPU ranks; these are CPU ranks (no GPU visible, or "
                             "device='dist:cpu'). Leave transport out, or give 'gloo'.")
        return None, "gloo", 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    transport = transport or "nccl"
    per_gpu = -(-int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // gpus)
    if transport == "nccl" and per_gpu > 1:
        raise ExecError(f"{os.environ.get('LOCAL_WORLD_SIZE')} ranks share {gpus} GPUs here and NCCL needs a GPU "
                        "per rank; give transport='gloo' (transfers staged through the host) to share GPUs.")
    return local % gpus, transport, per_gpu


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _collective(rank: int, what: str, wait: float, fn: Any, *args: Any, **kwargs: Any) -> None:
    """``fn(*args, **kwargs)``, a collective of every rank; its failure (a rank gone, or past the group's
    timeout) is an ExecError naming this rank and what the ranks were exchanging."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        raise ExecError(f"rank {rank}: exchanging {what} with the other ranks failed ({type(e).__name__}: "
                        f"{_first_line(e)}); a rank exited, or did not reach compileGraph within the group's "
                        f"timeout ({wait:g} s for a group this call made). Every rank must compile the same "
                        "graph.") from None


TOPOLOGY_FILE = "RELATIONAL_TENSORS_TOPOLOGY"  # environment: a measured topology file (bench/measure_topology.py)
_KINDS = (("H200", "hgx-h200"), ("H100", "hgx-h200"), ("A100", "dgx-a100"), ("V100", "dgx-v100"))


def _topology(gpu: int | None) -> Any:
    """The machine a distributed plan is priced on when ``topology=`` is not given: the measured topology
    file named by $RELATIONAL_TENSORS_TOPOLOGY, else the switch topology of this rank's GPU kind
    (H100-class GPUs priced as the H200 machine), else hgx-h200."""
    path = os.environ.get(TOPOLOGY_FILE)
    if path:
        from relational_tensors.machine.topology import Topology

        if not os.path.isfile(path):
            raise GraphError(f"${TOPOLOGY_FILE} names {path!r}, which is no file; write one with "
                             "bench/measure_topology.py or unset it.")
        return Topology.from_json(path)
    if gpu is not None:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(gpu)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        for key, topology in _KINDS:
            if key in name:
                return topology
    return "hgx-h200"


def compile_distributed(graph: Graph, options: CompileOptions, catalog: Any = None, process_group: Any = None,
                        timeout: float | None = None, transport: str | None = None,
                        topology_given: bool = True) -> CompiledGraph:
    """The plan of ``graph`` for every rank of the process group, planned once on rank 0 (``options`` as
    ``compileGraph`` validated them, ``options.device`` one of ``dist``, ``dist:cpu``, ``dist:cuda``; without
    ``topology_given`` the topology is this machine's, see :func:`_topology`); ``timeout`` in seconds
    bounds each transfer of a group this call initializes; ``transport``: see :func:`_gpu`."""
    from relational_tensors.physical.p2p import check_schedule

    if not isinstance(graph, Graph):
        raise GraphError(f"compileGraph takes an rt.Graph; got {type(graph).__name__}.")
    wait = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
        raise GraphError(f"timeout is the seconds a rank waits for a transfer, a positive number; got {timeout!r}.")
    gpu, transport, sharing = _gpu(str(options.device), transport)
    if not topology_given:
        options = replace(options, topology=_topology(gpu))
    dist, group, owned = _group(process_group, float(wait), gpu if transport == "nccl" else None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = 0 if group is None else dist.get_global_rank(group, 0)
    prints: list[Any] = [None] * world
    _collective(rank, "the graphs' fingerprints", wait, dist.all_gather_object, prints, graph.fingerprint(),
                group=group)
    if len(set(prints)) != 1:
        odd = [r for r, f in enumerate(prints) if f != prints[0]]
        raise ExecError(f"rank {rank}: the ranks hold different graphs (ranks {odd} differ from rank 0: another "
                        "name, shape, dtype or operator); every rank must build the same graph.")
    blob: list[Any] = [None]
    if gpu is not None and options.memory_per_device is None:  # each rank's share of its GPU
        import cupy

        options = replace(options, memory_per_device=cupy.cuda.Device(gpu).mem_info[1] // sharing)
    if rank == 0:
        try:  # planned for virtual devices: the same DAG, and no executor built for them here
            cg = run(graph, replace(options, device=f"cpu:{world}"), catalog)
            blob = [dumps(cg)]
        except Exception as e:  # the other ranks must not wait for a plan that never comes
            blob = [e]
            _collective(rank, "rank 0's plan", wait, dist.broadcast_object_list, blob, src=first, group=group)
            raise
    _collective(rank, "rank 0's plan", wait, dist.broadcast_object_list, blob, src=first, group=group)
    if isinstance(blob[0], Exception):
        raise ExecError(f"rank {rank}: rank 0 could not plan the graph: {blob[0]}") from None
    if rank != 0:
        cg = loads(blob[0], graph, catalog, where="the plan rank 0 sent")
    check_schedule(cg.dag)
    cg.run_on_ranks(Ranks(group, gpu, transport, world, owned))
    return cg

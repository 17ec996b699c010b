"""Executors of the task DAG: ``numpy_backend`` (virtual CPU devices), ``cupy_backend`` (GPUs), and both
per rank of a process group (``dist_backend``, ``dist_cupy``); the memory plan and kernel fusion they
use.  :func:`executor_for` picks one for a program, locally or per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relational_tensors.errors import ExecError
from relational_tensors.machine.devices import DeviceSet, parse_devices, visible_gpus
from relational_tensors.physical.tasks import Liveness, TaskDAG
from relational_tensors.runtime.numpy_backend import NumpyExecutor

__all__ = ["NumpyExecutor", "Ranks", "executor_for"]


@dataclass(frozen=True)
class Ranks:
    """The process group a program runs over, one rank per device: ``gpu`` is this rank's GPU (None: a
    CPU rank), ``transport`` ``nccl`` or ``gloo``, ``owned`` whether the group was made for this program
    (and is destroyed with its executor)."""

    group: Any
    gpu: int | None
    transport: str
    world: int
    owned: bool = False


def executor_for(devices: DeviceSet, dag: TaskDAG, live: Liveness, attention: str = "triton",
                 ranks: Ranks | None = None, where: str = "", bind: Any = None) -> Any:
    """The executor that runs ``dag`` here: on ``devices`` (virtual CPU devices or GPUs), or as this rank's
    share of it when ``ranks`` is given.  ``where`` names the plan's machine in the refusal; ``bind``: the
    inputs read in place from the given arrays (``runtime/binding.py``; one process's devices)."""
    if ranks is not None:
        if bind:
            raise ExecError("bind= reads inputs in place from arrays of this process; a program run over a process "
                            "group (device='dist') loads them on each rank instead: leave bind out.")
        if ranks.gpu is None:
            from relational_tensors.runtime.dist_backend import DistExecutor

            ex: Any = DistExecutor(dag, live, group=ranks.group)
        else:
            from relational_tensors.runtime.dist_cupy import DistCupyExecutor

            ex = DistCupyExecutor(dag, live, parse_devices("cuda:" + ",".join([str(ranks.gpu)] * ranks.world)),
                                  ranks.group, ranks.transport, attention=attention)
        ex.owns_group = ranks.owned
        return ex
    if devices.kind == "cpu":
        return NumpyExecutor(dag, live, bind=bind)
    if visible_gpus() > max(devices.physical):
        from relational_tensors.runtime.cupy_backend import CupyExecutor

        return CupyExecutor(dag, live, devices, attention=attention, bind=bind)
    raise ExecError(f"this program was compiled for {devices}{f' ({where})' if where else ''}, and no GPU backend "
                    "can run it here. Compile with device='cpu:N' to run on N virtual CPU devices; simulate() and "
                    "trace() work for any device.")

"""The target of one compilation: its logical devices, the topology they sit on and the kernel model.

It is resolved once per compilation from the user's ``device``, ``topology`` and ``calibration``
arguments and handed to every pass that prices or places anything, so that the whole compilation
sees one machine.

>>> t = Target.resolve("cpu:4", "dgx-a100")
>>> t.p, t.topology.name, t.topology.sites
(4, 'dgx-a100[4]', (0, 1, 2, 3))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relational_tensors.machine.devices import (
    DeviceSet,
    gpu_total_memory,
    host_available_memory,
    parse_devices,
    visible_gpus,
)
from relational_tensors.machine.kernel_model import KernelModel
from relational_tensors.machine.machines import get_topology
from relational_tensors.machine.topology import Topology

__all__ = ["Target"]


@dataclass(frozen=True)
class Target:
    """p logical devices, the topology of p sites they are priced on, and its kernel model."""

    devices: DeviceSet
    topology: Topology
    kernels: KernelModel

    @staticmethod
    def resolve(device: object, topology: str | Topology = "hgx-h200",
                calibration: str | Path | None = None) -> Target:
        """Resolve the device argument (``relational_tensors.machine.devices``), then the topology for as
        many sites (a subset of a larger machine, or a wider switch of the same GPUs) and its kernel
        model (``calibration``, else the one shipped for the machine)."""
        devices = parse_devices(device)
        return Target.on(devices, topology, calibration)

    @staticmethod
    def on(devices: DeviceSet, topology: str | Topology, calibration: str | Path | None = None) -> Target:
        topo = get_topology(topology, gpus=devices.p)
        return Target(devices, topo, KernelModel.from_calibration(topo, calibration))

    @property
    def p(self) -> int:
        return self.devices.p

    @property
    def sharing(self) -> int:
        """The most logical devices that share one physical GPU (1 on CPUs, whose virtual devices stand for
        separate machines' devices): the calibrated cost model prices their kernels and copies as sharing it."""
        return max(self.devices.per_physical().values()) if self.devices.kind == "cuda" else 1

    @property
    def shared_gpus(self) -> tuple[int, ...] | None:
        """The physical GPU of each logical device where some share one (``cuda:0,0,0,0``), for the simulator;
        None where each device stands for one of its own (CPU virtual devices too)."""
        return tuple(self.devices.physical) if self.sharing > 1 else None

    def memory_source(self) -> str:
        """What :meth:`memory` reads, in words (for messages)."""
        if self.devices.kind == "cpu":
            return "the host's available memory per virtual device"
        if visible_gpus() > max(self.devices.physical):
            return "each GPU's memory per logical device"
        return f"the memory of a {self.topology.machine} GPU per logical device"

    def memory(self) -> dict[int, int] | None:
        """Bytes each logical device may use, shared evenly among the logical devices of one physical one:
        on GPUs present here each GPU's own memory, on absent GPUs the topology's; on virtual CPU devices
        the host's available memory; None where that is unknown."""
        phys = self.devices.physical
        sharing = self.devices.per_physical()
        if self.devices.kind == "cpu":
            host = host_available_memory()
            return None if host is None else {d: host // self.p for d in range(self.p)}
        present = {g: gpu_total_memory(g) for g in sharing} if visible_gpus() > max(phys) else {}
        return {d: (present.get(g) or self.topology.memory_bytes) // sharing[g] for d, g in enumerate(phys)}

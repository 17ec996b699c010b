"""The machine model, below both planners: devices, topologies, the flow engine, the kernel model and
its calibrations, and the pricing rules of data movement that the DP and the simulator share."""

from relational_tensors.machine.devices import DeviceSet, parse_devices, visible_gpus
from relational_tensors.machine.kernel_model import KernelModel
from relational_tensors.machine.machines import TOPOLOGIES, get_topology
from relational_tensors.machine.target import Target
from relational_tensors.machine.topology import Topology

__all__ = ["DeviceSet", "parse_devices", "visible_gpus", "KernelModel", "Target", "Topology", "TOPOLOGIES",
           "get_topology"]

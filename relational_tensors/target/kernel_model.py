"""The kernel model: roofline times of compute tasks on one GPU of a topology, from its peak rates or a
calibration file of measured rates.

Both planners price kernels with it: the calibrated cost model (``dp_optimizer.costs``) and the
whole-plan simulator (``physical.simulate``).  A kind's *cost family* (``matmul``, ``attention``,
``compute``, ``memory``) is declared by its operator (``Operator.cost_family``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from relational_tensors.target.topology import Topology

__all__ = ["KernelModel", "DEFAULT_EFFICIENCY", "CALIBRATIONS", "COST_FAMILIES"]

# Fractions of peak that real kernels reach; replaced by measured numbers from a calibration file.
DEFAULT_EFFICIENCY = {"matmul": 0.75, "attention": 0.55, "compute": 0.5, "memory": 0.8}
# the cost families an operator may declare (``Operator.cost_family``)
COST_FAMILIES = tuple(DEFAULT_EFFICIENCY)


CALIBRATIONS = Path(__file__).resolve().parent / "calibrations"


@dataclass(frozen=True)
class KernelModel:
    """Roofline times for compute tasks on one GPU of a topology.

    ``curves`` holds measured rates by size for a kind (``matmul``, ``attention``: FLOP/s against
    FLOPs; ``memory``: bytes/s against bytes), interpolated in log-size; kinds without a curve
    use the peak rate times ``efficiency``.
    """

    topology: Topology
    efficiency: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    curves: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = "defaults"

    @staticmethod
    def from_calibration(topology: Topology, path: str | Path | None = None) -> KernelModel:
        """Load a calibration file (``relational-tensors calibrate`` writes one); by default the one
        shipped for the topology's machine, if any (a subset, ``hgx-h200[4]``, has the same GPUs)."""
        if path is None:
            shipped = CALIBRATIONS / f"{topology.machine}.json"
            if not shipped.exists():
                return KernelModel(topology)
            path = shipped
        data = json.loads(Path(path).read_text())
        eff = dict(DEFAULT_EFFICIENCY)
        eff.update({k: float(v) for k, v in data.get("efficiency", {}).items()})
        curves = {k: tuple(sorted((float(a), float(b)) for a, b in v)) for k, v in data.get("curves", {}).items()}
        return KernelModel(topology, eff, curves, str(path))

    def _rate(self, kind: str, size: float) -> float | None:
        curve = self.curves.get(kind)
        if not curve or size <= 0:
            return None
        xs = [math.log(a) for a, _ in curve]
        x = math.log(size)
        if x <= xs[0]:  # below the smallest measurement: its rate (the launch latency is charged apart)
            return curve[0][1]
        if x >= xs[-1]:
            return curve[-1][1]
        for (x0, (_, r0)), (x1, (_, r1)) in zip(zip(xs, curve), zip(xs[1:], curve[1:])):
            if x0 <= x <= x1:
                t = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
                return r0 + t * (r1 - r0)
        return curve[-1][1]

    def time(self, flops: float, nbytes: float, dtype: str, family: str) -> float:
        """Seconds of one kernel of cost ``family`` doing ``flops`` over ``nbytes``: the launch latency plus
        the slower of its compute and its memory traffic.  A ``memory``-bound kernel's few FLOPs (a ⊕)
        are priced at the ``compute`` rate."""
        top = self.topology
        peak = top.peak_flops.get(dtype) or top.peak_flops.get("float32") or max(top.peak_flops.values())
        if family == "memory":
            family = "compute"
        rate = self._rate(family, flops) if flops else None
        compute = flops / rate if rate else (flops / (peak * self.efficiency[family]) if flops else 0.0)
        mem_rate = self._rate("memory", nbytes) or top.hbm_bandwidth * self.efficiency["memory"]
        memory = nbytes / mem_rate
        return top.launch_latency + max(compute, memory)

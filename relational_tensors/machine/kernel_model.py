"""The kernel model: roofline times of compute tasks on one GPU of a topology, from its peak rates or a
calibration file of measured rates.

Both planners price kernels with it: the calibrated cost model (``dp_optimizer.costs``) and the
whole-plan simulator (``physical.simulate``).  A kind's *cost family* (``matmul``, ``attention``,
``compute``, ``memory``) is declared by its operator (``Operator.cost_family``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from relational_tensors.core.numbers import is_number
from relational_tensors.errors import ExchangeError
from relational_tensors.machine.topology import Topology, load_json, read_text, show

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

    def __post_init__(self) -> None:
        # checked once here so that no kernel time is NaN or infinite: a NaN time loops the whole-plan
        # simulator; families left out of ``efficiency`` keep their DEFAULT_EFFICIENCY
        if not isinstance(self.topology, Topology):
            raise ExchangeError(f"a kernel model prices kernels on a Topology; got {type(self.topology).__name__} "
                                f"{show(self.topology)}.")
        eff = _families("efficiency", self.efficiency, "fractions of peak")
        checked = dict(DEFAULT_EFFICIENCY)
        for k, v in eff.items():
            if not is_number(v) or not 0 < v <= 1:
                raise ExchangeError(f"efficiency[{k!r}] must be a fraction of peak in (0, 1]; got {show(v)}. "
                                    "Give the achieved rate over the peak rate, e.g. 0.75.")
            checked[k] = float(v)
        object.__setattr__(self, "efficiency", checked)
        curves: dict[str, tuple[tuple[float, float], ...]] = {}
        for k, points in _families("curves", self.curves, "lists of [size, rate] points").items():
            if isinstance(points, (str, bytes, Mapping)) or not hasattr(points, "__iter__"):
                raise ExchangeError(f"curves[{k!r}] must be a list of [size, rate] points; got {show(points)}.")
            pairs = []
            for i, p in enumerate(points):
                if (isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) != 2
                        or not all(is_number(x) and 0 < x < math.inf for x in p)):
                    raise ExchangeError(
                        f"curves[{k!r}][{i}] must be a [size, rate] pair of finite numbers > 0 (FLOPs or bytes "
                        f"per call, and the FLOP/s or bytes/s achieved); got {show(p)}.")
                pairs.append((float(p[0]), float(p[1])))
            curves[k] = tuple(sorted(pairs))
        object.__setattr__(self, "curves", curves)

    @staticmethod
    def from_calibration(topology: Topology, path: str | Path | None = None) -> KernelModel:
        """Load a calibration file (``relational-tensors calibrate`` writes one); by default the one
        shipped for the topology's machine, if any (a subset, ``hgx-h200[4]``, has the same GPUs).

        Every problem with the file -- missing, not JSON, a field of the wrong shape or a rate that is
        not a finite positive number -- is an :class:`ExchangeError` naming the file and the field."""
        if path is None:
            shipped = CALIBRATIONS / f"{topology.gpu_machine}.json"
            if not shipped.exists():
                return KernelModel(topology)
            path = shipped
        if not isinstance(path, (str, os.PathLike)):
            raise ExchangeError(f"a calibration is the path of a calibration file; got {type(path).__name__} "
                                f"{show(path)}.")
        origin = f"calibration file {os.fspath(path)!r}"
        data = load_json(read_text(path, "calibration"), origin, "a calibration")
        try:
            if not isinstance(data, dict):
                raise ExchangeError(f"a calibration is a JSON object with 'efficiency' and 'curves'; got "
                                    f"{type(data).__name__} {show(data)}.")
            return KernelModel(topology, data.get("efficiency", {}), data.get("curves", {}), str(path))
        except ExchangeError as e:
            raise ExchangeError(f"{origin}: {e}") from None

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
        family, peak_rate, peak_mem = self._peaks(dtype, family)
        rate = self._rate(family, flops) if flops else None
        compute = flops / (rate or peak_rate) if flops else 0.0
        memory = nbytes / (self._rate("memory", nbytes) or peak_mem)
        return self.topology.launch_latency + max(compute, memory)

    def _peaks(self, dtype: str, family: str) -> tuple[str, float, float]:
        """The family a kernel is priced as (``memory``-bound ones' few FLOPs at the ``compute`` rate), and
        its compute and memory rates without a calibration curve: the peaks times the efficiencies."""
        top = self.topology
        peak = top.peak_flops.get(dtype) or top.peak_flops.get("float32") or max(top.peak_flops.values())
        family = "compute" if family == "memory" else family
        return family, peak * self.efficiency[family], top.hbm_bandwidth * self.efficiency["memory"]

    def busy_time(self, flops: float, nbytes: float, dtype: str, family: str) -> float:
        """Seconds of a whole GPU that one kernel's work occupies when other kernels run beside it: its
        compute and memory traffic at the family's best rates (the calibration's largest measured size, or
        the peak times the efficiency), without the launch latency.  A small kernel alone takes longer
        (``time``) than it keeps the GPU busy."""
        family, peak_rate, peak_mem = self._peaks(dtype, family)
        curve, mem_curve = self.curves.get(family), self.curves.get("memory")
        rate = max(r for _, r in curve) if curve else peak_rate
        mem_rate = max(r for _, r in mem_curve) if mem_curve else peak_mem
        return max(flops / rate if flops else 0.0, nbytes / mem_rate)


def _families(key: str, value: object, what: str) -> Mapping[str, object]:
    """``value`` checked to map cost families (COST_FAMILIES) to something."""
    if not isinstance(value, Mapping):
        raise ExchangeError(f"{key} must be an object of cost families to {what}; got {type(value).__name__} "
                            f"{show(value)}.")
    unknown = [k for k in value if k not in COST_FAMILIES]
    if unknown:
        raise ExchangeError(f"{key} names unknown cost families {show(unknown)}; the families are "
                            f"{list(COST_FAMILIES)}; got {show(dict(value))}.")
    return value

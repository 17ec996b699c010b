"""Cost models of candidate join-agg specs (section 4.3) and the candidate table.

``paper`` is the proxy of the paper exactly, in elements:

* repartition: |input| when the producer's tiling differs from the blocks the
  spec reads (``in_k(J)``); 0 for graph inputs, which are materialized as needed;
* join: the sum over function specs of the sizes of their input projections;
* aggregation: (m - 1)·|block| for each output block produced m times.

``bytes`` weighs the same counts by dtype width (an lse partial also carries
its log-sum-exp row).  Both are switchable so the paper's model stays
reproducible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from relational_tensors.core.dtypes import itemsize
from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.tiling import Tiling, as_grid
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import PlanError

__all__ = ["CostModel", "CalibratedCostModel", "COST_MODELS", "COST_MODEL_NAMES", "TilingTable", "spec_memory",
           "spec_resident", "cost_model"]


@dataclass(frozen=True)
class CostModel:
    """Weights turning element counts into costs (``paper``: elements; ``bytes``: dtype widths)."""

    name: str
    width: Callable[[str], float]  # dtype -> weight of one element

    def repartition(self, t: TensorType, p: int = 1) -> float:
        return float(t.volume) * self.width(t.dtype)

    def join(self, spec: JoinAggSpec, graph_inputs: tuple[bool, ...] = ()) -> float:
        total = 0.0
        for k, t in enumerate(spec.input_types):
            total += sum(f.inputs[k].volume for f in spec.functions) * self.width(t.dtype)
        return total

    def aggregation(self, spec: JoinAggSpec) -> float:
        width = self.width(spec.output_type.dtype)
        total = 0.0
        for box, m in spec.output_multiplicity().items():
            if m > 1:
                moved = box.volume * width
                if spec.aggregation.partial_extra and self.name != "paper":
                    moved += box.volume // box.shape[-1] * self.width("float32")  # the lse row of a partial
                total += (m - 1) * moved
        return total

    def compute(self, spec: JoinAggSpec, op: object) -> float:
        return 0.0


@dataclass(frozen=True)
class CalibratedCostModel(CostModel):
    """Seconds: bytes moved over the topology's links plus kernel time from a calibration.

    Communication: a repartition moves (p-1)/p of the tensor, spread over the p devices' links; a
    join moves the bytes its function specs read beyond one copy of each op-produced input (graph
    inputs are loaded where they are read); an aggregation moves m-1 partial copies of a block.
    Computation: the slowest function spec's kernel under the kernel model (a roofline whose
    efficiency follows the measured, shape-dependent rates of the calibration file).
    """

    kernels: object = None      # exchange.plan_sim.KernelModel
    bandwidth: float = 1.0      # bytes/s of one device's link

    def _seconds(self, nbytes: float, p: int) -> float:
        return nbytes / (max(p, 1) * self.bandwidth)

    def repartition(self, t: TensorType, p: int = 1) -> float:
        return self._seconds(t.nbytes * (p - 1) / max(p, 1), p)

    def join(self, spec: JoinAggSpec, graph_inputs: tuple[bool, ...] = ()) -> float:
        extra = 0.0
        for k, t in enumerate(spec.input_types):
            if k < len(graph_inputs) and graph_inputs[k]:
                continue
            read = sum(f.inputs[k].volume for f in spec.functions)
            extra += max(0, read - t.volume) * itemsize(t.dtype)
        return self._seconds(extra, spec.p)

    def aggregation(self, spec: JoinAggSpec) -> float:
        moved = 0.0
        for box, m in spec.output_multiplicity().items():
            if m > 1:
                moved += (m - 1) * box.volume * itemsize(spec.output_type.dtype)
        return self._seconds(moved, spec.p)

    def compute(self, spec: JoinAggSpec, op: object) -> float:
        model = self.kernels
        kind = getattr(op, "kind", "compute")
        out_w = itemsize(spec.output_type.dtype)
        widths = [itemsize(t.dtype) for t in spec.input_types]
        worst = 0.0
        for f in spec.functions:
            nbytes = sum(b.volume * w for b, w in zip(f.inputs, widths)) + f.output.volume * out_w
            worst = max(worst, model.time(f.flops, nbytes, spec.output_type.dtype, kind))  # type: ignore[attr-defined]
        return worst


COST_MODELS: dict[str, CostModel] = {
    "paper": CostModel("paper", lambda dtype: 1.0),
    "bytes": CostModel("bytes", lambda dtype: float(itemsize(dtype))),
}
COST_MODEL_NAMES = ("paper", "bytes", "calibrated")


def cost_model(name: str, topology: str | None = None, p: int = 1, calibration: str | None = None) -> CostModel:
    """The cost model ``name``; ``calibrated`` needs the topology (and takes a calibration file)."""
    if name not in COST_MODEL_NAMES:
        raise PlanError(f"unknown cost model {name!r}; choose one of {list(COST_MODEL_NAMES)}.")
    if name != "calibrated":
        return COST_MODELS[name]
    from relational_tensors.exchange.plan_sim import KernelModel
    from relational_tensors.exchange.topology import get_topology

    base = get_topology(topology or "hgx-h200")
    topo = get_topology(base, gpus=p) if 1 < p <= len(base.sites) else base
    sites = topo.sites
    pairs = [(a, b) for a in sites for b in sites if a != b]
    bw = sum(topo.bandwidth(a, b) for a, b in pairs) / len(pairs) if pairs else topo.hbm_bandwidth
    return CalibratedCostModel("calibrated", lambda dtype: float(itemsize(dtype)),
                               KernelModel.from_calibration(topo, calibration), bw)


def spec_memory(spec: JoinAggSpec) -> int:
    """The largest per-device working set of ``spec``: its input blocks plus its output block, in bytes."""
    out_width = itemsize(spec.output_type.dtype)
    widths = [itemsize(t.dtype) for t in spec.input_types]
    best = 0
    for f in spec.functions:
        need = sum(b.volume * w for b, w in zip(f.inputs, widths)) + f.output.volume * out_width
        best = max(best, need)
    return best


def spec_resident(spec: JoinAggSpec, graph_inputs: tuple[bool, ...]) -> int:
    """The largest per-device bytes of graph-input blocks ``spec`` reads: they stay loaded for every run."""
    widths = [itemsize(t.dtype) for t in spec.input_types]
    return max(sum(b.volume * w for b, w, g in zip(f.inputs, widths, graph_inputs) if g) for f in spec.functions)


@dataclass
class TilingTable:
    """Interned block sets: grids by their breakpoints, other sets (overlapping key prefixes) by their boxes."""

    ids: dict[tuple[int, object], int] = field(default_factory=dict)
    rows: list[dict[str, object]] = field(default_factory=list)

    def intern(self, tensor_id: int, boxes: tuple[Box, ...] | Tiling, space: Box) -> int:
        if isinstance(boxes, Tiling):
            key: object = boxes
        else:
            key = as_grid(boxes, space) or frozenset(boxes)
        tid = self.ids.get((tensor_id, key))
        if tid is None:
            tid = len(self.rows)
            self.ids[(tensor_id, key)] = tid
            if isinstance(key, Tiling):
                grid, counts, blocks, is_grid = str(key), key.shape_str(), key.num_blocks, True
            else:
                ordered = sorted(key, key=lambda b: (b.lower, b.upper))  # type: ignore[arg-type]
                grid, counts, blocks, is_grid = json.dumps([str(b) for b in ordered]), f"{len(ordered)} blocks", len(ordered), False
            self.rows.append(dict(tiling_id=tid, tensor_id=tensor_id, is_grid=is_grid, grid=grid,
                                  counts=counts, blocks=blocks))
        return tid

    def arrow(self) -> pa.Table:
        cols = ["tiling_id", "tensor_id", "is_grid", "grid", "counts", "blocks"]
        return pa.table({c: [r[c] for r in self.rows] for c in cols},
                        schema=pa.schema([("tiling_id", pa.int32()), ("tensor_id", pa.int32()), ("is_grid", pa.bool_()),
                                          ("grid", pa.string()), ("counts", pa.string()), ("blocks", pa.int32())]))

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

__all__ = ["CostModel", "COST_MODELS", "TilingTable", "spec_memory", "spec_resident"]


@dataclass(frozen=True)
class CostModel:
    """Weights turning element counts into costs."""

    name: str
    width: Callable[[str], float]  # dtype -> weight of one element

    def repartition(self, t: TensorType) -> float:
        return float(t.volume) * self.width(t.dtype)

    def join(self, spec: JoinAggSpec) -> float:
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


COST_MODELS: dict[str, CostModel] = {
    "paper": CostModel("paper", lambda dtype: 1.0),
    "bytes": CostModel("bytes", lambda dtype: float(itemsize(dtype))),
}


def cost_model(name: str) -> CostModel:
    if name not in COST_MODELS:
        raise PlanError(f"unknown cost model {name!r}; choose one of {sorted(COST_MODELS)}.")
    return COST_MODELS[name]


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

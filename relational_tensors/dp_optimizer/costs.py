"""Cost models of candidate join-agg specs (section 4.3) and the candidate table.

``paper`` is the proxy of the paper exactly, in elements:

* repartition: |input| when the producer's tiling differs from the blocks the
  spec reads (``in_k(J)``); 0 for graph inputs, which are materialized as needed;
* join: the sum over function specs of the sizes of their input projections;
* aggregation: (m - 1)·|block| for each output block produced m times.

``bytes`` weighs the same counts by dtype width (an lse partial also carries
its log-sum-exp row).  Both are switchable so the paper's model stays
reproducible.  Both price an edge with one number whenever the producer's
tiling differs from the one read; ``calibrated`` prices each pair of tilings
(:meth:`CostModel.exchange`), in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, cast

import pyarrow as pa

from relational_tensors.core.dtypes import itemsize, partial_dtype
from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.tiling import Tiling, as_grid
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import PlanError
from relational_tensors.machine.kernel_model import KernelModel
from relational_tensors.machine.pricing import device_bandwidth, exchange_seconds
from relational_tensors.machine.target import Target

__all__ = ["CostModel", "CalibratedCostModel", "COST_MODELS", "COST_MODEL_NAMES", "TilingTable", "spec_memory",
           "spec_resident", "cost_model"]


@dataclass(frozen=True)
class CostModel:
    """Weights turning element counts into costs (``paper``: elements; ``bytes``: dtype widths)."""

    name: str
    width: Callable[[str], float]  # dtype -> weight of one element

    # True: every (producer tiling, required tiling) pair of an edge has its own price, ``exchange``;
    # False: an edge costs ``repartition`` when the two differ and nothing when they agree.
    pairwise: ClassVar[bool] = False

    def repartition(self, t: TensorType, p: int = 1) -> float:
        return float(t.volume) * self.width(t.dtype)

    def exchange(self, producer: JoinAggSpec, consumer: JoinAggSpec, k: int) -> float:
        raise PlanError(f"cost model {self.name!r} prices an edge by one number (repartition), not per pair "
                        "of tilings; only pairwise models (calibrated) implement exchange().")

    def move(self, blocks: tuple[Box, ...], reads: tuple[Box, ...], dtype: str, aggregation: str) -> float:
        """The price of delivering ``blocks`` (one per source; repeated: partial copies) as ``reads`` (one
        per reader; empty: none); pairwise models only, like :meth:`exchange`."""
        raise PlanError(f"cost model {self.name!r} prices an edge by one number (repartition), not per pair "
                        "of block sets; only pairwise models (calibrated) implement move().")

    def join(self, spec: JoinAggSpec, graph_inputs: tuple[bool, ...] = ()) -> float:
        total = 0.0
        for k, t in enumerate(spec.input_types):
            total += sum(f.inputs[k].volume for f in spec.functions) * self.width(t.dtype)
        return total

    def aggregation(self, spec: JoinAggSpec, saved: bool = False) -> float:
        width = self.width(partial_dtype(spec.output_type.dtype))  # partials move in their partial dtype
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
    """Seconds, shaped like the whole-plan simulator's clock: per operator, its slowest kernel, plus
    per input edge the time of the exchange that delivers the producer's blocks to the spec's readers.

    An edge is priced for the pair (producer tiling, required tiling) by :meth:`exchange`, so the
    dynamic program minimises over the producer's tilings with the price of each.  The exchange
    covers everything the simulator charges between two kernels: slicing producer blocks into atoms,
    the transfers (the busiest device's ingress or egress over its link bandwidth), the ⊕ of partial
    copies and the assembly of the blocks a kernel reads.  Hence ``join`` is 0 (graph inputs are
    loaded where they are read; replicated reads of op outputs are part of the edge) and
    ``aggregation`` is the exchange that finishes a *saved* output's partials (a consumed output's
    partials are combined by its consumers' edges).
    """

    kernels: KernelModel | None = None
    bandwidth: float = 1.0      # bytes/s one device sends (and receives) while every device exchanges
    latency: float = 0.0        # start latency of a transfer, s
    sharing: int = 1            # logical devices per physical GPU: their kernels share its SMs and memory
    _prices: dict = field(default_factory=dict, compare=False, repr=False)  # memo of exchange()

    pairwise: ClassVar[bool] = True

    def repartition(self, t: TensorType, p: int = 1) -> float:
        """Fallback price of a differing pair (every pair the selectors meet is priced by ``exchange``)."""
        return t.nbytes * (p - 1) / max(p, 1) / (max(p, 1) * self.bandwidth)

    def join(self, spec: JoinAggSpec, graph_inputs: tuple[bool, ...] = ()) -> float:
        return 0.0

    def aggregation(self, spec: JoinAggSpec, saved: bool = False) -> float:
        if not saved or max(spec.output_multiplicity().values()) == 1:
            return 0.0
        blocks = tuple(f.output for f in spec.functions)
        first = {b: g for g, b in reversed(list(enumerate(blocks)))}  # each block finishes where it is first made
        empty = Box((0,) * spec.output_type.rank, (0,) * spec.output_type.rank)
        reads = tuple(b if first[b] == g else empty for g, b in enumerate(blocks))
        return self._exchange(blocks, reads, spec.output_type.dtype, spec.aggregation.name)

    def exchange(self, producer: JoinAggSpec, consumer: JoinAggSpec, k: int) -> float:
        """Seconds to deliver ``producer``'s output blocks as the blocks input ``k`` of ``consumer`` reads."""
        return self._exchange(tuple(f.output for f in producer.functions),
                              tuple(f.inputs[k] for f in consumer.functions),
                              producer.output_type.dtype, producer.aggregation.name)

    def move(self, blocks: tuple[Box, ...], reads: tuple[Box, ...], dtype: str, aggregation: str) -> float:
        return self._exchange(blocks, reads, dtype, aggregation)

    def _exchange(self, blocks: tuple[Box, ...], reads: tuple[Box, ...], dtype: str, aggregation: str) -> float:
        key = (blocks, reads, dtype, aggregation)
        price = self._prices.get(key)
        if price is None:
            price = self._prices[key] = exchange_seconds(blocks, reads, dtype, aggregation, self.kernels,
                                                         self.bandwidth, self.latency)
        return price

    def compute(self, spec: JoinAggSpec, op: object) -> float:
        model = cast(KernelModel, self.kernels)  # cost_model() passes the target's kernel model
        family = getattr(op, "cost_family", "compute")
        out_w = itemsize(spec.output_type.dtype)
        widths = [itemsize(t.dtype) for t in spec.input_types]
        worst = 0.0
        for f in spec.functions:
            nbytes = op.kernel_bytes([b.volume * w for b, w in zip(f.inputs, widths)], f.output.volume * out_w) \
                if hasattr(op, "kernel_bytes") else sum(b.volume * w for b, w in zip(f.inputs, widths)) + \
                f.output.volume * out_w
            worst = max(worst, model.time(f.flops, nbytes, spec.output_type.dtype, family))
        return worst * self.sharing


COST_MODELS: dict[str, CostModel] = {
    "paper": CostModel("paper", lambda dtype: 1.0),
    "bytes": CostModel("bytes", lambda dtype: float(itemsize(dtype))),
}
COST_MODEL_NAMES = ("paper", "bytes", "calibrated")


def cost_model(name: str, target: Target | None = None) -> CostModel:
    """The cost model ``name``; ``calibrated`` prices seconds on the target's topology and kernel model."""
    if name not in COST_MODEL_NAMES:
        raise PlanError(f"unknown cost model {name!r}; choose one of {list(COST_MODEL_NAMES)}.")
    if name != "calibrated":
        return COST_MODELS[name]
    if target is None:
        raise PlanError("the calibrated cost model prices a target: pass the Target of the compilation.")
    topo = target.topology
    routes = [topo.route(a, b) for a in topo.sites for b in topo.sites if a != b]
    latency = sum(r.latency for r in routes) / len(routes) if routes else 0.0
    bandwidth, sharing = device_bandwidth(topo), target.sharing
    if sharing > 1:  # logical devices of one GPU copy through its memory (a read and a write), all at once
        bandwidth = min(bandwidth, topo.hbm_bandwidth / (2 * sharing))
    return CalibratedCostModel("calibrated", lambda dtype: float(itemsize(dtype)), target.kernels, bandwidth,
                               latency, sharing)


def spec_memory(spec: JoinAggSpec) -> int:
    """The largest per-device working set of ``spec``: its input blocks plus its output block, in bytes."""
    made = spec.output_multiplicity()
    final, wide = itemsize(spec.output_type.dtype), itemsize(partial_dtype(spec.output_type.dtype))
    widths = [itemsize(t.dtype) for t in spec.input_types]
    best = 0
    for f in spec.functions:
        out_width = final if made[f.output] == 1 else wide  # a partial block is kept in its partial dtype
        need = sum(b.volume * w for b, w in zip(f.inputs, widths)) + f.output.volume * out_width
        best = max(best, need)
    return best


def spec_resident(spec: JoinAggSpec, graph_inputs: tuple[bool, ...], held: bool = False) -> int:
    """The largest per-device bytes ``spec`` keeps for the whole run: the graph-input blocks it reads (they
    stay loaded), and, if ``held``, its output block as a partial sum (a weight's gradient accumulated over
    a pipeline's micro-batches: its device holds it from the first micro-batch's backward to the update)."""
    widths = [itemsize(t.dtype) for t in spec.input_types]
    out = itemsize(partial_dtype(spec.output_type.dtype)) if held else 0
    return max(sum(b.volume * w for b, w, g in zip(f.inputs, widths, graph_inputs) if g) + f.output.volume * out
               for f in spec.functions)


def block_set_key(boxes: tuple[Box, ...] | Tiling, space: Box) -> Tiling | frozenset[Box]:
    """A block set as a grid when it is one, else as its set of boxes (how ``TilingTable`` knows it)."""
    return boxes if isinstance(boxes, Tiling) else as_grid(boxes, space) or frozenset(boxes)


@dataclass
class TilingTable:
    """Interned block sets: grids by their breakpoints, other sets (overlapping key prefixes) by their boxes."""

    ids: dict[tuple[int, object], int] = field(default_factory=dict)
    rows: list[dict[str, object]] = field(default_factory=list)

    def intern(self, tensor_id: int, boxes: tuple[Box, ...] | Tiling, space: Box) -> int:
        return self.intern_key(tensor_id, block_set_key(boxes, space))

    def intern_key(self, tensor_id: int, key: Tiling | frozenset[Box],
                   text: tuple[bool, str, str, int] | None = None) -> int:
        """``intern`` of a block set already turned into its key (``block_set_key``); ``text`` is the key's
        ``row_text`` when the caller has it (identical layers intern the same keys for many tensors)."""
        tid = self.ids.get((tensor_id, key))
        if tid is None:
            tid = len(self.rows)
            self.ids[(tensor_id, key)] = tid
            is_grid, grid, counts, blocks = text or self.row_text(key)
            self.rows.append(dict(tiling_id=tid, tensor_id=tensor_id, is_grid=is_grid, grid=grid,
                                  counts=counts, blocks=blocks))
        return tid

    @staticmethod
    def row_text(key: Tiling | frozenset[Box]) -> tuple[bool, str, str, int]:
        """(is_grid, grid, counts, blocks) of a block set's catalog row."""
        if isinstance(key, Tiling):
            return True, str(key), key.shape_str(), key.num_blocks
        ordered = sorted(key, key=lambda b: (b.lower, b.upper))
        return False, json.dumps([str(b) for b in ordered]), f"{len(ordered)} blocks", len(ordered)

    def arrow(self) -> pa.Table:
        cols = ["tiling_id", "tensor_id", "is_grid", "grid", "counts", "blocks"]
        return pa.table({c: [r[c] for r in self.rows] for c in cols},
                        schema=pa.schema([("tiling_id", pa.int32()), ("tensor_id", pa.int32()), ("is_grid", pa.bool_()),
                                          ("grid", pa.string()), ("counts", pa.string()), ("blocks", pa.int32())]))

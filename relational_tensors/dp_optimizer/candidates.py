"""Candidate join-agg specs of every operator, costed, as Arrow tables for the catalog.

Specs are enumerated once per distinct operator and device count (identical
layers of a deep model share them), costed by the chosen model, and filtered
by the balance and memory rules into the ``eligible`` set the selectors see.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

import pyarrow as pa

from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.types import Interval
from relational_tensors.dp_optimizer.costs import CostModel, TilingTable, spec_memory, spec_resident
from relational_tensors.dp_optimizer.enumerate import interval_requests
from relational_tensors.errors import OutOfMemoryPlanError, PlanError
from relational_tensors.frontend.graph import Graph
from relational_tensors.sql_specs.base import Operator

__all__ = ["Candidate", "Candidates", "build_candidates", "specs_for"]


@functools.lru_cache(maxsize=4096)
def specs_for(op: Operator, p: int) -> tuple[tuple[tuple[tuple[str, tuple[Interval, ...]], ...], JoinAggSpec], ...]:
    """Every (request, spec) of ``op`` for ``p`` function specs; cached per distinct operator."""
    return tuple((tuple(r.items()), op.spec(r)) for r in interval_requests(op, p))


@dataclass
class Candidate:
    spec_id: int
    request: tuple[tuple[str, tuple[Interval, ...]], ...]
    spec: JoinAggSpec
    output_tiling: int
    required: tuple[int, ...]  # per input: the interned block set in_k(J)
    join_cost: float
    aggregation_cost: float
    memory_bytes: int
    resident_bytes: int
    compute_cost: float = 0.0
    eligible: bool = True

    @property
    def local_cost(self) -> float:
        return self.join_cost + self.aggregation_cost + self.compute_cost


@dataclass
class Candidates:
    """Everything the selectors need: per op its candidates, the tilings, and per edge its repartition price."""

    p: int
    by_op: dict[int, list[Candidate]] = field(default_factory=dict)
    tilings: TilingTable = field(default_factory=TilingTable)
    repartition: dict[tuple[int, int], float] = field(default_factory=dict)  # (op, input pos) -> price

    def eligible(self, op_id: int) -> list[Candidate]:
        return [c for c in self.by_op[op_id] if c.eligible]

    def arrow_specs(self) -> pa.Table:
        rows: dict[str, list] = {k: [] for k in ("op_id", "spec_id", "split", "intervals", "output_tiling", "join_cost",
                                                 "aggregation_cost", "compute_cost", "flops", "imbalance", "balanced",
                                                 "memory_bytes", "resident_bytes", "eligible")}
        for op_id, cands in self.by_op.items():
            for c in cands:
                rows["op_id"].append(op_id)
                rows["spec_id"].append(c.spec_id)
                rows["split"].append(c.spec.split_text)
                rows["intervals"].append(";".join(f"{n}=" + ",".join(str(i) for i in ivs) for n, ivs in c.request))
                rows["output_tiling"].append(c.output_tiling)
                rows["join_cost"].append(c.join_cost)
                rows["aggregation_cost"].append(c.aggregation_cost)
                rows["compute_cost"].append(c.compute_cost)
                rows["flops"].append(c.spec.total_flops)
                imb = c.spec.imbalance
                rows["imbalance"].append(imb if imb != float("inf") else None)
                rows["balanced"].append(c.spec.balanced)
                rows["memory_bytes"].append(c.memory_bytes)
                rows["resident_bytes"].append(c.resident_bytes)
                rows["eligible"].append(c.eligible)
        schema = pa.schema([("op_id", pa.int32()), ("spec_id", pa.int32()), ("split", pa.string()),
                            ("intervals", pa.string()), ("output_tiling", pa.int32()), ("join_cost", pa.float64()),
                            ("aggregation_cost", pa.float64()), ("compute_cost", pa.float64()),
                            ("flops", pa.float64()), ("imbalance", pa.float64()),
                            ("balanced", pa.bool_()), ("memory_bytes", pa.int64()),
                            ("resident_bytes", pa.int64()), ("eligible", pa.bool_())])
        return pa.table(rows, schema=schema)

    def arrow_inputs(self, graph: Graph, tree_of: Mapping[int, int]) -> pa.Table:
        rows: dict[str, list] = {k: [] for k in ("op_id", "spec_id", "input_pos", "required_tiling", "producer_op",
                                                 "op_tree", "producer_tree", "repartition")}
        for op_id, cands in self.by_op.items():
            node = graph.nodes[op_id]
            for k, i in enumerate(node.inputs):
                producer = i if graph.nodes[i].op is not None else None
                for c in cands:
                    rows["op_id"].append(op_id)
                    rows["spec_id"].append(c.spec_id)
                    rows["input_pos"].append(k)
                    rows["required_tiling"].append(c.required[k])
                    rows["producer_op"].append(producer)
                    rows["op_tree"].append(tree_of[op_id])
                    rows["producer_tree"].append(tree_of.get(producer) if producer is not None else None)
                    rows["repartition"].append(self.repartition[(op_id, k)])
        schema = pa.schema([("op_id", pa.int32()), ("spec_id", pa.int32()), ("input_pos", pa.int32()),
                            ("required_tiling", pa.int32()), ("producer_op", pa.int32()),
                            ("op_tree", pa.int32()), ("producer_tree", pa.int32()), ("repartition", pa.float64())])
        return pa.table(rows, schema=schema)


def build_candidates(graph: Graph, p: int, model: CostModel, memory_per_device: int | None = None) -> Candidates:
    """Enumerate, cost and filter the specs of every operator of ``graph`` for ``p`` devices."""
    out = Candidates(p)
    for node in graph.operators:
        op = node.op
        assert op is not None
        pairs = specs_for(op, p)
        if not pairs:
            extents = ", ".join(f"{s.name}={s.extent}" for s in op.requestable()) or "none"
            raise PlanError(
                f"operator {node.name!r} ({op.kind}, output {op.output_type.shape}) has no decomposition into "
                f"exactly p={p} function specs: its shardable indices ({extents}) cannot be split into {p} "
                f"combinations. Use fewer devices, or a device count that factors over these extents."
            )
        cands = []
        graph_inputs = tuple(graph.nodes[i].op is None for i in node.inputs)
        for sid, (request, spec) in enumerate(pairs):
            out_t = out.tilings.intern(node.id, spec.output_tiling, op.output_type.box)
            required = tuple(out.tilings.intern(i, spec.input_blocks(k), op.input_types[k].box)
                             for k, i in enumerate(node.inputs))
            cands.append(Candidate(sid, request, spec, out_t, required, model.join(spec, graph_inputs),
                                   model.aggregation(spec), spec_memory(spec), spec_resident(spec, graph_inputs),
                                   model.compute(spec, op)))
        if memory_per_device is not None:
            fitting = [c for c in cands if c.memory_bytes <= memory_per_device]
            if not fitting:
                lean = min(cands, key=lambda c: c.memory_bytes)
                raise OutOfMemoryPlanError(
                    f"operator {node.name!r} ({op.kind}) needs at least {lean.memory_bytes:,} bytes per device "
                    f"(its leanest spec, {lean.spec.split_text}, holds its input blocks and output block), but "
                    f"memory_per_device is {memory_per_device:,} bytes. Use more devices or a larger memory limit."
                )
            for c in cands:
                c.eligible = c.memory_bytes <= memory_per_device
        # the paper's cost model assumes balanced work: offer balanced specs, else the least unbalanced
        live = [c for c in cands if c.eligible]
        floor = min(c.spec.imbalance for c in live)
        for c in live:
            c.eligible = c.spec.balanced or c.spec.imbalance <= floor
        out.by_op[node.id] = cands
        for k, i in enumerate(node.inputs):
            out.repartition[(node.id, k)] = model.repartition(graph.nodes[i].type, p)
    return out

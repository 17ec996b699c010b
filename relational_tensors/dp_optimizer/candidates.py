"""Candidate join-agg specs of every operator, costed, as Arrow tables for the catalog.

Specs are enumerated once per distinct operator and device count (identical
layers of a deep model share them), costed by the chosen model, and filtered
by the balance and memory rules into the ``eligible`` set the selectors see.
Under a pairwise cost model every input edge also gets a price for each pair
of (producer output tiling, required tiling) that eligible specs can meet.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.tiling import Tiling
from relational_tensors.core.types import Box, Interval
from relational_tensors.dp_optimizer.constraints import Held
from relational_tensors.dp_optimizer.costs import CostModel, TilingTable, block_set_key, spec_memory, spec_resident
from relational_tensors.dp_optimizer.enumerate import interval_requests
from relational_tensors.errors import OutOfMemoryPlanError, PlanError
from relational_tensors.frontend.graph import Graph
from relational_tensors.sql_specs.base import Operator

__all__ = ["Candidate", "Candidates", "build_candidates", "specs_for"]


@functools.lru_cache(maxsize=4096)
def specs_for(op: Operator, p: int) -> tuple[tuple[tuple[tuple[str, tuple[Interval, ...]], ...], JoinAggSpec], ...]:
    """Every (request, spec) of ``op`` for ``p`` function specs; cached per distinct operator.

    An operator too small to split into exactly ``p`` (three elements on eight devices, a 6x6 on
    seven) gets the specs of the largest count below ``p`` that it can be split into: its function
    specs take that many devices and the others hold none of it."""
    for k in range(p, 0, -1):
        found = tuple((tuple(r.items()), op.spec(r)) for r in interval_requests(op, k))
        if found:
            return found
    return ()


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
    layout_cost: float = 0.0  # moving pinned inputs' and states' layouts to and from this spec's blocks

    @property
    def local_cost(self) -> float:
        return self.join_cost + self.aggregation_cost + self.compute_cost + self.layout_cost


@dataclass
class Candidates:
    """Everything the selectors need: per op its candidates, the tilings, and per edge its repartition price."""

    p: int
    by_op: dict[int, list[Candidate]] = field(default_factory=dict)
    tilings: TilingTable = field(default_factory=TilingTable)
    repartition: dict[tuple[int, int], float] = field(default_factory=dict)  # (op, input pos) -> price
    # pairwise models: (op, input pos) -> (producer tiling, required tiling) -> price
    prices: dict[tuple[int, int], dict[tuple[int, int], float]] = field(default_factory=dict)
    # (op, input pos) -> the operator whose output tiling the edge is priced from (Graph.source_op): its
    # producer, or for an assigned state the operator of its value; absent for inputs and parameters
    sources: dict[tuple[int, int], int] = field(default_factory=dict)
    carried: frozenset[tuple[int, int]] = frozenset()  # the edges reading an assigned state

    def readers(self) -> dict[int, list[tuple[int, int]]]:
        """Per operator, the (reader, input position) of every edge priced from its output tiling."""
        out: dict[int, list[tuple[int, int]]] = {v: [] for v in self.by_op}
        for (w, k), v in sorted(self.sources.items()):
            out[v].append((w, k))
        return out

    def eligible(self, op_id: int) -> list[Candidate]:
        return [c for c in self.by_op[op_id] if c.eligible]

    def edge_price(self, op_id: int, k: int, producer_tiling: int, required_tiling: int) -> float:
        """What input ``k`` of ``op_id`` pays when its producer's output tiling is ``producer_tiling`` and
        the spec reads ``required_tiling``: the pair's own price under a pairwise model, else the edge's
        repartition price when the two differ (the paper's rule)."""
        pairs = self.prices.get((op_id, k))
        if pairs is None:
            return 0.0 if producer_tiling == required_tiling else self.repartition[(op_id, k)]
        price = pairs.get((producer_tiling, required_tiling))
        if price is None:
            raise PlanError(f"input {k} of operator {op_id} has no price for producer tiling {producer_tiling} "
                            f"read as tiling {required_tiling}; pairs are priced for eligible specs only "
                            f"({len(pairs)} pairs known).")
        return price

    def arrow_prices(self) -> pa.Table:
        rows: dict[str, list] = {k: [] for k in ("op_id", "input_pos", "producer_tiling", "required_tiling", "price")}
        for (op_id, k), pairs in self.prices.items():
            for (theirs, wanted), price in pairs.items():
                rows["op_id"].append(op_id)
                rows["input_pos"].append(k)
                rows["producer_tiling"].append(theirs)
                rows["required_tiling"].append(wanted)
                rows["price"].append(price)
        schema = pa.schema([("op_id", pa.int32()), ("input_pos", pa.int32()), ("producer_tiling", pa.int32()),
                            ("required_tiling", pa.int32()), ("price", pa.float64())])
        return pa.table(rows, schema=schema)

    def arrow_specs(self) -> pa.Table:
        rows: dict[str, list] = {k: [] for k in ("op_id", "spec_id", "split", "intervals", "output_tiling", "join_cost",
                                                 "aggregation_cost", "compute_cost", "flops", "imbalance", "balanced",
                                                 "memory_bytes", "resident_bytes", "eligible", "layout_cost")}
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
                rows["layout_cost"].append(c.layout_cost)
        schema = pa.schema([("op_id", pa.int32()), ("spec_id", pa.int32()), ("split", pa.string()),
                            ("intervals", pa.string()), ("output_tiling", pa.int32()), ("join_cost", pa.float64()),
                            ("aggregation_cost", pa.float64()), ("compute_cost", pa.float64()),
                            ("flops", pa.float64()), ("imbalance", pa.float64()),
                            ("balanced", pa.bool_()), ("memory_bytes", pa.int64()),
                            ("resident_bytes", pa.int64()), ("eligible", pa.bool_()),
                            ("layout_cost", pa.float64())])
        return pa.table(rows, schema=schema)

    def floor(self, op_id: int, k: int, required_tiling: int) -> float:
        """The least price any producer tiling could deliver ``required_tiling`` at, under a pairwise model
        (0 under the paper's rule): what a spec charges itself for an input whose producer is planned
        later, so that reading a whole tensor on every device is not free just because its producer's
        plan is not known yet."""
        pairs = self.prices.get((op_id, k))
        if not pairs:
            return 0.0
        return min((price for (_, wanted), price in pairs.items() if wanted == required_tiling), default=0.0)

    def arrow_inputs(self, graph: Graph, tree_of: Mapping[int, int]) -> pa.Table:
        rows: dict[str, list] = {k: [] for k in ("op_id", "spec_id", "input_pos", "required_tiling", "producer_op",
                                                 "op_tree", "producer_tree", "repartition", "floor", "carried")}
        for op_id, cands in self.by_op.items():
            node = graph.nodes[op_id]
            for k, _ in enumerate(node.inputs):
                producer = self.sources.get((op_id, k))
                floors: dict[int, float] = {}
                for c in cands:
                    wanted = c.required[k]
                    if wanted not in floors:
                        floors[wanted] = self.floor(op_id, k, wanted) if c.eligible else 0.0
                    rows["floor"].append(floors[wanted])
                    rows["op_id"].append(op_id)
                    rows["spec_id"].append(c.spec_id)
                    rows["input_pos"].append(k)
                    rows["required_tiling"].append(c.required[k])
                    rows["producer_op"].append(producer)
                    rows["op_tree"].append(tree_of[op_id])
                    rows["producer_tree"].append(tree_of.get(producer) if producer is not None else None)
                    rows["repartition"].append(self.repartition[(op_id, k)])
                    rows["carried"].append((op_id, k) in self.carried)
        schema = pa.schema([("op_id", pa.int32()), ("spec_id", pa.int32()), ("input_pos", pa.int32()),
                            ("required_tiling", pa.int32()), ("producer_op", pa.int32()),
                            ("op_tree", pa.int32()), ("producer_tree", pa.int32()), ("repartition", pa.float64()),
                            ("floor", pa.float64()), ("carried", pa.bool_())])
        return pa.table(rows, schema=schema)


def build_candidates(graph: Graph, p: int, model: CostModel, memory_per_device: int | None = None,
                     limit_name: str = "memory_per_device",
                     constraints: Mapping[int, Mapping[str, int]] | None = None,
                     layouts: Mapping[int, Held] | None = None) -> Candidates:
    """Enumerate, cost and filter the specs of every operator of ``graph`` for ``p`` devices; specs whose
    working set exceeds ``memory_per_device`` bytes (the limit ``limit_name`` names) are not offered.

    ``constraints`` (operator id -> index -> count) keeps only the specs of an operator that split
    those indices that many ways, the balance rule applied among them (so a split that is only offered
    unbalanced is still honoured).

    ``layouts`` (graph input or state id -> the blocks it is held in) pins tensors' layouts: each
    reader's specs pay for moving the held blocks to the blocks they read, and the operator making a
    pinned state's value pays for writing it into them (``Candidate.layout_cost``); an edge reading a
    pinned state is not carried (it reads the pinned blocks, not its value's tiling)."""
    out = Candidates(p)
    saved_ids = set(graph.outputs.values())
    layouts = layouts or {}
    carried = []
    for node in graph.operators:
        for k, i in enumerate(node.inputs):
            src = graph.source_op(i) if i not in layouts else None
            if src is not None:
                out.sources[(node.id, k)] = src
                if src != i:
                    carried.append((node.id, k))
    out.carried = frozenset(carried)
    # id(spec) -> (the spec, kept alive for its id; the keys of its output and input block sets)
    keys: dict[int, tuple[JoinAggSpec, list[Tiling | frozenset[Box]]]] = {}
    for node in graph.operators:
        op = node.op
        assert op is not None
        pairs = specs_for(op, p)
        if not pairs:
            extents = ", ".join(f"{s.name}={s.extent}" for s in op.requestable()) or "none"
            raise PlanError(  # even one function spec is a decomposition: a defect of the operator's specs
                f"operator {node.name!r} ({op.kind}, output {op.output_type.shape}) offered no join-agg spec for "
                f"any count of function specs up to p={p} (shardable indices: {extents})."
            )
        cands = []
        graph_inputs = tuple(graph.nodes[i].op is None for i in node.inputs)
        saved = node.id in saved_ids
        for sid, (request, spec) in enumerate(pairs):
            if id(spec) not in keys:  # the identical layers of a deep model share their specs: keyed once
                keys[id(spec)] = (spec, [block_set_key(spec.output_tiling, op.output_type.box)] + [
                    block_set_key(spec.input_blocks(k), op.input_types[k].box) for k in range(len(node.inputs))])
            block_keys = keys[id(spec)][1]
            out_t = out.tilings.intern_key(node.id, block_keys[0])
            # a carried edge's blocks are interned as blocks of the state's value: its tilings compare
            required = tuple(out.tilings.intern_key(out.sources.get((node.id, k), i), block_keys[k + 1])
                             for k, i in enumerate(node.inputs))
            cands.append(Candidate(sid, request, spec, out_t, required, model.join(spec, graph_inputs),
                                   model.aggregation(spec, saved), spec_memory(spec), spec_resident(spec, graph_inputs),
                                   model.compute(spec, op)))
        if memory_per_device is not None:
            fitting = [c for c in cands if c.memory_bytes <= memory_per_device]
            if not fitting:
                lean = min(cands, key=lambda c: c.memory_bytes)
                raise OutOfMemoryPlanError(
                    f"operator {node.name!r} ({op.kind}) needs at least {lean.memory_bytes:,} bytes per device "
                    f"(its leanest spec, {lean.spec.split_text}, holds its input blocks and output block), but "
                    f"{limit_name} is {memory_per_device:,} bytes. Use more devices or a larger memory limit."
                )
            for c in cands:
                c.eligible = c.memory_bytes <= memory_per_device
        # the paper's cost model assumes balanced work: offer balanced specs, else the least unbalanced
        live = [c for c in cands if c.eligible]
        want = (constraints or {}).get(node.id)
        if want is not None:
            _constrain(node.name, live, want)
        else:
            floor = min(c.spec.imbalance for c in live)
            for c in live:
                c.eligible = c.spec.balanced or c.spec.imbalance <= floor
        out.by_op[node.id] = cands
        _price_layouts(graph, node.id, cands, layouts, model, out.tilings, p)
        for k, i in enumerate(node.inputs):
            out.repartition[(node.id, k)] = model.repartition(graph.nodes[i].type, p)
            if model.pairwise and graph.nodes[i].op is not None:
                out.prices[(node.id, k)] = _pair_prices(model, out.eligible(i), [c for c in cands if c.eligible], k)
    if model.pairwise:  # a carried edge's producer comes later in the graph: priced once both are known
        for w, k in sorted(out.carried):
            out.prices[(w, k)] = _pair_prices(model, out.eligible(out.sources[(w, k)]), out.eligible(w), k)
    return out


def _price_layouts(graph: Graph, op_id: int, cands: list[Candidate], layouts: Mapping[int, Held],
                   model: CostModel, tilings: TilingTable, p: int) -> None:
    """Charge each candidate of ``op_id`` for reading the pinned tensors among its inputs (from their held
    blocks) and for writing the value of a pinned state it makes (into the state's blocks): under a
    pairwise model the exchange's price, else the paper's rule (nothing when the blocks agree or the
    held copy is whole on every device, else the tensor's repartition price)."""
    if not layouts:  # the common case: nothing pinned, nothing to price
        return
    node = graph.nodes[op_id]
    writes = [s for s, v in graph.assignments.items() if v == op_id and s in layouts]
    reads = [(k, i) for k, i in enumerate(node.inputs) if i in layouts]
    if not writes and not reads:
        return
    distinct = {i: tuple(dict.fromkeys(box for box, _ in layouts[i])) for i in {i for _, i in reads} | set(writes)}
    keys = {i: block_set_key(distinct[i], graph.nodes[i].type.box) for i in distinct}
    for c in cands:
        total = 0.0
        for k, i in reads:
            t = graph.nodes[i].type
            if distinct[i] == (t.box,):  # whole on every device: each reader slices its own copy
                continue
            if model.pairwise:  # from one copy of each block
                total += model.move(distinct[i], tuple(f.inputs[k] for f in c.spec.functions), t.dtype, "sum")
            elif tilings.ids.get((i, keys[i])) != c.required[k]:
                total += model.repartition(t, p)
        for s in writes:
            held, t = layouts[s], graph.nodes[s].type
            if model.pairwise:
                per_device = {d: box for box, d in held}
                empty = Box((0,) * t.rank, (0,) * t.rank)
                total += model.move(tuple(f.output for f in c.spec.functions),
                                    tuple(per_device.get(d, empty) for d in range(p)), t.dtype,
                                    c.spec.aggregation.name)
            elif block_set_key(c.spec.output_tiling, t.box) != keys[s]:
                total += model.repartition(t, p)
        c.layout_cost = total


def _constrain(name: str, live: list[Candidate], want: Mapping[str, int]) -> None:
    """Keep eligible only the specs in ``live`` (those that fit the memory) that split as ``want`` says;
    refuse, naming the nearest legal splits, when none does."""
    def misses(c: Candidate) -> int:
        split = dict(c.spec.split)
        return sum(split.get(k) != v for k, v in want.items())

    def distance(c: Candidate) -> tuple[int, float]:  # indices off, then how far off (in factors of two)
        split = dict(c.spec.split)
        return misses(c), sum(abs(math.log2(split.get(k, 1) / v)) for k, v in want.items())

    matching = [c for c in live if misses(c) == 0]
    if not matching:
        ranked = sorted(live, key=lambda c: (*distance(c), c.spec.split_text))
        near = list(dict.fromkeys(c.spec.split_text for c in ranked))
        asked = ",".join(f"{k}={v}" for k, v in want.items())
        raise PlanError(f"operator {name!r} has no spec that splits {asked} (among those that fit the memory); "
                        f"the nearest legal splits: {', '.join(near[:4])}. Constrain it to one of those.")
    floor = min(c.spec.imbalance for c in matching)  # the balance rule, among the splits asked for
    keep = {id(c) for c in matching if c.spec.balanced or c.spec.imbalance <= floor}
    for c in live:
        c.eligible = id(c) in keep


def _pair_prices(model: CostModel, producers: list[Candidate], readers: list[Candidate],
                 k: int) -> dict[tuple[int, int], float]:
    """The price of every (producer output tiling, required tiling) pair of one edge.  Specs with the same
    tiling make and read their blocks the same number of times (near-equal intervals), so the first
    spec of each tiling stands for all of them."""
    made: dict[int, JoinAggSpec] = {}
    for c in producers:
        made.setdefault(c.output_tiling, c.spec)
    read: dict[int, JoinAggSpec] = {}
    for c in readers:
        read.setdefault(c.required[k], c.spec)
    return {(theirs, wanted): model.exchange(ps, rs, k) for theirs, ps in made.items() for wanted, rs in read.items()}

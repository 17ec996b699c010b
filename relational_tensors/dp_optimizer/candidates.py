"""Candidate join-agg specs of every operator, costed, as Arrow tables for the catalog.

Specs are enumerated once per distinct operator and device count (identical
layers of a deep model share them), costed by the chosen model, and filtered
by the balance and memory rules into the ``eligible`` set the selectors see;
the costing and filtering is done once per class of operators (``_Template``),
and only the tilings are interned per operator.  Under a pairwise cost model
every input edge also gets a price for each pair of (producer output tiling,
required tiling) that eligible specs can meet, worked out once per pair of
classes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.tiling import Tiling
from relational_tensors.core.types import Box, Interval
from relational_tensors.dp_optimizer import repeats
from relational_tensors.dp_optimizer.constraints import Held
from relational_tensors.dp_optimizer.costs import CostModel, TilingTable, block_set_key, spec_memory, spec_resident
from relational_tensors.dp_optimizer.enumerate import interval_requests
from relational_tensors.errors import OutOfMemoryPlanError, PlanError
from relational_tensors.graph.graph import Graph
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
    # op -> its class's candidates before interning: operators sharing one have equal specs, costs and
    # eligibility (layout costs aside), and so equal candidate lists up to the tensors' tiling ids
    templates: dict[int, _Template] = field(default_factory=dict)
    # op -> its class: equal classes have equal candidate lists (specs, costs, eligibility, layout costs),
    # tiling ids aside, whose order among one operator's output tilings is part of the class (ties go to
    # the lowest id); so an edge between two operators is priced alike wherever their classes meet
    classes: dict[int, int] = field(default_factory=dict)

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
        cols: dict[str, list] = {k: [] for k in ("op_id", "spec_id", "split", "intervals", "output_tiling", "join_cost",
                                                 "aggregation_cost", "compute_cost", "flops", "imbalance", "balanced",
                                                 "memory_bytes", "resident_bytes", "eligible", "layout_cost")}
        # a spec's texts and FLOPs, worked out once per spec (equal operators share their specs)
        shown: dict[tuple[int, int], tuple[str, str, float, float | None, bool]] = {}
        keep: list[object] = []  # the specs and requests whose ids key ``shown``
        for op_id, cands in self.by_op.items():
            cols["op_id"] += [op_id] * len(cands)
            for c in cands:
                key = (id(c.spec), id(c.request))
                texts = shown.get(key)
                if texts is None:
                    keep.append((c.spec, c.request))
                    imb = c.spec.imbalance
                    texts = shown[key] = (
                        c.spec.split_text, ";".join(f"{n}=" + ",".join(str(i) for i in ivs) for n, ivs in c.request),
                        c.spec.total_flops, imb if imb != float("inf") else None, c.spec.balanced)
                cols["spec_id"].append(c.spec_id)
                cols["split"].append(texts[0])
                cols["intervals"].append(texts[1])
                cols["output_tiling"].append(c.output_tiling)
                cols["join_cost"].append(c.join_cost)
                cols["aggregation_cost"].append(c.aggregation_cost)
                cols["compute_cost"].append(c.compute_cost)
                cols["flops"].append(texts[2])
                cols["imbalance"].append(texts[3])
                cols["balanced"].append(texts[4])
                cols["memory_bytes"].append(c.memory_bytes)
                cols["resident_bytes"].append(c.resident_bytes)
                cols["eligible"].append(c.eligible)
                cols["layout_cost"].append(c.layout_cost)
        schema = pa.schema([("op_id", pa.int32()), ("spec_id", pa.int32()), ("split", pa.string()),
                            ("intervals", pa.string()), ("output_tiling", pa.int32()), ("join_cost", pa.float64()),
                            ("aggregation_cost", pa.float64()), ("compute_cost", pa.float64()),
                            ("flops", pa.float64()), ("imbalance", pa.float64()),
                            ("balanced", pa.bool_()), ("memory_bytes", pa.int64()),
                            ("resident_bytes", pa.int64()), ("eligible", pa.bool_()),
                            ("layout_cost", pa.float64())])
        return pa.table(cols, schema=schema)

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
        cols: dict[str, list] = {k: [] for k in ("op_id", "spec_id", "input_pos", "required_tiling", "producer_op",
                                                 "op_tree", "producer_tree", "repartition", "floor", "carried")}
        for op_id, cands in self.by_op.items():
            n = len(cands)
            spec_ids = [c.spec_id for c in cands]
            for k in range(len(graph.nodes[op_id].inputs)):
                producer = self.sources.get((op_id, k))
                required = [c.required[k] for c in cands]
                if (op_id, k) in self.prices:  # the floor of each tiling read, priced at its first spec's eligibility
                    floors: dict[int, float] = {}
                    for c, wanted in zip(cands, required):
                        if wanted not in floors:
                            floors[wanted] = self.floor(op_id, k, wanted) if c.eligible else 0.0
                    cols["floor"] += [floors[wanted] for wanted in required]
                else:
                    cols["floor"] += [0.0] * n
                cols["op_id"] += [op_id] * n
                cols["spec_id"] += spec_ids
                cols["input_pos"] += [k] * n
                cols["required_tiling"] += required
                cols["producer_op"] += [producer] * n
                cols["op_tree"] += [tree_of[op_id]] * n
                cols["producer_tree"] += [tree_of.get(producer) if producer is not None else None] * n
                cols["repartition"] += [self.repartition[(op_id, k)]] * n
                cols["carried"] += [(op_id, k) in self.carried] * n
        schema = pa.schema([("op_id", pa.int32()), ("spec_id", pa.int32()), ("input_pos", pa.int32()),
                            ("required_tiling", pa.int32()), ("producer_op", pa.int32()),
                            ("op_tree", pa.int32()), ("producer_tree", pa.int32()), ("repartition", pa.float64()),
                            ("floor", pa.float64()), ("carried", pa.bool_())])
        return pa.table(cols, schema=schema)


def build_candidates(graph: Graph, p: int, model: CostModel, memory_per_device: int | None = None,
                     limit_name: str = "memory_per_device",
                     constraints: Mapping[int, Mapping[str, int]] | None = None,
                     layouts: Mapping[int, Held] | None = None, held: Collection[int] = ()) -> Candidates:
    """Enumerate, cost and filter the specs of every operator of ``graph`` for ``p`` devices; specs whose
    working set exceeds ``memory_per_device`` bytes (the limit ``limit_name`` names) are not offered.

    ``constraints`` (operator id -> index -> count) keeps only the specs of an operator that split
    those indices that many ways, the balance rule applied among them (so a split that is only offered
    unbalanced is still honoured).

    ``layouts`` (graph input or state id -> the blocks it is held in) pins tensors' layouts: each
    reader's specs pay for moving the held blocks to the blocks they read, and the operator making a
    pinned state's value pays for writing it into them (``Candidate.layout_cost``); an edge reading a
    pinned state is not carried (it reads the pinned blocks, not its value's tiling).

    ``held`` names the operators whose output blocks stay on their devices for the whole run (a pipeline's
    gradients, accumulated over its micro-batches): their bytes count as resident (``spec_resident``), which
    a memory-priced selection pays for."""
    out = Candidates(p)
    saved_ids = set(graph.outputs.values())
    held = frozenset(held)
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
    share = repeats.enabled()
    classes: dict[tuple[object, ...], _Template] = {}  # an operator's class -> its candidates, tilings not interned
    made = 0
    class_ids: dict[object, int] = {}
    pair_memo: dict[tuple[int, int, int], list[tuple[int, int, float]]] = {}
    for node in graph.operators:
        op = node.op
        assert op is not None
        graph_inputs = tuple(graph.nodes[i].op is None for i in node.inputs)
        want = (constraints or {}).get(node.id)
        key = (op, graph_inputs, node.id in saved_ids, None if want is None else tuple(sorted(want.items())),
               node.id in held)
        tmpl = classes.get(key) if share else None
        if tmpl is None:
            tmpl = _template(node.name, op, p, model, graph_inputs, node.id in saved_ids, memory_per_device,
                             limit_name, want, made, node.id in held)
            classes[key] = tmpl
            made += 1
        out.templates[node.id] = tmpl
        # the slots' block sets interned in the order the specs first name them (output, then each input),
        # so that tiling ids follow the specs whatever is shared
        slot_tensor = (node.id, *(out.sources.get((node.id, k), i) for k, i in enumerate(node.inputs)))
        ids = [out.tilings.intern_key(slot_tensor[slot], key_, row) for slot, key_, row in tmpl.firsts]
        cands = [Candidate(sid, request, spec, ids[at[0]], tuple(ids[a] for a in at[1:]), *costs, eligible=ok)
                 for sid, ((request, spec), at, costs, ok) in enumerate(zip(tmpl.pairs, tmpl.slots, tmpl.costs,
                                                                             tmpl.eligible))]
        out.by_op[node.id] = cands
        _price_layouts(graph, node.id, cands, layouts, model, out.tilings, p)
        layout = tuple(c.layout_cost for c in cands) if layouts else ()
        order = sorted(set(c.output_tiling for c in cands))
        cls = (tmpl.index, layout, tuple(order.index(c.output_tiling) for c in cands)) if share else node.id
        out.classes[node.id] = class_ids.setdefault(cls, len(class_ids))
        for k, i in enumerate(node.inputs):
            out.repartition[(node.id, k)] = model.repartition(graph.nodes[i].type, p)
            if model.pairwise and graph.nodes[i].op is not None:
                out.prices[(node.id, k)] = _edge_prices(model, out, i, node.id, k, pair_memo)
    if model.pairwise:  # a carried edge's producer comes later in the graph: priced once both are known
        for w, k in sorted(out.carried):
            out.prices[(w, k)] = _edge_prices(model, out, out.sources[(w, k)], w, k, pair_memo)
    return out


@dataclass(frozen=True, slots=True)
class _Template:
    """The candidates of one class of operators before their block sets are interned as tilings: equal
    operators (the identical layers of a deep model) with the same graph-input pattern, saved flag and
    split constraint get the same specs, costs and eligibility, so they are worked out once per class.

    ``firsts`` lists each (slot, block-set key, catalog row) in the order the specs first name it
    (slot 0 the output, k + 1 input k); ``slots`` gives, per spec, the index in ``firsts`` of its output's
    and each input's block set; ``costs`` the Candidate's (join, aggregation, memory, resident, compute)."""

    index: int
    pairs: tuple[tuple[tuple[tuple[str, tuple[Interval, ...]], ...], JoinAggSpec], ...]
    firsts: tuple[tuple[int, Tiling | frozenset[Box], tuple[bool, str, str, int]], ...]
    slots: tuple[tuple[int, ...], ...]
    costs: tuple[tuple[float, float, int, int, float], ...]
    eligible: tuple[bool, ...]


def _template(name: str, op: Operator, p: int, model: CostModel, graph_inputs: tuple[bool, ...], saved: bool,
              memory_per_device: int | None, limit_name: str, want: Mapping[str, int] | None,
              index: int, held: bool = False) -> _Template:
    """The candidates of operator ``op`` (named ``name`` in errors): specs, costs, eligibility, block sets;
    ``held``: its output blocks count as resident (``spec_resident``)."""
    pairs = specs_for(op, p)
    if not pairs:
        extents = ", ".join(f"{s.name}={s.extent}" for s in op.requestable()) or "none"
        raise PlanError(  # even one function spec is a decomposition: a defect of the operator's specs
            f"operator {name!r} ({op.kind}, output {op.output_type.shape}) offered no join-agg spec for "
            f"any count of function specs up to p={p} (shardable indices: {extents})."
        )
    spaces = (op.output_type.box, *(t.box for t in op.input_types))
    firsts: dict[tuple[int, object], int] = {}
    rows: list[tuple[int, Tiling | frozenset[Box], tuple[bool, str, str, int]]] = []
    slots = []
    costs = []
    for _, spec in pairs:
        at = []
        sets: list[tuple[Box, ...] | Tiling] = [spec.output_tiling]
        sets += [spec.input_blocks(k) for k in range(len(op.input_types))]
        for slot, blocks in enumerate(sets):
            key = block_set_key(blocks, spaces[slot])
            n = firsts.get((slot, key))
            if n is None:
                n = firsts[(slot, key)] = len(rows)
                rows.append((slot, key, TilingTable.row_text(key)))
            at.append(n)
        slots.append(tuple(at))
        costs.append((model.join(spec, graph_inputs), model.aggregation(spec, saved), spec_memory(spec),
                      spec_resident(spec, graph_inputs, held), model.compute(spec, op)))
    fits = [memory_per_device is None or c[2] <= memory_per_device for c in costs]
    if not any(fits):
        lean = min(range(len(pairs)), key=lambda s: costs[s][2])
        raise OutOfMemoryPlanError(
            f"operator {name!r} ({op.kind}) needs at least {costs[lean][2]:,} bytes per device "
            f"(its leanest spec, {pairs[lean][1].split_text}, holds its input blocks and output block), but "
            f"{limit_name} is {memory_per_device:,} bytes. Use more devices or a larger memory limit."
        )
    # the paper's cost model assumes balanced work: offer balanced specs, else the least unbalanced
    live = [s for s in range(len(pairs)) if fits[s]]
    if want is not None:
        keep = _constrain(name, [(s, pairs[s][1]) for s in live], want)
    else:
        floor = min(pairs[s][1].imbalance for s in live)
        keep = {s for s in live if pairs[s][1].balanced or pairs[s][1].imbalance <= floor}
    return _Template(index, pairs, tuple(rows), tuple(slots), tuple(costs),
                     tuple(s in keep for s in range(len(pairs))))


def _edge_prices(model: CostModel, out: Candidates, producer: int, reader: int, k: int,
                 memo: dict[tuple[int, int, int], list[tuple[int, int, float]]]) -> dict[tuple[int, int], float]:
    """``_pair_prices`` of the edge into input ``k`` of ``reader``, priced once per pair of operator classes
    (the prices depend on the two operators' eligible specs only) and keyed by the edge's tiling ids."""
    made, read = out.by_op[producer], out.by_op[reader]
    key = (out.templates[producer].index, out.templates[reader].index, k)
    rows = memo.get(key)
    if rows is None:  # (producer spec, reader spec, price): the first eligible spec of each tiling stands for all
        firsts: dict[int, int] = {}
        for c in made:
            if c.eligible:
                firsts.setdefault(c.output_tiling, c.spec_id)
        wants: dict[int, int] = {}
        for c in read:
            if c.eligible:
                wants.setdefault(c.required[k], c.spec_id)
        rows = memo[key] = [(s, t, model.exchange(made[s].spec, read[t].spec, k))
                            for s in firsts.values() for t in wants.values()]
    return {(made[s].output_tiling, read[t].required[k]): price for s, t, price in rows}


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


def _constrain(name: str, live: list[tuple[int, JoinAggSpec]], want: Mapping[str, int]) -> set[int]:
    """The spec ids among ``live`` (those that fit the memory) that split as ``want`` says and pass the
    balance rule among themselves; refuse, naming the nearest legal splits, when none does."""
    def misses(spec: JoinAggSpec) -> int:
        split = dict(spec.split)
        return sum(split.get(k) != v for k, v in want.items())

    def distance(spec: JoinAggSpec) -> tuple[int, float]:  # indices off, then how far off (in factors of two)
        split = dict(spec.split)
        return misses(spec), sum(abs(math.log2(split.get(k, 1) / v)) for k, v in want.items())

    matching = [(s, spec) for s, spec in live if misses(spec) == 0]
    if not matching:
        ranked = sorted((spec for _, spec in live), key=lambda spec: (*distance(spec), spec.split_text))
        near = list(dict.fromkeys(spec.split_text for spec in ranked))
        asked = ",".join(f"{k}={v}" for k, v in want.items())
        raise PlanError(f"operator {name!r} has no spec that splits {asked} (among those that fit the memory); "
                        f"the nearest legal splits: {', '.join(near[:4])}. Constrain it to one of those.")
    floor = min(spec.imbalance for _, spec in matching)  # the balance rule, among the splits asked for
    return {s for s, spec in matching if spec.balanced or spec.imbalance <= floor}

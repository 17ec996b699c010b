"""Pipeline stages: consecutive layers on groups of devices, the batch split into micro-batches in time.

A pipelined plan of ``p`` devices cuts them into ``stages`` equal groups of consecutive devices (a node
each, on a machine of nodes) and gives every operator a stage.  Inside a stage the plan is the DP's plan
for ``p / stages`` devices (the intra-operator splits of every operator, chosen as for one stage holding
the whole model); each operator's function specs are placed on its stage's devices only, so the tensors
that cross a stage boundary move between groups by the exchange programs that serve any other edge.

Micro-batches are a split along time: an operator that carries the batch (an index that splits the first
dimension of the data inputs, through every tensor computed from them) has that index cut ``m`` times
more finely, and the ``m`` function specs of one block of the stage's plan run in sequence on the device
of that block.  A weight's gradient, which sums over the batch, becomes ``m`` partial sums that the
plan's ⊕ combines: gradient accumulation.  The schedule (``gpipe``: every micro-batch's forward, then
every backward; ``1f1b``: after a warm-up of ``stages - s - 1`` forwards, stage ``s`` alternates one
forward and one backward) is the order each device runs its tasks in (``physical.schedule``); the bubble
is what the simulation of that order shows.

Stages follow the weights.  Each weight the loss reads (a parameter, or a state whose readers lead to a
saved output) gets a position: the topological index of its first reader.  An operator's position is the
smaller of the latest weight it depends on (forward: the layer it is in) and the latest weight whose
update depends on it (backward and the optimizer: the layer whose gradient it computes); positions are
cut into ``stages`` runs of consecutive positions with near-equal work (FLOPs of every operator at that
position, forward, backward and update together).  Names are never read.

>>> Pipeline(2, 4).validate(8)
Pipeline(stages=2, micro_batches=4, schedule='gpipe')
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from relational_tensors.core.spec import ANY, JoinAggSpec, ShardableIndex
from relational_tensors.core.types import Interval
from relational_tensors.dp_optimizer.plan import LogicalPlan
from relational_tensors.dp_optimizer.plans import batch_indices
from relational_tensors.errors import PlanError
from relational_tensors.graph.graph import Graph

__all__ = ["Pipeline", "PIPELINE_SCHEDULES", "PipelinedPlan", "positions", "assign_stages", "pipelined",
           "forward_ops", "ancestors", "parse_pipeline"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Pipeline:
    """``stages`` groups of consecutive devices, ``micro_batches`` slices of the batch run in sequence,
    and the order they run in (``PIPELINE_SCHEDULES``)."""

    stages: int
    micro_batches: int = 1
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        for what, v in (("stages", self.stages), ("micro_batches", self.micro_batches)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"pipeline {what} must be a positive integer; got {v!r}.")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise PlanError(f"unknown pipeline schedule {self.schedule!r}; choose one of {PIPELINE_SCHEDULES}.")

    def validate(self, p: int) -> Pipeline:
        """This pipeline if its stages divide ``p`` devices, else a PlanError that says which would."""
        if p % self.stages:
            ok = [s for s in range(1, p + 1) if p % s == 0]
            raise PlanError(f"a pipeline cuts the {p} devices into equal stages; {self.stages} stages do not "
                            f"divide them. Use one of {ok}.")
        return self

    def groups(self, p: int) -> tuple[tuple[int, ...], ...]:
        """The devices of each stage: consecutive runs of ``p / stages``."""
        per = p // self.stages
        return tuple(tuple(range(s * per, (s + 1) * per)) for s in range(self.stages))


def parse_pipeline(value: object) -> Pipeline | str | None:
    """``None``, a :class:`Pipeline`, a mapping of its fields (``{"stages": 2, "micro_batches": 4}``), or
    ``"auto"`` (the planner chooses: ``driver.pipelines``)."""
    if value is None or isinstance(value, Pipeline) or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"stages", "micro_batches", "schedule"})
        if unknown or "stages" not in value:
            raise PlanError(f"pipeline takes stages, micro_batches and schedule (stages required); got "
                            f"{sorted(value)}.")
        return Pipeline(**value)
    raise PlanError(f"pipeline is None, 'auto', rt.Pipeline(stages, micro_batches, schedule) or a dict of those; "
                    f"got {value!r}.")


def ancestors(graph: Graph, tensors: Iterable[int]) -> set[int]:
    """Every tensor (node id) that ``tensors`` depend on, themselves included."""
    seen: set[int] = set()
    todo = list(tensors)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph.nodes[n].inputs)
    return seen


def _saved(graph: Graph) -> list[int]:
    """The saved outputs that are no state's next value (in a training step: the loss)."""
    values = set(graph.assignments.values())
    return [n for n in graph.outputs.values() if n not in values]


def forward_ops(graph: Graph) -> set[int]:
    """The operators the saved outputs depend on (in a training step: the forward pass and the loss)."""
    return {n for n in ancestors(graph, _saved(graph)) if graph.nodes[n].op is not None}


def positions(graph: Graph) -> dict[int, int]:
    """Each operator's position (module docstring): min(latest weight it reads through its inputs, latest
    weight whose update reads it); a backward operator that reads a weight itself (a product giving an input
    gradient) takes that weight's, so the weight is read in one stage only; an update's step that reads no
    weight (a moment's decay) takes the weight it updates; -1 for a forward operator that depends on no
    weight."""
    forward = ancestors(graph, _saved(graph))  # weights included
    readers = graph.consumers()
    weight_pos: dict[int, int] = {}
    for n in graph.inputs:
        if n.role in ("parameter", "state") and n.id in forward and readers.get(n.id):
            weight_pos[n.id] = min(readers[n.id])
    late: dict[int, int] = {}  # the latest weight each node depends on
    for n in graph.nodes:
        late[n.id] = weight_pos.get(n.id, max((late[i] for i in n.inputs), default=-1))
    # the latest and the earliest weight whose new value depends on each node; a scalar operator that
    # several weights' updates read (a clipping coefficient: the norm of every gradient) passes on neither,
    # so the gradients it scales keep their own weight's position instead of the last weight's
    update: dict[int, int] = {}
    first: dict[int, int] = {}
    for state, value in graph.assignments.items():
        if state in weight_pos:
            update[value] = max(update.get(value, -1), weight_pos[state])
            first[value] = min(first.get(value, weight_pos[state]), weight_pos[state])
    for n in reversed(graph.nodes):
        at = update.get(n.id)
        if at is None or (n.op is not None and n.type.volume == 1 and first[n.id] != at):
            continue
        for i in n.inputs:
            update[i] = max(update.get(i, -1), at)
            first[i] = min(first.get(i, at), first[n.id])
    out: dict[int, int] = {}
    for n in graph.operators:
        read = [weight_pos[i] for i in n.inputs if i in weight_pos]
        if n.id in forward:
            out[n.id] = min(late[n.id], update.get(n.id, late[n.id]))
        elif read:  # a backward product with a weight (its input gradient) stays with the weight
            out[n.id] = max(read)
        elif n.id in update:  # the rest of the backward and the update; a moment's decay (no weight) with its weight
            out[n.id] = update[n.id] if late[n.id] < 0 else min(late[n.id], update[n.id])
        else:  # read by no update but through a global scalar (a gradient's square sum): where its inputs are
            out[n.id] = max((out[i] for i in n.inputs if i in out), default=late[n.id])
    return out


def assign_stages(graph: Graph, stages: int) -> dict[int, int]:
    """Each operator's stage: positions cut into ``stages`` runs of near-equal FLOPs, in order."""
    pos = positions(graph)
    work: dict[int, float] = {}
    for n in graph.operators:
        assert n.op is not None
        ins = tuple(graph.nodes[i].type.box for i in n.inputs)
        work[pos[n.id]] = work.get(pos[n.id], 0.0) + max(float(n.op.flops(ins, n.type.box)), 1.0)
    order = sorted(work)
    total = sum(work.values())
    cuts: list[int] = []  # the first position of stages 1..stages-1
    acc = 0.0
    for x in order:
        while len(cuts) < stages - 1 and acc >= total * (len(cuts) + 1) / stages:
            cuts.append(x)
        acc += work[x]
    return {op: bisect.bisect_right(cuts, x) for op, x in pos.items()}


def _subdivide(index: ShardableIndex, iv: Interval, m: int) -> tuple[Interval, ...]:
    """``iv`` cut into up to ``m`` near-equal intervals at the index's legal positions inside it."""
    inside = tuple(c - iv.lo for c in index.legal_cuts() if iv.lo < c < iv.hi)
    part = ShardableIndex(index.name, iv.size, positions=inside if index.positions != ANY else ANY)
    ivs = part.near_equal(min(m, part.max_intervals()))
    assert ivs is not None  # at most as many intervals as the legal cuts allow
    return tuple(Interval(a.lo + iv.lo, a.hi + iv.lo) for a in ivs)


@dataclass
class PipelinedPlan(LogicalPlan):
    """A logical plan for the devices of one stage, laid out over ``pipeline.stages`` groups with each
    operator's batch index cut into micro-batches.  ``spec`` is the spec the lowering runs (the micro-batched
    one); ``coarse`` the stage plan's own, whose blocks ``coarse_of`` maps each function spec to."""

    pipeline: Pipeline = field(default_factory=lambda: Pipeline(1))
    devices: int = 1
    stage_of: dict[int, int] = field(default_factory=dict)
    forward: frozenset[int] = frozenset()
    fine: dict[int, JoinAggSpec] = field(default_factory=dict)
    coarse_of: dict[int, tuple[int, ...]] = field(default_factory=dict)   # op -> coarse function of each
    micro_of: dict[int, tuple[int, ...]] = field(default_factory=dict)    # op -> micro-batch of each

    @property
    def p(self) -> int:
        return self.devices

    def spec(self, op: str | int) -> JoinAggSpec:
        node = self.graph.node(op) if isinstance(op, str) else self.graph.nodes[op]
        return self.fine.get(node.id) or self.candidate(node.id).spec

    def coarse(self, op_id: int) -> JoinAggSpec:
        return self.candidate(op_id).spec

    def group(self, op_id: int) -> tuple[int, ...]:
        return self.pipeline.groups(self.devices)[self.stage_of[op_id]]

    def micro_batch(self, op_id: int, g: int) -> int | None:
        """The micro-batch function spec ``g`` of ``op_id`` computes, or None (the operator carries no batch)."""
        m = self.micro_of.get(op_id)
        return None if m is None else m[g]


def pipelined(plan: LogicalPlan, pipeline: Pipeline, devices: int) -> PipelinedPlan:
    """``plan`` (chosen for ``devices / stages`` devices) over ``devices``: stages and micro-batches."""
    graph = plan.graph
    stage_of = assign_stages(graph, pipeline.stages)
    batch = batch_indices(graph) if pipeline.micro_batches > 1 else {}
    fine: dict[int, JoinAggSpec] = {}
    coarse_of: dict[int, tuple[int, ...]] = {}
    micro_of: dict[int, tuple[int, ...]] = {}
    memo: dict[tuple[int, str], tuple[JoinAggSpec, tuple[int, ...], tuple[int, ...]]] = {}
    for n in graph.operators:
        name = batch.get(n.id)
        if name is None:
            continue
        cand = plan.candidate(n.id)
        key = (id(cand.spec), name)
        if key not in memo:
            assert n.op is not None
            index = {s.name: s for s in n.op.requestable()}[name]
            request = dict(cand.request)
            coarse_ivs = request.get(name, (Interval(0, index.extent),))
            parts = [_subdivide(index, iv, pipeline.micro_batches) for iv in coarse_ivs]
            request[name] = tuple(iv for part in parts for iv in part)
            spec = n.op.spec(request)
            position = [s.name for s in n.op.requestable()].index(name)
            owner = [(c, k) for c, part in enumerate(parts) for k in range(len(part))]  # fine -> (coarse, micro)
            by_coords = {f.coords: g for g, f in enumerate(cand.spec.functions)}
            coarse, micro = [], []
            for f in spec.functions:
                c, k = owner[f.coords[position]]
                coords = list(f.coords)
                coords[position] = c
                coarse.append(by_coords[tuple(coords)])
                micro.append(k)
            memo[key] = (spec, tuple(coarse), tuple(micro))
        fine[n.id], coarse_of[n.id], micro_of[n.id] = memo[key]
    return PipelinedPlan(graph, plan.candidates, plan.choice, plan.selector, plan.cost_model, pipeline=pipeline,
                         devices=devices, stage_of=stage_of, forward=frozenset(forward_ops(graph)), fine=fine,
                         coarse_of=coarse_of, micro_of=micro_of)

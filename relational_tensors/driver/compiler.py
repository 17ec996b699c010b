"""Compilation: an ordered, literal list of passes from a graph to a plan.

>>> import relational_tensors as rt
>>> g = rt.Graph(); a = g.input("a", [64, 64]); b = g.input("b", [64, 64])
>>> _ = g.save(g.matmul(a, b), name="c")
>>> run(g, rt.CompileOptions(device="cpu:8")).plan.split("matmul_2")
'i=2,j=2,k=2'
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa

from relational_tensors.catalog import Catalog
from relational_tensors.core.dtypes import itemsize, partial_dtype
from relational_tensors.dp_optimizer import repeats
from relational_tensors.dp_optimizer.candidates import build_candidates
from relational_tensors.dp_optimizer.constraints import parse_constraints
from relational_tensors.dp_optimizer.costs import cost_model as get_cost_model
from relational_tensors.dp_optimizer.pipeline import Pipeline, PipelinedPlan, pipelined
from relational_tensors.dp_optimizer.plan import LogicalPlan
from relational_tensors.dp_optimizer.plans import batch_sums
from relational_tensors.dp_optimizer.select import select_dp, select_exact, select_greedy, select_random
from relational_tensors.dp_optimizer.trees import cut_pieces
from relational_tensors.driver.compiled import CompiledGraph
from relational_tensors.driver.options import CompileOptions
from relational_tensors.driver.registry import operator_table
from relational_tensors.driver.state import CompileState
from relational_tensors.errors import GraphError, OutOfMemoryPlanError, PlanError
from relational_tensors.graph.graph import Graph
from relational_tensors.machine.target import Target
from relational_tensors.physical.lower import Lowered, covers, lower, value_blocks
from relational_tensors.physical.tasks import KernelPayload, Liveness, graph_liveness

__all__ = ["run", "CompiledGraph", "PASSES"]

# per-pass timings at INFO, each pass's start at DEBUG (with extra fields rt_pass, rt_index and rt_total, which
# the command line's progress bar reads); the library adds no handler beyond the package's NullHandler
log = logging.getLogger("relational_tensors.compile")

_GC_YOUNG = 100_000  # net allocations between collections of the youngest generation while searching (Python: 700)


def _pass_target(s: CompileState) -> None:
    o = s.options
    s.target = Target.resolve(o.device, o.topology, o.calibration)
    s.limits = _device_memory(s)
    s.limit = min(s.limits.values()) if s.limits else None
    devices = s.target.devices
    from relational_tensors._version import __version__

    s.cid = s.catalog.new_compilation(label=o.label or ",".join(s.graph.outputs), devices=devices.p,
                                      device=str(devices), selector=o.selector, seed=o.seed,
                                      cost_model=o.cost_model,
                                      memory_per_device=s.limit, topology=s.target.topology.name,
                                      schedule_mode="search" if o.searched else "naive", tactic=o.tactic,
                                      calibration=s.target.kernels.source, keep_states=o.keep_states,
                                      graph_fingerprint=s.graph.fingerprint(), version=__version__,
                                      cost_unit=COST_UNITS.get(o.cost_model, o.cost_model),
                                      memory_limit=o.memory_per_device, **_pipeline_fields(o.pipeline))


def _pipeline_fields(pipe: object) -> dict[str, object]:
    """The compilations columns of a pipeline option (one stage, one micro-batch without one)."""
    if isinstance(pipe, Pipeline):
        return dict(stages=pipe.stages, micro_batches=pipe.micro_batches, pipeline_schedule=pipe.schedule)
    return dict(stages=1, micro_batches=1, pipeline_schedule=None)


def _stage_p(s: CompileState) -> int:
    """The devices the DP plans for: all of them, or one pipeline stage's."""
    assert s.target is not None
    pipe = s.options.pipeline
    return s.target.p // pipe.validate(s.target.p).stages if isinstance(pipe, Pipeline) else s.target.p


def _pass_candidates(s: CompileState) -> None:
    assert s.target is not None
    model = get_cost_model(s.options.cost_model, s.target)
    p = _stage_p(s)
    s.constraints = parse_constraints(s.graph.nodes, s.options.constraints, p)
    pipe = s.options.pipeline
    # under micro-batches a sum over the batch (a weight's gradient) is held from the first to the last
    held = batch_sums(s.graph) if isinstance(pipe, Pipeline) and pipe.micro_batches > 1 else ()
    s.candidates = build_candidates(s.graph, p, model, s.limit,
                                    "memory_per_device" if s.options.memory_per_device is not None
                                    else s.target.memory_source(), constraints=s.constraints.splits,
                                    layouts=s.constraints.layouts, held=held)


def _pass_pieces(s: CompileState) -> None:
    s.pieces, s.cut = cut_pieces(s.graph, s.options.tactic)


def _pass_catalog(s: CompileState) -> None:
    g, cat, cid = s.graph, s.catalog, s.cid
    assert s.candidates is not None
    consumers = g.consumers()
    saved = set(g.outputs.values())
    cat.insert("tensors", pa.table({
        "tensor_id": pa.array([n.id for n in g.nodes], pa.int32()),
        "name": [n.name for n in g.nodes],
        "role": [n.role for n in g.nodes],
        "dtype": [n.type.dtype for n in g.nodes],
        "shape": ["x".join(map(str, n.type.shape)) for n in g.nodes],
        "dims": [",".join(n.type.names) for n in g.nodes],
        "elements": pa.array([n.type.volume for n in g.nodes], pa.int64()),
        "bytes": pa.array([n.type.nbytes for n in g.nodes], pa.int64()),
        "consumers": pa.array([len(consumers[n.id]) for n in g.nodes], pa.int32()),
        "saved": [n.id in saved for n in g.nodes],
    }), cid)
    cat.insert("operator_kinds", operator_table(), cid)
    piece_of = {v: pc.piece_id for pc in s.pieces for v in pc.members}
    ops = g.operators
    texts: dict[int, tuple[str, str, str, str]] = {}  # per class of equal operators: signature, params, ...
    for n in ops:
        cls = s.candidates.templates[n.id].index
        if cls not in texts:
            op = n.op
            assert op is not None
            texts[cls] = (op.signature(), json.dumps(op.params(), default=str),
                          ",".join(f"{x.name}={x.extent}" for x in op.requestable()), str(op.aggregation))
    described = [texts[s.candidates.templates[n.id].index] for n in ops]
    cat.insert("operators", pa.table({
        "op_id": pa.array([n.id for n in ops], pa.int32()),
        "op_name": [n.name for n in ops],
        "op_kind": [n.kind for n in ops],
        "signature": [d[0] for d in described],
        "params": [d[1] for d in described],
        "shardable": [d[2] for d in described],
        "aggregation": [d[3] for d in described],
        "tree_id": pa.array([piece_of[n.id] for n in ops], pa.int32()),
    }), cid)
    sources, carried = s.candidates.sources, s.candidates.carried
    edges = [(n.id, k, i, sources.get((n.id, k)), s.cut[(n.id, k)], (n.id, k) in carried)
             for n in ops for k, i in enumerate(n.inputs)]
    cat.insert("edges", pa.table({
        "op_id": pa.array([e[0] for e in edges], pa.int32()),
        "input_pos": pa.array([e[1] for e in edges], pa.int32()),
        "tensor_id": pa.array([e[2] for e in edges], pa.int32()),
        "producer_op": pa.array([e[3] for e in edges], pa.int32()),
        "cut": [e[4] for e in edges],
        "carried": [e[5] for e in edges],
    }), cid)
    pinned = s.options.constraints
    if pinned:
        cat.insert("constraints", pa.table({"target": [t for t, _ in pinned],
                                            "target_id": pa.array([g.node(t).id for t, _ in pinned], pa.int32()),
                                            "kind": [s.constraints.kinds[t] for t, _ in pinned],
                                            "value": [v for _, v in pinned]}), cid)
    cat.insert("tilings", s.candidates.tilings.arrow(), cid)
    cat.insert("candidate_specs", s.candidates.arrow_specs(), cid)
    cat.insert("spec_inputs", s.candidates.arrow_inputs(g, piece_of), cid)
    if s.candidates.prices:
        cat.insert("edge_prices", s.candidates.arrow_prices(), cid)


def _choose(s: CompileState, memory_price: float = 0.0) -> tuple[dict[int, int], LogicalPlan]:
    """One spec per operator by the options' selector (``memory_price``: per resident byte, DP only)."""
    assert s.candidates is not None
    sel = s.options.selector
    if sel == "dp":
        choice = select_dp(s.catalog, s.cid, s.graph, s.candidates, s.pieces, memory_price=memory_price,
                           refine_choice=s.options.refine)
    elif sel == "exact":
        choice = select_exact(s.catalog, s.cid, s.graph, s.candidates, memory_price=memory_price)
    elif sel == "greedy":
        choice = select_greedy(s.catalog, s.cid)
    else:
        choice = select_random(s.catalog, s.cid, s.candidates, s.options.seed)
    plan = LogicalPlan(s.graph, s.candidates, choice, sel, s.options.cost_model)
    if isinstance(s.options.pipeline, Pipeline):
        assert s.target is not None
        plan = pipelined(plan, s.options.pipeline, s.target.p)
    return choice, plan


def _pass_select(s: CompileState) -> None:
    s.choice, s.plan = _choose(s)


def _pass_check(s: CompileState) -> None:
    """Changes nothing: every operator has one spec of at most p function specs (p unless it is too
    small to split so) whose outputs tile its output."""
    assert s.plan is not None and s.target is not None
    p = _stage_p(s)
    for n in s.graph.operators:
        if n.id not in s.choice:
            raise PlanError(f"check after 'select': operator {n.name!r} has no spec.")
        spec = s.plan.coarse(n.id) if isinstance(s.plan, PipelinedPlan) else s.plan.spec(n.id)
        if not 1 <= spec.p <= p:
            raise PlanError(f"check after 'select': {n.name!r} has {spec.p} function specs for p={p}.")
        if spec.output_type != n.type or spec.output_tiling.space != n.type.box:
            raise PlanError(f"check after 'select': the spec of {n.name!r} changed its output type.")


@contextmanager
def _collecting(on: bool) -> Iterator[None]:
    """Python's cyclic collector running, if ``on``, at a young-generation threshold of at least _GC_YOUNG;
    then off again with the caller's thresholds.  The search leaves reference cycles in proportion to the
    proposals it judges, not to the plan, so they are reclaimed as it goes."""
    thresholds = gc.get_threshold()
    if not on or gc.isenabled() or not thresholds[0]:  # threshold 0: the caller wants no automatic collection
        yield
        return
    gc.set_threshold(max(thresholds[0], _GC_YOUNG), *thresholds[1:])
    gc.enable()
    try:
        yield
    finally:
        gc.disable()
        gc.set_threshold(*thresholds)


def _searched(s: CompileState, plan: LogicalPlan, naive: Lowered) -> Lowered:
    """``plan`` lowered with searched exchange programs, unless the whole plan simulates faster with the
    naive ones (``naive``): the search improves each program on its own, and programs that overlap can
    interfere on shared links.  The programs share ``search_total_steps``, weighed by their naive runs in
    ``naive`` (the programs of assigned states keep their devices and are not searched)."""
    from relational_tensors.exchange.searcher import make_searcher
    from relational_tensors.physical.simulate import simulate_plan

    assert s.target is not None
    t, o = s.target, s.options
    synth = make_searcher(t.topology, seed=o.seed, budget_s=o.search_budget_s, max_steps=o.search_steps,
                          total_steps=o.search_total_steps)
    with _collecting(s.collect):
        synth.spread((prog, naive.memberships.get(name, {})) for name, prog in naive.programs.items()
                     if not name.startswith("assign:"))
        searched = _lower(s, plan, synth)
    s.search_timeouts = sum(r.out_of_time for r in synth.results)
    s.searched_programs = len(synth.results)
    log.info("search: %d exchange programs, %d at their lower bound, %d proposals judged (limit %s over the plan, "
             "%s per program)", len(synth.results), sum(r.at_bound for r in synth.results),
             sum(r.steps for r in synth.results), o.search_total_steps, o.search_steps)
    if s.search_timeouts:
        log.warning("search: the budget of %g s per program stopped %d of %d searches, so the plan depends on "
                    "this machine's speed; raise search_budget_s or lower search_total_steps", o.search_budget_s,
                    s.search_timeouts, len(synth.results))
    if simulate_plan(naive.dag, s.graph, t.topology, t.kernels, t.shared_gpus).time < simulate_plan(
            searched.dag, s.graph, t.topology, t.kernels, t.shared_gpus).time:
        return naive
    return searched


def _lower(s: CompileState, plan: LogicalPlan, synthesize: Any = None, kept: dict[int, str] | None = None) -> Lowered:
    """``plan`` lowered under the compilation's kept states (or ``kept``), pinned layouts and phases."""
    return lower(plan, "naive", synthesize, kept=s.kept if kept is None else kept,
                 later=s.options.second_phase_inputs, layouts=s.constraints.layouts, share=repeats.enabled(),
                 fold=s.fold)


def _relowered(s: CompileState, plan: LogicalPlan) -> tuple[Lowered, Liveness]:
    """``plan`` lowered again (and searched, as the passes before did), with its liveness."""
    lowered = _lower(s, plan)
    if s.options.searched:
        lowered = _searched(s, plan, lowered)
    return lowered, _liveness(s, lowered.dag)


def _pass_lower(s: CompileState) -> None:
    assert s.plan is not None
    if s.options.keep_states != "auto":
        s.kept = {state: s.options.keep_states for state in s.graph.assignments}
    s.kept.update({state: "pinned" for state in s.graph.assignments if state in s.constraints.layouts})
    s.lowered = _lower(s, s.plan)


def _pass_search(s: CompileState) -> None:
    if s.options.searched:
        assert s.plan is not None and s.lowered is not None
        s.lowered = _searched(s, s.plan, s.lowered)


def _device_memory(s: CompileState) -> dict[int, int] | None:
    """Bytes each logical device may use: memory_per_device, else what the target has (each GPU's
    memory, an absent machine's from its topology, the host's available memory for CPU devices)."""
    assert s.target is not None
    if s.options.memory_per_device is not None:
        return {d: s.options.memory_per_device for d in range(s.target.p)}
    return s.target.memory()


def _liveness(s: CompileState, dag: Any, categories: bool = False) -> Liveness:
    """The liveness of a lowering of the graph, with the kernels' scratch at its task on a GPU target (the
    GPU executor gives it in the arena, alive during its task); CPU devices' NumPy kernels need none."""
    assert s.target is not None
    scratch = None
    if s.target.devices.kind == "cuda":
        from relational_tensors.kernels.launchers import kernel_scratch

        scratch = kernel_scratch(dag)
    return graph_liveness(s.graph, dag, categories=categories, scratch=scratch)


def _fits(live: Liveness, limits: dict[int, int] | None) -> bool:
    return limits is None or all(live.peak[d] <= limits[d] for d in live.peak)


def _pass_liveness(s: CompileState) -> None:
    assert s.lowered is not None
    s.live = _liveness(s, s.lowered.dag, categories=True)


def _keep_sharded(s: CompileState, limits: dict[int, int]) -> bool:
    """Under memory pressure, assigned states are kept sharded (one copy of their value's blocks,
    gathered for each reader during the step, like ZeRO-3/FSDP) instead of as their readers read them:
    first the states whose sharding saves the most bytes on the devices over their limit, until the
    estimate fits, then every state that saves any.  True if a lowering with those states sharded fits
    (the state then holds it); otherwise the state holds the leanest one tried."""
    assert s.lowered is not None and s.plan is not None and s.live is not None
    graph, dag = s.graph, s.lowered.dag
    saves: dict[int, dict[int, int]] = {}  # state -> device -> bytes saved by keeping it sharded
    for state, value in graph.assignments.items():
        if s.kept.get(state, "as read") in ("sharded", "pinned"):
            continue
        node = graph.nodes[state]
        now: dict[int, int] = {}
        for _, b in dag.inputs.get(node.name, []):
            now[dag.buffers[b].device] = now.get(dag.buffers[b].device, 0) + dag.buffers[b].nbytes
        for box, device in value_blocks(s.plan, value):
            now[device] = now.get(device, 0) - box.volume * itemsize(node.type.dtype)
        if any(v > 0 for v in now.values()):
            saves[state] = now
    if not saves:
        return False
    over = {d: s.live.peak[d] - limits[d] for d in limits if s.live.peak[d] > limits[d]}
    order = sorted(saves, key=lambda st: (-sum(max(saves[st].get(d, 0), 0) for d in over), st))
    tried: list[dict[int, str]] = []
    chosen: dict[int, str] = dict(s.kept)
    left = dict(over)
    for state in order:
        chosen[state] = "sharded"
        for d in left:
            left[d] -= saves[state].get(d, 0)
        if all(v <= 0 for v in left.values()):
            break
    tried.append(chosen)
    everything = {**s.kept, **{st: "sharded" for st in saves}}
    if everything != chosen:
        tried.append(everything)
    for kept in tried:
        lowered = _lower(s, s.plan, kept=kept)
        if s.options.searched:
            s.kept = kept
            lowered = _searched(s, s.plan, lowered)
        live = _liveness(s, lowered.dag)
        s.kept, s.lowered, s.live = kept, lowered, live
        if _fits(live, limits):
            return True
    return False


def _pass_fit_memory(s: CompileState) -> None:
    """A plan whose peak exceeds a device's memory folds its micro-batches' partial gradients as they are
    made, if it is pipelined with three or more (``schedule.pipeline_order``); then keeps its assigned
    states sharded (``_keep_sharded``);
    if that is not enough, a DP plan is re-chosen with a growing price on the bytes each spec keeps
    resident (``spec_resident``; a Lagrangian relaxation of the memory constraint), up to eight times, each
    re-chosen plan lowered (and searched) as the passes before did unless its specs were lowered before;
    if none fits, the plan is refused with the peak of the best one found."""
    assert s.lowered is not None and s.plan is not None and s.live is not None
    limits = s.limits
    if _fits(s.live, limits):
        return
    assert limits is not None

    def excess(live: Liveness) -> int:
        return max(live.peak[d] - limits[d] for d in live.peak)

    best, best_dag = s.live, s.lowered.dag
    if isinstance(s.plan, PipelinedPlan) and s.plan.pipeline.micro_batches > 2:
        s.fold = True  # every lowering from here on folds the micro-batches' partials as they are made
        lowered, live = _relowered(s, s.plan)
        s.lowered, s.live = lowered, live
        if _fits(live, limits):
            return
        if excess(live) < excess(best):
            best, best_dag = live, lowered.dag
    if s.options.keep_states == "auto" and _keep_sharded(s, limits):
        return
    if s.live.peak != best.peak and excess(s.live) < excess(best):
        best, best_dag = s.live, s.lowered.dag
    if s.options.selector in ("dp", "exact"):
        resident = sum(s.plan.candidate(o).resident_bytes for o in s.choice) or 1
        price = max(s.plan.cost, 1.0) / resident
        tried = {tuple(sorted(s.choice.items()))}
        for _ in range(8):
            choice, plan = _choose(s, memory_price=price)
            key = tuple(sorted(choice.items()))
            if key in tried:  # the same specs lower to the same plan: only a higher price can change them
                price *= 4
                continue
            tried.add(key)
            lowered, live = _relowered(s, plan)
            if _fits(live, limits):
                s.choice, s.plan, s.lowered, s.live = choice, plan, lowered, live
                return
            if excess(live) < excess(best):
                best, best_dag = live, lowered.dag
            price *= 4
    worst = max(best.peak, key=lambda d: best.peak[d] - limits[d])
    parts = _liveness(s, best_dag, categories=True).at_peak.get(worst, {})
    largest = ", ".join(f"{k} {v:,}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3] if v > 0)
    raise OutOfMemoryPlanError(
        f"device {worst} needs {best.peak[worst]:,} bytes at its peak under the best plan found "
        f"({best.resident[worst]:,} of them loaded inputs; largest: {largest}), but has {limits[worst]:,}. "
        "Use more devices or a larger memory_per_device."
    )


def _pass_verify(s: CompileState) -> None:
    """Changes nothing: every searched exchange program is valid (Definition 5.5) with the membership
    lowering used (a naive one is checked for structure: the lowering fired it and found every
    requirement delivered, which is its closure), every kernel computes its function spec's block on
    the device it was placed on, saved outputs are covered by their blocks with their dtypes unchanged,
    and every assigned state's kept blocks cover it and are written once."""
    from relational_tensors.core.tiling import check_tiles
    from relational_tensors.exchange.closure import check, check_structure

    assert s.lowered is not None and s.plan is not None
    low = s.lowered
    checked: set[tuple[int, int, bool]] = set()  # identical layers share one program object: checked once
    for name, prog in low.programs.items():
        membership = low.memberships.get(name, {})
        key = (id(prog), id(membership), name in low.searched)
        if key in checked:
            continue
        checked.add(key)
        try:
            (check if name in low.searched else check_structure)(prog, membership)
        except Exception as e:
            raise PlanError(f"verify after 'lower': the exchange program of {name!r} is invalid: {e}") from e
    buffers, nodes, placement = low.dag.buffers, s.graph.nodes, low.placement
    for t in low.dag.tasks:
        if t.kind == "kernel":
            k = t.payload
            assert isinstance(k, KernelPayload) and t.op is not None  # a kernel task serves an operator
            f = k.function
            out = buffers[t.outputs[0]]
            dtype = nodes[t.op].type.dtype
            if not k.final:
                dtype = partial_dtype(dtype)
            if out.box != f.output or out.dtype != dtype or out.device != placement[t.op][k.index]:
                raise PlanError(f"verify after 'lower': kernel {t.label} writes {out.box} ({out.dtype}) on device "
                                f"{out.device}, not its function spec's block {f.output} ({dtype}).")
    for name, blocks in low.dag.outputs.items():
        node = s.graph.nodes[s.graph.outputs[name]]
        try:
            check_tiles([box for box, _ in blocks], node.type.box)
        except Exception as e:
            raise PlanError(f"verify after 'lower': the blocks of saved output {name!r} do not tile it: {e}") from e
    written: dict[int, int] = {}
    for t in low.dag.tasks:
        if t.kind == "assign":
            src, dst = (low.dag.buffers[b] for b in (*t.inputs, *t.outputs))
            if (src.box, src.dtype, src.device, src.partial) != (dst.box, dst.dtype, dst.device, None):
                raise PlanError(f"verify after 'lower': {t.label} writes {src.box} ({src.dtype}, device "
                                f"{src.device}) into the kept block {dst.box} ({dst.dtype}, device {dst.device}).")
            written[dst.id] = written.get(dst.id, 0) + 1
    # a next value assembled in its kept block in place: the blocks the run writes of it, by kept block
    kept_blocks = low.dag.kept_state_blocks()
    root = low.dag.view_roots()
    in_place: dict[int, list[Any]] = {}
    for t in low.dag.tasks:
        if t.kind != "assign":
            for r, b in low.dag.kept_writes(t, kept_blocks, root):
                in_place.setdefault(r, []).append(buffers[b].box)
    for name in low.dag.assigned:
        kept = low.dag.inputs[name]
        if not covers([box for box, _ in kept], s.graph.node(name).type.box) or any(
                not (written.get(b) == 1 and b not in in_place
                     or b not in written and covers(in_place.get(b, []), box)) for box, b in kept):
            raise PlanError(f"verify after 'lower': state {name!r} must keep blocks covering it, each written "
                            "once per execution: by an assign task, or by the copies and assembly of its next "
                            "value in place.")


def _pass_record(s: CompileState) -> None:
    """The physical plan into the catalog: placements, exchange programs and their actions, tasks, edge
    traffic, device memory by category, and the layouts states keep between executions.  An in-memory
    catalog writes them when it is first read after this compilation (``Catalog.defer``): a plan that is
    only run never pays for tables nobody reads."""
    assert s.lowered is not None and s.plan is not None and s.live is not None
    if not s.live.at_peak and s.lowered.dag.buffers:  # a lowering re-chosen for memory: split it by category
        s.live = _liveness(s, s.lowered.dag, categories=True)
    s.catalog.defer(functools.partial(_record, s.graph, s.plan, s.lowered, s.live, s.cid))


def _record(graph: Graph, plan: LogicalPlan, lowered: Lowered, live: Liveness, cid: int, catalog: Catalog) -> None:
    from relational_tensors.driver.visualize import kept_layouts
    from relational_tensors.physical.record import physical_tables

    for table, rows in physical_tables(plan, lowered, live).items():
        if rows.num_rows:
            catalog.insert(table, rows, cid)
    rows = kept_layouts(graph, lowered)
    if rows:
        cols = ("state_id", "state", "value_op", "kept", "placement", "blocks", "bytes_per_device", "bytes_total",
                "write_bytes")
        types = {"state_id": pa.int32(), "value_op": pa.int32(), "blocks": pa.int32(), "bytes_per_device": pa.int64(),
                 "bytes_total": pa.int64(), "write_bytes": pa.int64()}
        catalog.insert("state_layouts", pa.table({c: pa.array([r[c] for r in rows], types.get(c, pa.string()))
                                                  for c in cols}), cid)


COST_UNITS = {"paper": "elements", "bytes": "bytes", "calibrated": "seconds"}  # plan_cost's unit per model


# The pipeline, in order, each with the reason it exists.
PASSES: tuple[tuple[str, Callable[[CompileState], None], str], ...] = (
    ("target", _pass_target, "resolve the devices, their topology and kernel model once; open a compilation"),
    ("candidates", _pass_candidates, "enumerate and cost every operator's join-agg specs for p"),
    ("pieces", _pass_pieces, "cut the graph at multi-consumer tensors into pieces the DP solves exactly"),
    ("catalog", _pass_catalog, "write tensors, operators, edges, tilings and costed specs as Arrow tables"),
    ("select", _pass_select, "choose one spec per operator (dp, greedy or random)"),
    ("check", _pass_check, "verify the plan without changing it"),
    ("lower", _pass_lower, "place function specs, build naive exchange programs and the task DAG"),
    ("search", _pass_search, "schedule_mode='search': searched programs, kept if the whole plan is no slower"),
    ("liveness", _pass_liveness, "free buffers after last use; the peak bytes of every device"),
    ("fit_memory", _pass_fit_memory, "re-choose a DP plan that exceeds device memory, else refuse it"),
    ("verify", _pass_verify, "check the physical plan without changing it: valid programs, placed kernels, outputs"),
    ("record", _pass_record, "write the physical plan into the catalog: placements, exchanges, tasks, "
                             "traffic, memory, kept state layouts"),
)


def run(graph: Graph, options: CompileOptions, catalog: str | Path | Catalog | None = None,
        bind: Mapping[str, Any] | None = None) -> CompiledGraph:
    """Plan ``graph`` with ``options`` (already validated) on ``options.device``: the passes of ``PASSES`` in
    order over one :class:`CompileState`; ``catalog`` is where the compilation's rows go (a path to persist
    them, default: in memory); ``bind``: inputs its program reads in place (``runtime/binding.py``).  Every
    compilation is a row of the catalog, with why it has no plan if a pass raised."""
    # planning allocates millions of small objects and few cycles, in numbers that grow with the plan: the
    # cyclic collector would only rescan them (a third of a 32-layer compile), so it is off while planning,
    # except while searching exchange programs (_collecting), whose cycles grow with the search's effort
    collecting = gc.isenabled()
    gc.disable()
    try:
        if not isinstance(graph, Graph):
            raise GraphError(f"compileGraph takes an rt.Graph; got {type(graph).__name__}.")
        if isinstance(options.pipeline, str):
            raise PlanError(f"pipeline={options.pipeline!r} chooses among several compilations: rt.compileGraph "
                            "does that; here give rt.Pipeline(stages, micro_batches) or None.")
        inputs = {n.name for n in graph.inputs}
        strange = sorted(set(options.second_phase_inputs) - inputs)
        if strange:
            raise GraphError(f"second_phase_inputs names graph inputs; {strange} are not inputs of this graph "
                             f"(its inputs: {sorted(inputs)[:8]}{' ...' if len(inputs) > 8 else ''}).")
        if not graph.operators:
            raise PlanError("the graph has no operators to plan; add some and save an output.")
        if not graph.outputs:
            raise PlanError("the graph saves no output, so a run would return nothing; save the tensors you want "
                            "back with g.save(t, name=...).")
        cat = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
        state = CompileState(graph, options, cat, collect=collecting)
        try:
            for index, (name, run_pass, _reason) in enumerate(PASSES):
                log.debug("pass %s begins", name, extra={"rt_pass": name, "rt_index": index, "rt_total": len(PASSES)})
                t0 = time.perf_counter()
                run_pass(state)
                state.timings[name] = time.perf_counter() - t0
                log.info("pass %-10s %8.3f s", name, state.timings[name])
            assert state.plan is not None
            compiled = CompiledGraph(state, bind)
        except BaseException as e:  # the compilation stays in the catalog, saying why it has no plan
            if state.cid >= 0:
                status = "refused" if isinstance(e, OutOfMemoryPlanError) else "failed"
                cat.finish_compilation(state.cid, status, error=e, planning_seconds=sum(state.timings.values()))
            raise
        log.info("compiled %d operators for %d devices in %.3f s", len(graph.operators), state.target.p
                 if state.target is not None else 0, sum(state.timings.values()))
        cat.finish_compilation(state.cid, "ok", plan_cost=state.plan.cost,
                               planning_seconds=sum(state.timings.values()),
                               peak_bytes=max(compiled.memory().values(), default=0))
        return compiled
    finally:
        if collecting:
            gc.enable()

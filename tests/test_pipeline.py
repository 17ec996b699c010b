"""Pipeline stages and micro-batches: a training step cut into stages of consecutive layers on groups of
devices, its batch into micro-batches run in sequence, equals the single-device reference; the stages
follow the layers; each device runs its micro-batches in the schedule's order."""

from __future__ import annotations

import io

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.dp_optimizer.pipeline import PipelinedPlan, assign_stages, positions
from relational_tensors.driver.visualize import plan_rows
from relational_tensors.graph.graph import Graph
from relational_tensors.graph.models import add_llama_block, llama_training_feeds, llama_training_graph, optimizer_feeds
from relational_tensors.graph.optim import adamw
from relational_tensors.physical.schedule import stage_slots


def _rel(a: object, b: object) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _pipelined(cg: rt.CompiledGraph) -> PipelinedPlan:
    plan = cg.plan
    assert isinstance(plan, PipelinedPlan)
    return plan


def _one_step_equals_the_reference(cg: rt.CompiledGraph, g: rt.Graph, feeds: dict[str, np.ndarray]) -> None:
    """One execution from ``feeds``: the loss and every state's next value equal the reference's."""
    cg.load(feeds)
    cg.execute()
    want = rt.reference(g, feeds)
    assert _rel(cg.offload("loss"), want["loss"]) <= 1e-5
    for s in g.assignments:
        name = g.nodes[s].name
        assert _rel(cg.offload(name), want[f"{name}.next"]) <= 1e-4, name


def _graph(layers: int = 4, batch: int = 8, dtype: str = "float64") -> rt.Graph:
    # float64: in float32 the k projection's gradient of this small model cancels to within 4e-4 of its
    # largest element on 8 devices (float64 agrees to 1e-12), and AdamW's first step turns such rounding in a
    # near-zero gradient into a whole lr of difference, which says nothing about the schedule
    return llama_training_graph(batch, 12, 32, 4, 2, 48, 40, layers=layers, optimizer="adamw", dtype=dtype)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_of_four_devices_and_four_micro_batches_equal_the_reference(schedule: str) -> None:
    """Two AdamW steps of a 4-layer model on cpu:8 cut into 2 stages x 4 devices with 4 micro-batches: the
    loss and every updated state equal the single-device reference fed back its own assigned values."""
    g = _graph()
    feeds = llama_training_feeds(g, lr=1e-2)
    cg = rt.compileGraph(g, device="cpu:8", pipeline=rt.Pipeline(2, 4, schedule))
    ref_feeds = dict(feeds)
    for step in range(2):
        cg.load(feeds if step == 0 else {"lr": feeds["lr"]})
        cg.execute()
        want = rt.reference(g, ref_feeds)
        assert _rel(cg.offload("loss"), want["loss"]) <= 1e-5
        for s in g.assignments:
            ref_feeds[g.nodes[s].name] = want[f"{g.nodes[s].name}.next"]
    for s in g.assignments:
        name = g.nodes[s].name
        assert _rel(cg.offload(name), ref_feeds[name]) <= 1e-4, name
    # every kernel of an operator runs on its stage's devices
    plan = _pipelined(cg)
    for n in g.operators:
        stage = plan.stage_of[n.id]
        assert set(cg.lowered.placement[n.id]) <= set(range(4 * stage, 4 * stage + 4)), n.name


def test_a_clipped_step_in_two_stages_equals_the_reference() -> None:
    """Clipping to a global norm: the norm gathers a scalar from every stage, and each stage's update reads
    the coefficient back; the step equals the reference's."""
    g = llama_training_graph(4, 6, 16, 2, 1, 24, 20, layers=2, optimizer="adamw", max_grad_norm=0.05)
    feeds = llama_training_feeds(g, lr=1e-2)
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 2, "1f1b"))
    _one_step_equals_the_reference(cg, g, feeds)
    plan = _pipelined(cg)
    grads = [n for n in g.operators if n.id not in plan.forward and n.name.startswith("grad.l0.")]
    assert grads and {plan.stage_of[n.id] for n in grads} == {0}  # layer 0's backward is not in the last stage


def test_a_tied_embedding_read_in_the_first_and_the_last_stage_equals_the_reference() -> None:
    """The LM head reads the embedding table (tied weights): the table is kept in one stage and read in
    two; its gradient sums the lookup's and the head's parts across stages."""
    g = Graph()
    ids = g.input("ids", [4, 6], "int64", dims=("batch", "seq"))
    targets = g.input("targets", [4, 6], "int64", dims=("batch", "seq"))
    table = g.state("embed", [20, 16], "float32")
    x = g.embedding(table, ids, name="embed_lookup")
    for n in range(2):
        x = add_llama_block(g, x, n_heads=2, n_kv_heads=1, d_ff=24, prefix=f"l{n}.", leaf=g.state)
    h = g.rmsnorm(x, g.state("final_norm", [16], "float32"), 1e-5, name="final_rmsnorm")
    logits = g.einsum("bsd,vd->bsv", h, table, name="lm_head_proj")
    loss = g.save(g.cross_entropy(logits, targets, name="loss"), name="loss")
    params = g.trainable()
    adamw(g, params, g.grad(loss, params), g.input("lr", [1], "float32"))
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {"ids": rng.integers(0, 20, (4, 6)), "targets": rng.integers(0, 20, (4, 6))}
    for p in params:
        feeds[p.name] = (rng.standard_normal(p.type.shape) * 0.3).astype(np.float32)
    feeds = optimizer_feeds(g, feeds, 1e-2)
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 2, "1f1b"))
    plan = _pipelined(cg)
    assert plan.stage_of[g.node("embed_lookup").id] == 0 and plan.stage_of[g.node("lm_head_proj").id] == 1
    cg.load(feeds)
    cg.execute()
    want = rt.reference(g, feeds)
    assert _rel(cg.offload("loss"), want["loss"]) <= 1e-5
    for p in params:
        assert _rel(cg.offload(p.name), want[f"{p.name}.next"]) <= 1e-4, p.name


def test_a_plan_over_the_memory_folds_the_micro_batches_partials_as_they_are_made() -> None:
    """Eight micro-batches' weight gradients are eight partial blocks until the ⊕ sums them; a plan that
    does not fit folds each into a running sum as it is made (chains of two-input ⊕s) and fits; one that
    fits keeps the single ⊕ (a third of the bytes).  Both give the reference's step (SGD: AdamW's first step,
    g / (|g| + eps), would magnify the float32 rounding of gradients that nearly cancel)."""
    g = llama_training_graph(8, 4, 64, 4, 2, 256, 300, layers=2, optimizer="sgd")
    feeds = llama_training_feeds(g, lr=1e-2)
    want = rt.reference(g, feeds)
    plain = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 8, "1f1b"))
    limit = int(0.75 * max(plain.live.peak.values()))
    folded = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 8, "1f1b"), memory_per_device=limit)
    assert max(folded.live.peak.values()) <= limit
    widest = [max(len(t.inputs) for t in cg.dag.tasks if t.kind == "aggregate") for cg in (plain, folded)]
    assert widest[0] >= 8 and widest[1] == 2
    for cg in (plain, folded):
        cg.load(feeds)
        cg.execute()
        assert _rel(cg.offload("loss"), want["loss"]) <= 1e-5
        for st in g.assignments:
            name = g.nodes[st].name
            assert _rel(cg.offload(name), want[f"{name}.next"]) <= 1e-4, name


@pytest.mark.parametrize("stages, micro", [(4, 3), (8, 1), (1, 5)])
def test_stage_and_micro_batch_counts_that_do_not_divide_the_batch(stages: int, micro: int) -> None:
    """A batch of 5 in 3 micro-batches, one device per stage, one stage: still the reference's step."""
    g = llama_training_graph(5, 6, 16, 2, 1, 24, 20, layers=4, optimizer="adamw")
    feeds = llama_training_feeds(g, lr=1e-2)
    cg = rt.compileGraph(g, device="cpu:8", pipeline=rt.Pipeline(stages, micro))
    _one_step_equals_the_reference(cg, g, feeds)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_stages_follow_the_layers_forward_backward_and_update_together(clip: float | None) -> None:
    """Every reader of a weight (its forward product, the product giving the input gradient, its update)
    and the steps of its update share a stage, so each weight lives in one stage; stages never decrease
    from one layer to the next, nor along the positions.  Clipping to a global norm (which every update
    reads) changes none of that."""
    g = llama_training_graph(8, 12, 32, 4, 2, 48, 40, layers=6, optimizer="adamw", max_grad_norm=clip)
    stage = assign_stages(g, 3)
    pos = positions(g)
    assert set(stage.values()) == {0, 1, 2}
    by_weight = {}
    for w in g.inputs:
        if w.role != "state" or w.name.startswith("adamw") or ".exp_avg" in w.name:
            continue
        readers = [n for n in g.operators if w.id in n.inputs]  # forward, input gradient and update
        by_weight[w.name] = {stage[n.id] for n in readers} | {stage[g.assignments[w.id]]}
        assert len(by_weight[w.name]) == 1, (w.name, by_weight[w.name])
    order = [next(iter(by_weight[f"l{k}.wq"])) for k in range(6)]
    assert order == sorted(order) and order[0] == 0 and order[-1] == 2
    assert next(iter(by_weight["embed"])) == 0 and next(iter(by_weight["lm_head"])) == 2
    along = sorted(pos, key=lambda o: pos[o])
    assert all(stage[a] <= stage[b] for a, b in zip(along, along[1:]))
    # the steps of a weight's update that read only its moments (their decay) run in that weight's stage
    for name, at in by_weight.items():
        moments = {g.node(f"{name}{m}").id for m in (".exp_avg", ".exp_avg_sq")}
        decay = [o for o in g.operators if set(o.inputs) & moments]
        assert decay and {stage[o.id] for o in decay} == at, name


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_device_runs_its_micro_batches_in_the_schedules_order(schedule: str) -> None:
    """On every device the bulk of each (forward or backward, micro-batch) comes in the schedule's order:
    ordered by the median position of their kernels (a few run early: the token count a mean divides by
    is made from the inputs before the first loss needs it)."""
    g = _graph()
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 4, schedule))
    plan = _pipelined(cg)
    for device in range(4):
        at: dict[tuple[int, int], list[int]] = {}
        for k, t in enumerate(t for t in cg.lowered.dag.tasks if t.kind == "kernel" and t.device == device):
            assert t.op is not None
            mb = plan.micro_batch(t.op, t.kernel.index)
            if mb is not None:
                at.setdefault((0 if t.op in plan.forward else 1, mb), []).append(k)
        rank = stage_slots(schedule, 2, device // 2, 4)
        bulk = sorted(at, key=lambda u: float(np.median(at[u])))
        assert bulk == sorted(rank, key=lambda u: rank[u]), (device, bulk)


def test_stage_slots_1f1b_warms_up_by_the_stages_after() -> None:
    order = stage_slots("1f1b", 4, 0, 6)
    assert sorted(order, key=lambda u: order[u])[:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    last = stage_slots("1f1b", 4, 3, 6)
    assert sorted(last, key=lambda u: last[u])[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_bad_pipelines_are_refused() -> None:
    g = _graph(layers=2)
    with pytest.raises(rt.PlanError, match="do not divide"):
        rt.compileGraph(g, device="cpu:6", pipeline=rt.Pipeline(4, 2))
    with pytest.raises(rt.PlanError, match="schedule"):
        rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 2, "zigzag"))
    with pytest.raises(rt.PlanError, match="positive integer"):
        rt.compileGraph(g, device="cpu:4", pipeline={"stages": 2, "micro_batches": 0})
    with pytest.raises(rt.PlanError, match="second_phase_inputs"):
        rt.compileGraph(g, device="cpu:4", pipeline={"stages": 2}, second_phase_inputs=("targets",))
    with pytest.raises(rt.PlanError, match="pipeline"):
        rt.compileGraph(g, device="cpu:4", pipeline=(2, 2))


def test_a_pipelined_plan_saved_and_loaded_runs_the_same_step(tmp_path: object) -> None:
    g = llama_training_graph(4, 6, 16, 2, 1, 24, 20, layers=2, optimizer="adamw")
    feeds = llama_training_feeds(g, lr=1e-2)
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 2))
    path = f"{tmp_path}/step.plan"
    rt.save_plan(cg, path)
    same = rt.load_plan(path, g)
    for c in (cg, same):
        c.load(feeds)
        c.execute()
    assert np.array_equal(same.offload("loss"), cg.offload("loss"))
    assert _pipelined(same).stage_of == _pipelined(cg).stage_of
    assert [t.label for t in same.lowered.dag.tasks] == [t.label for t in cg.lowered.dag.tasks]


def test_auto_keeps_the_fastest_simulated_candidate_and_records_every_one() -> None:
    """pipeline="auto" compiles no pipeline and 2 and 4 stages on cpu:4 into one catalog, and returns the
    candidate whose simulated step is the shortest; its step still equals the reference."""
    g = _graph(layers=2)
    feeds = llama_training_feeds(g, lr=1e-2)
    cg = rt.compileGraph(g, device="cpu:4", pipeline="auto", label="step")
    rows = cg.catalog.execute("SELECT label, predicted_seconds FROM compilations WHERE status = 'ok' "
                            "ORDER BY compilation_id").fetchall()
    assert [r[0] for r in rows] == ["step (no pipeline)", "step (pipeline 2x4)", "step (pipeline 4x8)"]
    assert cg.simulate() == min(r[1] for r in rows)
    cg.load(feeds)
    cg.execute()
    assert _rel(cg.offload("loss"), rt.reference(g, feeds)["loss"]) <= 1e-5
    with pytest.raises(rt.PlanError, match="auto"):
        rt.compileGraph(g, device="dist", pipeline="auto")


def test_explain_shows_the_stages_and_the_pipeline() -> None:
    g = llama_training_graph(4, 6, 16, 2, 1, 24, 20, layers=2, optimizer="adamw")
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 2, "1f1b"))
    text = " ".join(cg.explain(file=io.StringIO(), width=400).split())
    assert "pipeline: 2 stages of 2 devices, 2 micro-batches, 1f1b" in text
    rows = {r["op_name"]: r["stage"] for r in plan_rows(cg)}
    assert rows == {n.name: _pipelined(cg).stage_of[n.id] for n in g.operators}
    assert rows["embed_lookup"] == 0 and rows["lm_head_proj"] == 1


def test_the_catalog_records_stages_micro_batches_and_the_schedule() -> None:
    g = llama_training_graph(4, 6, 16, 2, 1, 24, 20, layers=2, optimizer="adamw")
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 2, "1f1b"))
    pp = _pipelined(cg)
    (row,) = cg.sql(f"SELECT stages, micro_batches, pipeline_schedule FROM compilations "
                    f"WHERE compilation_id = {cg.compilation_id}").to_pylist()
    assert row == {"stages": 2, "micro_batches": 2, "pipeline_schedule": "1f1b"}
    rows = cg.sql(f"SELECT op_id, function_index, device, stage, micro_batch FROM placements "
                  f"WHERE compilation_id = {cg.compilation_id}").to_pylist()
    assert {r["op_id"] for r in rows} == {n.id for n in g.operators}
    for r in rows:  # each function spec on a device of its operator's stage, with its micro-batch
        assert r["stage"] == pp.stage_of[r["op_id"]]
        assert r["device"] in pp.group(r["op_id"])
        assert r["micro_batch"] == pp.micro_batch(r["op_id"], r["function_index"])
    assert {r["micro_batch"] for r in rows} == {0, 1, None}  # the weights' updates carry no batch
    plain = rt.compileGraph(g, device="cpu:4")
    (row,) = plain.sql(f"SELECT stages, micro_batches, pipeline_schedule FROM compilations "
                       f"WHERE compilation_id = {plain.compilation_id}").to_pylist()
    assert row == {"stages": 1, "micro_batches": 1, "pipeline_schedule": None}
    assert plain.sql(f"SELECT count(*) AS n FROM placements WHERE compilation_id = {plain.compilation_id} "
                     "AND (stage IS NOT NULL OR micro_batch IS NOT NULL)").to_pylist() == [{"n": 0}]


def test_sharded_states_are_kept_on_their_update_s_stage() -> None:
    """A state kept sharded (one copy of its value's blocks) is held on the devices of the stage that
    updates it, not on the first stage's: reading and writing it never crosses stages.  The step still
    equals the reference's."""
    g = _graph(layers=2)
    feeds = llama_training_feeds(g, lr=1e-2)
    cg = rt.compileGraph(g, device="cpu:8", pipeline=rt.Pipeline(2, 2, "1f1b"), keep_states="sharded")
    plan = _pipelined(cg)
    stages = set()
    for state, value in g.assignments.items():
        group = set(plan.group(value))
        held = {cg.dag.buffers[b].device for _, b in cg.dag.inputs[g.nodes[state].name]}
        assert held <= group, g.nodes[state].name
        stages.add(plan.stage_of[value])
    assert stages == {0, 1}
    _one_step_equals_the_reference(cg, g, feeds)


def test_a_pipeline_prices_the_gradients_it_accumulates_as_resident() -> None:
    """Under micro-batches a weight's gradient is held from the first micro-batch to the update, so the
    memory-priced selection counts its output block with the loaded inputs (``Candidate.resident_bytes``);
    without micro-batches it does not."""
    from relational_tensors.dp_optimizer.plans import batch_sums

    g = _graph(layers=1, dtype="float32")
    sums = batch_sums(g)
    grads = [n for n in g.operators if n.id in sums and n.type.rank == 2 and n.name.startswith("grad.")]
    assert grads
    piped = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 4, "1f1b"))
    plain = rt.compileGraph(g, device="cpu:2")  # the same specs: a stage of the pipeline has two devices
    for n in grads:
        for c, d in zip(piped.plan.candidates.by_op[n.id], plain.plan.candidates.by_op[n.id], strict=True):
            assert c.spec.split_text == d.spec.split_text
            out = max(f.output.volume for f in c.spec.functions) * 4  # float32 partial sums
            assert c.resident_bytes - d.resident_bytes == out, n.name

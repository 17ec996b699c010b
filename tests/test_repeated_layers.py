"""Repeated layers planned once (``dp_optimizer.repeats``): identical layers get identical plans, and
sharing work between them changes nothing: the same choice (in the same order), candidates, DAG task for
task, exchange programs and catalog rows as planning with sharing off."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.dp_optimizer import repeats
from relational_tensors.dp_optimizer import select as select_module
from relational_tensors.dp_optimizer.refine import refine
from relational_tensors.dp_optimizer.trees import cut_pieces
from relational_tensors.errors import OutOfMemoryPlanError
from relational_tensors.graph.graph import Node
from relational_tensors.graph.models import LLAMA3_8B, llama_block, llama_training_graph

MEMORY = 141 * (1 << 30)
SMALL = dict(d_model=256, n_heads=8, n_kv_heads=2, d_ff=704)
TABLES = ("tensors", "operators", "edges", "tilings", "candidate_specs", "spec_inputs", "edge_prices", "dp_table",
          "chosen", "placements", "exchange_programs", "exchange_actions", "tasks", "edge_traffic", "device_memory")


def stack(layers: int = 6) -> rt.Graph:
    return llama_block(1, 8192, dtype="float16", layers=layers, **LLAMA3_8B)


def picture(cg: rt.CompiledGraph) -> dict[str, object]:
    """Everything a compilation decided, as comparable values."""
    plan, low = cg.plan, cg.lowered
    out: dict[str, object] = {
        "choice": list(plan.choice.items()),
        "cost": plan.cost,
        "candidates": {o: [(c.spec_id, c.output_tiling, c.required, c.join_cost, c.aggregation_cost, c.compute_cost,
                            c.memory_bytes, c.resident_bytes, c.eligible, c.layout_cost) for c in cs]
                       for o, cs in plan.candidates.by_op.items()},
        "prices": plan.candidates.prices,
        "placement": low.placement,
        "tasks": [(t.id, t.kind, t.device, t.inputs, t.outputs, t.op, t.src_device, t.payload, t.label)
                  for t in low.dag.tasks],
        "buffers": low.dag.buffers,
        "io": (low.dag.inputs, low.dag.outputs, low.dag.assigned),
        "programs": list(cg.exchange_programs().items()),
        "memberships": low.memberships,
        "kept": low.kept,
        "memory": cg.memory(),
    }
    for table in TABLES:
        out[table] = cg.catalog.execute(f"SELECT * EXCLUDE (compilation_id) FROM {table} "
                                        "WHERE compilation_id = ? ORDER BY ALL", [cg.compilation_id]).fetchall()
    return out


def assert_same_without_sharing(g: rt.Graph, **options: object) -> rt.CompiledGraph:
    shared = rt.compileGraph(g, **options)
    with repeats.sharing(False):
        alone = rt.compileGraph(g, **options)
    a, b = picture(shared), picture(alone)
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"planning with sharing changed {differ}"
    assert alone.lowered.replayed == 0
    return shared


def layer_ops(g: rt.Graph, layer: int) -> list[Node]:
    """The operators of layer ``layer`` of a stack, in order: those between its first and last named node."""
    ids = [n.id for n in g.nodes if n.name.startswith(f"l{layer}.")]
    return [n for n in g.operators if min(ids) <= n.id <= max(ids)]


@pytest.mark.parametrize(("p", "layers"), [(4, 6), (8, 6), pytest.param(8, 80, marks=pytest.mark.slow)])
def test_every_layer_is_planned_like_layer_zero(p: int, layers: int) -> None:
    g = stack(layers)
    cg = assert_same_without_sharing(g, device=f"cpu:{p}", memory_per_device=MEMORY)
    first = layer_ops(g, 0)
    for layer in range(1, layers):
        ops = layer_ops(g, layer)
        assert [n.name.split(".", 1)[-1] for n in ops if n.name.startswith("l")] == \
            [n.name.split(".", 1)[-1] for n in first if n.name.startswith("l")]
        for mine, theirs in zip(ops, first, strict=True):
            assert (cg.plan.split(mine.id), cg.lowered.placement[mine.id]) == \
                (cg.plan.split(theirs.id), cg.lowered.placement[theirs.id]), (layer, mine.name)
    # the work was shared: all but a few operators replayed, and a few pieces solved by SQL
    assert cg.lowered.replayed > len(g.operators) * 0.8


def test_pieces_of_equal_context_are_solved_once(monkeypatch, caplog) -> None:
    solved: list[int] = []
    real = select_module._solve

    def counting(catalog, cid, cands, group, *rest):  # type: ignore[no-untyped-def]
        solved.append(len(group))
        return real(catalog, cid, cands, group, *rest)

    monkeypatch.setattr(select_module, "_solve", counting)
    by_depth = {}
    for layers in (4, 12):
        solved.clear()
        with caplog.at_level(logging.DEBUG, logger="relational_tensors.dp_optimizer.select"):
            caplog.clear()
            cg = rt.compileGraph(stack(layers), device="cpu:8", memory_per_device=MEMORY)
        pieces = cg.catalog.execute("SELECT count(DISTINCT tree_id) FROM operators WHERE compilation_id = ?",
                                    [cg.compilation_id]).fetchone()[0]
        logged = [(r.rt_pieces, r.rt_solved_by_sql) for r in caplog.records if hasattr(r, "rt_solved_by_sql")]
        assert logged == [(pieces, sum(solved))]
        by_depth[layers] = sum(solved)
    assert by_depth[4] == by_depth[12] < pieces / 4  # flat in depth: the middle layers take the solutions
    solved.clear()
    with repeats.sharing(False):
        rt.compileGraph(stack(12), device="cpu:8", memory_per_device=MEMORY)
    assert sum(solved) == pieces


@pytest.mark.parametrize("p", [4, 8])
def test_training_graph_with_gradients(p: int) -> None:
    # the ends differ from the middle (embedding and the first layer's input; the head, the loss and the
    # backward's first layer), the middle layers repeat, forward and backward
    assert_same_without_sharing(llama_training_graph(2, 256, vocab=1000, layers=3, **SMALL), device=f"cpu:{p}",
                                memory_per_device=MEMORY)


@pytest.mark.slow
@pytest.mark.parametrize("cost_model", ["paper", "calibrated"])
def test_training_step_with_states(cost_model: str) -> None:
    g = llama_training_graph(2, 256, vocab=1000, layers=3, optimizer="adamw", **SMALL)
    assert_same_without_sharing(g, device="cpu:4", memory_per_device=MEMORY, cost_model=cost_model)


@pytest.mark.slow
def test_calibrated_stack_and_linear_tactic() -> None:
    assert_same_without_sharing(stack(), device="cpu:8", memory_per_device=MEMORY, cost_model="calibrated")
    assert_same_without_sharing(llama_block(2, 256, dtype="float32", layers=4, seq_ends=[64, 100, 256], **SMALL),
                                device="cpu:8", memory_per_device=MEMORY, tactic="linear")


@pytest.mark.slow
def test_states_kept_sharded_under_memory_pressure() -> None:
    g = llama_training_graph(2, 256, vocab=1000, layers=3, optimizer="adamw", **SMALL)
    peak = max(rt.compileGraph(g, device="cpu:4", memory_per_device=1 << 40).memory().values())
    cg = assert_same_without_sharing(g, device="cpu:4", memory_per_device=int(peak * 0.9))
    assert "sharded" in cg.lowered.kept.values()  # held blocks enter the lowering's geometry keys
    messages = []
    for on in (True, False):  # re-chosen with a price on memory, then refused: the same way both times
        with repeats.sharing(on), pytest.raises(OutOfMemoryPlanError) as e:
            rt.compileGraph(g, device="cpu:4", memory_per_device=int(peak * 0.8))
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_shared_inputs_and_repeated_operands() -> None:
    # equal matmuls reading one input (the second finds it loaded), a square (one tensor read twice), and
    # identical operators with different dtypes or saved flags: none may take another's plan or tasks
    g = rt.Graph()
    x = g.input("x", [48, 40])
    outs = [g.matmul(x, g.parameter(f"w{i}", [40, 40])) for i in range(3)]
    sq = [g.mul(o, o) for o in outs]
    g.save(sq[0], name="a")
    g.save(g.add(sq[1], sq[2]), name="b")
    h = g.input("h", [48, 40], "float16")
    g.save(g.matmul(h, g.parameter("wh", [40, 40], "float16")), name="c")
    for p in (3, 4, 8):
        assert_same_without_sharing(g, device=f"cpu:{p}", memory_per_device=MEMORY)


def random_repeated_graph(rng: np.random.Generator) -> rt.Graph:
    """A small random model whose layers are drawn from two kinds, so some repeat and some do not, with
    a loss and the gradient of every parameter (half of the draws)."""
    g = rt.Graph()
    tokens, d = int(rng.integers(6, 40)), int(rng.integers(4, 24))
    x = g.input("x", [tokens, d])
    kinds = [(int(rng.integers(d, 3 * d)), bool(rng.random() < 0.5)) for _ in range(2)]
    for layer in range(int(rng.integers(2, 6))):
        f, gated = kinds[int(rng.integers(0, 2))]
        pre = f"l{layer}."
        h = g.rmsnorm(x, g.parameter(pre + "norm", [d]), 1e-5)
        if gated:
            inner = g.swiglu(g.matmul(h, g.parameter(pre + "w1", [d, f])), g.matmul(h, g.parameter(pre + "w3", [d, f])))
        else:
            inner = g.unary(g.matmul(h, g.parameter(pre + "w1", [d, f])), "gelu")
        x = g.add(x, g.matmul(inner, g.parameter(pre + "w2", [f, d])))
    if rng.random() < 0.5:
        g.save(x, name="y")
        return g
    loss = g.mse(x, g.input("target", [tokens, d]))
    g.save(loss, name="loss")
    params = g.trainable()
    for p, dp in zip(params, g.grad(loss, params)):
        g.save(dp, name=f"grad.{p.name}")
    return g


@pytest.mark.parametrize(("seed", "p", "cost_model"),
                         [(s, (2, 4, 3, 8)[s % 4], ("paper", "calibrated", "bytes")[s % 3]) for s in range(8)])
def test_random_repeated_models(seed: int, p: int, cost_model: str) -> None:
    g = random_repeated_graph(np.random.default_rng(seed))
    assert_same_without_sharing(g, device=f"cpu:{p}", memory_per_device=MEMORY, cost_model=cost_model)


@pytest.mark.parametrize("seed", range(4))
def test_refinement_from_random_choices(seed: int) -> None:
    # started far from the DP's plan, the refinement takes many steps in many different neighbourhoods:
    # its memoized steps must land where the plain ones do
    rng = np.random.default_rng(seed)
    g = random_repeated_graph(rng) if seed % 2 else llama_training_graph(2, 64, vocab=100, layers=3, **SMALL)
    cands = rt.compileGraph(g, device=f"cpu:{(4, 2)[seed % 2]}", memory_per_device=MEMORY).plan.candidates
    pieces, _ = cut_pieces(g)
    moved = 0
    for _ in range(3):
        start = {v: int(rng.choice([c.spec_id for c in cands.eligible(v)])) for v in sorted(cands.by_op)}
        shared = refine(g, cands, start, 0.0, pieces)
        with repeats.sharing(False):
            alone = refine(g, cands, start, 0.0, pieces)
        assert list(shared.items()) == list(alone.items())
        moved += shared != start
    assert moved


def test_searched_exchange_programs() -> None:
    # a replayed lowering skips the synthesizer exactly where the exchange's own memo would
    cg = assert_same_without_sharing(stack(4), device="cpu:4", memory_per_device=MEMORY, schedule_mode="search",
                                     search_steps=20)
    assert cg.lowered.replayed > 0 and cg.lowered.searched


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_stages_replay_the_layers_of_earlier_stages(schedule: str) -> None:
    """A layer in a later pipeline stage replays the lowering of the same layer in an earlier one on its own
    stage's devices (recorded relative to the stage's first device): the plan is the one planned without
    sharing, task for task, and most layers are replayed."""
    g = llama_training_graph(8, 16, vocab=300, layers=8, optimizer="adamw", **SMALL)
    cg = assert_same_without_sharing(g, device="cpu:8", memory_per_device=MEMORY,
                                     pipeline=rt.Pipeline(4, 8, schedule))
    later = [n for n in g.operators if n.name.startswith(("l5.", "l6.", "grad.l5.", "grad.l6."))]
    assert {cg.plan.stage_of[n.id] for n in later} == {2, 3}  # type: ignore[attr-defined]
    assert cg.lowered.replayed >= len(g.operators) // 2

"""Constraints as rows: an operator's split or an input's or state's layout pinned by hand
(``compileGraph(..., constraints=...)``), honoured by every selector through the eligible specs and
layout prices the DP's SQL reads, recorded in the catalog, and ``cg.constraints()`` reproducing a
compiled plan exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.graph.models import llama_block

BLOCK = llama_block(1, 48, 64, 4, 2, 96, dtype="float32")


def test_a_pinned_split_is_honoured_costed_recorded_and_runs_like_the_reference() -> None:
    free = rt.compileGraph(BLOCK, device="cpu:4")
    pinned = rt.compileGraph(BLOCK, device="cpu:4", constraints={"attention": "heads_kv=1", "q_proj": "k=4"})
    split = dict(kv.split("=") for kv in pinned.plan.split("attention").split(","))
    assert split["heads_kv"] == "1"
    assert dict(kv.split("=") for kv in pinned.plan.split("q_proj").split(","))["k"] == "4"
    assert pinned.plan.cost >= free.plan.cost - 1e-6  # the optimizer's plan is the cheapest it found
    rows = pinned.sql("SELECT target, kind, value FROM constraints ORDER BY target").to_pylist()
    assert rows == [{"target": "attention", "kind": "split", "value": "heads_kv=1"},
                    {"target": "q_proj", "kind": "split", "value": "k=4"}]
    feeds = {n.name: np.random.default_rng(1).standard_normal(n.type.shape).astype(np.float32) for n in BLOCK.inputs}
    name = next(iter(BLOCK.outputs))
    got, want = pinned.run(feeds)[name], rt.reference(BLOCK, feeds)[name]
    # float32, a contraction split four ways: rounding relative to the output's largest magnitude
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("selector", ["dp", "greedy"])
def test_the_constraints_of_a_plan_reproduce_it(selector: str) -> None:
    cg = rt.compileGraph(BLOCK, device="cpu:4", selector=selector)
    again = rt.compileGraph(BLOCK, device="cpu:4", selector=selector, constraints=cg.constraints())
    assert again.plan.choice == cg.plan.choice


def test_bad_constraints_are_refused_with_the_rule() -> None:
    with pytest.raises(rt.PlanError, match="nearest legal splits"):
        rt.compileGraph(BLOCK, device="cpu:4", constraints={"attention": "heads_kv=3"})
    with pytest.raises(rt.GraphError, match="shardable indices"):
        rt.compileGraph(BLOCK, device="cpu:4", constraints={"attention": "nope=2"})
    with pytest.raises(rt.GraphError, match="operators, graph inputs or states of the graph"):
        rt.compileGraph(BLOCK, device="cpu:4", constraints={"no_such_op": "seq=2"})
    with pytest.raises(rt.GraphError, match="maps operator names"):
        rt.compileGraph(BLOCK, device="cpu:4", constraints=[("attention", "heads_kv=2")])  # type: ignore[arg-type]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), p=st.integers(2, 5))
def test_any_legal_split_of_any_operator_can_be_pinned(data: st.DataObject, p: int) -> None:
    free = rt.compileGraph(BLOCK, device=f"cpu:{p}")
    op = data.draw(st.sampled_from([n for n in BLOCK.operators]))
    legal = sorted({c.spec.split_text for c in free.plan.candidates.by_op[op.id]
                    if c.memory_bytes <= free.target.memory()[0]})
    split = data.draw(st.sampled_from(legal))
    pinned = rt.compileGraph(BLOCK, device=f"cpu:{p}", constraints={op.name: split})
    assert pinned.plan.split(op.id) == split


def _feeds(g: rt.Graph, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n.name: rng.standard_normal(n.type.shape).astype(np.float32) for n in g.inputs}


def _held(cg: rt.CompiledGraph, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The (lower, upper, device) of every block of graph input ``name`` that the program loads."""
    return sorted((box.lower, box.upper, cg.dag.buffers[b].device) for box, b in cg.dag.inputs[name])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), p=st.integers(2, 5), cost_model=st.sampled_from(["paper", "calibrated"]))
def test_a_pinned_input_layout_is_held_priced_and_runs_like_the_reference(data: st.DataObject, p: int,
                                                                          cost_model: str) -> None:
    x = data.draw(st.sampled_from([n for n in BLOCK.inputs]))
    layouts = ["R"] + [f"S({d})" for d in range(x.type.rank)] + [
        f"{x.type.names[d]}={n}" for d in range(x.type.rank) for n in range(2, p + 1) if n <= x.type.shape[d]]
    layout = data.draw(st.sampled_from(layouts))
    cg = rt.compileGraph(BLOCK, device=f"cpu:{p}", cost_model=cost_model, constraints={x.name: layout})
    from relational_tensors.dp_optimizer.constraints import parse_layout

    want_blocks = sorted((b.lower, b.upper, d) for b, d in parse_layout(x.name, x.type, layout, p))
    assert set(want_blocks) <= set(_held(cg, x.name))  # held as asked (a saved input is also loaded whole)
    assert cg.constraints()[x.name] == layout
    assert cg.sql("SELECT kind FROM constraints").to_pylist() == [{"kind": "layout"}]
    plan_total = cg.sql("SELECT sum(total_cost) AS t FROM plan").to_pylist()[0]["t"]
    assert plan_total == pytest.approx(cg.plan.cost, rel=1e-9, abs=1e-12)  # the SQL view prices what the DP did
    feeds = _feeds(BLOCK)
    name = next(iter(BLOCK.outputs))
    got, want = cg.run(feeds)[name], rt.reference(BLOCK, feeds)[name]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # float32; contractions split up to p ways


def test_a_layout_that_differs_from_what_its_reader_reads_costs_a_repartition() -> None:
    g = rt.Graph()
    a, b = g.input("a", [64, 48]), g.input("b", [48, 40])
    g.save(g.matmul(a, b, name="mm"), name="c")
    free = rt.compileGraph(g, device="cpu:4")
    rows = rt.compileGraph(g, device="cpu:4", constraints={"a": "S(0)"})  # rows: the i=4 split reads it as held
    cols = rt.compileGraph(g, device="cpu:4", constraints={"a": "S(1)"})
    assert rows.plan.split("mm") == "i=4,j=1,k=1" and rows.sql("SELECT sum(layout_cost) AS c FROM plan"
                                                               ).to_pylist()[0]["c"] == 0
    costs = {r["split"]: r["layout_cost"] for r in cols.sql("SELECT split, layout_cost FROM specs").to_pylist()}
    assert costs["i=1,j=4,k=1"] == 0 and all(c == 64 * 48 for s, c in costs.items() if s != "i=1,j=4,k=1")
    assert cols.plan.cost >= free.plan.cost and rows.plan.cost >= free.plan.cost
    # whole on every device: each reader slices its own copy, at no price, holding p copies
    rep = rt.compileGraph(g, device="cpu:4", constraints={"a": "R"})
    assert rep.sql("SELECT max(layout_cost) AS c FROM specs").to_pylist()[0]["c"] == 0
    assert _held(rep, "a") == [((0, 0), (64, 48), d) for d in range(4)]
    feeds = _feeds(g)
    for cg in (rows, cols, rep):
        assert np.allclose(cg.run(feeds)["c"], feeds["a"] @ feeds["b"], rtol=1e-5, atol=1e-5)
    again = rt.compileGraph(g, device="cpu:4", constraints=cols.constraints())
    assert again.plan.choice == cols.plan.choice and again.constraints() == cols.constraints()


@pytest.mark.parametrize("layout", ["R", "S(0)", "S(-1)"])
def test_states_pinned_to_a_layout_are_kept_in_it_and_train_like_the_free_plan(layout: str) -> None:
    from relational_tensors.graph.models import llama_training_feeds, llama_training_graph

    g = llama_training_graph(2, 16, 32, 4, 2, 48, 64, optimizer="adamw")
    feeds = llama_training_feeds(g)
    states = [n.name for n in g.inputs if n.role == "state"]

    def steps(cg: rt.CompiledGraph) -> dict[str, np.ndarray]:
        cg.load(feeds)
        for _ in range(2):
            cg.execute()
        return {s: cg.offload(s) for s in states}

    free = steps(rt.compileGraph(g, device="cpu:4"))
    cg = rt.compileGraph(g, device="cpu:4", constraints={s: layout for s in states})
    pinned = steps(cg)
    for s in states:  # float32 AdamW steps, the same arithmetic split differently: rounding only
        assert np.allclose(pinned[s], free[s], rtol=1e-5, atol=1e-6), s
    rows = {r["state"]: r for r in cg.state_layouts()}
    assert {r["kept"] for r in rows.values()} == {"pinned"}
    w = g.node("wq").type
    assert rows["wq"]["placement"] == {"R": "R", "S(0)": "S(0)", "S(-1)": f"S({w.rank - 1})"}[layout]


def test_bad_layouts_are_refused_with_the_rule() -> None:
    x = BLOCK.inputs[0].name
    for value, match in [("P(sum)", "partial results"), ("S(7)", "names dimension 7"), ("nope=2", "R, S"),
                         ("batch=2", "more than its extent"), ("seq=3,model=3", "more than the 4 devices"),
                         ("S(x)", "R, S")]:
        with pytest.raises(rt.GraphError, match=match):
            rt.compileGraph(BLOCK, device="cpu:4", constraints={x: value})


def _mm() -> rt.Graph:
    g = rt.Graph()
    x, w = g.input("x", [10, 6]), g.parameter("w", [6, 5])
    g.save(g.matmul(x, w), name="y")
    return g


@pytest.mark.parametrize("value, match", [("i=2,i=2", "names 'i' twice"), ("i=2,i=1", "names 'i' twice"),
                                          ("i=²", "idx=n"), ("i=٣", "idx=n"), ("i=２", "idx=n")])
def test_a_split_names_each_index_once_in_ascii_digits(value: str, match: str) -> None:
    g = _mm()
    with pytest.raises(rt.GraphError, match=match):
        rt.compileGraph(g, device="cpu:4", constraints={g.operators[0].name: value})


@pytest.mark.parametrize("value, match", [("d0=2,d0=2", "dimension 0 \\(d0\\) twice"),
                                          ("d0=2,0=2", "dimension 0 \\(d0\\) twice"),
                                          ("d1=2,-1=3", "dimension 1 \\(d1\\) twice"),
                                          ("d0=²", "R, S"), ("²=2", "R, S"), ("S(²)", "R, S")])
def test_a_layout_names_each_dimension_once_in_ascii_digits(value: str, match: str) -> None:
    with pytest.raises(rt.GraphError, match=match):
        rt.compileGraph(_mm(), device="cpu:4", constraints={"x": value})


def test_two_constraints_on_one_node_are_refused_naming_both() -> None:
    from relational_tensors.dp_optimizer.constraints import parse_constraints

    g = _mm()
    with pytest.raises(rt.GraphError, match="'x' got two, 'R' and 'S\\(0\\)'"):
        parse_constraints(g.nodes, [("x", "R"), ("x", "S(0)")], 4)

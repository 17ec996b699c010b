"""Constraints as rows: an operator's split pinned by hand (``compileGraph(..., constraints=...)``),
honoured by every selector through the eligible specs the DP's SQL reads, recorded in the catalog, and
``cg.constraints()`` reproducing a compiled plan exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.models import llama_block

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
    with pytest.raises(rt.GraphError, match="operators of the graph"):
        rt.compileGraph(BLOCK, device="cpu:4", constraints={"no_such_op": "seq=2"})
    with pytest.raises(rt.GraphError, match="not supported yet"):
        rt.compileGraph(BLOCK, device="cpu:4", constraints={BLOCK.inputs[0].name: "seq=2"})
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

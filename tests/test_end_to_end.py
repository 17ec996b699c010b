"""compileGraph(..., device="cpu:N").run(feeds) equals rt.reference: every operator and the
LLaMA-style block, several device counts, DP, greedy and random plans."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cases import CASES, CATALOG, TOL, check_plan, feeds_for

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, llama_block, llama_feeds

P_VALUES = [1, 2, 3, 4, 6, 8]


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_operator_end_to_end(case: str, p: int) -> None:
    g, _ = CASES[case]("float32")
    check_plan(g, feeds_for(g), p)


@pytest.mark.parametrize("p", P_VALUES if os.environ.get("RT_FULL_E2E") == "1" else [3, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_operator_under_other_selectors(case: str, p: int) -> None:
    """The DP's plans are checked at every p above; the other selectors at an odd and an even p
    (every p with RT_FULL_E2E=1)."""
    g, _ = CASES[case]("float32")
    feeds = feeds_for(g)
    check_plan(g, feeds, p, selector="greedy")
    for seed in range(3):
        check_plan(g, feeds, p, selector="random", seed=seed)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("selector,seed", [("dp", 0), ("greedy", 0), ("random", 0), ("random", 1), ("random", 2)])
def test_llama_block_packed_end_to_end(p: int, selector: str, seed: int) -> None:
    g = llama_block(2, 48, 32, 8, 2, 88, dtype="float32", seq_ends=[5, 17, 20, 33, 48])
    check_plan(g, llama_feeds(g, seed=p), p, selector=selector, seed=seed)


def test_two_layers_and_repeated_execution() -> None:
    g = llama_block(1, 40, 32, 4, 2, 64, dtype="float32", layers=2)
    cg = check_plan(g, llama_feeds(g), 4)
    feeds = llama_feeds(g, seed=7)
    cg.load(feeds)
    cg.execute()
    cg.execute()  # the same loaded inputs run again
    np.testing.assert_allclose(cg.offload("y"), rt.reference(g, feeds)["y"], **TOL)


def test_data_parallel_batch_has_no_transfers() -> None:
    g = llama_block(128, 1024, dtype="float16", **LLAMA3_8B)
    cg = rt.compileGraph(g, device="cpu:8", catalog=CATALOG)
    assert cg.dag.transfers() == []


def test_long_sequence_moves_data_only_around_attention() -> None:
    g = llama_block(1, 131072, dtype="float16", **LLAMA3_8B)
    cg = rt.compileGraph(g, device="cpu:8", catalog=CATALOG)
    repartitioned = {cg.graph.node(c).id for c, _ in cg.plan.repartitions()}
    movers = {t.op for t in cg.dag.transfers()}
    assert movers == repartitioned
    names = {cg.graph.nodes[o].name for o in movers}
    assert names <= {"reshape_5", "reshape_8", "reshape_11", "q_rope", "k_rope", "attention", "reshape_15"}
    # every byte moved belongs to q, k, v going into the head split or the output coming out of it
    moved = cg.dag.bytes_moved()
    t = cg.graph.node("attention").type
    qkv_out = (t.volume * 2 + 2 * t.volume // 4) * 2  # q + out, k + v (8 of 32 heads), 2 bytes each
    assert moved == qkv_out * 7 // 8  # each device keeps its own eighth


def test_whole_plan_memory_check_runs_before_execution() -> None:
    g = rt.Graph()  # ten resident weights: each operator fits, the plan as a whole does not
    x = g.input("x", [64, 256])
    for n in range(10):
        x = g.matmul(x, g.parameter(f"w{n}", [256, 256]))
    g.save(x, name="y")
    need = max(rt.compileGraph(g, device="cpu:2", catalog=CATALOG).memory().values())
    per_op = max(c.memory_bytes for c in rt.compileGraph(g, device="cpu:2", catalog=CATALOG).plan.candidates.by_op[2])
    assert per_op < need
    with pytest.raises(rt.OutOfMemoryPlanError, match=r"device \d needs [\d,]+ bytes at its peak"):
        rt.compileGraph(g, device="cpu:2", memory_per_device=need - 1, catalog=CATALOG)


def test_absent_hardware_plans_but_does_not_execute() -> None:
    g = rt.Graph()
    g.save(g.matmul(g.input("a", [64, 64]), g.input("b", [64, 64])), name="c")
    cg = rt.compileGraph(g, device=8, topology="dgx-a100", catalog=CATALOG)
    with pytest.raises(rt.ExecError, match="compiled for cuda:0,1,2,3,4,5,6,7"):
        cg.load({"a": np.ones((64, 64)), "b": np.ones((64, 64))})


def test_execution_errors_are_clear() -> None:
    g = rt.Graph()
    g.save(g.unary(g.input("x", [8, 4]), "relu"), name="y")
    cg = rt.compileGraph(g, device="cpu:2", catalog=CATALOG)
    with pytest.raises(rt.ExecError, match="load the inputs first"):
        cg.execute()
    with pytest.raises(rt.ExecError, match=r"missing a value for input 'x' of shape \(8, 4\)"):
        cg.load({})
    with pytest.raises(rt.ExecError, match=r"input 'x' must have shape \(8, 4\); got \(4, 8\)"):
        cg.load({"x": np.zeros((4, 8))})
    cg.load({"x": np.zeros((8, 4))})
    with pytest.raises(rt.ExecError, match="execute the program before offloading"):
        cg.offload("y")
    cg.execute()
    with pytest.raises(rt.ExecError, match="no saved output named 'z'"):
        cg.offload("z")


def test_every_lowered_exchange_program_is_valid_and_prints() -> None:
    from relational_tensors.exchange.closure import check
    from relational_tensors.exchange.text import parse

    g = llama_block(2, 48, 32, 8, 2, 88, dtype="float32", seq_ends=[5, 17, 20, 33, 48])
    cg = rt.compileGraph(g, device="cpu:6", catalog=CATALOG)
    texts = cg.exchange_programs()
    assert texts, "a 6-way plan of the block moves data somewhere"
    for name, text in texts.items():
        prog = parse(text)
        assert prog == cg.lowered.programs[name]
        check(prog, cg.lowered.memberships[name])  # every action fires and OUT holds
        assert "{size 1}" in text and "IN:" in text and "OUT:" in text


def test_weights_stay_loaded_between_loads() -> None:
    g = llama_block(1, 32, 32, 4, 2, 64, dtype="float32")
    cg = rt.compileGraph(g, device="cpu:4", catalog=CATALOG)
    feeds = llama_feeds(g)
    cg.load(feeds)
    cg.execute()
    fresh = llama_feeds(g, seed=5)["x"]
    cg.load({"x": fresh})  # only the activations change; the weights loaded before stay
    cg.execute()
    np.testing.assert_allclose(cg.offload("y"), rt.reference(g, dict(feeds, x=fresh))["y"], **TOL)

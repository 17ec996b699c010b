"""Hand plans (``rt.plans``): Megatron tensor parallelism, sequence parallelism, data parallelism and
DDP/FSDP training layouts, built from a graph's structure as constraint sets; each compiles, computes
what the single-device reference computes, and is what its name says it is."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.graph.graph import Graph
from relational_tensors.graph.models import add_llama_block, llama_block, llama_training_feeds, llama_training_graph


def _block(prefix: str = "", batch: int = 2) -> Graph:
    g = Graph()
    x = g.input("tokens" if prefix else "x", [batch, 48, 64], dims=("batch", "seq", "model"))
    g.save(add_llama_block(g, x, n_heads=8, n_kv_heads=4, d_ff=96, prefix=prefix), name="y")
    return g


def _split(cg: rt.CompiledGraph, op: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in cg.plan.split(op).split(","))}


def test_megatron_tp_is_column_then_row_parallel_with_the_heads_split() -> None:
    g = _block()
    plan = rt.plans.megatron_tp(g, 4)
    cg = rt.compileGraph(g, device="cpu:4", constraints=plan)
    for op in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # the weight's output features
        assert _split(cg, op)["k"] == 4 and max(cg.plan.spec(op).output_multiplicity().values()) == 1, op
    for op in ("o_proj", "down_proj"):  # the contracted features: partial sums, combined once
        assert _split(cg, op)["j"] == 4 and max(cg.plan.spec(op).output_multiplicity().values()) == 4, op
    assert _split(cg, "attention")["heads_kv"] == 4 and _split(cg, "swiglu")["d1"] == 4
    assert "attn_rmsnorm" not in plan and "attn_residual" not in plan  # left to the optimizer
    sp = rt.plans.sequence_parallel(g, 4)
    assert sp["attn_rmsnorm"] == sp["ffn_residual"] == "seq=4" and {k: sp[k] for k in plan} == plan


def test_plans_are_read_from_the_structure_not_the_names() -> None:
    plain, renamed = _block(), _block(prefix="layer7.")
    for name in ("megatron_tp", "sequence_parallel", "data_parallel"):
        a, b = rt.plans.PLANS[name](plain, 4), rt.plans.PLANS[name](renamed, 4)
        assert list(a.values()) == list(b.values()) and all(k2 == "layer7." + k1 or k2.startswith("reshape")
                                                            for k1, k2 in zip(a, b)), name


@pytest.mark.parametrize("p", [4, 6])
@pytest.mark.parametrize("name", ["megatron_tp", "sequence_parallel", "data_parallel"])
def test_every_hand_plan_of_the_block_computes_the_reference(name: str, p: int) -> None:
    g = _block(batch=6)
    cg = rt.compileGraph(g, device=f"cpu:{p}", constraints=rt.plans.PLANS[name](g, p))
    feeds = {n.name: np.random.default_rng(3).standard_normal(n.type.shape).astype(np.float32) for n in g.inputs}
    got, want = cg.run(feeds)["y"], rt.reference(g, feeds)["y"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # float32: contraction splits round only
    if name == "data_parallel":  # a batch of 6 splits p ways on 4 and on 6 devices
        assert _split(cg, "attention")["batch"] == p and _split(cg, "down_proj")["b0"] == p


def test_data_parallel_splits_the_batch_and_finds_none_in_one_sequence() -> None:
    cg = rt.compileGraph(llama_block(8, 16, 64, 4, 2, 96), device="cpu:8",
                         constraints=rt.plans.data_parallel(llama_block(8, 16, 64, 4, 2, 96), 8))
    assert all(_split(cg, n.name).get(x, 8) == 8 for n in cg.graph.operators for x in ("batch", "b0"))
    assert rt.plans.data_parallel(llama_block(1, 64, 64, 4, 2, 96), 8) == {}


@pytest.mark.parametrize("name,layout", [("ddp", "R"), ("fsdp", "S(0)"), ("zero3", "S(0)"), ("megatron_tp", None)])
def test_training_plans_keep_their_layouts_and_train_like_the_free_plan(name: str, layout: str | None) -> None:
    g = llama_training_graph(4, 16, 32, 4, 2, 48, 64, optimizer="adamw")
    feeds = llama_training_feeds(g)
    states = [n.name for n in g.inputs if n.role == "state"]
    free = rt.compileGraph(g, device="cpu:4")
    cg = rt.compileGraph(g, device="cpu:4", constraints=rt.plans.PLANS[name](g, 4))
    got = {}
    for c in (free, cg):
        c.load(feeds)
        c.execute()
        got[c] = {s: c.offload(s) for s in states}
    for s in states:  # one AdamW step in float32, its sums split differently: rounding relative to the largest
        assert np.abs(got[cg][s] - got[free][s]).max() <= 1e-5 * np.abs(got[free][s]).max() + 1e-7, s
    rows = {r["state"]: r for r in cg.state_layouts()}
    if layout is not None:
        assert {r["kept"] for r in rows.values()} == {"pinned"}
        assert rows["wq"]["placement"] == layout and rows["l0.wq.exp_avg" if "l0.wq.exp_avg" in rows
                                                         else "wq.exp_avg"]["placement"] == layout
    else:  # tensor parallel: the backward follows the forward (dX of a column-parallel matmul is row-parallel)
        assert _split(cg, "q_proj")["k"] == 4
    if name == "ddp":
        assert all(rows[s]["bytes_per_device"] == g.node(s).type.nbytes for s in states)


def test_fsdp_reduces_each_layer_s_gradient_during_the_backward(monkeypatch) -> None:
    """Under FSDP every device holds a partial sum of every weight's gradient; each is reduced and freed
    by its update right after it is made (``emission_order``), not held until the backward ends: the
    peak is lower than in the graph's order, and the step trains as that order and the single-device
    reference do."""
    from relational_tensors.physical import lower

    g = llama_training_graph(4, 8, 128, 4, 2, 256, 64, layers=8, optimizer="adamw")
    feeds = llama_training_feeds(g)
    states = [n.name for n in g.inputs if n.role == "state"]
    runs = {}
    for order in ("hoisted", "graph"):
        if order == "graph":
            monkeypatch.setattr(lower, "emission_order", lambda graph, partial=(): [n.id for n in graph.operators])
        cg = rt.compileGraph(g, device="cpu:4", constraints=rt.plans.PLANS["fsdp"](g, 4))
        cg.load(feeds)
        cg.execute()
        runs[order] = (max(cg.memory().values()), cg.memory_by_category(), {s: cg.offload(s) for s in states})
    (hoisted, cats, got), (graph_order, graph_cats, want) = runs["hoisted"], runs["graph"]
    assert hoisted < 0.8 * graph_order, (hoisted, graph_order)
    peak = max(cats, key=lambda d: sum(cats[d].values()))
    assert cats[peak]["gradients"] < 0.5 * graph_cats[peak]["gradients"]
    ref = rt.reference(g, feeds)  # and both are the single-device reference's step (float32 sums reordered)
    for s in states:  # the same sums in the same order: the same bits
        np.testing.assert_array_equal(got[s], want[s], err_msg=s)
        expected = ref[f"{s}.next"]
        assert np.abs(got[s] - expected).max() <= 1e-5 * np.abs(expected).max() + 1e-7, s


@pytest.mark.parametrize("name,layout", [("megatron_dp", None), ("fsdp_tp", "S(0)")])
def test_two_dimensional_plans_split_heads_in_groups_and_the_batch_across(name: str, layout: str | None) -> None:
    """Tensor parallelism in groups of 2 and data parallelism over 3 groups on 6 devices (the batch of 6,
    the heads of 4): both splits in one spec, and one AdamW step equal to the free plan's."""
    g = llama_training_graph(6, 16, 32, 4, 2, 48, 64, optimizer="adamw")
    feeds = llama_training_feeds(g)
    states = [n.name for n in g.inputs if n.role == "state"]
    constraints = rt.plans.PLANS[name](g, 6, tp=2)
    free = rt.compileGraph(g, device="cpu:6")
    cg = rt.compileGraph(g, device="cpu:6", constraints=constraints)
    assert {k: v for k, v in _split(cg, "q_proj").items() if v > 1} == {"k": 2, "b0": 3}
    got = {}
    for c in (free, cg):
        c.load(feeds)
        c.execute()
        got[c] = {s: c.offload(s) for s in states}
    for s in states:
        assert np.abs(got[cg][s] - got[free][s]).max() <= 1e-5 * np.abs(got[free][s]).max() + 1e-7, s
    rows = {r["state"]: r for r in cg.state_layouts()}
    if layout is not None:
        assert rows["wq"]["placement"] == layout
    else:  # as read: a group's half of the weight held by every group (at least half on each device)
        assert rows["wq"]["bytes_per_device"] >= g.node("wq").type.nbytes // 2
    with pytest.raises(rt.GraphError, match="tp dividing p"):
        rt.plans.PLANS[name](g, 6, tp=4)


def test_a_hand_plan_needs_a_graph_and_a_device_count() -> None:
    with pytest.raises(rt.GraphError, match="p >= 1"):
        rt.plans.megatron_tp(_block(), 0)
    with pytest.raises(rt.GraphError, match="rt.Graph"):
        rt.plans.data_parallel("block", 4)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_hand_plans_of_the_8b_block_and_step_plan_at_p8_as_they_say() -> None:
    """The shapes of the benchmark (planning only): Megatron TP and sequence parallelism on the 8K
    LLaMA-3-8B-shaped block, data parallelism on 8 x 1K, and DDP/FSDP/TP layouts of the 4-layer step."""
    from relational_tensors.graph.models import LLAMA3_8B

    block = llama_block(1, 8192, dtype="bfloat16", **LLAMA3_8B)
    tp = rt.compileGraph(block, device=8, constraints=rt.plans.megatron_tp(block, 8))
    sp = rt.compileGraph(block, device=8, constraints=rt.plans.sequence_parallel(block, 8))
    for cg in (tp, sp):
        assert _split(cg, "q_proj")["k"] == _split(cg, "o_proj")["j"] == _split(cg, "attention")["heads_kv"] == 8
    assert _split(sp, "attn_rmsnorm")["seq"] == _split(sp, "ffn_residual")["seq"] == 8
    wide = llama_block(8, 1024, dtype="bfloat16", **LLAMA3_8B)
    dp = rt.compileGraph(wide, device=8, constraints=rt.plans.data_parallel(wide, 8))
    assert all(_split(dp, n.name).get("batch", _split(dp, n.name).get("b0")) == 8 for n in wide.operators)
    step = llama_training_graph(8, 1024, dtype="bfloat16", vocab=128256, layers=4, optimizer="adamw",
                                master_dtype="float32", **LLAMA3_8B)
    states = [n.name for n in step.inputs if n.role == "state"]
    for name, placement in (("ddp", "R"), ("fsdp", "S(0)"), ("megatron_tp", None)):
        cg = rt.compileGraph(step, device=8, constraints=rt.plans.PLANS[name](step, 8))
        rows = {r["state"]: r for r in cg.state_layouts()}
        if placement is not None:
            assert all(rows[s]["placement"] == placement for s in states if step.node(s).type.shape[0] >= 8)
        else:
            assert _split(cg, "l0.q_proj")["k"] == 8 and rows["l0.wq"]["placement"] == "S(1)"

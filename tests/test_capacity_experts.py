"""Experts with a capacity in per-group buffers (``add_moe_ffn(capacity_factor=..., experts_compute="grouped")``,
``capacity_route`` and ``routed_gather`` in ``sql_specs/experts.py``): the tokens in groups, each group's
routed pairs placed in ``[experts, capacity]`` rows first come first served, the experts' products batched
over the buffers, the rows gathered back.  Checked against a per-token torch loop with GShard's per-group
capacity (values) and torch autograd (gradients), on 1 to 4 virtual devices with the optimizer's plan and
expert parallelism; the maps against a loop over the pairs; the gather's splits against the whole; and bad
maps refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from test_grouped_experts import step_under_plan  # noqa: E402  (the AdamW step under a plan)

import relational_tensors as rt  # noqa: E402
from relational_tensors.core.types import TensorType  # noqa: E402
from relational_tensors.errors import ExecError, GraphError  # noqa: E402
from relational_tensors.graph.moe import add_moe_ffn, default_capacity_groups, moe_layer_graph  # noqa: E402
from relational_tensors.graph.reference import execute_spec  # noqa: E402
from relational_tensors.sql_specs.experts import CapacityRouteOp, RoutedGatherOp, capacity_maps  # noqa: E402

F = torch.nn.functional
T, D, E, K, FF = 16, 8, 4, 2, 6


def _loop_maps(ids: np.ndarray, experts: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The slot and pair maps by walking each group's pairs in order."""
    groups = ids.shape[0]
    flat = ids.reshape(groups, -1)
    slot = np.full(flat.shape, -1, np.int64)
    pair = np.full((groups, experts * capacity), -1, np.int64)
    for g in range(groups):
        taken = [0] * experts
        for p, e in enumerate(flat[g]):
            if 0 <= e < experts and taken[e] < capacity:
                slot[g, p] = e * capacity + taken[e]
                pair[g, slot[g, p]] = p
                taken[e] += 1
    return slot, pair


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 4), tokens=st.integers(1, 9), k=st.integers(1, 3), experts=st.integers(1, 5),
       capacity=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_the_maps_place_pairs_first_come_first_served(groups: int, tokens: int, k: int, experts: int, capacity: int,
                                                     seed: int) -> None:
    ids = np.random.default_rng(seed).integers(-1, experts + 1, (groups, tokens, k))  # -1, experts: no expert
    slot, pair = capacity_maps(ids, experts, capacity)
    want_slot, want_pair = _loop_maps(ids, experts, capacity)
    np.testing.assert_array_equal(slot, want_slot)
    np.testing.assert_array_equal(pair, want_pair)
    op = CapacityRouteOp((TensorType.zero(ids.shape, "int64"),), experts, capacity, "pair")
    assert op.output_type.shape == pair.shape


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 3), tokens=st.integers(1, 7), k=st.integers(1, 3), h=st.integers(1, 5),
       experts=st.integers(1, 4), capacity=st.integers(1, 4),
       pieces=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       seed=st.integers(0, 2**16))
def test_gather_splits_sum_to_the_whole(groups: int, tokens: int, k: int, h: int, experts: int, capacity: int,
                                        pieces: tuple[int, int, int, int], seed: int) -> None:
    """Dispatch and combine under every split of groups, rows (⊕ = sum), m and hidden, sizes that do not
    divide: the whole gather."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (groups, tokens, k))
    slot, pair = capacity_maps(ids, experts, capacity)
    x = rng.standard_normal((groups, tokens, h)).astype(np.float32)
    buffers = rng.standard_normal((groups, experts * capacity, h)).astype(np.float32)
    wanted = dict(zip(("groups", "rows", "m", "hidden"), pieces))
    for src, index, inverse, per in ((x, pair, slot, k), (buffers, slot, pair, 1)):
        op = RoutedGatherOp((TensorType.zero(src.shape), TensorType.zero(index.shape, "int64"),
                             TensorType.zero(inverse.shape, "int64")))
        want = np.zeros((groups, index.shape[1], h), np.float32)
        for g in range(groups):
            for i in range(index.shape[1]):
                if index[g, i] >= 0:
                    want[g, i] = src[g, index[g, i] // per]
        request = {}
        for ix in op.requestable():
            ivs = ix.near_equal(wanted[ix.name]) if ix.name in wanted else None
            if ivs is not None:
                request[ix.name] = ivs
        np.testing.assert_array_equal(execute_spec(op, op.spec(request), [src, index, inverse]), want)


def test_bad_maps_are_refused() -> None:
    x = np.ones((1, 3, 2), np.float32)
    slot, pair = capacity_maps(np.array([[[0], [1], [0]]]), 2, 2)  # [1, 3], [1, 4]
    op = RoutedGatherOp((TensorType.zero(x.shape), TensorType.zero(pair.shape, "int64"),
                         TensorType.zero(slot.shape, "int64")))
    (f,) = op.spec({}).functions
    wrong = pair.copy()
    wrong[0, 0], wrong[0, 1] = wrong[0, 1], wrong[0, 0]  # a swap the inverse does not know
    with pytest.raises(ExecError, match="not each other's inverse"):
        op.kernel([x, wrong, slot], f)
    with pytest.raises(ExecError, match=r"positions in \[0, 3\) or -1"):
        op.kernel([x, np.array([[0, 7, -1, -1]]), slot], f)
    with pytest.raises(GraphError, match="d entries per row"):
        RoutedGatherOp((TensorType.zero((1, 3, 2)), TensorType.zero((1, 4), "int64"), TensorType.zero((1, 4), "int64")))
    with pytest.raises(GraphError, match="capacity_route's capacity"):
        CapacityRouteOp((TensorType.zero((1, 3, 1), "int64"),), 2, 0, "slot")
    g = rt.Graph()
    x = g.input("x", [T, D])
    with pytest.raises(GraphError, match="leave one of the two out"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, capacity_factor=1.0, experts_compute="grouped",
                    routing_hint=(1.0,) * E)
    with pytest.raises(GraphError, match="divides the 16 tokens"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, capacity_factor=1.0, capacity_groups=3)
    with pytest.raises(GraphError, match="give capacity_factor too"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, capacity_groups=2)
    assert len(g.nodes) == 1  # refused before any node was added


def _layer(compute: str, groups: int | None, factor: float = 0.75, dtype: str = "float32") -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [T, D], dtype)
    g.save(add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, capacity_factor=factor, capacity_groups=groups,
                       experts_compute=compute), name="y")
    return g


def _feeds(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n.name: (rng.standard_normal(n.type.shape) * 0.5).astype(np.float32) for n in g.inputs}


def _torch_layer(f: dict[str, np.ndarray], groups: int, factor: float, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer as a per-token loop, each group of T // groups tokens with its own capacity."""
    x, router = params["x"], params["router"]
    probs = torch.softmax(x @ router, -1)
    top, ids = torch.topk(probs, K)
    top = top / top.sum(-1, keepdim=True)
    per = T // groups
    capacity = math.ceil(factor * per * K / E)
    keep = torch.ones(T, K, dtype=torch.float64)
    for g in range(groups):
        taken = [0] * E
        for t in range(g * per, (g + 1) * per):
            for j in range(K):
                e = int(ids[t, j])
                keep[t, j] = float(taken[e] < capacity)
                taken[e] += 1
    top = top * keep
    w1, w3, w2 = params["w1"], params["w3"], params["w2"]
    rows = []
    for t in range(T):
        acc = torch.zeros(D, dtype=torch.float64)
        for j in range(K):
            e = int(ids[t, j])
            acc = acc + top[t, j] * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("groups", [1, 2, 4, None])
def test_buffers_equal_a_per_token_loop_on_every_device_count(groups: int | None) -> None:
    """The buffered layer, and the dense one with the same capacity, against the loop (some pairs dropped)."""
    n = groups or default_capacity_groups(T)
    buffered, dense = _layer("grouped", groups), _layer("dense", groups)
    f = _feeds(buffered)
    params = {k: torch.tensor(v, dtype=torch.float64) for k, v in f.items()}
    want = _torch_layer(f, n, 0.75, params).numpy()
    if n < T:  # a capacity of one pair per expert and token drops none
        dropless = rt.reference(_layer("grouped", groups, factor=8.0), f)["y"]
        assert np.abs(dropless - want).max() > 1e-3  # the capacity drops pairs here
    np.testing.assert_allclose(rt.reference(dense, f)["y"], want, rtol=1e-4, atol=1e-6)
    for device in ("cpu:1", "cpu:2", "cpu:4"):
        got = rt.compileGraph(buffered, device=device).run(f)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=device)


def test_gradients_equal_torch_autograd() -> None:
    """d x, d router and d every expert weight through the buffers, on 1 and 3 devices."""
    g = _layer("grouped", 2)
    y = g.tensor(g.outputs["y"])
    names = ("x", "router", "w1", "w3", "w2")
    grads = g.grad(g.reshape(g.mean(g.mul(y, y), [0, 1], keepdims=True), []), [g.tensor(g.node(n).id) for n in names])
    for n, d in zip(names, grads):
        g.save(d, name=f"d{n}")
    f = _feeds(g, seed=7)
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in f.items()}
    _torch_layer(f, 2, 0.75, params).square().mean().backward()
    for device in ("cpu:1", "cpu:3"):
        got = rt.compileGraph(g, device=device).run(f)
        for n in names:
            np.testing.assert_allclose(got[f"d{n}"], params[n].grad.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=f"d{n} on {device}")


@pytest.mark.parametrize("plan", ["optimizer", "expert_parallel"])
def test_a_training_step_under_each_plan_equals_the_reference(plan: str) -> None:
    """The buffered layer's AdamW step on cpu:4: expert parallelism splits the batched products over the
    experts, the dispatch and combine stay split over the groups, and the values are the reference's."""
    g = moe_layer_graph(T, D, experts=E, top_k=K, d_ff=FF, dtype="float32", training=True, master_dtype=None,
                        experts_compute="grouped", capacity_factor=1.0, capacity_groups=4)
    step_under_plan(g, plan, "experts")


def test_bfloat16_buffers_equal_the_loop_within_rounding() -> None:
    g = _layer("grouped", 2, dtype="bfloat16")
    f = _feeds(g)
    bf = {k: np.asarray(v, np.float32) for k, v in rt.compileGraph(g, device="cpu:1").run(f).items()}
    exact = {k: torch.tensor(np.asarray(v, np.float32), dtype=torch.float64) for k, v in f.items()}
    want = _torch_layer(f, 2, 0.75, exact).numpy()
    assert np.abs(bf["y"] - want).max() <= 4 * 2**-8 * max(1.0, np.abs(want).max())


def test_the_optimizer_finds_all_to_all_expert_parallelism_and_keeps_it_under_a_memory_limit() -> None:
    """A capacity layer's training step planned for 8 simulated H200s: the optimizer splits the experts'
    products over the experts (each device updates its experts' weights) and the router, dispatch and
    combine over the groups, so the buffers move between them (the all-to-alls); it costs no more than the
    hand EP plan.  Under a memory limit that replicated experts would exceed, the plan still fits."""
    g = moe_layer_graph(2048, 512, experts=8, top_k=2, d_ff=1024, dtype="bfloat16", training=True,
                        experts_compute="grouped", capacity_factor=1.25)
    cg = rt.compileGraph(g, device=8, topology="hgx-h200", cost_model="calibrated")
    splits = {n: dict(cg.plan.spec(n).split) for n in ("expert_gate", "expert_down", "dispatch", "gather_back")}
    assert splits["expert_gate"]["experts"] == 8 and splits["expert_down"]["experts"] == 8, splits
    assert splits["dispatch"].get("groups", 1) > 1 and splits["gather_back"].get("groups", 1) > 1, splits
    hand = rt.compileGraph(g, device=8, topology="hgx-h200", cost_model="calibrated",
                           constraints=rt.plans.expert_parallel(g, 8))
    assert cg.plan.cost <= hand.plan.cost * (1 + 1e-9)
    weights = sum(n.type.nbytes for n in g.inputs if n.type.rank == 3)  # the experts' weights and moments
    limit = int(max(cg.live.peak.values()) * 1.05)
    assert limit < weights  # replicating the experts alone would not fit
    tight = rt.compileGraph(g, device=8, topology="hgx-h200", cost_model="calibrated", memory_per_device=limit)
    assert max(tight.live.peak.values()) <= limit
    assert dict(tight.plan.spec("expert_gate").split).get("experts", 1) > 1

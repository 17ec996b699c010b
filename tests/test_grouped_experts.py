"""Sparse experts (``add_moe_ffn(experts_compute="grouped")``, ``sql_specs/experts.py``): the routed pairs
sorted by expert, each row through its own expert only.  Checked against a per-token torch loop (values)
and torch autograd (gradients of the input, the router and every expert weight), on 1 to 4 virtual
devices with every split the planner may choose, including experts split over devices (expert
parallelism); the maps against a stable sort; the kernels' splits against the whole kernel; and against
the dense form it replaces, in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from test_moe_router import FF, D, E, K, _feeds, _reference  # noqa: E402  (its layer's sizes and feeds)

import relational_tensors as rt  # noqa: E402
from relational_tensors.core.types import TensorType  # noqa: E402
from relational_tensors.graph.models import optimizer_feeds  # noqa: E402
from relational_tensors.graph.moe import add_moe_ffn, moe_layer_graph  # noqa: E402
from relational_tensors.sql_specs.experts import GroupedMatmulOp, GroupedWeightGradOp, RouteIndexOp, route_maps  # noqa: E402

F = torch.nn.functional
T = 13  # tokens (test_moe_router's layer has 19)


def _layer(experts_compute: str, dtype: str = "float32", **router: object) -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [T, D], dtype)
    g.save(add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, experts_compute=experts_compute, **router), name="y")
    return g


def test_the_maps_are_a_stable_sort_by_expert() -> None:
    ids = np.array([[3, 0], [0, 2], [3, 1], [9, 0]])  # 9: a sentinel, sorted last, in no expert's rows
    token, dest, group = route_maps(ids, 4)
    assert group.tolist() == [0, 0, 0, 1, 2, 3, 3, 4]
    assert token.tolist() == [0, 1, 3, 2, 1, 0, 2, 3]
    flat = ids.reshape(-1)
    for t in range(4):
        for j in range(2):
            assert token[dest[t, j]] == t and group[dest[t, j]] == min(flat[t * 2 + j], 4)


@pytest.mark.parametrize("router", [dict(), dict(gate="sigmoid", selection_bias=True, scaling=2.0),
                                    dict(capacity_factor=0.75), dict(shared_d_ff=5)],
                         ids=["softmax", "sigmoid_bias", "capacity", "shared"])
def test_grouped_equals_dense_on_every_device_count(router: dict) -> None:
    dense, grouped = _layer("dense", **router), _layer("grouped", **router)
    f = _feeds(dense)
    want = rt.reference(dense, f)["y"]
    if not router:
        np.testing.assert_allclose(want, _reference(f)["y"], rtol=1e-4, atol=1e-5)
    for device in ("cpu:1", "cpu:2", "cpu:4"):
        got = rt.compileGraph(grouped, device=device).run(f)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=device)


@pytest.mark.parametrize("plan", ["optimizer", "expert_parallel", "expert_tensor_parallel"])
def test_a_training_step_under_each_plan_equals_the_reference(plan: str) -> None:
    """The grouped layer's AdamW step on cpu:4 under the optimizer's plan and the hand plans: the
    reference's loss and updated weights; expert parallelism splits the grouped products over the experts
    (each device runs the rows routed to its experts; ⊕ sums the expert blocks)."""
    g = moe_layer_graph(T, D, experts=4, top_k=K, d_ff=FF, dtype="float32", training=True, master_dtype=None,
                        experts_compute="grouped")
    step_under_plan(g, plan, "experts")


def step_under_plan(g: rt.Graph, plan: str, experts_index: str) -> None:
    """``g``'s AdamW step on cpu:4 under ``plan`` (the optimizer's, or a hand plan of ``rt.plans``) against
    the reference's updated weights; under expert parallelism the expert products split ``experts_index``."""
    constraints = None if plan == "optimizer" else rt.plans.PLANS[plan](g, 4)
    cg = rt.compileGraph(g, device="cpu:4", constraints=constraints)
    f = optimizer_feeds(g, _feeds(g, seed=3))  # zero moments: random ones make sqrt NaN
    want = rt.reference(g, f)
    cg.run(f)
    for name in ("w1", "w2", "w3", "router", "ffn_norm"):
        np.testing.assert_allclose(cg.offload(name), want[f"{name}.next"], rtol=1e-4, atol=1e-6, err_msg=name)
    if plan == "expert_parallel":
        splits = {n: dict(cg.plan.spec(n).split) for n in ("expert_gate", "expert_up", "expert_down")}
        assert all(s.get(experts_index, 1) > 1 for s in splits.values()), splits


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 17), h=st.integers(1, 6), f=st.integers(1, 7), e=st.integers(1, 5),
       pieces=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       trans=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_splits_sum_to_the_whole(rows: int, h: int, f: int, e: int, pieces: tuple[int, int, int, int],
                                        trans: bool, seed: int) -> None:
    """Every split of rows, hidden, ff and experts (sizes that do not divide) of both products gives the
    whole kernel's result after ⊕ (sums of the expert and hidden blocks)."""
    from relational_tensors.graph.reference import execute_spec

    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((rows, h)).astype(np.float32)
    w = rng.standard_normal((e, f, h) if trans else (e, h, f)).astype(np.float32)
    dy = rng.standard_normal((rows, f)).astype(np.float32)
    group = rng.integers(0, e + 1, rows).astype(np.int64)  # e: rows of no expert (zeros)
    mm = GroupedMatmulOp((TensorType.zero(xs.shape), TensorType.zero(w.shape), TensorType.zero(group.shape, "int64")),
                         trans)
    wg = GroupedWeightGradOp((TensorType.zero(xs.shape), TensorType.zero(dy.shape),
                              TensorType.zero(group.shape, "int64")), e)
    want_mm = np.zeros((rows, f), np.float64)
    want_wg = np.zeros((e, h, f), np.float64)
    for p in range(rows):
        if group[p] < e:
            we = w[group[p]].T if trans else w[group[p]]
            want_mm[p] = xs[p] @ we
            want_wg[group[p]] += np.outer(xs[p], dy[p])
    wanted = dict(zip(("rows", "hidden", "ff", "experts"), pieces))

    def request(op: object) -> dict:
        out = {}
        for index in op.requestable():  # type: ignore[attr-defined]
            ivs = index.near_equal(wanted[index.name]) if index.name in wanted else None
            if ivs is not None:
                out[index.name] = ivs
        return out
    got_mm = execute_spec(mm, mm.spec(request(mm)), [xs, w, group])
    got_wg = execute_spec(wg, wg.spec(request(wg)), [xs, dy, group])
    np.testing.assert_allclose(got_mm, want_mm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_wg, want_wg, rtol=1e-5, atol=1e-5)


def test_gradients_equal_torch_autograd() -> None:
    """d x, d router and d every expert weight of the grouped layer inside a training step's loss, against
    torch autograd through a per-token loop, on 1 and 3 devices."""
    g = _layer("grouped")
    x, y = g.tensor(g.node("x").id), g.tensor(g.outputs["y"])
    wrt = [g.tensor(g.node(n).id) for n in ("x", "router", "w1", "w3", "w2")]
    loss = g.reshape(g.mean(g.mul(y, y), [0, 1], keepdims=True), [])
    grads = g.grad(loss, wrt)
    for n, d in zip(("x", "router", "w1", "w3", "w2"), grads):
        g.save(d, name=f"d{n}")
    f = _feeds(g, seed=7)
    tx = torch.tensor(f["x"], dtype=torch.float64, requires_grad=True)
    tr = torch.tensor(f["router"], dtype=torch.float64, requires_grad=True)
    w1, w3, w2 = (torch.tensor(f[k], dtype=torch.float64, requires_grad=True) for k in ("w1", "w3", "w2"))
    probs = torch.softmax(tx @ tr, -1)
    top, ids = torch.topk(probs, K)
    top = top / top.sum(-1, keepdim=True)
    rows = []
    for t in range(T):
        acc = torch.zeros(D, dtype=torch.float64)
        for j in range(K):
            e = int(ids[t, j])
            acc = acc + top[t, j] * ((F.silu(tx[t] @ w1[e]) * (tx[t] @ w3[e])) @ w2[e])
        rows.append(acc)
    torch.stack(rows).square().mean().backward()
    want = {"dx": tx.grad, "drouter": tr.grad, "dw1": w1.grad, "dw3": w3.grad, "dw2": w2.grad}
    for device in ("cpu:1", "cpu:3"):
        got = rt.compileGraph(g, device=device).run(f)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{k} on {device}")
    assert x is not None


def test_bfloat16_grouped_equals_dense_within_rounding() -> None:
    """In bfloat16 the two forms round differently (the dense sum carries zero-weighted experts): they
    agree within bfloat16's rounding of the output's magnitude (a few units of 2**-8)."""
    dense, grouped = _layer("dense", "bfloat16"), _layer("grouped", "bfloat16")
    f = _feeds(dense)
    want = _reference({k: np.asarray(v, np.float32) for k, v in f.items()})["y"]
    got = np.asarray(rt.compileGraph(grouped, device="cpu:2").run(f)["y"], np.float32)
    assert np.abs(got - want).max() <= 4 * 2**-8 * max(1.0, np.abs(want).max())


def test_a_training_step_with_grouped_experts_equals_the_dense_one() -> None:
    """moe_layer_graph's AdamW step, grouped against dense: the loss and every updated weight."""
    kw = dict(tokens=T, d_model=D, experts=E, top_k=K, d_ff=FF, dtype="float32", training=True, master_dtype=None)
    dense = moe_layer_graph(**kw)
    grouped = moe_layer_graph(**kw, experts_compute="grouped")
    f = _feeds(dense, seed=11)
    f.update({n.name: np.zeros(n.type.shape, np.float32) for n in dense.inputs if "exp_avg" in n.name
              or n.name == "adamw.step"})  # moments start at zero (random ones make sqrt NaN)
    want = rt.reference(dense, f)
    got = rt.compileGraph(grouped, device="cpu:2").run(f)
    for k in want:
        assert np.isfinite(np.asarray(want[k], np.float64)).all(), k
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6, err_msg=k)


def test_a_routing_hint_prices_the_expert_blocks_and_is_in_the_catalog() -> None:
    """A measured histogram as the cost model's routing: a block of experts costs its experts' share of the
    rows (uniform without a hint), the gradients carry it, the catalog's operators show it, and the values
    do not depend on it."""
    hint = (0.7, 0.1, 0.1, 0.05, 0.05)
    g = rt.Graph()
    x = g.input("x", [T, D])
    y = add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, experts_compute="grouped", routing_hint=hint)
    g.save(y, name="y")
    (dx,) = g.grad(g.reshape(g.mean(g.mul(y, y), [0, 1], keepdims=True), []), [g.tensor(g.node("w1").id)])
    g.save(dx, name="dw1")
    gate = g.node("expert_gate").op
    spec = gate.spec({"experts": next(i for i in gate.requestable() if i.name == "experts").near_equal(2)})
    whole = 2.0 * T * K * FF * D
    shares = [f.flops / whole for f in spec.functions]
    lows = [f.inputs[1].lower[0] for f in spec.functions]
    highs = [f.inputs[1].upper[0] for f in spec.functions]
    assert shares == pytest.approx([sum(hint[a:b]) / sum(hint) for a, b in zip(lows, highs)])
    assert all(op.routing == hint for op in (n.op for n in g.operators)
               if op.kind in ("grouped_matmul", "grouped_weight_grad"))
    uniform = GroupedMatmulOp(gate.input_types, gate.trans_w)
    halves = uniform.spec({"experts": next(i for i in uniform.requestable() if i.name == "experts").near_equal(2)})
    assert [f.flops / whole for f in halves.functions] == pytest.approx([(b - a) / E for a, b in zip(lows, highs)])
    cg = rt.compileGraph(g, device="cpu:2")
    params = cg.sql("SELECT params FROM operators WHERE op_kind = 'grouped_matmul'").column("params").to_pylist()
    assert params and all("0.7" in p for p in params)
    f = _feeds(g)
    plain = _layer("grouped")
    np.testing.assert_allclose(cg.run(f)["y"], rt.reference(plain, f)["y"], rtol=1e-4, atol=1e-5)
    with pytest.raises(rt.GraphError, match="routing hint"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, experts_compute="grouped", routing_hint=(1.0, 2.0),
                    prefix="b.")
    with pytest.raises(rt.GraphError, match="experts_compute='grouped'"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, routing_hint=hint, prefix="c.")


def test_the_weight_gradient_is_not_differentiated_again() -> None:
    g = rt.Graph()
    xs, dy, group = g.input("xs", [6, 3]), g.input("dy", [6, 4]), g.input("group", [6], "int64")
    dw = g.apply(GroupedWeightGradOp((xs.type, dy.type, group.type), 2), xs, dy, group)
    with pytest.raises(rt.GraphError, match="first-order gradient"):
        g.vjp(dw, g.input("cot", dw.shape), [xs])


def test_bad_arguments_are_refused() -> None:
    g = rt.Graph()
    x = g.input("x", [T, D])
    with pytest.raises(rt.GraphError, match="experts_compute"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, experts_compute="sparse")
    with pytest.raises(rt.GraphError, match="route_index"):
        RouteIndexOp((TensorType.zero((3,), "int64"),), 4, "token")
    with pytest.raises(rt.GraphError, match="one of"):
        RouteIndexOp((TensorType.zero((3, 2), "int64"),), 4, "sorted")
    with pytest.raises(rt.GraphError, match="input width"):
        GroupedMatmulOp((TensorType.zero((4, 3)), TensorType.zero((2, 5, 6)), TensorType.zero((4,), "int64")))
    with pytest.raises(rt.GraphError, match="group ids"):
        GroupedMatmulOp((TensorType.zero((4, 5)), TensorType.zero((2, 5, 6)), TensorType.zero((3,), "int64")))

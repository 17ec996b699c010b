"""Gradients of every operator: the reference gradient against central finite differences and torch
autograd (float64), and the planned gradient on cpu:p against the reference (float64 1e-9, float32
1e-4, 16-bit at the forward tests' tolerances, each relative to the largest magnitude of the compared
tensor).  CI runs one device count per case; RT_FULL_GRAD=1 runs p = 1..8 in every dtype."""

from __future__ import annotations

import contextlib
import os
import zlib

import numpy as np
import pytest
from cases import CASES, CATALOG, GRAD_CASES, NOT_DIFFERENTIABLE, SIXTEEN_BIT_TOL, assert_agrees, feeds_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_reference import torch_gradients

import relational_tensors as rt
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.graph.models import llama_training_feeds, llama_training_graph
from relational_tensors.graph.reference import execute_spec, run_operator
from relational_tensors.sql_specs import AttentionOp

FULL = os.environ.get("RT_FULL_GRAD") == "1"
REL_TOL = {"float64": 1e-9, "float32": 1e-4}
NAMES = sorted(GRAD_CASES)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    return float(np.max(np.abs(got - want), initial=0.0)) / scale


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    if dtype in SIXTEEN_BIT_TOL:
        assert_agrees(got, want, dtype, what)
        return
    got, want = np.asarray(got), np.asarray(want)
    same_inf = np.isinf(want) & (got == want)  # a log-sum-exp of a row that sees no key: -inf on both
    assert np.array_equal(np.isinf(got), np.isinf(want)), f"{what}: infinities differ"
    err = rel_err(np.where(same_inf, 0.0, got), np.where(same_inf, 0.0, want))
    assert err <= REL_TOL[dtype], f"{what}: error {err:.2e} of the largest magnitude > {REL_TOL[dtype]:g} ({dtype})"


def grad_names(g: rt.Graph) -> list[str]:
    return [k for k in g.outputs if k.startswith("d_")]


def device_counts(name: str) -> list[int]:
    """p = 1..8 in the full sweep; in CI one count per case, spread over 2..8 by the case's name."""
    return list(range(1, 9)) if FULL else [2 + zlib.crc32(name.encode()) % 7]


# --- the reference gradient -------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_reference_gradient_equals_finite_differences(name: str) -> None:
    """<∇, u> of the reference equals the central difference of <out, cot> along random directions u."""
    g, _ = GRAD_CASES[name]("float64")
    forward, _ = CASES[name]("float64")
    if forward.nodes[forward.outputs["out"]].type.dtype != "float64":
        pytest.skip("the output is rounded to float32 (a cast): differences at h = 1e-6 are noise; torch checks it")
    feeds = feeds_for(g, seed=1)
    grads = rt.reference(g, feeds)
    rng = np.random.default_rng(2)
    wrt = [k[2:] for k in grad_names(g)]

    def f(values: dict) -> float:
        inputs = {k: v for k, v in values.items() if k != "cot"}
        return float(np.sum(rt.reference(forward, inputs)["out"] * feeds["cot"]))

    h = 1e-6
    for _ in range(3):
        u = {w: rng.standard_normal(feeds[w].shape) for w in wrt}
        plus = {**feeds, **{w: feeds[w] + h * u[w] for w in wrt}}
        minus = {**feeds, **{w: feeds[w] - h * u[w] for w in wrt}}
        numeric = (f(plus) - f(minus)) / (2 * h)
        exact = sum(float(np.sum(grads[f"d_{w}"] * u[w])) for w in wrt)
        bound = sum(float(np.linalg.norm(grads[f"d_{w}"]) * np.linalg.norm(u[w])) for w in wrt)
        assert abs(numeric - exact) <= 1e-6 * max(bound, 1e-12), (name, numeric, exact)


@pytest.mark.parametrize("name", NAMES)
def test_reference_gradient_equals_torch_autograd(name: str) -> None:
    g, _ = GRAD_CASES[name]("float64")
    feeds = feeds_for(g, seed=3)
    got = rt.reference(g, feeds)
    wrt = [k[2:] for k in grad_names(g)]
    want = torch_gradients(g, "out", feeds["cot"], feeds, wrt)
    precision = g.nodes[g.outputs["out"]].type.dtype  # a cast to float32 on the way limits both to it
    for w in wrt:
        assert_close(got[f"d_{w}"], want[w], precision, f"{name} d_{w}")


def test_small_cases_equal_finite_differences_per_element() -> None:
    """Every element of the gradient of small float64 graphs, by central differences."""
    g = rt.Graph()
    x, w = g.input("x", [3, 4], "float64"), g.parameter("w", [4, 5], "float64")
    b, t = g.parameter("b", [5], "float64"), g.input("t", [3], "int64")
    nw = g.parameter("nw", [4], "float64")
    logits = g.add(g.matmul(g.rmsnorm(x, nw, 1e-5), w), b)
    loss = g.save(g.cross_entropy(g.unary(logits, "tanh"), t), name="loss")
    params = [x, w, b, nw]
    for p, d in zip(params, g.grad(loss, params)):
        g.save(d, name=f"d_{p.name}")
    rng = np.random.default_rng(0)
    feeds = {n.name: rng.standard_normal(n.type.shape) for n in g.inputs if n.name != "t"}
    feeds["t"] = np.array([0, 4, 2])
    got = rt.reference(g, feeds)
    for p in params:
        num = np.zeros(p.shape)
        for idx in np.ndindex(*p.shape):
            up, down = {k: v.copy() for k, v in feeds.items()}, {k: v.copy() for k, v in feeds.items()}
            up[p.name][idx] += 1e-6
            down[p.name][idx] -= 1e-6
            num[idx] = (rt.reference(g, up)["loss"][0] - rt.reference(g, down)["loss"][0]) / 2e-6
        np.testing.assert_allclose(got[f"d_{p.name}"], num, rtol=1e-6, atol=1e-8)


# --- planned gradients against the reference -----------------------------------------------------------

CI_DTYPES = ("float32",)
FULL_DTYPES = ("float64", "float32", "float16", "bfloat16")


@pytest.mark.parametrize("dtype", FULL_DTYPES if FULL else CI_DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_planned_gradient_equals_reference(name: str, dtype: str) -> None:
    g, _ = GRAD_CASES[name](dtype)
    feeds = feeds_for(g, seed=4)
    want = rt.reference(g, feeds)
    for p in device_counts(name):
        got = rt.compileGraph(g, device=f"cpu:{p}", catalog=CATALOG).run(feeds)
        for k in g.outputs:
            assert_close(got[k], want[k], dtype, f"{name} p={p} {k}")


@pytest.mark.parametrize("name", ["matmul_1000_tokens", "attention_packed_7", "cross_entropy_tokens_ignore",
                                  "rmsnorm", "embedding", "rope_packed"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_planned_gradient_in_other_dtypes(name: str, dtype: str) -> None:
    """A sample of the full sweep's other dtypes in CI."""
    g, _ = GRAD_CASES[name](dtype)
    feeds = feeds_for(g, seed=5)
    want = rt.reference(g, feeds)
    got = rt.compileGraph(g, device="cpu:5", catalog=CATALOG).run(feeds)
    for k in g.outputs:
        assert_close(got[k], want[k], dtype, f"{name} {k}")


def _backward_ops(g: rt.Graph, forward_len: int) -> list:
    return [n for n in g.nodes[forward_len:] if n.op is not None and n.op.requestable()]


@settings(max_examples=60 if not FULL else 400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NAMES), st.data())
def test_backward_operators_decompose_under_any_interval_request(name: str, data) -> None:
    """Each gradient operator's spec for a random interval request, joined and ⊕-aggregated, equals the
    operator on whole inputs (the plans' building block, independent of which plan the DP picks)."""
    forward, _ = CASES[name]("float64")
    g, _ = GRAD_CASES[name]("float64")
    node = data.draw(st.sampled_from(_backward_ops(g, len(forward.nodes))))
    op = node.op
    request = {}
    for s in op.requestable():
        cuts = sorted(data.draw(st.sets(st.sampled_from(list(s.legal_cuts())), max_size=3))) if s.max_intervals() > 1 \
            else []
        bounds = [0, *cuts, s.extent]
        request[s.name] = tuple(rt.Interval(a, b) for a, b in zip(bounds, bounds[1:]))
    feeds = feeds_for(g, seed=6)
    probe = rt.Graph()
    probe.nodes, probe._names = list(g.nodes), set(g._names)
    probe.outputs = {f"in{k}": i for k, i in enumerate(node.inputs)}
    vals = rt.reference(probe, feeds)
    inputs = [vals[f"in{k}"] for k in range(len(node.inputs))]
    whole = run_operator(op, inputs)
    split = execute_spec(op, op.spec(request), inputs)
    assert_close(split, whole, "float64", f"{node.name} {op.kind} {request}")


@settings(max_examples=25 if not FULL else 150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 40), d=st.integers(1, 12), vocab=st.integers(2, 30), p=st.integers(1, 8),
       seed=st.integers(0, 3), selector=st.sampled_from(["dp", "random", "greedy"]))
def test_mlp_with_cross_entropy_any_shape_devices_and_plan(tokens, d, vocab, p, seed, selector) -> None:
    g = rt.Graph()
    x, t = g.input("x", [tokens, d]), g.input("t", [tokens], "int64")
    w1, w2 = g.parameter("w1", [d, 2 * d + 1]), g.parameter("w2", [2 * d + 1, vocab])
    nw = g.parameter("nw", [d])
    h = g.unary(g.matmul(g.rmsnorm(x, nw, 1e-5), w1), "silu")
    loss = g.save(g.cross_entropy(g.matmul(h, w2), t, ignore_index=0), name="loss")
    for q, dq in zip([x, w1, w2, nw], g.grad(loss, [x, w1, w2, nw])):
        g.save(dq, name=f"d_{q.name}")
    rng = np.random.default_rng(seed)
    feeds = {n.name: rng.standard_normal(n.type.shape).astype(np.float32) for n in g.inputs if n.name != "t"}
    feeds["t"] = rng.integers(0, vocab, size=tokens)
    feeds["t"][0] = 1 if vocab > 1 else 0  # at least one counted token
    want = rt.reference(g, feeds)
    got = rt.compileGraph(g, device=f"cpu:{p}", selector=selector, seed=seed, catalog=CATALOG).run(feeds)
    for k in g.outputs:
        assert_close(got[k], want[k], "float32", f"{k} tokens={tokens} d={d} vocab={vocab} p={p} {selector}")


# --- the LLaMA-style block with a cross-entropy loss -------------------------------------------------------

PACKED = (5, 9, 20, 22, 31, 40, 47)


def _llama(dtype: str = "float32"):
    return llama_training_graph(batch=1, seq=47, d_model=48, n_heads=6, n_kv_heads=3, d_ff=70, vocab=97,
                                dtype=dtype, seq_ends=PACKED, ignore_index=5)


@pytest.mark.parametrize("p", range(1, 9) if FULL else [1, 3, 8])
def test_llama_block_gradients_on_cpu_devices(p: int) -> None:
    g = _llama()
    feeds = llama_training_feeds(g)
    want = rt.reference(g, feeds)
    got = rt.compileGraph(g, device=f"cpu:{p}", catalog=CATALOG).run(feeds)
    assert len([k for k in g.outputs if k.startswith("grad.")]) == 12  # embed, 7 in the block x 1, norms, head
    for k in g.outputs:
        assert_close(got[k], want[k], "float32", f"p={p} {k}")


def test_llama_block_reference_gradients_equal_torch_autograd() -> None:
    g = _llama("float64")
    feeds = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in llama_training_feeds(g).items()}
    want_loss = rt.reference(g, feeds)
    params = [n.name for n in g.inputs if n.role == "parameter"]
    got = torch_gradients(g, "loss", np.ones(1), feeds, params)
    for name in params:
        assert_close(want_loss[f"grad.{name}"], got[name], "float64", name)


# --- refusals -------------------------------------------------------------------------------------------------

def test_every_forward_kind_has_a_gradient_or_says_why() -> None:
    from relational_tensors.sql_specs import OPERATORS
    for kind, cls in OPERATORS.items():
        assert cls.gradient == "yes" or len(cls.gradient) > 10, kind


@pytest.mark.parametrize("name", sorted(NOT_DIFFERENTIABLE))
def test_non_differentiable_cases_are_refused_by_construct(name: str) -> None:
    g, _ = CASES[name]("float32")
    out = g.tensor(g.outputs["out"])
    with pytest.raises(GraphError, match=NOT_DIFFERENTIABLE[name]):
        g.vjp(out, g.input("cot", out.shape), [g.tensor(n.id) for n in g.inputs if n.name != "cot"])


def test_sql_expression_that_is_not_a_product_is_refused() -> None:
    g = rt.Graph()
    a, b = g.input("a", [4, 3]), g.input("b", [3, 5])
    y = g.sql("SELECT A.i, B.k, SUM(exp(A.v) * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k",
              A=(a, ("i", "j")), B=(b, ("j", "k")))
    with pytest.raises(GraphError, match=r"EXP\(A.v\) \* B.v"):
        g.grad(g.sum(y, axis=(0, 1)), [a])


def test_sql_sum_of_products_gradient_equals_the_matmul_one() -> None:
    g = rt.Graph()
    a, b = g.input("a", [4, 3], "float64"), g.input("b", [3, 5], "float64")
    y = g.sql("SELECT A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k",
              A=(a, ("i", "j")), B=(b, ("j", "k")))
    da, db = g.grad(g.sum(g.unary(y, "square"), axis=(0, 1)), [a, b])
    g.save(da, name="da"), g.save(db, name="db")
    rng = np.random.default_rng(0)
    f = {"a": rng.standard_normal((4, 3)), "b": rng.standard_normal((3, 5))}
    got = rt.reference(g, f)
    np.testing.assert_allclose(got["da"], 2 * (f["a"] @ f["b"]) @ f["b"].T, rtol=1e-12)
    np.testing.assert_allclose(got["db"], 2 * f["a"].T @ (f["a"] @ f["b"]), rtol=1e-12)


def test_grad_refusals_name_the_rule() -> None:
    g = rt.Graph()
    x, w = g.input("x", [4, 3]), g.parameter("w", [3, 2])
    unused = g.parameter("unused", [2])
    ids = g.input("ids", [4], "int64")
    y = g.matmul(x, w)
    with pytest.raises(GraphError, match="scalar loss"):
        g.grad(y, [w])
    loss = g.sum(y, axis=(0, 1))
    with pytest.raises(GraphError, match="only floating tensors"):
        g.grad(loss, [ids])
    with pytest.raises(GraphError, match="allow_unused=True"):
        g.grad(loss, [w, unused])
    dw, du = g.grad(loss, [w, unused], allow_unused=True)
    g.save(du, name="du")
    assert rt.reference(g, {"x": np.ones((4, 3)), "w": np.ones((3, 2)), "unused": np.ones(2),
                            "ids": np.zeros(4, int)})["du"].tolist() == [0.0, 0.0]
    with pytest.raises(GraphError, match="twice"):
        g.grad(loss, [w, w])
    (dw2,) = g.grad(g.sum(g.unary(y, "square"), axis=(0, 1)), [w])
    with pytest.raises(GraphError, match="second derivatives"):
        g.grad(g.sum(dw2, axis=(0, 1)), [w])
    other = rt.Graph()
    with pytest.raises(GraphError, match="tensor of this graph"):
        g.grad(loss, [other.input("z", [1])])
    with pytest.raises(GraphError, match="cotangent"):
        g.vjp(y, g.input("c", [4, 5]), [w])


def test_cross_entropy_needs_its_own_logsumexp() -> None:
    g = rt.Graph()
    logits, t = g.input("logits", [4, 6]), g.input("t", [4], "int64")
    fake = g.sum(logits, axis=-1)
    tok = g.apply(rt.sql_specs.CrossEntropyOp((logits.type, fake.type, t.type)), logits, fake, t)
    with pytest.raises(GraphError, match="logsumexp"):
        g.grad(g.sum(tok, axis=0), [logits])


def test_cross_entropy_refuses_targets_out_of_range() -> None:
    g = rt.Graph()
    logits, t = g.input("logits", [4, 6]), g.input("t", [4], "int64")
    g.save(g.cross_entropy(logits, t, ignore_index=-100), name="loss")
    f = {"logits": np.zeros((4, 6), np.float32), "t": np.array([0, 1, -100, 6])}
    with pytest.raises(ExecError, match=r"\[0, 6\) or equal ignore_index=-100; got values from 6 to 6"):
        rt.reference(g, f)
    with pytest.raises(ExecError, match="targets must lie"):
        rt.compileGraph(g, device="cpu:3", catalog=CATALOG).run(f)
    with pytest.raises(GraphError, match="reduction"):
        g.cross_entropy(logits, t, reduction="avg")
    with pytest.raises(GraphError, match="ignore_index"):
        g.cross_entropy(logits, t, ignore_index=1.5)


def test_cross_entropy_with_every_target_ignored_is_nan_as_in_torch() -> None:
    g = rt.Graph()
    logits, t = g.input("logits", [3, 5]), g.input("t", [3], "int64")
    g.save(g.cross_entropy(logits, t, ignore_index=2), name="loss")
    out = rt.compileGraph(g, device="cpu:2", catalog=CATALOG).run({"logits": np.ones((3, 5), np.float32),
                                                                    "t": np.full(3, 2)})
    assert np.isnan(out["loss"]).all()


def test_attention_gradient_parts_agree_packed_or_separate(monkeypatch) -> None:
    """dk and dv built as one packed operator or as two equal each other and the reference."""
    from relational_tensors.sql_specs import attention
    results = []
    for mode in ("packed", "separate"):
        monkeypatch.setitem(attention.KV_GRADIENTS, "mode", mode)
        g, _ = GRAD_CASES["attention_causal_gqa_8kv"]("float64")
        kinds = [n.kind for n in g.operators]
        assert (kinds.count("attention_grad"), kinds.count("slice")) == ((2, 2) if mode == "packed" else (3, 0))
        feeds = feeds_for(g, seed=7)
        results.append(rt.compileGraph(g, device="cpu:3", catalog=CATALOG).run(feeds))
    for k in results[0]:
        assert_close(results[1][k], results[0][k], "float64", k)
    assert isinstance(g.nodes[g.outputs["out"]].op, AttentionOp)


def test_recompute_regions_give_the_same_gradients_with_less_memory() -> None:
    def build(recompute: bool) -> rt.Graph:
        g = rt.Graph()
        h = g.input("x", [512, 64])
        ws = [g.parameter(f"w{i}", [64, 64]) for i in range(6)]
        for w in ws:
            with g.recompute() if recompute else contextlib.nullcontext():
                h = g.unary(g.unary(g.matmul(h, w), "gelu"), "tanh")
        loss = g.save(g.mean(g.unary(h, "square"), axis=(0, 1)), name="loss")
        for w, d in zip(ws, g.grad(loss, ws)):
            g.save(d, name=f"d{w.name}")
        return g

    rng = np.random.default_rng(0)
    plain, rec = build(False), build(True)
    feeds = {n.name: rng.standard_normal(n.type.shape).astype(np.float32) / 4 for n in plain.inputs}
    a = rt.compileGraph(plain, device="cpu:2", catalog=CATALOG)
    b = rt.compileGraph(rec, device="cpu:2", catalog=CATALOG)
    got, want = b.run(feeds), a.run(feeds)
    for k in want:  # the same values; the planner may split the recomputed graph's products otherwise, and a
        # contraction split into ⊕ partials rounds differently from a whole one (float32: a few ulps)
        scale = float(np.max(np.abs(want[k])))
        assert float(np.max(np.abs(got[k] - want[k]))) <= 1e-5 * scale, k
    assert sum(n.name.startswith("grad.") is False and "recompute." in n.name for n in rec.nodes) == 12
    assert max(b.memory().values()) < 0.6 * max(a.memory().values())
    # the operators made again are named for it, so a timeline shows them (simulated here, profiled on GPUs)
    again = [t for t in b.simulation().tasks if t.label.startswith("recompute.") and t.kind == "kernel"]
    assert len({t.label.split("[")[0] for t in again}) == 12 and all(t.end > t.start for t in again)
    assert not [t for t in a.simulation().tasks if t.label.startswith("recompute.")]

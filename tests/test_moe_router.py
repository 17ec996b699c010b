"""The graph API's MoE router (``moe.add_moe_ffn``): gates (softmax then top-k, top-k then softmax,
sigmoid with a selection bias and scaling), shared experts, a capacity factor that drops the routed pairs
past each expert's capacity (token order, then rank), and the auxiliary losses (load balancing as
transformers computes it, the router z-loss), each against a per-token torch loop or transformers'
function, values and gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import relational_tensors as rt  # noqa: E402
from relational_tensors.graph.moe import MoeLosses, add_moe_ffn  # noqa: E402

nn, F = torch.nn, torch.nn.functional
T, D, E, K, FF = 19, 8, 5, 2, 6


def _layer(**router: object) -> tuple[rt.Graph, list[MoeLosses]]:
    g = rt.Graph()
    x = g.input("x", [T, D])
    losses: list[MoeLosses] = []
    g.save(add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, losses=losses, **router), name="y")
    g.save(losses[0].balance, name="balance")
    g.save(losses[0].z, name="z")
    return g, losses


def _feeds(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {n.name: (rng.standard_normal(n.type.shape) * 0.5).astype(np.float32) for n in g.inputs}
    return feeds


def _reference(f: dict[str, np.ndarray], **router: object) -> dict:
    out = _forward({k: torch.tensor(v, dtype=torch.float64) for k, v in f.items()}, **router)  # type: ignore[arg-type]
    return dict(y=out["y"].numpy(), balance=out["balance"].item(), z=out["z"].item())


def _forward(f: dict[str, torch.Tensor], gate: str = "softmax", selection_bias: bool = False, scaling: float = 1.0,
             norm_topk: bool = True, shared_d_ff: int = 0, capacity_factor: float | None = None) -> dict:
    """The layer per token in torch (float64 tensors in, autograd through them): y, balance and z."""
    T, E = f["x"].shape[0], f["router"].shape[1]  # noqa: N806 - the layer's sizes, from its feeds
    x = f["x"]
    logits = x @ f["router"]
    probs = torch.softmax(logits, -1) if gate != "sigmoid" else torch.sigmoid(logits)
    if gate == "softmax_topk":
        top_logits, ids = torch.topk(logits, K)
        top = torch.softmax(top_logits, -1)
    else:
        chooser = probs + f["router_bias"] if selection_bias else probs
        ids = torch.topk(chooser, K).indices
        top = probs.gather(1, ids)
    if norm_topk:
        top = top / top.sum(-1, keepdim=True)
    top = top * scaling
    if capacity_factor is not None:
        capacity, taken = math.ceil(capacity_factor * T * K / E), [0] * E
        for t in range(T):
            for j in range(K):
                e = int(ids[t, j])
                if taken[e] >= capacity:
                    top = top.index_put((torch.tensor(t), torch.tensor(j)), torch.zeros((), dtype=top.dtype))
                taken[e] += 1
    w1, w3, w2 = (f[k] for k in ("w1", "w3", "w2"))
    y = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            y[t] += top[t, j] * ((F.silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e])
    if shared_d_ff:
        s1, s3, s2 = (f[k] for k in ("shared_w1", "shared_w3", "shared_w2"))
        y = y + (F.silu(x @ s1) * (x @ s3)) @ s2
    counts = F.one_hot(ids, E).to(torch.float64).sum((0, 1))
    balance = E * torch.sum(counts / T * probs.mean(0))
    z = torch.logsumexp(logits, -1).square().mean()
    return dict(y=y, balance=balance, z=z)


@pytest.mark.parametrize("router", [dict(), dict(gate="softmax_topk"), dict(gate="sigmoid", selection_bias=True,
                                    scaling=2.5), dict(norm_topk=False, shared_d_ff=7),
                                    dict(capacity_factor=1.0), dict(capacity_factor=0.5, gate="sigmoid")],
                         ids=["softmax", "softmax_topk", "sigmoid_bias", "shared", "capacity_1", "capacity_half"])
def test_the_router_forms_equal_a_per_token_loop(router: dict) -> None:
    g, _ = _layer(**router)
    f = _feeds(g)
    want = _reference(f, **router)
    for device in ("cpu:1", "cpu:3"):
        got = rt.compileGraph(g, device=device).run(f)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-5, err_msg=device)
        assert float(np.sum(got["balance"])) == pytest.approx(want["balance"], rel=1e-5)
        assert float(np.sum(got["z"])) == pytest.approx(want["z"], rel=1e-5)


@pytest.mark.parametrize("router", [dict(), dict(gate="softmax_topk"), dict(gate="sigmoid", selection_bias=True,
                                    scaling=2.5), dict(norm_topk=False, shared_d_ff=7)],
                         ids=["softmax", "softmax_topk", "sigmoid_bias", "shared"])
def test_every_gate_s_gradients_equal_torch_autograd(router: dict) -> None:
    """The gradient of a loss of the output and both auxiliary losses with respect to every weight and the
    tokens, for each gate (the selection bias picks experts, so it has no gradient), on 1 and 3 devices."""
    g, _ = _layer(**router)
    y, balance, z = (g.tensor(g.outputs[n]) for n in ("y", "balance", "z"))
    loss = g.add(g.add(g.mean(g.mul(y, y), [0, 1], keepdims=True), g.unary(balance, "scale", 0.01)),
                 g.unary(z, "scale", 0.001))
    wrt = [n.name for n in g.inputs if n.name != "router_bias"]
    for name, grad in zip(wrt, g.grad(g.reshape(loss, []), [g.tensor(g.node(n).id) for n in wrt])):
        g.save(grad, name="d_" + name)
    f = _feeds(g, seed=3)
    ts = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in wrt) for k, v in f.items()}
    out = _forward(ts, **router)
    (out["y"].square().mean() + 0.01 * out["balance"] + 0.001 * out["z"]).backward()
    for device in ("cpu:1", "cpu:3"):
        got = rt.compileGraph(g, device=device).run(f)
        for name in wrt:
            want = ts[name].grad.numpy()
            np.testing.assert_allclose(got["d_" + name], want, rtol=1e-4, atol=1e-6 * np.abs(want).max(),
                                       err_msg=f"{device}: d{name}")


def test_a_capacity_drops_pairs() -> None:
    """At capacity factor 0.5 some pairs are dropped; the output differs from the dropless one."""
    g, _ = _layer(capacity_factor=0.5)
    f = _feeds(g)
    dropless = _reference(f)["y"]
    capped = rt.reference(g, f)["y"]
    assert np.abs(capped - dropless).max() > 1e-3


def test_the_balance_loss_is_transformers_own() -> None:
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    g, _ = _layer()
    f = _feeds(g, seed=3)
    logits = torch.tensor(f["x"]) @ torch.tensor(f["router"])
    theirs = mixtral.load_balancing_loss_func((logits,), E, K)
    assert float(np.sum(rt.reference(g, f)["balance"])) == pytest.approx(float(theirs), rel=1e-5)


def test_aux_loss_gradients_equal_torch_autograd() -> None:
    from relational_tensors.graph.moe import moe_layer_graph

    g = moe_layer_graph(T, D, experts=E, top_k=K, d_ff=FF, dtype="float32", balance_coef=0.01, z_coef=0.001,
                        capacity_factor=1.25)
    # the layer's forward graph; the loss a training step takes, and its gradient with respect to the router
    router = g.tensor(g.node("router").id)
    y = g.tensor(g.outputs["y"])
    balance = next(g.tensor(n.id) for n in g.nodes if n.name == "balance_loss")
    z = next(g.tensor(n.id) for n in g.nodes if n.name == "z_loss")
    loss = g.add(g.add(g.mean(g.mul(y, y), [0, 1], keepdims=True), g.unary(balance, "scale", 0.01)),
                 g.unary(z, "scale", 0.001))
    g.save(loss, name="total")
    (drouter,) = g.grad(g.reshape(loss, []), [router])
    g.save(drouter, name="drouter")
    f = _feeds(g, seed=5)
    got = rt.compileGraph(g, device="cpu:2").run(f)
    tx = torch.tensor(f["x"], dtype=torch.float64)
    tr = torch.tensor(f["router"], dtype=torch.float64, requires_grad=True)
    nw = torch.tensor(f["ffn_norm"], dtype=torch.float64)
    h = tx * torch.rsqrt(tx.square().mean(-1, keepdim=True) + 1e-5) * nw
    logits = h @ tr
    probs = torch.softmax(logits, -1)
    top, ids = torch.topk(probs, K)
    top = top / top.sum(-1, keepdim=True)
    capacity, taken, keep = math.ceil(1.25 * T * K / E), [0] * E, torch.ones(T, K, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            keep[t, j] = float(taken[e] < capacity)
            taken[e] += 1
    top = top * keep
    w1, w3, w2 = (torch.tensor(f[k], dtype=torch.float64) for k in ("w1", "w3", "w2"))
    out = tx.clone()
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            out[t] = out[t] + top[t, j] * ((F.silu(h[t] @ w1[e]) * (h[t] @ w3[e])) @ w2[e])
    counts = F.one_hot(ids, E).to(torch.float64).sum((0, 1))
    total = out.square().mean() + 0.01 * E * torch.sum(counts / T * probs.mean(0)) + \
        0.001 * torch.logsumexp(logits, -1).square().mean()
    total.backward()
    assert float(np.sum(got["total"])) == pytest.approx(total.item(), rel=1e-5)
    np.testing.assert_allclose(got["drouter"], tr.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_bad_router_arguments_are_refused() -> None:
    g = rt.Graph()
    x = g.input("x", [T, D])
    with pytest.raises(rt.GraphError, match="gate is one of"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, gate="relu")
    with pytest.raises(rt.GraphError, match="top_k <= experts"):
        add_moe_ffn(g, x, experts=E, top_k=E + 1, d_ff=FF)
    with pytest.raises(rt.GraphError, match="capacity_factor is a positive"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, capacity_factor=0)
    with pytest.raises(rt.GraphError, match="capacity_groups is a positive number of token groups that divides"):
        add_moe_ffn(g, x, experts=E, top_k=K, d_ff=FF, capacity_factor=1.0, capacity_groups=2)

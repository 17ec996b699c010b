"""Transposed convolution (``g.conv_transpose``, torch's ``conv_transpose1d/2d/3d`` and ``ConvTranspose``
modules): the ``conv_grad`` operator's dx part run forward, its values equal to torch's for random forms
(1-3 spatial dimensions, strides, padding, output padding, dilation, groups) at every split the operator
offers, its gradients equal to torch autograd's and to finite differences, and a U-Net-style block (conv,
group norm, transposed conv) trained by ``rt.train_step`` step for step with torch's AdamW."""

from __future__ import annotations

import numpy as np
import pytest
from cases import request_for as _request_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.graph.reference import execute_spec

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
request_for = st.composite(_request_for)


@st.composite
def transpose_form(draw):
    rank = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2]))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    k = [draw(st.integers(1, 3)) for _ in range(rank)]
    d = [draw(st.integers(1, 2)) for _ in range(rank)]
    s = [draw(st.integers(1, 3)) for _ in range(rank)]
    p = [draw(st.integers(0, 1)) for _ in range(rank)]
    e = [draw(st.integers(0, max(s_, d_) - 1)) for s_, d_ in zip(s, d)]
    size = [draw(st.integers(1, 6 if rank < 3 else 4)) for _ in range(rank)]
    out = [(n - 1) * s_ - 2 * p_ + d_ * (k_ - 1) + e_ + 1 for n, s_, p_, d_, k_, e_ in zip(size, s, p, d, k, e)]
    if min(out) < 1:
        p = [0] * rank
    return dict(rank=rank, n=draw(st.integers(1, 2)), cin=cin, cout=cout, k=k, d=d, s=s, p=p, e=e, size=size,
                groups=groups)


def _graph(f: dict) -> tuple[rt.Graph, str]:
    g = rt.Graph()
    x = g.input("x", [f["n"], f["cin"], *f["size"]], "float64")
    w = g.input("w", [f["cin"], f["cout"] // f["groups"], *f["k"]], "float64")
    y = g.conv_transpose(x, w, stride=f["s"], padding=f["p"], output_padding=f["e"], dilation=f["d"],
                         groups=f["groups"])
    g.save(y, name="out")
    return g, y.name


def _torch(f: dict, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[f["rank"]]
    return fn(torch.tensor(x), torch.tensor(w), None, f["s"], f["p"], f["e"], f["groups"], f["d"]).numpy()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(form=transpose_form(), data=st.data())
def test_random_transposed_convolutions_equal_torch_at_every_split(form: dict, data) -> None:
    g, name = _graph(form)
    rng = np.random.default_rng(0)
    feeds = {n.name: rng.standard_normal(n.type.shape) for n in g.inputs}
    want = _torch(form, feeds["x"], feeds["w"])
    np.testing.assert_allclose(rt.reference(g, feeds)["out"], want, rtol=1e-10, atol=1e-10, err_msg=str(form))
    op = g.node(name).op
    if op.kind != "conv_grad":  # output padding past the stride: zeros padded after the transposed conv
        got = rt.compileGraph(g, device=f"cpu:{data.draw(st.integers(2, 5))}").run(feeds)["out"]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=str(form))
        return
    spec = op.spec(data.draw(request_for(op)))
    np.testing.assert_allclose(execute_spec(op, spec, [feeds["x"], feeds["w"]]), want, rtol=1e-10, atol=1e-10,
                               err_msg=f"{form} {spec.split_text}")


def test_gradients_equal_finite_differences() -> None:
    form = dict(rank=2, n=2, cin=2, cout=4, k=[3, 2], d=[1, 2], s=[2, 1], p=[1, 0], e=[1, 0], size=[3, 4], groups=2)
    g, name = _graph(form)
    y = g.tensor(g.outputs["out"])
    ct = g.input("ct", y.shape, "float64")
    loss = g.save(g.sum(g.mul(y, ct), [0, 1, 2, 3]), name="loss")
    x, w = g.tensor(g.node("x").id), g.tensor(g.node("w").id)
    for t, d in zip((x, w), g.grad(loss, [x, w])):
        g.save(d, name=f"d{t.name}")
    rng = np.random.default_rng(1)
    feeds = {n.name: rng.standard_normal(n.type.shape) for n in g.inputs}
    got = rt.compileGraph(g, device="cpu:3").run(feeds)
    for which in ("x", "w"):
        base = feeds[which]
        numeric = np.zeros_like(base)
        for i in np.ndindex(base.shape):
            for sign in (1, -1):
                moved = dict(feeds, **{which: base.copy()})
                moved[which][i] += sign * 1e-6
                numeric[i] += sign * float(np.sum(rt.reference(g, moved)["loss"])) / 2e-6
        np.testing.assert_allclose(got[f"d{which}"], numeric, rtol=1e-6, atol=1e-6, err_msg=which)


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3"])
def test_modules_forward_and_gradients_equal_torch(device: str) -> None:
    torch.manual_seed(0)
    for m, x in ((nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), torch.randn(2, 3, 7)),
                 (nn.ConvTranspose2d(4, 6, 3, stride=3, dilation=2, groups=2), torch.randn(2, 4, 5, 3)),
                 (nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False), torch.randn(1, 2, 3, 2, 3))):
        x.requires_grad_(True)
        y = rt.parallelize(m, (x,), device=device)(x)
        ref = m(x)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        ct = torch.randn_like(ref)
        params = [p for p in m.parameters()]
        got = torch.autograd.grad(y, (x, *params), ct)
        want = torch.autograd.grad(ref, (x, *params), ct)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class _UpBlock(nn.Module):
    """A U-Net decoder step: conv, group norm, SiLU, then a transposed conv that doubles the resolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 3, 4, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.silu(self.norm(self.conv(x))))


def test_a_unet_block_trains_as_torch_does() -> None:
    torch.manual_seed(0)
    model, twin = _UpBlock(), _UpBlock()
    twin.load_state_dict(model.state_dict())
    x, target = torch.randn(2, 4, 6, 6), torch.randn(2, 3, 12, 12)

    def loss_fn(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), t)
    step = rt.train_step(model, loss_fn, (x, target), optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:4")
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(3):
        ours = float(step(x, target))
        opt.zero_grad()
        theirs = loss_fn(twin, x, target)
        theirs.backward()
        opt.step()
        assert ours == pytest.approx(theirs.item(), rel=1e-5)
    step.load_into(model)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


def test_bad_transposed_convolutions_are_refused() -> None:
    g = rt.Graph()
    x, w = g.input("x", [1, 2, 5, 5]), g.input("w", [2, 3, 3, 3])
    with pytest.raises(rt.GraphError, match="output_padding must be smaller"):
        g.conv_transpose(x, w, stride=2, output_padding=2)
    with pytest.raises(rt.GraphError, match="padding is too large"):
        g.conv_transpose(g.input("x1", [1, 2, 1, 1]), w, padding=2)
    with pytest.raises(rt.GraphError, match="bias must have shape"):
        g.conv_transpose(x, w, bias=g.input("b", [2]))

"""Convolution and pooling as joins: random geometries and interval requests against PyTorch, halos at
every split of every spatial dimension, and the models that need them (ViT, a ResNet basic block, a
small CNN, wav2vec2's feature encoder) against their own output on cpu:4, gradients included."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from cases import feeds_for
from cases import request_for as _request_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.graph.reference import execute_spec

request_for = st.composite(_request_for)

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


@st.composite
def conv_form(draw):
    rank = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    k = [draw(st.integers(1, 4 if rank < 3 else 3)) for _ in range(rank)]
    d = [draw(st.integers(1, 2)) for _ in range(rank)]
    s = [draw(st.integers(1, 3)) for _ in range(rank)]
    p = [draw(st.integers(0, 2)) for _ in range(rank)]
    size = [draw(st.integers(max(1, d_ * (k_ - 1) + 1 - 2 * p_), 13 if rank < 3 else 7))
            for k_, d_, p_ in zip(k, d, p)]
    return dict(rank=rank, n=draw(st.integers(1, 2)), cin=cin, cout=cout, k=k, d=d, s=s, p=p, size=size,
                groups=groups)


def _conv_graph(f: dict) -> tuple[rt.Graph, str]:
    g = rt.Graph()
    x = g.input("x", [f["n"], f["cin"], *f["size"]], "float64")
    w = g.input("w", [f["cout"], f["cin"] // f["groups"], *f["k"]], "float64")
    y = g.conv(x, w, stride=f["s"], padding=f["p"], dilation=f["d"], groups=f["groups"])
    g.save(y, name="out")
    return g, y.name


def _torch_conv(f: dict, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[f["rank"]]
    return fn(torch.tensor(x), torch.tensor(w), None, f["s"], f["p"], f["d"], f["groups"]).numpy()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(form=conv_form(), data=st.data())
def test_random_convolutions_decompose_exactly(form: dict, data) -> None:
    g, name = _conv_graph(form)
    feeds = feeds_for(g)
    op = g.node(name).op
    want = _torch_conv(form, feeds["x"], feeds["w"])
    np.testing.assert_allclose(rt.reference(g, feeds)["out"], want, rtol=1e-10, atol=1e-10)
    if op.kind != "conv":  # stride = kernel, no padding: the patchify matmul, planned whole
        got = rt.compileGraph(g, device=f"cpu:{data.draw(st.integers(2, 8))}").run(feeds)["out"]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=str(form))
        return
    spec = op.spec(data.draw(request_for(op)))
    np.testing.assert_allclose(execute_spec(op, spec, [feeds["x"], feeds["w"]]), want, rtol=1e-10, atol=1e-10,
                               err_msg=f"{form} {spec.split_text}")


def test_a_patchify_convolution_is_a_matmul() -> None:
    """Non-overlapping windows (ViT's patch embedding): im2col is a permutation, so the matmul form does the
    convolution's FLOPs with one copy, where the convolution makes one per kernel position."""
    g = rt.Graph()
    x = g.input("x", [2, 3, 35, 32], "float64")  # 35 = 4·8 + 3: the last rows reach no window
    y = g.conv(x, g.input("w", [6, 3, 8, 8], "float64"), g.input("b", [6], "float64"), stride=8)
    g.save(y, name="out")
    kinds = [n.kind for n in g.operators]
    assert "conv" not in kinds and kinds.count("matmul") == 1
    feeds = feeds_for(g)
    want = F.conv2d(*(torch.tensor(feeds[k]) for k in ("x", "w", "b")), stride=8).numpy()
    np.testing.assert_allclose(rt.compileGraph(g, device="cpu:4").run(feeds)["out"], want, rtol=1e-10, atol=1e-10)


@st.composite
def pool_form(draw):
    rank = draw(st.integers(1, 3))
    k = [draw(st.integers(1, 4 if rank < 3 else 3)) for _ in range(rank)]
    s = [draw(st.integers(1, 3)) for _ in range(rank)]
    p = [draw(st.integers(0, kk // 2)) for kk in k]
    size = [draw(st.integers(kk, 12 if rank < 3 else 7)) for kk in k]  # torch refuses inputs under the kernel
    return dict(rank=rank, op=draw(st.sampled_from(["max", "avg"])), k=k, s=s, p=p, size=size,
                count=draw(st.booleans()), n=draw(st.integers(1, 2)), c=draw(st.integers(1, 3)),
                ceil=draw(st.booleans()))


def _torch_pool(form: dict, xt: torch.Tensor) -> torch.Tensor:
    r = form["rank"]
    if form["op"] == "max":
        return getattr(F, f"max_pool{r}d")(xt, form["k"], form["s"], form["p"], ceil_mode=form["ceil"])
    return getattr(F, f"avg_pool{r}d")(xt, form["k"], form["s"], form["p"], count_include_pad=form["count"],
                                       ceil_mode=form["ceil"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(form=pool_form(), data=st.data())
def test_random_pools_decompose_exactly(form: dict, data) -> None:
    """Pools of any rank, kernel, stride, padding and ``ceil_mode`` against torch, values and dx, and every
    split's function specs against the whole."""
    g = rt.Graph()
    x = g.input("x", [form["n"], form["c"], *form["size"]], "float64")
    if form["op"] == "max":
        y = g.max_pool(x, form["k"], form["s"], form["p"], ceil_mode=form["ceil"])
    else:
        y = g.avg_pool(x, form["k"], form["s"], form["p"], count_include_pad=form["count"], ceil_mode=form["ceil"])
    g.save(y, name="out")
    feeds = feeds_for(g)
    xt = torch.tensor(feeds["x"], requires_grad=True)
    out = _torch_pool(form, xt)
    want = out.detach().numpy()
    op = y.node.op
    cot = np.random.default_rng(1).standard_normal(want.shape)
    out.backward(torch.tensor(cot))
    (dx,) = g.vjp(y, g.input("cot", list(want.shape), "float64"), [x])
    g.save(dx, name="dx")
    got = rt.reference(g, {**feeds, "cot": cot})
    np.testing.assert_allclose(got["dx"], xt.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=f"dx {form}")
    np.testing.assert_allclose(got["out"], want, rtol=1e-12, atol=1e-12)
    spec = op.spec(data.draw(request_for(op)))
    np.testing.assert_allclose(execute_spec(op, spec, [feeds["x"]]), want, rtol=1e-12, atol=1e-12,
                               err_msg=f"{form} {spec.split_text}")


@pytest.mark.parametrize("kind", ["conv", "max_pool", "conv_dx", "conv_dw"])
def test_halos_at_every_split_of_every_spatial_dimension(kind: str) -> None:
    """Each spatial dimension alone, split in 1..8 near-equal blocks, against the whole operator."""
    g = rt.Graph()
    x = g.input("x", [2, 3, 17, 11], "float64")
    w = g.input("w", [4, 3, 3, 2], "float64")
    if kind == "max_pool":
        y = g.max_pool(x, 3, 2, 1)
    else:
        y = g.conv(x, w, stride=(2, 1), padding=(1, 1), dilation=(2, 1))
    target = y
    if kind.startswith("conv_d"):
        dx, dw = g.vjp(y, g.input("cot", y.shape, "float64"), [x, w])
        target = dx if kind == "conv_dx" else dw
    g.save(target, name="out")
    feeds = feeds_for(g)
    node = target.node
    probe = rt.Graph()
    probe.nodes, probe._names = list(g.nodes), set(g._names)
    probe.outputs = {f"in{k}": i for k, i in enumerate(node.inputs)}
    vals = rt.reference(probe, feeds)
    inputs = [vals[f"in{k}"] for k in range(len(node.inputs))]
    op = node.op
    want = rt.reference(g, feeds)["out"]
    spatial = [s for s in op.requestable() if s.name[0] in "os" and s.name[1:].isdigit()]
    assert spatial
    for index in spatial:
        for n in range(1, 9):
            ivs = index.near_equal(n)
            if ivs is None:
                continue
            got = execute_spec(op, op.spec({index.name: ivs}), inputs)
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=f"{kind} {index.name} n={n}")


# --- models ----------------------------------------------------------------------------------------------

def _compare(module: Any, inputs: tuple, device: str = "cpu:4", rel: float = 1e-4) -> Any:
    module = module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = rt.parallelize(module, inputs, device=device)
    with torch.no_grad():
        want = module(*inputs)
    got = fast(*inputs)
    err = float((got - want).abs().max()) / float(want.abs().max())
    assert err <= rel, f"error {err:.2e} of the largest magnitude"
    return fast


def _randomize_batch_norms(module: Any) -> None:
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_()
                m.bias.normal_()


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block, with the strided 1x1 downsample."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Any) -> Any:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


def _small_cnn(batch_norm: bool = True) -> Any:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8) if batch_norm else nn.Identity(),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 12, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))


def test_resnet_basic_block() -> None:
    torch.manual_seed(0)
    block = BasicBlock(6, 8, 2)
    _randomize_batch_norms(block)
    fast = _compare(block, (torch.randn(2, 6, 15, 13),))
    assert [n.kind for n in fast.graph.operators].count("conv") == 3


def test_small_cnn() -> None:
    torch.manual_seed(0)
    cnn = _small_cnn()
    _randomize_batch_norms(cnn)
    fast = _compare(cnn, (torch.randn(3, 3, 18, 18),))
    assert {"conv", "pool", "reduce", "matmul"} <= {n.kind for n in fast.graph.operators}


def test_vit_model() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                 image_size=32, patch_size=8, num_channels=3)

    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = transformers.ViTModel(cfg)

        def forward(self, x: Any) -> Any:
            return self.vit(pixel_values=x).last_hidden_state

    _compare(Hidden(), (torch.randn(2, 3, 32, 32),))


def test_wav2vec2_feature_encoder() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.wav2vec2.modeling_wav2vec2 import Wav2Vec2FeatureEncoder

    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(conv_dim=(16, 16, 16), conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2),
                                      feat_extract_norm="layer", conv_bias=True)
    fast = _compare(Wav2Vec2FeatureEncoder(cfg), (torch.randn(2, 400),))
    assert [n.kind for n in fast.graph.operators].count("conv") == 3


def test_a_cnn_trains_with_torch_autograd_gradients() -> None:
    torch.manual_seed(0)
    cnn = _small_cnn(batch_norm=False)
    x = torch.randn(3, 3, 14, 14)
    fast = rt.parallelize(cnn, (x,), device="cpu:4")
    fast(x).square().sum().backward()
    ours = {k: p.grad.clone() for k, p in cnn.named_parameters()}
    cnn.zero_grad()
    cnn(x).square().sum().backward()
    for k, p in cnn.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, rtol=1e-4, atol=1e-5, msg=k)


def _equals_torch(module: nn.Module, shape: tuple) -> None:
    """``module`` through rt.parallelize on three devices: torch's values and gradient."""
    x = torch.randn(*shape, requires_grad=True)
    y, want = rt.parallelize(module, (x,), device="cpu:3")(x), module(x)
    torch.testing.assert_close(y, want)
    ct = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(y, x, ct)[0], torch.autograd.grad(want, x, ct)[0])


@pytest.mark.parametrize("module,shape", [(nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 3, 10, 11)),
                                          (nn.AvgPool2d(3, 2, 1, ceil_mode=True), (2, 3, 10, 8)),
                                          (nn.AvgPool1d(2, 3, ceil_mode=True, count_include_pad=False), (2, 2, 9))])
def test_torch_pools_with_ceil_mode(module: nn.Module, shape: tuple) -> None:
    """``ceil_mode=True`` modules (windows past the padding at the end) through rt.parallelize on three
    devices: torch's values and gradient."""
    _equals_torch(module, shape)


@pytest.mark.parametrize("module,shape", [(nn.AdaptiveAvgPool2d((4, 3)), (2, 3, 10, 7)),
                                          (nn.AdaptiveAvgPool1d(3), (2, 2, 8)),
                                          (nn.AdaptiveAvgPool3d((2, 3, 4)), (1, 2, 5, 6, 7)),
                                          (nn.AdaptiveAvgPool2d((5, 7)), (2, 3, 7, 7))])
def test_adaptive_average_pooling_to_sizes_that_do_not_divide(module: nn.Module, shape: tuple) -> None:
    """Windows of different sizes (torch's floor/ceil bounds, overlapping where the output is longer than
    half the input): values and gradient through rt.parallelize on three devices, float32."""
    _equals_torch(module, shape)


def test_uneven_adaptive_average_pooling_in_bfloat16() -> None:
    """In bfloat16 the averaging runs in float32 (as torch's does), so the result is torch's to bfloat16's
    rounding of the output."""
    module, x = nn.AdaptiveAvgPool2d((3, 5)), torch.randn(2, 4, 11, 9).to(torch.bfloat16)
    torch.testing.assert_close(rt.parallelize(module, (x,), device="cpu:2")(x).float(), module(x).float(),
                               rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("module,shape", [(nn.AdaptiveMaxPool1d(1), (2, 3, 8)),
                                          (nn.AdaptiveMaxPool2d((2, 3)), (2, 3, 8, 9)),
                                          (nn.AdaptiveMaxPool3d(2), (1, 2, 4, 4, 6))])
def test_adaptive_max_pooling_to_sizes_that_divide(module: nn.Module, shape: tuple) -> None:
    _equals_torch(module, shape)


def test_adaptive_max_pooling_with_indices_or_uneven_windows_is_refused() -> None:
    with pytest.raises(rt.GraphError, match="returns its indices"):
        x = torch.randn(1, 2, 6, 6)
        rt.parallelize(nn.AdaptiveMaxPool2d(3, return_indices=True), (x,))(x)
    with pytest.raises(rt.GraphError, match="does not divide"):
        rt.parallelize(nn.AdaptiveMaxPool2d(4), (torch.randn(1, 2, 6, 6),))(torch.randn(1, 2, 6, 6))

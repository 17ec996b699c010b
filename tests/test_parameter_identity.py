"""A parameter keeps its identity through every transformation: each mechanism by which a module reads a
parameter other than as a plain operand, in a minimal module, trained through ``rt.parallelize`` (gradients
against torch autograd) and ``rt.train_step`` (AdamW steps against torch's loop), in float64."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import relational_tensors as rt  # noqa: E402
from relational_tensors.frontend.torch import from_torch  # noqa: E402

TOL = 1e-12  # float64 throughout: the two programs differ only in summation order


class TransposedWeight(nn.Module):  # FalconLinear: input @ self.weight.T
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 7))

    def forward(self, x: Any) -> Any:
        return x @ self.weight.T


class OnePlusWeight(nn.Module):  # Gemma's RMSNorm: x * (1 + w)
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7) * 0.1)

    def forward(self, x: Any) -> Any:
        return x * (1 + self.w)


class ConstantPositions(nn.Module):  # GPT-2 / BERT: an embedding read at constant ids
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 7)
        self.register_buffer("ids", torch.arange(6))

    def forward(self, x: Any) -> Any:
        return x + self.pos(self.ids)


class Tied(nn.Module):  # an embedding and an LM head that share one Parameter
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 7)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.embed.weight
        self.mix = nn.Linear(7, 7)

    def forward(self, ids: Any) -> Any:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class ClsToken(nn.Module):  # ViT: a learned token concatenated in front of the sequence
    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 7))

    def forward(self, x: Any) -> Any:
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)


class BatchNormEval(nn.Module):  # ResNet in eval mode: the affine from the running statistics
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: Any) -> Any:
        return self.bn(x)


class Detached(nn.Module):  # a parameter read once detached: only the other read trains it
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7))

    def forward(self, x: Any) -> Any:
        return x * self.w.detach() + torch.sin(x * self.w)


MODULES: dict[str, tuple[type, Any]] = {
    "x @ w.T": (TransposedWeight, lambda g: torch.randn(3, 6, 7, generator=g, dtype=torch.float64)),
    "x * (1 + w)": (OnePlusWeight, lambda g: torch.randn(3, 6, 7, generator=g, dtype=torch.float64)),
    "pos(ids)": (ConstantPositions, lambda g: torch.randn(3, 6, 7, generator=g, dtype=torch.float64)),
    "tied embedding and head": (Tied, lambda g: torch.randint(0, 11, (3, 6), generator=g)),
    "cat([cls.expand(...), x])": (ClsToken, lambda g: torch.randn(3, 6, 7, generator=g, dtype=torch.float64)),
    "eval batch norm": (BatchNormEval, lambda g: torch.randn(3, 6, 5, generator=g, dtype=torch.float64)),
    "detach": (Detached, lambda g: torch.randn(3, 6, 7, generator=g, dtype=torch.float64)),
}


def _build(name: str) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    cls, make = MODULES[name]
    module = cls().double().eval()
    g = torch.Generator().manual_seed(1)
    x = make(g)
    out = module(x)
    target = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return module, x, target


def _loss(m: Any, x: Any, target: Any) -> Any:
    return ((m(x) - target) ** 2).mean()


def _max_rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a.detach(), np.float64), np.asarray(b.detach(), np.float64)
    return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-300)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("device", ["cpu:1", "cpu:3"])
def test_parallelize_gives_every_parameter_torch_s_gradient(name: str, device: str) -> None:
    module, x, target = _build(name)
    twin = copy.deepcopy(module)
    fast = rt.parallelize(module, (x,), device=device)
    _loss(fast, x, target).backward()
    _loss(twin, x, target).backward()
    theirs = dict(twin.named_parameters())
    assert [k for k, _ in module.named_parameters()] == list(theirs)
    for k, p in module.named_parameters():
        assert p.grad is not None, f"{k} got no gradient"
        assert _max_rel(p.grad, theirs[k].grad) <= TOL, k


@pytest.mark.parametrize("name", MODULES)
def test_train_step_updates_every_parameter_as_torch_adamw_does(name: str) -> None:
    module, x, target = _build(name)
    twin = copy.deepcopy(module)
    step = rt.train_step(module, _loss, (x, target), optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:4")
    ours = [float(step(x, target)) for _ in range(3)]
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    theirs = []
    for _ in range(3):
        opt.zero_grad()
        loss = _loss(twin, x, target)
        loss.backward()
        opt.step()
        theirs.append(float(loss))
    np.testing.assert_allclose(ours, theirs, rtol=TOL)
    params = step.state_dict()["params"]
    assert set(params) == {k for k, _ in twin.named_parameters()}  # tied ones once, under their first name
    for k, p in twin.named_parameters():
        assert _max_rel(params[k], p) <= TOL, k


def test_a_tied_parameter_is_one_state_under_its_first_name() -> None:
    module, x, target = _build("tied embedding and head")
    step = rt.train_step(module, _loss, (x, target), device="cpu:2")
    assert step.holders["embed.weight"][0] == "module.embed.weight"
    assert "head.weight" not in step.holders
    g = from_torch(module, (x,), differentiate=True)
    assert sorted(origin for origin, _ in g.origins.values()) == ["embed.weight", "mix.bias", "mix.weight"]


def test_a_transposed_read_is_held_transposed_not_transposed_every_step() -> None:
    module, x, _ = _build("x @ w.T")
    g = from_torch(module, (x,), differentiate=True)
    assert g.origins == {"weight": ("weight", True)}
    assert "permute" not in {n.kind for n in g.operators}


def test_without_differentiation_parameter_only_values_are_folded_and_refolded_when_they_change() -> None:
    module, x, _ = _build("x * (1 + w)")
    fast = rt.parallelize(module, (x,), device="cpu:2")
    assert fast.graph.derived  # 1 + w was computed at trace time, from w
    with torch.no_grad():
        module.w.add_(0.5)
        fast.reload_weights()
        np.testing.assert_allclose(fast(x).numpy(), module(x).numpy(), rtol=1e-14)


def test_train_step_refuses_a_loss_that_reads_no_parameter_through_floats() -> None:
    class OnlyCompared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x: Any) -> Any:
            return x * (self.w > 0).to(x.dtype)

    x = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(rt.GraphError, match=r"only through integer or boolean values.*Got 1 parameters"):
        rt.train_step(OnlyCompared().double(), lambda m, x: m(x).sum(), (x,), device="cpu:1")


def test_decomposed_operations_train_too() -> None:
    class Decomposed(nn.Module):  # softplus, cumsum and group norm have no rule of their own
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.norm = nn.GroupNorm(2, 4)

        def forward(self, x: Any) -> Any:
            y = F.softplus(self.lin(x)) + x.cumsum(-1)
            return self.norm(y.reshape(2, 4, 3, 2))

    torch.manual_seed(0)
    module = Decomposed().double()
    twin = copy.deepcopy(module)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    fast = rt.parallelize(module, (x,), device="cpu:3")
    fast(x).sin().sum().backward()
    twin(x).sin().sum().backward()
    for (k, p), q in zip(module.named_parameters(), twin.parameters()):
        assert _max_rel(p.grad, q.grad) <= TOL, k


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3"])
def test_attention_dropout_is_softmax_dropped_by_the_counter_based_mask_then_times_v(device: str) -> None:
    """SDPA with dropout_p (transformers in training) against torch: the probabilities [b, h, sq, skv] of a
    causal GQA attention dropped where the generator's u(i) < p (its stream 1, the module's one draw), scaled
    by 1 / (1 - p), times v."""
    from relational_tensors.frontend.torch.torch_graph import draw_rng
    from relational_tensors.sql_specs.random import philox_uniform

    class Attn(nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True, enable_gqa=True)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(2))
    fast = rt.parallelize(Attn(), (q, k, v), device=device)
    torch.manual_seed(11)
    with torch.no_grad():
        ours = fast(q, k, v)
    torch.manual_seed(11)
    seed, offset = (int(x) for x in draw_rng())
    # the probabilities as the translator lays them out, [b, hkv, group, sq, skv]
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q.reshape(2, 2, 2, 5, 3), k) / 3 ** 0.5
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    u = philox_uniform(seed, offset, 1, np.arange(scores.numel())).reshape(scores.shape)
    probs = scores.softmax(-1) * torch.from_numpy(u >= 0.25) / 0.75
    want = torch.einsum("bhgqk,bhkd->bhgqd", probs, v).reshape(2, 4, 5, 3)
    assert _max_rel(ours, want) <= TOL


def test_strided_slices_equal_torch() -> None:
    class Strided(nn.Module):
        def forward(self, x: Any) -> Any:
            return torch.cat([x[:, ::2], x[:, 1::3], x[:, 2:9:4], x[:, 1:2:5]], dim=1)

    x = torch.randn(3, 10, 2, dtype=torch.float64)
    fast = rt.parallelize(Strided(), (x,), device="cpu:2")
    with torch.no_grad():
        assert torch.equal(fast(x), Strided()(x))


def test_counts_of_masks_and_integer_reductions_equal_torch() -> None:
    """``mask.sum()`` (the token count a loss is normalized by), integer sums along an axis, ``amax`` of a
    bool, and a 0-d count combined with a number: exact, on one device and on three; the gradient through
    the normalized loss is torch's."""
    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 6))

        def forward(self, x: Any) -> Any:
            mask = x > 0
            n = mask.sum()
            per_row = mask.to(torch.int32).sum(-1, keepdim=True)
            loss = ((x * self.w).square() * mask).sum() / n
            return loss + (n + 1) * 1e-3 + per_row.amax() * 1e-2 + mask.amax() * 1e-1 + torch.where(n > 2, 0.5, 0.25)

    x = torch.randn(5, 6)
    want = Counted()
    want(x).backward()
    for device in ("cpu:1", "cpu:3"):
        m = Counted()
        got = rt.parallelize(m, (x,), device=device)(x)
        torch.testing.assert_close(got, Counted()(x).detach(), rtol=1e-6, atol=1e-7)
        got.backward()
        torch.testing.assert_close(m.w.grad, want.w.grad, rtol=1e-5, atol=1e-7)


def test_uniform_draws_lie_in_their_interval_on_every_device_count() -> None:
    """``x.uniform_(a, b)`` (PhiMoE's router jitter): values in [a, b) with the interval's mean, the same
    draws on one device and on three."""
    class Jitter(nn.Module):
        def forward(self, x: Any) -> Any:
            return x * torch.empty_like(x).uniform_(0.9, 1.1) + torch.rand_like(x).uniform_() * 0

    x = torch.ones(64, 48)
    draws = []
    for device in ("cpu:1", "cpu:3"):
        fast = rt.parallelize(Jitter(), (x,), device=device)
        torch.manual_seed(3)
        draws.append(fast(x).detach().numpy())
    assert np.array_equal(draws[0], draws[1])
    assert draws[0].min() >= 0.9 and draws[0].max() < 1.1
    assert abs(draws[0].mean() - 1.0) < 0.005 and draws[0].std() > 0.05


class EveryNewRule(nn.Module):
    """The rules a trained module may now reach, in one module: a tied embedding and head, (1 + w),
    softplus (decomposed to log1p), erf, sin/cos, expm1, cumsum, a gather, a strided slice, group norm,
    detach, train-mode dropout and stochastic depth's floor(keep + rand)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        self.head = nn.Linear(8, 13, bias=False)
        self.head.weight = self.embed.weight
        self.gain = nn.Parameter(torch.zeros(8))
        self.norm = nn.GroupNorm(2, 4)
        self.register_buffer("pick", torch.tensor([[3, 1, 0, 2]]))

    def forward(self, ids: Any) -> Any:
        h = self.embed(ids) * (1 + self.gain)                                  # [2, 4, 8]
        h = F.softplus(h) + torch.erf(h) * torch.sin(h) - torch.expm1(h.cos() * 0.1)
        h = h + h.cumsum(1) * 0.1 + torch.gather(h, 1, self.pick[..., None].expand(2, 4, 8))
        h = torch.cat([h[..., ::2], h[..., 1::2].detach()], -1)
        h = self.norm(h.reshape(2, 4, 4, 2)).reshape(2, 4, 8)
        keep = (0.75 + torch.rand(2, 1, 1, dtype=h.dtype)).floor()
        return self.head(F.dropout(h, 0.2, training=True) * keep)


@pytest.mark.gpu
def test_every_new_rule_gives_on_gpus_what_it_gives_on_cpus() -> None:
    from relational_tensors.machine.devices import visible_gpus

    if visible_gpus() == 0:
        pytest.skip("no CUDA GPU visible (or CuPy not installed)")
    torch.manual_seed(0)
    module = EveryNewRule()
    ids = torch.randint(0, 13, (2, 4))
    results = {}
    for device in ("cpu:2", "cuda:0,0"):
        m = copy.deepcopy(module)
        fast = rt.parallelize(m, (ids,), device=device)
        torch.manual_seed(7)
        out = fast(ids)
        out.float().square().mean().backward()
        results[device] = (out.detach().cpu(), {k: p.grad.cpu() for k, p in m.named_parameters()})
    (out_c, grads_c), (out_g, grads_g) = results["cpu:2"], results["cuda:0,0"]
    assert _max_rel(out_g, out_c) <= 1e-5  # float32 on both; the same dropout masks
    for k in grads_c:
        assert _max_rel(grads_g[k], grads_c[k]) <= 1e-4, k

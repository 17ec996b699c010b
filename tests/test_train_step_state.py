"""What rt.train_step refuses in its state dicts, learning rates and batches, and that a refusal changes
nothing: every key, shape, dtype, hyperparameter and step count of a state is checked before any is taken, a
learning rate (set, scheduled, or held by a torch optimizer) before a step runs.  Each refused step is
compared with a twin that never saw the bad input, state by state and at the next step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch")
from torch.nn import functional as F  # noqa: E402

import relational_tensors as rt  # noqa: E402

X, T = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.randn(6, 3)


def mse(m: Any, x: Any, t: Any) -> Any:
    return F.mse_loss(m(x), t)


def _model() -> Any:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 3)


def make(opt: Any = None, topt: Any = None, **kw: Any) -> rt.TrainStep:
    """A step of a fresh Linear(4, 3) with rt.optim ``opt`` (AdamW(lr=1e-2) by default) or ``topt(module)``."""
    m = _model()
    optimizer = topt(m) if topt is not None else rt.optim.AdamW(lr=1e-2) if opt is None else opt
    return rt.train_step(m, mse, (X, T), optimizer=optimizer, device="cpu:2", **kw)


def flat(sd: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(sd, dict):
        return {k: v for key, x in sd.items() for k, v in flat(x, f"{prefix}/{key}").items()}
    if isinstance(sd, (list, tuple)):
        return {k: v for i, x in enumerate(sd) for k, v in flat(x, f"{prefix}/{i}").items()}
    return {prefix: sd}


def assert_same_state(a: rt.TrainStep, b: rt.TrainStep) -> None:
    sa, sb = flat(a.state_dict()), flat(b.state_dict())
    assert sorted(sa) == sorted(sb)
    for k, y in sb.items():
        x = sa[k]
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y or (x != x and y != y), (k, x, y)


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    s = make()
    s(X, T)
    s(X, T)
    return s.state_dict()


@pytest.fixture(scope="module")
def twins() -> tuple[rt.TrainStep, rt.TrainStep]:
    """Two steps one step in; the tests refuse loads on the first only, and check it still equals the second."""
    a, b = make(), make()
    a(X, T)
    b(X, T)
    return a, b


def _with_group(sd: dict[str, Any], **changes: Any) -> dict[str, Any]:
    o = sd["optimizer"]
    return {"optimizer": {**o, "param_groups": [{**o["param_groups"][0], **changes}]}}


def _with_entry(sd: dict[str, Any], **changes: Any) -> dict[str, Any]:
    o = sd["optimizer"]
    return {"optimizer": {**o, "state": {k: {**e, **changes} for k, e in o["state"].items()}}}


def _doubled(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v * 2 for k, v in sd["model"].items()}


BAD_STATES: dict[str, tuple[Any, str]] = {
    "model None": (lambda sd: {"model": None}, "'model' is the module's state_dict"),
    "a model of strings": (lambda sd: {"model": {k: np.full(tuple(v.shape), "a") for k, v in sd["model"].items()}},
                           "tensor of real numbers"),
    "a model of objects": (lambda sd: {"model": {k: np.empty(tuple(v.shape), object) for k, v in sd["model"].items()}},
                           "tensor of real numbers"),
    "a model of complex tensors": (lambda sd: {"model": {k: v.to(torch.complex64) for k, v in sd["model"].items()}},
                                   "tensor of real numbers"),
    "a model of meta tensors": (lambda sd: {"model": {k: v.to("meta") for k, v in sd["model"].items()}},
                                "tensor of real numbers"),
    "a good weight, a bias of another shape": (lambda sd: {"model": {**_doubled(sd), "bias": np.ones(4)}},
                                               "holds shape"),
    "a good weight, a bias None": (lambda sd: {"model": {**_doubled(sd), "bias": None}}, "got NoneType None"),
    "a good weight, a bias a number": (lambda sd: {"model": {**_doubled(sd), "bias": 0.5}}, "holds shape"),
    "optimizer None": (lambda sd: {"optimizer": None}, "'optimizer' is a dict"),
    "optimizer a list": (lambda sd: {"optimizer": [sd["optimizer"]]}, "'optimizer' is a dict"),
    "lr 'x'": (lambda sd: _with_group(sd, lr="x"), r"param_groups\[0\]\['lr'\]"),
    "lr nan": (lambda sd: _with_group(sd, lr=float("nan")), "finite number >= 0"),
    "lr -1": (lambda sd: _with_group(sd, lr=-1.0), "finite number >= 0"),
    "lr None": (lambda sd: _with_group(sd, lr=None), "finite number >= 0"),
    "params not indices": (lambda sd: _with_group(sd, params=["weight", "bias"]), "parameter indices"),
    "param_groups a dict": (lambda sd: {"optimizer": {**sd["optimizer"], "param_groups": {"lr": 0.1}}},
                            "list of dicts"),
    "state a list": (lambda sd: {"optimizer": {**sd["optimizer"], "state": []}}, "maps parameter indices"),
    "exp_avg of another shape": (lambda sd: _with_entry(sd, exp_avg=torch.ones(4, 3)), "holds shape"),
    "exp_avg None": (lambda sd: _with_entry(sd, exp_avg=None), r"\['exp_avg'\] is None"),
    "exp_avg a string": (lambda sd: _with_entry(sd, exp_avg="x"), "tensor of real numbers"),
    "step 'x'": (lambda sd: _with_entry(sd, step="x"), "whole number >= 0"),
    "step -1": (lambda sd: _with_entry(sd, step=torch.tensor(-1.0)), "whole number >= 0"),
    "step 1.5": (lambda sd: _with_entry(sd, step=torch.tensor(1.5)), "whole number >= 0"),
    "step nan": (lambda sd: _with_entry(sd, step=torch.tensor(float("nan"))), "whole number >= 0"),
    "a good model with an empty optimizer": (lambda sd: {"model": _doubled(sd), "optimizer": {}}, "has no"),
    "a good model with steps 'x'": (lambda sd: {"model": _doubled(sd), "steps": "x"}, "an int >= 0"),
    "an SGD step's state with a good model": (
        lambda sd: {"model": _doubled(sd), "optimizer": {"state": {}, "param_groups": [
            {**sd["optimizer"]["param_groups"][0], "momentum": 0.9}]}}, "same optimizer class"),
    "a good model, the old layout without a moment": (
        lambda sd: {"params": _doubled(sd), "optimizer": {"weight": {}, "bias": {}}}, "has no 'exp_avg'"),
}
for v in ("x", None, -1, 1.5, True, float("nan"), 2.0):
    BAD_STATES[f"steps={v!r}"] = (lambda sd, v=v: {**sd, "steps": v}, "an int >= 0")


@pytest.mark.parametrize("name", sorted(BAD_STATES))
def test_a_refused_state_changes_nothing(name: str, saved: dict[str, Any],
                                         twins: tuple[rt.TrainStep, rt.TrainStep]) -> None:
    a, b = twins
    state, words = BAD_STATES[name]
    with pytest.raises(rt.ExecError, match=words):
        a.load_state_dict(state(saved))
    assert_same_state(a, b)


def test_after_the_refusals_the_next_step_equals_the_twins(saved: dict[str, Any],
                                                             twins: tuple[rt.TrainStep, rt.TrainStep]) -> None:
    a, b = twins
    for state, _ in BAD_STATES.values():
        with pytest.raises(rt.ExecError):
            a.load_state_dict(state(saved))
    assert torch.equal(a(X, T), b(X, T))
    assert_same_state(a, b)


def test_a_torch_optimizers_groups_keep_their_lr_when_a_state_is_refused(saved: dict[str, Any]) -> None:
    topt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    a, b = make(topt=topt), make(topt=topt)
    a(X, T)
    b(X, T)
    with pytest.raises(rt.ExecError, match="finite number >= 0"):
        a.load_state_dict(_with_group(saved, lr="x"))
    assert a.setup.torch_optimizer.param_groups[0]["lr"] == 1e-2
    assert torch.equal(a(X, T), b(X, T))
    assert_same_state(a, b)


def test_good_states_still_load(saved: dict[str, Any]) -> None:
    """The checks take what torch writes: its AdamW state, a step as a 0-d tensor, steps as a NumPy int,
    index keys as text (a JSON round trip), an int64 model (cast as torch's load_state_dict casts)."""
    m = _model()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        o.zero_grad()
        mse(m, X, T).backward()
        o.step()
    s = make()
    s.load_state_dict({"model": m.state_dict(), "optimizer": o.state_dict(), "steps": np.int64(2)})
    assert s.steps == 2
    text_keys = {**saved["optimizer"], "state": {str(k): e for k, e in saved["optimizer"]["state"].items()}}
    s.load_state_dict({"model": {k: (v * 10).long() for k, v in saved["model"].items()}, "optimizer": text_keys})
    assert torch.equal(s.state_dict()["model"]["bias"], (saved["model"]["bias"] * 10).long().float())
    assert math.isfinite(float(s(X, T)))


@pytest.mark.parametrize("bad", [None, "x", torch.tensor([0.1, 0.2]), [0.1], 1j, float("nan"), float("inf"), -1.0])
def test_a_schedule_that_returns_no_learning_rate_is_refused_before_the_step(bad: Any) -> None:
    a, b = make(lr_schedule=lambda k: 1e-2 if k < 1 else bad), make(lr_schedule=lambda k: 1e-2)
    a(X, T)
    b(X, T)
    with pytest.raises(rt.ExecError, match=r"from lr_schedule\(1\)"):
        a(X, T)
    assert_same_state(a, b)
    assert a.lr == 1e-2


def test_a_torch_schedulers_nan_lr_is_refused_before_the_step() -> None:
    def make_scheduled(factor: Any) -> tuple[rt.TrainStep, Any]:
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return rt.train_step(m, mse, (X, T), optimizer=opt, device="cpu:2",
                             lr_schedule=torch.optim.lr_scheduler.LambdaLR(opt, factor)), opt

    a, opt = make_scheduled(lambda k: 1.0 if k < 1 else float("nan"))
    b, _ = make_scheduled(lambda k: 1.0)
    a(X, T)
    b(X, T)
    for run in (lambda: a(X, T), a.state_dict):  # nor is a nan lr written into a state_dict
        with pytest.raises(rt.ExecError, match="param group 0 of the torch optimizer"):
            run()
    assert a.steps == 1
    opt.param_groups[0]["lr"] = 1e-2  # mended: the step goes on from the state before the refusal, as its twin
    assert torch.equal(a(X, T), b(X, T))
    ma, mb = _model(), _model()
    a.load_into(ma)
    b.load_into(mb)
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.isfinite(pa).all() and torch.equal(pa, pb)


def test_a_torch_group_lr_set_by_hand_to_a_string_is_refused() -> None:
    topt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    a, b = make(topt=topt), make(topt=topt)
    a(X, T)
    b(X, T)
    a.setup.torch_optimizer.param_groups[0]["lr"] = "x"
    with pytest.raises(rt.ExecError, match=r"param_groups\[0\]\['lr'\]"):
        a(X, T)
    a.setup.torch_optimizer.param_groups[0]["lr"] = 1e-2
    assert_same_state(a, b)


def test_a_meta_batch_is_refused_and_changes_nothing(twins: tuple[rt.TrainStep, rt.TrainStep]) -> None:
    a, b = twins
    with pytest.raises(rt.ExecError, match="meta device"):
        a(torch.empty(6, 4, device="meta"), T)
    assert_same_state(a, b)


def test_a_param_group_whose_params_is_a_number_is_refused() -> None:
    with pytest.raises(rt.GraphError, match="'params' is a parameter or a list"):
        rt.optim.AdamW(lr=1e-2, param_groups=[{"params": 3}])


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_allow_unused_is_a_bool_and_a_refusal_leaves_the_graph(flag: Any) -> None:
    g = rt.Graph()
    x, w, u = g.input("x", [4, 3]), g.parameter("w", [3, 2]), g.parameter("u", [3])
    loss = g.sum(g.matmul(x, w), axis=(0, 1))
    count = len(g.nodes)
    with pytest.raises(rt.GraphError, match="allow_unused is True"):
        g.grad(loss, [u], allow_unused=flag)
    with pytest.raises(rt.GraphError, match="allow_unused is True"):
        g.vjp(loss, g.input("c", [1]), [u], allow_unused=flag)
    assert len(g.nodes) == count + 1  # the cotangent input only

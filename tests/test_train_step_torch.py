"""rt.train_step as a PyTorch training user drives it: a torch optimizer instance, parameter groups, learning-rate
schedules, gradient accumulation and torch's state_dict layout, each against torch's own optimizer loop on a small
MLP with LayerNorm and biases (float64 at 1e-9, float32 at 1e-5) on cpu:3 and cpu:4 (no size divides evenly)."""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import relational_tensors as rt  # noqa: E402


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 24), nn.Linear(24, 5)

    def forward(self, x: Any) -> Any:
        return self.down(F.gelu(self.up(self.norm(x))))


def ce(m: nn.Module, x: Any, t: Any) -> Any:
    return F.cross_entropy(m(x), t)


def _model(seed: int = 0, dtype: Any = torch.float64) -> MLP:
    torch.manual_seed(seed)
    m = MLP().to(dtype)
    with torch.no_grad():  # a LayerNorm away from its identity start, so its gradients are not special
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.2, 0.2)
    return m


def _batches(n: int, seed: int = 0, dtype: Any = torch.float64) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(11, 8, generator=g, dtype=dtype), torch.randint(0, 5, (11,), generator=g)) for _ in range(n)]


def _no_decay(m: nn.Module) -> tuple[list, list]:
    """The usual split: no weight decay on norms and biases."""
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    return decay, rest


def torch_loop(m: nn.Module, opt: Any, batches: list, accumulate: int = 1, scheduler: Any = None,
               clip: float | None = None) -> list[float]:
    """torch's loop: per micro-batch (loss / k).backward(); every k, clip, step, zero_grad, scheduler.step()."""
    losses = []
    for start in range(0, len(batches), accumulate):
        for micro in batches[start:start + accumulate]:
            loss = ce(m, *micro)
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def _rel(a: Any, b: Any, scale: float = 0.0) -> float:
    a, b = np.asarray(a.detach(), np.float64), np.asarray(b.detach(), np.float64)
    return float(np.max(np.abs(a - b), initial=0.0)) / max(float(np.max(np.abs(b), initial=0.0)), scale, 1e-300)


def assert_like_torch(step: rt.TrainStep, twin: nn.Module, opt: Any, tol: float) -> None:
    """Our state_dict against torch's module and optimizer: the same keys, layout and values."""
    ours = step.state_dict()
    theirs = {"model": twin.state_dict(), "optimizer": opt.state_dict()}
    assert list(ours["model"]) == list(theirs["model"])
    for k, v in theirs["model"].items():
        assert _rel(ours["model"][k], v) <= tol, k
    mine, want = ours["optimizer"], theirs["optimizer"]
    assert [{k: v for k, v in g.items() if k != "lr"} for g in mine["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "lr"} for g in want["param_groups"]]
    np.testing.assert_allclose([g["lr"] for g in mine["param_groups"]], [g["lr"] for g in want["param_groups"]],
                               rtol=1e-12)
    assert sorted(mine["state"]) == sorted(want["state"])
    scale: dict[str, float] = {}  # a moment whose gradient is zero in exact arithmetic holds rounding noise
    for entry in want["state"].values():
        for key, v in entry.items():
            scale[key] = max(scale.get(key, 0.0), 1e-6 * float(v.abs().max()))
    for i, entry in want["state"].items():
        assert list(mine["state"][i]) == list(entry), i
        for key, v in entry.items():
            if key == "step":
                assert mine["state"][i][key].dtype == v.dtype and float(mine["state"][i][key]) == float(v)
            else:
                assert mine["state"][i][key].dtype == v.dtype
                assert _rel(mine["state"][i][key], v, scale[key]) <= tol, (i, key)


TORCH_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=2e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True),
}


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_a_torch_optimizer_instance_steps_as_torch_does(name: str) -> None:
    model, twin, batches = _model(), _model(), _batches(4)
    make = TORCH_OPTIMIZERS[name]
    step = rt.train_step(model, ce, batches[0], optimizer=make(model.parameters()), device="cpu:3")
    ours = [float(step(*b)) for b in batches]
    opt = make(twin.parameters())
    np.testing.assert_allclose(ours, torch_loop(twin, opt, batches), rtol=1e-9)
    assert_like_torch(step, twin, opt, 1e-9)


def test_reductions_of_a_scalar_loss_are_the_loss() -> None:
    """A loss that reduces what is already a scalar (``F.cross_entropy(...).square().mean()``, ``.sum()``,
    ``.amax()``, or over dim 0 or -1, which torch allows): each reduction of a 0-d tensor is that tensor."""
    def loss(m: nn.Module, x: Any, t: Any) -> Any:
        e = F.cross_entropy(m(x), t)
        return e.square().mean() + e.sum() + e.amax() + e.mean(dim=()) + e.sum(0) + e.amin(-1, keepdim=True)
    model, twin, batches = _model(), _model(), _batches(3)
    step = rt.train_step(model, loss, batches[0], optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                         device="cpu:2")
    ours = [float(step(*b)) for b in batches]
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    theirs = []
    for b in batches:
        value = loss(twin, *b)
        value.backward()
        theirs.append(value.item())
        opt.step()
        opt.zero_grad()
    np.testing.assert_allclose(ours, theirs, rtol=1e-9)
    assert_like_torch(step, twin, opt, 1e-9)


@pytest.mark.parametrize("name", ["AdamW", pytest.param("SGD", marks=pytest.mark.slow)])
def test_a_0d_parameter_trains_as_torch_does(name: str) -> None:
    """A scalar parameter (a learnable temperature or logit scale, ``nn.Parameter(torch.tensor(0.7))``):
    its update, computed with the [1]-shaped learning rate and step, keeps its 0-d shape and equals torch's
    over three steps, gated accumulation included."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.temp = nn.Linear(4, 3), nn.Parameter(torch.tensor(0.7))

        def forward(self, x: Any) -> Any:
            return self.lin(x) * self.temp

    def loss(m: nn.Module, x: Any) -> Any:
        return m(x).square().mean()

    torch.manual_seed(0)
    ours, ref = Scaled(), Scaled()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(5, 4)
    make = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1), "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                                                              momentum=0.9)}[name]
    for accumulate in (1, 2):
        step = rt.train_step(ours, loss, (x,), optimizer=make(ours.parameters()), device="cpu:2", accumulate=accumulate)
        theirs = make(ref.parameters())
        for _ in range(3):
            theirs.zero_grad()
            for _ in range(accumulate):
                step(x)
                (loss(ref, x) / accumulate).backward()
            theirs.step()
        step.load_into(ours)
        assert ours.temp.shape == () and abs(float(ours.temp.detach()) - float(ref.temp.detach())) <= 1e-6
        torch.testing.assert_close(ours.lin.weight, ref.lin.weight, rtol=1e-5, atol=1e-6)


def test_no_decay_groups_from_torch_and_from_rt_optim_equal_torch() -> None:
    batches = _batches(4, seed=1)
    twin = _model()
    decay, rest = _no_decay(twin)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}],
                            lr=1e-2)
    want = torch_loop(twin, opt, batches)
    a = _model()
    decay, rest = _no_decay(a)
    from_torch = rt.train_step(a, ce, batches[0], device="cpu:4", optimizer=torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}], lr=1e-2))
    names = rt.optim.AdamW(lr=1e-2, param_groups=[  # by name this time; the step's lr scales both groups
        {"params": ["up.weight", "down.weight"], "weight_decay": 0.1},
        {"params": ["norm.weight", "norm.bias", "up.bias", "down.bias"], "weight_decay": 0.0, "lr": 3e-2}])
    from_names = rt.train_step(_model(), ce, batches[0], optimizer=names, device="cpu:3")
    assert from_names.lrs == [1e-2, 3e-2] and from_names.lr == 1e-2
    for step in (from_torch, from_names):
        np.testing.assert_allclose([float(step(*b)) for b in batches], want, rtol=1e-9)
        assert_like_torch(step, twin, opt, 1e-9)
    assert [n.name for n in from_names.graph.inputs if n.name.startswith("lr")] == ["lr", "lr.1"]


def test_a_parameter_in_no_group_is_not_trained_as_under_torch() -> None:
    model, twin, batches = _model(), _model(), _batches(3)
    before = copy.deepcopy(model.state_dict())
    step = rt.train_step(model, ce, batches[0], optimizer=torch.optim.SGD(model.down.parameters(), lr=0.5),
                         device="cpu:3")
    assert sorted(step.holders) == ["down.bias", "down.weight"]
    for b in batches:
        step(*b)
    opt = torch.optim.SGD(twin.down.parameters(), lr=0.5)
    torch_loop(twin, opt, batches)
    assert_like_torch(step, twin, opt, 1e-9)
    assert torch.equal(step.state_dict()["model"]["up.weight"], before["up.weight"])


def test_a_torch_lr_scheduler_per_group_and_a_callable_schedule_give_torchs_lrs() -> None:
    batches = _batches(5, seed=2)
    lambdas = [lambda k: 0.8 ** k, lambda k: 1.0 / (k + 1)]  # one per group: the groups' lr ratio changes

    def torch_pair(m: nn.Module) -> tuple[Any, Any]:
        decay, rest = _no_decay(m)
        opt = torch.optim.SGD([{"params": decay}, {"params": rest, "lr": 0.05}], lr=0.2, momentum=0.5)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)

    twin = _model()
    opt, scheduler = torch_pair(twin)
    want = torch_loop(twin, opt, batches, scheduler=scheduler)
    model = _model()
    mine, my_scheduler = torch_pair(model)
    step = rt.train_step(model, ce, batches[0], optimizer=mine, lr_schedule=my_scheduler, device="cpu:3")
    np.testing.assert_allclose([float(step(*b)) for b in batches], want, rtol=1e-9)
    assert step.lrs == scheduler.get_last_lr()
    assert_like_torch(step, twin, opt, 1e-9)

    def schedule(k: int) -> float:
        return 0.3 * 0.5 ** k

    twin = _model()
    opt = torch.optim.SGD(twin.parameters(), lr=0.3)
    losses = []
    for k, b in enumerate(batches):
        opt.param_groups[0]["lr"] = schedule(k)
        losses += torch_loop(twin, opt, [b])
    step = rt.train_step(_model(), ce, batches[0], optimizer=rt.optim.SGD(lr=0.3), lr_schedule=schedule,
                         device="cpu:4")
    np.testing.assert_allclose([float(step(*b)) for b in batches], losses, rtol=1e-9)
    assert_like_torch(step, twin, opt, 1e-9)


def test_accumulating_three_micro_batches_equals_torchs_loss_over_k_loop() -> None:
    batches = _batches(6, seed=3)
    twin = _model()
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    want = torch_loop(twin, opt, batches, accumulate=3, clip=0.5)
    step = rt.train_step(_model(), ce, batches[0], optimizer=rt.optim.AdamW(lr=1e-2, weight_decay=0.1,
                                                                            max_grad_norm=0.5),
                         accumulate=3, device="cpu:4")
    got = []
    for k, b in enumerate(batches):
        got.append(float(step(*b)))  # each micro-batch's own loss
        assert (step.micro, step.steps) == ((k + 1) % 3, (k + 1) // 3)
        if k == 1:
            with pytest.raises(rt.ExecError, match="between optimizer steps"):
                step.state_dict()
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert_like_torch(step, twin, opt, 1e-9)


def test_accumulation_with_sgd_momentum_and_a_step_scheduler_in_float32() -> None:
    batches = _batches(8, seed=4, dtype=torch.float32)
    twin = _model(dtype=torch.float32)
    opt = torch.optim.SGD(twin.parameters(), lr=0.2, momentum=0.9, dampening=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    want = torch_loop(twin, opt, batches, accumulate=2, scheduler=scheduler)
    model = _model(dtype=torch.float32)
    mine = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, dampening=0.1)
    step = rt.train_step(model, ce, batches[0], lr_schedule=torch.optim.lr_scheduler.StepLR(mine, 2, gamma=0.5),
                         accumulate=2, device="cpu:3")  # the optimizer is the scheduler's
    np.testing.assert_allclose([float(step(*b)) for b in batches], want, rtol=1e-5)
    assert step.lrs == [0.05]
    assert_like_torch(step, twin, opt, 1e-5)


def _continue(step: rt.TrainStep, twin: nn.Module, opt: Any, batches: list) -> None:
    np.testing.assert_allclose([float(step(*b)) for b in batches], torch_loop(twin, opt, batches), rtol=1e-9)
    assert_like_torch(step, twin, opt, 1e-9)


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only: the layout is tensors, numbers, strings and containers


def _grouped(m: nn.Module) -> Any:
    decay, rest = _no_decay(m)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def test_a_torch_run_continues_here_and_ours_continues_in_torch() -> None:
    batches = _batches(6, seed=5)
    torch_run = _model()
    torch_run.norm.weight.requires_grad_(False)  # frozen, and not LayerNorm's start: loaded as a graph input
    opt = _grouped(torch_run)
    torch_loop(torch_run, opt, batches[:3])
    state = _saved({"model": torch_run.state_dict(), "optimizer": opt.state_dict()})

    fresh = _model(seed=7)  # other weights: all of them come from the state
    fresh.norm.weight.requires_grad_(False)
    resumed = rt.train_step(fresh, ce, batches[0], optimizer=_grouped(fresh), device="cpu:3")
    resumed.load_state_dict(state)
    assert resumed.steps == 3
    _continue(resumed, torch_run, opt, batches[3:])

    ours = rt.train_step(_model(), ce, batches[0], optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:4")
    for b in batches[:3]:
        ours(*b)
    state = _saved(ours.state_dict())
    back, back_opt = _model(seed=8), None
    back.load_state_dict(state["model"])
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    back_opt.load_state_dict(state["optimizer"])
    _continue(ours, back, back_opt, batches[3:])


def test_the_old_layout_safetensors_and_mismatched_states() -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    batches = _batches(4, seed=6)
    model = _model()
    step = rt.train_step(model, ce, batches[0], optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:3")
    for b in batches[:2]:
        step(*b)
    state = step.state_dict()
    loaded = safetensors.load(safetensors.save(state["model"]))
    assert all(torch.equal(loaded[k], v) for k, v in state["model"].items())
    # the layout before torch's: parameters by name, each one's moments under its name, the shared step count
    moments = {name: {key: state["optimizer"]["state"][i][key] for key in ("exp_avg", "exp_avg_sq")}
               for i, (name, _) in enumerate(model.named_parameters())}
    old = {"params": state["params"], "steps": 2,
           "optimizer": {**moments, "adamw.step": state["optimizer"]["state"][0]["step"].reshape(1)}}
    again = rt.train_step(_model(seed=3), ce, batches[0], optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:4")
    again.load_state_dict(old)
    for b in batches[2:]:
        assert float(again(*b)) == pytest.approx(float(step(*b)), rel=1e-9)
    for k, v in step.state_dict()["model"].items():
        assert _rel(again.state_dict()["model"][k], v) <= 1e-9, k
    sgd_state = torch.optim.SGD(MLP().parameters(), lr=0.1, momentum=0.9).state_dict()
    with pytest.raises(rt.ExecError, match="weight_decay is a constant of the compiled step"):
        again.load_state_dict({"optimizer": torch.optim.AdamW(MLP().parameters(), weight_decay=0.5).state_dict()})
    with pytest.raises(rt.ExecError, match="same optimizer class"):
        again.load_state_dict({"optimizer": sgd_state})
    with pytest.raises(rt.ExecError, match="param groups of"):
        again.load_state_dict({"optimizer": _grouped(MLP()).state_dict()})
    with pytest.raises(rt.ExecError, match="keys the module has not"):
        again.load_state_dict({"model": {"nope": torch.zeros(1)}})


def _random_case(kind: str, split: bool, ratio: float, accumulate: int, devices: int) -> None:
    def make(m: nn.Module) -> Any:
        decay, rest = _no_decay(m)
        groups = [{"params": decay}, {"params": rest, "lr": 0.05 * ratio, "weight_decay": 0.0}] if split else \
            [{"params": list(m.parameters())}]
        if kind == "adamw":
            return torch.optim.AdamW(groups, lr=0.05, weight_decay=0.02)
        return torch.optim.SGD(groups, lr=0.05, momentum=0.7, weight_decay=0.02)

    batches = _batches(2 * accumulate, seed=accumulate)
    twin = _model()
    opt = make(twin)
    want = torch_loop(twin, opt, batches, accumulate=accumulate)
    model = _model()
    step = rt.train_step(model, ce, batches[0], optimizer=make(model), accumulate=accumulate, device=f"cpu:{devices}")
    np.testing.assert_allclose([float(step(*b)) for b in batches], want, rtol=1e-9)
    assert_like_torch(step, twin, opt, 1e-9)


CASES = dict(kind=st.sampled_from(["adamw", "sgd"]), split=st.booleans(), ratio=st.sampled_from([0.25, 1.0, 4.0]),
             accumulate=st.integers(1, 3), devices=st.sampled_from([2, 3, 4]))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(**CASES)
def test_random_groups_lrs_and_accumulation_equal_torch(kind: str, split: bool, ratio: float, accumulate: int,
                                                        devices: int) -> None:
    _random_case(kind, split, ratio, accumulate, devices)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(**CASES)
def test_many_random_groups_lrs_and_accumulation_equal_torch(kind: str, split: bool, ratio: float, accumulate: int,
                                                             devices: int) -> None:
    _random_case(kind, split, ratio, accumulate, devices)


def test_refusals_say_what_to_do() -> None:
    model, batch = _model(), _batches(1)[0]
    with pytest.raises(rt.GraphError, match="may set"):  # refused as the optimizer is made
        rt.optim.AdamW(param_groups=[{"params": ["up.weight"], "momentum": 0.9}])
    cases = [
        (torch.optim.AdamW(model.parameters(), amsgrad=True), None, "no amsgrad"),
        (torch.optim.SGD(model.parameters(), lr=0.1, maximize=True), None, "no maximize"),
        (torch.optim.RMSprop(model.parameters()), None, "AdamW, Adam and SGD"),
        (torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), None, "not one of them"),
        (rt.optim.SGD(param_groups=[{"params": ["up.weight"]}, {"params": ["up.weight"]}]), None, "in one"),
        ("adam", None, "rt.optim.AdamW"),
        (None, torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD(model.parameters(), lr=0.1)), "metric"),
        (torch.optim.SGD(model.parameters(), lr=0.1),
         torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1), "another optimizer"),
        (None, 0.1, "callable"),
    ]
    for optimizer, schedule, message in cases:
        with pytest.raises(rt.GraphError, match=message):
            rt.train_step(model, ce, batch, optimizer=optimizer, lr_schedule=schedule, device="cpu:2")
    with pytest.raises(rt.GraphError, match="accumulate is the number"):
        rt.train_step(model, ce, batch, accumulate=0, device="cpu:2")
    with pytest.raises(rt.GraphError, match="groups hold none"):
        model.down.requires_grad_(False)
        rt.train_step(model, ce, batch, optimizer=torch.optim.SGD(model.down.parameters(), lr=0.1), device="cpu:2")


@pytest.mark.parametrize("make", [
    lambda: rt.optim.AdamW(lr=-1e-3), lambda: rt.optim.AdamW(lr=float("nan")), lambda: rt.optim.SGD(lr=float("inf")),
    lambda: rt.optim.AdamW(lr=None), lambda: rt.optim.AdamW(betas=(1.0, 0.9)), lambda: rt.optim.AdamW(eps=-1e-8),
    lambda: rt.optim.SGD(lr=0.1, nesterov=True), lambda: rt.optim.SGD(lr=0.1, momentum=-0.9),
    lambda: rt.optim.AdamW(param_groups=[{"params": ["w"], "weight_decay": float("inf")}]),
    lambda: rt.optim.AdamW(max_grad_norm=0.0),
])
def test_hyperparameters_torch_refuses_are_refused(make: Any) -> None:
    with pytest.raises(rt.GraphError):
        make()


def test_a_bad_learning_rate_or_batch_is_refused_and_changes_nothing() -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x, t = torch.randn(5, 4), torch.randn(5, 2)
    step = rt.train_step(m, lambda m, x, t: torch.nn.functional.mse_loss(m(x), t), (x, t),
                         optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:2")
    for bad in (None, float("nan"), float("inf"), -1.0, "0.1"):
        with pytest.raises(rt.ExecError, match="learning rate"):
            step.lr = bad
    assert step.lr == pytest.approx(1e-2)
    for batch, words in (((x.numpy(), t), "torch tensor"), ((None, t), "torch tensor"),
                         ((x.double(), t), "dtype float32"), ((torch.randn(6, 4), t), "shape")):
        with pytest.raises(rt.ExecError, match=words):
            step(*batch)
    before = {k: v.clone() for k, v in step.state_dict()["model"].items()}
    with pytest.raises(rt.ExecError):
        step.load_state_dict({"model": {"0.weight": torch.zeros(3, 3)}})
    assert all(torch.equal(before[k], v) for k, v in step.state_dict()["model"].items())
    assert math.isfinite(float(step(x, t)))


@pytest.mark.gpu
def test_a_host_module_trains_on_a_cuda_batch() -> None:
    """The module on the host, the batch on the GPU (tracing moves the example to the module's device): the
    step runs on cuda:0 and gives torch's loss."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x, t = torch.randn(5, 4, device="cuda"), torch.randn(5, 2, device="cuda")
    want = float(torch.nn.functional.mse_loss(m.cuda()(x), t))
    m.cpu()
    step = rt.train_step(m, lambda m, x, t: torch.nn.functional.mse_loss(m(x), t), (x, t),
                         optimizer=rt.optim.AdamW(lr=1e-2), device="cuda:0")
    loss = step(x, t)
    assert loss.device.type == "cuda" and abs(float(loss) - want) <= 1e-5 * max(1.0, abs(want))

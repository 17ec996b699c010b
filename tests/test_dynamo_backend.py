"""The torch.compile backend against eager torch: forward, training with the user's optimizer and loop,
graph breaks compiled piece by piece, a new shape planned once, and the registered backend name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import relational_tensors as rt  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)
        self.norm = torch.nn.LayerNorm(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x))))


def _compiled(model: torch.nn.Module, calls: list | None = None, **options: object) -> torch.nn.Module:
    torch._dynamo.reset()

    def backend(gm: torch.fx.GraphModule, example_inputs: list, **kw: object) -> object:
        if calls is not None:
            calls.append([tuple(x.shape) for x in example_inputs])
        return rt.dynamo_backend(gm, example_inputs, **kw)

    return torch.compile(model, backend=backend, options={"device": "cpu:3", **options}, dynamic=False)


def test_forward_equals_eager() -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(5, 6)
    torch.testing.assert_close(_compiled(model)(x), model(x), rtol=1e-5, atol=1e-6)


def test_training_with_the_users_optimizer_equals_eager() -> None:
    torch.manual_seed(0)
    ours, theirs = Net().double(), Net().double()
    theirs.load_state_dict(ours.state_dict())
    compiled = _compiled(ours)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(3):
        x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
        for opt, run in ((opt_ours, compiled), (opt_theirs, theirs)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(run(x), y)
            loss.backward()
            opt.step()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{name} after step {step}")


def test_graph_breaks_compile_piece_by_piece() -> None:
    torch.manual_seed(0)
    model = Net()
    calls: list = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = model.up(x)
        torch._dynamo.graph_break()
        return model.down(h.relu())

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=lambda gm, ins, **kw: (calls.append(1), rt.dynamo_backend(
        gm, ins, options={"device": "cpu:2"}))[1], dynamic=False)
    x = torch.randn(4, 6)
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 2


def test_a_new_shape_is_planned_once() -> None:
    torch.manual_seed(0)
    model = Net()
    calls: list = []
    compiled = _compiled(model, calls)
    for rows in (5, 8, 5, 8):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert [shapes[-1] if shapes else None for shapes in calls].count((5, 6)) <= 1
    assert len(calls) == 2


def test_symbolic_shapes_are_refused_with_the_fix() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(Net(), backend=rt.dynamo_backend, options={"device": "cpu:2"}, dynamic=True)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(5, 6))
    cause = info.value
    while cause is not None and not isinstance(cause, rt.GraphError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, rt.GraphError) and "dynamic=False" in str(cause)


def test_the_backend_is_registered_by_name() -> None:
    from importlib.metadata import entry_points

    names = {e.name for e in entry_points(group="torch_dynamo_backends")}
    if "relational_tensors" not in names:
        pytest.skip("the package is not installed with its entry points (pip install -e .)")
    torch._dynamo.reset()
    model = Net()
    compiled = torch.compile(model, backend="relational_tensors", options={"device": "cpu:2"}, dynamic=False)
    x = torch.randn(3, 6)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)

"""Rows picked and written by ids the module computes or takes as inputs: ``x[ids]``, ``index_select``,
``x[ids] = v`` (``index_put``, with and without ``accumulate``) and ``index_copy``, translated to the embedding
lookup and its gradient's scatter, against torch eager and the single-device NumPy reference, on device
counts that do not divide the rows; the gradient of a gathered table against torch autograd; the cases
refused with a message."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch frontend tests need pip install torch")
nn = torch.nn

import relational_tensors as rt  # noqa: E402
from relational_tensors.api.parallelize import parallelize  # noqa: E402
from relational_tensors.errors import GraphError  # noqa: E402


def _check(module: nn.Module, inputs: tuple[Any, ...], device: str, atol: float = 1e-6) -> None:
    fast = parallelize(module.eval(), inputs, device=device)
    with torch.no_grad():
        want = module(*inputs)
    got = fast(*inputs)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    single = rt.reference(fast.graph, fast.graph.feeds(*inputs))
    (name,) = [n for kind, n in fast.graph.output_leaves if kind == "saved"]
    np.testing.assert_allclose(single[name].astype(np.float64), want.double().numpy(), atol=atol, rtol=atol)


class Take(nn.Module):
    def forward(self, x: Any, ids: Any) -> Any:
        return x[ids] * 2.0


class Select(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Any, ids: Any) -> Any:
        return x.index_select(self.dim, ids) + 1.0


class Put(nn.Module):
    def __init__(self, accumulate: bool) -> None:
        super().__init__()
        self.accumulate = accumulate

    def forward(self, x: Any, ids: Any, v: Any) -> Any:
        return (x * 1.0).index_put((ids,), v, accumulate=self.accumulate)


class Assign(nn.Module):  # the in-place spelling a KV cache writes with
    def forward(self, x: Any, ids: Any, v: Any) -> Any:
        y = x.clone()
        y[ids] = v
        return y


class Copy(nn.Module):
    def forward(self, x: Any, ids: Any, v: Any) -> Any:
        return x.index_copy(1, ids, v)


class Add(nn.Module):
    def forward(self, x: Any, ids: Any, v: Any) -> Any:
        return x.index_add(1, ids, v, alpha=0.5)


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3"])
@pytest.mark.parametrize("ids_shape", [(5,), (2, 3)])
def test_rows_at_input_ids(device: str, ids_shape: tuple[int, ...]) -> None:
    x = torch.randn(7, 3, 4)
    ids = torch.randint(0, 7, ids_shape)
    _check(Take(), (x, ids), device)


@pytest.mark.parametrize("dim", [0, 1])
def test_index_select(dim: int) -> None:
    x = torch.randn(7, 5)
    ids = torch.tensor([4, 0, 4, 2])
    _check(Select(dim), (x, ids), "cpu:3")


@pytest.mark.parametrize("device", ["cpu:1", "cpu:4"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_writes_rows(device: str, accumulate: bool) -> None:
    x = torch.randn(9, 2, 3)
    ids = torch.tensor([7, 1, 4])  # distinct: torch keeps an unspecified one of repeated writes
    v = torch.randn(3, 2, 3)
    _check(Put(accumulate), (x, ids, v), device)


def test_index_put_accumulates_repeated_rows_and_broadcasts_values() -> None:
    x = torch.randn(6, 4)
    ids = torch.tensor([2, 5, 2, 2])
    _check(Put(True), (x, ids, torch.randn(4, 4)), "cpu:2")
    _check(Put(False), (x, torch.tensor([3, 0]), torch.randn(4)), "cpu:2")  # one row of values for each id


def test_setitem_index_copy_and_index_add() -> None:
    x = torch.randn(8, 6)
    _check(Assign(), (x, torch.tensor([6, 0, 3]), torch.randn(3, 6)), "cpu:3")
    _check(Copy(), (x, torch.tensor([5, 1]), torch.randn(8, 2)), "cpu:3")
    _check(Add(), (x, torch.tensor([5, 1, 5]), torch.randn(8, 3)), "cpu:3")  # a column added twice


def test_bfloat16_rows_are_written_exactly() -> None:
    """A written row is the value itself, not x + (v - x): bfloat16 bits equal torch's."""
    x = torch.randn(10, 8).to(torch.bfloat16)
    ids = torch.tensor([9, 2, 5])
    v = torch.randn(3, 8).to(torch.bfloat16)
    fast = parallelize(Put(False).eval(), (x, ids, v), device="cpu:2")
    got = fast(x, ids, v)
    assert torch.equal(got, Put(False)(x, ids, v))


def test_gradient_of_a_gathered_table() -> None:
    """A parameter read by x[ids] (ids repeated): its gradient, the scatter-add of the rows' cotangents,
    equals torch autograd's."""

    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(6, 4))

        def forward(self, ids: Any) -> Any:
            return self.table[ids] * 3.0

    model = Lookup().train()
    ids = torch.tensor([[1, 5, 1], [0, 5, 5]])
    cotangent = torch.randn(2, 3, 4)
    fast = rt.parallelize(model, (ids,), device="cpu:4")
    (fast(ids) * cotangent).sum().backward()
    ours = model.table.grad.clone()
    model.zero_grad()
    (model(ids) * cotangent).sum().backward()
    torch.testing.assert_close(ours, model.table.grad, atol=1e-5, rtol=1e-5)
    assert float(ours[2].abs().max()) == 0.0  # a row no id reads gets no gradient


def test_refused_forms_say_what_is_supported() -> None:
    class TwoIndices(nn.Module):
        def forward(self, x: Any, i: Any, j: Any) -> Any:
            return x.index_put((i, j), torch.ones(()))

    class IntoInts(nn.Module):
        def forward(self, x: Any, i: Any) -> Any:
            return x.index_put((i,), torch.ones((), dtype=torch.int64))

    x, i = torch.randn(4, 4), torch.tensor([1, 2])
    with pytest.raises(GraphError, match="one, on the first dimension"):
        parallelize(TwoIndices(), (x, i, i), device="cpu:2")
    with pytest.raises(GraphError, match="floating tensors"):
        parallelize(IntoInts(), (torch.zeros(4, 4, dtype=torch.int64), i), device="cpu:2")


def test_gradients_through_written_rows() -> None:
    """x[ids] = v inside a trained module: v's gradient is the cotangent's rows at ids, x's is zero on the
    written rows; both equal torch autograd's."""

    class Write(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.Parameter(torch.randn(6, 4))
            self.v = nn.Parameter(torch.randn(3, 4))

        def forward(self, ids: Any) -> Any:
            return self.x.index_put((ids,), self.v * 2.0) * torch.arange(1.0, 5.0)

    model = Write().train()
    ids = torch.tensor([4, 0, 2])
    cotangent = torch.randn(6, 4)
    fast = rt.parallelize(model, (ids,), device="cpu:3")
    (fast(ids) * cotangent).sum().backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    (model(ids) * cotangent).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, atol=1e-5, rtol=1e-5)
    assert float(ours["x"][ids].abs().max()) == 0.0

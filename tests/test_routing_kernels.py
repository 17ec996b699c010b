"""The GPU launchers of routing's selections against the operators' NumPy kernels: ``topk`` (ties, NaN,
infinities, largest and smallest), ``take_along`` over blocks of positions (a split ``choices`` index gives
zeros for the ids a block does not hold) and ``one_hot`` over blocks of classes, in float32 and bfloat16.
Every result is a selection or a copy, so it must be equal bit for bit.

Without a GPU the kernels run in Triton's interpreter on CPU."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.types import TensorType
from relational_tensors.sql_specs.routing import OneHotOp, TakeAlongOp, TopkOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_routing")

from relational_tensors.kernels.launchers import allocates, launcher_for  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bool": torch.bool}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K)


def _scores(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Scores with ties, infinities and NaN among ordinary values, exact in ``dtype``."""
    g = np.random.default_rng(0)
    x = g.integers(-6, 6, shape).astype(np.float32) / 4  # many ties
    flat = x.reshape(-1)
    flat[::7] = np.inf
    flat[3::11] = -np.inf
    flat[5::13] = np.nan
    return torch.from_numpy(x).to(TORCH[dtype]).float().numpy()


def _host(a: np.ndarray, dtype: str) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a)).to(TORCH[dtype]) if dtype in TORCH else torch.from_numpy(a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(("shape", "k"), [((5, 8), 2), ((2, 3, 11), 4), ((4, 64), 8), ((3, 300), 1), ((2, 5), 5)])
def test_topk_matches_the_operator(shape: tuple[int, ...], k: int, largest: bool, dtype: str) -> None:
    x = _scores(shape, dtype)
    op = TopkOp((TensorType.zero(shape, dtype),), k, largest)
    assert not allocates(op)
    spec = op.spec({d.name: d.near_equal(min(2, d.extent)) for d in op.requestable()})
    for f in spec.functions:
        block = x[f.inputs[0].slices()]
        want = op.kernel([block], f)
        xb, _ = T.buf(_host(block, dtype))
        ob, got = T.buf(torch.full(f.output.shape, -7, dtype=torch.int64))
        launcher_for("topk").launch(op, f, [xb], ob, {}, 0)
        np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=str(f))


def test_topk_of_a_vocabulary_row_or_of_many_runs_on_the_host() -> None:
    """Rows longer than one program holds (top-k sampling over a vocabulary), and a k past the kernel's
    unrolled picks, take the host path."""
    assert allocates(TopkOp((TensorType.zero((2, 50000)),), 50))
    assert allocates(TopkOp((TensorType.zero((2, 1000)),), 65))
    assert not allocates(TopkOp((TensorType.zero((2, 1000)),), 64))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_take_along_matches_the_operator_on_blocks_of_positions(dtype: str) -> None:
    shape, k = (3, 4, 13), 5
    x = _scores(shape, dtype)
    ids = np.random.default_rng(1).integers(0, shape[-1], (*shape[:-1], k))
    op = TakeAlongOp((TensorType.zero(shape, dtype), TensorType.zero(ids.shape, "int64")))
    spec = op.spec({"t0": op.shardable()[0].near_equal(2), "choices": op.shardable()[2].near_equal(3)})
    for f in spec.functions:
        xb, _ = T.buf(_host(x[f.inputs[0].slices()], dtype))
        ib, _ = T.buf(torch.from_numpy(np.ascontiguousarray(ids[f.inputs[1].slices()])))
        want = op.kernel([x[f.inputs[0].slices()], ids[f.inputs[1].slices()]], f)
        ob, got = T.buf(torch.full(f.output.shape, 7.0, dtype=TORCH[dtype]))
        launcher_for("take_along").launch(op, f, [xb, ib], ob, {}, 0)
        np.testing.assert_array_equal(got.cpu().float().numpy(), np.asarray(want, np.float32), err_msg=str(f))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool"])
def test_one_hot_matches_the_operator_on_blocks_of_classes(dtype: str) -> None:
    ids = np.random.default_rng(2).integers(-1, 12, (4, 6))  # -1 and 11: outside the 11 classes
    op = OneHotOp((TensorType.zero(ids.shape, "int64"),), 11, dtype)
    spec = op.spec({"t0": op.shardable()[0].near_equal(3), "classes": op.shardable()[2].near_equal(4)})
    for f in spec.functions:
        block = np.ascontiguousarray(ids[f.inputs[0].slices()])
        ib, _ = T.buf(torch.from_numpy(block))
        ob, got = T.buf(torch.full(f.output.shape, 1, dtype=TORCH[dtype]) if dtype == "bool" else
                        torch.full(f.output.shape, 7.0, dtype=TORCH[dtype]))
        launcher_for("one_hot").launch(op, f, [ib], ob, {}, 0)
        want = op.kernel([block], f)
        np.testing.assert_array_equal(got.cpu().float().numpy(), np.asarray(want, np.float32), err_msg=str(f))

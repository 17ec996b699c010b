"""The Triton pooling kernels against the operators' NumPy kernels: max and average (counting the padding
or not), 1 to 3 spatial dimensions, strides, padding, ``ceil_mode``, and the blocks of split plans (halos
included), forward and gradient, float32 and bfloat16.

Without a GPU the kernels run in Triton's interpreter on CPU.  Max pooling and its gradient pick values
and add each window's dy once: exact.  An average sums its window in the NumPy kernel's order in float32,
so float32 agrees to one rounding of the division (1e-6); 16-bit outputs to their last place."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.types import TensorType
from relational_tensors.sql_specs.pool import PoolGradOp, PoolOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_pool")

from relational_tensors.kernels.launchers import HOST_KINDS, allocates, launcher_for  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-6, "bfloat16": 8e-3}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K)


def _buf(a: np.ndarray, dtype: str):
    return T.buf(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(TORCH[dtype]))


CASES = [  # shape, kernel, stride, padding, ceil_mode
    ((2, 3, 11), (3,), (2,), (1,), False),
    ((2, 3, 9, 10), (3, 3), (2, 2), (1, 1), False),
    ((1, 2, 8, 8), (2, 2), (2, 2), (0, 0), False),
    ((2, 2, 7, 9), (3, 2), (1, 2), (1, 0), False),
    ((1, 2, 5, 6, 7), (2, 3, 2), (2, 1, 2), (1, 1, 0), False),
    ((2, 3, 10, 11), (3, 3), (2, 2), (1, 1), True),  # windows past the padding at the end
    ((1, 2, 8, 6, 7), (2, 3, 3), (3, 2, 2), (0, 1, 0), True),
]


def _splits(op) -> dict:
    """Two or three intervals on every index that has room (halo blocks included)."""
    return {d.name: d.near_equal(min(3, d.extent)) for d in op.shardable()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("mode", "include"), [("max", True), ("avg", True), ("avg", False)])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}{'-ceil' if c[4] else ''}" for c in CASES])
def test_pool_and_its_gradient_match_the_operators(case: tuple, mode: str, include: bool, dtype: str) -> None:
    shape, kernel, stride, padding, ceil = case
    t = TensorType.zero(shape, dtype)
    op = PoolOp((t,), mode, kernel, stride, padding, include, ceil)
    g = np.random.default_rng(0)
    x = torch.from_numpy(g.standard_normal(shape).astype(np.float32)).to(TORCH[dtype]).float().numpy()
    if mode == "max":  # ties: the first largest of a window takes its gradient
        x.reshape(-1)[::4] = 0.5
    dy = torch.from_numpy(g.standard_normal(op.output_type.shape).astype(np.float32)).to(TORCH[dtype]).float().numpy()
    for f in op.spec(_splits(op)).functions:
        want = np.asarray(op.kernel([x[f.inputs[0].slices()]], f), np.float32)
        xb, _ = _buf(x[f.inputs[0].slices()], dtype)
        ob, got = _buf(np.full(f.output.shape, np.nan), dtype)
        launcher_for("pool").launch(op, f, [xb], ob, {}, 0)
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=0, atol=TOL[dtype] * scale,
                                   err_msg=f"pool {f}")
    grad = PoolGradOp((t, op.output_type), mode, kernel, stride, padding, include, ceil)
    for f in grad.spec(_splits(grad)).functions:
        blocks = [x[f.inputs[0].slices()], dy[f.inputs[1].slices()]]
        want = np.asarray(grad.kernel(blocks, f), np.float32)
        xb, _ = _buf(blocks[0], dtype)
        gb, _ = _buf(blocks[1], dtype)
        ob, got = _buf(np.full(f.output.shape, np.nan), dtype)
        launcher_for("pool_grad").launch(grad, f, [xb, gb], ob, {}, 0)
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=0, atol=2 * TOL[dtype] * scale,
                                   err_msg=f"pool_grad {f}")


def test_pooling_is_captured_with_the_program() -> None:
    t = TensorType.zero((2, 3, 8, 8), "bfloat16")
    op = PoolOp((t,), "max", (2, 2), (2, 2), (0, 0))
    assert "pool" not in HOST_KINDS and "pool_grad" not in HOST_KINDS
    assert not allocates(op) and not allocates(PoolGradOp((t, op.output_type), "max", (2, 2), (2, 2), (0, 0)))

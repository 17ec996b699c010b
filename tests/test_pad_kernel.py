"""The GPU launcher of ``pad`` (zeros, then the block copied to its place) against the operator's NumPy
kernel, for blocks of split plans along and across the padded axis, into contiguous and strided outputs,
in float32, bfloat16, int64 and bool.  The results are copies, so they must be equal bit for bit.

Without a GPU the copy kernels run in Triton's interpreter on CPU."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.types import TensorType
from relational_tensors.sql_specs.shape import PadOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_copy")

from relational_tensors.kernels.common import DevBuf  # noqa: E402
from relational_tensors.kernels.launchers import launcher_for  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
@pytest.mark.parametrize("strided", [False, True])
def test_pad_matches_the_operator(dtype: str, strided: bool) -> None:
    shape, axis, start, size = (3, 5, 4), 1, 2, 11
    op = PadOp((TensorType.zero(shape, dtype),), axis, start, size)
    g = np.random.default_rng(0)
    x = g.integers(1, 9, shape).astype(np.float32)
    x = (x > 4) if dtype == "bool" else x
    xt = torch.from_numpy(x).to(TORCH[dtype])
    zero, _ = T.buf(torch.zeros(8, dtype=torch.uint8))
    spec = op.spec({d.name: d.near_equal(k) for d, k in zip(op.shardable(), (1, 3, 2))})
    for f in spec.functions:
        block = xt[f.inputs[0].slices()]
        want = op.kernel([x[f.inputs[0].slices()]], f)
        xb, _ = T.buf(block.contiguous())
        if strided:  # the block a view inside a wider buffer: every other element of the last axis
            wide = torch.full((*f.output.shape[:-1], 2 * f.output.shape[-1]), 7, dtype=TORCH[dtype])
            ob, holder = T.buf(wide)
            ob = DevBuf(ob.ptr, f.output.shape, dtype, 0, (*holder.stride()[:-1], 2))
            launcher_for("pad").launch(op, f, [xb], ob, {"zero": zero}, 0)
            got = holder.cpu()[..., ::2]
        else:
            ob, got = T.buf(torch.full(f.output.shape, 7, dtype=TORCH[dtype]))
            launcher_for("pad").launch(op, f, [xb], ob, {"zero": zero}, 0)
            got = got.cpu()
        got = got.float().numpy() if dtype == "bfloat16" else got.numpy()
        np.testing.assert_array_equal(got, np.asarray(want).astype(got.dtype), err_msg=str(f))


def test_pad_is_captured_with_the_program() -> None:
    """No host copies: a program with a pad stays capturable in a CUDA graph."""
    from relational_tensors.kernels.launchers import HOST_KINDS, allocates

    assert "pad" not in HOST_KINDS
    assert not allocates(PadOp((TensorType.zero((2, 3), "bfloat16"),), 0, 1, 4))

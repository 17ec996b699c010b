"""The Triton rotary-embedding kernel against the operator's NumPy kernel, with exact and rounded
frequencies (a module's 16-bit ``inv_freq`` buffer: ``freq_dtype``), packed sequences, blocks that start
mid-sequence and the inverse rotation.

Without a GPU the kernel runs in Triton's interpreter on CPU (``TRITON_INTERPRET=1`` is set before the
kernel module is first imported).  Tolerances: the angles are the same float32 values (rounded
frequencies, read from the table the launcher uploads) or float64-reduced ones (exact) on both sides;
cos and sin differ by the device's last-ulp rounding, so float32 outputs agree to 2e-6 and 16-bit ones
to one unit in their last place (3e-2 bfloat16 and 4e-3 float16, relative to the largest value)."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.sql_specs.rope import RopeOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_rope")
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOL = {"float32": 2e-6, "bfloat16": 3e-2, "float16": 4e-3}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K)


def _buf(t):
    return T.buf(t.contiguous())


@pytest.mark.parametrize("freq_dtype", [None, "bfloat16", "float16", "float32"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_matches_the_operator(freq_dtype: str | None, dtype: str, inverse: bool) -> None:
    b, seq, heads, d = 2, 40, 3, 16
    lo, hi = 7, 33  # a block that starts mid-sequence
    ends = (12, 29, 40)  # packed sequences
    op = RopeOp((TensorType.zero((b, seq, heads, d), dtype),), base=500000.0, seq_ends=ends, inverse=inverse,
                freq_dtype=freq_dtype)
    g = np.random.default_rng(0)
    block = g.standard_normal((b, hi - lo, heads, d)).astype(np.float32)
    x = torch.from_numpy(block).to(TORCH[dtype])
    box = Box((0, lo, 0, 0), (b, hi, heads, d))
    want = op.kernel([x.float().numpy().astype(op._compute_dtype())], FunctionSpec((box,), box))
    from relational_tensors.kernels.launchers.elementwise import _rope_constants

    consts = _rope_constants(op)
    xb, _ = _buf(x)
    ob, out = _buf(torch.empty_like(x))
    sb, _ = _buf(torch.from_numpy(consts["seq_start"]))
    inv = _buf(torch.from_numpy(consts["inv_freq"]))[0] if "inv_freq" in consts else None
    K.rope(xb, ob, sb, lo, op.base, inverse, inv)
    got = out.float().cpu().numpy()
    scale = max(1.0, float(np.abs(want.astype(np.float32)).max()))
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=0, atol=TOL[dtype] * scale)


def test_rounded_frequencies_differ_from_exact_ones() -> None:
    """The rounding is real: at long positions bfloat16 frequencies move the angles far from the exact
    ones, and the kernel follows the rounded ones."""
    seq, d = 4096, 8
    op = RopeOp((TensorType.zero((1, seq, 1, d), "float32"),), base=10000.0, freq_dtype="bfloat16")
    exact = RopeOp((TensorType.zero((1, seq, 1, d), "float32"),), base=10000.0)
    x = torch.ones(1, seq, 1, d)
    box = Box((0, 0, 0, 0), (1, seq, 1, d))
    f = FunctionSpec((box,), box)
    want, other = op.kernel([x.numpy()], f), exact.kernel([x.numpy()], f)
    assert np.abs(want - other).max() > 0.1
    from relational_tensors.kernels.launchers.elementwise import _rope_constants

    xb, _ = _buf(x)
    ob, out = _buf(torch.empty_like(x))
    consts = _rope_constants(op)
    sb, _ = _buf(torch.from_numpy(consts["seq_start"]))
    K.rope(xb, ob, sb, 0, op.base, False, _buf(torch.from_numpy(consts["inv_freq"]))[0])
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=0, atol=2e-5 * seq)

"""The Triton rotary-embedding kernel against the operator's NumPy kernel, with exact and rounded
frequencies (a module's 16-bit ``inv_freq`` buffer: ``freq_dtype``), packed sequences, blocks that start
mid-sequence and the inverse rotation.

Without a GPU the kernel runs in Triton's interpreter on CPU (``TRITON_INTERPRET=1`` is set before the
kernel module is first imported).  Tolerances: the angles are the same float32 values (rounded
frequencies, read from the table the launcher uploads) or float64-reduced ones (exact) on both sides;
cos and sin differ by the device's last-ulp rounding, so float32 outputs agree to 2e-6 and 16-bit ones
to one unit in their last place (3e-2 bfloat16 and 4e-3 float16, relative to the largest value)."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.sql_specs.rope import RopeOp

torch = pytest.importorskip("torch")
GPU = visible_gpus() > 0 and torch.cuda.is_available()
_MODULE = "relational_tensors.kernels.triton_rope"
if not GPU and _MODULE in sys.modules:
    pytest.skip("the kernel module was defined for a GPU before this module could ask for the interpreter",
                allow_module_level=True)
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
K = importlib.import_module(_MODULE)

from relational_tensors.kernels.common import DevBuf  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32}
NAMES = {v: k for k, v in TORCH.items()}
TOL = {"float32": 2e-6, "bfloat16": 3e-2, "float16": 4e-3}
_TENSORS: dict[int, object] = {}


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    """In the interpreter a pointer argument must be the torch tensor itself."""
    _TENSORS.clear()
    if not GPU:
        monkeypatch.setattr(K, "Ptr", lambda buf, dtype=None: _TENSORS[buf.ptr])
    yield


def _buf(t):
    t = t.to(DEVICE).contiguous()
    _TENSORS[t.data_ptr()] = t
    return DevBuf(t.data_ptr(), tuple(t.shape), NAMES[t.dtype], 0, tuple(t.stride())), t


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

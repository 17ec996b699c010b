"""The Triton forward attention kernel with key padding and key lengths against the operator's NumPy
kernel: right, left and holed padding, a batch row with no real key (0 and log-sum-exp -inf), causal and
not, GQA, and blocks that start mid-sequence on both queries and keys (a split plan's blocks).

Without a GPU the kernel runs in Triton's interpreter on CPU.  Tolerances: float32 scores are computed
in IEEE float32 on both sides (2e-5); bfloat16 operands meet float32 accumulation (2e-2 of the largest
output), as in the kernel's other tests."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.sql_specs.attention import AttentionOp

torch = pytest.importorskip("torch")
GPU = visible_gpus() > 0 and torch.cuda.is_available()
_MODULE = "relational_tensors.kernels.triton_attention"
if not GPU and _MODULE in sys.modules:
    pytest.skip("the kernel module was defined for a GPU before this module could ask for the interpreter",
                allow_module_level=True)
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
K = importlib.import_module(_MODULE)

from relational_tensors.kernels.common import DevBuf  # noqa: E402
from relational_tensors.kernels.launchers.attention import _attention_constants  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32, "bool": torch.bool}
NAMES = {v: k for k, v in TORCH.items()}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
_TENSORS: dict[int, object] = {}


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    """In the interpreter a pointer argument must be the torch tensor itself (a bool one as int8, as the
    kernels read it); the interpreter multiplies bfloat16 operands of ``tl.dot`` as their raw bits, so they
    are widened to float32 first (exact, and what the tensor cores compute)."""
    _TENSORS.clear()
    if not GPU:
        import triton.language as tl
        from triton.runtime import interpreter

        def ptr(buf, dtype=None):
            t = _TENSORS[buf.ptr]
            return t.view(torch.int8) if t.dtype == torch.bool else t
        monkeypatch.setattr(K, "Ptr", ptr)
        dot = interpreter.InterpreterBuilder.create_dot

        def widened(h):
            if h.dtype == tl.bfloat16:
                return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                            lambda self, a, b, d, *rest: dot(self, widened(a), widened(b), d, *rest))
    yield


def _buf(t):
    t = t.to(DEVICE).contiguous()
    _TENSORS[t.data_ptr()] = t
    return DevBuf(t.data_ptr(), tuple(t.shape), NAMES[t.dtype], 0, tuple(t.stride())), t


PADDINGS = {
    "right": lambda skv: [skv, skv - 7, 13],
    "left": lambda skv: [-5, -17, 0],
    "holes": None,
    "a row with no key": lambda skv: [skv, 0, 9],
}


def _padding(kind: str, b: int, skv: int) -> np.ndarray:
    kp = np.ones((b, skv), dtype=bool)
    if kind == "holes":
        g = np.random.default_rng(3)
        kp = g.random((b, skv)) < 0.6
        kp[0, :] = True
        return kp
    for r, n in enumerate(PADDINGS[kind](skv)):
        if n >= 0:
            kp[r, n:] = False
        else:
            kp[r, :-n] = False
    return kp


def _run(op: AttentionOp, dtype: str, q0: int, q1: int, k0: int, k1: int, kp: np.ndarray | None) -> None:
    b, sq, hq, d = op.input_types[0].shape
    skv, hkv = op.input_types[1].shape[1:3]
    g = np.random.default_rng(0)
    q = torch.from_numpy(g.standard_normal((b, sq, hq, d)).astype(np.float32)).to(TORCH[dtype])
    k = torch.from_numpy(g.standard_normal((b, skv, hkv, d)).astype(np.float32)).to(TORCH[dtype])
    v = torch.from_numpy(g.standard_normal((b, skv, hkv, d)).astype(np.float32)).to(TORCH[dtype])
    qb, kb = Box((0, q0, 0, 0), (b, q1, hq, d)), Box((0, k0, 0, 0), (b, k1, hkv, d))
    boxes = [qb, kb, kb] + ([Box((0, k0), (b, k1))] if kp is not None else [])
    blocks = [q[:, q0:q1], k[:, k0:k1], v[:, k0:k1]]
    host = [x.float().numpy().astype(op._compute_dtype()) for x in blocks]
    if kp is not None:
        host.append(kp[:, k0:k1])
    want, want_lse = op.kernel(host, FunctionSpec(tuple(boxes), Box((0, q0, 0, 0), (b, q1, hq, d))))
    consts = {name: _buf(torch.from_numpy(a))[0] for name, a in _attention_constants(op).items()}
    qd, kd, vd = (_buf(x)[0] for x in blocks)
    od, out = _buf(torch.empty(b, q1 - q0, hq, d, dtype=TORCH[dtype]))
    ld, lse = _buf(torch.empty(b, q1 - q0, hq, dtype=torch.float32))
    if kp is not None:
        kpd, _ = _buf(torch.from_numpy(kp[:, k0:k1].copy()))
        limd, _ = _buf(torch.empty(b, 2, dtype=torch.int32))
        K.padding_limits(kpd, limd, k0)
        K.attention(qd, kd, vd, od, ld, consts["row_lo"], consts["row_hi"], q0, k0, op.softmax_scale,
                    key_padding=kpd, limits=limd)
    else:
        K.attention(qd, kd, vd, od, ld, consts["row_lo"], consts["row_hi"], q0, k0, op.softmax_scale,
                    limits=consts["key_limits"], limits_batch=0)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.float().cpu().numpy(), want.astype(np.float32), rtol=0, atol=TOL[dtype] * scale)
    got_lse = lse.cpu().numpy()
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[fin], want_lse[fin].astype(np.float32), rtol=0, atol=1e-3)


@pytest.mark.parametrize("kind", list(PADDINGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_key_padding_in_the_kernel(kind: str, causal: bool, dtype: str) -> None:
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    op = AttentionOp((TensorType.zero((b, s, hq, d), dtype), TensorType.zero((b, s, hkv, d), dtype),
                      TensorType.zero((b, s, hkv, d), dtype), TensorType.zero((b, s), "bool")),
                     causal=causal, extras=("key_padding",))
    kp = _padding(kind, b, s)
    _run(op, dtype, 0, s, 0, s, kp)
    _run(op, dtype, 9, 33, 5, 29, kp)  # blocks of a split plan: rows and keys from mid-sequence


@pytest.mark.parametrize("causal", [False, True])
def test_key_lengths_in_the_kernel(causal: bool) -> None:
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    op = AttentionOp(tuple(TensorType.zero(shape, "float32") for shape in
                           ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d))), causal=causal,
                     key_lengths=(40, 0, 17))
    _run(op, "float32", 0, s, 0, s, None)
    _run(op, "float32", 9, 33, 5, 29, None)

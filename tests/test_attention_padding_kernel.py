"""The Triton attention kernels with key padding and key lengths against the operators' NumPy kernels:
the forward, and the backward's log-sum-exp, dq and dk|dv; right, left and holed padding, a batch row
with no real key (0 and log-sum-exp -inf), causal and not, GQA, and blocks that start mid-sequence on
both queries and keys (a split plan's blocks).

Without a GPU the kernel runs in Triton's interpreter on CPU.  Tolerances: float32 scores are computed
in IEEE float32 on both sides (2e-5); bfloat16 operands meet float32 accumulation (2e-2 of the largest
output), as in the kernel's other tests."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.sql_specs.attention import AttentionOp
from relational_tensors.sql_specs.attention_grad import AttentionGradOp, AttentionLseOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_attention")
G = kernel_module("relational_tensors.kernels.triton_attention_grad")

from relational_tensors.kernels.launchers.attention import _attention_constants, _attention_grad_constants  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32, "bool": torch.bool}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K, G, widen_dot=True)


def _buf(t):
    return T.buf(t.contiguous())


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


def _grad_run(options: dict, dtype: str, kp: np.ndarray | None, q0: int, q1: int, k0: int, k1: int) -> None:
    """lse, dq and dk|dv of one block pair against the NumPy kernels."""
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    g = np.random.default_rng(1)
    arrays = [torch.from_numpy(g.standard_normal(shape).astype(np.float32)).to(TORCH[dtype]).float().numpy()
              for shape in ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d))]
    tq, tk = TensorType.zero((b, s, hq, d), dtype), TensorType.zero((b, s, hkv, d), dtype)
    ts = TensorType.zero((b, s, hq), "float32")
    extra = (TensorType.zero((b, s), "bool"),) if kp is not None else ()
    opts = dict(options, extras=("key_padding",)) if kp is not None else options
    lse_op = AttentionLseOp((tq, tk, *extra), **opts)
    qb, kb = Box((0, q0, 0, 0), (b, q1, hq, d)), Box((0, k0, 0, 0), (b, k1, hkv, d))
    kpb = [Box((0, k0), (b, k1))] if kp is not None else []
    kp_block = [kp[:, k0:k1]] if kp is not None else []
    whole = [Box((0, 0, 0, 0), (b, s, hq, d)), Box((0, 0, 0, 0), (b, s, hkv, d))]
    lse = lse_op.kernel([arrays[0], arrays[1], *([kp] if kp is not None else [])],
                        FunctionSpec((*whole, *([Box((0, 0), (b, s))] if kp is not None else [])),
                                     Box((0, 0, 0), (b, s, hq))))
    delta = np.einsum("bshd,bshd->bsh", arrays[3], g.standard_normal((b, s, hq, d)).astype(np.float32))
    lse = np.asarray(lse, np.float32)
    consts = {n: _buf(torch.from_numpy(a))[0] for n, a in _attention_grad_constants(lse_op).items()}
    dev = [_buf(torch.from_numpy(np.ascontiguousarray(a[:, q0:q1] if i in (0, 3) else a[:, k0:k1])).to(TORCH[dtype]))[0]
           for i, a in enumerate(arrays)]
    lse_b, delta_b = lse[:, q0:q1], delta[:, q0:q1].astype(np.float32)
    lse_d = _buf(torch.from_numpy(np.ascontiguousarray(lse_b)))[0]
    delta_d = _buf(torch.from_numpy(np.ascontiguousarray(delta_b)))[0]
    pad: dict = {}
    if kp is not None:
        kpd, _ = _buf(torch.from_numpy(kp[:, k0:k1].copy()))
        limd, _ = _buf(torch.empty(b, 2, dtype=torch.int32))
        K.padding_limits(kpd, limd, k0)
        pad = {"key_padding": kpd, "limits": limd}
    elif "key_limits" in consts:
        pad = {"limits": consts["key_limits"], "limits_batch": 0}
    host = [arrays[0][:, q0:q1], arrays[1][:, k0:k1], arrays[2][:, k0:k1], arrays[3][:, q0:q1], lse_b, delta_b]
    tol = TOL[dtype]
    # the log-sum-exp of this block's keys
    got_d, got = _buf(torch.empty(b, q1 - q0, hq, dtype=torch.float32))
    G.attention_lse(dev[0], dev[1], got_d, consts["row_lo"], consts["row_hi"], q0, k0, lse_op.softmax_scale, **pad)
    want = np.asarray(lse_op.kernel([host[0], host[1], *kp_block], FunctionSpec((qb, kb, *kpb), Box(
        (0, q0, 0), (b, q1, hq)))), np.float32)
    got = got.cpu().numpy()
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-3)
    for part in ("dq", "dkv"):
        op = AttentionGradOp((tq, tk, tk, tq, ts, ts, *extra), part=part, **opts)
        out_box = qb if part == "dq" else Box((0, k0, 0, 0), (b, k1, hkv, 2 * d))
        want = np.asarray(op.kernel([*host, *kp_block], FunctionSpec((qb, kb, kb, qb, Box((0, q0, 0), (b, q1, hq)),
                                                                       Box((0, q0, 0), (b, q1, hq)), *kpb), out_box)),
                          np.float32)
        od, out = _buf(torch.full(out_box.shape, float("nan"), dtype=torch.float32))
        if part == "dq":
            G.attention_dq(*dev, lse_d, delta_d, od, consts["row_lo"], consts["row_hi"], q0, k0, op.softmax_scale,
                           **pad)
        else:
            G.attention_dkv(*dev, lse_d, delta_d, od, consts["key_qlo"], consts["key_qhi"], q0, k0,
                            op.softmax_scale, **pad)
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=0, atol=tol * scale, err_msg=f"{part} {options}")


@pytest.mark.parametrize("kind", list(PADDINGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_key_padding_in_the_backward_kernels(kind: str, causal: bool, dtype: str) -> None:
    kp = _padding(kind, 3, 40)
    _grad_run({"causal": causal}, dtype, kp, 0, 40, 0, 40)
    _grad_run({"causal": causal}, dtype, kp, 9, 33, 5, 29)


@pytest.mark.parametrize("causal", [False, True])
def test_key_lengths_in_the_backward_kernels(causal: bool) -> None:
    opts = {"causal": causal, "key_lengths": (40, 0, 17)}
    _grad_run(opts, "float32", None, 0, 40, 0, 40)
    _grad_run(opts, "float32", None, 9, 33, 5, 29)

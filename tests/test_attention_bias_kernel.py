"""The Triton attention kernels with a boolean mask, an additive bias and a logit softcap against the
operators' NumPy kernels: the forward (and its log-sum-exp), the backward's log-sum-exp, dq, dk|dv, and the bias
gradient; masks and biases broadcast over batch rows, heads, both or neither, with causal alignment,
key padding and key lengths beside them, GQA, rows that see no key, -inf and large negative biases (as
HF's masks fill), and blocks that start mid-sequence on both queries and keys (a split plan's blocks).

Without a GPU the kernels run in Triton's interpreter on CPU.  Tolerances relative to the largest
output: float32 scores are computed in IEEE float32 on both sides (2e-5, 1e-4 for the gradients, which
add more terms); bfloat16 operands meet float32 accumulation with P and dS rounded to bfloat16 before
their products, as in the kernels' other tests (3e-2).  The bias gradient is summed over the broadcast
dimensions in float32 on both sides."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.sql_specs.attention import AttentionOp
from relational_tensors.sql_specs.attention_grad import AttentionGradOp, AttentionLseOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_attention")
G = kernel_module("relational_tensors.kernels.triton_attention_grad")
B = kernel_module("relational_tensors.kernels.triton_attention_dbias")

from relational_tensors.kernels.launchers.attention import _attention_constants, _attention_grad_constants  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": 2e-5, "bfloat16": 3e-2}
GRAD_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K, G, B, widen_dot=True)


def _buf(t):
    return T.buf(t.contiguous())[0]


class Case:
    """One attention problem with its mask, bias and padding, and the blocks of one function spec."""

    def __init__(self, dtype: str, b: int = 2, s: int = 37, hq: int = 4, hkv: int = 2, d: int = 16,
                 mask: str | None = "bh", bias: str | None = "bh", causal: bool = False, padding: bool = False,
                 key_lengths: tuple[int, ...] | None = None, seed: int = 0, fill: float = -np.inf,
                 softcap: float | None = None) -> None:
        g = np.random.default_rng(seed)
        self.dtype, self.b, self.s, self.hq, self.hkv, self.d = dtype, b, s, hq, hkv, d

        def rounded(shape):  # values the dtype holds exactly, so both sides see the same inputs
            return torch.from_numpy(g.standard_normal(shape).astype(np.float32)).to(TORCH[dtype]).float().numpy()

        self.q, self.k, self.v = rounded((b, s, hq, d)), rounded((b, s, hkv, d)), rounded((b, s, hkv, d))
        self.do = rounded((b, s, hq, d))
        extras, self.extra = [], []
        if padding:
            kp = g.random((b, s)) < 0.7
            kp[:, 0] = True
            extras.append("key_padding")
            self.extra.append(kp)
        for name, form in (("mask", mask), ("bias", bias)):
            if form is None:
                continue
            shape = (b if "b" in form else 1, hq if "h" in form else 1, s, s)
            if name == "mask":
                m = g.random(shape) < 0.75
                m[..., min(3, s - 1), :] = False  # a row that sees no key through the mask
                self.extra.append(m)
            else:
                bias = rounded(shape) * 2.0
                bias[..., min(5, s - 1), : s // 2] = fill  # hidden by the bias: -inf (SDPA) or finfo.min (HF's fill)
                self.extra.append(bias)
            extras.append(name)
        self.opts = dict(causal=causal, extras=tuple(extras), key_lengths=key_lengths, softcap=softcap)
        types = [TensorType.zero(x.shape, dtype) for x in (self.q, self.k, self.v)]
        self.extra_types = [TensorType.zero(x.shape, "bool" if x.dtype == bool else dtype) for x in self.extra]
        self.op = AttentionOp((*types, *self.extra_types), **self.opts)

    def extra_blocks(self, q0: int, q1: int, k0: int, k1: int) -> tuple[list[Box], list[np.ndarray]]:
        boxes, blocks = [], []
        for name, x in zip(self.opts["extras"], self.extra):
            if name == "key_padding":
                boxes.append(Box((0, k0), (self.b, k1)))
                blocks.append(x[:, k0:k1])
            else:
                boxes.append(Box((0, 0, q0, k0), (x.shape[0], x.shape[1], q1, k1)))
                blocks.append(x[:, :, q0:q1, k0:k1])
        return boxes, blocks

    def device_extras(self, blocks: list[np.ndarray], k0: int) -> dict:
        out: dict = {}
        for name, x in zip(self.opts["extras"], blocks):
            if name == "key_padding":
                out["key_padding"] = _buf(torch.from_numpy(x.copy()))
                out["limits"] = _buf(torch.empty(self.b, 2, dtype=torch.int32))
                K.padding_limits(out["key_padding"], out["limits"], k0)
            else:
                t = torch.from_numpy(x.copy())
                out[name] = _buf(t if x.dtype == bool else t.to(TORCH[self.dtype]))
        if self.opts["softcap"] is not None:
            out["softcap"] = self.opts["softcap"]
        if self.opts["key_lengths"] is not None:
            out["limits"] = _buf(torch.from_numpy(_attention_constants(self.op)["key_limits"]))
            out["limits_batch"] = 0
        return out


def _close(got, want, tol, what):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=tol * scale,
                               err_msg=what)


def _empty(shape, dtype):
    return T.buf(torch.full(shape, float("nan"), dtype=dtype))


def forward(c: Case, q0: int, q1: int, k0: int, k1: int) -> None:
    """The forward kernel's output and log-sum-exp of one block pair against the NumPy kernel."""
    b, hq, d = c.b, c.hq, c.d
    qb, kb = Box((0, q0, 0, 0), (b, q1, hq, d)), Box((0, k0, 0, 0), (b, k1, c.hkv, d))
    boxes, blocks = c.extra_blocks(q0, q1, k0, k1)
    host = [c.q[:, q0:q1], c.k[:, k0:k1], c.v[:, k0:k1], *blocks]
    want, want_lse = c.op.kernel(host, FunctionSpec((qb, kb, kb, *boxes), Box((0, q0, 0, 0), (b, q1, hq, d))))
    consts = {name: _buf(torch.from_numpy(a)) for name, a in _attention_constants(c.op).items()}
    qd, kd, vd = (_buf(torch.from_numpy(np.ascontiguousarray(x)).to(TORCH[c.dtype])) for x in host[:3])
    od, out = _empty((b, q1 - q0, hq, d), TORCH[c.dtype])
    ld, lse = _empty((b, q1 - q0, hq), torch.float32)
    K.attention(qd, kd, vd, od, ld, consts["row_lo"], consts["row_hi"], q0, k0, c.op.softmax_scale,
                **c.device_extras(blocks, k0))
    _close(out.float().cpu().numpy(), want, TOL[c.dtype], f"forward {c.opts}")
    got_lse = lse.cpu().numpy()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse)), "rows that see no key"
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[fin], want_lse[fin].astype(np.float32), rtol=0, atol=1e-3)


def backward(c: Case, q0: int, q1: int, k0: int, k1: int) -> None:
    """lse, dq, dk|dv and dbias of one block pair against the NumPy kernels (the rows' full lse and Δ)."""
    b, s, hq, hkv, d = c.b, c.s, c.hq, c.hkv, c.d
    tq, tk = TensorType.zero((b, s, hq, d), c.dtype), TensorType.zero((b, s, hkv, d), c.dtype)
    ts = TensorType.zero((b, s, hq), "float32")
    lse_op = AttentionLseOp((tq, tk, *c.extra_types), **c.opts)
    whole_boxes, whole_blocks = c.extra_blocks(0, s, 0, s)
    whole = [Box((0, 0, 0, 0), (b, s, hq, d)), Box((0, 0, 0, 0), (b, s, hkv, d))]
    lse = np.asarray(lse_op.kernel([c.q, c.k, *whole_blocks], FunctionSpec((*whole, *whole_boxes),
                                                                           Box((0, 0, 0), (b, s, hq)))), np.float32)
    out, _ = c.op.kernel([c.q, c.k, c.v, *whole_blocks], FunctionSpec((*whole, whole[1], *whole_boxes), whole[0]))
    delta = np.einsum("bshd,bshd->bsh", np.asarray(out, np.float32), c.do).astype(np.float32)
    consts = {n: _buf(torch.from_numpy(a)) for n, a in _attention_grad_constants(lse_op).items()}
    qb, kb = Box((0, q0, 0, 0), (b, q1, hq, d)), Box((0, k0, 0, 0), (b, k1, hkv, d))
    rb = Box((0, q0, 0), (b, q1, hq))
    boxes, blocks = c.extra_blocks(q0, q1, k0, k1)
    host = [c.q[:, q0:q1], c.k[:, k0:k1], c.v[:, k0:k1], c.do[:, q0:q1], lse[:, q0:q1], delta[:, q0:q1]]
    dev = [_buf(torch.from_numpy(np.ascontiguousarray(x)).to(TORCH[c.dtype])) for x in host[:4]]
    lse_d, delta_d = (_buf(torch.from_numpy(np.ascontiguousarray(x))) for x in host[4:])
    extra = c.device_extras(blocks, k0)
    tol = GRAD_TOL[c.dtype]
    got_d, got = _empty((b, q1 - q0, hq), torch.float32)
    G.attention_lse(dev[0], dev[1], got_d, consts["row_lo"], consts["row_hi"], q0, k0, lse_op.softmax_scale, **extra)
    want = np.asarray(lse_op.kernel([*host[:2], *blocks], FunctionSpec((qb, kb, *boxes), rb)), np.float32)
    got = got.cpu().numpy()
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "rows that see no key of the block"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-3)
    for part in ("dq", "dkv", "dbias"):
        if part == "dbias" and "bias" not in c.opts["extras"]:
            continue
        op = AttentionGradOp((tq, tk, tk, tq, ts, ts, *c.extra_types), part=part, **c.opts)
        if part == "dq":
            out_box = qb
        elif part == "dkv":
            out_box = Box((0, k0, 0, 0), (b, k1, hkv, 2 * d))
        else:
            out_box = boxes[c.opts["extras"].index("bias")]
        want = np.asarray(op.kernel([*host, *blocks], FunctionSpec((qb, kb, kb, qb, rb, rb, *boxes), out_box)),
                          np.float32)
        od, got = _empty(out_box.shape, torch.float32)
        if part == "dq":
            G.attention_dq(*dev, lse_d, delta_d, od, consts["row_lo"], consts["row_hi"], q0, k0, op.softmax_scale,
                           **extra)
        elif part == "dkv":
            G.attention_dkv(*dev, lse_d, delta_d, od, consts["key_qlo"], consts["key_qhi"], q0, k0, op.softmax_scale,
                            **extra)
        else:
            B.attention_dbias(*dev, lse_d, delta_d, od, consts["row_lo"], consts["row_hi"], q0, k0,
                              op.softmax_scale, **extra)
        _close(got.cpu().numpy(), want, tol, f"{part} {c.opts}")


FORMS = {"over batch and heads": ("bh", "bh"), "broadcast": ("", ""), "per batch row": ("b", "b"),
         "per head": ("h", "h"), "mask only": ("bh", None), "bias only": (None, "h")}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mask_and_bias_in_the_forward_kernel(form: str, causal: bool, dtype: str) -> None:
    mask, bias = FORMS[form]
    c = Case(dtype, mask=mask, bias=bias, causal=causal)
    forward(c, 0, c.s, 0, c.s)
    forward(c, 9, 33, 5, 29)  # blocks of a split plan: rows and keys from mid-sequence


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mask_and_bias_in_the_backward_kernels(form: str, dtype: str) -> None:
    mask, bias = FORMS[form]
    c = Case(dtype, mask=mask, bias=bias, causal=form == "per head")
    backward(c, 0, c.s, 0, c.s)
    backward(c, 9, 33, 5, 29)


def test_with_key_padding_and_key_lengths_beside_them() -> None:
    c = Case("float32", mask="b", bias="h", padding=True)
    forward(c, 0, c.s, 0, c.s)
    backward(c, 4, 30, 7, 37)
    c = Case("float32", mask="", bias="bh", causal=True, key_lengths=(37, 11))
    forward(c, 3, 37, 0, 20)
    backward(c, 3, 37, 0, 20)


@pytest.mark.parametrize("cap", [0.4, 3.0])
@pytest.mark.parametrize("bias", [None, "b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_in_every_kernel(cap: float, bias: str | None, dtype: str) -> None:
    """Gemma 2's logit soft-capping, alone and before a bias (the bias's gradient is the capped scores'),
    with a sliding window's worth of causality: a cap well under the scores' spread and one above it."""
    c = Case(dtype, mask=None, bias=bias, causal=True, softcap=cap)
    forward(c, 0, c.s, 0, c.s)
    forward(c, 9, 33, 5, 29)
    backward(c, 0, c.s, 0, c.s)
    backward(c, 9, 33, 5, 29)


def test_hf_fill_value_as_bias() -> None:
    """HF fills hidden pairs of a float mask with finfo.min: they weigh nothing, forward and backward."""
    for dtype in ("float32", "bfloat16"):
        c = Case(dtype, mask=None, bias="b", fill=float(torch.finfo(TORCH[dtype]).min))
        forward(c, 0, c.s, 0, c.s)
        backward(c, 0, c.s, 0, c.s)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_shape_and_block(data) -> None:
    s = data.draw(st.integers(5, 40), "s")
    hkv = data.draw(st.sampled_from([1, 2]), "hkv")
    q0 = data.draw(st.integers(0, s - 1), "q0")
    q1 = data.draw(st.integers(q0 + 1, s), "q1")
    k0 = data.draw(st.integers(0, s - 1), "k0")
    k1 = data.draw(st.integers(k0 + 1, s), "k1")
    c = Case("float32", b=data.draw(st.integers(1, 3), "b"), s=s, hq=hkv * data.draw(st.sampled_from([1, 2]), "g"),
             hkv=hkv, d=data.draw(st.sampled_from([8, 16, 24]), "d"),
             mask=data.draw(st.sampled_from([None, "", "b", "h", "bh"]), "mask"),
             bias=data.draw(st.sampled_from([None, "", "b", "h", "bh"]), "bias"),
             causal=data.draw(st.booleans(), "causal"), seed=data.draw(st.integers(0, 5), "seed"),
             softcap=data.draw(st.sampled_from([None, 0.5, 20.0]), "softcap"))
    forward(c, q0, q1, k0, k1)
    backward(c, q0, q1, k0, k1)

"""The decode attention kernel (``kernels.triton_attention_decode``: the keys split across programs, the
splits merged by their log-sum-exp) against the attention operator's NumPy kernel: one and a few query
rows, GQA groups, key padding (left, holed, a row with no real key), causal (bottom-right, as after a
cache) and windowed rows, blocks that start mid-sequence on queries and keys (a split plan's blocks),
one split and several, with and without the log-sum-exp output.

Without a GPU the kernels run in Triton's interpreter on CPU.  Tolerances as the forward kernel's tests:
float32 scores in IEEE float32 on both sides (2e-5 of the largest output); bfloat16 operands with float32
accumulation (2e-2); the log-sum-exp to 1e-3."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.kernels import scratch as S
from relational_tensors.sql_specs.attention import AttentionOp

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_attention_decode")
A = kernel_module("relational_tensors.kernels.triton_attention")
C = kernel_module("relational_tensors.kernels.triton_copy")

from relational_tensors.kernels.launchers import launcher_for, op_constants, scratch_shape  # noqa: E402
from relational_tensors.kernels.launchers.attention import _attention_constants, _decode_form  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K, A, C, widen_dot=True)


def _padding(kind: str, b: int, skv: int) -> np.ndarray | None:
    if kind == "none":
        return None
    g = np.random.default_rng(7)
    kp = np.ones((b, skv), dtype=bool)
    if kind == "left":
        for r in range(b):
            kp[r, : (5 * r) % max(skv // 2, 1)] = False
    elif kind == "holes":
        kp = g.random((b, skv)) < 0.6
    if kind == "a row with no key":
        kp[b - 1] = False
    return kp


def check(b: int, sq: int, hq: int, hkv: int, skv: int, dtype: str, padding: str, causal: bool | str,
          window: int | None, q0: int = 0, k0: int = 0, k1: int | None = None, d: int = 16,
          with_lse: bool = True, seed: int = 0) -> None:
    """The kernel on the blocks q[:, q0:q0+sq], keys [k0, k1) of an operator over sq_total = q0 + sq rows."""
    k1 = skv if k1 is None else k1
    total_q = q0 + sq
    extras = ("key_padding",) if padding != "none" else ()
    types = [TensorType.zero((b, total_q, hq, d), dtype), TensorType.zero((b, skv, hkv, d), dtype),
             TensorType.zero((b, skv, hkv, d), dtype)] + ([TensorType.zero((b, skv), "bool")] if extras else [])
    op = AttentionOp(tuple(types), causal=causal, window=window, extras=extras)
    g = np.random.default_rng(seed)
    q = torch.from_numpy(g.standard_normal((b, total_q, hq, d)).astype(np.float32)).to(TORCH[dtype])
    k = torch.from_numpy(g.standard_normal((b, skv, hkv, d)).astype(np.float32)).to(TORCH[dtype])
    v = torch.from_numpy(g.standard_normal((b, skv, hkv, d)).astype(np.float32)).to(TORCH[dtype])
    kp = _padding(padding, b, skv)
    blocks = [q[:, q0:total_q], k[:, k0:k1], v[:, k0:k1]]
    boxes = [Box((0, q0, 0, 0), (b, total_q, hq, d)), Box((0, k0, 0, 0), (b, k1, hkv, d)),
             Box((0, k0, 0, 0), (b, k1, hkv, d))]
    host = [x.float().numpy().astype(op._compute_dtype()) for x in blocks]
    if kp is not None:
        boxes.append(Box((0, k0), (b, k1)))
        host.append(kp[:, k0:k1])
    want, want_lse = op.kernel(host, FunctionSpec(tuple(boxes), Box((0, q0, 0, 0), (b, total_q, hq, d))))
    consts = {name: T.buf(torch.from_numpy(a))[0] for name, a in _attention_constants(op).items()}
    qd, kd, vd = (T.buf(x.contiguous())[0] for x in blocks)
    od, out = T.buf(torch.empty(b, sq, hq, d, dtype=TORCH[dtype]))
    ld, lse = T.buf(torch.empty(b, sq, hq, dtype=torch.float32))
    kpd = T.buf(torch.from_numpy(kp[:, k0:k1].copy()))[0] if kp is not None else None
    room = S.decode_scratch(b, sq, hq, hkv, k1 - k0, d)
    scratch = T.buf(torch.full((max(room, 1),), float("nan")))[0] if room else None
    K.decode_attention(qd, kd, vd, od, ld if with_lse else None, consts["row_lo"], consts["row_hi"], q0, k0,
                       op.softmax_scale, kpd, scratch)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.float().cpu().numpy(), want.astype(np.float32), rtol=0, atol=TOL[dtype] * scale)
    if with_lse:
        got_lse = lse.cpu().numpy()
        assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[fin], want_lse[fin].astype(np.float32), rtol=0, atol=1e-3)


@pytest.fixture
def small_splits(monkeypatch):
    """Splits of 64 keys (a tile each), so the interpreter's small caches still split several ways."""
    monkeypatch.setattr(S, "DECODE_MIN_KEYS", 64)


@pytest.mark.parametrize("padding", ["none", "left", "holes", "a row with no key"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_per_sequence_over_a_split_cache(small_splits, dtype: str, padding: str) -> None:
    assert S.decode_splits(2, 2, 300)[0] > 1
    check(2, 1, 8, 2, 300, dtype, padding, False, None)


@pytest.mark.parametrize("causal,window", [("bottom_right", None), ("bottom_right", 40), (False, 25)])
def test_a_few_rows_causal_and_windowed(small_splits, causal: bool | str, window: int | None) -> None:
    """Speculative rows after a cache: each row sees the keys up to its own position (and a window back)."""
    check(2, 3, 4, 2, 257, "float32", "left", causal, window)


def test_blocks_from_mid_sequence_and_one_split(small_splits) -> None:
    check(3, 2, 4, 1, 200, "float32", "holes", "bottom_right", None, q0=5, k0=37, k1=170)
    check(1, 1, 4, 4, 40, "bfloat16", "none", False, None, with_lse=False)  # one split: written directly
    assert S.decode_splits(1, 4, 40)[0] == 1


def test_the_splits_fill_the_gpu_and_cover_the_keys() -> None:
    for nb, hkv, skv in [(1, 8, 1056), (64, 8, 1056), (1, 1, 131072), (3, 2, 5), (1, 8, 257)]:
        splits, per = S.decode_splits(nb, hkv, skv)
        assert per % S.DECODE_BLOCK_N == 0 and (splits - 1) * per < skv <= splits * per
        assert splits == 1 or per >= S.DECODE_MIN_KEYS
        assert splits == 1 or nb * hkv * (splits - 1) < S.DECODE_PROGRAMS


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), sq=st.integers(1, 4), heads=st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3)]),
       skv=st.integers(1, 200), causal=st.sampled_from([False, "bottom_right"]), seed=st.integers(0, 99))
def test_shapes_that_do_not_divide(b: int, sq: int, heads: tuple[int, int], skv: int, causal: bool | str,
                                   seed: int) -> None:
    saved = S.DECODE_MIN_KEYS
    S.DECODE_MIN_KEYS = 16  # many splits of one partial tile each
    try:
        T.held.clear()
        if causal and sq > skv:
            causal = False
        check(b, sq, heads[0], heads[1], skv, "float32", "holes", causal, None, seed=seed)
    finally:
        S.DECODE_MIN_KEYS = saved


@pytest.mark.parametrize("request_", [{}, {"batch": 2, "heads_kv": 2}, {"seq_kv": 2}])
def test_the_launcher_takes_it_for_each_block_of_a_decode_step(small_splits, request_: dict[str, int]) -> None:
    """A decode step's attention (one row per sequence over the cache, key padding) through the attention
    launcher, block by block as a plan splits it (batch, heads, the keys), against the NumPy kernel; a
    prefill-shaped block keeps the general kernel."""
    b, hq, hkv, d, skv = 3, 8, 2, 16, 300
    dtype = "float32"
    types = (TensorType.zero((b, 1, hq, d), dtype), TensorType.zero((b, skv, hkv, d), dtype),
             TensorType.zero((b, skv, hkv, d), dtype), TensorType.zero((b, skv), "bool"))
    op = AttentionOp(types, extras=("key_padding",))
    g = np.random.default_rng(4)
    values = [g.standard_normal(t.shape).astype(np.float32) for t in types[:3]] + [_padding("left", b, skv)]
    by_name = {s.name: s for s in op.requestable()}
    spec = op.spec({name: by_name[name].near_equal(n) for name, n in request_.items()})
    consts = {name: T.buf(torch.from_numpy(a))[0] for name, a in op_constants(op).items()}
    for f in spec.functions:
        assert _decode_form(op, f)
        blocks = [np.ascontiguousarray(v[box.slices()]) for v, box in zip(values, f.inputs)]
        ins = [T.buf(torch.from_numpy(x.copy()))[0] for x in blocks]
        want, want_lse = op.kernel(blocks, f)
        od, out = T.buf(torch.full(f.output.shape, float("nan")))
        ld, lse = T.buf(torch.full(f.output.shape[:3], float("nan")))
        need = scratch_shape(op, f)
        run = dict(consts, **({"scratch": T.buf(torch.full(need[0], float("nan")))[0]} if need else {}))
        keys_split = "seq_kv" in request_
        launcher_for("attention").launch(op, f, ins, (od, ld) if keys_split else od, run, 0)
        np.testing.assert_allclose(out.cpu().numpy(), want, rtol=0, atol=2e-5 * max(1.0, float(np.abs(want).max())))
        if keys_split:
            fin = np.isfinite(want_lse)
            np.testing.assert_allclose(lse.cpu().numpy()[fin], want_lse[fin], rtol=0, atol=1e-3)
    prefill = AttentionOp((TensorType.zero((b, 40, hq, d), dtype), *types[1:]), extras=("key_padding",))
    assert not _decode_form(prefill, prefill.spec({}).functions[0])

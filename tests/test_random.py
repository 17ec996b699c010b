"""The random operators (``sql_specs.random``): the Philox generator, dropout and random tensors planned over
any number of devices, dropout's gradient, and the Triton kernels bit for bit against the NumPy ones.

Statistical tolerances are five standard deviations of the estimate (a false failure about once in 1.7
million runs; the seeds are fixed, so a run either always passes or always fails):

* the mean of n = 10^5 uniform values has standard deviation sqrt(1/12 / n) = 9.1e-4: 5σ = 4.6e-3;
* the share of elements dropout keeps, Binomial(n, 1-p)/n, has standard deviation at most
  sqrt(0.25 / n) = 1.6e-3: 5σ = 7.9e-3.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.sql_specs.random import (
    PHILOX_M,
    PHILOX_W,
    DropoutOp,
    RandomOp,
    flat_indices,
    philox4x32,
    philox_bits,
    philox_uniform,
)

GPU = visible_gpus() > 0
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels run on CPU, in Python

M32 = 0xFFFFFFFF
FLOATS = ["float32", "float64", "float16", "bfloat16"]


def same_bits(a: Any, b: Any, any_nan: bool = False) -> bool:
    """Equal bit for bit; with ``any_nan``, NaN matches NaN of any payload (a GPU makes the canonical NaN
    where an x86 CPU makes its own, e.g. for inf · 0)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if any_nan:
        nan = np.isnan(a.astype(np.float64))
        if not np.array_equal(nan, np.isnan(b.astype(np.float64))):
            return False
        a, b = a[~nan], b[~nan]
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


# ------------------------------------------------------------------ (a) the generator


def philox_scalar(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 of one counter, in Python integers (Salmon et al., SC'11, as Random123 writes it)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & M32, (k1 + PHILOX_W[1]) & M32
        p0, p1 = PHILOX_M[0] * c0, PHILOX_M[1] * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


# Random123's published known-answer vectors for philox4x32 with 10 rounds: counter, key, output
KNOWN = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
         ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
         ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
          (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("ctr,key,out", KNOWN)
def test_philox_known_answers(ctr: tuple, key: tuple, out: tuple) -> None:
    assert philox_scalar(ctr, key) == out
    got = philox4x32([np.array([c], np.uint32) for c in ctr], key)
    assert tuple(int(w[0]) for w in got) == out


# (seed, offset, stream, flat index): high words of every field set somewhere, a negative seed
LAYOUTS = [(0, 0, 0, 0), (42, 7, 3, 12345), (-1, 2**40 + 9, 2**32 - 1, 2**32 + 17), (2**63 - 1, -5, 1, 2**45 + 3),
           (-(2**63), 2**63 - 1, 77, 2**62)]


def test_the_counter_and_key_layout() -> None:
    """u(i) = (word0 >> 8)·2^-24 of key (seed lo, seed hi) and counter (i lo, i hi, stream, offset lo)."""
    for seed, offset, stream, i in LAYOUTS:
        s = seed & (2**64 - 1)
        word = philox_scalar((i & M32, i >> 32, stream, offset & M32), (s & M32, s >> 32))[0]
        assert int(philox_bits(seed, offset, stream, np.array([i]))[0]) == word
        assert float(philox_uniform(seed, offset, stream, np.array([i]))[0]) == (word >> 8) * 2.0**-24


def test_uniform_and_dropout_statistics() -> None:
    n = 10**5
    u = philox_uniform(1234, 5, 0, np.arange(n))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert abs(float(u.mean()) - 0.5) < 5 * np.sqrt(1 / 12 / n)
    g = rt.Graph()
    x, r = g.input("x", [n]), g.input("rng", [2], "int64")
    for k, p in enumerate((0.1, 0.5, 0.9)):
        g.save(g.dropout(x, r, p, stream=k), name=f"y{k}")
    out = rt.reference(g, {"x": np.ones(n, np.float32), "rng": np.array([99, 0])})
    for k, p in enumerate((0.1, 0.5, 0.9)):
        kept = out[f"y{k}"] != 0
        assert abs(float(kept.mean()) - (1 - p)) < 5 * np.sqrt(0.25 / n), p
        assert np.all(out[f"y{k}"][kept] == np.float32(1 / (1 - p)))
    # two streams draw independent masks: they agree on a share p^2 + (1-p)^2 of the elements
    a, b = out["y1"] != 0, rt.reference(g, {"x": np.ones(n, np.float32), "rng": np.array([100, 0])})["y1"] != 0
    assert abs(float((a == b).mean()) - 0.5) < 5 * np.sqrt(0.25 / n)


def test_random_tensors_follow_the_generator() -> None:
    g = rt.Graph()
    r = g.input("rng", [2], "int64")
    for dtype in FLOATS:
        g.save(g.random(r, [40, 50], dtype, stream=4), name=f"u_{dtype}")
    g.save(g.random(r, [40, 50], stream=4, distribution="bernoulli", p=0.3), name="b")
    g.save(g.dropout(g.unary(g.random(r, [40, 50], stream=9), "fill", 1.0), r, 0.3, stream=4), name="d")
    feeds = {"rng": np.array([-77, 3])}
    out = rt.reference(g, feeds)
    u24 = philox_uniform(-77, 3, 4, np.arange(2000)).reshape(40, 50)
    bits = {"float32": 24, "float64": 24, "float16": 11, "bfloat16": 8}
    for dtype in FLOATS:
        got = out[f"u_{dtype}"]
        assert got.dtype == numpy_dtype(dtype)
        want = np.floor(u24.astype(np.float64) * 2.0 ** bits[dtype]) * 2.0 ** -bits[dtype]  # truncated to the dtype
        assert np.array_equal(got.astype(np.float64), want) and float(got.astype(np.float64).max()) < 1.0
    assert np.array_equal(out["b"], (u24 < 0.3).astype(np.float32))
    assert np.array_equal(out["d"] != 0, out["b"] == 0)  # dropout keeps where bernoulli of one stream gives 0


# ------------------------------------------------------------------ (b) every plan draws the same values


def dropout_graph(shape: tuple[int, ...], p: float, stream: int = 1, dtype: str = "float32") -> rt.Graph:
    g = rt.Graph()
    x, r = g.input("x", list(shape), dtype), g.input("rng", [2], "int64")
    h = g.unary(x, "scale", 2.0)  # a producer (exact everywhere), so the input arrives split by another plan
    g.save(g.dropout(h, r, p, stream), name="y")
    g.save(g.random(r, list(shape), dtype, stream=stream + 1), name="u")
    return g


def feeds(shape: tuple[int, ...], seed: int = 0, dtype: str = "float32", state: tuple[int, int] = (2**40 + 3, 11)
          ) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal(shape).astype(numpy_dtype(dtype))
    return {"x": x, "rng": np.array(state, np.int64)}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), p=st.floats(0.0, 0.95),
       devices=st.sampled_from([2, 5, 6, 7]), selector=st.sampled_from(["dp", "random"]))
def test_every_device_count_draws_the_same_bits(shape: tuple[int, ...], p: float, devices: int,
                                                 selector: str) -> None:
    g = dropout_graph(shape, p)
    f = feeds(shape)
    want = rt.reference(g, f)
    for n in (1, 3, 4, devices):
        got = rt.compileGraph(g, device=f"cpu:{n}", selector=selector, seed=n).run(f)
        for k in ("y", "u"):
            assert same_bits(got[k], want[k]), (k, n, shape, p)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_other_dtypes_draw_the_same_bits(dtype: str) -> None:
    shape = (5, 7, 3)
    g, f = dropout_graph(shape, 0.25, dtype=dtype), feeds(shape, dtype=dtype)
    want = rt.reference(g, f)
    got = rt.compileGraph(g, device="cpu:3").run(f)
    assert all(same_bits(got[k], want[k]) for k in ("y", "u"))


def test_stream_seed_and_offset_each_change_the_mask() -> None:
    shape = (6, 40)
    base = rt.reference(dropout_graph(shape, 0.5), feeds(shape))["y"] != 0
    changed = [rt.reference(dropout_graph(shape, 0.5, stream=2), feeds(shape))["y"] != 0,
               rt.reference(dropout_graph(shape, 0.5), feeds(shape, state=(2**40 + 4, 11)))["y"] != 0,
               rt.reference(dropout_graph(shape, 0.5), feeds(shape, state=(2**40 + 3, 12)))["y"] != 0,
               # only the seed's high word differs
               rt.reference(dropout_graph(shape, 0.5), feeds(shape, state=(3, 11)))["y"] != 0]
    for other in changed:
        assert 0.3 < float((other != base).mean()) < 0.7  # about half of 240 elements differ
    again = rt.reference(dropout_graph(shape, 0.5), feeds(shape, seed=5))["y"] != 0  # x changes, the mask does not
    assert np.array_equal(again, base)


def test_a_block_draws_what_the_whole_tensor_has_there() -> None:
    op = DropoutOp((TensorType.zero((7, 9, 4)), TensorType.zero((2,), "int64")), 0.4, 5)
    x = np.random.default_rng(1).standard_normal((7, 9, 4)).astype(np.float32)
    state = np.array([-3, 2**33])
    whole = op.kernel([x, state], op.spec().functions[0])
    iv = [rt.Interval(0, 2), rt.Interval(2, 3), rt.Interval(3, 7)]
    spec = op.spec({"d0": tuple(iv), "d1": (rt.Interval(0, 5), rt.Interval(5, 9))})
    for f in spec.functions:
        assert same_bits(op.kernel([x[f.inputs[0].slices()], state], f), whole[f.output.slices()])
    assert flat_indices(rt.Box((2, 5, 1), (3, 6, 3)), (7, 9, 4)).tolist() == [[[93, 94]]]


# ------------------------------------------------------------------ (c) the gradient


def test_the_gradient_is_the_mask_times_the_upstream_gradient() -> None:
    shape, p = (6, 7), 0.35
    g = rt.Graph()
    x, w, r = g.input("x", list(shape), "float64"), g.input("w", list(shape), "float64"), g.input("rng", [2], "int64")
    y = g.dropout(x, r, p, stream=3)
    loss = g.save(g.sum(g.mul(g.unary(y, "square"), w), axis=(0, 1)), name="loss")
    (dx,) = g.grad(loss, [x])
    g.save(dx, name="dx")
    assert [n.op.kind for n in g.operators].count("dropout") == 2  # the backward is one more dropout
    rng = np.random.default_rng(0)
    f = {"x": rng.standard_normal(shape), "w": rng.standard_normal(shape), "rng": np.array([2**35 + 1, 4])}
    want = rt.reference(g, f)
    keep = philox_uniform(2**35 + 1, 4, 3, np.arange(42)).reshape(shape).astype(np.float64) >= p
    s = 1 / (1 - p)
    yv = f["x"] * keep * s
    np.testing.assert_allclose(want["dx"], keep * s * (2 * yv * f["w"]), rtol=1e-12)  # mask/(1-p) · upstream
    for n in (3, 4):
        got = rt.compileGraph(g, device=f"cpu:{n}").run(f)
        np.testing.assert_allclose(got["dx"], want["dx"], rtol=1e-12, atol=1e-14)
    # central differences along random directions: the loss is quadratic in x, so they are exact up to rounding
    h = 1e-5
    for _ in range(3):
        u = rng.standard_normal(shape)
        up, down = (rt.reference(g, {**f, "x": f["x"] + sgn * h * u})["loss"][0] for sgn in (1, -1))
        assert abs((up - down) / (2 * h) - float(np.sum(want["dx"] * u))) <= 1e-7 * np.linalg.norm(want["dx"]) * \
            np.linalg.norm(u)


def test_random_has_no_gradient() -> None:
    assert RandomOp.gradient != "yes"
    g = rt.Graph()
    x, r = g.input("x", [4, 3]), g.input("rng", [2], "int64")
    y = g.mul(x, g.random(r, [4, 3], distribution="bernoulli", p=0.5))  # a mask made by random: x's gradient flows
    (dx,) = g.grad(g.sum(y, axis=(0, 1)), [x])
    g.save(dx, name="dx")
    out = rt.reference(g, {"x": np.ones((4, 3), np.float32), "rng": np.array([1, 2])})
    mask = (philox_uniform(1, 2, 0, np.arange(12)).reshape(4, 3) < 0.5).astype(np.float32)
    assert np.array_equal(out["dx"], mask)


# ------------------------------------------------------------------ refusals


def _x(g: rt.Graph, dtype: str = "float32") -> rt.Tensor:
    return g.input("x", [4, 3], dtype)


def _state(g: rt.Graph, shape: list[int] | None = None, dtype: str = "int64") -> rt.Tensor:
    return g.input("rng", shape or [2], dtype)


REFUSALS = {
    "p of 1": (lambda g: g.dropout(_x(g), _state(g), 1.0, 0), r"dropout p must lie in \[0, 1\).*got p=1.0"),
    "negative p": (lambda g: g.dropout(_x(g), _state(g), -0.1, 0), r"got p=-0.1"),
    "p nan": (lambda g: g.dropout(_x(g), _state(g), float("nan"), 0), r"dropout p must be a finite number"),
    "p a string": (lambda g: g.dropout(_x(g), _state(g), "0.5", 0), r"dropout p must be a finite number"),
    "rng float": (lambda g: g.dropout(_x(g), _state(g, dtype="float32"), 0.5, 0),
                  r"int64 tensor of shape \[2\].*got float32 of shape \[2\].*g.input\('rng', \[2\], 'int64'\)"),
    "rng of 3": (lambda g: g.dropout(_x(g), _state(g, [3]), 0.5, 0), r"got int64 of shape \[3\]"),
    "x int": (lambda g: g.dropout(_x(g, "int64"), _state(g), 0.5, 0), r"dropout needs a floating x; got dtype int64"),
    "stream negative": (lambda g: g.dropout(_x(g), _state(g), 0.5, -1), r"stream must be an integer in \[0, 2\*\*32\)"),
    "stream float": (lambda g: g.dropout(_x(g), _state(g), 0.5, 1.5), r"got 1.5"),
    "random int dtype": (lambda g: g.random(_state(g), [3], "int64"), r"random makes floating tensors"),
    "random distribution": (lambda g: g.random(_state(g), [3], distribution="normal"),
                            r"distribution must be one of \['uniform', 'bernoulli'\]; got 'normal'"),
    "random p": (lambda g: g.random(_state(g), [3], distribution="bernoulli", p=1.5), r"must lie in \[0, 1\]"),
    "random shape": (lambda g: g.random(_state(g), [3, 0]), r"tensor dimensions must be positive integers"),
    "random shape an int": (lambda g: g.random(_state(g), 3), r"random shape is a sequence of positive integers"),
    "random rng float": (lambda g: g.random(_state(g, dtype="float64"), [3]), r"random takes its generator state"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_refused(case: str) -> None:
    build, message = REFUSALS[case]
    with pytest.raises(GraphError, match=message):
        build(rt.Graph())


# ------------------------------------------------------------------ (d) the Triton kernels, bit for bit


class Memory:
    """Device memory behind DevBuf pointers: CuPy on a GPU; without one, CPU torch tensors that Triton's
    interpreter reads (``ptr`` stands in for the kernel module's ``Ptr``)."""

    def __init__(self) -> None:
        self.blocks: list[Any] = []
        if GPU:
            import cupy

            from relational_tensors.kernels.common import bind_triton_to_cupy

            bind_triton_to_cupy()
            self.xp = cupy
        else:
            self.torch = pytest.importorskip("torch")

    def put(self, value: np.ndarray, dtype: str) -> Any:
        from relational_tensors.kernels.common import DevBuf

        value = np.ascontiguousarray(np.asarray(value).astype(numpy_dtype(dtype)))
        raw = value.reshape(-1).view(np.uint8)
        if GPU:
            a = self.xp.asarray(raw if raw.size else np.zeros(8, np.uint8))
            ptr = int(a.data.ptr)
        else:
            a = self.torch.from_numpy(raw.copy() if raw.size else np.zeros(8, np.uint8))
            ptr = int(a.data_ptr())
        self.blocks.append(a)
        return DevBuf(ptr, value.shape, dtype, 0)

    def _find(self, addr: int) -> tuple[Any, int]:
        for a in self.blocks:
            base, size = (int(a.data.ptr), a.size) if GPU else (int(a.data_ptr()), a.numel())
            if base <= addr < base + size:
                return a, addr - base
        raise AssertionError(f"pointer {addr:#x} lies in no block")

    def get(self, buf: Any) -> np.ndarray:
        a, off = self._find(buf.ptr)
        raw = self.xp.asnumpy(a[off:off + buf.nbytes]) if GPU else a[off:off + buf.nbytes].numpy().copy()
        return raw.view(numpy_dtype(buf.dtype)).reshape(buf.shape)

    def ptr(self, buf: Any, dtype: str | None = None) -> Any:
        torch = self.torch
        kinds = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int64": torch.int64}
        addr, name = (buf.ptr, dtype or buf.dtype) if hasattr(buf, "ptr") else (int(buf), dtype)
        a, off = self._find(addr)
        size = np.dtype(numpy_dtype(name)).itemsize
        return a[off:off + (a.numel() - off) // size * size].view(kinds[name])


@pytest.fixture
def mem(monkeypatch: pytest.MonkeyPatch) -> Memory:
    pytest.importorskip("triton")
    m = Memory()
    if not GPU:
        from relational_tensors.kernels import triton_random

        monkeypatch.setattr(triton_random, "Ptr", m.ptr)
    return m


def expected_block(op: Any, f: Any, blocks: list[np.ndarray]) -> np.ndarray:
    """The NumPy kernel's block.  Triton's interpreter converts float32 to bfloat16 by truncation (the GPU
    rounds to nearest even, as NumPy does): there the float32 result is truncated the same way."""
    if GPU or op.output_type.dtype != "bfloat16" or op.kind != "dropout":
        return np.asarray(op.kernel(blocks, f))
    wide = np.asarray(op.partial_kernel(blocks, f, "float32"), np.float32)
    return (wide.view(np.uint32) >> 16).astype(np.uint16).view(numpy_dtype("bfloat16"))


def run_launcher(mem: Memory, op: Any, f: Any, blocks: list[np.ndarray]) -> np.ndarray:
    from relational_tensors.kernels.launchers import launcher_for

    ins = [mem.put(b, t.dtype) for b, t in zip(blocks, op.input_types)]
    dtype = op.output_type.dtype
    out = mem.put(np.full(f.output.shape, np.nan).astype(numpy_dtype(dtype)), dtype)  # unwritten shows as NaN
    launcher_for(op.kind).launch(op, f, ins, out, {}, 0)
    if GPU:
        mem.xp.cuda.get_current_stream().synchronize()
    return mem.get(out)


def check_every_block(mem: Memory, op: Any, values: list[np.ndarray], request: dict[str, tuple]) -> None:
    for f in op.spec(request).functions:
        blocks = [np.ascontiguousarray(v[box.slices()]) for v, box in zip(values, f.inputs)]
        got, want = run_launcher(mem, op, f, blocks), expected_block(op, f, blocks)
        assert same_bits(got, want, any_nan=True), f"{op.kind} {op.output_type.dtype} {f}"


STATE = np.array([-(2**40) - 12345, 2**33 + 5], np.int64)


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # the interpreter's inf · 0
@pytest.mark.parametrize("dtype", FLOATS)
def test_triton_dropout_equals_the_numpy_kernel(mem: Memory, dtype: str) -> None:
    shape = (5, 7, 3)
    x = np.random.default_rng(0).standard_normal(shape).astype(numpy_dtype(dtype))
    x[0] = np.inf  # where dropped, inf · 0 = NaN on both sides (a kept one stays inf)
    x[1] = -0.0  # signed zeros keep their sign
    op = DropoutOp((TensorType.zero(shape, dtype), TensorType.zero((2,), "int64")), 0.3, 7)
    iv = rt.Interval
    check_every_block(mem, op, [x, STATE], {"d0": (iv(0, 2), iv(2, 5)), "d2": (iv(0, 1), iv(1, 3))})
    check_every_block(mem, op, [x, STATE], {"d0": (iv(0, 2), iv(2, 5))})  # blocks of whole rows: one flat piece


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("distribution", ["uniform", "bernoulli"])
def test_triton_random_equals_the_numpy_kernel(mem: Memory, dtype: str, distribution: str) -> None:
    op = RandomOp((TensorType.zero((2,), "int64"),), (6, 2, 9), dtype, 2**31 + 3, distribution, 0.4)
    iv = rt.Interval
    check_every_block(mem, op, [STATE], {"d0": (iv(0, 1), iv(1, 6)), "d2": (iv(0, 4), iv(4, 9))})
    check_every_block(mem, op, [STATE], {"d0": (iv(0, 1), iv(1, 6))})  # blocks of whole rows: one flat piece


def test_triton_kernels_on_blocks_of_many_pieces(mem: Memory) -> None:
    """A rank-6 block none of whose dimensions merge: the wrapper covers it in rank-4 pieces, each with its
    own offset in the whole tensor; and indices past 2^32 (the counter's second word)."""
    shape = (3, 3, 3, 3, 3, 3)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    op = DropoutOp((TensorType.zero(shape), TensorType.zero((2,), "int64")), 0.5, 2)
    iv = rt.Interval
    check_every_block(mem, op, [x, STATE], {f"d{k}": (iv(0, 1), iv(1, 3)) for k in range(0, 6, 2)})
    big = RandomOp((TensorType.zero((2,), "int64"),), (3, 2**31 + 1), "float32", 1, "uniform", 0.5)
    f = FunctionSpec((rt.Box((0,), (2,)),), rt.Box((1, 2**31 - 5), (3, 2**31 + 1)))
    assert same_bits(run_launcher(mem, big, f, [STATE]), expected_block(big, f, [STATE]))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="no CUDA GPU visible (or CuPy not installed)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_plans_draw_the_reference_bits(dtype: str) -> None:
    """Three virtual devices on one GPU, through the CuPy executor; later runs replay the program with a new
    generator state loaded (the kernels read it on the device, so a captured graph draws new values)."""
    shape = (5, 7, 3)
    g = dropout_graph(shape, 0.3, dtype=dtype)
    cg = rt.compileGraph(g, device="cuda:0,0,0")
    for state in ((1, 2), (2**40 + 3, 11), (-5, 2**35)):
        f = feeds(shape, dtype=dtype, state=state)
        got, want = cg.run(f), rt.reference(g, f)
        assert all(same_bits(got[k], want[k]) for k in ("y", "u")), state

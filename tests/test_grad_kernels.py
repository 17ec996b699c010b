"""The device kernels of the gradient operators (and rope's inverse rotation) against the operators' own
NumPy kernels, function spec for function spec: the same input blocks, the same offsets (a block of rows,
a slice of the vocabulary, a block of tokens), the launcher registered for the kind.

Without a GPU the Triton kernels run in Triton's interpreter on CPU memory (torch tensors stand behind the
device pointers the wrappers pass); with one they run compiled, on CuPy memory.  Skipped without Triton.
The tests marked ``gpu`` run a small training graph's gradient through the CuPy executor.

Tolerances, as a share of the largest magnitude of the reference block:

* float32 and float64: 1e-5 and 1e-12.  Both sides compute in the block's dtype and differ only by the
  order of additions in row sums and by the GPU's approximate division and square roots.
* bfloat16 and float16 results: both sides widen the same 16-bit inputs to float32, compute in float32 and
  round once, so they differ only where a float32 result a few float32 ulps apart lands on the other side
  of a 16-bit rounding boundary: one unit in the last place of the 16-bit result.  Two units of the
  largest magnitude (2·2^-8 for bfloat16, 2·2^-11 for float16) bound it with margin.  A 16-bit operator's
  unaggregated partials are kept in float32 and are compared at the float32 tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from relational_tensors.machine.devices import visible_gpus

GPU = visible_gpus() > 0
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels run on CPU, in Python

pytest.importorskip("triton")

import relational_tensors as rt  # noqa: E402
from relational_tensors.core.dtypes import itemsize, numpy_dtype  # noqa: E402
from relational_tensors.core.types import TensorType  # noqa: E402
from relational_tensors.kernels.common import DevBuf  # noqa: E402
from relational_tensors.kernels.launchers import allocates, launcher_for, op_constants, scratch_shape  # noqa: E402
from relational_tensors.sql_specs import OPERATORS  # noqa: E402

KINDS = ("norm_grad", "norm_weight_grad", "swiglu_grad", "softmax_grad", "unary_grad", "binary_grad",
         "embedding_grad", "cross_entropy", "cross_entropy_grad", "token_count", "rope", "rope_table")
KERNEL_MODULES = ("triton_norms_grad", "triton_elementwise_grad", "triton_elementwise", "triton_cross_entropy",
                  "triton_embedding_grad",
                  "triton_rope", "triton_copy", "triton_norms")
TOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2 * 2.0**-8, "float16": 2 * 2.0**-11}


# ------------------------------------------------------------------ device memory for the kernels


class HostMemory:
    """CPU memory behind DevBuf pointers, for Triton's interpreter: ``ptr`` stands in for the kernels'
    ``Ptr`` and hands the interpreter a torch view that starts at the pointer."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.blocks: list[Any] = []  # uint8 tensors

    def alloc(self, nbytes: int) -> int:
        t = self.torch.empty(max(nbytes, 8), dtype=self.torch.uint8)
        self.blocks.append(t)
        return int(t.data_ptr())

    def _find(self, addr: int) -> tuple[Any, int]:
        for t in self.blocks:
            base = t.data_ptr()
            if base <= addr <= base + t.numel():
                return t, addr - base
        raise AssertionError(f"pointer {addr:#x} lies in no block")

    def write(self, addr: int, data: np.ndarray) -> None:
        t, off = self._find(addr)
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        t[off:off + raw.size] = self.torch.from_numpy(raw.copy())

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        t, off = self._find(addr)
        return t[off:off + nbytes].numpy().copy()

    def ptr(self, buf: DevBuf | int, dtype: str | None = None) -> Any:
        torch = self.torch
        addr, name = (buf.ptr, dtype or buf.dtype) if isinstance(buf, DevBuf) else (int(buf), dtype or "float32")
        kinds = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64, "bool": torch.int8,
                 "int8": torch.int8}
        t, off = self._find(addr)
        size = itemsize("int8" if name == "bool" else name)
        n = (t.numel() - off) // size
        return t[off:off + n * size].view(kinds[name])

    def sync(self) -> None:
        pass


class CupyMemory:
    """GPU memory through CuPy; the kernels take the real ``Ptr``."""

    def __init__(self) -> None:
        import cupy

        from relational_tensors.kernels.common import bind_triton_to_cupy

        bind_triton_to_cupy()
        self.cupy = cupy
        self.blocks: list[Any] = []

    def alloc(self, nbytes: int) -> int:
        a = self.cupy.empty(max(nbytes, 8), dtype=self.cupy.uint8)
        self.blocks.append(a)
        return int(a.data.ptr)

    def write(self, addr: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        mem = self.cupy.cuda.UnownedMemory(addr, max(raw.size, 1), None, 0)
        self.cupy.ndarray(raw.shape, self.cupy.uint8, self.cupy.cuda.MemoryPointer(mem, 0)).set(raw)

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        self.sync()
        mem = self.cupy.cuda.UnownedMemory(addr, max(nbytes, 1), None, 0)
        return self.cupy.asnumpy(self.cupy.ndarray((nbytes,), self.cupy.uint8, self.cupy.cuda.MemoryPointer(mem, 0)))

    ptr = None

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


@pytest.fixture
def mem(monkeypatch: pytest.MonkeyPatch) -> Any:
    if GPU:
        return CupyMemory()
    pytest.importorskip("torch")
    host = HostMemory()
    import importlib

    for name in KERNEL_MODULES:
        module = importlib.import_module(f"relational_tensors.kernels.{name}")
        monkeypatch.setattr(module, "Ptr", host.ptr)
    return host


def put(mem: Any, value: np.ndarray, dtype: str) -> DevBuf:
    value = np.ascontiguousarray(np.asarray(value).astype(numpy_dtype(dtype)))
    buf = DevBuf(mem.alloc(value.nbytes), value.shape, dtype, 0)
    mem.write(buf.ptr, value)
    return buf


def empty(mem: Any, shape: tuple[int, ...], dtype: str) -> DevBuf:
    """A block filled with NaN (a pattern for integers), so an element a kernel leaves unwritten shows."""
    fill = np.full(shape, np.nan if dtype.startswith(("float", "bfloat")) else -7777).astype(numpy_dtype(dtype))
    return put(mem, fill, dtype)


def get(mem: Any, buf: DevBuf) -> np.ndarray:
    raw = mem.read(buf.ptr, buf.nbytes)
    return raw.view(numpy_dtype(buf.dtype)).reshape(buf.shape)


# ------------------------------------------------------------------ one function spec: launcher against kernel


def launch(mem: Any, op: Any, f: Any, blocks: list[np.ndarray], out_dtype: str) -> np.ndarray:
    """Run the kind's launcher on device copies of ``blocks`` into a block of ``out_dtype``."""
    ins = [put(mem, b, t.dtype) for b, t in zip(blocks, op.input_types)]
    out = empty(mem, f.output.shape, out_dtype)
    consts: dict[str, Any] = {name: put(mem, v, str(v.dtype)) for name, v in op_constants(op).items()}
    need = scratch_shape(op, f)
    if need is not None:
        consts["scratch"] = empty(mem, *need)
    launcher_for(op.kind).launch(op, f, ins, out, consts, 0)
    mem.sync()
    return get(mem, out)


def expected(op: Any, f: Any, blocks: list[np.ndarray], out_dtype: str) -> np.ndarray:
    if out_dtype == op.output_type.dtype:
        return np.asarray(op.kernel(blocks, f))
    return np.asarray(op.partial_kernel(blocks, f, out_dtype))


def check_block(got: np.ndarray, want: np.ndarray, dtype: str, what: str, tol: float | None = None,
                terms: float | None = None) -> None:
    """``got`` against ``want`` within ``tol`` (default: the dtype's) of the largest magnitude of ``want``, or
    of ``terms`` where given: the largest term of a difference that can cancel (rounding errors scale with
    the terms, not with what is left of them)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN where the reference has none (or none)"
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{what}: infinities differ"
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), terms or 0.0, 1e-30)
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)) / scale
    assert err <= (tol or TOL[dtype]), f"{what}: error {err:.2e} of the largest magnitude {scale:.3g} ({dtype})"


def check_op(mem: Any, op: Any, values: list[np.ndarray], request: dict[str, int] | None = None,
             partial_too: bool = True, tol: float | None = None, terms: float | None = None) -> int:
    """Every function spec of ``op``'s spec for ``request`` (index -> interval count, near-equal, so uneven
    where the extents do not divide): the launcher's block against the NumPy kernel's.  A 16-bit operator
    whose blocks are ⊕-summed partials is also checked with a float32 output block, as plans keep them."""
    # the values as the operator's input dtypes hold them (NumPy's promotion of a 16-bit array with a Python
    # float differs between versions), so the reference reads what the device reads
    values = [np.asarray(v).astype(numpy_dtype(t.dtype)) for v, t in zip(values, op.input_types)]
    by_name = {s.name: s for s in op.requestable()}
    lists = {name: by_name[name].near_equal(n) for name, n in (request or {}).items()}
    spec = op.spec(lists)
    outputs = [f.output for f in spec.functions]
    aggregated = len(set(outputs)) < len(outputs)
    dtype = op.output_type.dtype
    for f in spec.functions:
        blocks = [np.ascontiguousarray(v[box.slices()]) for v, box in zip(values, f.inputs)]
        out_dtypes = [dtype]
        if partial_too and aggregated and dtype in ("bfloat16", "float16"):
            out_dtypes.append("float32")
        for out_dtype in out_dtypes:
            got = launch(mem, op, f, blocks, out_dtype)
            check_block(got, expected(op, f, blocks, out_dtype), out_dtype, f"{op.kind} {f} -> {out_dtype}", tol,
                        terms)
    return len(spec.functions)


def make(kind: str, types: list[TensorType], **params: Any) -> Any:
    return OPERATORS[kind](tuple(types), **params)  # type: ignore[call-arg]


def randn(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(numpy_dtype(dtype))


T = TensorType.zero
FLOATS = ["float32", "float64", "bfloat16", "float16"]


# ------------------------------------------------------------------ the operators, one by one


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_grad(mem: Any, norm: str, dtype: str) -> None:
    rng = np.random.default_rng(1)
    shape = (3, 7, 37)
    x, w, dy = randn(rng, shape, dtype, 2.0) + 0.5, randn(rng, (37,), dtype), randn(rng, shape, dtype)
    op = make("norm_grad", [T(shape, dtype), T((37,), dtype), T(shape, dtype)], norm=norm, eps=1e-5)
    assert check_op(mem, op, [x, w, dy], {"d0": 2, "d1": 3}) == 6


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_grad_rows_longer_than_a_block(mem: Any, monkeypatch: pytest.MonkeyPatch, norm: str) -> None:
    from relational_tensors.kernels import triton_norms_grad as tng

    monkeypatch.setattr(tng, "_block", lambda d: 16)  # the multi-pass form, with rows of 3 tiles and a rest
    rng = np.random.default_rng(2)
    shape = (5, 41)
    op = make("norm_grad", [T(shape), T((41,)), T(shape)], norm=norm, eps=1e-6)
    check_op(mem, op, [randn(rng, shape, "float32", 3.0), randn(rng, (41,), "float32"), randn(rng, shape, "float32")],
             {"d0": 2})


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_weight_grad_partials_of_row_blocks(mem: Any, norm: str, dtype: str) -> None:
    # 75 rows in 2 blocks of 38 and 37: each block sums 2 chunks of 32 rows and a rest, chunk by chunk
    rng = np.random.default_rng(3)
    shape = (75, 70)
    x, dy = randn(rng, shape, dtype, 2.0) + 1.0, randn(rng, shape, dtype)
    op = make("norm_weight_grad", [T(shape, dtype), T(shape, dtype)], norm=norm, eps=1e-5)
    assert check_op(mem, op, [x, dy], {"d0": 2}) == 2


def test_norm_weight_grad_is_the_same_bits_every_run(mem: Any) -> None:
    rng = np.random.default_rng(4)
    shape = (2, 45, 24)
    op = make("norm_weight_grad", [T(shape), T(shape)], norm="layer", eps=1e-5)
    f = op.spec({}).functions[0]
    blocks = [randn(rng, shape, "float32"), randn(rng, shape, "float32")]
    first = launch(mem, op, f, blocks, "float32")
    assert np.array_equal(first.view(np.uint32), launch(mem, op, f, blocks, "float32").view(np.uint32))
    check_block(first, op.kernel(blocks, f), "float32", "norm_weight_grad")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_grad(mem: Any, axis: int, dtype: str) -> None:
    rng = np.random.default_rng(5)
    shape = (5, 6, 19)
    z = rng.standard_normal(shape)
    y = np.exp(z) / np.exp(z).sum(axis=axis, keepdims=True)
    op = make("softmax_grad", [T(shape, dtype), T(shape, dtype)], axis=axis)
    request = {n: 2 for n in ("d0", "d1", "d2") if n in {s.name for s in op.requestable()}}
    check_op(mem, op, [y.astype(numpy_dtype(dtype)), randn(rng, shape, dtype)], request)


def test_softmax_grad_lines_longer_than_a_block(mem: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from relational_tensors.kernels import triton_norms_grad as tng

    monkeypatch.setattr(tng, "_block", lambda d: 16)
    rng = np.random.default_rng(6)
    op = make("softmax_grad", [T((3, 50)), T((3, 50))], axis=-1)
    check_op(mem, op, [rng.random((3, 50)).astype(np.float32), randn(rng, (3, 50), "float32")])


UNARY_CASES = [("relu", 0.0), ("gelu", 0.0), ("gelu_tanh", 0.0), ("silu", 0.0), ("sigmoid", 0.0), ("tanh", 0.0),
               ("exp", 0.0), ("log", 0.0), ("abs", 0.0), ("sqrt", 0.0), ("rsqrt", 0.0), ("square", 0.0),
               ("pow", 3.0), ("pow", 2.0), ("pow", 0.5), ("pow", -1.5), ("pow", 1.0), ("log1p", 0.0), ("expm1", 0.0),
               ("erf", 0.0), ("sin", 0.0), ("cos", 0.0)]


# 0 ** e goes through log(0) = -inf, which NumPy (running the interpreted kernels) warns about
ZERO_POWERS = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning",
                                         "ignore:invalid value encountered in multiply:RuntimeWarning")


@ZERO_POWERS
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op_name,arg", UNARY_CASES)
def test_unary_grad(mem: Any, op_name: str, arg: float, dtype: str) -> None:
    rng = np.random.default_rng(7)
    shape = (9, 13)
    x = rng.standard_normal(shape) * 2
    if op_name in ("log", "sqrt", "rsqrt", "log1p") or (op_name == "pow" and arg != int(arg)):
        x = np.abs(x) + 0.25  # the domain
    if op_name in ("relu", "abs", "gelu", "silu", "square") or (op_name == "pow" and arg >= 1):
        x[0, :3] = 0.0  # where relu and abs take torch's derivative 0, and 0 ** 0 = 1
    op = make("unary_grad", [T(shape, dtype), T(shape, dtype)], op=op_name, arg=arg)
    check_op(mem, op, [x.astype(numpy_dtype(dtype)), randn(rng, shape, dtype)], {"d0": 2, "d1": 3})


@ZERO_POWERS
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op_name", ["log1p", "expm1", "erf", "sin", "cos", "floor", "detach"])
def test_unary_forward_of_the_functions_torch_decompositions_reach(mem: Any, op_name: str, dtype: str) -> None:
    """The forward kernels of the unary functions added for decomposed operations (softplus -> log1p) and
    training (detach, stochastic depth's floor), small and large arguments both (log1p and expm1 switch
    formulas at |x| = 1)."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((9, 13)) * 2
    x[0, :4] = [1e-7, -1e-6, 0.0, 3.5]
    if op_name == "log1p":
        x = np.abs(x) - 0.5  # above -1
    op = make("unary", [T(x.shape, dtype)], op=op_name)
    check_op(mem, op, [x.astype(numpy_dtype(dtype))], {"d0": 2, "d1": 3})


def test_unary_grad_of_pow_with_negative_bases_and_float64_exponents(mem: Any) -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 10))
    x[0, 0] = 0.0
    for arg, dtype in ((4.0, "float32"), (3.0, "float64"), (1.0 / 3.0, "float64"), (2.5, "float32")):
        op = make("unary_grad", [T((4, 10), dtype), T((4, 10), dtype)], op="pow", arg=arg)
        base = np.abs(x) + 0.5 if arg != int(arg) else x  # NumPy gives NaN for a negative base otherwise
        check_op(mem, op, [base.astype(numpy_dtype(dtype)), randn(rng, (4, 10), dtype)])


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("op_name", ["mul", "div", "maximum", "minimum"])
@pytest.mark.parametrize("wrt", [0, 1])
def test_binary_grad_with_broadcast_operands(mem: Any, op_name: str, wrt: int, dtype: str) -> None:
    rng = np.random.default_rng(9)
    for xs, ys in (((4, 1, 9), (5, 9)), ((7,), (3, 5, 7)), ((2, 3, 4), (2, 3, 4))):
        out = np.broadcast_shapes(xs, ys)
        x = rng.integers(-3, 4, xs).astype(np.float64) if op_name in ("maximum", "minimum") else rng.standard_normal(xs)
        y = rng.integers(-3, 4, ys).astype(np.float64) if op_name in ("maximum", "minimum") else \
            rng.standard_normal(ys) + np.sign(rng.standard_normal(ys)) * 0.5  # ties in max/min; no y near 0
        op = make("binary_grad", [T(xs, dtype), T(ys, dtype), T(out, dtype)], op=op_name, wrt=wrt)
        request = {s.name: 2 for s in op.requestable()[:2]}
        check_op(mem, op, [x.astype(numpy_dtype(dtype)), y.astype(numpy_dtype(dtype)), randn(rng, out, dtype)],
                 request)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wrt", [0, 1])
def test_swiglu_grad(mem: Any, wrt: int, dtype: str) -> None:
    rng = np.random.default_rng(10)
    shape = (6, 23)
    op = make("swiglu_grad", [T(shape, dtype)] * 3, wrt=wrt)
    check_op(mem, op, [randn(rng, shape, dtype, 2.0) for _ in range(3)], {"d0": 3, "d1": 2})


def _ids(rng: np.random.Generator, shape: tuple[int, ...], vocab: int, dtype: str) -> np.ndarray:
    ids = rng.integers(0, vocab, shape)
    ids.reshape(-1)[: ids.size // 3] = vocab // 2  # a frequent id: long runs
    return ids.astype(dtype)


@pytest.mark.parametrize("ids_dtype,dtype,request_", [
    ("int64", "float32", {"t1": 2, "vocab": 3, "embed": 2}), ("int32", "float64", {"t0": 2, "vocab": 2}),
    ("int32", "bfloat16", {"t1": 2, "vocab": 2}), ("int64", "float16", {"t0": 3})])
def test_embedding_grad_blocks_of_tokens_vocabulary_and_width(mem: Any, ids_dtype: str, dtype: str,
                                                              request_: dict[str, int]) -> None:
    rng = np.random.default_rng(11)
    ids, vocab = _ids(rng, (3, 17), 29, ids_dtype), 29
    op = make("embedding_grad", [T((3, 17), ids_dtype), T((3, 17, 10), dtype)], vocab=vocab)
    # tokens split (⊕ sum of partial tables), the vocabulary split (each block adds the ids it holds), the width
    check_op(mem, op, [ids, randn(rng, (3, 17, 10), dtype)], request_)


def test_embedding_grad_merges_sorted_runs_and_is_the_same_bits_every_run(mem: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from relational_tensors.kernels import triton_embedding_grad as teg

    monkeypatch.setattr(teg, "SORT_BLOCK", 8)  # 37 ids pad to 64 keys: runs of 8 merged three times
    rng = np.random.default_rng(12)
    ids = _ids(rng, (37,), 40, "int64")
    op = make("embedding_grad", [T((37,), "int64"), T((37, 7))], vocab=40)
    vocab = next(s for s in op.requestable() if s.name == "vocab")
    f = op.spec({"vocab": vocab.near_equal(2)}).functions[1]  # rows 20..39: ids below 20 are not this block's
    blocks = [ids, randn(rng, (37, 7), "float32")]
    first = launch(mem, op, f, blocks, "float32")
    check_block(first, op.kernel(blocks, f), "float32", "embedding_grad")
    assert np.array_equal(first.view(np.uint32), launch(mem, op, f, blocks, "float32").view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_embedding_grad_sums_long_runs_in_pieces_and_is_the_same_bits_every_run(
        mem: Any, monkeypatch: pytest.MonkeyPatch, dtype: str, chunk: int) -> None:
    """A small vocabulary over many tokens (T5's relative-position buckets): each id's run of keys summed in
    pieces of ``RUN_CHUNK`` keys, the pieces of runs that cross a chunk's end added by a second pass; runs
    that start on a chunk's first key, inside it, span several chunks or end on a chunk's last key; a block
    of the vocabulary; the same bits twice."""
    from relational_tensors.kernels import scratch
    from relational_tensors.kernels import triton_embedding_grad as teg

    monkeypatch.setattr(scratch, "RUN_CHUNK", chunk)
    monkeypatch.setattr(teg, "SORT_BLOCK", 16)
    rng = np.random.default_rng(21 + chunk)
    ids = np.sort(rng.integers(0, 5, 83))[::-1].copy()  # long runs, unsorted order
    rng.shuffle(ids[:40])
    ids[::11] = 6
    op = make("embedding_grad", [T((83,), "int64"), T((83, 9), dtype)], vocab=7)
    blocks = [ids, randn(rng, (83, 9), dtype)]
    whole = op.spec({}).functions[0]
    first = launch(mem, op, whole, blocks, dtype)
    check_block(first, op.kernel(blocks, whole), dtype, "embedding_grad")
    again = launch(mem, op, whole, blocks, dtype)
    assert np.array_equal(np.ascontiguousarray(first).view(np.uint8), np.ascontiguousarray(again).view(np.uint8))
    vocab = next(s for s in op.requestable() if s.name == "vocab")
    for f in op.spec({"vocab": vocab.near_equal(2)}).functions:  # rows 0..3 and 4..6
        check_block(launch(mem, op, f, blocks, dtype), op.kernel(blocks, f), dtype, "embedding_grad")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("ignore_index", [None, 4, -100])
def test_cross_entropy_loss_partials_of_vocabulary_blocks(mem: Any, ignore_index: int | None, dtype: str) -> None:
    rng = np.random.default_rng(13)
    tokens, vocab = (2, 11), 37
    targets = rng.integers(0, vocab, tokens)
    if ignore_index is not None:
        targets[0, :4] = ignore_index
    logits = randn(rng, (*tokens, vocab), dtype, 2.0)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(numpy_dtype(dtype))
    op = make("cross_entropy", [T((*tokens, vocab), dtype), T(tokens, dtype), T(tokens, "int64")],
              ignore_index=ignore_index)
    check_op(mem, op, [logits, lse, targets], {"t1": 2, "vocab": 3})


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("ignore_index", [None, 5])
def test_cross_entropy_grad_blocks(mem: Any, monkeypatch: pytest.MonkeyPatch, ignore_index: int | None,
                                   dtype: str) -> None:
    from relational_tensors.kernels import triton_cross_entropy as tce

    monkeypatch.setattr(tce, "BLOCK_V", 16)  # several vocabulary tiles per row
    rng = np.random.default_rng(14)
    tokens, vocab = (3, 5), 61
    targets = rng.integers(0, vocab, tokens).astype(np.int32)
    if ignore_index is not None:
        targets[1, :2] = ignore_index
    logits = randn(rng, (*tokens, vocab), dtype, 2.0)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(numpy_dtype(dtype))
    op = make("cross_entropy_grad", [T((*tokens, vocab), dtype), T(tokens, dtype), T(tokens, "int32"),
                                     T(tokens, dtype)], ignore_index=ignore_index)
    check_op(mem, op, [logits, lse, targets, randn(rng, tokens, dtype)], {"t0": 2, "vocab": 3})


def test_cross_entropy_targets_out_of_range_give_nan(mem: Any) -> None:
    # the NumPy kernels refuse them with an error; a kernel marks them NaN instead of dropping them
    op = make("cross_entropy", [T((4, 6)), T((4,)), T((4,), "int64")], ignore_index=-1)
    f = op.spec({}).functions[0]
    got = launch(mem, op, f, [np.zeros((4, 6), np.float32), np.zeros(4, np.float32), np.array([0, 6, -1, -2])],
                 "float32")
    assert got[0] == 0.0 and np.isnan(got[1]) and got[2] == 0.0 and np.isnan(got[3])


@pytest.mark.parametrize("ignore_index", [None, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_count(mem: Any, ignore_index: int | None, dtype: str) -> None:
    rng = np.random.default_rng(15)
    targets = rng.integers(0, 6, (4, 9))
    op = make("token_count", [T((4, 9), "int64")], ignore_index=ignore_index, dtype=dtype)
    check_op(mem, op, [targets], {"t0": 3, "t1": 2})


FEW = settings(max_examples=5, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FEW
@given(rows=st.integers(1, 40), d=st.integers(1, 40), parts=st.integers(1, 4), norm=st.sampled_from(["rms", "layer"]),
       seed=st.integers(0, 99))
@example(rows=1, d=1, parts=1, norm="rms", seed=0)  # x̂² ≈ 1: dx is what is left of a cancellation
def test_norm_gradients_over_random_shapes_and_row_splits(mem: Any, rows: int, d: int, parts: int, norm: str,
                                                          seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, w, dy = randn(rng, (rows, d), "float32", 2.0), randn(rng, (d,), "float32"), randn(rng, (rows, d), "float32")
    request = {"d0": min(parts, rows)}
    # dx = r·(w·dy - x̂·mean(w·dy·x̂)) (layernorm: also minus the mean of w·dy) cancels where x̂² ≈ 1 (d = 1,
    # say), and dw = Σ dy·x̂ over rows of both signs: float32 errors scale with the terms r·w·dy and |dy·x̂|
    x64 = x.astype(np.float64)
    c = x64 - x64.mean(-1, keepdims=True) if norm == "layer" else x64
    r = 1.0 / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)
    dx_terms = float(np.max(np.abs(r * w * dy), initial=0.0))
    dw_terms = float(np.max(np.abs(dy * c * r).sum(0), initial=0.0))
    check_op(mem, make("norm_grad", [T((rows, d)), T((d,)), T((rows, d))], norm=norm, eps=1e-5), [x, w, dy], request,
             terms=dx_terms)
    check_op(mem, make("norm_weight_grad", [T((rows, d)), T((rows, d))], norm=norm, eps=1e-5), [x, dy], request,
             terms=dw_terms)


@FEW
@given(tokens=st.integers(1, 24), vocab=st.integers(1, 30), t_parts=st.integers(1, 3), v_parts=st.integers(1, 4),
       seed=st.integers(0, 99))
def test_vocabulary_blocks_over_random_shapes_and_splits(mem: Any, tokens: int, vocab: int, t_parts: int,
                                                         v_parts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    request = {"t0": min(t_parts, tokens), "vocab": min(v_parts, vocab)}
    targets = rng.integers(0, vocab, tokens)
    logits = randn(rng, (tokens, vocab), "float32", 2.0)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(np.float32)
    ce = [T((tokens, vocab)), T((tokens,)), T((tokens,), "int64")]
    check_op(mem, make("cross_entropy", ce), [logits, lse, targets], request)
    check_op(mem, make("cross_entropy_grad", [*ce, T((tokens,))]), [logits, lse, targets, randn(rng, (tokens,),
                                                                                                 "float32")], request)
    emb = make("embedding_grad", [T((tokens,), "int64"), T((tokens, 5))], vocab=vocab)
    check_op(mem, emb, [targets, randn(rng, (tokens, 5), "float32")], request)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("seq_ends", [None, (3, 10, 13)])
@pytest.mark.parametrize("inverse", [True, False])
def test_rope_and_its_inverse(mem: Any, inverse: bool, seq_ends: tuple[int, ...] | None, dtype: str) -> None:
    rng = np.random.default_rng(16)
    shape = (2, 13, 3, 8)
    op = make("rope", [T(shape, dtype)], base=100.0, seq_ends=seq_ends, inverse=inverse)
    # the rotation's angles are float32 on the device (float64 positions reduced to [0, 2π) first)
    check_op(mem, op, [randn(rng, shape, dtype)], {"d1": 3, "d2": 2}, tol=1e-6 if dtype == "float64" else None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shared", ["both", "cos", "sin", "neither"])  # which tables are [1, s, d], not [b, s, d]
@pytest.mark.parametrize("inverse", [True, False])
def test_rope_by_tables_and_its_transpose(mem: Any, inverse: bool, shared: str, dtype: str) -> None:
    rng = np.random.default_rng(17)
    shape = (3, 11, 5, 8)
    cos, sin = ((1 if shared in ("both", which) else 3, 11, 8) for which in ("cos", "sin"))
    op = make("rope_table", [T(shape, dtype), T(cos, dtype), T(sin, dtype)], inverse=inverse)
    # tables that are not a rotation's (cos² + sin² ≠ 1, halves unequal): each of the four halves is read
    check_op(mem, op, [randn(rng, shape, dtype), randn(rng, cos, dtype), randn(rng, sin, dtype)],
             {"d0": 2, "d1": 3, "d2": 2})


# ------------------------------------------------------------------ function specs of compiled training graphs


def training_graph(dtype: str = "float32") -> rt.Graph:
    """Token ids through an embedding, RMSNorm, RoPE over packed sequences and by learned tables, SwiGLU, GELU,
    a broadcast divide and maximum, LayerNorm, a softmax and a matmul to cross-entropy logits, and the gradient of every
    parameter: each kind these kernels serve appears in the gradient."""
    g = rt.Graph()
    ids = g.input("ids", [2, 9], "int64")
    targets = g.input("targets", [2, 9], "int64")
    table = g.parameter("table", [23, 16], dtype)
    x = g.embedding(table, ids)
    h = g.rmsnorm(x, g.parameter("w_rms", [16], dtype))
    h = g.rope(g.reshape(h, [2, 9, 2, 8]), base=50.0, seq_ends=(4, 9))
    cos, sin = g.parameter("cos", [1, 9, 8], dtype), g.parameter("sin", [1, 9, 8], dtype)
    h = g.reshape(g.rope_table(h, cos, sin), [2, 9, 16])
    s = g.swiglu(g.matmul(h, g.parameter("wa", [16, 12], dtype)), g.matmul(h, g.parameter("wb", [16, 12], dtype)))
    s = g.unary(s, "gelu")
    s = g.div(s, g.parameter("scale", [12], dtype))
    s = g.binary(s, g.parameter("floor", [1, 12], dtype), "maximum")
    s = g.layernorm(s, g.parameter("w_ln", [12], dtype), g.parameter("b_ln", [12], dtype))
    s = g.softmax(s, axis=-1)
    logits = g.matmul(s, g.parameter("head", [12, 23], dtype))
    loss = g.save(g.cross_entropy(logits, targets, ignore_index=3), name="loss")
    params = g.trainable()
    for p, d in zip(params, g.grad(loss, params)):
        g.save(d, name=f"grad.{p.name}")
    return g


def vjp_graph(dtype: str = "float32") -> rt.Graph:
    """The same chain without matmuls and the mean (their gradients run through CuPy, which allocates): per-token
    losses, and the gradients of the parameters for a given ``dloss``; every operator runs on device kernels
    that do not allocate, so the program is captured in a CUDA graph."""
    g = rt.Graph()
    ids = g.input("ids", [2, 9], "int64")
    targets = g.input("targets", [2, 9], "int64")
    x = g.embedding(g.parameter("table", [23, 16], dtype), ids)
    h = g.rmsnorm(x, g.parameter("w_rms", [16], dtype))
    h = g.rope(g.reshape(h, [2, 9, 2, 8]), base=50.0, seq_ends=(4, 9))
    h = g.reshape(g.rope_table(h, g.input("cos", [2, 9, 8], dtype), g.input("sin", [2, 9, 8], dtype)), [2, 9, 16])
    s = g.swiglu(g.mul(h, g.parameter("wa", [16], dtype)), g.mul(h, g.parameter("wb", [16], dtype)))
    s = g.unary(s, "gelu")
    s = g.div(s, g.parameter("scale", [16], dtype))
    s = g.binary(s, g.parameter("floor", [1, 16], dtype), "maximum")
    s = g.layernorm(s, g.parameter("w_ln", [16], dtype), g.parameter("b_ln", [16], dtype))
    loss = g.save(g.cross_entropy(g.softmax(s, axis=-1), targets, ignore_index=3, reduction="none"), name="loss")
    params = g.trainable()
    for p, d in zip(params, g.vjp(loss, g.input("dloss", [2, 9], dtype), params)):
        g.save(d, name=f"grad.{p.name}")
    return g


def training_feeds(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    classes = g.nodes[next(c for c in g.operators if c.kind == "cross_entropy").inputs[0]].type.shape[-1]
    for n in g.inputs:
        if n.type.dtype == "int64":
            feeds[n.name] = rng.integers(0, 23 if n.name == "ids" else classes, n.type.shape)
        else:
            feeds[n.name] = rng.standard_normal(n.type.shape).astype(numpy_dtype(n.type.dtype))
    feeds["scale"] = (np.abs(feeds["scale"].astype(np.float64)) + 0.5).astype(feeds["scale"].dtype)
    feeds["targets"].reshape(-1)[::5] = 3  # ignored
    return feeds


def recorded_kernel_calls(monkeypatch: pytest.MonkeyPatch, g: rt.Graph, feeds: dict, p: int,
                          **options: Any) -> list[tuple[Any, Any, list[np.ndarray], str, np.ndarray]]:
    """Compile ``g`` for ``cpu:p`` and run it, recording each kernel task of the kinds served here: (operator,
    function spec, input blocks, output dtype, the NumPy kernel's output)."""
    from relational_tensors.runtime.numpy_backend import NumpyExecutor

    calls: list[tuple[Any, Any, list[np.ndarray], str, np.ndarray]] = []
    original: Callable[..., list[Any]] = NumpyExecutor._run

    def recording(self: Any, task: Any, ins: list[Any]) -> list[Any]:
        out = original(self, task, ins)
        if task.kind == "kernel":
            node = self.dag.nodes[task.op]
            if node.kind in KINDS:
                calls.append((node.op, task.kernel.function, [np.array(a, copy=True) for a in ins],
                              self.dag.buffers[task.outputs[0]].dtype, np.array(out[0], copy=True)))
        return out

    monkeypatch.setattr(NumpyExecutor, "_run", recording)
    rt.compileGraph(g, device=f"cpu:{p}", **options).run(feeds)
    monkeypatch.setattr(NumpyExecutor, "_run", original)
    return calls


def replay(mem: Any, calls: list) -> set[str]:
    for op, f, blocks, out_dtype, want in calls:
        got = launch(mem, op, f, blocks, out_dtype)
        check_block(got, want, out_dtype, f"{op.kind} {op.params()} {f} -> {out_dtype}")
    return {op.kind for op, *_ in calls}


@pytest.mark.parametrize("build,p", [(training_graph, 2), (training_graph, 3), (vjp_graph, 3)])
def test_the_function_specs_of_a_compiled_training_graph(mem: Any, monkeypatch: pytest.MonkeyPatch,
                                                         build: Callable[[], rt.Graph], p: int) -> None:
    g = build()
    kinds = replay(mem, recorded_kernel_calls(monkeypatch, g, training_feeds(g), p))
    assert kinds >= set(KINDS) - ({"token_count"} if build is vjp_graph else set()), kinds


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("p", [4, 5])
def test_the_function_specs_of_a_compiled_training_graph_on_more_devices(mem: Any, monkeypatch: pytest.MonkeyPatch,
                                                                         p: int, dtype: str) -> None:
    g = training_graph(dtype)
    replay(mem, recorded_kernel_calls(monkeypatch, g, training_feeds(g, seed=p), p))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["softmax_axis0", "unary_gelu", "binary_div",
                                  "cross_entropy_tokens_ignore", "cross_entropy_mean", "embedding", "layernorm",
                                  "rmsnorm", "rope_packed", "swiglu", "mse"])
def test_the_function_specs_of_the_gradient_cases(mem: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    from cases import GRAD_CASES, feeds_for

    g, _ = GRAD_CASES[case]("float32")
    assert replay(mem, recorded_kernel_calls(monkeypatch, g, feeds_for(g, seed=4), 4))


# ------------------------------------------------------------------ the CuPy executor on a GPU


def _relative(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= tol, f"{what}: error {err:.2e} of the largest magnitude"


def on_gpu(test: Callable[..., None]) -> Any:
    """Marked ``gpu``, skipped where no GPU is visible."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="no CUDA GPU visible (or CuPy not installed)")(test))


# 16-bit plans against the 16-bit reference through a dozen operators, each rounding its output to 16 bits
GRAPH_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_training_graph_gradients_on_gpu(device: str, dtype: str) -> None:
    g = training_graph(dtype)
    assert not any(allocates(n.op) for n in g.operators if n.kind in KINDS)
    feeds = training_feeds(g)
    want = rt.reference(g, feeds)
    cg = rt.compileGraph(g, device=device)
    first = cg.run(feeds)
    for name in g.outputs:
        _relative(first[name], want[name], GRAPH_TOL[dtype], f"{device} {dtype} {name}")
    again = cg.run(feeds)
    for name in g.outputs:  # no float atomics: the same bits on every run
        assert np.array_equal(np.asarray(again[name]).view(np.uint8), np.asarray(first[name]).view(np.uint8)), name


@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_gradients_are_captured_in_a_cuda_graph_and_replay_the_same_bits(device: str, dtype: str) -> None:
    g = vjp_graph(dtype)
    feeds = training_feeds(g)
    want = rt.reference(g, feeds)
    cg = rt.compileGraph(g, device=device)
    assert cg.executor.capturable, "an operator of the gradient still allocates on the GPU"
    cg.load(feeds)
    cg.execute()  # eager
    first = {name: cg.offload(name) for name in g.outputs}
    for name in g.outputs:
        _relative(first[name], want[name], GRAPH_TOL[dtype], f"{device} {dtype} {name}")
    for _ in range(3):
        cg.execute()  # the second run is captured into a CUDA graph, the later ones replay it
    assert cg.executor.graph_exec is not None
    for name in g.outputs:
        assert np.array_equal(cg.offload(name).view(np.uint8), first[name].view(np.uint8)), name


@on_gpu
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_llama_training_graph_gradients_on_gpu(device: str) -> None:
    from relational_tensors.graph.models import llama_training_feeds, llama_training_graph

    g = llama_training_graph(1, 29, 32, 4, 2, 40, 53, seq_ends=(7, 20, 29), ignore_index=5)
    feeds = llama_training_feeds(g)
    want = rt.reference(g, feeds)
    got = rt.compileGraph(g, device=device).run(feeds)
    for name in g.outputs:
        _relative(got[name], want[name], 1e-4, f"{device} {name}")



@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("how", ["sum", "mean", "max", "logsumexp"])
@pytest.mark.parametrize("axes", [(0, 1, 2), (1, 2), (0, 2)])
def test_a_reduction_of_few_long_rows_is_chunked(mem: Any, monkeypatch: pytest.MonkeyPatch, how: str,
                                                 axes: tuple[int, ...], dtype: str) -> None:
    """A loss's mean over a whole tensor: the rows are cut into chunks whose partials a second pass combines
    (thresholds lowered so that small tensors take that path, with a short last chunk), axes moved last first
    where they are not; every function spec of a split against the NumPy kernel."""
    from relational_tensors.kernels import scratch as sizes

    monkeypatch.setattr(sizes, "SPLIT_LENGTH", 64)
    monkeypatch.setattr(sizes, "CHUNK_MIN", 16)
    rng = np.random.default_rng(3)
    shape = (3, 29, 11)
    op = make("reduce", [T(shape, dtype)], op=how, axes=axes)
    requests = [{}, {op.requestable()[0].name: 2}]
    for request in requests:
        check_op(mem, op, [randn(rng, shape, dtype, 2.0)], request, tol=1e-12 if dtype == "float64" else 1e-5
                 if dtype == "float32" else None)
    assert sizes.reduce_chunks(1, 29 * 11 * 3) > 1


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("how", ["sum", "mean", "max", "min", "logsumexp"])
@pytest.mark.parametrize(("shape", "axes"), [((5, 2, 37), (1,)), ((3, 4, 6, 9), (1, 2)), ((7, 3, 5), (0,))])
def test_a_reduction_over_middle_axes_reads_them_in_place(mem: Any, shape: tuple[int, ...], axes: tuple[int, ...],
                                                          how: str, dtype: str) -> None:
    """A reduction over a run of axes that are not last (a MoE combine's sum over its k rows, a mean over
    batch): each program walks the reduced axes for a block of the kept ones, no copy with them moved last;
    every function spec of a split against the NumPy kernel."""
    from relational_tensors.kernels.launchers.norms import _in_place

    op = make("reduce", [T(shape, dtype)], op=how, axes=axes)
    assert _in_place(shape, axes) is not None and scratch_shape(op, op.spec({}).functions[0]) is None
    rng = np.random.default_rng(4)
    for request in [{}, {op.requestable()[0].name: 2}]:
        check_op(mem, op, [randn(rng, shape, dtype, 2.0)], request, tol=1e-12 if dtype == "float64" else 1e-5
                 if dtype == "float32" else None)


def test_a_long_middle_reduction_is_in_place_where_its_programs_fill_the_gpu(mem: Any) -> None:
    """Past the short extents, a middle reduction reads in place only where its programs fill the GPU."""
    from relational_tensors.kernels.launchers.norms import _in_place

    assert _in_place((4, 70, 3), (1,)) is None  # 4 programs: moved last and chunked instead
    op = make("reduce", [T((265, 65, 2), "float32")], op="sum", axes=(1,))
    assert _in_place((265, 65, 2), (1,)) == (265, 65, 2)
    check_op(mem, op, [randn(np.random.default_rng(5), (265, 65, 2), "float32", 2.0)], {}, tol=1e-5)

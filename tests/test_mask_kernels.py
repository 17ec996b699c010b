"""The Triton kernels of boolean masks against NumPy: comparisons (in the operands' own dtype, NaN
included), the logic of booleans, ``where`` and the casts to and from bool, with broadcasting.

Without a GPU the kernels run in Triton's interpreter on CPU.  Every result is exact (a comparison, a
selection or a cast to 0/1), so it must equal NumPy's bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_elementwise")
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool,
         "float16": torch.float16}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K)


def _buf(a: np.ndarray, dtype: str):
    return T.buf(torch.from_numpy(np.ascontiguousarray(a.astype(np.float32) if dtype == "bfloat16" else a))
                 .to(TORCH[dtype]).contiguous())


def _values(g: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool":
        return g.random(shape) < 0.5
    if dtype == "int64":
        return g.integers(-3, 3, shape)
    a = np.round(g.standard_normal(shape), 1)  # ties between the operands, and a NaN
    a.reshape(-1)[0] = np.nan
    return a.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else a.astype(dtype)


SHAPES = [((4, 5), (4, 5)), ((3, 1, 6), (1, 4, 6)), ((2, 3, 4, 5), (5,))]


# logic takes booleans; booleans compare only for equality
PAIRS = [(op, dtype) for op in K.MASK_CODES for dtype in ("float32", "bfloat16", "float16", "int64", "bool")
         if op.startswith("logical") == (dtype == "bool") or (dtype == "bool" and op in ("equal", "not_equal"))]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize(("op", "dtype"), PAIRS)
def test_comparisons_and_logic_match_numpy(op: str, dtype: str, shapes: tuple) -> None:
    g = np.random.default_rng(0)
    x, y = _values(g, shapes[0], dtype), _values(g, shapes[1], dtype)
    want = {"equal": np.equal, "not_equal": np.not_equal, "less": np.less, "less_equal": np.less_equal,
            "greater": np.greater, "greater_equal": np.greater_equal, "logical_and": np.logical_and,
            "logical_or": np.logical_or, "logical_xor": np.logical_xor}[op](x, y)
    xb, _ = _buf(x, dtype)
    yb, _ = _buf(y, dtype)
    ob, out = _buf(np.zeros(want.shape, dtype=bool), "bool")
    K.compare(xb, yb, ob, op)
    assert np.array_equal(out.cpu().numpy(), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_where_matches_numpy(dtype: str) -> None:
    g = np.random.default_rng(1)
    cond = g.random((3, 1, 6)) < 0.5
    x, y = _values(g, (1, 4, 6), dtype), _values(g, (3, 4, 1), dtype)
    want = np.where(cond, x, y)
    cb, _ = _buf(cond, "bool")
    xb, _ = _buf(x, dtype)
    yb, _ = _buf(y, dtype)
    ob, out = _buf(np.zeros(want.shape, dtype=want.dtype), dtype)
    K.where(cb, xb, yb, ob)
    np.testing.assert_array_equal(out.float().cpu().numpy() if dtype == "bfloat16" else out.cpu().numpy(), want)


@pytest.mark.parametrize("into", ["y", "x"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_where_writes_in_place_into_the_block_it_keeps(dtype: str, into: str) -> None:
    """A key/value cache taking a step's rows: out is the kept operand itself, and only the elements the
    other operand replaces are read and written (the kernel's in-place form), with the same result."""
    g = np.random.default_rng(3)
    cache = _values(g, (2, 9, 3, 4), dtype)
    write = np.zeros((1, 9, 1, 1), dtype=bool)
    write[0, 5] = True
    new = _values(g, (2, 1, 3, 4), dtype)
    cond = write if into == "y" else ~write
    want = np.where(cond, new, cache) if into == "y" else np.where(cond, cache, new)
    cb, _ = _buf(cond, "bool")
    kept, held = _buf(cache, dtype)
    nb, _ = _buf(new, dtype)
    K.where(cb, nb, kept, kept) if into == "y" else K.where(cb, kept, nb, kept)
    np.testing.assert_array_equal(held.float().cpu().numpy() if dtype == "bfloat16" else held.cpu().numpy(), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_casts_to_and_from_bool_and_logical_not(dtype: str) -> None:
    g = np.random.default_rng(2)
    x = _values(g, (7, 9), dtype)
    x.reshape(-1)[1:4] = 0
    xb, _ = _buf(x, dtype)
    ob, out = _buf(np.zeros(x.shape, dtype=bool), "bool")
    K.to_bool(xb, ob)
    assert np.array_equal(out.cpu().numpy(), x.astype(bool))
    nb, negated = _buf(np.zeros(x.shape, dtype=bool), "bool")
    K.logical_not(ob, nb)
    assert np.array_equal(negated.cpu().numpy(), ~x.astype(bool))
    back, values = _buf(np.zeros(x.shape, dtype=np.float32), "float32")
    K.unary(ob, back, "cast")
    assert np.array_equal(values.cpu().numpy(), x.astype(bool).astype(np.float32))

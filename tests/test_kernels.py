"""Every operator's concrete NumPy kernel, run on the whole tensor through ``rt.reference``,
against an independent plain-NumPy formula written here (never the package's kernels).

The ``naive_*`` functions are also the ground truth of test_llama.py and test_core.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.sql_specs.elementwise import UNARY_FUNCTIONS

TOL64 = dict(rtol=1e-10, atol=1e-12)


# --- independent formulas ---------------------------------------------------------------------

def naive_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


def naive_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * w


def naive_silu(x: np.ndarray) -> np.ndarray:
    return x * (1.0 / (1.0 + np.exp(-x)))


def packed_positions(length: int, seq_ends: Sequence[int] | None) -> np.ndarray:
    """Each token's position inside its own packed sequence (0 at every sequence start)."""
    if seq_ends is None:
        return np.arange(length)
    pos, start = [], 0
    for end in seq_ends:
        pos.extend(range(end - start))
        start = end
    assert len(pos) == length
    return np.array(pos)


def segment_ids(length: int, seq_ends: Sequence[int] | None) -> np.ndarray:
    """Which packed sequence each token belongs to."""
    if seq_ends is None:
        return np.zeros(length, dtype=int)
    seg, start = np.empty(length, dtype=int), 0
    for n, end in enumerate(seq_ends):
        seg[start:end] = n
        start = end
    return seg


def naive_rope(x: np.ndarray, base: float, seq_ends: Sequence[int] | None = None) -> np.ndarray:
    """Rotate-half RoPE of x[batch, seq, heads, d]: angle(pos, i) = pos * base**(-2i/d)."""
    _, s, _, d = x.shape
    half = d // 2
    pos = packed_positions(s, seq_ends).astype(np.float64)
    out = np.empty_like(x)
    for i in range(half):
        ang = pos * base ** (-2.0 * i / d)
        c, sn = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        x1, x2 = x[..., i], x[..., i + half]
        out[..., i] = x1 * c - x2 * sn
        out[..., i + half] = x2 * c + x1 * sn
    return out


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False,
                    seq_ends: Sequence[int] | None = None, scale: float | None = None) -> np.ndarray:
    """Full score matrix, kv heads repeated for GQA, masked, softmax, weighted sum."""
    _, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # q head h reads kv head h // group
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = np.einsum("bqhd,bkhd->bhqk", q, k_rep) * scale
    mask = np.ones((sq, skv), dtype=bool)
    if causal:
        mask &= np.arange(skv)[None, :] <= np.arange(sq)[:, None]
    if seq_ends is not None:
        mask &= segment_ids(sq, seq_ends)[:, None] == segment_ids(skv, seq_ends)[None, :]
    scores = np.where(mask, scores, -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", naive_softmax(scores, -1), v_rep)


# --- helpers ----------------------------------------------------------------------------------

def rand(rng: np.random.Generator, shape: Sequence[int], dtype: str = "float64", positive: bool = False) -> np.ndarray:
    a = rng.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.1
    return a.astype(rt.core.dtypes.numpy_dtype(dtype))


def run(build: Callable[[rt.Graph], rt.Tensor], feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Build a one-output graph and evaluate it with the single-device reference."""
    g = rt.Graph()
    g.save(build(g), name="out")
    return rt.reference(g, feeds)["out"]


def inp(g: rt.Graph, feeds: dict[str, np.ndarray], name: str) -> rt.Tensor:
    a = feeds[name]
    return g.input(name, a.shape, rt.core.dtypes.canonical_dtype(a.dtype))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --- contractions -----------------------------------------------------------------------------

@pytest.mark.parametrize("a_shape, b_shape", [
    ((7, 5), (5, 9)),           # 2-D
    ((3, 7, 5), (5, 9)),        # batched activations, 2-D weight
    ((2, 3, 7, 5), (5, 4)),     # two batch dimensions, 2-D weight
    ((3, 7, 5), (3, 5, 9)),     # batched both
    ((2, 3, 7, 5), (2, 3, 5, 4)),
])
def test_matmul(rng, a_shape, b_shape) -> None:
    f = {"a": rand(rng, a_shape), "b": rand(rng, b_shape)}
    got = run(lambda g: g.matmul(inp(g, f, "a"), inp(g, f, "b")), f)
    a, b = f["a"], f["b"]
    want = np.zeros((*a_shape[:-1], b_shape[-1]))
    for idx in np.ndindex(*a_shape[:-2]):  # one plain 2-D product per batch entry
        bb = b[idx] if b.ndim > 2 else b
        want[idx] = [[sum(a[idx][i, j] * bb[j, k] for j in range(a_shape[-1])) for k in range(b_shape[-1])]
                     for i in range(a_shape[-2])]
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, **TOL64)


def test_matmul_operator_spelling(rng) -> None:
    f = {"a": rand(rng, (4, 6)), "b": rand(rng, (6, 3))}
    got = run(lambda g: inp(g, f, "a") @ inp(g, f, "b"), f)
    np.testing.assert_allclose(got, f["a"].dot(f["b"]), **TOL64)


def test_einsum_three_operands(rng) -> None:
    f = {"a": rand(rng, (5, 6)), "b": rand(rng, (6, 7, 2)), "c": rand(rng, (7, 4))}
    got = run(lambda g: g.einsum("ij,jkb,kl->bil", inp(g, f, "a"), inp(g, f, "b"), inp(g, f, "c")), f)
    a, b, c = f["a"], f["b"], f["c"]
    want = np.zeros((2, 5, 4))
    for bi in range(2):
        want[bi] = a @ b[:, :, bi] @ c
    np.testing.assert_allclose(got, want, **TOL64)


def test_einsum_implicit_output_and_diagonal(rng) -> None:
    f = {"a": rand(rng, (6, 6)), "b": rand(rng, (6, 3))}
    # implicit output: the indices used once, sorted -> "k"
    got = run(lambda g: g.einsum("ii,ik", inp(g, f, "a"), inp(g, f, "b")), f)
    want = (np.diag(f["a"])[:, None] * f["b"]).sum(axis=0)
    np.testing.assert_allclose(got, want, **TOL64)


# --- SQL operators ----------------------------------------------------------------------------

def test_sql_sum_of_product_is_a_contraction(rng) -> None:
    q = "SELECT A.i, C.l, SUM(A.v * B.v * C.v) AS v FROM A JOIN B ON A.j = B.j JOIN C ON B.k = C.k GROUP BY A.i, C.l"
    f = {"a": rand(rng, (4, 5)), "b": rand(rng, (5, 6)), "c": rand(rng, (6, 3))}
    got = run(lambda g: g.sql(q, A=(inp(g, f, "a"), ("i", "j")), B=(inp(g, f, "b"), ("j", "k")),
                              C=(inp(g, f, "c"), ("k", "l"))), f)
    np.testing.assert_allclose(got, np.einsum("ij,jk,kl->il", f["a"], f["b"], f["c"]), **TOL64)
    np.testing.assert_allclose(got, f["a"] @ f["b"] @ f["c"], **TOL64)


def test_sql_sum_of_product_with_a_batch_key(rng) -> None:
    q = "SELECT A.b, A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.b = B.b AND A.j = B.j GROUP BY A.b, A.i, B.k"
    f = {"a": rand(rng, (3, 4, 5)), "b": rand(rng, (3, 5, 2))}
    got = run(lambda g: g.sql(q, A=(inp(g, f, "a"), ("b", "i", "j")), B=(inp(g, f, "b"), ("b", "j", "k"))), f)
    np.testing.assert_allclose(got, np.einsum("bij,bjk->bik", f["a"], f["b"]), **TOL64)


def test_sql_matmul_with_aliases_and_dims(rng) -> None:
    q = "SELECT x.r, y.c, SUM(x.v * y.v) AS v FROM A AS x JOIN B AS y ON x.m = y.m GROUP BY x.r, y.c"
    f = {"a": rand(rng, (4, 5)), "b": rand(rng, (5, 6))}

    def build(g):
        a = g.input("a", [4, 5], "float64", dims=("r", "m"))
        b = g.input("b", [5, 6], "float64", dims=("m", "c"))
        return g.sql(q, A=a, B=b)

    np.testing.assert_allclose(run(build, f), f["a"] @ f["b"], **TOL64)


def test_sql_max_plus(rng) -> None:
    q = "SELECT A.i, B.k, MAX(A.v + B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"
    f = {"a": rand(rng, (6, 5)), "b": rand(rng, (5, 7))}
    got = run(lambda g: g.sql(q, A=(inp(g, f, "a"), ("i", "j")), B=(inp(g, f, "b"), ("j", "k"))), f)
    want = (f["a"][:, :, None] + f["b"][None, :, :]).max(axis=1)  # [i, j, k] -> max over j
    np.testing.assert_allclose(got, want, **TOL64)


def test_sql_min_of_expression(rng) -> None:
    q = "SELECT A.i, MIN(exp(A.v) - B.v * 2) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i"
    f = {"a": rand(rng, (6, 5)), "b": rand(rng, (5,))}
    got = run(lambda g: g.sql(q, A=(inp(g, f, "a"), ("i", "j")), B=(inp(g, f, "b"), ("j",))), f)
    np.testing.assert_allclose(got, (np.exp(f["a"]) - 2 * f["b"][None, :]).min(axis=1), **TOL64)


def test_sql_elementwise_join_without_aggregate(rng) -> None:
    q = "SELECT A.i, A.j, A.v * B.v AS v FROM A JOIN B ON A.i = B.i AND A.j = B.j"
    f = {"a": rand(rng, (6, 5)), "b": rand(rng, (6, 5))}
    got = run(lambda g: g.sql(q, A=(inp(g, f, "a"), ("i", "j")), B=(inp(g, f, "b"), ("i", "j"))), f)
    np.testing.assert_allclose(got, f["a"] * f["b"], **TOL64)


def test_sql_elementwise_sum_of_values_with_transpose(rng) -> None:
    q = "SELECT A.j, A.i, A.v + B.v AS v FROM A JOIN B ON A.i = B.i AND A.j = B.j"
    f = {"a": rand(rng, (6, 5)), "b": rand(rng, (6, 5))}
    got = run(lambda g: g.sql(q, A=(inp(g, f, "a"), ("i", "j")), B=(inp(g, f, "b"), ("i", "j"))), f)
    np.testing.assert_allclose(got, (f["a"] + f["b"]).T, **TOL64)


# --- elementwise ------------------------------------------------------------------------------

_erf = np.vectorize(math.erf)
UNARY_EXPECTED: dict[str, tuple[Callable[[np.ndarray, float], np.ndarray], float, bool]] = {
    # name: (formula(x, arg), arg, needs positive x)
    "relu": (lambda x, a: np.where(x > 0, x, 0.0), 0.0, False),
    "gelu": (lambda x, a: x * 0.5 * (1.0 + _erf(x / math.sqrt(2.0))), 0.0, False),
    "gelu_tanh": (lambda x, a: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))), 0.0, False),
    "silu": (lambda x, a: x / (1 + np.exp(-x)), 0.0, False),
    "sigmoid": (lambda x, a: np.exp(x) / (1 + np.exp(x)), 0.0, False),
    "tanh": (lambda x, a: (np.exp(2 * x) - 1) / (np.exp(2 * x) + 1), 0.0, False),
    "exp": (lambda x, a: math.e**x, 0.0, False),
    "log": (lambda x, a: np.log(x), 0.0, True),
    "neg": (lambda x, a: 0.0 - x, 0.0, False),
    "abs": (lambda x, a: np.sqrt(x * x), 0.0, False),
    "sqrt": (lambda x, a: x**0.5, 0.0, True),
    "rsqrt": (lambda x, a: x**-0.5, 0.0, True),
    "square": (lambda x, a: x**2, 0.0, False),
    "scale": (lambda x, a: a * x, -2.5, False),
    "add_scalar": (lambda x, a: a + x, 3.25, False),
    "pow": (lambda x, a: np.exp(a * np.log(x)), 1.7, True),
    "cast": (lambda x, a: x, "float64", False),
    "fill": (lambda x, a: np.full(x.shape, a), -1.5, False),
    "log1p": (lambda x, a: np.log(1.0 + x), 0.0, True),
    "expm1": (lambda x, a: math.e**x - 1.0, 0.0, False),
    "erf": (lambda x, a: _erf(x), 0.0, False),
    "sin": (lambda x, a: np.imag(np.exp(1j * x)), 0.0, False),
    "cos": (lambda x, a: np.real(np.exp(1j * x)), 0.0, False),
    "detach": (lambda x, a: x, 0.0, False),
    "floor": (lambda x, a: x - np.mod(x, 1.0), 0.0, False),
}


def test_every_unary_op_has_an_expected_formula() -> None:
    assert set(UNARY_EXPECTED) == set(UNARY_FUNCTIONS) - {"logical_not"}  # the boolean one: below


def test_comparisons_logic_and_where_follow_numpy(rng) -> None:
    g = rt.Graph()
    a, b = g.input("a", [6, 1, 5], "bfloat16"), g.input("b", [4, 5], "bfloat16")
    c = g.input("c", [6, 4, 1], "bool")
    for op in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
        g.save(g.binary(a, b, op), name=op)
    lt = g.binary(a, b, "less")
    for op in ("logical_and", "logical_or", "logical_xor"):
        g.save(g.binary(lt, c, op), name=op)
    g.save(g.unary(c, "logical_not"), name="not")
    g.save(g.where(c, a, b), name="where")
    bf = rt.core.dtypes.numpy_dtype("bfloat16")
    f = {"a": np.round(rng.standard_normal((6, 1, 5))).astype(bf),
         "b": np.round(rng.standard_normal((4, 5))).astype(bf), "c": rng.random((6, 4, 1)) < 0.5}
    out = rt.compileGraph(g, device="cpu:3").run(f)
    x, y = f["a"].astype(np.float32), f["b"].astype(np.float32)  # ties included: the values are small integers
    for op in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
        assert out[op].dtype == np.bool_ and np.array_equal(out[op], getattr(np, op)(x, y)), op
    for op in ("logical_and", "logical_or", "logical_xor"):
        assert np.array_equal(out[op], getattr(np, op)(x < y, f["c"])), op
    assert np.array_equal(out["not"], ~f["c"])
    assert np.array_equal(out["where"].astype(np.float32), np.where(f["c"], x, y))


@pytest.mark.parametrize("bad", [
    lambda g: g.binary(g.input("a", [3], "bool"), g.input("b", [3], "bool"), "add"),
    lambda g: g.binary(g.input("a", [3]), g.input("b", [3]), "logical_and"),
    lambda g: g.unary(g.input("a", [3]), "logical_not"),
    lambda g: g.sum(g.input("a", [3], "bool")),
    lambda g: g.matmul(g.input("a", [3, 2], "bool"), g.input("b", [2, 3], "bool")),
    lambda g: g.where(g.input("c", [3]), g.input("a", [3]), g.input("b", [3])),
    lambda g: g.unary(g.input("a", [3], "bool"), "exp"),
])
def test_booleans_are_refused_where_they_mean_nothing(bad) -> None:
    with pytest.raises(rt.GraphError, match="bool|boolean"):
        bad(rt.Graph())


@pytest.mark.parametrize("name", sorted(UNARY_EXPECTED))
def test_unary(rng, name: str) -> None:
    formula, arg, positive = UNARY_EXPECTED[name]
    f = {"x": rand(rng, (7, 6), positive=positive)}
    f["x"][0, :3] = [0.0, 1.0, -1.0] if not positive else [0.5, 1.0, 2.0]
    got = run(lambda g: g.unary(inp(g, f, "x"), name, arg), f)
    np.testing.assert_allclose(got, formula(f["x"], arg), **TOL64)


def test_gelu_exact_values() -> None:
    got = run(lambda g: g.unary(g.input("x", [3], "float64"), "gelu"), {"x": np.array([-1.0, 0.0, 2.0])})
    np.testing.assert_allclose(got, [-0.15865525393145707, 0.0, 1.9544997361036416], rtol=1e-12)


@pytest.mark.parametrize("target", ["float32", "float16", "bfloat16", "int64", "int32"])
def test_cast(rng, target: str) -> None:
    f = {"x": rand(rng, (5, 4)) * 10}
    got = run(lambda g: g.cast(inp(g, f, "x"), target), f)
    want = f["x"].astype(rt.core.dtypes.numpy_dtype(target))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op, formula", [
    ("add", lambda x, y: x + y), ("sub", lambda x, y: x - y), ("mul", lambda x, y: x * y),
    ("div", lambda x, y: x / y), ("maximum", lambda x, y: np.where(x > y, x, y)),
    ("minimum", lambda x, y: np.where(x < y, x, y)),
])
@pytest.mark.parametrize("x_shape, y_shape", [
    ((4, 5), (4, 5)), ((4, 1, 5), (3, 5)), ((5,), (2, 3, 5)), ((2, 1, 4), (1, 3, 1)), ((4, 5), (1,)),
])
def test_binary_broadcasting(rng, op, formula, x_shape, y_shape) -> None:
    f = {"x": rand(rng, x_shape), "y": rand(rng, y_shape, positive=True)}
    got = run(lambda g: g.binary(inp(g, f, "x"), inp(g, f, "y"), op), f)
    shape = np.broadcast_shapes(x_shape, y_shape)
    want = formula(np.broadcast_to(f["x"], shape), np.broadcast_to(f["y"], shape))
    assert got.shape == shape
    np.testing.assert_allclose(got, want, **TOL64)


def test_binary_operator_spellings(rng) -> None:
    f = {"x": rand(rng, (3, 4)), "y": rand(rng, (4,), positive=True)}

    def build(g):
        x, y = inp(g, f, "x"), inp(g, f, "y")
        return (x + y) * x - y / y

    x, y = f["x"], f["y"]
    np.testing.assert_allclose(run(build, f), (x + y) * x - 1.0, **TOL64)


def test_swiglu(rng) -> None:
    f = {"a": rand(rng, (3, 4, 7)), "b": rand(rng, (3, 4, 7))}
    got = run(lambda g: g.swiglu(inp(g, f, "a"), inp(g, f, "b")), f)
    a = f["a"]
    np.testing.assert_allclose(got, a / (1 + np.exp(-a)) * f["b"], **TOL64)


# --- reductions and row-wise ops ------------------------------------------------------------

@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
@pytest.mark.parametrize("axis", [0, 1, -1, (0, 2), (1, -1), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(rng, op: str, axis, keepdims: bool) -> None:
    f = {"x": rand(rng, (4, 5, 6))}
    got = run(lambda g: getattr(g, op)(inp(g, f, "x"), axis=axis, keepdims=keepdims), f)
    x = f["x"]
    axes = {a % 3 for a in ((axis,) if isinstance(axis, int) else axis)}
    # move the reduced axes to the end, flatten them, reduce the flat axis by a Python loop
    kept = [d for d in range(3) if d not in axes]
    flat = np.transpose(x, kept + sorted(axes)).reshape(*(x.shape[d] for d in kept), -1)
    red = {"sum": np.add, "max": np.maximum, "min": np.minimum, "mean": np.add}[op]
    acc = flat[..., 0]
    for n in range(1, flat.shape[-1]):
        acc = red(acc, flat[..., n])
    if op == "mean":
        acc = acc / flat.shape[-1]
    if keepdims:
        want = acc.reshape([1 if d in axes else x.shape[d] for d in range(3)])
    else:
        want = acc.reshape(acc.shape if kept else (1,))  # a full reduction keeps one element
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL64)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_softmax(rng, axis: int) -> None:
    f = {"x": rand(rng, (4, 5, 6)) * 3}
    got = run(lambda g: g.softmax(inp(g, f, "x"), axis=axis), f)
    e = np.exp(f["x"])
    np.testing.assert_allclose(got, e / e.sum(axis=axis, keepdims=True), **TOL64)
    np.testing.assert_allclose(got.sum(axis=axis), 1.0, **TOL64)


def test_softmax_is_shift_invariant_for_large_inputs() -> None:
    x = np.array([[1000.0, 1001.0, 1002.0]])
    got = run(lambda g: g.softmax(g.input("x", [1, 3], "float64")), {"x": x})
    np.testing.assert_allclose(got, naive_softmax(x - 1000.0), **TOL64)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm(rng, eps: float) -> None:
    f = {"x": rand(rng, (2, 5, 8)), "w": rand(rng, (8,))}
    got = run(lambda g: g.rmsnorm(inp(g, f, "x"), inp(g, f, "w"), eps), f)
    x, w = f["x"], f["w"]
    rms = np.sqrt(np.sum(x * x, axis=-1, keepdims=True) / x.shape[-1] + eps)
    np.testing.assert_allclose(got, x / rms * w, **TOL64)


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_layernorm(rng, eps: float) -> None:
    f = {"x": rand(rng, (2, 5, 8)) + 3.0, "w": rand(rng, (8,)), "b": rand(rng, (8,))}
    got = run(lambda g: g.layernorm(inp(g, f, "x"), inp(g, f, "w"), inp(g, f, "b"), eps), f)
    x = f["x"]
    mu = x.sum(axis=-1, keepdims=True) / 8
    var = ((x - mu) ** 2).sum(axis=-1, keepdims=True) / 8  # biased variance
    np.testing.assert_allclose(got, (x - mu) / np.sqrt(var + eps) * f["w"] + f["b"], **TOL64)


# --- rope -------------------------------------------------------------------------------------

@pytest.mark.parametrize("base", [10000.0, 500000.0, 37.0])
def test_rope(rng, base: float) -> None:
    f = {"x": rand(rng, (2, 11, 3, 8))}
    got = run(lambda g: g.rope(inp(g, f, "x"), base), f)
    np.testing.assert_allclose(got, naive_rope(f["x"], base), **TOL64)


def test_rope_rotates_pairs_by_the_documented_angle() -> None:
    """Position 3, d = 4: pairs (x0, x2) and (x1, x3) rotate by 3 and 3 / base**0.5 radians."""
    x = np.zeros((1, 4, 1, 4))
    x[0, 3, 0] = [1.0, 1.0, 0.0, 0.0]
    got = run(lambda g: g.rope(g.input("x", x.shape, "float64"), 100.0), {"x": x})
    a0, a1 = 3.0, 3.0 / 10.0
    np.testing.assert_allclose(got[0, 3, 0], [math.cos(a0), math.cos(a1), math.sin(a0), math.sin(a1)], **TOL64)
    np.testing.assert_allclose(got[0, :3], 0.0)


@pytest.mark.parametrize("seq_ends", [(5, 9, 20, 22, 31, 40, 47), (47,), (1, 2, 47), (46, 47)])
def test_rope_packed_positions_restart(rng, seq_ends) -> None:
    f = {"x": rand(rng, (2, 47, 2, 6))}
    got = run(lambda g: g.rope(inp(g, f, "x"), 500.0, seq_ends), f)
    np.testing.assert_allclose(got, naive_rope(f["x"], 500.0, seq_ends), **TOL64)
    # a token that starts a sequence is not rotated at all
    starts = [0, *seq_ends[:-1]]
    np.testing.assert_allclose(got[:, starts], f["x"][:, starts], **TOL64)


# --- layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("src, dst", [
    ((2, 10, 12), (2, 10, 3, 4)), ((2, 10, 3, 4), (2, 10, 12)), ((6, 4, 5), (4, 6, 5)),
    ((6, 4, 5), (120,)), ((6, 4, 5), (-1, 5)), ((1, 6, 1), (2, 3)), ((3, 4), (4, 3)),
])
def test_reshape(rng, src, dst) -> None:
    f = {"x": rand(rng, src)}
    got = run(lambda g: g.reshape(inp(g, f, "x"), dst), f)
    flat = [f["x"][idx] for idx in np.ndindex(*src)]  # row-major order, element by element
    want = np.array(flat).reshape(got.shape)
    assert got.shape == tuple(d if d != -1 else 24 for d in dst)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("perm", [(0, 1, 2), (2, 0, 1), (1, 0, 2), (-1, 0, 1)])
def test_permute(rng, perm) -> None:
    f = {"x": rand(rng, (3, 4, 5))}
    got = run(lambda g: g.permute(inp(g, f, "x"), perm), f)
    perm = tuple(p % 3 for p in perm)
    want = np.empty(tuple(f["x"].shape[p] for p in perm))
    for idx in np.ndindex(*want.shape):
        src = [0, 0, 0]
        for out_dim, in_dim in enumerate(perm):
            src[in_dim] = idx[out_dim]
        want[idx] = f["x"][tuple(src)]
    np.testing.assert_array_equal(got, want)


def test_transpose(rng) -> None:
    f = {"x": rand(rng, (3, 4, 5))}
    got = run(lambda g: g.transpose(inp(g, f, "x"), 0, 2), f)
    np.testing.assert_array_equal(got, np.swapaxes(f["x"], 0, 2))


@pytest.mark.parametrize("axis, start, stop", [(0, 0, 1), (1, 3, 14), (1, 0, 17), (-1, 16, 17), (-2, 2, 6)])
def test_slice(rng, axis, start, stop) -> None:
    f = {"x": rand(rng, (6, 17))}
    got = run(lambda g: g.slice(inp(g, f, "x"), axis, start, stop), f)
    want = f["x"][start:stop] if axis % 2 == 0 else f["x"][:, start:stop]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(rng, axis: int) -> None:
    shapes = [(5, 3), (5, 7), (5, 2)] if axis % 2 else [(3, 5), (7, 5), (2, 5)]
    f = {f"x{n}": rand(rng, s) for n, s in enumerate(shapes)}
    got = run(lambda g: g.concat([inp(g, f, k) for k in f], axis), f)
    parts = [f[k] for k in f]
    want = np.vstack(parts) if axis % 2 == 0 else np.hstack(parts)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ids_dtype", ["int64", "int32"])
def test_embedding(rng, ids_dtype: str) -> None:
    f = {"table": rand(rng, (23, 6)), "ids": rng.integers(0, 23, size=(3, 7)).astype(ids_dtype)}
    f["ids"][0, :2] = [0, 22]
    got = run(lambda g: g.embedding(inp(g, f, "table"), inp(g, f, "ids")), f)
    want = np.array([[f["table"][int(t)] for t in row] for row in f["ids"]])
    np.testing.assert_array_equal(got, want)


# --- attention --------------------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (batch, seq_q, seq_kv, heads_q, heads_kv, d, d_v, causal, seq_ends, scale)
    "mha": (2, 9, 9, 4, 4, 8, 8, False, None, None),
    "gqa": (2, 9, 9, 8, 2, 8, 8, False, None, None),
    "mqa_causal": (1, 12, 12, 6, 1, 4, 4, True, None, None),
    "gqa_causal": (2, 13, 13, 8, 2, 8, 8, True, None, None),
    "cross_seq_q_ne_seq_kv": (2, 7, 13, 4, 2, 8, 5, False, None, None),
    "cross_longer_q": (1, 13, 5, 2, 1, 4, 4, False, None, None),
    "explicit_scale": (1, 10, 10, 4, 2, 8, 8, True, None, 0.05),
    "explicit_scale_non_causal": (1, 8, 11, 2, 2, 8, 8, False, None, 1.3),
    "packed_causal": (1, 47, 47, 4, 2, 4, 4, True, (5, 9, 20, 22, 31, 40, 47), None),
    "packed_non_causal": (2, 47, 47, 4, 2, 4, 6, False, (5, 9, 20, 22, 31, 40, 47), None),
    "packed_single_tokens": (1, 6, 6, 2, 1, 4, 4, True, (1, 2, 3, 6), None),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention(rng, case: str) -> None:
    b, sq, skv, hq, hkv, d, dv, causal, ends, scale = ATTENTION_CASES[case]
    f = {"q": rand(rng, (b, sq, hq, d)), "k": rand(rng, (b, skv, hkv, d)), "v": rand(rng, (b, skv, hkv, dv))}
    got = run(lambda g: g.attention(inp(g, f, "q"), inp(g, f, "k"), inp(g, f, "v"), causal=causal,
                                    seq_ends=ends, scale=scale), f)
    assert got.shape == (b, sq, hq, dv)
    np.testing.assert_allclose(got, naive_attention(f["q"], f["k"], f["v"], causal, ends, scale), **TOL64)


def test_attention_long_sequence_crosses_row_chunks(rng) -> None:
    """More query rows than one NumPy step of the kernel holds."""
    f = {"q": rand(rng, (1, 1100, 2, 4)), "k": rand(rng, (1, 1100, 1, 4)), "v": rand(rng, (1, 1100, 1, 4))}
    ends = (300, 513, 1100)
    got = run(lambda g: g.attention(inp(g, f, "q"), inp(g, f, "k"), inp(g, f, "v"), causal=True, seq_ends=ends), f)
    np.testing.assert_allclose(got, naive_attention(f["q"], f["k"], f["v"], True, ends), **TOL64)


def test_attention_first_causal_row_copies_first_value(rng) -> None:
    f = {"q": rand(rng, (1, 5, 2, 4)), "k": rand(rng, (1, 5, 2, 4)), "v": rand(rng, (1, 5, 2, 4))}
    got = run(lambda g: g.attention(inp(g, f, "q"), inp(g, f, "k"), inp(g, f, "v"), causal=True), f)
    np.testing.assert_allclose(got[:, 0], f["v"][:, 0], **TOL64)


# --- 16-bit floats ------------------------------------------------------------------------------

LOW_PRECISION_CASES: dict[str, tuple[dict[str, tuple[int, ...]], Callable[[rt.Graph, dict], rt.Tensor]]] = {
    "matmul": ({"a": (8, 16), "b": (16, 8)}, lambda g, t: g.matmul(t["a"], t["b"])),
    "matmul_batched": ({"a": (2, 8, 16), "b": (2, 16, 8)}, lambda g, t: g.matmul(t["a"], t["b"])),
    "einsum": ({"a": (4, 6), "b": (6, 5)}, lambda g, t: g.einsum("ij,jk->ik", t["a"], t["b"])),
    "sql_maxplus": ({"a": (4, 6), "b": (6, 5)}, lambda g, t: g.sql(
        "SELECT A.i, B.k, MAX(A.v + B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k",
        A=(t["a"], ("i", "j")), B=(t["b"], ("j", "k")))),
    "gelu": ({"x": (6, 8)}, lambda g, t: g.unary(t["x"], "gelu")),
    "silu": ({"x": (6, 8)}, lambda g, t: g.unary(t["x"], "silu")),
    "add_broadcast": ({"x": (3, 1, 8), "y": (4, 8)}, lambda g, t: g.add(t["x"], t["y"])),
    "swiglu": ({"a": (6, 8), "b": (6, 8)}, lambda g, t: g.swiglu(t["a"], t["b"])),
    "sum": ({"x": (6, 8)}, lambda g, t: g.sum(t["x"], axis=1)),
    "mean": ({"x": (6, 8)}, lambda g, t: g.mean(t["x"], axis=0, keepdims=True)),
    "max": ({"x": (6, 8)}, lambda g, t: g.max(t["x"], axis=(0, 1))),
    "softmax": ({"x": (6, 8)}, lambda g, t: g.softmax(t["x"], axis=0)),
    "rmsnorm": ({"x": (6, 8), "w": (8,)}, lambda g, t: g.rmsnorm(t["x"], t["w"])),
    "layernorm": ({"x": (6, 8), "w": (8,), "b": (8,)}, lambda g, t: g.layernorm(t["x"], t["w"], t["b"])),
    "rope": ({"x": (1, 12, 2, 8)}, lambda g, t: g.rope(t["x"], 10000.0, (5, 12))),
    "reshape": ({"x": (2, 3, 8)}, lambda g, t: g.reshape(t["x"], [2, 3, 2, 4])),
    "permute": ({"x": (2, 3, 8)}, lambda g, t: g.permute(t["x"], [2, 0, 1])),
    "slice": ({"x": (2, 9)}, lambda g, t: g.slice(t["x"], 1, 2, 7)),
    "concat": ({"x": (2, 3), "y": (2, 4)}, lambda g, t: g.concat([t["x"], t["y"]], 1)),
    "attention": ({"q": (1, 10, 4, 8), "k": (1, 10, 2, 8), "v": (1, 10, 2, 8)},
                  lambda g, t: g.attention(t["q"], t["k"], t["v"], causal=True, seq_ends=(3, 10))),
}


def _low_precision_graph(case: str, dtype: str) -> rt.Graph:
    shapes, build = LOW_PRECISION_CASES[case]
    g = rt.Graph()
    g.save(build(g, {n: g.input(n, s, dtype) for n, s in shapes.items()}), name="out")
    return g


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", sorted(LOW_PRECISION_CASES))
def test_16_bit_floats_are_close_to_float32(rng, case: str, dtype: str) -> None:
    low_np = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    shapes, _ = LOW_PRECISION_CASES[case]
    low = {n: rng.standard_normal(s).astype(low_np) for n, s in shapes.items()}
    got = rt.reference(_low_precision_graph(case, dtype), low)["out"]
    want = rt.reference(_low_precision_graph(case, "float32"), {n: a.astype(np.float32) for n, a in low.items()})["out"]
    assert got.dtype == np.dtype(low_np) and got.shape == want.shape
    tol = 1e-2 if dtype == "float16" else 4e-2
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def test_bfloat16_embedding_table(rng) -> None:
    table = rng.standard_normal((9, 4)).astype(ml_dtypes.bfloat16)
    ids = np.array([[0, 8, 3]])

    def build(g):
        return g.embedding(g.input("table", [9, 4], "bfloat16"), g.input("ids", [1, 3], "int64"))

    got = run(build, {"table": table, "ids": ids})
    assert got.dtype == table.dtype
    np.testing.assert_array_equal(got.astype(np.float32), table[ids[0]].astype(np.float32)[None])


@pytest.mark.parametrize("src, dst", [
    ("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "bfloat16"), ("bfloat16", "float16"),
    ("bfloat16", "bfloat16"), ("float64", "float16"), ("int32", "int64"), ("int64", "int32"),
])
def test_feeds_convert_among_floats_and_among_ints(rng, src: str, dst: str) -> None:
    """A feed of another float (bfloat16 included) or int dtype is converted to the input's dtype."""
    x = (rng.standard_normal((3, 4)) * 5).astype(rt.core.dtypes.numpy_dtype(src))
    got = run(lambda g: g.reshape(g.input("x", [3, 4], dst), [12]), {"x": x})
    want = x.astype(rt.core.dtypes.numpy_dtype(dst)).reshape(12)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_sql_counts_every_join_tuple_even_when_a_relation_has_no_value_in_the_sum() -> None:
    g = rt.Graph()
    a = g.input("A", [3, 4], "float64", dims=("i", "j"))
    b = g.input("B", [4, 5], "float64", dims=("j", "k"))
    g.save(g.sql("SELECT A.i, SUM(A.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i", A=a, B=b), name="y")
    got = rt.reference(g, {"A": np.ones((3, 4)), "B": np.ones((4, 5))})["y"]
    np.testing.assert_array_equal(got, np.full(3, 20.0))  # 4 values of j times 5 matching rows of B

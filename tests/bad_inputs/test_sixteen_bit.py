"""16-bit operators: partials are kept and combined in float32 and rounded once, so a decomposed result
agrees with the single-device reference as closely as the reference agrees with the exact value.

The measure is the one every 16-bit comparison here uses: the largest absolute error over the largest
output magnitude.  The decomposed error may exceed the reference's own error (against a float64 truth)
by at most half again plus one unit in the last place of that magnitude in the dtype: both round once,
but the order of the float32 additions differs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from cases import CASES, feeds_for

import relational_tensors as rt
from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.graph.models import llama_block, llama_feeds
from relational_tensors.machine.devices import visible_gpus

GPU = [pytest.param("cuda:0,0,0,0", marks=pytest.mark.gpu)] if visible_gpus() else []
DEVICES = ["cpu:2", "cpu:4", "cpu:7", *GPU]
DTYPES = ["float16", "bfloat16"]


def _ulp(magnitude: float, dtype: str) -> float:
    info = ml_dtypes.finfo(numpy_dtype(dtype))
    return float(magnitude) * float(info.eps)


def _relative_error(got: np.ndarray, truth: np.ndarray) -> float:
    got, truth = np.asarray(got, np.float64), np.asarray(truth, np.float64)
    return float(np.max(np.abs(got - truth)) / max(np.max(np.abs(truth)), 1e-30))


def _check_against_truth(build, feeds: dict, device: str, dtype: str) -> None:
    """``build(dtype)`` makes the graph; its float64 twin on the same (exactly widened) feeds is the truth."""
    g = build(dtype)
    got = rt.compileGraph(g, device=device).run(feeds)
    ref = rt.reference(g, feeds)
    truth = rt.reference(build("float64"), {k: v if np.asarray(v).dtype.kind in "iub" else np.asarray(v, np.float64)
                                            for k, v in feeds.items()})
    for name in g.outputs:
        ours, theirs = _relative_error(got[name], truth[name]), _relative_error(ref[name], truth[name])
        assert ours <= 1.5 * theirs + _ulp(1.0, dtype), (name, device, dtype, ours, theirs)


def test_a_float16_sum_that_cancels_is_zero_on_every_split() -> None:
    g = rt.Graph()
    g.save(g.sum(g.input("x", [4], "float16"), 0), name="y")
    feeds = {"x": np.array([40000, 40000, -40000, -40000], np.float64)}
    for p in (2, 4):
        cg = rt.compileGraph(g, device=f"cpu:{p}")
        assert cg.run(feeds)["y"][0] == 0 == rt.reference(g, feeds)["y"][0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_float16_matmul_split_on_its_contraction_does_not_overflow(device: str) -> None:
    g = rt.Graph()
    a, b = g.input("a", [1, 4], "float16"), g.input("b", [4, 1], "float16")
    g.save(g.matmul(a, b), name="y")
    cg = rt.compileGraph(g, device=device)
    assert "j=" in cg.plan.split(g.operators[0].name)
    got = cg.run({"a": np.array([[40000.0, 40000.0, -40000.0, -40000.0]]), "b": np.ones((4, 1))})["y"]
    assert np.array_equal(np.asarray(got, np.float64), np.zeros((1, 1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_reductions_round_once(device: str, dtype: str) -> None:
    def build(dt: str) -> rt.Graph:
        g = rt.Graph()
        x = g.input("x", [3, 4096], dt)
        g.save(g.matmul(x, g.input("w", [4096, 5], dt)), name="mm")
        g.save(g.sum(x, 1), name="rows")
        return g

    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 4096)), "w": rng.standard_normal((4096, 5))}
    _check_against_truth(build, {k: v.astype(numpy_dtype(dtype)) for k, v in feeds.items()}, device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_block_in_16_bits(device: str, dtype: str) -> None:
    def build(dt: str) -> rt.Graph:
        return llama_block(batch=1, seq=40, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, dtype=dt)

    _check_against_truth(build, llama_feeds(build(dtype)), device, dtype)


@pytest.mark.parametrize("device", ["cpu:3", *GPU])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_operator_case_in_16_bits(case: str, dtype: str, device: str) -> None:
    rng = np.random.default_rng(0)
    g, _ = CASES[case](dtype)
    feeds = {}
    for n in g.inputs:  # ids as the operator cases draw them, values in the dtype (exactly widened for the truth)
        feeds[n.name] = feeds_for(g)[n.name] if n.type.dtype.startswith(("int", "bool")) else \
            rng.standard_normal(n.type.shape).astype(numpy_dtype(dtype))
    _check_against_truth(lambda dt: CASES[case](dt)[0], feeds, device, dtype)


# --- the dtype's extremes: every operator with a ⊕, on 1-8 devices and with each ⊕ index split -------------
# Inputs at ±max in pairs that cancel along the last axis (or subnormals, or ±inf and NaN among normals); where
# the reference is finite a plan agrees with it (to 4e-3 / 3e-2 of its largest finite magnitude in float16 /
# bfloat16, plus the smallest subnormal), and a plan is never NaN where the reference is not.  Partials of
# bfloat16 are float64 and bfloat16 contractions compute in float64 (core.dtypes.partial_dtype), so no split
# overflows where the reference does not.
_SPLIT_KINDS = {"matmul", "einsum", "conv", "conv_grad", "reduce", "softmax", "softmax_grad", "rmsnorm", "layernorm",
                "norm_grad", "norm_weight_grad", "attention", "attention_lse", "attention_delta", "attention_grad",
                "cross_entropy", "cross_entropy_grad", "embedding_grad", "sql", "pool", "pool_grad", "swiglu_grad"}
_MM = "SELECT A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"
_MAXPLUS = "SELECT A.i, B.k, MAX(A.v + B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"


def _grads(g: rt.Graph, out, c, wrt) -> None:
    for k, d in enumerate(g.grad(g.sum(g.mul(out, c), tuple(range(len(c.type.shape)))), wrt)):
        g.save(d, name=f"d{k}")


# name -> (build(g, D), the inputs given extreme values, integer feeds)
EXTREMES = {
    "sum": (lambda g, D: g.save(g.sum(g.input("x", [6, 16], D), 1), name="y"), "x", {}),
    "max": (lambda g, D: g.save(g.max(g.input("x", [6, 16], D), 1), name="y"), "x", {}),
    "logsumexp": (lambda g, D: g.save(g.logsumexp(g.input("x", [6, 16], D), 1), name="y"), "x", {}),
    "softmax": (lambda g, D: g.save(g.softmax(g.input("x", [6, 16], D), -1), name="y"), "x", {}),
    "matmul": (lambda g, D: g.save(g.matmul(g.input("a", [6, 16], D), g.input("b", [16, 5], D)), name="y"), "a", {}),
    "batched matmul": (lambda g, D: g.save(g.matmul(g.input("a", [2, 6, 16], D), g.input("b", [2, 16, 5], D)),
                                           name="y"), "a", {}),
    "einsum of three": (lambda g, D: g.save(g.einsum("ij,jk,kl->il", g.input("a", [4, 8], D), g.input("b", [8, 8], D),
                                                     g.input("c", [8, 5], D)), name="y"), "a", {}),
    "sql sum join": (lambda g, D: g.save(g.sql(_MM, A=(g.input("a", [6, 16], D), ("i", "j")),
                                               B=(g.input("b", [16, 5], D), ("j", "k"))), name="y"), "a", {}),
    "sql max-plus join": (lambda g, D: g.save(g.sql(_MAXPLUS, A=(g.input("a", [6, 16], D), ("i", "j")),
                                                    B=(g.input("b", [16, 5], D), ("j", "k"))), name="y"), "a", {}),
    "rmsnorm": (lambda g, D: g.save(g.rmsnorm(g.input("x", [6, 16], D), g.input("w", [16], D), 1e-5), name="y"),
                "x", {}),
    "layernorm": (lambda g, D: g.save(g.layernorm(g.input("x", [6, 16], D), g.input("w", [16], D),
                                                  g.input("b", [16], D)), name="y"), "x", {}),
    "attention": (lambda g, D: g.save(g.attention(*(g.input(n, [1, 16, 2, 8], D) for n in "qkv"), causal=True),
                                      name="y"), "q v", {}),
    "cross_entropy": (lambda g, D: g.save(g.cross_entropy(g.input("l", [8, 16], D), g.input("t", [8], "int64")),
                                          name="y"), "l", {"t": np.arange(8) % 16}),
    "conv1d": (lambda g, D: g.save(g.conv(g.input("x", [2, 4, 16], D), g.input("w", [3, 4, 4], D)), name="y"), "x",
               {}),
    "avg_pool": (lambda g, D: g.save(g.avg_pool(g.input("x", [2, 3, 16], D), 4, 4), name="y"), "x", {}),
    "matmul gradients": (lambda g, D: _grads(g, g.matmul(a := g.input("a", [16, 6], D), b := g.input("b", [6, 5], D)),
                                             g.input("c", [16, 5], D), [a, b]), "a c", {}),
    "embedding gradient": (lambda g, D: _grads(g, g.embedding(t := g.input("t", [5, 4], D),
                                                              g.input("ids", [16], "int64")),
                                               g.input("c", [16, 4], D), [t]), "c", {"ids": np.arange(16) % 5}),
    "rmsnorm gradients": (lambda g, D: _grads(g, g.rmsnorm(x := g.input("x", [16, 8], D), w := g.input("w", [8], D),
                                                           1e-5), g.input("c", [16, 8], D), [x, w]), "c", {}),
    "layernorm gradients": (lambda g, D: _grads(g, g.layernorm(x := g.input("x", [16, 8], D),
                                                               w := g.input("w", [8], D), b := g.input("b", [8], D)),
                                                g.input("c", [16, 8], D), [x, w, b]), "c", {}),
    "softmax gradient": (lambda g, D: _grads(g, g.softmax(x := g.input("x", [6, 16], D), -1),
                                             g.input("c", [6, 16], D), [x]), "c", {}),
    "cross_entropy gradient": (lambda g, D: g.save(g.grad(g.cross_entropy(lg := g.input("l", [8, 16], D),
                                                                          g.input("t", [8], "int64")), [lg])[0],
                                                   name="d0"), "l", {"t": np.arange(8)}),
    "attention gradients": (lambda g, D: _grads(g, g.attention(q := g.input("q", [1, 16, 2, 8], D),
                                                               k := g.input("k", [1, 16, 2, 8], D),
                                                               v := g.input("v", [1, 16, 2, 8], D), causal=True),
                                                g.input("c", [1, 16, 2, 8], D), [q, k, v]), "v c", {}),
    "conv gradients": (lambda g, D: _grads(g, g.conv(x := g.input("x", [2, 4, 16], D), w := g.input("w", [3, 4, 4], D)),
                                           g.input("c", [2, 3, 13], D), [x, w]), "c", {}),
    "pool gradients": (lambda g, D: _grads(g, g.max_pool(x := g.input("x", [2, 3, 16], D), 4, 4),
                                           g.input("c", [2, 3, 4], D), [x]), "c", {}),
    "swiglu gradients": (lambda g, D: _grads(g, g.swiglu(a := g.input("a", [6, 16], D), b := g.input("b", [6, 16], D)),
                                             g.input("c", [6, 16], D), [a, b]), "c", {}),
}


def _extreme_values(pattern: str, shape: tuple[int, ...], dtype: str, extreme: bool,
                    rng: np.random.Generator) -> np.ndarray:
    dt = numpy_dtype(dtype)
    info, n = ml_dtypes.finfo(dt), int(np.prod(shape))
    if not extreme:
        v = np.ones(n) if pattern in ("max", "subnormal") else rng.standard_normal(n)
    elif pattern == "max":
        v = np.resize(np.array([1.0, 1.0, -1.0, -1.0]), n) * float(info.max)
    elif pattern == "subnormal":
        v = rng.integers(-8, 9, n) * float(info.smallest_subnormal)
    else:
        v = rng.standard_normal(n)
        hit = rng.random(n) < 0.15
        v[hit] = np.where(rng.random(int(hit.sum())) < 0.5, np.inf, -np.inf) if pattern == "inf" else np.nan
    return v.reshape(shape).astype(dt)


def _check_extremes(case: str, dtype: str, pattern: str, devices: range = range(1, 9)) -> None:
    build, extreme, ints = EXTREMES[case]
    g = rt.Graph()
    build(g, dtype)
    rng = np.random.default_rng(0)
    feeds = {n.name: ints[n.name] if n.name in ints else
             _extreme_values(pattern, n.type.shape, dtype, n.name in extreme.split(), rng) for n in g.inputs}
    want = rt.reference(g, feeds)
    tol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]
    tiny = float(ml_dtypes.finfo(numpy_dtype(dtype)).smallest_subnormal)
    runs: list[tuple[int, dict[str, str] | None]] = [(p, None) for p in devices]
    splits = [(op.name, s.name, s.max_intervals()) for op in g.operators if op.kind in _SPLIT_KINDS
              for s in op.op.requestable() if s.max_intervals() > 1]
    for k, (op, index, most) in enumerate(splits):  # every index of every ⊕ operator split, at 2..8 devices
        p = 2 + k % 7
        runs.append((p, {op: f"{index}={min(p, most)}"}))
    bad = []
    for p, cons in runs:
        try:
            cg = rt.compileGraph(g, device=f"cpu:{p}", constraints=cons)
        except rt.PlanError:
            assert cons is not None
            continue  # no spec of this operator splits that index on p devices
        with np.errstate(all="ignore"):
            got = cg.run(feeds)
        for name in want:
            a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
            fin = np.isfinite(b)
            scale = max(float(np.abs(b[fin]).max()) if fin.any() else 0.0, tiny)
            off = fin & ~(np.abs(a - b) <= tol * scale + tiny)
            nan = ~np.isnan(b) & np.isnan(a)
            if off.any() or nan.any():
                i = np.flatnonzero((off | nan).ravel())[0]
                bad.append(f"{name} on cpu:{p} {cons or ''}: {a.ravel()[i]!r}, reference {b.ravel()[i]!r}")
    assert not bad, f"{case} {dtype} {pattern}: " + "; ".join(bad[:3])


# float16's extremes of these in the default run (its overflow reaches products, attention and the loss
# first); every other case's float16 twin is slow-marked beside its bfloat16 run
FLOAT16_DEFAULT = ("matmul", "attention", "cross_entropy")


def _extreme_cases() -> list:
    return [pytest.param(case, dtype, marks=pytest.mark.slow if dtype == "float16" and not
                         case.startswith(FLOAT16_DEFAULT) else ()) for case in sorted(EXTREMES) for dtype in DTYPES]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(("case", "dtype"), _extreme_cases())
def test_extremes_at_max_agree_with_the_reference(case: str, dtype: str) -> None:
    _check_extremes(case, dtype, "max")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("pattern", ["subnormal", "inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(EXTREMES))
def test_extremes_subnormal_inf_nan_agree_with_the_reference(case: str, dtype: str, pattern: str) -> None:
    _check_extremes(case, dtype, pattern)


# --- the bound at the extremes, stated in docs/limits.md -------------------------------------------------------
def _cancelling_chunks(dtype: str) -> dict[str, np.ndarray]:
    """A row of 16 whose four chunks of 4 sum to +max, +max, -max, -max (each chunk's running sum within max):
    float32 partials of bfloat16 combine to +inf (max + max overflows); the exact sum is 0."""
    m = float(ml_dtypes.finfo(numpy_dtype(dtype)).max) / 4
    row = np.repeat([m, m, -m, -m], 4)
    return {"a": np.tile(row, (2, 1)).astype(numpy_dtype(dtype)), "b": np.ones((16, 3), numpy_dtype(dtype))}


def _cancelling_matmul(dtype: str) -> rt.Graph:
    g = rt.Graph()
    g.save(g.matmul(g.input("a", [2, 16], dtype), g.input("b", [16, 3], dtype), name="mm"), name="y")
    return g


def test_bfloat16_partials_are_float64_and_float16_partials_float32() -> None:
    from relational_tensors.core.dtypes import partial_dtype
    from relational_tensors.dp_optimizer.costs import spec_memory

    assert (partial_dtype("bfloat16"), partial_dtype("float16"), partial_dtype("float32")) == \
        ("float64", "float32", "float32")
    for dtype, width in (("bfloat16", 8), ("float16", 4)):
        cg = rt.compileGraph(_cancelling_matmul(dtype), device="cpu:4", constraints={"mm": "j=4"})
        partials = {b.dtype for b in cg.dag.buffers.values() if b.partial is not None}
        assert partials == {partial_dtype(dtype)}, (dtype, partials)
        spec = cg.plan.spec("mm")  # inputs [2, 4] and [4, 3] and a [2, 3] partial per function spec
        assert spec_memory(spec) == 2 * (2 * 4 + 4 * 3) + 2 * 3 * width


@pytest.mark.parametrize("p", [1, 2, 4])
def test_a_bfloat16_matmul_whose_partials_pass_float32s_range_is_exact(p: int) -> None:
    g, feeds = _cancelling_matmul("bfloat16"), _cancelling_chunks("bfloat16")
    cg = rt.compileGraph(g, device=f"cpu:{p}", constraints={"mm": f"j={p}"} if p > 1 else None)
    got = np.asarray(cg.run(feeds)["y"], np.float64)
    assert np.array_equal(got, np.zeros((2, 3))) and np.array_equal(np.asarray(rt.reference(g, feeds)["y"]), got)


def test_float16_attention_delta_is_one_sum_per_row() -> None:
    # Δ split over d added its float32 partials in another order than the reference: one ulp at 3.4e10 (4096)
    # became dq = 1448 where the reference has 0 (dS = P∘(dP − Δ) cancels exactly)
    g = rt.Graph()
    build, _, _ = EXTREMES["attention gradients"]
    build(g, "float16")
    delta = next(op for op in g.operators if op.kind == "attention_delta")
    assert [s.name for s in delta.op.requestable()] == list(delta.type.names[:3])
    _check_extremes("attention gradients", "float16", "max", range(8, 9))


def test_gpu_bfloat16_partials_are_written_through_float32_scratch() -> None:
    # no GPU needed: the scratch each kernel task gets is computed from the task DAG alone
    from relational_tensors.kernels.launchers import task_scratch

    for dtype in DTYPES:
        cg = rt.compileGraph(_cancelling_matmul(dtype), device="cpu:4", constraints={"mm": "j=4"})
        needs = task_scratch(cg.dag)
        kernels = [t for t in cg.dag.tasks if t.kind == "kernel"]
        if dtype == "bfloat16":
            assert {needs[t.id] for t in kernels} == {((2 * 3,), "float32")}
        else:
            assert not any(t.id in needs for t in kernels)


# GPU: cuBLAS and the Triton kernels accumulate bfloat16 in float32 within a kernel, so the bound on GPUs is
# float32's range for every running sum inside one device; partials beyond it across devices combine in float64.
_NO_GPU = pytest.mark.skipif(visible_gpus() == 0, reason="no CUDA GPU visible (or CuPy not installed)")


@pytest.mark.gpu
@_NO_GPU
@pytest.mark.parametrize("p", [4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_partials_beyond_float32s_range_combine_exactly(dtype: str, p: int) -> None:
    """Four partials of max each (within float32's range) combine to 0 on a GPU: their sum passes float32's
    range, and the bfloat16 partials are float64.  (At p = 2 each partial is itself 2 · max: the GPU kernels
    accumulate in float32, as cuBLAS and torch do, and overflow there; docs/limits.md.)"""
    g, feeds = _cancelling_matmul(dtype), _cancelling_chunks(dtype)
    cg = rt.compileGraph(g, device="cuda:" + ",".join(["0"] * p), constraints={"mm": f"j={p}"})
    got, want = cg.run(feeds)["y"], rt.reference(g, feeds)["y"]
    assert np.array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


@pytest.mark.gpu
@_NO_GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["matmul", "batched matmul", "sql sum join", "conv gradients", "attention",
                                  "attention gradients", "embedding gradient", "rmsnorm gradients"])
def test_gpu_extremes_within_the_bound(case: str, dtype: str) -> None:
    """Inputs at max/64: every float32 running sum stays within range, so GPU plans (one device and split
    over four logical devices of one GPU) agree with the reference as the CPU plans do."""
    build, extreme, ints = EXTREMES[case]
    g = rt.Graph()
    build(g, dtype)
    rng = np.random.default_rng(0)
    feeds = {n.name: ints[n.name] if n.name in ints else
             (_extreme_values("max", n.type.shape, dtype, n.name in extreme.split(), rng).astype(np.float64) / 64
              ).astype(numpy_dtype(dtype)) for n in g.inputs}
    want = rt.reference(g, feeds)
    tol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]
    for device in ("cuda:0", "cuda:0,0,0,0"):
        got = rt.compileGraph(g, device=device).run(feeds)
        for name in want:
            a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
            fin = np.isfinite(b)
            scale = max(float(np.abs(b[fin]).max()) if fin.any() else 0.0, 1e-30)
            assert not (~np.isnan(b) & np.isnan(a)).any(), (case, device, name)
            assert np.all(np.abs(a - b)[fin] <= tol * scale), (case, device, name)

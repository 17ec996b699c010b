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

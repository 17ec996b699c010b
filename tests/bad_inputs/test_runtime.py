"""Run time: no stale or half-applied state, and no silently lossy feeds, on both executors.

Each case is a reproducer: it failed (a stale array, a wrapped integer, an infinity) before the
mechanism it names was fixed.  The GPU cases run the same checks on logical devices of one GPU."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.machine.devices import visible_gpus

DEVICES = ["cpu:3"] + ([pytest.param("cuda:0,0", marks=pytest.mark.gpu)] if visible_gpus() else [])


def _program(device: str, dtype: str = "float32") -> tuple[rt.Graph, rt.CompiledGraph]:
    g = rt.Graph()
    x, w = g.input("x", [10, 6], dtype), g.parameter("w", [6, 5], dtype)
    g.save(g.unary(g.matmul(x, w), "relu"), name="y")
    return g, rt.compileGraph(g, device=device)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((10, 6)).astype(np.float32), "w": rng.standard_normal((6, 5)).astype(np.float32)}


@pytest.mark.parametrize("device", DEVICES)
def test_offload_after_a_new_load_without_execute_is_refused(device: str) -> None:
    g, cg = _program(device)
    cg.run(_feeds(0))
    cg.load({"x": _feeds(1)["x"]})
    with pytest.raises(rt.ExecError, match="saved outputs are stale"):
        cg.offload("y")
    cg.execute()
    np.testing.assert_allclose(cg.offload("y"), rt.reference(g, {**_feeds(0), "x": _feeds(1)["x"]})["y"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_load_changes_nothing(device: str) -> None:
    g, cg = _program(device)
    first = _feeds(0)
    cg.run(first)
    bad = {"x": _feeds(1)["x"], "w": np.zeros((5, 5), np.float32)}  # x is fine, w has the wrong shape
    with pytest.raises(rt.ExecError, match=r"input 'w' must have shape \(6, 5\)"):
        cg.load(bad)
    cg.execute()  # still the first inputs, x included
    np.testing.assert_allclose(cg.offload("y"), rt.reference(g, first)["y"], rtol=1e-5, atol=1e-5)


def test_a_failed_execute_leaves_no_stale_result_and_the_program_usable(monkeypatch) -> None:
    g, cg = _program("cpu:3")
    feeds = _feeds(0)
    cg.run(feeds)
    cg.load({"x": _feeds(1)["x"]})
    op = type(next(n.op for n in g.operators if n.kind == "unary"))
    real = op.kernel
    for interrupt in (RuntimeError("boom"), KeyboardInterrupt()):
        def failing(self, blocks, f, interrupt=interrupt):
            raise interrupt
        monkeypatch.setattr(op, "kernel", failing)
        with pytest.raises(type(interrupt)):
            cg.execute()
        monkeypatch.setattr(op, "kernel", real)
        with pytest.raises(rt.ExecError, match="saved outputs are stale"):
            cg.offload("y")
    cg.execute()  # usable again, and right
    np.testing.assert_allclose(cg.offload("y"), rt.reference(g, {**feeds, "x": _feeds(1)["x"]})["y"],
                               rtol=1e-5, atol=1e-5)
    assert cg.executor.peak == [cg.memory()[d] for d in range(cg.p)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "value", "words"), [
    ("int32", 2**32 + 1, r"holds integers in \[-2147483648, 2147483647\]; got 4294967297"),
    ("int32", -(2**31) - 1, "got -2147483649"),
])
def test_integers_that_would_wrap_are_refused(device: str, dtype: str, value: int, words: str) -> None:
    g = rt.Graph()
    g.save(g.embedding(g.input("table", [7, 4]), g.input("ids", [3], dtype)), name="y")
    cg = rt.compileGraph(g, device=device)
    with pytest.raises(rt.ExecError, match=words):
        cg.load({"table": np.ones((7, 4), np.float32), "ids": np.array([1, value, 2], np.int64)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "value"), [("float16", 70000.0), ("bfloat16", 1e39), ("float32", 1e39)])
def test_finite_floats_that_would_overflow_are_refused(device: str, dtype: str, value: float) -> None:
    g = rt.Graph()
    g.save(g.unary(g.input("x", [4], dtype), "relu"), name="y")
    cg = rt.compileGraph(g, device=device)
    with pytest.raises(rt.ExecError, match=rf"input 'x' is {dtype}, whose largest finite value is .*which would"):
        cg.load({"x": np.array([1.0, value, -2.0, 0.5], np.float64)})


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_feeds_propagate_as_in_the_reference(device: str) -> None:
    g = rt.Graph()
    x = g.input("x", [6, 4], "float16")
    g.save(g.softmax(g.unary(x, "scale", 2.0)), name="y")
    cg = rt.compileGraph(g, device=device)
    feeds = {"x": np.array([[np.nan, 1, 2, 3], [np.inf, 0, 0, 0], [-np.inf, 1, 1, 1], [1, 2, 3, 4],
                            [0, 0, 0, 0], [5, -5, 5, -5]], np.float64)}
    got = np.asarray(cg.run(feeds)["y"], np.float64)
    want = np.asarray(rt.reference(g, feeds)["y"], np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=2e-3, atol=2e-3)


def test_a_parallelized_module_runs_on_the_weights_the_module_has_now() -> None:
    torch = pytest.importorskip("torch")
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(5, 8)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    assert torch.allclose(pm(x), m(x), atol=1e-5)
    with torch.no_grad():  # an in-place update, as an optimizer step makes: read again, never stale
        m[0].weight.mul_(2)
        assert torch.allclose(pm(x), m(x), atol=1e-5)
        m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})  # replaced tensors
        assert torch.allclose(pm(x), m(x), atol=1e-5)
    with torch.no_grad():
        m[0].weight.mul_(2)
    assert torch.allclose(pm(x), m(x), atol=1e-5)  # and with grad enabled

"""Inputs read in place (``compileGraph(..., bind={name: array})``, ``runtime/binding.py``): which blocks
are contiguous runs of their array, the blocks read from the array itself on virtual devices and on GPUs
(no copy, no arena room), the rest copied, results equal to the reference, and the refusals (a state, an
unknown name, a wrong shape or dtype, a load or a stage of a bound input, ``device="dist"``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.core.types import Box
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.runtime.binding import contiguous_offset
from relational_tensors.runtime.memory_plan import plan_memory


def _mlp(dtype: str = "float32", rows: int = 13, d: int = 24, f: int = 40) -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [rows, d], dtype)
    w1, w2 = g.parameter("w1", [d, f], dtype), g.parameter("w2", [f, d], dtype)
    h = g.rmsnorm(x, g.parameter("norm", [d], dtype), 1e-5)
    g.save(g.add(x, g.matmul(g.unary(g.matmul(h, w1), "gelu"), w2)), name="y")
    return g


def _feeds(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n.name: (rng.standard_normal(n.type.shape) / 4).astype(np.float32) for n in g.inputs}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_contiguous_offset_is_numpys_answer(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    lower, upper = [], []
    for n in shape:
        lo = data.draw(st.integers(0, n - 1))
        lower.append(lo)
        upper.append(data.draw(st.integers(lo + 1, n)))
    box = Box(tuple(lower), tuple(upper))
    a = np.arange(int(np.prod(shape))).reshape(shape)
    block = a[box.slices()].reshape(-1)
    run = bool(np.all(np.diff(block) == 1))  # one contiguous run of the array's elements
    got = contiguous_offset(box, shape)
    assert (got is not None) == run, (shape, box, got)
    if got is not None:
        assert got == block[0]


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3", "cpu:4"])
def test_bound_weights_are_read_in_place_on_virtual_devices(device: str) -> None:
    g = _mlp()
    feeds = _feeds(g)
    weights = {k: feeds[k] for k in ("w1", "w2", "norm")}
    cg = rt.compileGraph(g, device=device, bind=weights)
    got = cg.run({"x": feeds["x"]})["y"]  # the weights need no load
    np.testing.assert_allclose(got, rt.reference(g, feeds)["y"], rtol=1e-5, atol=1e-6)
    ex = cg.executor
    for name, a in weights.items():
        for _, b in cg.dag.inputs[name]:
            assert np.shares_memory(ex._get(b), a), (name, b)
    # a new batch, the same bound weights
    x2 = _feeds(g, 1)["x"]
    np.testing.assert_allclose(cg.run({"x": x2})["y"], rt.reference(g, {**feeds, "x": x2})["y"], rtol=1e-5,
                               atol=1e-6)


def test_a_bound_input_is_a_constant_and_bad_binds_are_refused() -> None:
    g = _mlp()
    feeds = _feeds(g)
    cg = rt.compileGraph(g, device="cpu:2", bind={"w1": feeds["w1"]})
    with pytest.raises(ExecError, match="bound when the program was made"):
        cg.load({"w1": feeds["w1"]})
    unread = rt.Graph()  # an input no operator reads has no blocks to bind
    a = unread.input("a", [4], "float32")
    unread.input("u", [3], "float32")
    unread.save(unread.unary(a, "relu"), name="out")
    ones = np.ones(4, np.float32)
    got = rt.compileGraph(unread, device="cpu:2", bind={"a": ones, "u": np.zeros(3, np.float32)}).run({})
    np.testing.assert_array_equal(got["out"], ones)
    with pytest.raises(ExecError, match="not among its inputs"):
        rt.compileGraph(g, device="cpu:2", bind={"w9": feeds["w1"]})
    with pytest.raises(ExecError, match="must have shape"):
        rt.compileGraph(g, device="cpu:2", bind={"w1": feeds["w2"]})
    with pytest.raises(ExecError, match="never converted"):
        rt.compileGraph(g, device="cpu:2", bind={"w1": feeds["w1"].astype(np.float64)})
    with pytest.raises(GraphError, match="dist"):
        rt.compileGraph(g, device="dist", bind={"w1": feeds["w1"]})
    s = rt.Graph()
    v = s.state("v", [4], "float32")
    s.assign(v, s.add(v, s.input("dv", [4], "float32")))
    s.save(s.unary(v, "relu"), name="out")
    with pytest.raises(ExecError, match="states"):
        rt.compileGraph(s, device="cpu:2", bind={"v": np.zeros(4, np.float32)})


def test_the_memory_plan_leaves_external_blocks_out_of_the_arena() -> None:
    g = _mlp(rows=64, d=64, f=256)
    cg = rt.compileGraph(g, device="cpu:2")
    dag, live = cg.dag, cg.live
    external = frozenset(b for name in ("w1", "w2") for _, b in dag.inputs[name])
    with_all, without = plan_memory(dag, live), plan_memory(dag, live, external=external)
    assert not external & set(without.slots)
    kept = sum(dag.buffers[b].box.volume * 4 for b in external)
    assert sum(without.arena_bytes.values()) <= sum(with_all.arena_bytes.values()) - kept // 2
    ranges = {without.byte_range(dag, b) for b in external}
    assert len(ranges) == len(external) and all(lo < 0 for _, lo, _ in ranges)  # no arena byte, no overlap


gpu = pytest.mark.skipif(visible_gpus() == 0, reason="no CUDA GPU visible (or CuPy not installed)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0", "cuda:0,0,0"])
def test_bound_cuda_tensors_take_no_arena_room(device: str, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    g = _mlp(dtype, rows=96, d=128, f=512)
    feeds = _feeds(g)
    tdt = getattr(torch, dtype)
    weights = {k: torch.from_numpy(feeds[k]).to("cuda", tdt) for k in ("w1", "w2", "norm")}
    plain = rt.compileGraph(g, device=device)
    cg = rt.compileGraph(g, device=device, bind=weights)
    x = torch.from_numpy(feeds["x"]).to("cuda", tdt)
    got = cg.run({"x": x})["y"].astype(np.float32)
    want = plain.run({"x": x, **weights})["y"].astype(np.float32)
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ex = cg.executor
    assert ex.bound, "no block was read in place"
    for name, t in weights.items():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        for _, b in cg.dag.inputs[name]:
            if b in ex.bound:
                assert lo <= ex.views[b].ptr < hi
    assert sum(ex.arena_bytes.values()) < sum(plain.executor.arena_bytes.values())
    with pytest.raises(ExecError, match="bound"):
        cg.load({"w1": weights["w1"]})
    # replayed from its CUDA graph: the bound blocks still read the tensors
    for _ in range(2):
        again = cg.run({"x": x})["y"].astype(np.float32)
    np.testing.assert_allclose(again, got, rtol=0, atol=0)

"""``put_rows`` (torch's ``x[ids] = values``): rows replaced, the last of repeated ids winning, on plans
that split the rows and the other axes; a state's rows written in place (a paged key/value cache taking a
step's rows); the Triton kernel against NumPy in Triton's interpreter (without a GPU), in place and not;
the torch frontend's ``index_put`` and ``index_copy`` reach it."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

import relational_tensors as rt

torch = pytest.importorskip("torch")
C = kernel_module("relational_tensors.kernels.triton_copy")
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, C)


def _graph(rows: int = 11, rest: tuple[int, ...] = (3, 4), n: int = 6, dtype: str = "float32") -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [rows, *rest], dtype)
    out = g.put_rows(x, g.input("ids", [n], "int64"), g.input("values", [n, *rest], dtype))
    g.save(out, name="out")
    return g


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3", "cpu:4"])
def test_repeated_ids_keep_the_last_values_on_every_plan(device: str) -> None:
    g = _graph()
    rng = np.random.default_rng(1)
    ids = np.array([4, 9, 4, 0, 10, 9])  # 4 and 9 twice: the later values stay
    feeds = {"x": rng.standard_normal((11, 3, 4)).astype(np.float32), "ids": ids,
             "values": rng.standard_normal((6, 3, 4)).astype(np.float32)}
    want = feeds["x"].copy()
    for i, r in enumerate(ids):
        want[r] = feeds["values"][i]
    np.testing.assert_array_equal(rt.reference(g, feeds)["out"], want)
    np.testing.assert_array_equal(rt.compileGraph(g, device=device).run(feeds)["out"], want)


def test_an_id_outside_the_rows_is_refused() -> None:
    g = _graph()
    feeds = {"x": np.zeros((11, 3, 4), np.float32), "ids": np.array([0, 1, 2, 3, 4, 11]),
             "values": np.zeros((6, 3, 4), np.float32)}
    with pytest.raises(rt.ExecError, match=r"put_rows ids \(rows of x\) must lie in \[0, 11\)"):
        rt.compileGraph(g, device="cpu:2").run(feeds)


def test_bad_operands_are_refused_with_the_rule() -> None:
    g = rt.Graph()
    x = g.input("x", [5, 4])
    with pytest.raises(rt.GraphError, match="values of shape"):
        g.put_rows(x, g.input("ids", [2], "int64"), g.input("values", [3, 4]))
    with pytest.raises(rt.GraphError, match="int32 or int64 vector"):
        g.put_rows(x, g.input("ids2", [2, 1], "int64"), g.input("v2", [2, 4]))


@pytest.mark.parametrize("p", [1, 3])
def test_a_state_takes_its_rows_in_place(p: int) -> None:
    """A pool of cache rows written at a step's rows: the kernel writes the state's block itself (no assign
    copies the pool), and the pool carries over between steps."""
    g = rt.Graph()
    pool = g.state("pool", [20, 2, 8], "float32")
    rows = g.input("rows", [3], "int64")
    new = g.input("new", [3, 2, 8], "float32")
    g.save(g.sum(pool, axis=0), name="old")
    g.assign(pool, g.put_rows(pool, rows, new))
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    kept = {b for _, b in cg.dag.inputs["pool"]}
    puts = [t for t in cg.dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].kind == "put_rows"]
    assert puts and all(cg.dag.root(t.outputs[0]) in kept for t in puts)
    assert not [t for t in cg.dag.tasks if t.kind == "assign"]
    rng = np.random.default_rng(p)
    state = rng.standard_normal((20, 2, 8)).astype(np.float32)
    for step in range(3):
        feeds = {"rows": np.array([step, 7 + step, 19 - step]),
                 "new": rng.standard_normal((3, 2, 8)).astype(np.float32)}
        cg.load({"pool": state, **feeds} if step == 0 else feeds)
        cg.execute()
        np.testing.assert_allclose(cg.offload("old"), state.sum(0), rtol=1e-6, atol=1e-6)
        state = state.copy()
        state[feeds["rows"]] = feeds["new"]
        np.testing.assert_array_equal(cg.offload("pool"), state)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_writes_the_rows_of_its_block(dtype: str, in_place: bool) -> None:
    """A block of rows [3, 9) of an 11-row tensor: ids outside it are skipped, the last of repeats wins."""
    g = np.random.default_rng(2)
    tdtype = getattr(torch, dtype)
    x = torch.from_numpy(g.standard_normal((6, 5)).astype(np.float32)).to(tdtype)
    ids = torch.tensor([4, 0, 8, 4, 10, 3, 8], dtype=torch.int64)
    values = torch.from_numpy(g.standard_normal((7, 5)).astype(np.float32)).to(tdtype)
    want = x.clone()
    for i, r in enumerate(ids.tolist()):
        if 3 <= r < 9:
            want[r - 3] = values[i]
    xd, xt = T.buf(x.clone())
    idd, _ = T.buf(ids)
    vd, _ = T.buf(values)
    od, ot = (xd, xt) if in_place else T.buf(torch.full_like(x, float("nan")))
    C.put_rows(xd, idd, vd, od, 3)
    assert torch.equal(ot.cpu(), want)


def test_the_frontend_writes_rows_with_put_rows() -> None:
    """``x[ids] = v``, ``index_put_`` and ``index_copy`` of a module: one put_rows each, no scatter and select."""
    from torch import nn

    class Writes(nn.Module):
        def forward(self, x: torch.Tensor, ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y[ids] = v
            return y.index_copy(0, ids + 1, v * 2)

    m = Writes()
    x, ids, v = torch.randn(9, 4), torch.tensor([2, 5, 0]), torch.randn(3, 4)
    pm = rt.parallelize(m, (x, ids, v), device="cpu:2")
    torch.testing.assert_close(pm(x, ids, v), m(x, ids, v))
    kinds = [n.kind for n in pm.graph.operators]
    assert kinds.count("put_rows") == 2 and "embedding_grad" not in kinds and "where" not in kinds


@pytest.mark.parametrize("form", ["values from the state", "x elsewhere, values from the state"])
def test_a_state_its_values_are_read_from_is_not_written_in_place(form: str) -> None:
    """put_rows reads value row i where it writes row ids[i] (and writes x over the block first): with the
    state's old value among its values, writing the state's block in place would read rows already written,
    so its next value takes a block of its own."""
    g = rt.Graph()
    pool = g.state("pool", [6, 4], "float32")
    perm = g.input("perm", [6], "int64")
    x = pool if form == "values from the state" else g.input("x", [6, 4], "float32")
    g.assign(pool, g.put_rows(x, perm, pool))
    for p in (1, 2):
        cg = rt.compileGraph(g, device=f"cpu:{p}")
        kept = {b for _, b in cg.dag.inputs["pool"]}
        puts = [t for t in cg.dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].kind == "put_rows"]
        assert puts and not any(cg.dag.root(t.outputs[0]) in kept for t in puts)
        state = np.arange(24, dtype=np.float32).reshape(6, 4)
        feeds = {"pool": state, "perm": np.array([1, 2, 3, 0, 5, 4]), "x": np.zeros((6, 4), np.float32)}
        cg.run({k: v for k, v in feeds.items() if k in cg.dag.inputs})
        want = (state if form == "values from the state" else feeds["x"]).copy()
        want[feeds["perm"]] = state
        np.testing.assert_array_equal(cg.offload("pool"), want)


def test_the_decode_attention_scratch_is_counted_without_triton() -> None:
    """A GPU plan's memory counts kernels' scratch on any machine (``kernels.scratch``): the decode attention
    kernel's share of it is worked out with Triton missing."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["triton"] = None
from relational_tensors.core.types import TensorType as T
from relational_tensors.kernels.launchers import scratch_shape
from relational_tensors.kernels.scratch import decode_scratch
from relational_tensors.sql_specs.attention import AttentionOp
op = AttentionOp((T.zero((1, 1, 32, 128), "bfloat16"), T.zero((1, 4096, 8, 128), "bfloat16"),
                  T.zero((1, 4096, 8, 128), "bfloat16"), T.zero((1, 4096), "bool")), extras=("key_padding",))
f = op.spec({}).functions[0]
assert scratch_shape(op, f) == ((decode_scratch(1, 1, 32, 8, 4096, 128),), "float32"), scratch_shape(op, f)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]

"""Atoms and delivered pieces as views (``physical.views``): fewer tasks and passes, the same result,
and a liveness the executors reproduce."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.exchange.naive import naive
from relational_tensors.graph.models import llama_block, llama_feeds, llama_training_feeds, llama_training_graph
from relational_tensors.physical.lower import _Lowering
from relational_tensors.physical.tasks import liveness
from relational_tensors.physical.views import fuse_views
from relational_tensors.runtime.numpy_backend import NumpyExecutor


def unfused(cg, reread: bool = True):
    """``cg``'s plan lowered without views (and, with ``reread=False``, with every block delivered to
    each reader: no reader reads again a block a recent reader received)."""
    low = _Lowering(cg.plan, naive)
    if not reread:
        low.window = -1
    for node in cg.plan.graph.operators:
        low.lower_op(node.id)
    low.lower_outputs()
    return low.dag


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("seq_ends", [None, [40, 97, 128]])
def test_views_remove_passes_and_keep_the_result(p, seq_ends) -> None:
    g = llama_block(2, 128, 256, 8, 2, 512, dtype="float32", seq_ends=seq_ends)
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    before, after = unfused(cg), cg.dag
    assert fuse_views(before).counts() == after.counts()
    # the same bytes cross between devices; decompose only survives for log-sum-exp partials
    assert before.bytes_moved() == after.bytes_moved()
    assert all(after.buffers[t.inputs[0]].partial == "lse" or
               any(r.kind == "kernel" for r in after.tasks if set(r.inputs) & set(t.outputs))
               for t in after.tasks if t.kind == "decompose")
    assert after.counts()["recompose"] <= before.counts()["recompose"]
    if before.counts()["decompose"]:
        assert after.counts()["decompose"] < before.counts()["decompose"]
    for _b, buf in after.buffers.items():  # a view lies inside its parent, on its device, of its tensor
        if buf.parent is not None:
            parent = after.buffers[buf.parent]
            assert parent.device == buf.device and parent.tensor == buf.tensor and parent.dtype == buf.dtype
            assert parent.box.contains(buf.box)
    feeds = llama_feeds(g)
    ex = NumpyExecutor(after, liveness(after))
    ex.load(feeds)
    ex.execute()
    np.testing.assert_allclose(ex.offload("y"), rt.reference(g, feeds)["y"], rtol=1e-4, atol=1e-4)
    assert ex.peak == [cg.live.peak[d] for d in range(p)]  # roots are allocated when first written
    # atoms no longer take memory: views and re-read blocks together never raise the peak of the plain
    # lowering (re-reading alone can lower it below the views' peak: it removes whole deliveries)
    plain = liveness(unfused(cg, reread=False))
    assert all(cg.live.peak[d] <= plain.peak[d] for d in range(p))
    assert after.bytes_moved() <= unfused(cg, reread=False).bytes_moved()


def test_a_view_read_waits_for_the_block_it_is_cut_from() -> None:
    g = llama_block(1, 64, 128, 8, 2, 256, dtype="float32")
    cg = rt.compileGraph(g, device="cpu:4")
    dag = cg.dag
    deps = dag.producers()
    checked = 0
    for t in dag.tasks:
        for b in t.inputs:
            buf = dag.buffers[b]
            if buf.parent is not None and t.kind == "copy":
                root = dag.root(b)
                writers = [w.id for w in dag.tasks if w.kind != "load" and root in w.outputs and w.id < t.id]
                assert set(writers) <= deps[t.id]
                checked += 1
    assert checked


@pytest.mark.parametrize("p", [4, 8])
def test_gpu_view_geometry_names_the_elements_numpy_slicing_does(p) -> None:
    # the GPU executor places reshape outputs and views by (element offset, strides) in their root;
    # checked here against NumPy views of a root filled with its own element indices
    from numpy.lib.stride_tricks import as_strided

    from relational_tensors.runtime.memory_plan import plan_memory, view_geometry

    g = llama_block(2, 96, 128, 8, 2, 256, dtype="float32", seq_ends=[40, 96])
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    dag = cg.dag
    plan = plan_memory(dag, cg.live)
    geo = view_geometry(dag, plan)
    assert set(geo) == set(plan.alias) and geo
    arrays: dict[int, np.ndarray] = {}

    def array(b: int) -> np.ndarray:  # NumPy's idea of buffer b over its root's element indices
        if b not in arrays:
            buf = dag.buffers[b]
            if b not in plan.alias:
                arrays[b] = np.arange(buf.box.volume).reshape(buf.box.shape)
            elif buf.parent is None:  # a reshape reads its root in order
                arrays[b] = array(plan.alias[b]).ravel()[:buf.box.volume].reshape(buf.box.shape)
            else:
                arrays[b] = array(buf.parent)[buf.box.slices(dag.buffers[buf.parent].box)]
        return arrays[b]

    seen_views = 0
    for b, (offset, strides) in geo.items():
        flat = np.arange(dag.buffers[plan.alias[b]].box.volume)
        got = as_strided(flat[offset:], dag.buffers[b].box.shape, tuple(s * flat.itemsize for s in strides))
        np.testing.assert_array_equal(got, array(b))
        seen_views += dag.buffers[b].parent is not None
    assert seen_views


# the calibrated model prices a reader's local assembly, which settles the smaller block's ties itself
def _assert_step_matches(got: dict, want: dict) -> None:
    """A training step's outputs (loss and every updated state) against the reference's, relative to the
    largest magnitude of each: bf16 states hold 2^-7."""
    assert set(got) == set(want)
    for name, ref in want.items():
        ref, out = np.asarray(ref, np.float64), np.asarray(got[name], np.float64)
        err = np.max(np.abs(out - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1e-30)
        assert err <= 1e-2, f"{name}: {err:.1e} of the largest magnitude"


@pytest.mark.parametrize(("device", "cost_model", "seq", "model"),
                         [("cpu:8", "paper", 512, 256), ("cuda:0,0,0,0,0,0,0,0", "calibrated", 1024, 512)])
def test_placement_ties_follow_the_last_operator_with_the_same_blocks(device: str, cost_model: str, seq: int,
                                                                      model: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer's update chain follows its gradient's placement where its states leave a tie: fewer
    bytes than with ties going to the identity, and the same result."""
    g = llama_training_graph(1, seq, model, 8, 2, 2 * model, 64, dtype="bfloat16", optimizer="adamw",
                             master_dtype="float32")
    hinted = rt.compileGraph(g, device=device, cost_model=cost_model)
    monkeypatch.setattr(_Lowering, "_hint", lambda self, op_id, outputs: None)
    plain = rt.compileGraph(g, device=device, cost_model=cost_model)
    assert hinted.dag.bytes_moved() < plain.dag.bytes_moved()
    if device.startswith("cpu"):  # the hinted plan computes the step: loss and every updated state
        feeds = llama_training_feeds(g)
        got, want = hinted.run(feeds), rt.reference(g, feeds)
        _assert_step_matches(got, want)


def test_a_plan_priced_for_its_local_assembly_computes_the_step() -> None:
    """The calibrated model on eight logical devices of one GPU prices each reader's copy of the part of
    its block a whole block on its own device holds (``target.pricing.exchange_seconds``); the training
    step it plans, its task DAG run by the NumPy executor, gives the single-device reference's loss and
    updated states."""
    g = llama_training_graph(1, 512, 256, 8, 2, 512, 64, dtype="bfloat16", optimizer="adamw",
                             master_dtype="float32")
    cg = rt.compileGraph(g, device="cuda:" + ",".join(["0"] * 8), cost_model="calibrated")
    assert any(t.kind == "recompose" for t in cg.dag.tasks)  # readers assemble blocks from pieces
    feeds = llama_training_feeds(g)

    class OnHost(NumpyExecutor):  # the GPU plan's tasks, run on the host (called as the GPU executor is)
        def offload(self, name: str, like: str = "numpy") -> np.ndarray:
            return super().offload(name)

        def state(self, name: str, like: str = "numpy") -> np.ndarray:
            return super().state(name)

    cg._executor = OnHost(cg.dag, cg.live)
    got, want = cg.run(feeds), rt.reference(g, feeds)
    _assert_step_matches(got, want)


def test_recent_readers_blocks_are_read_again_not_received_again() -> None:
    """The gate and up projections read one normalized activation: placed alike, the second reads the
    buffer the first received; the plan moves fewer bytes than one that delivers every block, with no more
    memory, and computes the same."""
    g = llama_block(2, 128, 256, 8, 2, 512, dtype="float32")
    cg = rt.compileGraph(g, device="cpu:4")
    dag, names = cg.dag, {n.id: n.name for n in g.nodes}
    reads: dict[tuple[str, int], list[int]] = {}
    for t in dag.tasks:
        if t.kind == "kernel" and names[t.op] in ("gate_proj", "up_proj"):
            for b in t.inputs:
                if names[dag.buffers[b].tensor] == "ffn_rmsnorm":
                    reads.setdefault((names[t.op], t.device), []).append(b)
    shared = [d for d in range(4) if set(reads.get(("gate_proj", d), [])) & set(reads.get(("up_proj", d), []))]
    assert shared, reads
    plain = unfused(cg, reread=False)
    assert dag.bytes_moved() < plain.bytes_moved()
    assert all(cg.live.peak[d] <= liveness(plain).peak[d] for d in range(4))
    feeds = llama_feeds(g)
    np.testing.assert_allclose(cg.run(feeds)["y"], rt.reference(g, feeds)["y"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("p", "seq"), [(6, 48)])  # a plan with such a piece: the case is rare
def test_a_piece_several_assemblies_read_is_held_by_the_first(p: int, seq: int) -> None:
    """A block delivered once for two readers on one device is written into the first reader's assembly,
    and the second reads it there: the training step (AdamW, float32) still equals the reference."""
    import collections

    g = llama_training_graph(2, seq, 64, 4, 2, 96, 128, dtype="float32", optimizer="adamw")
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    readers: dict[int, list] = collections.defaultdict(list)
    copied = set()
    for t in cg.dag.tasks:
        for b in t.inputs:
            readers[b].append(t)
        if t.kind == "copy":
            copied.add(t.outputs[0])
    assembles = {t.outputs[0]: t for t in cg.dag.tasks if t.kind == "recompose"}
    shared = [b for b in copied if sum(r.kind == "recompose" for r in readers[b]) > 1
              and cg.dag.buffers[b].parent in assembles]
    assert shared
    for b in shared:  # held by the first of its assemblies (one that needs nothing else left runs before)
        host = assembles[cg.dag.buffers[b].parent]
        assert host.id <= min(r.id for r in readers[b])
    feeds = llama_training_feeds(g)
    got, want = cg.run(feeds), rt.reference(g, feeds)
    # float32, relative to each output's largest magnitude: AdamW's first step divides a gradient by its
    # own magnitude, so an element whose gradient is near zero turns summation-order rounding into up to
    # lr * 1 (1e-3 of a unit-scale parameter); every other element agrees to float32 rounding
    for k in got:
        ref, out = np.asarray(want[k], np.float64), np.asarray(got[k], np.float64)
        assert np.max(np.abs(out - ref)) <= 1e-3 * max(np.max(np.abs(ref)), 1e-30), k


def _cache_step(old_read_after: bool) -> rt.Graph:
    g = rt.Graph()
    cache = g.state("cache", [3, 16, 2, 8], "float32")
    new = g.input("new", [3, 1, 2, 8], "float32")
    write = g.input("write", [3, 16, 1, 1], "bool")
    if old_read_after:
        written = g.where(write, new, cache)
        g.save(g.sum(written, axis=3), name="read")
        g.save(g.sum(cache, axis=1), name="old")  # the old cache, read after the write is made
    else:
        g.save(g.sum(cache, axis=1), name="old")
        written = g.where(write, new, cache)
        g.save(g.sum(written, axis=3), name="read")
    g.assign(cache, written)
    return g


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("old_read_after", [False, True])
def test_a_selected_next_value_is_written_into_the_kept_block(p: int, old_read_after: bool) -> None:
    """A cache written at a few positions (``where``) is written in place, with no assign copying it, where
    every reader of the old cache runs before the write; read after it, the next value takes its own block."""
    g = _cache_step(old_read_after)
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    wheres = [t for t in cg.dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].kind == "where"]
    assigns = [t for t in cg.dag.tasks if t.kind == "assign"]
    kept = {b for _, b in cg.dag.inputs["cache"]}
    in_place = [t for t in wheres if cg.dag.root(t.outputs[0]) in kept]
    if old_read_after:
        assert assigns and not in_place
    else:
        assert in_place and len(in_place) + len(assigns) >= len(wheres)
    rng = np.random.default_rng(p)
    state = rng.standard_normal((3, 16, 2, 8)).astype(np.float32)
    for step in range(3):
        write = np.zeros((3, 16, 1, 1), bool)
        write[np.arange(3), [step, 5 + step, 15 - step]] = True
        feeds = {"new": rng.standard_normal((3, 1, 2, 8)).astype(np.float32), "write": write}
        want = rt.reference(g, {"cache": state, **feeds})
        cg.load({"cache": state, **feeds} if step == 0 else feeds)  # the cache carried between steps
        cg.execute()
        for name in ("read", "old"):  # (sums over a split axis: float32 in another order)
            np.testing.assert_allclose(cg.offload(name), want[name], rtol=1e-6, atol=1e-6)
        state = np.where(write, feeds["new"], state)
        np.testing.assert_array_equal(cg.offload("cache"), state)  # selected, not computed: the same bits


@pytest.mark.parametrize("p", [1, 2])
def test_a_selected_next_value_keeps_its_own_block_when_phases_reorder_the_tasks(p: int) -> None:
    """A reader of the old cache that needs a second-phase input runs after the first phase's ``where``: the
    ``where`` must not have overwritten the cache by then, so it writes its own block and the assign copies
    it.  (The NumPy executor keeps a next value aside until the run ends, so only the plan shows this.)"""
    g = rt.Graph()
    cache = g.state("cache", [3, 16, 2, 8], "float32")
    new = g.input("new", [3, 1, 2, 8], "float32")
    write = g.input("write", [3, 16, 1, 1], "bool")
    dy = g.input("dy", [3, 16, 2, 8], "float32")
    g.save(g.sum(g.mul(cache, dy), axis=1), name="old")  # read before the write, but in the second phase
    written = g.where(write, new, cache)
    g.save(g.sum(written, axis=3), name="read")
    g.assign(cache, written)
    cg = rt.compileGraph(g, device=f"cpu:{p}", second_phase_inputs=["dy"])
    kept = {b for _, b in cg.dag.inputs["cache"]}
    assert [t for t in cg.dag.tasks if t.kind == "assign"]
    assert not [t for t in cg.dag.tasks if t.kind == "kernel" and cg.dag.root(t.outputs[0]) in kept]
    rng = np.random.default_rng(p)
    feeds = {"cache": rng.standard_normal((3, 16, 2, 8)).astype(np.float32),
             "new": rng.standard_normal((3, 1, 2, 8)).astype(np.float32),
             "write": np.eye(16, dtype=bool)[[2, 7, 11]][:, :, None, None],
             "dy": rng.standard_normal((3, 16, 2, 8)).astype(np.float32)}
    want = rt.reference(g, feeds)
    cg.load(feeds)
    cg.execute()
    for name in ("old", "read"):
        np.testing.assert_allclose(cg.offload(name), want[name], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cg.offload("cache"), np.where(feeds["write"], feeds["new"], feeds["cache"]))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_atoms_cut_from_a_value_written_in_place_read_the_new_value(p: int) -> None:
    """The where's output, written into the kept block, redistributed for a reader that splits it another
    way: the atoms cut from it (views of a view of the kept block) hold the new value on every executor."""
    g = rt.Graph()
    cache = g.state("cache", [8, 16], "float32")
    new = g.input("new", [8, 16], "float32")
    write = g.input("write", [8, 16], "bool")
    written = g.where(write, new, cache)
    g.assign(cache, written)
    g.save(g.sum(written, axis=0), name="columns")
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    rng = np.random.default_rng(0)
    feeds = {"cache": rng.standard_normal((8, 16)).astype(np.float32),
             "new": rng.standard_normal((8, 16)).astype(np.float32), "write": rng.random((8, 16)) < 0.5}
    want = rt.reference(g, feeds)
    cg.load(feeds)
    cg.execute()
    np.testing.assert_allclose(cg.offload("columns"), want["columns"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cg.offload("cache"), want["cache.next"])

"""The array-form liveness (``physical.tasks.liveness``) against a task-by-task walk of the same rules.

A whole model's DAG has millions of tasks, so the liveness pass runs on arrays (scatter-max last uses,
running sums of births and deaths per device).  The walk below is the definition it must equal: every
buffer's last use, each device's resident and peak bytes, and the split of each peak by category, on the
plans of every operator case, of a training step with states kept as read and sharded, and with kernel
scratch at random tasks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping

import numpy as np
import pytest
from cases import CASES

import relational_tensors as rt
from relational_tensors.graph.models import llama_training_graph
from relational_tensors.physical.tasks import Liveness, TaskDAG, graph_liveness, liveness, reshape_shares


def loop_liveness(dag: TaskDAG, category: Callable[[int], str] | None = None,
             shares: Mapping[int, int] | None = None, scratch: Mapping[int, int] | None = None) -> Liveness:
    """The liveness walked task by task: the definition the array form must equal."""
    buffers, tasks = dag.buffers, dag.tasks
    root = dag.view_roots(shares)
    views = frozenset(root)
    persistent = {b for blocks in dag.inputs.values() for _, b in blocks}
    persistent |= {b for blocks in dag.outputs.values() for _, b in blocks}
    persistent |= {root[b] for b in persistent if b in root}
    end = len(tasks)
    # a view of a reshape output is read through that output (an executor holds its value), so the
    # reshape output lives as long as its views too
    through = {b: p for b in root if buffers[b].parent is not None and (p := dag.root(b)) in root}
    # task ids increase, so a buffer's last use is the last task naming it (or a view of it)
    last_use: dict[int, int] = {}
    born: dict[int, int] = {}
    for t in tasks:
        tid = t.id
        for b in t.inputs:
            last_use[b] = tid
            r = root.get(b)
            if r is not None:
                last_use[r] = tid
                if b in through:
                    last_use[through[b]] = tid
        for b in t.outputs:
            r = root.get(b)
            if r is None:
                born.setdefault(b, tid)
                last_use[b] = tid
            else:
                born.setdefault(r, tid)
                last_use.setdefault(b, tid)  # written but never read: dies right away
                last_use[r] = tid
    for b in persistent:
        last_use[b] = end
    resident: dict[int, int] = defaultdict(int)
    loaded = [b for b in persistent if b in buffers and b not in views and born.get(b) is not None
              and tasks[born[b]].kind == "load"]
    for b in loaded:
        resident[buffers[b].device] += buffers[b].nbytes
    live: dict[int, int] = defaultdict(int, resident)
    peak: dict[int, int] = defaultdict(int, resident)
    by: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # device -> category -> live bytes
    at_peak: dict[int, dict[str, int]] = {}
    if category is not None:
        for b in loaded:
            by[buffers[b].device][category(buffers[b].tensor)] += buffers[b].nbytes
        at_peak = {d: dict(c) for d, c in by.items()}
    dies: dict[int, list[int]] = defaultdict(list)
    for b, last in last_use.items():
        if b not in persistent and b not in views:
            dies[last].append(b)
    counted: set[int] = set(loaded)  # resident already (a reshape of a loaded block takes no more)
    for t in tasks:
        if t.kind == "load":
            continue
        if t.kind != "assign":  # an assign writes a loaded (resident) block
            for b in t.outputs:
                r = root.get(b, b)
                if r in counted:
                    continue
                counted.add(r)
                buf = buffers[r]
                d = buf.device
                live[d] += buf.nbytes
                if category is not None:
                    by[d][category(buf.tensor)] += buf.nbytes
                    if live[d] > peak[d]:
                        at_peak[d] = dict(by[d])
                if live[d] > peak[d]:
                    peak[d] = live[d]
        extra = scratch.get(t.id, 0) if scratch else 0
        if extra and live[t.device] + extra > peak[t.device]:
            peak[t.device] = live[t.device] + extra
            if category is not None:
                held = dict(by[t.device])
                held["other"] = held.get("other", 0) + extra
                at_peak[t.device] = held
        gone = dies.get(t.id)
        if gone:
            for b in gone:
                buf = buffers[b]
                live[buf.device] -= buf.nbytes
                if category is not None:
                    by[buf.device][category(buf.tensor)] -= buf.nbytes
    for d in range(dag.p):
        peak.setdefault(d, 0)
        resident.setdefault(d, 0)
    return Liveness(last_use, frozenset(persistent), dict(peak), dict(resident), views, at_peak, dict(shares or {}))


def same(dag: TaskDAG, category: Callable[[int], str] | None = None, scratch: Mapping[int, int] | None = None) -> None:
    shares = reshape_shares(dag)
    got = liveness(dag, category, shares, scratch)
    want = loop_liveness(dag, category, shares, scratch)
    assert got.last_use == want.last_use
    assert got.persistent == want.persistent and got.views == want.views
    assert got.resident == want.resident
    assert {d: v for d, v in got.peak.items()} == {d: v for d, v in want.peak.items()}
    drop = {d: {c: v for c, v in parts.items() if v} for d, parts in want.at_peak.items()}
    assert {d: {c: v for c, v in parts.items() if v} for d, parts in got.at_peak.items()} == drop
    # (the order a task's frees are listed in is free: an executor drops them all after the task)
    assert {t: sorted(bs) for t, bs in got.frees_after().items()} == \
        {t: sorted(bs) for t, bs in want.frees_after().items()}


def scratch_at(dag: TaskDAG, seed: int) -> dict[int, int]:
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(dag.tasks), size=min(len(dag.tasks), 40), replace=False)
    return {int(t): int(rng.integers(1, 1 << 20)) for t in picked}


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_plans(case: str) -> None:
    graph, _ = CASES[case]("float32")
    cg = rt.compileGraph(graph, device="cpu:3")
    categories = graph.memory_categories().__getitem__
    same(cg.lowered.dag)
    same(cg.lowered.dag, categories, scratch_at(cg.lowered.dag, len(case)))


@pytest.mark.parametrize("keep", ["as read", "sharded"])
@pytest.mark.parametrize("p", [1, 4, 5])
def test_a_training_step(p: int, keep: str) -> None:
    g = llama_training_graph(2, 24, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, vocab=40, layers=2,
                             dtype="float32", optimizer="adamw")
    cg = rt.compileGraph(g, device=f"cpu:{p}", keep_states=keep)
    categories = g.memory_categories().__getitem__
    same(cg.lowered.dag, categories)
    same(cg.lowered.dag, categories, scratch_at(cg.lowered.dag, p))
    live = graph_liveness(g, cg.lowered.dag, categories=True)
    assert isinstance(live, Liveness) and max(live.peak.values()) > 0


def test_a_pipelined_training_step() -> None:
    g = llama_training_graph(4, 16, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, vocab=40, layers=2,
                             dtype="float32", optimizer="adamw")
    cg = rt.compileGraph(g, device="cpu:4", pipeline=rt.Pipeline(2, 4, "1f1b"))
    same(cg.lowered.dag, g.memory_categories().__getitem__, scratch_at(cg.lowered.dag, 7))

"""Elementwise task fusion in the GPU executor (``gpu_exec/fusion.py``, ``gpu_exec/kernels/triton_fused.py``).

1. The grouping, a pure function of the DAG and its memory plan, on real training steps (AdamW with float32
   master weights) and on random elementwise graphs, for 1, 2 and 4 devices: a simulation of the arenas
   byte by byte, where every write leaves a token made from the tokens its task read, runs the program
   unfused and fused (each group at its last task, reading its operands from memory then, writing only
   its outputs) and finds every task reading the same tokens, the saved outputs and states ending the
   same; every cross-stream wait is issued after the event it waits for; AdamW's update of a parameter
   block is one or two groups.
2. The generated kernels, in Triton's interpreter on CPU memory (on the GPU where there is one), against
   the unfused launchers, bit for bit: the whole program run task by task on arenas laid out by the
   memory plan, unfused and fused, for float32, bfloat16 and float16 chains with casts, broadcasts of [1]
   and of strided operands, saved intermediates, and three AdamW steps.
3. On a GPU (marked ``gpu``): a small training step on cuda:0 and cuda:0,0,0,0 with fusion on and off,
   the same bits after three steps, the program captured into a CUDA graph.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relational_tensors.machine.devices import visible_gpus

GPU = visible_gpus() > 0
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: its kernels run on CPU

import relational_tensors as rt  # noqa: E402
from relational_tensors.core.dtypes import itemsize, numpy_dtype  # noqa: E402
from relational_tensors.graph.models import llama_training_feeds, llama_training_graph  # noqa: E402
from relational_tensors.graph.optim import adamw  # noqa: E402
from relational_tensors.kernels.common import contiguous_strides  # noqa: E402
from relational_tensors.kernels.fused_expr import FusedExpr  # noqa: E402
from relational_tensors.physical.tasks import TaskDAG  # noqa: E402
from relational_tensors.runtime.fusion import FusedSchedule, FusionGroup, fusion_enabled, fusion_groups, fusion_plan  # noqa: E402
from relational_tensors.runtime.memory_plan import (  # noqa: E402
    SIBLINGS,
    MemoryPlan,
    align,
    buffer_bytes,
    plan_memory,
    sibling_tasks,
    view_geometry,
)

# the interpreter computes masked-off lanes too (rsqrt and log2 of the zeros loaded there)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*")

# ------------------------------------------------------------------ 1. the grouping, pure


def training_step(device: str) -> rt.CompiledGraph:
    """A one-layer language model's training step, bfloat16 weights, AdamW on float32 master weights."""
    return _training_step(device)


@functools.cache
def _training_step(device: str) -> rt.CompiledGraph:
    g = llama_training_graph(2, 16, 32, 4, 2, 64, 64, dtype="bfloat16", optimizer="adamw", master_dtype="float32")
    return rt.compileGraph(g, device=device)


def planned(cg: rt.CompiledGraph) -> tuple[MemoryPlan, list[FusionGroup]]:
    """The memory plan the fused program runs on, and its groups, as the executor makes them."""
    return fusion_plan(cg.dag, cg.live)


def _token(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


class Arenas:
    """Every device's arena as one token per byte: a task's write leaves a token made of its task, its
    output and the tokens it read, on the very bytes the memory plan gives the block (a view's strided
    elements only)."""

    def __init__(self, dag: TaskDAG, plan: MemoryPlan) -> None:
        self.dag, self.plan = dag, plan
        self.geo = view_geometry(dag, plan)
        # roots outside the arena (bound inputs) get bytes of their own past the arena's end
        ends = dict(plan.arena_bytes)
        self.outside: dict[int, int] = {}
        for r in sorted(plan.external):
            d = dag.buffers[r].device
            self.outside[r] = ends[d]
            ends[d] += align(buffer_bytes(dag, r)[0])
        self.mem = {d: np.zeros(max(n, 1), np.int64) for d, n in ends.items()}
        self._cells: dict[int, np.ndarray] = {}

    def cells(self, b: int) -> np.ndarray:
        found = self._cells.get(b)
        if found is not None:
            return found
        buf = self.dag.buffers[b]
        root = self.plan.root(b)
        base = self.outside[root] if root in self.outside else self.plan.slots[root].offset
        size = itemsize(buf.dtype)
        offset, strides = self.geo.get(b, (0, contiguous_strides(buf.box.shape)))
        elements = np.full((), offset, np.int64)
        for n, s in zip(buf.box.shape, strides):
            elements = elements[..., None] + np.arange(n, dtype=np.int64) * s
        cells = (base + elements.reshape(-1)[:, None] * size + np.arange(size)).reshape(-1)
        if buf.partial == "lse":  # and its float32 row values after the block
            main = buf.box.volume * size
            rows = buf.box.volume // buf.box.shape[-1] if buf.box.shape[-1] else 0
            cells = np.concatenate([cells, base + align(main) + np.arange(rows * 4)])
        self._cells[b] = cells
        return cells

    def read(self, b: int) -> int:
        return _token(self.mem[self.dag.buffers[b].device][self.cells(b)].tobytes())

    def write(self, b: int, token: int) -> None:
        self.mem[self.dag.buffers[b].device][self.cells(b)] = token

    def as_read(self, b: int, token: int) -> int:
        """What ``read(b)`` gives after ``write(b, token)``: a value a fused kernel keeps in registers."""
        return _token(np.full(len(self.cells(b)), token, np.int64).tobytes())


def simulate(dag: TaskDAG, plan: MemoryPlan, groups: list[FusionGroup], runs: int = 2
             ) -> tuple[dict[tuple[int, int], tuple[int, ...]], dict[int, int]]:
    """(per run and task, the tokens it computes from; per loaded or saved buffer, its final token) of the
    program issued in task order, each group at its last task."""
    arenas = Arenas(dag, plan)
    for blocks in dag.inputs.values():
        for _, b in blocks:
            arenas.write(b, _token("load", b))
    at = {g.last: g for g in groups}
    deferred = {m for g in groups for m in g.tasks[:-1]}
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    for run in range(runs):
        for t in dag.tasks:
            if t.kind == "load" or t.id in deferred:
                continue
            group = at.get(t.id)
            if group is None:
                ins = tuple(arenas.read(b) for b in t.inputs)
                seen[(run, t.id)] = ins
                for k, o in enumerate(t.outputs):
                    arenas.write(o, _token(t.id, k, ins))
                continue
            values = {b: arenas.read(b) for b in group.operands}  # read when the fused kernel runs
            made: dict[int, int] = {}
            written = {dag.tasks[m].outputs[0]: m for m in group.tasks}
            for m in group.tasks:
                member = dag.tasks[m]
                ins = tuple(made[b] if b in made else values[b] for b in member.inputs)
                seen[(run, m)] = ins
                made[member.outputs[0]] = arenas.as_read(member.outputs[0], _token(m, 0, ins))
            for o in group.outputs:
                arenas.write(o, _token(written[o], 0, seen[(run, written[o])]))
    kept = {b for blocks in (*dag.inputs.values(), *dag.outputs.values()) for _, b in blocks}
    return seen, {b: arenas.read(b) for b in sorted(kept)}


def check_groups(cg: rt.CompiledGraph, plan: MemoryPlan, groups: list[FusionGroup]) -> None:
    """The fused program computes what the unfused one does, and every cross-stream wait follows its event."""
    dag = cg.dag
    members = [m for g in groups for m in g.tasks]
    assert len(members) == len(set(members)), "a task in two groups"
    for g in groups:
        assert list(g.tasks) == sorted(g.tasks) and len(g.tasks) > 1
        assert {dag.tasks[m].device for m in g.tasks} == {g.device}
        assert all(dag.buffers[dag.tasks[m].outputs[0]].box.shape == g.shape for m in g.tasks)
        if dag.phase_split is not None:
            assert len({m < dag.phase_split for m in g.tasks}) == 1, "a group across the phases"
    want, want_kept = simulate(dag, plan, [])
    got, got_kept = simulate(dag, plan, groups)
    assert got.keys() <= want.keys()
    wrong = sorted(k for k in got if got[k] != want[k])
    assert not wrong, f"tasks reading other values when fused: {[(r, dag.tasks[t].label) for r, t in wrong[:5]]}"
    assert got_kept == want_kept
    # issue order: a group at its last task, waiting for all its members' waits
    issued = {m: g.last for g in groups for m in g.tasks}
    for t in dag.tasks:
        for w in plan.waits.get(t.id, ()):
            if issued.get(w, w) == issued.get(t.id, t.id):
                continue
            assert issued.get(w, w) < issued.get(t.id, t.id), (w, t.id)


@pytest.mark.parametrize("device", ["cpu:1", "cpu:2", "cpu:4"])
def test_groups_of_a_training_step_keep_the_program(device: str) -> None:
    cg = training_step(device)
    plan, groups = planned(cg)
    assert groups
    check_groups(cg, plan, groups)


@pytest.mark.parametrize("device", ["cpu:1", "cpu:2", "cpu:4"])
def test_groups_keep_the_program_with_weights_outside_the_arena(device: str) -> None:
    """Weights bound to the caller's arrays (``compileGraph``'s ``bind``) have no slot: the fused program
    still computes what the unfused one does, reading them where they lie."""
    g = llama_training_graph(2, 16, 32, 4, 2, 64, 64, dtype="bfloat16")
    cg = rt.compileGraph(g, device=device)
    dag = cg.dag
    external = frozenset(b for n in dag.input_nodes if n.role == "parameter" for _, b in dag.inputs[n.name])
    plan, groups = fusion_plan(dag, cg.live, external=external)
    assert external and not external & set(plan.slots)
    assert sum(plan.arena_bytes.values()) < sum(planned(cg)[0].arena_bytes.values())
    assert groups
    check_groups(cg, plan, groups)


@pytest.mark.parametrize("device", ["cpu:1", "cpu:2", "cpu:4"])
def test_adamw_update_is_one_or_two_kernels_per_block(device: str) -> None:
    cg = training_step(device)
    _, groups = planned(cg)
    dag = cg.dag
    of = {m: i for i, g in enumerate(groups) for m in g.tasks}
    # the assigns of one parameter block: its moments and its master weights (and the rounded parameter,
    # whose block may be delivered by an exchange instead of made in place)
    blocks: dict[tuple[str, int], list[int]] = {}
    for t in dag.tasks:
        if t.kind == "assign" and t.label != "assign adamw.step":
            name = t.label.removeprefix("assign ")
            blocks.setdefault((name.split(".master")[0], t.device), []).append(t.id)
    assert blocks
    for (name, device_id), assigns in blocks.items():
        masters = [a for a in assigns if ".master" in dag.tasks[a].label]
        if device == "cpu:1":  # one device: every assign is written by its fused kernel
            masters = assigns
        assert all(a in of for a in masters), f"{name} on device {device_id}: an assign left unfused"
        kernels = {of[a] for a in masters}
        # (on 4 devices the plan spreads one block's update over several devices, with copies between)
        if device != "cpu:4":
            assert len(kernels) <= 2, f"{name} on device {device_id}: its update is {len(kernels)} fused kernels"
    # the update's elementwise kernels are fused, the gradient's cast to float32 and the decayed master
    # weights too (the plan keeps the blocks they read until their group runs); a few scalar ones stay
    update = [t for t in dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].name.startswith("optim.")
              and cg.graph.nodes[t.op].kind in ("unary", "binary")]
    large = [t.id for t in update if math.prod(dag.buffers[t.outputs[0]].box.shape) > 1]
    assert sum(t in of for t in large) >= 0.95 * len(large), [t for t in large if t not in of]


@pytest.mark.parametrize("device", ["cpu:1", "cpu:2", "cpu:4"])
def test_the_fused_program_keeps_blocks_without_raising_a_peak(device: str) -> None:
    """The fused program's plan keeps what its groups read until they run, never past a device's peak of live
    bytes without fusion, and takes groups the plain plan cannot (the memory they read is reused by then)."""
    from relational_tensors.runtime.fusion import _peak

    cg = training_step(device)
    plain = plan_memory(cg.dag, cg.live)
    plan, groups = planned(cg)
    for d in range(cg.dag.p):
        roots = [r for r in plain.lifetimes if cg.dag.buffers[r].device == d]
        assert _peak(plan, roots, {})[0] <= _peak(plain, roots, {})[0]
    fused = {m for g in groups for m in g.tasks}
    alone = {m for g in fusion_groups(cg.dag, plain, cg.live) for m in g.tasks}
    assert len(fused) > len(alone)


def test_groups_read_and_write_in_place_only_where_safe() -> None:
    """A fused AdamW kernel reads a moment and writes its next value into the same block (no copy)."""
    cg = training_step("cpu:1")
    _, groups = planned(cg)
    dag = cg.dag
    in_place = [g for g in groups if set(g.operands) & set(g.outputs)]
    assert in_place
    for g in in_place:
        for b in set(g.operands) & set(g.outputs):
            assert any(dag.tasks[m].kind == "assign" and dag.tasks[m].outputs[0] == b for m in g.tasks)


def test_a_group_never_spans_the_phases() -> None:
    g = rt.Graph()
    x = g.input("x", [8, 16])
    w = g.input("w", [8, 16])
    dy = g.input("dy", [8, 16])
    h = g.unary(g.mul(x, w), "scale", 0.5)
    g.save(g.unary(g.add(h, dy), "square"), name="y")
    cg = rt.compileGraph(g, device="cpu:2", second_phase_inputs=["dy"])
    plan, groups = planned(cg)
    assert cg.dag.phase_split is not None
    check_groups(cg, plan, groups)


def test_fusion_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELATIONAL_TENSORS_FUSE", raising=False)
    assert fusion_enabled() and not fusion_enabled(False)
    monkeypatch.setenv("RELATIONAL_TENSORS_FUSE", "0")
    assert not fusion_enabled() and fusion_enabled(True)


UNARY = ["relu", "neg", "abs", "square", "scale", "add_scalar", "exp", "sigmoid", "silu", "sqrt", "rsqrt", "pow",
         "fill"]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
SHAPE = (4, 6, 8)


def random_graph(draw: Callable[..., Any], dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")) -> rt.Graph:
    """Elementwise chains over a few inputs of one shape and broadcast ones ([1], [6, 1], [8]), with casts,
    outputs saved midway, a reduction and a matmul reading intermediates, and a state assigned."""
    g = rt.Graph()
    dtype = draw(st.sampled_from(dtypes))
    full = [g.input(f"x{i}", list(SHAPE), dtype) for i in range(2)]
    small = [g.input("s", [1], dtype), g.input("col", [6, 1], dtype), g.input("row", [8], dtype)]
    state = g.state("acc", list(SHAPE), dtype)
    values = [*full, state]
    for i in range(draw(st.integers(3, 14))):
        what = draw(st.sampled_from(["unary", "binary", "broadcast", "cast", "save", "other"]))
        x = values[draw(st.integers(0, len(values) - 1))]
        if what == "unary":
            op = draw(st.sampled_from(UNARY))
            if op in ("sqrt", "rsqrt", "pow"):
                x = g.unary(g.unary(x, "abs"), "add_scalar", 0.5)
            arg = {"scale": 0.37, "add_scalar": -0.25, "pow": 1.5, "fill": 2.0}.get(op, 0.0)
            values.append(g.unary(x, op, arg))
        elif what in ("binary", "broadcast"):
            y = values[draw(st.integers(0, len(values) - 1))] if what == "binary" else \
                small[draw(st.integers(0, len(small) - 1))]
            y = y if y.dtype == x.dtype else g.cast(y, x.dtype)
            op = draw(st.sampled_from(BINARY))
            if op == "div":
                y = g.unary(g.unary(y, "abs"), "add_scalar", 1.0)
            values.append(g.binary(x, y, op) if draw(st.booleans()) else g.binary(y, x, op))
        elif what == "cast":
            values.append(g.cast(x, draw(st.sampled_from(["float32", "bfloat16", "float16"]))))
        elif what == "save" and x is not state:  # (saving a state it assigns: not planned on 2 devices yet)
            g.save(x, name=f"mid{i}")
        elif what == "other":
            g.save(g.sum(x, axis=2), name=f"sum{i}")
    last = values[-1] if values[-1] is not state else g.unary(state, "neg")
    g.assign(state, last if last.dtype == dtype else g.cast(last, dtype))
    g.save(last, name="out")
    return g


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_groups_of_random_elementwise_graphs_keep_the_program(data: st.DataObject) -> None:
    g = random_graph(data.draw)
    device = data.draw(st.sampled_from(["cpu:1", "cpu:2", "cpu:3", "cpu:4"]))
    cg = rt.compileGraph(g, device=device)
    plan, groups = planned(cg)
    check_groups(cg, plan, groups)


# ------------------------------------------------------------------ 2. the kernels, bit for bit

KERNEL_MODULES = ("triton_elementwise", "triton_copy", "triton_norms", "triton_fused", "triton_attention",
                  "triton_attention_grad", "triton_elementwise_grad", "triton_norms_grad")


class HostArenas:
    """Each device's arena in CPU memory for Triton's interpreter (or in GPU memory, with a GPU): ``ptr``
    stands in for the kernels' ``Ptr`` and hands the interpreter a torch view that starts at the pointer."""

    def __init__(self, plan: MemoryPlan) -> None:
        import torch

        self.torch = torch
        self.gpu = GPU
        self.blocks = {d: self.alloc(n) for d, n in plan.arena_bytes.items()}
        self.extra: list[Any] = []

    def alloc(self, nbytes: int) -> Any:
        t = self.torch.zeros(max(nbytes, 256), dtype=self.torch.uint8, device="cuda" if self.gpu else "cpu")
        return t

    def scratch(self, nbytes: int) -> int:
        t = self.alloc(nbytes)
        self.extra.append(t)
        return int(t.data_ptr())

    def _find(self, addr: int) -> tuple[Any, int]:
        for t in (*self.blocks.values(), *self.extra):
            base = t.data_ptr()
            if base <= addr <= base + t.numel():
                return t, addr - base
        raise AssertionError(f"pointer {addr:#x} lies in no arena")

    def ptr(self, buf: Any, dtype: str | None = None) -> Any:
        torch = self.torch
        addr, name = (buf.ptr, dtype or buf.dtype) if hasattr(buf, "ptr") else (int(buf), dtype or "float32")
        kinds = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64, "bool": torch.int8,
                 "int8": torch.int8}
        t, off = self._find(addr)
        size = 1 if name in ("bool", "int8") else itemsize(name)
        return t[off:off + (t.numel() - off) // size * size].view(kinds[name])

    def write(self, addr: int, data: np.ndarray) -> None:
        t, off = self._find(addr)
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        t[off:off + raw.size] = self.torch.from_numpy(raw.copy()).to(t.device)

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        t, off = self._find(addr)
        return t[off:off + nbytes].cpu().numpy().copy()


class HostProgram:
    """A compiled program run task by task on ``HostArenas``, as the CuPy executor runs it: the unfused
    tasks through their launchers, or each group's generated kernel at its last task."""

    def __init__(self, cg: rt.CompiledGraph, fused: bool, siblings: tuple[str, ...] = SIBLINGS) -> None:
        from relational_tensors.kernels.common import DevBuf
        from relational_tensors.kernels.launchers import scratch_bytes, task_scratch

        self.cg, self.dag = cg, cg.dag
        done_by = sibling_tasks(cg.dag, siblings) if siblings else {}
        # a kernel that writes a sibling's output too -> the sibling (its scratch may differ)
        self.sibling_of = {w: s for s, w in done_by.items()}
        self.needs = task_scratch(cg.dag)
        if fused:  # as the executor plans it when it fuses: kernel scratch in the arena too
            self.plan = fusion_plan(cg.dag, cg.live, done_by, scratch_bytes(self.needs))[0]
        else:
            self.plan = plan_memory(cg.dag, cg.live, done_by)
        assert self.plan.done_by == done_by
        self.mem = HostArenas(self.plan)
        self.views: dict[int, Any] = {}
        for b, buf in self.dag.buffers.items():
            if b not in self.plan.alias:
                assert buf.partial != "lse"
                ptr = self.mem.blocks[buf.device].data_ptr() + self.plan.slots[b].offset
                self.views[b] = DevBuf(ptr, buf.box.shape, buf.dtype, buf.device)
        for b, (offset, strides) in view_geometry(self.dag, self.plan).items():
            buf = self.dag.buffers[b]
            root = self.views[self.plan.alias[b]]
            self.views[b] = DevBuf(root.ptr + offset * itemsize(buf.dtype), buf.box.shape, buf.dtype, buf.device,
                                   strides)
        self.fused = fused

    def schedule(self) -> FusedSchedule | None:
        """The executor's schedule of the groups over these views (made once the kernels' ``Ptr`` is set)."""
        if self.fused and not hasattr(self, "_schedule"):
            self._schedule = FusedSchedule.build(self.dag, self.plan, self.cg.live, self.views)
        return self._schedule if self.fused else None

    @property
    def groups(self) -> list[FusionGroup]:
        sched = self.schedule()
        return sched.groups if sched is not None else []

    def load(self, feeds: dict[str, np.ndarray]) -> None:
        for name, blocks in self.dag.inputs.items():
            dtype = self.cg.graph.node(name).type.dtype
            value = np.asarray(feeds[name]).astype(numpy_dtype(dtype))
            for box, b in blocks:
                self.mem.write(self.views[b].ptr, np.ascontiguousarray(value[box.slices()]))

    def block(self, b: int) -> np.ndarray:
        v = self.views[b]
        raw = self.mem.read(v.ptr, v.nbytes)
        return raw.view(numpy_dtype(v.dtype)).reshape(v.shape)

    def saved(self, name: str) -> np.ndarray:
        """A saved output assembled from its blocks."""
        t = self.cg.graph.nodes[self.cg.graph.outputs[name]].type
        out = np.zeros(t.shape, numpy_dtype(t.dtype))
        for box, b in self.dag.outputs[name]:
            out[box.slices()] = self.block(b)
        return out

    def kept(self) -> dict[str, list[np.ndarray]]:
        """Every saved output's blocks and every loaded block (states after their assigns), as they lie."""
        out = {f"out:{n}": [self.block(b) for _, b in blocks] for n, blocks in self.dag.outputs.items()}
        out.update({f"in:{n}": [self.block(b) for _, b in blocks] for n, blocks in self.dag.inputs.items()})
        return out

    def execute(self) -> None:
        """Every task in order, as ``CupyExecutor._issue_all`` issues them (on one stream)."""
        sched = self.schedule()
        for t in self.dag.tasks:
            if t.kind == "load" or (sched is not None and t.id in sched.deferred):
                continue
            fused = sched.at.get(t.id) if sched is not None else None
            if fused is not None:
                assert set(fused.waits) <= {w for m in fused.group.tasks for w in self.plan.waits[m]}
                fused.launch()
            else:
                self._run(t)

    def _run(self, t: Any) -> None:
        from relational_tensors.kernels import triton_copy as tc
        from relational_tensors.kernels import triton_elementwise as te
        from relational_tensors.kernels.common import DevBuf
        from relational_tensors.kernels.launchers import launcher_for, op_constants

        views = self.views
        if t.kind == "kernel":
            if t.outputs[0] in self.plan.reshaped or t.id in self.plan.done_by:
                return  # an aliased reshape; an lse its forward wrote
            node = self.cg.graph.nodes[t.op]
            consts: dict[str, Any] = {}
            for name, host in op_constants(node.op).items():
                ptr = self.mem.scratch(host.nbytes)
                self.mem.write(ptr, host)
                consts[name] = DevBuf(ptr, host.shape, str(host.dtype), 0)
            sib = self.sibling_of.get(t.id)
            if sib is not None:  # the sibling's operator and blocks, as the executor passes them
                sib_task = self.dag.tasks[sib]
                consts["sibling"] = (self.cg.graph.nodes[sib_task.op].op, sib_task.kernel.function)
            need = self.needs.get(t.id)
            if need is not None:
                shape, dtype = need
                slot = self.plan.scratch.get(t.id)  # in the arena during the task, as the executor places it
                ptr = self.mem.blocks[t.device].data_ptr() + slot.offset if slot is not None else \
                    self.mem.scratch(math.prod(shape) * itemsize(dtype))
                consts["scratch"] = DevBuf(ptr, tuple(shape), dtype, 0)
            out = views[t.outputs[0]]
            if t.id in self.plan.also_writes:  # a sibling task's output too (the lse of a forward attention)
                out = (out, views[self.plan.also_writes[t.id]])
            launcher_for(node.kind).launch(node.op, t.kernel.function, [views[b] for b in t.inputs], out, consts, 0)
        elif t.kind in ("copy", "assign", "recompose") and len(t.inputs) == 1 and \
                views[t.inputs[0]].shape == views[t.outputs[0]].shape:
            tc.copy_box(views[t.inputs[0]], views[t.outputs[0]])
        elif t.kind == "decompose":
            src, src_buf = views[t.inputs[0]], self.dag.buffers[t.inputs[0]]
            for cell, b in zip(t.payload.cells, t.outputs):
                tc.copy_box(src.sub(tuple(c - s for c, s in zip(cell.lower, src_buf.box.lower)), cell.shape),
                            views[b])
        elif t.kind == "recompose":
            out, out_buf = views[t.outputs[0]], self.dag.buffers[t.outputs[0]]
            for cell, b in zip(t.payload.cells, t.inputs):
                tc.copy_box(views[b], out.sub(tuple(c - s for c, s in zip(cell.lower, out_buf.box.lower)),
                                              cell.shape))
        elif t.kind == "aggregate":
            ins, out = [views[b] for b in t.inputs], views[t.outputs[0]]
            op = {"sum": "add", "max": "maximum", "min": "minimum"}[t.payload.aggregation.name]
            te.binary(ins[0], ins[1], out, op)
            for x in ins[2:]:
                te.binary(out, x, out, op)
        else:
            raise AssertionError(f"task kind {t.kind}")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Callable[..., HostProgram]:
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    import importlib

    programs: list[HostProgram] = []

    def make(cg: rt.CompiledGraph, fused: bool, siblings: tuple[str, ...] = SIBLINGS) -> HostProgram:
        prog = HostProgram(cg, fused, siblings)
        for name in KERNEL_MODULES:
            module = importlib.import_module(f"relational_tensors.kernels.{name}")
            if GPU:
                from relational_tensors.kernels.common import bind_triton_to_cupy

                bind_triton_to_cupy()
            else:
                monkeypatch.setattr(module, "Ptr", prog.mem.ptr)
        programs.append(prog)
        return prog

    return make


def run_both(host: Callable[[rt.CompiledGraph, bool], HostProgram], cg: rt.CompiledGraph,
             feeds: dict[str, np.ndarray], steps: int = 1) -> tuple[HostProgram, HostProgram]:
    """The program unfused and fused, ``steps`` executions each on one load; every kept block bit for bit."""
    runs = []
    for fused in (False, True):
        prog = host(cg, fused)
        prog.load(feeds)
        for _ in range(steps):
            prog.execute()
        runs.append(prog)
    plain, fused_run = runs
    assert fused_run.groups, "nothing was fused"
    want, got = plain.kept(), fused_run.kept()
    for name in want:
        for a, b in zip(want[name], got[name]):
            assert a.tobytes() == b.tobytes(), f"{name} differs when fused"
    return plain, fused_run


def _values(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n.name: (rng.standard_normal(n.type.shape) * 2.0).astype(numpy_dtype(n.type.dtype)) for n in g.inputs}


def chain(dtype: str) -> rt.Graph:
    """Casts between the three float dtypes, [1], column and row broadcasts, every fused unary op, a
    saved intermediate and one a reduction reads, and a state assigned."""
    g = rt.Graph()
    x = g.input("x", list(SHAPE), dtype)
    y = g.input("y", list(SHAPE), dtype)
    s = g.input("s", [1], "float32")
    col = g.input("col", [6, 1], dtype)
    row = g.input("row", [8], "float16")
    acc = g.state("acc", list(SHAPE), "float32")
    a = g.cast(x, "float32")
    a = g.unary(g.add(g.unary(a, "scale", 0.3), s), "square")
    b = g.cast(g.mul(g.cast(a, dtype), col), "float16")
    b = g.unary(g.sub(b, row), "silu")
    g.save(b, name="mid")
    c = g.cast(g.binary(g.cast(b, dtype), y, "maximum"), "bfloat16")
    c = g.unary(g.unary(g.unary(c, "abs"), "add_scalar", 0.25), "sqrt")
    d = g.div(g.unary(c, "rsqrt"), g.unary(g.unary(g.cast(y, "bfloat16"), "sigmoid"), "add_scalar", 0.5))
    g.save(g.sum(g.cast(d, "float32"), axis=2), name="rows")
    e = g.unary(g.unary(g.unary(d, "pow", 1.5), "exp"), "neg")
    f = g.binary(g.unary(g.cast(e, "float32"), "relu"), g.unary(a, "fill", 2.0), "minimum")
    g.assign(acc, g.add(acc, f))
    g.save(g.cast(f, dtype), name="out")
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device", ["cpu:1", "cpu:2"])
def test_fused_kernels_match_the_launchers_bit_for_bit(host: Any, dtype: str, device: str) -> None:
    g = chain(dtype)
    cg = rt.compileGraph(g, device=device)
    feeds = _values(g)
    feeds["acc"] = np.zeros(SHAPE, np.float32)
    plain, fused = run_both(host, cg, feeds, steps=2)
    kinds = " ".join(gr.kind for gr in fused.groups)
    assert "binary" in kinds and "unary" in kinds and "assign" in kinds
    sched = fused.schedule()
    assert sched is not None
    labels = sched.labels(cg.dag)
    assert set(labels) == set(sched.at) and all(k.startswith("kernel:fused(") for k, _ in labels.values())
    assert any(how != "full" for gr in fused.groups for _, how in gr.expr.loads)  # broadcasts inside groups
    # and the program run this way is the graph's (the unfused kernels' own tolerance aside)
    want = rt.reference(g, feeds)["mid"].astype(np.float64)
    got = plain.saved("mid").astype(np.float64)
    assert np.allclose(got, want, rtol=2e-2, atol=2e-2)


def adamw_step(dtype: str) -> tuple[rt.Graph, Any]:
    """AdamW on two parameters of ``dtype`` with float32 master weights, their gradients given."""
    g = rt.Graph()
    params = [g.state("w", [8, 16], dtype), g.state("b", [16], dtype)]
    grads = [g.input(f"grad.{p.name}", list(p.shape), dtype) for p in params]
    lr = g.input("lr", [1], "float32")
    opt = adamw(g, params, grads, lr, master_dtype="float32")
    return g, opt


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("device", ["cpu:1", "cpu:2"])
def test_fused_adamw_steps_match_bit_for_bit(host: Any, dtype: str, device: str) -> None:
    g, opt = adamw_step(dtype)
    cg = rt.compileGraph(g, device=device)
    feeds = _values(g, seed=3)
    feeds["lr"] = np.array([1e-2], np.float32)
    feeds.update(opt.initial({p: feeds[p] for p in ("w", "b")}))
    _, fused = run_both(host, cg, feeds, steps=3)
    # each parameter's update reads its gradient, master weights and moments once and writes them in place
    assert any(k.count("assign") for k in (gr.kind for gr in fused.groups))


def cache_write(dtype: str) -> rt.Graph:
    """A cache write: each sequence's new keys at the position it writes, the cache elsewhere, assigned back
    to the cache; the written cache read on (as attention reads it), and the old one."""
    g = rt.Graph()
    cache = g.state("cache", [3, 16, 2, 8], dtype)
    new = g.input("new", [3, 1, 2, 8], dtype)
    write = g.input("write", [3, 16, 1, 1], "bool")
    written = g.where(write, new, cache)
    g.assign(cache, written)
    g.save(g.sum(g.cast(written, "float32"), axis=3), name="read")
    # the old cache read after the write too: the where cannot write the kept block in place
    # (``physical.views``), so it writes its own block and the assign copies it, unless the two are fused
    g.save(g.sum(g.cast(cache, "float32"), axis=1), name="old")
    return g


def _cache_feeds(g: rt.Graph, step: int = 0) -> dict[str, np.ndarray]:
    feeds = _values(g, seed=5 + step)
    write = np.zeros((3, 16, 1, 1), bool)
    write[np.arange(3), [4 + step, 9 + step, 15 - step]] = True
    feeds["write"] = write
    return feeds


@pytest.mark.parametrize("device", ["cpu:1", "cpu:2", "cpu:4"])
def test_a_cache_write_joins_a_fused_kernel(device: str) -> None:
    g = cache_write("bfloat16")
    cg = rt.compileGraph(g, device=device)
    plan, groups = planned(cg)
    check_groups(cg, plan, groups)
    assert any("where×1" in gr.kind for gr in groups)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("device", ["cpu:1", "cpu:2"])
def test_fused_cache_writes_match_bit_for_bit(host: Any, dtype: str, device: str) -> None:
    g = cache_write(dtype)
    cg = rt.compileGraph(g, device=device)
    plain, fused = run_both(host, cg, _cache_feeds(g), steps=3)
    assert all("where" in gr.kind for gr in fused.groups)
    assert any(how == "strided" for gr in fused.groups for _, how in gr.expr.loads)  # the broadcast operands
    assert plain.saved("read").tobytes() == fused.saved("read").tobytes()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("p", [1, 2])
def test_a_reshape_of_a_state_read_after_its_assignment_reads_the_old_value(host: Any, p: int, fused: bool) -> None:
    """A reshape of a state keeps the state's bytes (``reshape_shares``): its readers run before the state is
    assigned, on arenas as the GPU executor lays them out (the NumPy executor keeps next values aside)."""
    g = rt.Graph()
    cache = g.state("cache", [4, 8], "float32")
    new = g.input("new", [4, 8], "float32")
    write = g.input("write", [4, 8], "bool")
    flat = g.reshape(cache, [32])
    g.assign(cache, g.where(write, new, cache))
    g.save(g.mul(flat, flat), name="old")
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    rng = np.random.default_rng(p)
    feeds = {"cache": rng.standard_normal((4, 8)).astype(np.float32),
             "new": rng.standard_normal((4, 8)).astype(np.float32), "write": rng.random((4, 8)) < 0.5}
    want = rt.reference(g, feeds)
    prog = host(cg, fused)
    prog.load(feeds)
    prog.execute()
    np.testing.assert_array_equal(prog.saved("old"), want["old"])


@pytest.mark.slow
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fused_kernels_of_random_graphs_match_bit_for_bit(host: Any, data: st.DataObject) -> None:
    g = random_graph(data.draw)
    cg = rt.compileGraph(g, device=data.draw(st.sampled_from(["cpu:1", "cpu:2"])))
    feeds = _values(g, seed=data.draw(st.integers(0, 100)))
    feeds["acc"] = np.zeros(SHAPE, numpy_dtype(g.node("acc").type.dtype))
    plan = plan_memory(cg.dag, cg.live)
    if not fusion_groups(cg.dag, plan, cg.live):
        return
    run_both(host, cg, feeds, steps=2)


@pytest.mark.parametrize("p", [1, 2])
def test_the_forward_attention_kernel_writes_the_lse_its_backward_reads(host: Callable[..., HostProgram],
                                                                         p: int) -> None:
    """An attention's gradients through the launchers on the arenas, in Triton's interpreter: the forward
    kernel writes the log-sum-exp rows the backward reads (the attention_lse tasks do nothing), and dq, dk, dv
    equal the reference, as they do with the lse recomputed (packed causal GQA, 45 rows)."""
    g = rt.Graph()
    q = g.input("q", [1, 45, 4, 16], "float32")
    k = g.input("k", [1, 45, 2, 16], "float32")
    v = g.input("v", [1, 45, 2, 16], "float32")
    o = g.attention(q, k, v, causal=True, seq_ends=(17, 45), name="attn")
    g.save(o, name="o")
    for name, t in zip(("dq", "dk", "dv"), g.vjp(o, g.input("do", [1, 45, 4, 16], "float32"), [q, k, v])):
        g.save(t, name=name)
    feeds = _values(g, 3)
    want = rt.reference(g, feeds)
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    for paired in (True, False):
        prog = host(cg, False, SIBLINGS if paired else ())
        assert bool(prog.plan.done_by) == paired
        kinds = sorted(cg.graph.nodes[cg.dag.tasks[s].op].kind for s in prog.plan.done_by)
        assert kinds == (["attention_lse"] * p if paired else []), kinds
        prog.load(feeds)
        prog.execute()
        for name in ("o", "dq", "dk", "dv"):
            got, ref = prog.saved(name), want[name]
            err = float(np.max(np.abs(got - ref))) / float(np.max(np.abs(ref)))
            assert err < 1e-5, f"{name} (p={p}, lse from the forward: {paired}): {err:.1e} of the largest"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_swiglu_gradient_kernel_writes_both_bit_for_bit(host: Callable[..., HostProgram], dtype: str) -> None:
    """swiglu's backward through the launchers on the arenas, in Triton's interpreter: one kernel writes da
    and db (the second task does nothing), with the same bits as the two kernels alone."""
    g = rt.Graph()
    a = g.input("a", [3, 40, 24], dtype)
    b = g.input("b", [3, 40, 24], dtype)
    dy = g.input("dy", [3, 40, 24], dtype)
    y = g.swiglu(a, b)
    for name, t in zip(("da", "db"), g.vjp(y, dy, [a, b])):
        g.save(t, name=name)
    feeds = _values(g, 5)
    cg = rt.compileGraph(g, device="cpu:2")
    runs = {}
    for kinds in (("swiglu_grad",), ()):
        prog = host(cg, False, kinds)
        assert bool(prog.plan.done_by) == bool(kinds)
        prog.load(feeds)
        prog.execute()
        runs[kinds] = {name: prog.saved(name) for name in ("da", "db")}
    want = rt.reference(g, feeds)
    for name in ("da", "db"):
        assert runs[("swiglu_grad",)][name].tobytes() == runs[()][name].tobytes(), name
        got, ref = (np.asarray(x, np.float64) for x in (runs[()][name], want[name]))
        assert np.max(np.abs(got - ref)) <= (1e-5 if dtype == "float32" else 1e-2) * np.max(np.abs(ref)), name


@pytest.mark.parametrize("p", [1, 3])
def test_kernel_scratch_in_the_arena_keeps_the_bits(host: Callable[..., HostProgram], p: int) -> None:
    """Kernels that need scratch (rmsnorm's weight gradient, a mean over long rows) with their scratch placed in
    the arena during their task: the same bits as with scratch of their own, and the reference's values."""
    g = rt.Graph()
    x = g.input("x", [3, 70, 48], "float32")
    w = g.input("w", [48], "float32")
    y = g.rmsnorm(x, w, 1e-5)
    loss = g.save(g.mean(g.unary(y, "square"), axis=(0, 1, 2)), name="loss")
    for name, t in zip(("dx", "dw"), g.grad(loss, [x, w])):
        g.save(t, name=name)
    feeds = _values(g, 7)
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    want = rt.reference(g, feeds)
    got = []
    for fused in (True, False):  # one after the other: the kernels' pointers are the latest program's
        prog = host(cg, fused)
        assert bool(prog.plan.scratch) == fused
        prog.load(feeds)
        prog.execute()
        got.append({name: prog.saved(name) for name in ("loss", "dx", "dw")})
    for name in ("loss", "dx", "dw"):
        a, b = got[0][name], got[1][name]
        assert a.tobytes() == b.tobytes(), name
        err = float(np.max(np.abs(a - want[name]))) / max(float(np.max(np.abs(want[name]))), 1e-30)
        assert err < 1e-5, (name, err)


def test_generated_source_is_cached_by_expression(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from relational_tensors.kernels import triton_fused

    monkeypatch.setenv("RELATIONAL_TENSORS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_fused, "_KERNELS", {})
    e = FusedExpr((("bfloat16", "full"), ("float32", "scalar")),
                  (("cast", "cast", (0,), "float32"), ("binary", "mul", (2, 1), "float32"),
                   ("unary", "scale", (3,), "bfloat16")), ((4, "bfloat16"), (3, "float32")))
    k1 = triton_fused.kernel(e)
    assert triton_fused.kernel(e) is k1
    files = list((tmp_path / "fused").glob("*.py"))
    assert len(files) == 1 and "unary_math(v3.to(ACC), a0, 13)" in files[0].read_text()


# ------------------------------------------------------------------ 3. on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(visible_gpus() == 0, reason="no CUDA GPU visible (or CuPy not installed)")
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_training_step_on_gpu_fused_and_unfused_bit_for_bit(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = llama_training_graph(2, 64, 128, 4, 2, 256, 256, dtype="bfloat16", optimizer="adamw", master_dtype="float32")
    feeds = llama_training_feeds(g)
    states = [n.name for n in g.inputs if n.role == "state"]

    def steps(fuse: str) -> dict[str, np.ndarray]:
        monkeypatch.setenv("RELATIONAL_TENSORS_FUSE", fuse)
        cg = rt.compileGraph(g, device=device)
        ex = cg.executor
        assert (ex.fusion is not None and len(ex.fusion.groups) > 0) == (fuse == "1")
        assert ex.capturable, "an operator of the step runs on host copies: the program cannot be captured"
        cg.load(feeds)
        for _ in range(3):  # eager, captured into a CUDA graph, replayed
            cg.execute()
        assert ex.graph_exec is not None, "the program was not captured into a CUDA graph"
        kinds = {t.kind for t in cg.profile().tasks}  # a fourth step, eager, each task timed
        assert any(k.startswith("kernel:fused(") for k in kinds) == (fuse == "1")
        return {name: np.asarray(cg.offload(name)) for name in (*states, "loss")}

    fused, plain = steps("1"), steps("0")
    differ = [name for name in plain if fused[name].tobytes() != plain[name].tobytes()]
    if differ:
        again = steps("0")
        noisy = [name for name in plain if again[name].tobytes() != plain[name].tobytes()]
        assert not noisy, f"the unfused step itself is not reproducible on {device}: {noisy}"
    assert not differ, f"with fusion on {device}, {differ} differ"

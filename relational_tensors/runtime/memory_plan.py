"""Where every buffer lives in its device's arena, and which cross-stream waits keep that safe.

Pure planning, no GPU: the CuPy executor allocates one arena per logical device and issues the
waits computed here; tests check the plan for hazards on any DAG.

* reshape outputs alias their input (a row-major reshape of a block keeps its bytes in order), and
  views (``Buffer.parent``) are sub-boxes of their parent: neither has a slot of its own, and the
  root's lifetime runs from the first write to any of them to the last use of any of them;
* buffers are placed first-fit over their lifetimes, so buffers alive together never overlap (the
  tightest of three orders); a kernel's scratch is placed as a buffer alive during its task;
* a task waits for the producers of its inputs on other streams (read after write) and for every
  earlier task on another stream that touched memory its outputs reuse (write after read/write); a
  task that overwrites a state's loaded block (its ``assign``, or a copy or assembly that writes the
  next value in place) waits for every earlier task that touched it;
* a kernel that computes a sibling task's output as it goes writes it (``siblings``): the forward
  ``attention`` the log-sum-exp rows its backward's ``attention_lse`` task would recompute (the same q
  and k blocks, the same key visibility, neither side a partial), and one ``swiglu_grad`` both
  gradients (da and db from one read of a, b and dy).  The sibling's block is born at the task that
  writes it, and the sibling has nothing to do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from relational_tensors.kernels.common import ALIGN, align
from relational_tensors.physical.tasks import Liveness, Task, TaskDAG, block_bytes, reshape_shares
from relational_tensors.sql_specs.attention import AttentionOp

SIBLINGS = ("attention_lse", "swiglu_grad")  # the kinds of task another kernel does as it goes, by default

__all__ = ["MemoryPlan", "plan_memory", "plan_arena", "sibling_tasks", "SIBLINGS", "view_geometry",
           "ALIGN", "align"]


@dataclass(frozen=True)
class Slot:
    offset: int
    size: int


def _place(sizes: dict[int, int], lifetimes: dict[int, tuple[int, int]],
           order: list[int]) -> tuple[list[tuple[int, int, int, int, int]], int]:
    """Each buffer of ``order`` in turn at the lowest offset free over its lifetime:
    (offset, end, born, dies, buffer) per buffer, and the arena size."""
    n = len(order)
    starts, ends = np.zeros(n, np.int64), np.zeros(n, np.int64)
    borns = np.array([lifetimes[b][0] for b in order], np.int64)
    deaths = np.array([lifetimes[b][1] for b in order], np.int64)
    placed: list[tuple[int, int, int, int, int]] = []
    top = 0
    for i, b in enumerate(order):
        size = align(max(sizes[b], 1))
        born, dies = int(borns[i]), int(deaths[i])
        offset = 0
        alive = ~((deaths[:i] < born) | (dies < borns[:i]))
        if alive.any():
            o, e = starts[:i][alive], ends[:i][alive]
            by = np.argsort(o, kind="stable")
            o, e = o[by], e[by]
            # first fit: before the k-th busy range (by offset) the candidate is the furthest end so far
            before = np.concatenate(([0], np.maximum.accumulate(e)[:-1]))
            fits = np.flatnonzero(before + size <= o)
            offset = int(before[fits[0]]) if fits.size else max(0, int(e.max()))
        starts[i], ends[i] = offset, offset + size
        placed.append((offset, offset + size, born, dies, b))
        top = max(top, offset + size)
    return placed, top


def plan_arena(sizes: dict[int, int],
               lifetimes: dict[int, tuple[int, int]]) -> tuple[dict[int, Slot], int, dict[int, list[int]]]:
    """First-fit placement of buffers in one arena: buffers alive at the same time never overlap.

    Three orders are placed (largest first, longest-lived first, first born first) and the smallest
    arena kept: no one order packs every program tightly (on the 8B-shaped block's training step,
    largest first leaves 2.4% over the live peak at 8K tokens and none at 32x1K; first born, 0.3% and
    4.1%).  Returns each buffer's slot, the arena size, and for each buffer the earlier buffers whose
    memory it reuses (in the order they were placed)."""
    orders = (sorted(sizes, key=lambda b: (-sizes[b], lifetimes[b][0], b)),
              sorted(sizes, key=lambda b: (lifetimes[b][0] - lifetimes[b][1], -sizes[b], b)),
              sorted(sizes, key=lambda b: (lifetimes[b][0], -sizes[b], b)))
    placed, arena = min((_place(sizes, lifetimes, order) for order in orders), key=lambda pa: pa[1])
    slots = {b: Slot(o, e - o) for o, e, _born, _dies, b in placed}
    reuses: dict[int, list[int]] = {}
    if placed:
        starts, ends, borns, deaths, ids = (np.array(col, np.int64) for col in zip(*placed))
        for o, e, born, _dies, b in placed:
            mine = np.flatnonzero((deaths < born) & (starts < e) & (o < ends))
            if mine.size:
                reuses[b] = ids[mine].tolist()
    return slots, arena, reuses


def buffer_bytes(dag: TaskDAG, b: int) -> tuple[int, int]:
    """(bytes of the block, bytes of its lse rows) of buffer ``b``."""
    buf = dag.buffers[b]
    return block_bytes(buf.box, buf.dtype, buf.partial == "lse")


@dataclass
class MemoryPlan:
    alias: dict[int, int]                  # reshape output or view -> the root buffer whose memory it shares
    slots: dict[int, Slot]                 # root buffers -> slot in their device's arena
    arena_bytes: dict[int, int]            # logical device -> arena size
    reuses: dict[int, list[int]]           # root buffer -> earlier roots whose memory it reuses
    waits: dict[int, list[int]]            # task -> tasks on other streams it waits for
    reshaped: frozenset[int] = frozenset()  # reshape outputs (the reshape kernel has nothing to do)
    view_order: tuple[int, ...] = ()        # aliases and views, each after the buffer it is taken from
    also_writes: dict[int, int] = field(default_factory=dict)  # task -> a sibling's output it writes too
    done_by: dict[int, int] = field(default_factory=dict)      # sibling task -> the task that writes its output
    lifetimes: dict[int, tuple[int, int]] = field(default_factory=dict)  # root -> (first task, last task)
    scratch: dict[int, Slot] = field(default_factory=dict)  # kernel task -> its scratch in its device's arena
    external: frozenset[int] = frozenset()  # roots outside the arenas (inputs read in place from a bound array)

    def writes(self, t: Task) -> tuple[int, ...]:
        """The buffers task ``t`` writes: its outputs, and a sibling's (``also_writes``)."""
        extra = self.also_writes.get(t.id)
        return t.outputs if extra is None else (*t.outputs, extra)

    def root(self, b: int) -> int:
        return self.alias.get(b, b)

    def byte_range(self, dag: TaskDAG, b: int) -> tuple[int, int, int]:
        """(device, first byte, end byte) of buffer ``b`` in its arena (a view: its root's whole range,
        which holds its strided elements)."""
        r = self.root(b)
        if r in self.external:  # memory of its own outside the arena, never written: a range no other touches
            return dag.buffers[r].device, -1 - r, -r
        slot = self.slots[r]
        main, extra = buffer_bytes(dag, r if dag.buffers[b].parent is not None else b)
        return dag.buffers[r].device, slot.offset, slot.offset + (align(main) + extra if extra else main)


def _aliases(dag: TaskDAG) -> tuple[dict[int, int], set[int], list[int]]:
    """Every buffer without memory of its own -> its root; the reshape outputs among them; and an
    order in which each comes after the buffer it is taken from."""
    reshaped = reshape_shares(dag)  # reshape output -> its input
    root = dag.view_roots(reshaped)
    return root, set(reshaped), list(root)


def sibling_tasks(dag: TaskDAG, kinds: Sequence[str] = SIBLINGS) -> dict[int, int]:
    """Tasks of ``kinds`` whose output an earlier kernel task writes as it goes -> that task (the module's
    docstring), where no task between them writes a block the sibling reads."""
    found: dict[int, int] = {}
    if "attention_lse" in kinds:
        found.update(_forward_lse(dag))
    if "swiglu_grad" in kinds:
        found.update(_swiglu_pairs(dag))
    if not found:
        return found
    writers: dict[int, list[int]] = defaultdict(list)  # root -> the tasks that write it
    for t in dag.tasks:
        if t.kind != "load":
            for b in t.outputs:
                writers[dag.root(b)].append(t.id)
    return {s: w for s, w in found.items()
            if not any(w < x < s for b in dag.tasks[s].inputs for x in writers[dag.root(b)])}


def _forward_lse(dag: TaskDAG) -> dict[int, int]:
    """``attention_lse`` tasks whose block the forward ``attention`` task can write -> that forward task: the
    same device, q and k buffers and key visibility (no padding, masks or biases, which the forward runs
    densely), the lse block the forward's rows and heads, and neither output a ⊕ partial (a key split's
    partial lse rides with its partial output already)."""
    forwards: dict[tuple[int, int, int], Task] = {}
    out: dict[int, int] = {}
    for t in dag.tasks:
        if t.kind != "kernel" or t.op is None:
            continue
        op = dag.nodes[t.op].op
        if not isinstance(op, AttentionOp):
            continue
        if op.kind == "attention":
            if not op.extras and op.key_lengths is None and dag.buffers[t.outputs[0]].partial is None:
                forwards[(t.device, t.inputs[0], t.inputs[1])] = t
        elif op.kind == "attention_lse":
            f = forwards.get((t.device, t.inputs[0], t.inputs[1]))
            if f is None:
                continue
            fwd_op = dag.nodes[f.op].op  # type: ignore[index]
            o, lse = dag.buffers[f.outputs[0]], dag.buffers[t.outputs[0]]
            if (isinstance(fwd_op, AttentionOp) and fwd_op.options() == op.options() and lse.partial is None
                    and lse.parent is None and lse.dtype == "float32" and o.box.lower[:3] == lse.box.lower
                    and o.box.upper[:3] == lse.box.upper):
                out[t.id] = f.id
    return out


def _swiglu_pairs(dag: TaskDAG) -> dict[int, int]:
    """The later of two ``swiglu_grad`` tasks (da and db) on the same a, b and dy buffers -> the earlier,
    both outputs whole blocks of their own of one shape and dtype."""
    first: dict[tuple[int, ...], Task] = {}
    out: dict[int, int] = {}
    for t in dag.tasks:
        if t.kind != "kernel" or t.op is None or dag.nodes[t.op].kind != "swiglu_grad":
            continue
        o = dag.buffers[t.outputs[0]]
        if o.partial is not None or o.parent is not None:
            continue
        key = (t.device, *t.inputs)
        f = first.get(key)
        if f is None:
            first[key] = t
            continue
        fo = dag.buffers[f.outputs[0]]
        wrt = (dag.nodes[f.op].op.wrt, dag.nodes[t.op].op.wrt)  # type: ignore[index, union-attr]
        if wrt in ((0, 1), (1, 0)) and o.box.shape == fo.box.shape and o.dtype == fo.dtype:
            out[t.id] = f.id
            del first[key]
    return out


def plan_memory(dag: TaskDAG, live: Liveness, siblings: Mapping[int, int] | None = None,
                keep_until: dict[int, int] | None = None, reuse: bool = True,
                scratch: Mapping[int, int] | None = None, external: frozenset[int] = frozenset()) -> MemoryPlan:
    """Slots, arena sizes and cross-stream waits (the module's rules); ``siblings``: the tasks whose output
    another kernel writes as it goes -> that kernel's task (``sibling_tasks``; None: of every kind in
    ``SIBLINGS``, ``{}``: none); ``keep_until``
    (root buffer -> task) keeps a buffer's memory until that task at least (a fused kernel reads it there);
    ``reuse=False`` gives every buffer bytes of its own (a plan to find what could be fused, never
    allocated); ``scratch`` (kernel task -> bytes) places each task's kernel scratch in its device's arena,
    alive during that task only (``MemoryPlan.scratch``); ``external`` names root buffers that get no slot
    (input blocks read in place from arrays the program was given: ``CupyExecutor``'s ``bind``)."""
    end = len(dag.tasks)
    alias, reshaped, order = _aliases(dag)
    done_by = dict(sibling_tasks(dag) if siblings is None else siblings)
    also = {w: dag.tasks[s].outputs[0] for s, w in done_by.items()}
    born: dict[int, int] = {}
    for t in dag.tasks:
        for b in t.outputs:
            r = alias.get(b, b)  # a root is born with the first write to it or to any of its views
            born[r] = min(born.get(r, end), 0 if t.kind == "load" else t.id)
    for w, b in also.items():
        born[b] = min(born.get(b, end), w)
    group_end: dict[int, int] = {}
    for dst, src in alias.items():  # the shared memory lives until the last user of any of them
        group_end[src] = max(group_end.get(src, live.last_use.get(src, end)), live.last_use.get(dst, end))
    slots: dict[int, Slot] = {}
    all_lifetimes: dict[int, tuple[int, int]] = {}
    reuses: dict[int, list[int]] = {}
    arena_bytes: dict[int, int] = {}
    scratch_slots: dict[int, Slot] = {}
    for d in range(dag.p):
        mine = [b for b, buf in dag.buffers.items() if buf.device == d and b not in alias and b not in external]
        sizes = {}
        for b in mine:
            main, extra = buffer_bytes(dag, b)
            sizes[b] = align(main) + extra
        lifetimes = {b: (born.get(b, 0), max(group_end.get(b, live.last_use.get(b, end)),
                                             (keep_until or {}).get(b, -1))) for b in mine}
        all_lifetimes.update(lifetimes)
        for tid, nbytes in (scratch or {}).items():  # a task's scratch: a buffer of its own, alive at the task
            if dag.tasks[tid].device == d:
                mine.append(_scratch_id(tid))
                sizes[_scratch_id(tid)] = align(max(nbytes, 1))
                lifetimes[_scratch_id(tid)] = (tid, tid)
        if reuse:
            device_slots, total, device_reuses = plan_arena(sizes, lifetimes)
        else:
            device_slots, total, device_reuses = {}, 0, {}
            for b in sorted(mine):
                device_slots[b] = Slot(total, align(max(sizes[b], 1)))
                total += device_slots[b].size
        for tid in scratch or {}:
            if dag.tasks[tid].device == d:
                scratch_slots[tid] = device_slots.pop(_scratch_id(tid))
        slots.update(device_slots)
        reuses.update(device_reuses)
        arena_bytes[d] = total
    touchers: dict[int, list[int]] = defaultdict(list)
    for t in dag.tasks:
        for b in (*t.inputs, *t.outputs):
            touchers[alias.get(b, b)].append(t.id)
    for w, b in also.items():
        touchers[b].insert(0, w)
    # a block's memory is reused by a task on its own device, whose stream orders it after every task there:
    # only the tasks of other devices (copies reading it) need a wait
    remote = {r: xs for r, ts in touchers.items() if (xs := [
        x for x in ts if dag.tasks[x].device != dag.buffers[r].device and dag.tasks[x].kind != "load"])}
    read_after_write = dag.producers()
    kept = dag.kept_state_blocks()
    waits: dict[int, list[int]] = {}
    for t in dag.tasks:
        if t.kind == "load":
            continue
        deps = set(read_after_write[t.id])
        # a state's next value overwrites a loaded block: after every earlier task that touched it
        deps.update(x for r in dag.overwrites(t, kept, alias) for x in remote.get(r, ()) if x < t.id)
        mine = [alias.get(b, b) for b in t.outputs] + ([also[t.id]] if t.id in also else []) + \
            ([_scratch_id(t.id)] if t.id in scratch_slots else [])
        for r in mine:
            for old in reuses.get(r, ()):
                if old in remote:
                    deps.update(x for x in remote[old] if x < t.id)
        waits[t.id] = sorted(x for x in deps if dag.tasks[x].device != t.device)
    return MemoryPlan(alias, slots, arena_bytes, reuses, waits, frozenset(reshaped), tuple(order), also, done_by,
                      all_lifetimes, scratch_slots, frozenset(external))


def _scratch_id(task: int) -> int:
    """The placement's name for a task's scratch (negative: no buffer of the DAG has it)."""
    return -1 - task


def view_geometry(dag: TaskDAG, plan: MemoryPlan) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Where every reshape output and view lies in its root: (element offset, element strides).

    A reshape output reads its root's elements in order (contiguous strides of its own shape); a view
    is its parent's geometry shifted to its box's corner, with the parent's strides."""
    from relational_tensors.kernels.common import contiguous_strides

    geo: dict[int, tuple[int, tuple[int, ...]]] = {}
    for b in plan.view_order:
        buf = dag.buffers[b]
        if buf.parent is None:  # a reshape: its root's bytes, read in order
            geo[b] = (0, contiguous_strides(buf.box.shape))
            continue
        parent = dag.buffers[buf.parent]
        offset, strides = geo.get(buf.parent, (0, contiguous_strides(parent.box.shape)))
        rel = [lo - plo for lo, plo in zip(buf.box.lower, parent.box.lower)]
        geo[b] = (offset + sum(r * st for r, st in zip(rel, strides)), strides)
    return geo


"""Elementwise task fusion in the GPU executor: chains of elementwise kernel tasks issued as one kernel.

An execution-level rewrite.  The plan, the task DAG and the memory plan stay as they are; the CuPy
executor issues one generated Triton kernel (``kernels/triton_fused.py``) where a group's last task
stands, instead of the group's tasks, so that a chain such as AdamW's update (about a dozen unary and
binary operators per parameter block) reads its inputs and writes its results once.

A *group* (``fusion_groups``, a pure function of the DAG and its memory plan):

* kernel tasks of ``unary`` and ``binary`` operators whose op has a fusable device kernel
  (``UNARY_OPS``, ``BINARY_OPS``) and of ``where``, on one device, in one phase, whose output blocks have one
  shape; every block they touch is float16, bfloat16 or float32 (a ``where``'s condition boolean); operands
  are that shape or broadcast to it (a [1] learning rate, a step count, a decode step's new keys and the
  positions it writes);
* ``assign`` tasks of a member's output: the fused kernel writes the state's block itself;
* a member's output that only members read is never written (it stays in registers); one any other task
  reads, or that is saved, is written as an extra output of the fused kernel.

Issuing the members at the place of the last one keeps every ordering the unfused program had: a group is
taken only where no task between its first and last member (on any stream) reads or writes memory a
moved member writes, writes memory a moved member reads (memory reused by then), or waits for a member;
within the kernel, memory is read and written at once only in place (the same element, as AdamW's
moments are), and a buffer a member writes is never read by a later member from memory.  The fused
kernel waits for every wait of its members (the memory plan's cross-stream waits) and records their
events.  Groups are taken one after another, each checked against the program with the groups taken
before it fused and every other task at its place; a conflict between two groups that reverses their
order is always seen by one of the two checks (the one of the group moved past the other), so they compose.

Results are bit-identical to the unfused kernels: the fused kernel runs the same arithmetic
(``triton_elementwise.unary_math`` / ``binary_math``), in the same compute type, rounds every
intermediate to its block's dtype as the unfused store would, and is compiled without contracting a
multiply and an add into one rounding (which an unfused store never allows); ops whose own kernels
contain such multiply-adds (gelu, tanh, log, log-add-exp) are left unfused.

The memory plan is made for the fused program (``fusion_plan``): the groups are first found on a plan
where no two buffers share bytes, then every block a group reads is kept until the group's kernel runs
(its last task), and the groups are found again on that plan, which now lets them read what the plain
plan would have reused by then (AdamW's cast of a gradient to float32 and its decayed master weights,
issued with the update).  The kept blocks can raise an arena above the liveness prediction only where
they are alive at its peak.

``RELATIONAL_TENSORS_FUSE=0`` (or ``CupyExecutor(fuse=False)``) turns fusion off.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relational_tensors.errors import ExecError
from relational_tensors.kernels.common import contiguous_strides, env_switch
from relational_tensors.kernels.fused_expr import SCALAR_OPS, FusedExpr, access, broadcast_strides, geometry
from relational_tensors.physical.simulate import Issue
from relational_tensors.physical.tasks import Liveness, Task, TaskDAG
from relational_tensors.runtime.memory_plan import MemoryPlan, plan_memory, sibling_tasks, view_geometry

__all__ = ["FUSE_ENV", "UNARY_OPS", "BINARY_OPS", "FusedExpr", "FusionGroup", "FusedIssue", "FusedSchedule",
           "fusion_enabled", "fusion_groups", "fusion_plan", "access", "geometry"]

FUSE_ENV = "RELATIONAL_TENSORS_FUSE"  # "0": the executor issues every task on its own
# unary and binary ops whose kernels hold no multiply-add the compiler could contract (see the docstring)
UNARY_OPS = frozenset({"relu", "neg", "abs", "sqrt", "rsqrt", "square", "scale", "add_scalar", "pow", "exp",
                       "sigmoid", "silu", "cast", "fill"})
BINARY_OPS = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "eq"})
DTYPES = frozenset({"float16", "bfloat16", "float32"})
MAX_SPAN = 512  # the most tasks a group spans, first member to last (bounds the checks' cost)


def fusion_enabled(fuse: bool | None = None) -> bool:
    """``fuse`` when given, else whether ``$RELATIONAL_TENSORS_FUSE`` leaves fusion on (the default)."""
    return env_switch(FUSE_ENV, fuse)


@dataclass(frozen=True, slots=True)
class FusionGroup:
    """Tasks issued as one fused kernel at the place of the last: ``operands`` are the buffers it reads (in
    the order of ``expr.loads``), ``outputs`` those it writes (``expr.stores``), ``args`` its scalars."""

    device: int
    tasks: tuple[int, ...]
    shape: tuple[int, ...]
    expr: FusedExpr
    operands: tuple[int, ...]
    outputs: tuple[int, ...]
    args: tuple[float, ...]
    kind: str  # for profiles: "kernel:fused(unary×5,binary×4,assign×2)"

    @property
    def last(self) -> int:
        return self.tasks[-1]


class _Facts:
    """What the checks read of the DAG and its memory plan, computed once."""

    def __init__(self, dag: TaskDAG, plan: MemoryPlan, live: Liveness) -> None:
        self.dag, self.plan = dag, plan
        self.geo = view_geometry(dag, plan)
        self.readers: dict[int, list[tuple[int, int]]] = defaultdict(list)  # root -> (task, buffer read)
        self.producer: dict[int, int] = {}  # buffer -> the kernel task that writes it
        for t in dag.tasks:
            for b in t.inputs:
                self.readers[plan.root(b)].append((t.id, b))
            if t.kind == "kernel":
                for b in t.outputs:
                    self.producer[b] = t.id
        self.persistent = {plan.root(b) for b in live.persistent}
        self.split = dag.phase_split
        self._ranges: dict[int, tuple[int, int, int]] = {}
        self._info: dict[int, tuple[str, str, float | None] | None] = {}
        self._touches: dict[int, tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], frozenset[int]]] = {}
        # groups already taken: each runs at its last task, its other members nowhere else
        self.taken: dict[int, FusionGroup] = {}
        self.deferred: set[int] = set()
        self.taken_waits: dict[int, set[int]] = {}

    def take(self, group: FusionGroup) -> None:
        """Check later groups against the program with ``group`` fused."""
        self.taken[group.last] = group
        self.deferred.update(group.tasks[:-1])
        self.taken_waits[group.last] = {w for m in group.tasks for w in self.plan.waits.get(m, ())}
        reads, writes = [self.range(b) for b in group.operands], [self.range(b) for b in group.outputs]
        self._touches[group.last] = (reads, writes, frozenset(r[0] for r in (*reads, *writes)))

    def range(self, b: int) -> tuple[int, int, int]:
        r = self._ranges.get(b)
        if r is None:
            r = self._ranges[b] = self.plan.byte_range(self.dag, b)
        return r

    def touches(self, t: Task) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], frozenset[int]]:
        """The byte ranges task ``t`` reads and writes, and the devices whose memory they lie in."""
        found = self._touches.get(t.id)
        if found is None:
            reads, writes = [self.range(b) for b in t.inputs], [self.range(b) for b in self.plan.writes(t)]
            slot = self.plan.scratch.get(t.id)
            if slot is not None:  # its kernel's scratch, in its device's arena
                writes.append((t.device, slot.offset, slot.offset + slot.size))
            found = self._touches[t.id] = (reads, writes, frozenset(r[0] for r in (*reads, *writes)))
        return found

    def strides(self, b: int) -> tuple[int, ...]:
        g = self.geo.get(b)
        return g[1] if g is not None else contiguous_strides(self.dag.buffers[b].box.shape)

    def own(self, b: int) -> bool:
        """Whether ``b`` has memory of its own, laid out contiguously (not a view or a reshape's alias)."""
        return b not in self.plan.alias

    def info(self, t: Task) -> tuple[str, str, float | None] | None:
        """(kind, op, scalar argument) of a kernel task the fused kernels can run, else None."""
        if t.id in self._info:
            return self._info[t.id]
        self._info[t.id] = found = self._kernel_info(t)
        return found

    def _kernel_info(self, t: Task) -> tuple[str, str, float | None] | None:
        if t.kind != "kernel" or t.op is None or len(t.outputs) != 1:
            return None
        node = self.dag.nodes[t.op]
        op = node.op
        name = getattr(op, "op", None)
        if node.kind == "unary" and name in UNARY_OPS and len(t.inputs) == 1:
            kind = "cast" if name == "cast" else "unary"
            arg = float(op.arg) if name in SCALAR_OPS else None  # type: ignore[union-attr, arg-type]
        elif node.kind == "binary" and name in BINARY_OPS and len(t.inputs) == 2:
            kind, arg = "binary", None
        elif node.kind == "where" and len(t.inputs) == 3 and self.dag.buffers[t.inputs[0]].dtype == "bool":
            kind, name, arg = "where", "where", None  # (a selection: nothing to round or contract)
        else:
            return None
        buffers = [self.dag.buffers[b] for b in (*t.inputs, *t.outputs)]
        if kind == "where":
            buffers = buffers[1:]  # the condition is boolean
        if any(b.dtype not in DTYPES or b.partial is not None for b in buffers):
            return None
        out = t.outputs[0]
        if not self.own(out) or out in self.plan.reshaped:
            return None
        assert name is not None
        return kind, name, arg


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _kind_name(counts: Counter[str]) -> str:
    parts = [f"{k}×{counts[k]}" for k in ("unary", "binary", "where", "assign") if counts[k]]
    return f"kernel:fused({','.join(parts)})"


def _build(facts: _Facts, members: Sequence[int]) -> FusionGroup | None:
    """The group of ``members`` (task ids, increasing), or None where it breaks a rule of the module's."""
    dag, tasks = facts.dag, facts.dag.tasks
    first, last = members[0], members[-1]
    device = tasks[first].device
    if last - first > MAX_SPAN or any(tasks[m].device != device for m in members):
        return None
    if facts.split is not None and (first < facts.split) != (last < facts.split):
        return None
    inside = set(members)
    made: dict[int, int] = {}  # output buffer of a kernel member -> that member
    shape: tuple[int, ...] | None = None
    for m in members:
        t = tasks[m]
        if t.kind == "kernel":
            if facts.info(t) is None:
                return None
            out_shape = dag.buffers[t.outputs[0]].box.shape
            if shape is None:
                shape = out_shape
            elif out_shape != shape:
                return None
            made[t.outputs[0]] = m
        elif t.kind != "assign":
            return None
    if shape is None:
        return None
    # where each buffer the kernel reads from memory is read, how, and what it writes (by the member
    # whose write it takes over)
    reads: list[tuple[int, int, str]] = []  # (member, buffer, access)
    writes: list[tuple[int, int, int]] = []  # (member, buffer, the member whose value it is)
    for m in members:
        t = tasks[m]
        if t.kind == "assign":
            src, dst = t.inputs[0], t.outputs[0]
            if made.get(src, m) >= m or not facts.own(dst) or dag.buffers[dst].dtype != dag.buffers[src].dtype \
                    or dag.buffers[dst].box.shape != shape or dag.buffers[dst].partial is not None:
                return None
            writes.append((m, dst, made[src]))
            continue
        info = facts.info(t)
        assert info is not None
        for b in t.inputs:
            if made.get(b, m) < m:
                continue  # a member's output, in registers
            how = access(shape, dag.buffers[b].box.shape, facts.strides(b))
            if how != "full" and info[0] not in ("binary", "where"):
                return None  # the unary kernels read their input in order
            reads.append((m, b, how))
    for o, m in made.items():
        escapes = facts.plan.root(o) in facts.persistent or any(
            u not in inside or b != o for u, b in facts.readers.get(facts.plan.root(o), ()))
        if escapes:
            writes.append((m, o, m))
    # memory the kernel reads and writes: only in place, and only what is read before it is written
    for m, b, how in reads:
        rb = facts.range(b)
        for w, out, _ in writes:
            if not _overlap(rb, facts.range(out)):
                continue
            same = rb == facts.range(out) and how == "full" and facts.own(b) and facts.own(out) \
                and dag.buffers[b].dtype == dag.buffers[out].dtype
            if w <= m or not same:
                return None
    for i, (_, a, _) in enumerate(writes):
        for _, b, _ in writes[i + 1:]:
            if _overlap(facts.range(a), facts.range(b)):
                return None
    strided = [broadcast_strides(shape, dag.buffers[b].box.shape, facts.strides(b))
               for _, b, how in reads if how == "strided"]
    if strided and geometry(shape, strided) is None:
        return None
    if not _ordered(facts, members, inside, reads, writes):
        return None
    return _group(facts, members, device, shape, made, reads, writes)


def _ordered(facts: _Facts, members: Sequence[int], inside: set[int], reads: list[tuple[int, int, str]],
             writes: list[tuple[int, int, int]]) -> bool:
    """Whether no task between the first member and the last conflicts with a member moved past it."""
    dag, plan = facts.dag, facts.plan
    device = dag.tasks[members[0]].device
    by_member_reads: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    by_member_writes: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for m, b, _ in reads:
        by_member_reads[m].append(facts.range(b))
    for w, b, _ in writes:
        by_member_writes[w].append(facts.range(b))
    moved_reads: list[tuple[int, int, int]] = []
    moved_writes: list[tuple[int, int, int]] = []
    passed: set[int] = set()
    for tid in range(members[0], members[-1]):
        if tid in inside:
            moved_reads += by_member_reads.get(tid, [])
            moved_writes += by_member_writes.get(tid, [])
            passed.add(tid)
            continue
        u = dag.tasks[tid]
        if u.kind == "load" or tid in facts.deferred:
            continue  # loads run at load(), before any task; a taken group's members at its last task
        if not passed.isdisjoint(facts.taken_waits[tid] if tid in facts.taken else plan.waits.get(tid, ())):
            return False
        u_reads, u_writes, where = facts.touches(u)
        if device not in where:
            continue  # it touches no memory of this device
        if any(_overlap(w, r) for w in u_writes for r in moved_reads):
            return False
        if any(_overlap(x, w) for x in (*u_reads, *u_writes) for w in moved_writes):
            return False
    return True


def _group(facts: _Facts, members: Sequence[int], device: int, shape: tuple[int, ...], made: dict[int, int],
           reads: list[tuple[int, int, str]], writes: list[tuple[int, int, int]]) -> FusionGroup:
    dag, tasks = facts.dag, facts.dag.tasks
    value: dict[int, int] = {}  # buffer -> value number (operands), then member -> value number (steps)
    loads: list[tuple[str, str]] = []
    operands: list[int] = []
    for _, b, how in reads:
        if b not in value:
            value[b] = len(loads)
            loads.append((dag.buffers[b].dtype, how))
            operands.append(b)
    steps: list[tuple[str, str, tuple[int, ...], str]] = []
    args: list[float] = []
    of_member: dict[int, int] = {}
    counts: Counter[str] = Counter()
    for m in members:
        t = tasks[m]
        if t.kind == "assign":
            counts["assign"] += 1
            continue
        kind, op, arg = facts.info(t)  # type: ignore[misc]
        counts[kind if kind in ("binary", "where") else "unary"] += 1
        ins = tuple(len(loads) + of_member[made[b]] if made.get(b, m) < m else value[b] for b in t.inputs)
        of_member[m] = len(steps)
        steps.append((kind, op, ins, dag.buffers[t.outputs[0]].dtype))
        if arg is not None:
            args.append(arg)
    stores = tuple((len(loads) + of_member[src], dag.buffers[b].dtype) for _, b, src in writes)
    expr = FusedExpr(tuple(loads), tuple(steps), stores)
    return FusionGroup(device, tuple(members), shape, expr, tuple(operands), tuple(b for _, b, _ in writes),
                       tuple(args), _kind_name(counts))


def fusion_groups(dag: TaskDAG, plan: MemoryPlan, live: Liveness) -> list[FusionGroup]:
    """The groups of tasks the executor issues as fused kernels, in the order of their last tasks.

    Tasks are first joined along the edges a group may take (an elementwise kernel reading another's
    output of its shape on its device; an ``assign`` of such an output), and each connected set is one group
    where the rules allow it, checked against the program with the groups taken before it fused (blocks of
    fewer elements first).  Where they do not, it is split greedily in task order (a kernel joins the
    groups that made its inputs, all of them, else the latest one it can join; an ``assign`` the group that
    made its value), and two of its groups are then merged wherever their union is allowed (those an edge
    joins first, then siblings such as AdamW's two moments).  A group of one task is left as it is."""
    facts = _Facts(dag, plan, live)
    tasks = dag.tasks
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    edges: list[tuple[int, int]] = []  # (producer, reader)
    for t in tasks:
        if t.kind == "assign":
            sources = [facts.producer.get(t.inputs[0])]
        elif facts.info(t) is not None:
            sources = [facts.producer.get(b) for b in t.inputs]
            parent.setdefault(t.id, t.id)
        else:
            continue
        for p in sources:
            if p is not None and facts.info(tasks[p]) is not None and tasks[p].device == t.device and \
                    dag.buffers[tasks[p].outputs[0]].box.shape == dag.buffers[t.outputs[0]].box.shape:
                parent.setdefault(t.id, t.id)
                edges.append((p, t.id))
                parent[find(t.id)] = find(p)
    components: dict[int, list[int]] = defaultdict(list)
    for x in parent:
        components[find(x)].append(x)
    out: list[FusionGroup] = []
    # small blocks first (the [1] scalars of an optimizer): a chain checked after them sees where their
    # values stay in registers, and so which memory they no longer write
    order = sorted((sorted(m) for m in components.values() if len(m) > 1),
                   key=lambda m: (dag.buffers[tasks[m[0]].outputs[0]].box.volume, m[0]))
    for members in order:
        whole = _build(facts, members)
        found = [whole] if whole is not None else \
            _split(facts, members, [(p, r) for p, r in edges if p in set(members)])
        for group in found:
            facts.take(group)
        out += found
    return sorted(out, key=lambda g: g.last)


def fusion_plan(dag: TaskDAG, live: Liveness, siblings: Mapping[int, int] | None = None,
                scratch: Mapping[int, int] | None = None,
                external: frozenset[int] = frozenset()) -> tuple[MemoryPlan, list[FusionGroup]]:
    """The memory plan of the fused program and its groups (the module's docstring): every block a group
    found on a plan without reuse reads is kept until that group's last task, except for the groups whose
    keeping would raise a device's peak of live bytes, and the groups are found again on the plan made so.
    ``siblings``, ``scratch`` and ``external`` as for ``plan_memory`` (``siblings`` found once here when None)."""
    if siblings is None:
        siblings = sibling_tasks(dag)
    spacious = plan_memory(dag, live, siblings, reuse=False, scratch=scratch, external=external)
    wanted = fusion_groups(dag, spacious, live)
    while True:
        keep: dict[int, int] = {}
        for g in wanted:
            for b in g.operands:
                r = spacious.root(b)
                keep[r] = max(keep.get(r, -1), g.last)
        raised = _raised_peaks(dag, spacious, keep)
        if not raised:
            break
        # the groups that keep a block alive only for them at the time of a raised peak give up fusing it
        wanted = [g for g in wanted if not any(
            (r := spacious.root(b)) in raised and spacious.lifetimes[r][1] < raised[r] <= g.last
            for b in g.operands)]
    plan = plan_memory(dag, live, siblings, keep_until=keep, scratch=scratch, external=external)
    return plan, fusion_groups(dag, plan, live)


def _raised_peaks(dag: TaskDAG, plan: MemoryPlan, keep: dict[int, int]) -> dict[int, int]:
    """Root -> the time of its device's raised peak, for the roots that ``keep`` keeps alive past their own
    last use at a time where a device's live bytes pass its peak without ``keep``."""
    out: dict[int, int] = {}
    by_device: dict[int, list[int]] = defaultdict(list)
    for r in plan.lifetimes:
        by_device[dag.buffers[r].device].append(r)
    for roots in by_device.values():
        base, _ = _peak(plan, roots, {})
        peak, at = _peak(plan, roots, keep)
        if peak > base:
            out.update({r: at for r in roots if r in keep and plan.lifetimes[r][1] < at <= keep[r]})
    return out


def _peak(plan: MemoryPlan, roots: list[int], keep: dict[int, int]) -> tuple[int, int]:
    """(the most bytes of ``roots`` alive at once, the first task where they are), each root alive over its
    lifetime in ``plan``, to ``keep``'s task where that is later."""
    events: dict[int, int] = defaultdict(int)
    for r in roots:
        born, dies = plan.lifetimes[r]
        events[born] += plan.slots[r].size
        events[max(dies, keep.get(r, -1)) + 1] -= plan.slots[r].size
    live = peak = at = 0
    for t in sorted(events):
        live += events[t]
        if live > peak:
            peak, at = live, t
    return peak, at


def _split(facts: _Facts, members: list[int], edges: list[tuple[int, int]]) -> list[FusionGroup]:
    """Groups of a connected set that cannot be one: greedy in task order, then merged pairwise."""
    tasks = facts.dag.tasks
    groups: dict[int, tuple[int, ...]] = {}  # group id -> members
    built: dict[int, FusionGroup] = {}
    of: dict[int, int] = {}  # task -> group id
    next_id = 0

    def commit(new: tuple[int, ...], group: FusionGroup, old: Sequence[int]) -> None:
        nonlocal next_id
        for g in old:
            groups.pop(g)
            built.pop(g)
        gid, next_id = next_id, next_id + 1
        groups[gid], built[gid] = new, group
        for m in new:
            of[m] = gid

    for tid in members:
        t = tasks[tid]
        sources = [t.inputs[0]] if t.kind == "assign" else list(t.inputs)
        near = sorted({of[p] for b in sources if (p := facts.producer.get(b)) is not None and p in of},
                      key=lambda g: -groups[g][-1])
        tries = ([near] if len(near) > 1 else []) + [[g] for g in near] + ([[]] if t.kind == "kernel" else [])
        for old in tries:
            new = tuple(sorted({tid, *(m for g in old for m in groups[g])}))
            group = _build(facts, new)
            if group is not None:
                commit(new, group, old)
                break
    # then any two groups whose union is allowed: those an edge joins first, then siblings (AdamW's two
    # moments read the same gradient), nearest first
    joined = {(of[p], of[r]) for p, r in edges if p in of and r in of}
    refused: set[tuple[int, ...]] = set()
    merged = True
    while merged:
        merged = False
        ids = sorted(groups, key=lambda g: groups[g][0])
        pairs = sorted(((a, b) for i, a in enumerate(ids) for b in ids[i + 1:]),
                       key=lambda ab: ((ab[0], ab[1]) not in joined and (ab[1], ab[0]) not in joined,
                                       groups[ab[1]][0] - groups[ab[0]][-1]))
        for a, b in pairs:
            if max(groups[a][-1], groups[b][-1]) - min(groups[a][0], groups[b][0]) > MAX_SPAN:
                continue
            new = tuple(sorted(groups[a] + groups[b]))
            group = _build(facts, new) if new not in refused else None
            if group is None:
                refused.add(new)
            else:
                commit(new, group, [a, b])
                joined = {(of[p], of[r]) for p, r in edges if p in of and r in of}
                merged = True
                break
    return [g for g in built.values() if len(g.tasks) > 1]


@dataclass(frozen=True)
class FusedIssue:
    """One group as the executor issues it: after ``waits`` (the union of its members' cross-stream waits,
    tasks outside the group), ``launch`` (on the current stream)."""

    group: FusionGroup
    waits: tuple[int, ...]
    launch: Callable[[], None]


@dataclass
class FusedSchedule:
    """The groups an executor issues fused: each at its last task (``at``); the other members are skipped
    (``deferred``)."""

    groups: list[FusionGroup]
    at: dict[int, FusedIssue]
    deferred: frozenset[int]

    @classmethod
    def build(cls, dag: TaskDAG, plan: MemoryPlan, live: Liveness, views: dict[int, Any],
              groups: list[FusionGroup] | None = None) -> FusedSchedule:
        """The schedule of ``groups`` (by default ``fusion_groups`` on ``plan``), each group's kernel
        generated (and compiled at its first launch) over the executor's device ``views``."""
        from relational_tensors.kernels import triton_fused

        if groups is None:
            groups = fusion_groups(dag, plan, live)
        at = {}
        for g in groups:
            waits = tuple(sorted({w for m in g.tasks for w in plan.waits.get(m, ())} - set(g.tasks)))
            launch = triton_fused.prepare(g.expr, [views[b] for b in g.operands], [views[b] for b in g.outputs],
                                          g.args, g.shape)
            at[g.last] = FusedIssue(g, waits, _named(launch, g, dag))
        return cls(groups, at, frozenset(m for g in groups for m in g.tasks[:-1]))

    def labels(self, dag: TaskDAG) -> dict[int, tuple[str, str]]:
        """Per group's last task, (kind, label) for profiles: the fused kind and the members' labels."""
        out = {}
        for g in self.groups:
            names = [dag.tasks[m].label for m in g.tasks]
            out[g.last] = (g.kind, f"fused {names[0]} .. {names[-1]} ({len(names)} tasks)")
        return out


def _named(launch: Callable[[], None], group: FusionGroup, dag: TaskDAG) -> Callable[[], None]:
    """``launch``, whose failure names the group's tasks and the switch that runs them unfused."""
    def run() -> None:
        try:
            launch()
        except Exception as e:
            names = ", ".join(dag.tasks[m].label for m in group.tasks)
            raise ExecError(f"the fused kernel of tasks {list(group.tasks)} ({names}) on logical device "
                            f"{group.device} failed: {type(e).__name__}: {e}. {FUSE_ENV}=0 runs them unfused; "
                            "report this with the plan (rt.save_plan).") from e
    return run


def simulated_issue(dag: TaskDAG, live: Liveness, fuse: bool | None = None) -> Issue:
    """How the GPU executor issues ``dag``, for the whole-plan simulator: its fused groups (where fusion
    is on; each priced by the bytes it reads and writes, at its last task), and the tasks it does nothing
    for (the groups' other members, siblings another kernel writes, reshapes that keep their input's
    bytes)."""
    siblings = sibling_tasks(dag)
    if fusion_enabled(fuse):
        plan, groups = fusion_plan(dag, live, siblings)
    else:
        plan, groups = plan_memory(dag, live, siblings), []
    free = set(siblings) | {t.id for t in dag.tasks if t.kind == "kernel" and t.outputs[0] in plan.reshaped}
    fused: dict[int, tuple[int, str]] = {}
    for g in groups:
        free.update(g.tasks[:-1])
        moved = sum(dag.buffers[b].nbytes for b in (*g.operands, *g.outputs))
        fused[g.tasks[-1]] = (moved, dag.buffers[dag.tasks[g.tasks[-1]].outputs[0]].dtype)
    return Issue(frozenset(free), fused)

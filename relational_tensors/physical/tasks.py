"""The physical plan: one task DAG for the whole graph, with explicit buffers.

Task kinds: ``load`` (a graph input block, materialized where it is needed),
``decompose`` (slice a producer's block into atoms), ``aggregate`` (⊕ of
aggregates at one device), ``copy`` (a transfer between devices), ``recompose``
(assemble atoms into the block a kernel reads, finalizing ⊕ partials),
``kernel`` (a concrete operator on one function spec), ``assign`` (write an
assigned state's next value into a block the state keeps, on that block's
device, after its last reader).  Only the tasks that write a state's next value
write a loaded block: its ``assign``, or the copies and the assembly that write
the value into the kept block in place (``physical.views``); each waits for
every earlier task that touched the block.  Emission order is a topological
order and the order each device runs its tasks in.

A buffer may be a *view*: a sub-box of another buffer on the same device
(``parent``), sharing its memory with the parent's strides.  Views let a copy
read an atom straight out of the producer's block and write it straight into
the block its reader assembles (``physical.views``); they take no memory of
their own, and keep their root buffer alive.  The output of a ``reshape`` kernel
whose input is a whole, final block keeps that block's bytes in row-major order
(``reshape_shares``): executors give it the input's memory, and the liveness
counts it as a view of the input.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from relational_tensors.core.aggregation import Aggregation
from relational_tensors.core.dtypes import itemsize
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box
from relational_tensors.errors import ExecError

if TYPE_CHECKING:
    from relational_tensors.graph.graph import Graph, Node

__all__ = ["Buffer", "Task", "TaskDAG", "Liveness", "liveness", "graph_liveness", "reshape_shares", "split_phases",
           "phase_range",
           "phase_ready", "block_bytes", "Payload", "LoadPayload",
           "DecomposePayload", "AggregatePayload", "RecomposePayload", "KernelPayload"]

TASK_KINDS = ("load", "decompose", "aggregate", "copy", "recompose", "kernel", "assign")


def block_bytes(box: Box, dtype: str, lse: bool = False) -> tuple[int, int]:
    """(bytes of a block's elements, bytes of its float32 log-sum-exp rows): an lse partial carries one
    row value per output row (its last dimension is the head dimension)."""
    main = box.volume * itemsize(dtype)
    rows = box.volume // box.shape[-1] if lse and box.rank and box.shape[-1] else 0
    return main, rows * 4


@dataclass(slots=True, unsafe_hash=True)
class Buffer:
    """A block of a tensor on one device.  ``partial`` names the ⊕ whose partial it holds, if any.  Treated
    as immutable (equal and hashed by value) but not frozen: a frozen dataclass's constructor costs five
    times as much, and a whole model's lowering makes millions of buffers."""

    id: int
    device: int
    box: Box
    dtype: str
    tensor: int                # node id of the tensor it belongs to
    partial: str | None = None  # "sum", "max", "min", "lse" (an lse partial also holds a float32 row per output row)
    parent: int | None = None   # a view: the buffer (same device, tensor and dtype) whose sub-box it is
    _nbytes: int = field(default=-1, init=False, repr=False, compare=False)  # nbytes, once asked for

    @property
    def nbytes(self) -> int:
        n = self._nbytes
        if n < 0:
            if self.partial == "lse":
                n = sum(block_bytes(self.box, self.dtype, True))
            else:  # (block_bytes' elements alone, without making its pair: most buffers are no lse partial)
                n = self.box.volume * itemsize(self.dtype)
            self._nbytes = n
        return n


@dataclass(frozen=True, slots=True)
class LoadPayload:
    """A load: the block ``box`` of graph input ``input``."""

    input: str
    box: Box


@dataclass(frozen=True, slots=True)
class DecomposePayload:
    """A decompose: the cell of each output atom, in output order."""

    cells: tuple[Box, ...]


@dataclass(frozen=True, slots=True)
class AggregatePayload:
    """An aggregate: the ⊕ that combines its inputs."""

    aggregation: Aggregation


@dataclass(frozen=True, slots=True)
class RecomposePayload:
    """A recompose: the cell of each input piece, the tensor's ⊕ (None for graph inputs) and, per
    piece, whether it is a partial to finalize (an lse partial and its rows) as it is written."""

    cells: tuple[Box, ...]
    aggregation: Aggregation | None
    finalize: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class KernelPayload:
    """A kernel: the function spec it runs (the ``index``-th of its operator's spec), and whether its
    output is final (made once) or a partial its readers combine with ``aggregation``."""

    function: FunctionSpec
    index: int
    final: bool
    aggregation: Aggregation


# what each task kind carries (a copy carries nothing but its buffers)
Payload = LoadPayload | DecomposePayload | AggregatePayload | RecomposePayload | KernelPayload | None


@dataclass(slots=True)
class Task:
    id: int
    kind: str
    device: int                   # where it runs (a copy runs on its destination's queue)
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    op: int | None = None         # node id of the operator it serves
    src_device: int | None = None  # copies: the source device
    payload: Payload = None
    label: str = ""

    @property
    def kernel(self) -> KernelPayload:
        """The payload of a kernel task."""
        assert isinstance(self.payload, KernelPayload), f"task {self.id} is a {self.kind}, not a kernel"
        return self.payload


@dataclass
class TaskDAG:
    """Tasks in emission order, the buffers they use, and where inputs and outputs live."""

    p: int
    tasks: list[Task] = field(default_factory=list)
    buffers: dict[int, Buffer] = field(default_factory=dict)
    inputs: dict[str, list[tuple[Box, int]]] = field(default_factory=dict)        # input name -> (box, buffer)
    outputs: dict[str, list[tuple[Box, int]]] = field(default_factory=dict)       # saved name -> aggregated blocks
    output_aggregation: dict[str, Aggregation] = field(default_factory=dict)
    assigned: dict[str, int] = field(default_factory=dict)  # assigned state -> the node of its value
    # a program run in two phases (split_phases): the index of the first task of the second phase, which
    # holds every task that depends on the inputs ``later`` (the others run in the first)
    phase_split: int | None = None
    later: frozenset[str] = frozenset()
    # the operator table the executors read (they never see the Graph): the graph's nodes by id (a kernel
    # task's ``op`` indexes it: the operator, its inputs and the type of every tensor), and the node of
    # each saved output
    nodes: tuple[Node, ...] = ()
    saved: dict[str, int] = field(default_factory=dict)

    def node(self, name: str) -> Node:
        """The node named ``name`` (an input, or any tensor of the graph), through an index of the names made
        at the first lookup (the executors ask it of every input of every call)."""
        index = self.__dict__.get("_by_name")
        if index is None or index[0] is not self.nodes:
            index = self.__dict__["_by_name"] = (self.nodes, {n.name: n for n in reversed(self.nodes)})
        n = index[1].get(name)
        if n is None:
            raise ExecError(f"no tensor named {name!r} in this program.")
        return n

    @property
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.op is None]

    @property
    def operators(self) -> list[Node]:
        return [n for n in self.nodes if n.op is not None]

    def saved_node(self, name: str) -> Node:
        return self.nodes[self.saved[name]]

    def buffer(self, device: int, box: Box, dtype: str, tensor: int, partial: str | None = None) -> int:
        bid = len(self.buffers)
        self.buffers[bid] = Buffer(bid, device, box, dtype, tensor, partial)
        return bid

    def root(self, b: int) -> int:
        """The buffer that owns ``b``'s memory (``b`` itself unless it is a view)."""
        while self.buffers[b].parent is not None:
            b = self.buffers[b].parent  # type: ignore[assignment]
        return b

    def kept_state_blocks(self) -> set[int]:
        """The blocks the assigned states keep: the loaded buffers that tasks of a run write."""
        return {b for name in self.assigned for _, b in self.inputs.get(name, ())}

    def overwrites(self, t: Task, kept: set[int], root: Mapping[int, int] | None = None) -> list[int]:
        """The kept state blocks (``kept_state_blocks``) that task ``t`` writes, itself or through views."""
        return [r for r, _ in self.kept_writes(t, kept, root)]

    def kept_writes(self, t: Task, kept: set[int], root: Mapping[int, int] | None = None) -> list[tuple[int, int]]:
        """(kept block, output) for each output of task ``t`` that is a kept state block or a view of one
        (``root``: ``view_roots()``, found once by a caller that asks of every task)."""
        if t.kind == "load":
            return []
        if root is None:
            return [(r, b) for b in t.outputs if (r := self.root(b)) in kept]
        # (a loop, not a comprehension: most tasks write no kept block, and this is asked of every task)
        out = []
        for b in t.outputs:
            r = root.get(b, b)
            if r in kept:
                out.append((r, b))
        return out

    def add(self, kind: str, device: int, inputs: tuple[int, ...], outputs: tuple[int, ...], **kw: Any) -> Task:
        task = Task(len(self.tasks), kind, device, inputs, outputs, **kw)
        self.tasks.append(task)
        return task

    def producers(self) -> dict[int, set[int]]:
        """Per task, the earlier tasks (loads aside) that wrote what it reads.  A view is read where its
        root's bytes are, so reading one waits for every earlier write to that root or its views (the
        producer's kernel for an atom cut out of its block; every copy into a block being assembled)."""
        root = self.view_roots()
        writers: dict[int, list[int]] = {}
        deps: dict[int, set[int]] = {}
        for t in self.tasks:
            waits: set[int] = set()
            for b in t.inputs:
                w = writers.get(root.get(b, b))
                if w is not None:
                    waits.update(w)
            deps[t.id] = waits
            if t.kind != "load":
                for b in t.outputs:
                    r = root.get(b, b)
                    w = writers.get(r)
                    if w is None:
                        writers[r] = [t.id]
                    else:
                        w.append(t.id)
        return deps

    def view_roots(self, shares: Mapping[int, int] | None = None) -> dict[int, int]:
        """Every buffer without memory of its own -> the buffer that owns it: the views (``root``), and the
        reshape outputs in ``shares`` (output -> input, ``reshape_shares``), through their input's own root.
        Each comes after the buffer it is taken from, where that has a root too."""
        out: dict[int, int] = {}
        source = {b: q for b, buf in self.buffers.items() if (q := buf.parent) is not None}
        for b, s in (shares or {}).items():
            source.setdefault(b, s)
        for b in sorted(source):  # (linear where, as made, they come in id order already)
            up = source[b]
            if up not in source:  # taken from a buffer with memory: most are
                out[b] = up
                continue
            if b in out:
                continue
            chain = [b]  # b, what it is taken from, ..., up to a buffer with memory or one already resolved
            up = source[b]
            while up not in out and up in source:
                chain.append(up)
                up = source[up]
            top = out.get(up, up)
            for x in reversed(chain):  # each after the buffer it is taken from
                out[x] = top
        return out

    def counts(self) -> Counter[str]:
        return Counter(t.kind for t in self.tasks)

    def transfers(self) -> list[Task]:
        """Copies between different devices (a copy to itself never happens)."""
        return [t for t in self.tasks if t.kind == "copy"]

    def bytes_moved(self) -> int:
        """Bytes the transfers carry between devices."""
        return sum(self.buffers[t.outputs[0]].nbytes for t in self.transfers())

    def summary(self) -> str:
        c = self.counts()
        moved = self.bytes_moved()
        return (f"{len(self.tasks)} tasks ({', '.join(f'{k} {c[k]}' for k in TASK_KINDS if c[k])}), "
                f"{len(self.buffers)} buffers, {moved:,} bytes between devices")


def split_phases(dag: TaskDAG, later: frozenset[str]) -> TaskDAG:
    """``dag`` with its tasks in two phases, each in its order: first every task that needs none of the
    inputs ``later`` (a forward pass), then every task that does (its backward, once the cotangents are
    loaded).  A task needs an input when it reads a block loaded from it, or memory a task that needs it
    wrote.  Liveness and memory plans made from the result hold across the pause between the phases:
    what the second phase reads of the first stays alive until its last reader."""
    unknown = sorted(later - set(dag.inputs))
    if unknown:
        raise ValueError(f"split_phases: {unknown} are not inputs of the program")
    late_roots: set[int] = set()
    early: list[Task] = []
    late: list[Task] = []
    for t in dag.tasks:
        is_late = (t.kind == "load" and isinstance(t.payload, LoadPayload) and t.payload.input in later) or any(
            dag.root(b) in late_roots for b in t.inputs)
        if is_late:
            late_roots.update(dag.root(b) for b in t.outputs)
            late.append(t)
        else:
            early.append(t)
    out = replace(dag, tasks=[], phase_split=len(early), later=later)
    for n, t in enumerate(early + late):
        out.tasks.append(t if t.id == n else Task(n, t.kind, t.device, t.inputs, t.outputs, t.op, t.src_device,
                                                  t.payload, t.label))
    return out


def phase_range(dag: TaskDAG, phase: int | None, held: bool) -> tuple[int, int]:
    """The tasks [lo, hi) that ``execute(phase)`` runs: all of them, or one phase of a program split in
    two.  Phase 1 continues a phase 0 whose results are ``held`` (run since its inputs were last
    loaded, and not yet consumed by a phase 1: the second phase frees what it reads last)."""
    n = len(dag.tasks)
    if phase is None:
        return 0, n
    if dag.phase_split is None:
        raise ExecError("execute(phase=...) runs one phase of a program compiled with second_phase_inputs; "
                        "this one runs whole: call execute().")
    if phase == 0:
        return 0, dag.phase_split
    if phase == 1:
        if not held:
            raise ExecError("execute(phase=1) continues a first phase run since its inputs were last loaded "
                            "(and not yet followed by a second); call execute(phase=0) first.")
        return dag.phase_split, n
    raise ExecError(f"phase must be 0, 1 or None; got {phase!r}.")


def phase_ready(dag: TaskDAG) -> dict[str, int]:
    """Per saved output, how many tasks must have run for it to be there: the first phase's end for an
    output that phase makes (no second-phase task writes its blocks), else all of them."""
    n = len(dag.tasks)
    if dag.phase_split is None:
        return {name: n for name in dag.outputs}
    late = {dag.root(b) for t in dag.tasks[dag.phase_split:] for b in t.outputs}
    return {name: n if any(dag.root(b) in late for _, b in blocks) else dag.phase_split
            for name, blocks in dag.outputs.items()}


@dataclass(frozen=True)
class Liveness:
    """When each buffer dies, and the memory each device needs.  A view dies with its root: the root's
    ``last_use`` covers every view of it, and only roots hold bytes."""

    last_use: dict[int, int]           # buffer -> index of the last task reading it (persistent: len(tasks))
    persistent: frozenset[int]         # loaded inputs and saved outputs (and the roots they are views of)
    peak: dict[int, int]               # device -> peak bytes
    resident: dict[int, int]           # device -> bytes of persistent buffers
    views: frozenset[int] = frozenset()  # buffers that are views or share a reshape's input (they free nothing)
    # with liveness(dag, category=...): device -> category -> bytes live at that device's peak
    at_peak: dict[int, dict[str, int]] = field(default_factory=dict)
    shares: Mapping[int, int] = field(default_factory=dict)  # reshape output in its input's memory -> input

    def frees_after(self) -> dict[int, list[int]]:
        """Task -> the buffers an executor may drop after it: roots after their last use, and reshape
        outputs after theirs (a reference to their input's memory, which the root's death frees)."""
        out: dict[int, list[int]] = defaultdict(list)
        for b, t in self.last_use.items():
            if b not in self.persistent and (b not in self.views or b in self.shares):
                out[t].append(b)
        return out


def reshape_shares(dag: TaskDAG) -> dict[int, int]:
    """Reshape outputs that keep their input's bytes -> that input: a ``reshape`` kernel whose input
    is a whole buffer (not a view, whose strides are its parent's) and neither side a ⊕ partial."""
    out: dict[int, int] = {}
    for t in dag.tasks:
        if t.kind != "kernel" or t.op is None or dag.nodes[t.op].kind != "reshape":
            continue
        src, dst = t.inputs[0], t.outputs[0]
        if dag.buffers[src].partial is None and dag.buffers[dst].partial is None and dag.buffers[src].parent is None:
            out[dst] = src
    return out


def liveness(dag: TaskDAG, category: Callable[[int], str] | None = None,
             shares: Mapping[int, int] | None = None, scratch: Mapping[int, int] | None = None) -> Liveness:
    """Free each buffer after its last use; report per-device peak bytes.

    Loaded inputs stay resident (a program executes many times on one load) and
    saved outputs stay until they are offloaded.  A root is born with the first
    write to it or to any of its views and dies after the last use of any of them.
    ``category`` (tensor node id -> a name) also splits each device's peak by category;
    ``shares`` (:func:`reshape_shares`) are counted as views of the buffers they reshape; ``scratch``
    (task -> bytes) is memory a kernel task holds while it runs, besides its outputs (in the category
    ``"other"``).
    """
    buffers, tasks = dag.buffers, dag.tasks
    root = dag.view_roots(shares)
    views = frozenset(root)
    persistent = {b for blocks in dag.inputs.values() for _, b in blocks}
    persistent |= {b for blocks in dag.outputs.values() for _, b in blocks}
    persistent |= {root[b] for b in persistent if b in root}
    end = len(tasks)
    # a view of a reshape output is read through that output (an executor holds its value), so the
    # reshape output lives as long as its views too.  (The end of a view's chain of parents has no parent
    # itself, so only ``shares`` can put it in ``root``: without them there is none.)
    through: dict[int, int] = {}
    if shares:
        for b in root:
            p = buffers[b].parent
            if p is None:  # (a reshape output, no view)
                continue
            while (up := buffers[p].parent) is not None:  # to the end of b's chain of parents (``dag.root(b)``)
                p = up
            if p in root:
                through[b] = p
    # task ids increase, so a buffer's last use is the last task naming it (or a view of it).  ``born``: the
    # first task writing each persistent root or a view of it (whether it is loaded); no other is asked for
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
                if b in persistent and b not in born:
                    born[b] = tid
                last_use[b] = tid
            else:
                if r in persistent and r not in born:
                    born[r] = tid
                if b not in last_use:  # written but never read: dies right away
                    last_use[b] = tid
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
        kind = t.kind
        if kind == "load":
            continue
        if kind != "assign":  # an assign writes a loaded (resident) block
            for b in t.outputs:
                r = root.get(b, b)
                if r in counted:
                    continue
                counted.add(r)
                buf = buffers[r]
                d = buf.device
                n = buf.nbytes
                now = live[d] + n
                live[d] = now
                if category is not None:
                    by[d][category(buf.tensor)] += n
                    if now > peak[d]:
                        at_peak[d] = dict(by[d])
                if now > peak[d]:
                    peak[d] = now
        if scratch:
            extra = scratch.get(t.id, 0)
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
                n = buf.nbytes
                live[buf.device] -= n
                if category is not None:
                    by[buf.device][category(buf.tensor)] -= n
    for d in range(dag.p):
        peak.setdefault(d, 0)
        resident.setdefault(d, 0)
    return Liveness(last_use, frozenset(persistent), dict(peak), dict(resident), views, at_peak, dict(shares or {}))


def graph_liveness(graph: Graph, dag: TaskDAG, categories: bool = False,
                   scratch: Mapping[int, int] | None = None) -> Liveness:
    """:func:`liveness` of the DAG lowered from ``graph``: its reshape outputs counted in their input's
    memory (``reshape_shares``), with ``categories`` each peak split by ``Graph.memory_categories``, and
    the kernels' ``scratch`` (task -> bytes; on GPUs, ``kernels.launchers.kernel_scratch``) at its task."""
    return liveness(dag, graph.memory_categories().__getitem__ if categories else None, reshape_shares(dag),
                    scratch)

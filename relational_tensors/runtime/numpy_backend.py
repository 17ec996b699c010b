"""The NumPy executor: the task DAG on virtual devices ``cpu:0..p-1``.

Each device has its own buffer pool (a dict of arrays); a copy task copies an
array from one pool into another, so nothing is shared between devices that
the DAG does not move.  Buffers are freed after their last use, as the
liveness pass planned; the executor checks its own peak against the plan's.
A view is a NumPy view of its root's array: writing it writes the root, which
is allocated by the first write to it or to any of its views.  The views a run
writes of a state's kept block (its next value, assembled in place) are written
into a copy of the block that replaces it when the run finishes, as the
``assign`` tasks are: a run that stops part-way leaves every state as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from relational_tensors.core.aggregation import Aggregation
from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.feeds import STALE_OUTPUTS, check_feed_names, check_loaded, coerce_feed, refuse_bound
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import ExecError
from relational_tensors.physical.tasks import (
    AggregatePayload,
    DecomposePayload,
    Liveness,
    RecomposePayload,
    TaskDAG,
    phase_range,
    phase_ready,
)

__all__ = ["NumpyExecutor", "block_pieces"]


def _nbytes(x: Any) -> int:
    if isinstance(x, tuple):
        return sum(_nbytes(a) for a in x)
    return int(x.nbytes)


class NumpyExecutor:
    """Runs one TaskDAG; ``load`` once, ``execute`` as often as wanted, ``offload`` results."""

    def __init__(self, dag: TaskDAG, live: Liveness, bind: Mapping[str, Any] | None = None) -> None:
        self.dag = dag
        self.live = live
        self.pools: list[dict[int, Any]] = [dict() for _ in range(dag.p)]
        self.frees = live.frees_after()
        self.copied: dict[int, int] = {}  # reshape outputs -> bytes of their own (0 where they kept the input's)
        self.loaded = False
        self.resident: set[str] = set()
        self.done = 0  # tasks run, in order, since the inputs they read were loaded (phases: see execute)
        self.runs = 0  # executions that finished
        self.peak = [0] * dag.p
        self.split = dag.phase_split if dag.phase_split is not None else len(dag.tasks)
        self.ready = phase_ready(dag)
        self.held = False  # what a first phase left for the second is on the devices
        kept = dag.kept_state_blocks()
        # the views of kept state blocks that a run writes (a state's next value), and during a run the
        # next value of each such block, put in place when the run finishes
        root = dag.view_roots()
        written = {b for t in dag.tasks for r, b in dag.kept_writes(t, kept, root) if b != r}
        # ... and the views cut out of those (atoms of a next value a kernel wrote in place, read by copies):
        # they hold the next value too
        self.next_views = {b for b in root if _through(dag, b, written)}
        self.next_values: dict[int, np.ndarray] = {}
        self.bound_arrays: dict[str, np.ndarray] = {}
        if bind:
            self._bind(bind)

    def _bind(self, bind: Mapping[str, Any]) -> None:
        """Inputs read in place (``runtime/binding.py``; ``check_bind`` passed when the program was compiled):
        every block of each is a view of its array."""
        for name, value in bind.items():
            try:
                a = np.asarray(value)
            except (TypeError, ValueError, RuntimeError):  # (a GPU tensor, a torch bfloat16 one)
                a = None
            if a is None or a.dtype == object:
                raise ExecError(f"bound input {name!r} is read in place on the host: give a NumPy array of its "
                                f"dtype; got {type(value).__name__}.")
            self.bound_arrays[name] = a
            for box, buf in self.dag.inputs.get(name, ()):  # (an input no operator reads has no blocks)
                if self._holds(buf):
                    self._put(buf, a[box.slices()])
        self.resident.update(self.bound_arrays)

    def _put(self, buf: int, value: Any) -> int:
        """Store ``value`` as buffer ``buf``; returns the bytes newly allocated."""
        dag = self.dag
        pool = self.pools[dag.buffers[buf].device]
        root = dag.root(buf)
        if buf in self.live.shares:  # a reshape of a whole block: in its memory, which the input's root holds
            pool[buf] = value
            src = self._get(self.live.shares[buf]) if dag.root(self.live.shares[buf]) in pool else None
            self.copied[buf] = 0 if src is not None and np.may_share_memory(value, src) else _nbytes(value)
            return self.copied[buf]
        if buf in self.next_views:  # part of a state's next value: in its block's copy until the run ends
            rb = dag.buffers[root]
            block = self.next_values.get(root)
            if block is None:
                block = self.next_values[root] = np.empty(rb.box.shape, dtype=numpy_dtype(rb.dtype))
            block[dag.buffers[buf].box.slices(rb.box)] = value
            return 0
        if root == buf and root not in pool:
            pool[buf] = value
            return _nbytes(value)
        if root == buf and pool[root] is value:  # a recompose that filled the block its views wrote into
            return 0
        fresh = 0
        if root not in pool:  # the first write to one of its views allocates the root
            rb = dag.buffers[root]
            pool[root] = np.empty(rb.box.shape, dtype=numpy_dtype(rb.dtype))
            fresh = _nbytes(pool[root])
        pool[root][dag.buffers[buf].box.slices(dag.buffers[root].box)] = value
        return fresh

    def _get(self, buf: int) -> Any:
        dag = self.dag
        pool = self.pools[dag.buffers[buf].device]
        root = dag.root(buf)
        if root not in pool:
            raise ExecError(f"buffer {buf} is not resident on device {dag.buffers[buf].device}; "
                            "the task DAG read it after it was freed.")
        if root == buf:
            return pool[buf]
        if buf in self.next_views and root in self.next_values:
            return self.next_values[root][dag.buffers[buf].box.slices(dag.buffers[root].box)]
        return pool[root][dag.buffers[buf].box.slices(dag.buffers[root].box)]

    def _holds(self, buf: int) -> bool:
        """Whether this executor keeps buffer ``buf`` (every device is this process's here)."""
        return True

    def load(self, feeds: Mapping[str, Any], partial: bool = False, owned: bool = False) -> None:
        """Materialize every graph input straight into the blocks the plan reads, on their devices.

        A feed is a whole array, or a list of ``(offset, array)`` pieces of the tensor (see
        :func:`block_pieces`) that together cover every block this executor keeps of it; ``owned``
        pieces (read for this load alone) are kept as they are where one is a whole block."""
        dag = self.dag
        refuse_bound(feeds, self.bound_arrays)
        held = {name for name, blocks in dag.inputs.items() if any(self._holds(b) for _, b in blocks)}
        # inputs loaded before (weights) stay loaded: a later load may name only the ones that change
        names = check_feed_names(self.dag.input_nodes, feeds, [] if partial else [
            n for n in dag.inputs if n in held and n not in self.resident and n not in dag.later])
        # every feed is checked before any is placed: a load that fails changes nothing
        values: dict[str, list[tuple[int, Any]]] = {}
        for name in dag.inputs:
            if name not in feeds:
                continue
            t = names[name].type
            pieces = block_pieces(name, feeds[name], t)
            mine = [(box, buf) for box, buf in dag.inputs[name] if self._holds(buf)]
            if pieces is None:
                whole = coerce_feed(name, feeds[name], t)
                values[name] = [(buf, np.array(whole[box.slices()], copy=True)) for box, buf in mine]
            else:
                values[name] = [(buf, _cover(name, box, pieces, t.dtype, owned)) for box, buf in mine]
        # the saved outputs no longer belong to the loaded inputs; loading only second-phase inputs keeps
        # what the first phase made
        self.done = min(self.done, self.split if set(values) <= dag.later else 0)
        self.held = self.held and set(values) <= dag.later
        for blocks in values.values():
            for buf, value in blocks:
                self._put(buf, value)
        self.resident.update(values)
        self.resident.update(n for n in dag.inputs if n not in held)  # nothing of it is kept here
        self.loaded = True

    @property
    def fresh(self) -> bool:
        """Every saved output belongs to the loaded inputs (a whole execution ran after the last load)."""
        return self.done == len(self.dag.tasks)

    def execute(self, phase: int | None = None) -> None:
        """Run the program; with ``phase`` 0 or 1, only that phase of a program split in two
        (``TaskDAG.phase_split``): phase 1 continues a phase 0 run since the last load of its inputs."""
        lo, hi = phase_range(self.dag, phase, self.held)
        needed = self.dag.inputs if hi > self.split else {n: v for n, v in self.dag.inputs.items()
                                                           if n not in self.dag.later}
        check_loaded(self.loaded, self.resident & set(needed), needed)
        self.done = min(self.done, lo)
        self.held = False  # a second phase frees what it reads last; a failed run leaves nothing
        try:
            self._execute(lo, hi)
        except BaseException:
            # a run that stops part-way (an error, Ctrl-C) leaves only the loaded inputs behind: the
            # next execute() starts clean, and offload() refuses until one finishes
            loaded = {b for blocks in self.dag.inputs.values() for _, b in blocks}
            for pool in self.pools:
                for b in [b for b in pool if b not in loaded]:
                    del pool[b]
            self.next_values.clear()
            self.done = 0
            raise
        self.done = hi
        self.held = phase == 0
        if hi == len(self.dag.tasks):
            self.runs += 1

    def _execute(self, lo: int, hi: int) -> None:
        dag = self.dag
        live = [sum(self.copied.get(b, 0) if b in self.live.shares else _nbytes(v) for b, v in pool.items())
                for pool in self.pools]
        self.peak = list(live)
        assigned: list[tuple[int, Any]] = []  # written into the states' blocks once the whole run has finished

        def keep(results: list[tuple[int, Any]], after: list[Any]) -> None:
            """Put ``results`` (buffer, value), then free what the tasks ``after`` read last."""
            for b, value in results:
                d = dag.buffers[b].device
                live[d] += self._put(b, value)
                self.peak[d] = max(self.peak[d], live[d])
            for task in after:
                for b in self.frees.get(task.id, ()):
                    d = dag.buffers[b].device
                    value = self.pools[d].pop(b, None)
                    if value is not None:
                        live[d] -= self.copied.pop(b) if b in self.live.shares else _nbytes(value)

        for task in dag.tasks[lo:hi]:
            if task.kind == "load" or not self._mine(task):
                continue
            if task.kind == "assign":
                assigned.append((task.outputs[0], self._get(task.inputs[0])))
                continue
            self._step(task, keep)
        for b, value in assigned:  # a run that stops part-way leaves every state as it was
            self._put(b, value)
        for root, block in self.next_values.items():  # the next values assembled in place
            np.copyto(self.pools[dag.buffers[root].device][root], block)
        self.next_values.clear()

    def _step(self, task: Any, keep: Any) -> None:
        """Run one task and keep its outputs (``keep(results, tasks whose last reads are done)``)."""
        keep(list(zip(task.outputs, self._outputs(task))), [task])

    def _mine(self, task: Any) -> bool:
        """Whether this executor runs ``task`` (every task here: all devices are this process's)."""
        return True

    def _outputs(self, task: Any) -> list[Any]:
        """The values of ``task``'s outputs, computed from its inputs."""
        return self._run(task, [self._get(b) for b in task.inputs])

    def _run(self, task: Any, ins: list[Any]) -> list[Any]:
        kind = task.kind
        if kind == "kernel":
            node = self.dag.nodes[task.op]
            run = task.kernel
            dtype = self.dag.buffers[task.outputs[0]].dtype
            if dtype == node.type.dtype:
                out = node.op.kernel(ins, run.function)
            else:  # an unaggregated partial, kept wider than the output
                out = node.op.partial_kernel(ins, run.function, dtype)
                if isinstance(out, tuple) and node.type.dtype != "float64":
                    # its log-sum-exp rows in float32, as the plan counts them and the GPU kernels write them
                    out = (out[0], np.asarray(out[1], dtype=np.float32))
            if run.final:
                out = np.asarray(run.aggregation.finalize(out)).astype(
                    numpy_dtype(node.type.dtype), copy=False)
            return [out]
        if kind == "copy":
            return [tuple(np.array(a, copy=True) for a in ins[0]) if isinstance(ins[0], tuple)
                    else np.array(ins[0], copy=True)]
        if kind == "aggregate":
            assert isinstance(task.payload, AggregatePayload)
            return [task.payload.aggregation.combine(ins)]
        if kind == "decompose":
            src = self.dag.buffers[task.inputs[0]].box
            assert isinstance(task.payload, DecomposePayload)
            return [_slice(ins[0], cell.slices(src)) for cell in task.payload.cells]
        if kind == "recompose":
            out_buf = self.dag.buffers[task.outputs[0]]
            pool = self.pools[out_buf.device]
            # copies may already have written some pieces into the block (views of it): keep them (a
            # state's next value is assembled in its kept block's copy, ``next_values``)
            written = (self.dag.root(out_buf.id) in self.next_values if out_buf.id in self.next_views
                       else out_buf.id in pool)
            out = self._get(out_buf.id) if written else np.empty(out_buf.box.shape, dtype=numpy_dtype(out_buf.dtype))
            pieces = task.payload
            assert isinstance(pieces, RecomposePayload)
            # only partial pieces are finalized, and a tensor with partials has a ⊕ (graph inputs have none)
            agg = cast(Aggregation, pieces.aggregation)
            for cell, value, final in zip(pieces.cells, ins, pieces.finalize):
                out[cell.slices(out_buf.box)] = agg.finalize(value) if final else value
            return [out]
        raise ExecError(f"the numpy executor cannot run task kind {kind!r}.")

    def state(self, name: str) -> np.ndarray:
        """The current value of a state, assembled from the blocks the devices keep of it."""
        if name not in self.resident:
            raise ExecError(f"state {name!r} has no value yet; load it first: cg.load({{{name!r}: array}}).")
        node = self.dag.node(name)
        out = np.empty(node.type.shape, dtype=numpy_dtype(node.type.dtype))
        for box, buf in self.dag.inputs[name]:
            out[box.slices()] = self._get(buf)
        return out

    def _check_offload(self, name: str) -> None:
        """Refuse to offload ``name`` unless it is a saved output that a finished execution made."""
        if name not in self.dag.outputs:
            raise ExecError(f"no saved output named {name!r}; saved: {sorted(self.dag.outputs)}.")
        if self.done < self.ready[name]:
            if not self.runs and not self.done:
                raise ExecError("execute the program before offloading results: cg.execute().")
            raise ExecError(STALE_OUTPUTS)

    def offload(self, name: str) -> np.ndarray:
        """The saved tensor ``name``, assembled from its blocks."""
        self._check_offload(name)
        node = self.dag.saved_node(name)
        out = np.empty(node.type.shape, dtype=numpy_dtype(node.type.dtype))
        for box, buf in self.dag.outputs[name]:
            value = self._get(buf)
            out[box.slices()] = value[0] if isinstance(value, tuple) else value
        return out


def block_pieces(name: str, value: Any, t: Any) -> list[tuple[Box, np.ndarray]] | None:
    """A feed given as pieces, ``[(offset, array), ...]`` (each array the part of the tensor that starts at
    ``offset``), as (box, array of the tensor's dtype) pairs, each checked to lie inside the tensor; None
    for a feed that is a whole array."""
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], np.ndarray)
            and isinstance(p[0], (tuple, list)) for p in value):
        return None
    out = []
    for offset, array in value:
        if len(offset) != t.rank or not all(isinstance(o, (int, np.integer)) and not isinstance(o, bool)
                                            for o in offset) or array.ndim != t.rank:
            raise ExecError(f"a piece of input {name!r} is (offset, array) with {t.rank} offsets and a {t.rank}-d "
                            f"array; got offset {tuple(offset)} and an array of shape {array.shape}.")
        box = Box(tuple(int(o) for o in offset), tuple(int(o) + n for o, n in zip(offset, array.shape)))
        if not t.box.contains(box) or any(o < 0 for o in box.lower):
            raise ExecError(f"a piece of input {name!r} at {tuple(offset)} of shape {array.shape} lies outside the "
                            f"tensor's shape {t.shape}.")
        out.append((box, coerce_feed(name, array, TensorType.zero(array.shape, t.dtype))))
    return out


def _cover(name: str, block: Box, pieces: list[tuple[Box, np.ndarray]], dtype: str, owned: bool) -> np.ndarray:
    """Block ``block`` of input ``name`` assembled from ``pieces``, refused unless they cover it (``owned``:
    the pieces are this executor's to keep, so a piece that is the whole block is kept, not copied)."""
    for box, array in pieces:
        if owned and box == block and array.dtype == numpy_dtype(dtype):
            return array  # the piece is the block, and no one else holds it (a checkpoint's read): not copied
    out = np.empty(block.shape, dtype=numpy_dtype(dtype))
    covered = np.zeros(block.shape, dtype=bool)
    for box, array in pieces:
        part = box.intersect(block)
        if not part.is_empty:
            out[part.slices(block)] = array[part.slices(box)]
            covered[part.slices(block)] = True
    if not covered.all():
        raise ExecError(f"the pieces given for input {name!r} do not cover its block {block} (that this process "
                        f"keeps): {int(covered.size - covered.sum())} of its {covered.size} elements are missing. "
                        "Give pieces that cover it, or the whole array.")
    return out


def _slice(value: Any, index: tuple[slice, ...]) -> Any:
    if isinstance(value, tuple):  # an lse partial: (out [..., d], lse [...])
        out, lse = value
        return np.ascontiguousarray(out[index]), np.ascontiguousarray(lse[index[:-1]])
    return np.ascontiguousarray(value[index])


def _through(dag: TaskDAG, b: int, written: set[int]) -> bool:
    """Whether view ``b`` is one of ``written`` or lies inside one (a view of a view of it)."""
    at: int | None = b
    while at is not None:
        if at in written:
            return True
        at = dag.buffers[at].parent
    return False

"""Replaying lowerings: the identical layers of a deep model are lowered once and stamped.

An operator whose lowering has the geometry of one lowered before (the same spec, placement hint and
readable blocks: ``physical.lower``'s geometry key) gets that lowering's tasks again with fresh buffer ids
(``Replay``); an exchange whose program has the geometry of one run before (its sources, readers and
⊕) gets that run's tasks again (``ProgramReplay``): the assignments of the states of identical layers,
which no operator's replay covers.  Both make exactly the tasks a fresh lowering would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from relational_tensors.core.types import Box
from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import ExProg
from relational_tensors.exchange.naive import Membership
from relational_tensors.graph.graph import Graph
from relational_tensors.physical.tasks import Buffer, Task, TaskDAG

__all__ = ["LoweringState", "ProgramReplay", "Replay"]


def _made(dag: TaskDAG, task: Task, tensor_ref: dict[int, int], shift: int = 0) -> list[tuple[Any, ...]] | None:
    """The buffers ``task`` makes as (device less ``shift``, box, dtype, tensor ref, partial), or None when
    one is a view or a block of a tensor the recording does not name."""
    outs = []
    for b in task.outputs:
        buf = dag.buffers[b]
        if buf.tensor not in tensor_ref or buf.parent is not None:
            return None
        outs.append((buf.device - shift, buf.box, buf.dtype, tensor_ref[buf.tensor], buf.partial))
    return outs


class LoweringState(Protocol):
    """What a replay reads and writes of a lowering in progress (``physical.lower``)."""

    dag: TaskDAG
    graph: Graph
    kernel_out: dict[int, list[int]]
    loaded: dict[tuple[int, Box, int], int]
    loaded_blocks: dict[int, list[tuple[Box, int]]]
    placement: dict[int, tuple[int, ...]]
    programs: dict[str, ExProg]
    memberships: dict[str, Membership]
    searched: set[str]

    def load(self, tensor: int, box: Box, device: int) -> int: ...


@dataclass(frozen=True, slots=True)
class ProgramReplay:
    """The tasks one run of an exchange program made (``_Lowering.run_program``), so that an exchange of the
    same geometry makes the same tasks and buffers by replaying them (the assignments of the states of
    identical layers, their gradients' and updates' exchanges).  A buffer is referred to by an int: n >= 0
    the n-th buffer the run made, ~e (negative) the e-th source block (every tensor's sources in order).
    Each step is (kind, device, input refs, output buffers as (device, box, dtype, tensor index, partial),
    source device, payload, and whether the label is the program's name and its text or the text alone);
    ``state`` is the run's (aggregate, site) -> buffer ref."""

    steps: tuple[tuple[Any, ...], ...]
    state: tuple[tuple[tuple[frozenset[str], int], int], ...]
    made: int

    @staticmethod
    def record(dag: TaskDAG, first_task: int, first_buffer: int, tensors: Sequence[int], sources: Sequence[int],
               state: dict[tuple[frozenset[str], int], int], name: str) -> ProgramReplay | None:
        """The run that made tasks ``first_task..`` and buffers ``first_buffer..``, or None when one of its
        tasks reads a buffer that is neither made by it nor a source."""
        outside = {b: ~e for e, b in enumerate(sources)}
        tensor_ref = {t: n for n, t in enumerate(tensors)}

        def ref(b: int) -> int | None:
            return b - first_buffer if b >= first_buffer else outside.get(b)

        steps = []
        made = first_buffer
        for task in dag.tasks[first_task:]:
            if any(b != made + n for n, b in enumerate(task.outputs)):
                return None  # buffers are made in task order
            made += len(task.outputs)
            ins = [ref(b) for b in task.inputs]
            if any(r is None for r in ins):
                return None
            outs = _made(dag, task, tensor_ref)
            if outs is None:
                return None
            named = task.label.startswith(name + ":")
            steps.append((task.kind, task.device, tuple(ins), tuple(outs), task.src_device, task.payload,
                          (named, task.label[len(name):] if named else task.label)))
        refs = {k: ref(b) for k, b in state.items()}
        if made != len(dag.buffers) or any(r is None for r in refs.values()):
            return None
        return ProgramReplay(tuple(steps), tuple((k, r) for k, r in refs.items() if r is not None),
                              made - first_buffer)

    def apply(self, dag: TaskDAG, tensors: Sequence[int], sources: Sequence[int], op: int | None,
              name: str) -> dict[tuple[frozenset[str], int], int]:
        """The recorded tasks, appended with fresh buffer ids; the run's state over them."""
        buffers, tasks = dag.buffers, dag.tasks
        base = len(buffers)
        for kind, device, ins, outs, src_device, payload, (named, label) in self.steps:
            made = []
            for b_device, box, dtype, tensor, partial in outs:
                b = len(buffers)
                buffers[b] = Buffer(b, b_device, box, dtype, tensors[tensor], partial)
                made.append(b)
            tasks.append(Task(len(tasks), kind, device, tuple(base + r if r >= 0 else sources[~r] for r in ins),
                              tuple(made), op, src_device, payload, name + label if named else label))
        if len(buffers) != base + self.made:
            raise ExchangeError(f"replaying the exchange {name!r} made {len(buffers) - base} buffers where its "
                                f"recording made {self.made}: a geometry key misses something the program reads.")
        return {k: base + r if r >= 0 else sources[~r] for k, r in self.state}


@dataclass(frozen=True, slots=True)
class Replay:
    """The tasks one operator's lowering made, with the operator's own tensor and name and its buffer ids
    left out, so that an operator of the same geometry gets the same tasks, buffers, placement and program
    by replaying them.  A buffer is referred to by an int: n >= 0 the n-th buffer the lowering made (they
    are made in task order, so the n-th is the first one's id + n), ~e (negative) the e-th of ``outside``:
    ("out", t, f) function spec f's kernel output of distinct input t, or ("load", t, box, device) a block
    of distinct input t loaded before.  Each step is a load (distinct input, box, device) or a task (kind,
    device, input refs, output buffers as (device, box, dtype, tensor: -1 the operator or a distinct
    input, partial), source device, payload, and whether the label is the operator's name and its text or
    the text alone)."""

    steps: tuple[tuple[Any, ...], ...]
    outside: tuple[tuple[Any, ...], ...]
    made: int  # buffers made
    placement: tuple[int, ...]
    kernel_out: tuple[int, ...]  # the new buffers the kernels wrote
    program: tuple[ExProg, Membership, bool] | None  # the operator's exchange program, membership, searched
    recorded_at: int = 0  # the shift the program (which names devices) was recorded at
    # shift -> what ``_moved`` makes for it, once per pipeline stage (the program: checked and laid out once)
    moved: dict[int, tuple[Any, ...]] = field(default_factory=dict, compare=False)

    @staticmethod
    def record(low: LoweringState, op_id: int, first_task: int, first_buffer: int,
               readable: dict[int, dict[tuple[Box, int], int]], shift: int = 0) -> Replay | None:
        """The lowering of ``op_id`` that made tasks ``first_task..`` and buffers ``first_buffer..``, or None
        when a task of it reads or names something the geometry key does not fix.  Devices are recorded
        less ``shift`` (the first device of a pipeline stage's group), so that the same layer in another stage
        replays it on its own devices."""
        dag, node = low.dag, low.graph.nodes[op_id]
        name = node.name
        distinct = list(dict.fromkeys(node.inputs))
        tensor_ref = {op_id: -1, **{i: t for t, i in enumerate(distinct)}}
        outside: dict[int, tuple[Any, ...]] = {}
        for t, i in enumerate(distinct):
            for f, b in enumerate(low.kernel_out.get(i, ())):
                outside[b] = ("out", t, f)
            for box, device in low.loaded_blocks.get(i, ()):
                b = low.loaded[(i, box, device)]
                if b < first_buffer:
                    outside[b] = ("load", t, box, device - shift)
            for (box, device), b in readable[i].items():
                outside.setdefault(b, ("read", t, box, device - shift))
        used: dict[int, int] = {}  # outside buffer -> its index in ``outside``

        def ref(b: int) -> int | None:
            if b >= first_buffer:
                return b - first_buffer
            if b not in outside:
                return None
            return ~used.setdefault(b, len(used))

        steps: list[tuple[Any, ...]] = []
        made = first_buffer
        for task in dag.tasks[first_task:]:
            if any(b != made + n for n, b in enumerate(task.outputs)):
                return None  # buffers are made in task order
            made += len(task.outputs)
            if task.kind == "load":
                buf = dag.buffers[task.outputs[0]]
                if buf.tensor not in tensor_ref or task.op is not None:
                    return None
                steps.append(("load", tensor_ref[buf.tensor], buf.box, buf.device - shift))
                continue
            ins = [ref(b) for b in task.inputs]
            if task.op != op_id or any(r is None for r in ins):
                return None
            outs = _made(dag, task, tensor_ref, shift)
            if outs is None:
                return None
            label: tuple[bool, str] = (False, task.label)
            if task.kind in ("kernel", "copy"):  # labels that start with the operator's (or program's) name
                if not task.label.startswith(name):
                    return None
                label = (True, task.label[len(name):])
            if task.kind == "copy":  # ... and end with the devices (" 3->5"), written afresh on a replay
                ends = f" {task.src_device}->{task.device}"
                if not task.label.endswith(ends):
                    return None
                label = (True, task.label[len(name):-len(ends)])
            src = None if task.src_device is None else task.src_device - shift
            steps.append(("task", task.kind, task.device - shift, tuple(ins), tuple(outs), src, task.payload,
                          label))
        if made != len(dag.buffers) or any(b < first_buffer for b in low.kernel_out[op_id]):
            return None
        program = None
        if name in low.programs:
            program = (low.programs[name], low.memberships[name], name in low.searched)
        order = sorted(used, key=used.__getitem__)
        return Replay(tuple(steps), tuple(outside[b] for b in order), made - first_buffer,
                      tuple(d - shift for d in low.placement[op_id]),
                      tuple(b - first_buffer for b in low.kernel_out[op_id]), program, shift)

    def _moved(self, shift: int) -> tuple[Any, ...]:
        """What a replay ``shift`` devices on uses: the steps with their devices moved and copies' labels
        written ((kind, device, input refs, outputs, source device, payload, whether the label follows the
        operator's name, label), a load as (None, distinct input, box, device)); the placement; the program
        and its membership there (None without a program)."""
        steps: list[tuple[Any, ...]] = []
        for step in self.steps:
            if step[0] == "load":
                steps.append((None, step[1], step[2], step[3] + shift))
                continue
            _, kind, device, ins, outs, src_device, payload, (named, label) = step
            device += shift
            if src_device is not None:
                src_device += shift
            if kind == "copy":
                label = f"{label} {src_device}->{device}"
            moved = tuple((d + shift, box, dtype, tensor, partial) for d, box, dtype, tensor, partial in outs)
            steps.append((kind, device, ins, moved, src_device, payload, named, label))
        program = None
        if self.program is not None:
            prog, membership, _ = self.program
            move = shift - self.recorded_at
            program = (prog.moved(move), {k: tuple(d + move for d in v) for k, v in membership.items()}) \
                if move else (prog, membership)
        return tuple(steps), tuple(d + shift for d in self.placement), program

    def apply(self, low: LoweringState, op_id: int, readable: dict[int, dict[tuple[Box, int], int]],
              shift: int = 0) -> None:
        """The recorded lowering, for ``op_id``: its tasks appended with fresh buffer ids, on the recorded
        devices plus ``shift``."""
        dag, node = low.dag, low.graph.nodes[op_id]
        name = node.name
        tensors = (*dict.fromkeys(node.inputs), op_id)  # index -1: the operator
        buffers, tasks = dag.buffers, dag.tasks
        outside = [low.kernel_out[tensors[r[1]]][r[2]] if r[0] == "out" else
                   low.loaded[(tensors[r[1]], r[2], r[3] + shift)] if r[0] == "load" else
                   readable[tensors[r[1]]][(r[2], r[3] + shift)] for r in self.outside]
        base = len(buffers)
        moved = self.moved.get(shift)
        if moved is None:
            moved = self.moved[shift] = self._moved(shift)
        steps, placement, program = moved
        nb, nt = base, len(tasks)
        for step in steps:
            if step[0] is None:  # a load
                _, t, box, device = step
                low.load(tensors[t], box, device)
                nb, nt = len(buffers), len(tasks)
                continue
            kind, device, ins, outs, src_device, payload, named, label = step
            made = []
            for b_device, box, dtype, tensor, partial in outs:
                buffers[nb] = Buffer(nb, b_device, box, dtype, tensors[tensor], partial)
                made.append(nb)
                nb += 1
            tasks.append(Task(nt, kind, device, tuple([base + r if r >= 0 else outside[~r] for r in ins]),
                              tuple(made), op_id, src_device, payload, name + label if named else label))
            nt += 1
        if len(buffers) != base + self.made:
            raise ExchangeError(f"replaying the lowering of {name!r} made {len(buffers) - base} buffers where its "
                                f"recording made {self.made}: a geometry key misses something the lowering reads.")
        low.placement[op_id] = placement
        low.kernel_out[op_id] = [base + n for n in self.kernel_out]
        if program is not None and self.program is not None:
            low.programs[name], low.memberships[name] = program
            if self.program[2]:  # searched
                low.searched.add(name)

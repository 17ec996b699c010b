"""From the logical plan to the task DAG (section 5.3).

Per operator, in topological order:

1. placement: each function spec goes to a device, greedily matching the
   specs to the devices that already hold most of the bytes they read, then the
   identity; an operator none of whose inputs is placed yet (a chain of
   elementwise updates whose states are not yet loaded) takes the devices of the
   last operator with the same output blocks (so it follows the gradient it
   started from).  Ties among placed bytes never follow an earlier operator:
   that would carry one layer's tie-breaks into the next, and identical layers
   would be placed, and lowered, differently;
2. the ExProg preamble: atoms are the cells of the overlay of the producer's
   output blocks and the blocks the operator reads (one atom per cell and
   producing copy, unaggregated); IN puts each at the device of its copy, OUT
   asks for the ⊕-aggregate of each cell at every function spec reading it,
   each function spec a partition declared by size 1 whose device the
   synthesizer may choose (starting from the greedy placement);
3. the body: ``naive`` gathers every required aggregate at each reading
   device and aggregates there;
4. tasks: decompose producer blocks into atoms, run the program (aggregate and
   copy tasks, in firing order), recompose atoms into kernel inputs, run the
   kernel.  Graph inputs are loaded straight into the blocks a spec reads.

A block of an operator's output that a kernel of one of the last ``REUSE_WINDOW``
operators read on a device is read there again by a function spec placed there
that reads the same block, rather than delivered again (two projections of one
normalized activation, the weight gradients of both, the three
attention-backward passes over one key block); the window bounds how much
longer the block stays alive.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import partial_dtype
from relational_tensors.core.types import Box
from relational_tensors.dp_optimizer.pipeline import PipelinedPlan, ancestors, forward_ops
from relational_tensors.dp_optimizer.plan import LogicalPlan
from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import ExProg, InAtom, Partition, Requirement, aggregate_text, exact_cover
from relational_tensors.exchange.naive import Membership, Synthesizer, naive
from relational_tensors.graph.graph import Graph
from relational_tensors.physical.placement import place
from relational_tensors.physical.replay import ProgramReplay, Replay
from relational_tensors.physical.schedule import pipeline_order
from relational_tensors.physical.tasks import (
    AggregatePayload,
    DecomposePayload,
    KernelPayload,
    LoadPayload,
    RecomposePayload,
    TaskDAG,
    block_bytes,
    split_phases,
)
from relational_tensors.physical.views import fuse_views

__all__ = ["Lowered", "lower", "place", "covers", "value_blocks", "SCHEDULES", "KEPT"]

SCHEDULES = ("naive",)
REUSE_WINDOW = 4  # operators: a block one of the last four read on a device is read there again


@dataclass
class _Atom:
    buffer: int      # the producer copy holding it
    cell: Box
    tensor: int


KEPT = ("as read", "sharded", "pinned")  # pinned: in the layout a constraint gave it


@dataclass
class Lowered:
    """The task DAG, the placement of every operator's function specs, and its exchange programs."""

    dag: TaskDAG
    placement: dict[int, tuple[int, ...]]      # op id -> device of each function spec
    programs: dict[str, ExProg] = field(default_factory=dict)  # op name, "save:<name>" or "assign:<state>"
    memberships: dict[str, Membership] = field(default_factory=dict)  # the partitions' chosen devices
    kept: dict[int, str] = field(default_factory=dict)  # assigned state -> how it is kept (KEPT)
    write_bytes: dict[int, int] = field(default_factory=dict)  # state -> bytes moved to write its value
    searched: frozenset[str] = frozenset()  # the programs not written by the naive synthesizer
    replayed: int = 0  # operators lowered by replaying the tasks of one of the same geometry


def value_blocks(plan: LogicalPlan, value: int) -> tuple[tuple[Box, int], ...]:
    """The blocks a state keeps when kept sharded: each distinct output block of the spec of its value
    (operator ``value``), on the device of the first function spec making it (where the update's kernels
    run, identity placed; in a pipelined plan, on the devices of the update's stage)."""
    if isinstance(plan, PipelinedPlan):
        spec, devices = plan.coarse(value), plan.group(value)
    else:
        spec = plan.spec(value)
        devices = tuple(range(len(spec.functions)))
    first: dict[Box, int] = {}
    for g, f in enumerate(spec.functions):
        first.setdefault(f.output, devices[g])
    return tuple(first.items())


def covers(boxes: Sequence[Box], space: Box) -> bool:
    """Whether the union of ``boxes`` (which may overlap) is all of ``space``: every cell of the overlay
    of their edges lies in one of them (memoized: the identical layers of a deep model ask alike)."""
    return _covers(tuple(boxes), space)


@functools.lru_cache(maxsize=4096)
def _covers(boxes: tuple[Box, ...], space: Box) -> bool:
    if space.is_empty:
        return True
    boxes = tuple(b for b in boxes if not b.is_empty)
    if not boxes:
        return False
    breaks = [np.unique([space.lower[d], space.upper[d], *(x for b in boxes for x in (b.lower[d], b.upper[d]))])
              for d in range(space.rank)]
    hit = np.zeros([len(br) - 1 for br in breaks], dtype=bool)
    for b in boxes:
        hit[tuple(slice(int(np.searchsorted(br, b.lower[d])), int(np.searchsorted(br, b.upper[d])))
                  for d, br in enumerate(breaks))] = True
    inside = tuple(slice(int(np.searchsorted(br, space.lower[d])), int(np.searchsorted(br, space.upper[d])))
                   for d, br in enumerate(breaks))
    return bool(hit[inside].all())


class _Overlay:
    """The cells of the overlay of a tensor's breakpoints, and which of its source blocks hold each:
    per dimension and break interval a bit mask of the blocks spanning it, so a cell's holders are the
    AND of its intervals' masks (the identical layers of deep models make this the lowering's inner loop)."""

    def __init__(self, breaks: list[list[int]], boxes: Sequence[Box]) -> None:
        self.breaks = breaks
        self.index = [{x: j for j, x in enumerate(br)} for br in breaks]
        self.all = (1 << len(boxes)) - 1
        self.masks: list[list[int]] = []
        for d, br in enumerate(breaks):
            masks = [0] * max(len(br) - 1, 0)
            for f, box in enumerate(boxes):
                bit = 1 << f
                for j in range(self.index[d][box.lower[d]], self.index[d][box.upper[d]]):
                    masks[j] |= bit
            self.masks.append(masks)

    def cells(self, block: Box) -> list[tuple[Box, list[int]]]:
        """Each overlay cell inside ``block`` (row-major), with the blocks holding it in order."""
        ranges = [range(self.index[d][block.lower[d]], self.index[d][block.upper[d]]) for d in range(block.rank)]
        out = []
        for js in itertools.product(*ranges):
            mask = self.all
            for d, j in enumerate(js):
                mask &= self.masks[d][j]
            holders = []
            while mask:
                low = mask & -mask
                holders.append(low.bit_length() - 1)
                mask ^= low
            cell = Box(tuple(self.breaks[d][j] for d, j in enumerate(js)),
                       tuple(self.breaks[d][j + 1] for d, j in enumerate(js)))
            out.append((cell, holders))
        return out


class _Lowering:
    def __init__(self, plan: LogicalPlan, synthesize: Synthesizer, kept: Mapping[int, str] | None = None,
                 layouts: Mapping[int, tuple[tuple[Box, int], ...]] | None = None, share: bool = True):
        self.plan = plan
        self.graph: Graph = plan.graph
        self.p = plan.p
        self.dag = TaskDAG(self.p, nodes=tuple(self.graph.nodes), saved=dict(self.graph.outputs))
        self.placement: dict[int, tuple[int, ...]] = {}
        self.programs: dict[str, ExProg] = {}
        self.memberships: dict[str, Membership] = {}
        self.place_memo: dict = {}
        self.recent: dict[tuple[Box, ...], tuple[int, ...]] = {}  # output blocks -> last placement with them
        self.outputs_memo: dict[int, tuple[Box, ...]] = {}  # id(spec) -> its function specs' output blocks
        # tensor -> (block, device) -> (buffer, lowering step) of an operator output's block a kernel read
        self.assembled: dict[int, dict[tuple[Box, int], tuple[int, int]]] = {}
        self.step = 0  # operators lowered so far
        self.window = REUSE_WINDOW  # (negative: every block is delivered to each reader)
        self.exchange_memo: dict = {}  # an exchange's geometry -> its synthesized program (see exchange)
        self.program_replays: dict = {}  # an exchange's geometry -> the tasks its program made (ProgramReplay)
        self.kernel_out: dict[int, list[int]] = {}   # op id -> output buffer of each function spec
        self.loaded: dict[tuple[int, Box, int], int] = {}
        self.loaded_blocks: dict[int, list[tuple[Box, int]]] = {}  # graph input -> (block, device) loaded
        self.synthesize = synthesize
        graph = self.graph
        layouts = layouts or {}
        self.kept = {s: "pinned" if s in layouts else (kept or {}).get(s, "as read") for s in graph.assignments}
        bad = {graph.nodes[s].name: m for s, m in self.kept.items()
               if m not in KEPT or (m == "pinned") != (s in layouts)}
        if bad:
            raise ExchangeError(f"a state is kept {' or '.join(map(repr, KEPT))} (pinned: only with a layout "
                                f"constraint); got {bad}.")
        # a sharded state keeps its value's output blocks, one copy each, on the devices of the value's
        # function specs in order (where the update's kernels run unless they are placed elsewhere)
        # a pinned input or state is held in its constraint's blocks (copies of a block are replicas)
        self.held: dict[int, tuple[tuple[Box, int], ...]] = {}
        for t, blocks in sorted(layouts.items()):
            self.held[t] = tuple(blocks)
            for box, device in blocks:
                self.load(t, box, device)
        for s, mode in self.kept.items():
            if mode == "sharded":
                self.held[s] = value_blocks(plan, graph.assignments[s])
                for box, device in self.held[s]:
                    self.load(s, box, device)
        # each state takes its value once the value is made and the state's last reader has run
        readers = graph.consumers() if graph.assignments else {}
        partial = set() if not graph.assignments else {  # operators whose outputs are partial sums
            n.id for n in graph.operators if max(plan.spec(n.id).output_multiplicity().values(), default=1) > 1}
        self.order = emission_order(graph, partial)  # an update reading a partial gradient right after it
        position = {op: k for k, op in enumerate(self.order)}
        last_reader = {s: max([v, *_readers_through_reshapes(graph, readers, s)], key=lambda r: position.get(r, -1))
                       for s, v in graph.assignments.items()}
        self.assign_after: dict[int, list[int]] = {}
        self.write_bytes: dict[int, int] = {}  # state -> bytes its assignment moves between devices
        self.searched: set[str] = set()  # programs a synthesizer other than the naive one wrote
        self.share = share
        self.replays: dict[tuple[object, ...], Replay | None] = {}  # geometry -> the tasks of its lowering
        self.replayed = 0
        # a saved state that is also assigned is saved as read: its kept blocks copied before the assignment
        self.saved_states = {t for t in graph.outputs.values() if t in graph.assignments}
        self.snapshots: dict[int, list[tuple[Box, int]]] = {}
        for s, at in sorted(last_reader.items()):
            self.assign_after.setdefault(at, []).append(s)

    # --- graph inputs ----------------------------------------------------------
    def load(self, tensor: int, box: Box, device: int) -> int:
        key = (tensor, box, device)
        if key not in self.loaded:
            node = self.graph.nodes[tensor]
            b = self.dag.buffer(device, box, node.type.dtype, tensor)
            self.dag.add("load", device, (), (b,), payload=LoadPayload(node.name, box), label=f"load {node.name}")
            self.dag.inputs.setdefault(node.name, []).append((box, b))
            self.loaded[key] = b
            self.loaded_blocks.setdefault(tensor, []).append((box, device))
        return self.loaded[key]

    # --- one exchange ------------------------------------------------------------
    def sources(self, tensor: int) -> list[tuple[Box, int, bool]]:
        """The blocks a tensor's readers are served from: (box, buffer, whether it is one of several
        partials of that box): an operator's kernel outputs, or a sharded state's kept blocks."""
        if tensor in self.held:
            return [(box, self.load(tensor, box, device), False) for box, device in self.held[tensor]]
        spec = self.plan.spec(tensor)
        multiplicity = spec.output_multiplicity()
        return [(f.output, b, multiplicity[f.output] > 1) for f, b in zip(spec.functions, self.kernel_out[tensor])]

    def exchange(self, name: str, wants: Sequence[tuple[object, int, Box, int]], guess: dict[int, int],
                 op: int | None, synthesize: Synthesizer | None = None
                 ) -> tuple[dict[tuple[object, int], list[tuple[Box, int]]], dict[int, int]]:
        """Deliver blocks of op-produced tensors (or sharded states) to their readers.

        ``wants`` holds (key, tensor, block, reader); each reader (a function spec) is a partition of
        size 1 whose device the synthesizer may choose, starting from ``guess`` (``synthesize``
        overrides the lowering's synthesizer).  Returns, per (key, tensor), the aggregated atoms of
        the block (cell, buffer), and the reader placement.

        The program depends only on the geometry (the sources' blocks, devices and dtypes, the blocks
        read, the readers' devices), so the identical layers of a deep model share one program and
        its synthesis; only its tasks are made per call."""
        synth = synthesize or self.synthesize
        by_tensor: dict[int, list[tuple[object, Box, int]]] = {}
        for key, tensor, block, reader in wants:
            by_tensor.setdefault(tensor, []).append((key, block, reader))
        tensors = sorted(by_tensor)
        made_all = [self.sources(t) for t in tensors]
        buffers = self.dag.buffers
        sig = (synth, tuple(sorted(guess.items())), tuple(
            (tuple((box, buffers[b].device, buffers[b].dtype, several) for box, b, several in made),
             t not in self.held and self.plan.spec(t).aggregation.name == "lse", self.graph.nodes[t].type.rank,
             tuple(by_tensor[t])) for t, made in zip(tensors, made_all)))
        geo = self.exchange_memo.get(sig)
        if geo is None:
            geo = self.exchange_memo[sig] = self._geometry(sig[2], guess, synth)
        prog, membership, placed, atom_src, cells = geo
        if prog is None:  # nothing to deliver
            return {(key, tensors[n]): [] for n, key, _ in cells}, dict(guess)
        atoms = {a: _Atom(made_all[n][f][1], cell, tensors[n]) for a, (n, f, cell) in atom_src.items()}
        self.programs[name] = prog
        if synth is not naive:
            self.searched.add(name)
        self.memberships[name] = membership
        sources = [b for _, b, _ in (s for made in made_all for s in made)]
        # the tasks a program makes follow from its geometry, the sources' ⊕ and partials, and whether they
        # serve an operator: the first run of each is recorded, the others replay it with fresh buffer ids
        key = (sig, tuple(None if t in self.held else self.plan.spec(t).aggregation.name for t in tensors),
               tuple(buffers[b].partial for b in sources), op is None) if self.share else None
        replay = self.program_replays.get(key) if key is not None else None
        if replay:
            state = replay.apply(self.dag, tensors, sources, op, name)
        else:  # recorded when seen a second time (most geometries are seen once: recording would not pay)
            first_task, first_buffer = len(self.dag.tasks), len(buffers)
            state = self.run_program(prog, atoms, membership, op, name)
            if key is not None and replay is not None:
                self.program_replays[key] = ProgramReplay.record(self.dag, first_task, first_buffer, tensors,
                                                                   sources, state, name)
            elif key is not None:
                self.program_replays[key] = False
        out: dict[tuple[object, int], list[tuple[Box, int]]] = {}
        for n, key, entries in cells:
            blocks = []
            for cell, agg, reader in entries:
                device = placed[reader]
                if (agg, device) not in state:
                    raise ExchangeError(f"exchange program of {name} does not deliver "
                                        f"{aggregate_text(agg)} @ {device}.")
                blocks.append((cell, state[(agg, device)]))
            out[(key, tensors[n])] = blocks
        return out, dict(placed)

    def _geometry(self, per_tensor: tuple[Any, ...], guess: dict[int, int], synth: Synthesizer) -> tuple[Any, ...]:
        """The exchange program of one delivery, synthesized, and where its atoms and cells lie: (program
        or None when nothing moves, membership, reader placement, atom -> (tensor index, source index,
        cell), [(tensor index, key, [(cell, aggregate, reader)])])."""
        ins: list[InAtom] = []
        reqs: dict[frozenset[str], list[int | str]] = {}
        readers: dict[int, str] = {}
        atom_src: dict[str, tuple[int, int, Box]] = {}
        cells: list[tuple[int, object, list[tuple[Box, frozenset[str], int]]]] = []
        for n, (made, lse_tensor, rank, reads) in enumerate(per_tensor):
            breaks = [sorted({b for box, *_ in made for b in (box.lower[d], box.upper[d])} |
                             {b for _, blk, _ in reads if not blk.is_empty for b in (blk.lower[d], blk.upper[d])})
                      for d in range(rank)]
            overlay = _Overlay(breaks, [box for box, *_ in made])
            names: dict[tuple[Box, int], str] = {}
            for key, block, reader in reads:
                entry: list[tuple[Box, frozenset[str], int]] = []
                cells.append((n, key, entry))
                if block.is_empty:
                    continue
                part = readers.setdefault(reader, f"F{reader}")
                for cell, holders in overlay.cells(block):
                    if len(holders) > 1 and not any(made[f][3] for f in holders):
                        # replicas of a held block, not partials: read one, the reader's own if it has it
                        holders = [f for f in holders if made[f][1] == guess.get(reader)][:1] or holders[:1]
                    copies = []
                    for f in holders:
                        _, device, dtype, several = made[f]
                        atom = names.get((cell, f))
                        if atom is None:
                            atom = f"t{n}.{len(names)}"
                            names[(cell, f)] = atom
                            atom_src[atom] = (n, f, cell)
                            size = sum(block_bytes(cell, dtype, lse_tensor and several))
                            ins.append(InAtom(atom, device, size))
                        copies.append(atom)
                    agg = frozenset(copies)
                    targets = reqs.setdefault(agg, [])
                    if part not in targets:
                        targets.append(part)
                    entry.append((cell, agg, reader))
        if not ins:
            return None, {}, dict(guess), atom_src, cells
        prog = ExProg(tuple(range(self.p)),
                      tuple(Partition(readers[r], 1) for r in sorted(readers)),
                      tuple(ins),
                      tuple(Requirement(agg, tuple(sorted(t, key=str))) for agg, t in reqs.items()))
        membership: Membership = {readers[r]: (guess[r],) for r in readers}
        body, membership = synth(prog, membership)
        placed = dict(guess)
        placed.update({r: membership[readers[r]][0] for r in readers})
        return prog.with_body(body), dict(membership), placed, atom_src, cells

    def run_program(self, prog: ExProg, atoms: dict[str, _Atom], membership: Membership,
                    op: int | None, program: str = "") -> dict[tuple[frozenset[str], int], int]:
        """Tasks for a valid program: decompose, then fire actions in dataflow order."""
        dag = self.dag
        state: dict[tuple[frozenset[str], int], int] = {}
        held: dict[int, set[frozenset[str]]] = {}  # site -> the aggregates it holds (state, indexed)

        def hold(agg: frozenset[str], site: int, buffer: int) -> None:
            state[(agg, site)] = buffer
            held.setdefault(site, set()).add(agg)

        def cover_at(agg: frozenset[str], site: int) -> list[frozenset[str]] | None:
            there = held.get(site, ())
            return [agg] if agg in there else exact_cover(agg, there)  # mostly the aggregate itself

        by_buffer: dict[int, list[str]] = {}
        for name in sorted(atoms):
            by_buffer.setdefault(atoms[name].buffer, []).append(name)
        for src, names in by_buffer.items():
            buf = dag.buffers[src]
            if len(names) == 1 and atoms[names[0]].cell == buf.box:
                hold(frozenset(names), buf.device, src)  # the block is one atom: no slicing
                continue
            outs = tuple(dag.buffer(buf.device, atoms[a].cell, buf.dtype, buf.tensor, buf.partial) for a in names)
            dag.add("decompose", buf.device, (src,), outs, op=op,
                    payload=DecomposePayload(tuple(atoms[a].cell for a in names)), label="decompose")
            for a, b in zip(names, outs):
                hold(frozenset({a}), buf.device, b)
        pending = sorted(prog.body,
                         key=lambda a: (aggregate_text(a.aggregate), str(a.source), [str(d) for d in a.dests]))
        while pending:
            fired: list[int] = []  # positions in pending
            for at, act in enumerate(pending):
                sources = prog.sites_of(act.source, membership)
                covers = {s: cover_at(act.aggregate, s) for s in sources}
                if not sources or any(c is None for c in covers.values()):
                    continue
                for s in sources:
                    cover = covers[s]
                    assert cover is not None
                    if (act.aggregate, s) not in state:
                        first = dag.buffers[state[(cover[0], s)]]
                        b = dag.buffer(s, first.box, first.dtype, first.tensor, first.partial)
                        dag.add("aggregate", s, tuple(state[(c, s)] for c in cover), (b,), op=op,
                                payload=AggregatePayload(self.plan.spec(first.tensor).aggregation),
                                label=f"⊕ {aggregate_text(act.aggregate)}")
                        hold(act.aggregate, s, b)
                    for dest in act.dests:
                        for d in prog.sites_of(dest, membership):
                            if (act.aggregate, d) in state:
                                continue
                            src_buf = dag.buffers[state[(act.aggregate, s)]]
                            b = dag.buffer(d, src_buf.box, src_buf.dtype, src_buf.tensor, src_buf.partial)
                            dag.add("copy", d, (src_buf.id,), (b,), op=op, src_device=s,
                                    label=f"{program}: {aggregate_text(act.aggregate)} {s}->{d}")
                            hold(act.aggregate, d, b)
                fired.append(at)
            if not fired:
                raise ExchangeError(f"exchange program is not well-formed: {len(pending)} actions never fire, "
                                    f"e.g. {aggregate_text(pending[0].aggregate)} @ {pending[0].source}.")
            done = set(fired)
            pending = [a for at, a in enumerate(pending) if at not in done]
        return state

    def recompose(self, block: Box, pieces: list[tuple[Box, int]], device: int, tensor: int, op: int | None) -> int:
        node = self.graph.nodes[tensor]
        only = self.dag.buffers[pieces[0][1]] if len(pieces) == 1 else None
        if only is not None and pieces[0][0] == block and only.partial != "lse" and only.dtype == node.type.dtype:
            return only.id  # the block as it is: no assembly, no rounding of a wider partial
        out = self.dag.buffer(device, block, node.type.dtype, tensor)
        agg = self.plan.spec(tensor).aggregation if node.op is not None else None
        finalize = [self.dag.buffers[b].partial == "lse" for _, b in pieces]  # lse partials carry their lse rows
        self.dag.add("recompose", device, tuple(b for _, b in pieces), (out,), op=op,
                     payload=RecomposePayload(tuple(c for c, _ in pieces), agg, tuple(finalize)), label="recompose")
        return out

    # --- operators ---------------------------------------------------------------
    def lower_op(self, op_id: int) -> None:
        """Place the operator's function specs, deliver their inputs and run their kernels; then write
        the states whose last reader it is.  An operator whose lowering has the geometry of one lowered
        before (``_geometry_key``) replays that one's tasks with fresh buffer ids (``physical.replay.Replay``)."""
        outputs = self._outputs(op_id)
        hint = self._hint(op_id, outputs)
        readable = {i: self._readable(i) for i in dict.fromkeys(self.graph.nodes[op_id].inputs)}
        key = self._geometry_key(op_id, hint, readable) if self.share else None
        replay = self.replays.get(key) if key is not None else None
        tasks = len(self.dag.tasks)
        if replay is not None:
            replay.apply(self, op_id, readable, self._shift(op_id))
            self.replayed += 1
        else:
            buffers = len(self.dag.buffers)
            self._lower_op(op_id, hint, readable)
            if key is not None and key not in self.replays:  # (None: a lowering its key does not fix)
                self.replays[key] = Replay.record(self, op_id, tasks, buffers, readable, self._shift(op_id))
        self.recent[outputs] = self.placement[op_id]
        self.step += 1
        self._note_reads(tasks)
        for state in self.assign_after.get(op_id, ()):
            self.lower_assignment(state)

    def _outputs(self, op_id: int) -> tuple[Box, ...]:
        """The output blocks of ``op_id``'s function specs (placement hints are looked up by them)."""
        spec = self.plan.spec(op_id)
        blocks = self.outputs_memo.get(id(spec))
        if blocks is None:
            blocks = self.outputs_memo[id(spec)] = tuple(f.output for f in spec.functions)
        return blocks

    def _hint(self, op_id: int, outputs: tuple[Box, ...]) -> tuple[int, ...] | None:
        """The placement of the last operator lowered whose function specs write ``outputs``, for an operator
        none of whose inputs is on a device yet (an update chain starting from states not yet loaded); None
        for any other, for none or for the identity (which ties go to anyway: equal geometries stay equal).
        An operator that reads placed bytes breaks their ties by the identity, not by the placement of an
        earlier one: a hint there would carry each layer's tie-breaks into the next, and identical layers
        would be placed differently (and lowered afresh) layer after layer."""
        graph = self.graph
        if any(graph.nodes[i].op is not None or i in self.held or i in self.loaded_blocks
               for i in graph.nodes[op_id].inputs):
            return None
        hint = self.recent.get(outputs)
        return None if hint is None or hint == tuple(range(len(hint))) else hint

    def _readable(self, tensor: int) -> dict[tuple[Box, int], int]:
        """The blocks of operator output ``tensor`` that a kernel of one of the last ``REUSE_WINDOW``
        operators read, by (block, device) -> buffer: a reader of the same block placed on that device
        reads it again instead of receiving it again."""
        if self.graph.nodes[tensor].op is None:
            return {}
        oldest = self.step - self.window
        return {where: b for where, (b, at) in self.assembled.get(tensor, {}).items() if at >= oldest}

    def _note_reads(self, first_task: int) -> None:
        """Remember the blocks of operator outputs that the kernels from task ``first_task`` on read whole
        and that were delivered to them (final values in the tensor's dtype, not views; a producer's own
        block is where its exchange finds it anyway)."""
        dag, nodes = self.dag, self.graph.nodes
        for task in dag.tasks[first_task:]:
            if task.kind != "kernel":
                continue
            for b in task.inputs:
                buf = dag.buffers[b]
                if (nodes[buf.tensor].op is not None and buf.partial is None and buf.parent is None
                        and buf.dtype == nodes[buf.tensor].type.dtype and b not in self.kernel_out[buf.tensor]):
                    self.assembled.setdefault(buf.tensor, {})[(buf.box, buf.device)] = (b, self.step)

    def _geometry_key(self, op_id: int, hint: tuple[int, ...] | None,
                      readable: dict[int, dict[tuple[Box, int], int]]) -> tuple[object, ...]:
        """Everything the lowering of ``op_id`` reads: its spec, which inputs are the same tensor, its
        placement hint, and per distinct input the blocks recent readers received (``_readable``) and its
        producer's spec and placement, a held tensor's blocks, or the blocks of a graph input already
        loaded (and its dtype).  Specs are compared by identity: equal operators share them."""
        node = self.graph.nodes[op_id]
        at = self._shift(op_id)  # devices relative to the stage's first: a layer replays across stages
        parts: list[object] = [("hint", None if hint is None else tuple(d - at for d in hint))]
        if isinstance(self.plan, PipelinedPlan):
            parts.append(("stage", len(self.plan.group(op_id))))
        for i in dict.fromkeys(node.inputs):
            parts.append(("read", tuple((box.lower, box.upper, d - at) for box, d in readable[i])))
            n = self.graph.nodes[i]
            if i in self.held:
                parts.append(("held", tuple((box, d - at) for box, d in self.held[i])))
            elif n.op is None:
                parts.append(("input", n.type.dtype, tuple((box, d - at) for box, d in self.loaded_blocks.get(i, ()))))
            else:
                parts.append(("op", id(self.plan.spec(i)), tuple(d - at for d in self.placement[i])))
        return id(self.plan.spec(op_id)), tuple(node.inputs.index(i) for i in node.inputs), tuple(parts)

    def _shift(self, op_id: int) -> int:
        """The first device of the operator's pipeline stage (0 without stages): replays are recorded and
        keyed relative to it."""
        return self.plan.group(op_id)[0] if isinstance(self.plan, PipelinedPlan) else 0

    def _place(self, op_id: int, held: dict[int, tuple[tuple[Box, int], ...]],
               hint: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The reader (exchange partition) of each function spec and the first guess of each reader's
        device (``physical.placement``): a reader per function spec; in a pipelined plan a reader per block of
        the stage plan, placed on the stage's devices, whose micro-batches run in sequence on its device."""
        plan = self.plan
        if not isinstance(plan, PipelinedPlan):
            where = place(plan, op_id, self.placement, self.place_memo, held, hint)
            return tuple(range(len(where))), where
        coarse = plan.coarse(op_id)
        owner = plan.coarse_of.get(op_id, tuple(range(coarse.p)))
        if hint is not None:
            first = {c: g for g, c in reversed(list(enumerate(owner)))}
            hint = tuple(hint[first[c]] for c in range(coarse.p))
        return owner, place(plan, op_id, self.placement, self.place_memo, held, hint, spec=coarse,
                            devices=plan.group(op_id))

    def _lower_op(self, op_id: int, hint: tuple[int, ...] | None,
                  readable: dict[int, dict[tuple[Box, int], int]]) -> None:
        """Place, deliver and run ``op_id`` (``lower_op``): ``hint`` the placement ties go to, ``readable``
        per input the blocks recent readers received (``_readable``)."""
        node = self.graph.nodes[op_id]
        assert node.op is not None
        spec = self.plan.spec(op_id)
        # blocks already loaded count as co-resident too: two readers of one input block share its copy
        held = {i: self.held.get(i) or tuple(self.loaded_blocks.get(i, ())) for i in node.inputs
                if self.graph.nodes[i].op is None and (i in self.held or i in self.loaded_blocks)}
        reader_of, first_guess = self._place(op_id, held, hint)
        guess = {g: first_guess[r] for g, r in enumerate(reader_of)}
        shared = len(first_guess) < len(reader_of)  # micro-batches share a reader: none may move alone
        exchanged = [self.graph.nodes[i].op is not None or i in self.held for i in node.inputs]
        wants: list[tuple[object, int, Box, int]] = []
        reread: dict[tuple[int, int], int] = {}  # (function spec, input) -> the buffer it reads again
        for g, f in enumerate(spec.functions):
            again = {k: readable[i].get((f.inputs[k], guess[g])) for k, i in enumerate(node.inputs) if exchanged[k]}
            # the naive synthesizer keeps every reader at its guess; another may move one that receives
            # anything, so there a function spec reads blocks again only if it receives nothing
            if self.synthesize is not naive and (shared or None in again.values()):
                again = {}
            for k, i in enumerate(node.inputs):
                buffer = again.get(k)
                if buffer is not None:
                    reread[(g, k)] = buffer
                elif exchanged[k]:
                    wants.append(((g, k), i, f.inputs[k], reader_of[g]))
        delivered, placed = self.exchange(node.name, wants, dict(enumerate(first_guess)), op_id)
        where = tuple(placed[reader_of[g]] for g in range(spec.p))
        if isinstance(self.plan, PipelinedPlan):
            group = self.plan.group(op_id)
            if not set(where) <= set(group):
                raise ExchangeError(f"the placement of {node.name!r} must keep its function specs on its stage's "
                                    f"devices {group}; got {where}.")
        elif len(set(where)) != len(where) or not set(where) <= set(range(self.p)):
            raise ExchangeError(f"the placement of {node.name!r} must put its function specs on distinct devices of "
                                f"0..{self.p - 1}; got {where}.")
        self.placement[op_id] = where
        outs = []
        multiplicity = spec.output_multiplicity()
        for g, f in enumerate(spec.functions):
            blocks = []
            for k, i in enumerate(node.inputs):
                if not exchanged[k]:
                    blocks.append(self.load(i, f.inputs[k], where[g]))
                elif (g, k) in reread:
                    blocks.append(reread[(g, k)])
                else:
                    blocks.append(self.recompose(f.inputs[k], delivered[((g, k), i)], where[g], i, op_id))
            alone = multiplicity[f.output] == 1  # nothing to combine: the kernel writes the final block
            partial = None if alone else spec.aggregation.name
            dtype = node.type.dtype if alone else partial_dtype(node.type.dtype)
            out = self.dag.buffer(where[g], f.output, dtype, op_id, partial)
            self.dag.add("kernel", where[g], tuple(blocks), (out,), op=op_id,
                         payload=KernelPayload(f, g, alone, spec.aggregation), label=f"{node.name}[{g}]")
            outs.append(out)
        self.kernel_out[op_id] = outs

    def lower_assignment(self, state: int) -> None:
        """Write the state's value into every block the state keeps, on its device (``assign`` tasks),
        delivered by an exchange program like any reader's: the plan's kept layout at both ends."""
        value = self.graph.assignments[state]
        node = self.graph.nodes[state]
        name = node.name
        if not covers([box for box, _ in self.dag.inputs.get(name, [])], node.type.box):
            # its readers read part of it (or none do): it also keeps its value's blocks, so that the
            # whole state persists and can be read back
            for box, device in value_blocks(self.plan, value):
                self.load(state, box, device)
        kept = self.dag.inputs[name]
        if state in self.saved_states:  # the value the execution read, before the assignment overwrites it
            snaps = []
            for box, b in kept:
                device = self.dag.buffers[b].device
                copy = self.dag.buffer(device, box, node.type.dtype, state)
                self.dag.add("copy", device, (b,), (copy,), src_device=device, label=f"save {name} as read")
                snaps.append((box, copy))
            self.snapshots[state] = snaps
        # one reader per device (partitions are disjoint sites), at its own device
        wants = [((n, 0), value, box, self.dag.buffers[b].device) for n, (box, b) in enumerate(kept)]
        guess = {self.dag.buffers[b].device: self.dag.buffers[b].device for _, b in kept}
        start = len(self.dag.tasks)
        delivered, _ = self.exchange(f"assign:{name}", wants, guess, None, synthesize=naive)  # devices fixed
        self.write_bytes[state] = sum(self.dag.buffers[t.outputs[0]].nbytes for t in self.dag.tasks[start:]
                                      if t.kind == "copy")
        for n, (box, b) in enumerate(kept):
            device = self.dag.buffers[b].device
            made = self.recompose(box, delivered[((n, 0), value)], device, value, None)
            self.dag.add("assign", device, (made,), (b,), label=f"assign {name}")
        self.dag.assigned[name] = value

    def lower_outputs(self) -> None:
        carried = self.graph.next_names()  # <state>.next: its value is written into the state's blocks
        for name, tensor in self.graph.outputs.items():
            if name in carried:
                continue
            node = self.graph.nodes[tensor]
            if tensor in self.snapshots:
                self.dag.outputs[name] = list(self.snapshots[tensor])
                continue
            if node.op is None:
                b = self.load(tensor, node.type.box, 0)
                self.dag.outputs[name] = [(node.type.box, b)]
                continue
            spec = self.plan.spec(tensor)
            first: dict[Box, int] = {}
            for f, ff in enumerate(spec.functions):
                first.setdefault(ff.output, self.dag.buffers[self.kernel_out[tensor][f]].device)
            boxes = list(first)
            wants = [((n, 0), tensor, box, n) for n, box in enumerate(boxes)]
            delivered, placed = self.exchange(f"save:{name}", wants, dict(enumerate(first.values())), None)
            blocks = []
            for n, box in enumerate(boxes):
                pieces = delivered[((n, 0), tensor)]
                blocks.append((box, self.recompose(box, pieces, placed[n], tensor, None)))
            self.dag.outputs[name] = blocks


def _readers_through_reshapes(graph: Graph, readers: Mapping[int, Sequence[int]], state: int) -> list[int]:
    """The operators reading ``state``, and those reading a reshape of it (one may keep the state's own
    bytes, ``physical.tasks.reshape_shares``): the state is assigned after all of them."""
    out: list[int] = []
    stack = [state]
    while stack:
        for r in readers.get(stack.pop(), ()):
            out.append(r)
            if graph.nodes[r].kind == "reshape":
                stack.append(r)
    return out


def emission_order(graph: Graph, partial: Collection[int] = ()) -> list[int]:
    """The operators in the order they are lowered (and each device runs them): the graph's order, except
    that an operator no saved output depends on (it only feeds the states' next values: an optimizer's
    update) and that reads a partial sum (an operator of ``partial``: a weight gradient under a split
    batch, reduced by the reader's exchange) runs as soon as its inputs are made, after the latest of
    their producers.  The partial gradients (each as large as the weight, on every device) are then
    reduced and freed layer by layer during the backward instead of all being held until it ends; the
    rest of the update keeps its place, and so does an update that reads no partial, so their float32
    temporaries and new values do not join the backward's peak (hoisting the whole update measured
    higher peaks: a full-size new master and moments per layer wait there for the assignments).

    >>> from relational_tensors.graph.graph import Graph
    >>> g = Graph()
    >>> x, w = g.input("x", (4,)), g.state("w", (4,))
    >>> y = g.save(g.mul(x, w, name="y"))
    >>> grad = g.mul(y, x, name="grad")
    >>> z = g.save(g.mul(y, y, name="z"))
    >>> g.assign(w, g.sub(w, grad, name="w_next")) and None
    >>> [g.nodes[op].name for op in emission_order(g)]
    ['y', 'grad', 'z', 'w_next']
    >>> [g.nodes[op].name for op in emission_order(g, partial={grad.id})]  # grad a partial sum per device
    ['y', 'grad', 'w_next', 'z']
    """
    ops = [n.id for n in graph.operators]
    if not graph.assignments or not partial:
        return ops
    updates = ancestors(graph, graph.assignments.values()) - forward_ops(graph)  # what feeds only the states
    keys: dict[int, tuple[int, ...]] = {}
    for op in ops:
        inputs = graph.nodes[op].inputs
        if op in updates and any(i in partial for i in inputs):  # just after its inputs' latest producer
            keys[op] = max((keys[i] for i in inputs if i in keys), default=(-1,)) + (op,)
        else:
            keys[op] = (op,)
    return sorted(ops, key=keys.__getitem__)


def lower(plan: LogicalPlan, schedule: str = "naive", synthesize: Synthesizer | None = None,
          kept: Mapping[int, str] | None = None, later: frozenset[str] = frozenset(),
          layouts: Mapping[int, tuple[tuple[Box, int], ...]] | None = None, share: bool = True,
          fold: bool = False) -> Lowered:
    """Lower ``plan`` to one task DAG, synthesizing each exchange program with ``schedule``
    (or the given synthesizer, which returns a body and the devices of the readers' partitions).

    ``kept`` says how each assigned state is kept between executions (``KEPT``; default "as read");
    ``later`` names inputs loaded only for a second phase of each execution (``split_phases``);
    ``layouts`` holds pinned inputs and states in the (block, device) copies a constraint gave them;
    ``share`` replays the tasks of operators whose lowering has the geometry of one lowered before (the
    same DAG, made faster); ``fold`` folds a pipelined plan's micro-batch partials as they are made
    (``schedule.pipeline_order``)."""
    if schedule not in SCHEDULES and synthesize is None:
        raise ExchangeError(f"unknown schedule mode {schedule!r}; choose one of {SCHEDULES}.")
    low = _Lowering(plan, synthesize or naive, kept or {}, layouts, share)
    for op in low.order:
        low.lower_op(op)
    low.lower_outputs()
    pipelined = plan if isinstance(plan, PipelinedPlan) and plan.pipeline.micro_batches * plan.pipeline.stages > 1 \
        else None
    # (reordered afterwards, a reader of a state's old value could run after a where that overwrote it)
    dag = fuse_views(low.dag, select_in_place=pipelined is None and not later)
    if pipelined is not None:
        dag = pipeline_order(dag, pipelined, fold)
    if later:
        dag = split_phases(dag, later)
    return Lowered(dag, low.placement, low.programs, low.memberships, dict(low.kept),
                   low.write_bytes, frozenset(low.searched), low.replayed)

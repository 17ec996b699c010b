"""Plan views for people: which device holds which block of a tensor, and its DTensor-style name.

A tensor's *layout* under a plan is read off the producing operator's chosen
join-agg spec: its output tiling, the output block of each function spec and
the device the lowering placed that function spec on.  Several devices holding
one block are partials waiting for the operator's ⊕.  A graph input has no
producer; its layout is how each consumer's function specs read it (several
devices reading one block hold copies).

:func:`placement_notation` names a layout in PyTorch DTensor / JAX terms when one
fits, without a mesh: ``S(d)`` split along dimension ``d`` in near-equal blocks
(sizes differ by at most one), ``R`` replicated, ``P(sum)``/``P(max)``/``P(lse)``
partials, and products such as ``S(0)S(2)`` or ``S(1)P(sum)``; ``-`` when none
fits (uneven or overlapping blocks, unequal numbers of copies).

>>> import relational_tensors as rt
>>> g = rt.Graph(); x = g.input("x", [64, 4]); w = g.parameter("w", [4, 4])
>>> _ = g.save(g.matmul(x, w, name="mm"), name="y")
>>> cg = rt.compileGraph(g, device="cpu:2")
>>> placement_notation(cg, "mm"), placement_notation(cg, "w")
('S(0)', 'R')
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relational_tensors.core.tiling import Tiling, as_grid
from relational_tensors.core.types import Box, Interval
from relational_tensors.dp_optimizer.pipeline import PipelinedPlan
from relational_tensors.errors import GraphError

if TYPE_CHECKING:
    from relational_tensors.driver.compiler import CompiledGraph

__all__ = ["Layout", "layouts", "show_tiling", "placement_notation", "plan_rows", "plan_table", "kept_layouts",
           "state_table"]


@dataclass(frozen=True)
class Layout:
    """Which devices hold each block of one tensor.

    ``blocks`` maps a block to its holders, one entry per function spec (so a
    device may appear once per block).  ``partial`` is the ⊕ name when the
    holders of a block hold partials of it (an operator's output), ``None`` when
    they hold copies (a consumer's reads of a graph input).
    """

    tensor: str
    space: Box
    names: tuple[str, ...]
    blocks: dict[Box, tuple[int, ...]]
    partial: str | None
    source: str
    reader: str | None = None

    def grid(self) -> Tiling:
        """The coarsest grid whose cells each lie inside or outside every block (the overlay of their edges)."""
        breaks = []
        for d in range(self.space.rank):
            pts = {self.space.lower[d], self.space.upper[d]}
            for b in self.blocks:
                pts.update((b.lower[d], b.upper[d]))
            breaks.append(tuple(sorted(pts)))
        return Tiling(tuple(breaks))

    def holders(self, cell: Box) -> tuple[int, ...]:
        """The devices whose block contains ``cell``, in order."""
        out: list[int] = []
        for block, devs in self.blocks.items():
            if block.contains(cell):
                out.extend(devs)
        return tuple(sorted(out))

    def notation(self) -> str:
        """The DTensor-style name of this layout (see the module docstring)."""
        return _notation(self)


def _resolve(cg: CompiledGraph, tensor_name: str) -> Any:
    try:
        return cg.graph.node(tensor_name)
    except GraphError:
        saved = cg.graph.outputs.get(tensor_name)
        if saved is None:
            known = [n.name for n in cg.graph.nodes] + [f"{k} (saved)" for k in cg.graph.outputs]
            raise GraphError(f"no tensor named {tensor_name!r} in this graph; known: {known}.") from None
        return cg.graph.nodes[saved]


def layouts(cg: CompiledGraph, tensor_name: str) -> list[Layout]:
    """The layout of an operator's output (one), or of a graph input as each consumer reads it (one per read).

    ``tensor_name`` is a node name or a saved output name.
    """
    node = _resolve(cg, tensor_name)
    space = node.type.box
    names = tuple(node.type.names)
    if node.op is not None:
        spec = cg.plan.spec(node.id)
        where = cg.lowered.placement[node.id]
        blocks: dict[Box, list[int]] = {b: [] for b in spec.output_tiling.boxes()}
        for g, f in enumerate(spec.functions):
            blocks[f.output].append(where[g])
        partial = str(spec.aggregation) if any(len(v) > 1 for v in blocks.values()) else None
        saved = [k for k, v in cg.graph.outputs.items() if v == node.id]
        source = f"{node.kind} output, split {spec.split_text}" + (f", saved as {', '.join(saved)}" if saved else "")
        return [Layout(node.name, space, names, {b: tuple(v) for b, v in blocks.items()}, partial, source)]
    out = []
    for c in cg.graph.consumers()[node.id]:
        consumer = cg.graph.nodes[c]
        spec = cg.plan.spec(c)
        where = cg.lowered.placement[c]
        for k, i in enumerate(consumer.inputs):
            if i != node.id:
                continue
            reads: dict[Box, list[int]] = {}
            for g, f in enumerate(spec.functions):
                if not f.inputs[k].is_empty:
                    reads.setdefault(f.inputs[k], []).append(where[g])
            source = f"read by {consumer.name} as input {k} (split {spec.split_text})"
            out.append(Layout(node.name, space, names, {b: tuple(v) for b, v in reads.items()}, None, source,
                              consumer.name))
    return out


def kept_layouts(graph: Any, lowered: Any) -> list[dict[str, Any]]:
    """How each assigned state is kept on the devices between executions: one dict per state with the
    catalog's ``state_layouts`` columns (``kept``, DTensor-style ``placement``, ``blocks``,
    ``bytes_per_device``, ``bytes_total``, ``write_bytes``)."""
    dag = lowered.dag
    rows = []
    for state, value in sorted(graph.assignments.items()):
        node = graph.nodes[state]
        blocks: dict[Box, list[int]] = {}
        per_device: dict[int, int] = {}
        for box, b in dag.inputs.get(node.name, []):
            buf = dag.buffers[b]
            blocks.setdefault(box, []).append(buf.device)
            per_device[buf.device] = per_device.get(buf.device, 0) + buf.nbytes
        lay = Layout(node.name, node.type.box, tuple(node.type.names), {b: tuple(v) for b, v in blocks.items()},
                     None, "kept between executions")
        rows.append(dict(state_id=state, state=node.name, value_op=value, kept=lowered.kept.get(state, "as read"),
                         placement=lay.notation(), blocks=sum(len(v) for v in blocks.values()),
                         bytes_per_device=max(per_device.values(), default=0),
                         bytes_total=sum(per_device.values()), write_bytes=lowered.write_bytes.get(state, 0)))
    return rows


def _near_equal(ivs: Sequence[Interval]) -> bool:
    sizes = [iv.size for iv in ivs]
    return max(sizes) - min(sizes) <= 1


def _notation(lay: Layout) -> str:
    if not lay.blocks:
        return "-"
    grid = as_grid(lay.blocks, lay.space)
    copies = {len(v) for v in lay.blocks.values()}
    if grid is None or len(copies) != 1:
        return "-"
    parts = []
    for d, count in enumerate(grid.counts):
        if count > 1:
            if not _near_equal(grid.intervals(d)):
                return "-"
            parts.append(f"S({d})")
    if copies.pop() > 1:
        parts.append(f"P({lay.partial})" if lay.partial else "R")
    return "".join(parts) or "R"  # one device holding the whole tensor: replicated over a mesh of one


def placement_notation(cg: CompiledGraph, tensor_name: str) -> str:
    """The DTensor/JAX-style placement of a tensor under ``cg``'s plan, or ``-`` where none applies.

    For a graph input read differently by its consumers, each reading is named:
    ``S(0) by q_proj; R by k_proj``.
    """
    found = layouts(cg, tensor_name)
    if not found:
        return "-"
    by_name: dict[str, list[str]] = {}
    for lay in found:
        by_name.setdefault(lay.notation(), []).append(lay.reader or lay.tensor)
    if len(by_name) == 1:
        return next(iter(by_name))
    return "; ".join(f"{n} by {', '.join(dict.fromkeys(who))}" for n, who in by_name.items())


# ---------------------------------------------------------------------------------------------- drawing


def _devices_text(devs: Sequence[int], partial: bool) -> str:
    """``0+1`` for partials, ``0,1`` for copies; runs of four or more shortened (``0+..+7``)."""
    if not devs:
        return "·"
    sep = "+" if partial else ","
    runs: list[list[int]] = []
    for d in devs:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return sep.join(f"{r[0]}{sep}..{sep}{r[-1]}" if len(r) >= 4 else sep.join(map(str, r)) for r in runs)


def _shown_dims(grid: Tiling) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid dims, panel dims): the last two split dimensions (padded with the last unsplit ones) are
    drawn as a grid; any further split dimensions become one panel per block."""
    rank = grid.rank
    split = [d for d in range(rank) if grid.counts[d] > 1]
    shown = split[-2:]
    for d in reversed(range(rank)):
        if len(shown) >= min(2, rank):
            break
        if d not in shown:
            shown.append(d)
    return tuple(sorted(shown)), tuple(d for d in split if d not in shown)


def _draw(lay: Layout, width: int) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    grid = lay.grid()
    shown, panels = _shown_dims(grid)
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(f"{lay.tensor} {list(lay.space.shape)}: {lay.source}  [{lay.notation()}]", markup=False,
                  highlight=False)

    def name(d: int | None) -> str:
        return "" if d is None else lay.names[d] if d < len(lay.names) else f"d{d}"

    panel_ranges = [grid.intervals(d) for d in panels]
    for pick in itertools.product(*panel_ranges):
        fixed = dict(zip(panels, pick))
        if fixed:
            console.print("  " + ", ".join(f"{name(d)} {iv}" for d, iv in fixed.items()), markup=False,
                          highlight=False)
        rows_dim = shown[0] if len(shown) == 2 else None
        cols_dim = shown[-1] if shown else None
        row_ivs = grid.intervals(rows_dim) if rows_dim is not None else (None,)
        col_ivs = grid.intervals(cols_dim) if cols_dim is not None else (None,)
        corner = f"{name(rows_dim)} \\ {name(cols_dim)}" if rows_dim is not None else ""
        table = Table(show_lines=True, box=box.SQUARE)
        table.add_column(corner)
        for iv in col_ivs:
            table.add_column(str(iv) if iv is not None else "", justify="center", overflow="fold")
        for riv in row_ivs:
            cells = []
            for civ in col_ivs:
                # one cell: the chosen interval on each shown or panel dimension, the whole extent elsewhere
                chosen = dict(fixed)
                if rows_dim is not None and riv is not None:
                    chosen[rows_dim] = riv
                if cols_dim is not None and civ is not None:
                    chosen[cols_dim] = civ
                cell = Box.from_intervals([chosen.get(d, grid.intervals(d)[0]) for d in range(grid.rank)])
                cells.append(_devices_text(lay.holders(cell), lay.partial is not None))
            table.add_row(str(riv) if riv is not None else name(cols_dim), *cells)
        console.print(table)
    unsplit = [d for d in range(grid.rank) if grid.counts[d] == 1 and d not in shown]
    if lay.reader is not None:
        note = "cells: the devices reading the block (a,b: copies; · not read)"
    elif lay.partial is not None:
        note = f"cells: the devices computing the block (a+b: partials combined with ⊕={lay.partial})"
    else:
        note = "cells: the device computing the block"
    if unsplit:
        note += "; whole along " + ", ".join(name(d) for d in unsplit)
    console.print(note, markup=False, highlight=False)
    return buf.getvalue()


def show_tiling(cg: CompiledGraph, tensor_name: str, width: int = 120) -> str:
    """The grid of which device holds which block of ``tensor_name`` under ``cg``'s plan, as text.

    Operator outputs show each block's devices, ``0+1`` for partials still to be
    combined with ⊕; a graph input shows one grid per consumer reading it.
    """
    return "\n".join(_draw(lay, width) for lay in layouts(cg, tensor_name)) or (
        f"{tensor_name}: not read by any operator\n")


# ---------------------------------------------------------------------------------------------- the plan table

_PLAN_COLUMNS = ("op_name", "op_kind", "split", "output_tiling", "placement", "repartitioned_inputs",
                 "repartition_cost", "join_cost", "aggregation_cost", "total_cost")


def plan_rows(cg: CompiledGraph) -> list[dict[str, Any]]:
    """One dict per operator: the ``plan`` view's columns plus ``placement``, its output's notation."""
    rows = cg.sql(
        "SELECT op_name, op_kind, split, output_tiling, repartitioned_inputs, repartition_cost, join_cost, "
        "aggregation_cost, total_cost FROM plan ORDER BY op_id"
    ).to_pylist()
    staged = cg.plan if isinstance(cg.plan, PipelinedPlan) else None
    for r in rows:
        r["placement"] = placement_notation(cg, r["op_name"])
        r["repartitioned_inputs"] = r["repartitioned_inputs"] or ""
        if staged is not None:
            r["stage"] = staged.stage_of[cg.graph.node(r["op_name"]).id]
    return [{k: r[k] for k in (*_PLAN_COLUMNS, *(("stage",) if staged is not None else ()))} for r in rows]


def plan_table(cg: CompiledGraph, rows: list[dict[str, Any]] | None = None, width: int = 160,
               titled: bool = True) -> str:
    """The plan as a text table (``explain``'s columns plus placement)."""
    from rich.console import Console
    from rich.table import Table

    rows = plan_rows(cg) if rows is None else rows
    # paper: elements; bytes: bytes; calibrated: seconds, shown in microseconds
    unit, scale, digits = {"paper": ("elements", 1.0, 0), "calibrated": ("µs", 1e6, 1)}.get(
        cg.plan.cost_model, ("bytes", 1.0, 0))
    staged = cg.plan if isinstance(cg.plan, PipelinedPlan) else None
    p = cg.p // staged.pipeline.stages if staged is not None else cg.p  # the devices each operator's plan is for
    small = [n.name for n in cg.graph.operators
             if (staged.coarse(n.id) if staged is not None else cg.plan.spec(n.id)).p < p]
    few = (f"; on fewer than {p} devices (too small to split {p} ways): {', '.join(small)}" if small else "")
    if staged is not None:
        pipe = staged.pipeline
        few += (f"; pipeline: {pipe.stages} stages of {p} devices, {pipe.micro_batches} micro-batches, "
                f"{pipe.schedule}; each operator's split is for its stage's devices")
    searched, late = cg.search
    if late:  # a search stopped by the wall clock depends on the machine's speed: say so
        few += (f"; the search budget ({cg.options.search_budget_s:g} s) stopped {late} of {searched} searched "
                "exchange programs: raise search_budget_s for a reproducible search")
    table = Table(
        title=(f"plan for p={cg.p} ({cg.devices}), selector={cg.plan.selector}, cost model={cg.plan.cost_model} "
               f"({unit})") if titled else None,
        caption=(f"total cost {cg.plan.cost * scale:,.{digits}f} {unit}; planned in {sum(cg.timings.values()):.3f}s"
                 + few) if titled else None)
    heads = ("op", "kind", "split", "out tiling", "placement", "repartitions", "repartition", "join", "aggregation",
             "total", *(("stage",) if staged is not None else ()))
    for h in heads:
        numeric = h in ("repartition", "join", "aggregation", "total")
        table.add_column(h, justify="right" if numeric else "left", overflow="fold")
    for r in rows:
        table.add_row(r["op_name"], r["op_kind"], r["split"], r["output_tiling"], r["placement"],
                      r["repartitioned_inputs"], *(f"{r[c] * scale:,.{digits}f}" for c in _PLAN_COLUMNS[6:]),
                      *((str(r["stage"]),) if staged is not None else ()))
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()


def state_table(cg: CompiledGraph, width: int = 160) -> str:
    """The states kept between executions as a text table (``explain`` prints it under the plan)."""
    from rich.console import Console
    from rich.table import Table

    rows = cg.state_layouts()
    if not rows:
        return ""
    table = Table(title="states kept on the devices between executions (the value is written into them at the end)")
    for h in ("state", "kept", "placement", "blocks", "bytes/device", "written from", "bytes moved to write"):
        table.add_column(h, justify="right" if h.startswith(("blocks", "bytes")) else "left", overflow="fold")
    for r in rows:
        table.add_row(r["state"], r["kept"], r["placement"], str(r["blocks"]), f"{r['bytes_per_device']:,}",
                      cg.graph.nodes[r["value_op"]].name, f"{r['write_bytes']:,}")
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()

"""The selectors: ``dp`` (Algorithm 1 over the pieces), ``greedy`` and ``random``.

``dp`` runs the inner minimization in SQL over the catalog's costed spec
tables, one statement per wave of a piece, and traces the choices back in
Python.  Each selector writes its choice into the catalog's ``chosen`` table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from relational_tensors.catalog import Catalog, load_sql
from relational_tensors.dp_optimizer.candidates import Candidates
from relational_tensors.dp_optimizer.exact import exact_choice
from relational_tensors.dp_optimizer.refine import refine
from relational_tensors.dp_optimizer.trees import Piece
from relational_tensors.errors import PlanError
from relational_tensors.frontend.graph import Graph

__all__ = ["SELECTORS", "select_dp", "select_exact", "select_greedy", "select_random"]

SELECTORS = ("dp", "exact", "greedy", "random")


def _write_chosen(catalog: Catalog, cid: int, cands: Candidates, choice: dict[int, int]) -> None:
    ops = sorted(choice)
    rows = pa.table({
        "op_id": pa.array(ops, pa.int32()),
        "spec_id": pa.array([choice[o] for o in ops], pa.int32()),
        "output_tiling": pa.array([cands.by_op[o][choice[o]].output_tiling for o in ops], pa.int32()),
    })
    catalog.insert("chosen", rows, cid)


def independent_groups(graph: Graph, pieces: list[Piece],
                       carried: Mapping[int, Sequence[int]] | None = None) -> list[list[Piece]]:
    """Consecutive pieces with no edge between any two of them: solving them together equals solving
    them one after another, and costs one SQL statement per wave instead of one per piece and wave.
    ``carried`` (operator -> the operators its edges across steps join it to, both ways) counts too."""
    consumers = graph.consumers()
    carried = carried or {}
    groups: list[list[Piece]] = []
    members: set[int] = set()
    for piece in pieces:
        touches = {i for v in piece.members for i in graph.nodes[v].inputs} | {
            c for v in piece.members for c in consumers[v]} | {u for v in piece.members for u in carried.get(v, ())}
        if groups and not (touches & members):
            groups[-1].append(piece)
        else:
            groups.append([piece])
            members = set()
        members |= set(piece.members)
    return groups


def select_dp(catalog: Catalog, cid: int, graph: Graph, cands: Candidates, pieces: list[Piece],
              memory_price: float = 0.0, refine_choice: bool = True) -> dict[int, int]:
    """Algorithm 1 on each piece in turn, each subject to the pieces fixed before it; then, with
    ``refine_choice``, the coordinate descent of ``refine`` across the cut tensors (the ``dp_table`` keeps
    Algorithm 1's entries, ``chosen`` the final choice).

    ``memory_price`` adds that cost per byte of graph input a spec keeps resident on a device."""
    catalog.execute("DELETE FROM dp_table WHERE compilation_id = ?", [cid])
    catalog.execute("DELETE FROM chosen WHERE compilation_id = ?", [cid])
    wave_sql, root_sql = load_sql("dp_wave.sql"), load_sql("dp_root.sql")
    piece_of = {v: pc.piece_id for pc in pieces for v in pc.members}
    nodes = graph.nodes
    choice: dict[int, int] = {}
    across: dict[int, list[int]] = {}
    for w, k in cands.carried:
        v = cands.sources[(w, k)]
        across.setdefault(v, []).append(w)
        across.setdefault(w, []).append(v)
    for group in independent_groups(graph, pieces, across):
        for h in range(max(len(pc.waves) for pc in group)):
            wave = [v for pc in group if h < len(pc.waves) for v in pc.waves[h]]
            catalog.execute(wave_sql, {"cid": cid, "ops": wave, "memory_price": memory_price})  # type: ignore[arg-type]
        roots = {int(r[0]): (int(r[2]), float(r[3])) for r in catalog.execute(
            root_sql, {"cid": cid, "roots": [pc.root for pc in group]}).fetchall()}  # type: ignore[arg-type]
        members = [v for pc in group for v in pc.members]
        table: dict[int, dict[int, tuple[float, int]]] = {v: {} for v in members}
        for op_id, tiling, cost, spec in catalog.execute(
            "SELECT op_id, tiling_id, cost, spec_id FROM dp_table WHERE compilation_id = ? AND op_id IN "
            "(SELECT unnest(?::INTEGER[]))", [cid, members]
        ).fetchall():
            table[op_id][tiling] = (cost, spec)
        picked: dict[int, int] = {}
        for pc in group:
            if pc.root not in roots or not math.isfinite(roots[pc.root][1]):
                raise PlanError(f"no eligible spec combination for the piece rooted at {nodes[pc.root].name!r}.")
            picked[pc.root] = roots[pc.root][0]
        stack = [pc.root for pc in group]
        while stack:  # trace back the minimizing choices, top-down
            v = stack.pop()
            cand = cands.by_op[v][picked[v]]
            for k, i in enumerate(nodes[v].inputs):
                if nodes[i].op is None or piece_of.get(i) != piece_of[v] or i in picked:
                    continue
                entries = table[i]
                want = cand.required[k]
                # the producer tiling that achieved the wave's minimum; on ties the tiling read, then the
                # cheaper Opt, then the lowest id
                via = {t: entries[t][0] + cands.edge_price(v, k, t, want) for t in entries}
                picked[i] = entries[min(via, key=lambda t: (via[t], t != want, entries[t][0], t))][1]
                stack.append(i)
        missing = set(members) - set(picked)
        if missing:
            raise PlanError(f"DP traceback left operators without a spec: {sorted(nodes[m].name for m in missing)}.")
        _write_chosen(catalog, cid, cands, picked)  # the groups after this one read it
        choice.update(picked)
    if refine_choice:
        better = refine(graph, cands, choice, memory_price, pieces)
        if better != choice:
            catalog.execute("DELETE FROM chosen WHERE compilation_id = ?", [cid])
            _write_chosen(catalog, cid, cands, better)
            choice = better
    return choice


def select_exact(catalog: Catalog, cid: int, graph: Graph, cands: Candidates,
                 memory_price: float = 0.0) -> dict[int, int]:
    """The exact optimum of the DP's objective (``exact.exact_choice``, a HiGHS mixed-integer program)."""
    choice, _ = exact_choice(graph, cands, memory_price)
    catalog.execute("DELETE FROM chosen WHERE compilation_id = ?", [cid])
    _write_chosen(catalog, cid, cands, choice)
    return choice


def select_greedy(catalog: Catalog, cid: int) -> dict[int, int]:
    """Each operator takes its cheapest eligible spec, ignoring repartitions."""
    catalog.execute(load_sql("greedy.sql"), {"cid": cid})  # type: ignore[arg-type]
    rows = catalog.execute("SELECT op_id, spec_id FROM chosen WHERE compilation_id = ?", [cid]).fetchall()
    return {int(o): int(s) for o, s in rows}


def select_random(catalog: Catalog, cid: int, cands: Candidates, seed: int) -> dict[int, int]:
    """Each operator takes an eligible spec uniformly at random (deterministic for ``seed``)."""
    rng = np.random.default_rng(seed)
    choice = {}
    for op_id in sorted(cands.by_op):
        options = cands.eligible(op_id)
        choice[op_id] = options[int(rng.integers(len(options)))].spec_id
    _write_chosen(catalog, cid, cands, choice)
    return choice

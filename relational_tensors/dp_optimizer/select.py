"""The selectors: ``dp`` (Algorithm 1 over the pieces), ``greedy`` and ``random``.

``dp`` runs the inner minimization in SQL over the catalog's costed spec
tables, one recursive statement per group of independent pieces (its waves
computed in turn), and traces the choices back in Python; a piece whose
context equals that of a piece solved before (identical layers) takes its
solution instead (``repeats``).  Each selector writes its choice into the
catalog's ``chosen`` table.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from relational_tensors.catalog import Catalog, load_sql
from relational_tensors.dp_optimizer import repeats
from relational_tensors.dp_optimizer.candidates import Candidates
from relational_tensors.dp_optimizer.exact import exact_choice
from relational_tensors.dp_optimizer.plan import plan_cost
from relational_tensors.dp_optimizer.refine import refine
from relational_tensors.dp_optimizer.trees import Piece
from relational_tensors.errors import PlanError
from relational_tensors.graph.graph import Graph, Node

__all__ = ["SELECTORS", "select_dp", "select_exact", "select_greedy", "select_random"]

SELECTORS = ("dp", "exact", "greedy", "random")

log = logging.getLogger(__name__)


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
    """The pieces in groups solved together, one SQL statement per group: each piece goes into
    the group after the last one holding a piece it has an edge with (``carried``: operator -> the
    operators its edges across steps join it to, both ways, count too).  Two pieces with an edge keep
    their order, and a piece's DP sees only the choices of the pieces it has an edge with, so this
    solves exactly what solving them one after another does, in far fewer statements."""
    consumers = graph.consumers()
    carried = carried or {}
    piece_of = {v: pc.piece_id for pc in pieces for v in pc.members}
    level: dict[int, int] = {}
    groups: list[list[Piece]] = []
    for piece in pieces:
        touches = {i for v in piece.members for i in graph.nodes[v].inputs} | {
            c for v in piece.members for c in consumers[v]} | {u for v in piece.members for u in carried.get(v, ())}
        neighbours = {piece_of[u] for u in touches if u in piece_of} - {piece.piece_id}
        at = 1 + max((level[n] for n in neighbours if n in level), default=-1)
        level[piece.piece_id] = at
        if at == len(groups):
            groups.append([])
        groups[at].append(piece)
    return groups


def select_dp(catalog: Catalog, cid: int, graph: Graph, cands: Candidates, pieces: list[Piece],
              memory_price: float = 0.0, refine_choice: bool = True) -> dict[int, int]:
    """Algorithm 1 on each piece in turn, each subject to the pieces fixed before it; then, with
    ``refine_choice``, the coordinate descent of ``refine`` across the cut tensors (the ``dp_table`` keeps
    Algorithm 1's entries, ``chosen`` the final choice).

    A piece whose context (``_piece_context``) equals one solved before (the identical layers of a deep
    model) takes that piece's solution, member by member, and its ``dp_table`` rows, without SQL.

    ``memory_price`` adds that cost per byte of graph input a spec keeps resident on a device."""
    catalog.execute("DELETE FROM dp_table WHERE compilation_id = ?", [cid])
    catalog.execute("DELETE FROM chosen WHERE compilation_id = ?", [cid])
    group_sql, root_sql = load_sql("dp_group.sql"), load_sql("dp_root.sql")
    piece_of = {v: pc.piece_id for pc in pieces for v in pc.members}
    nodes = graph.nodes
    choice: dict[int, int] = {}
    across: dict[int, list[int]] = {}
    for w, k in cands.carried:
        v = cands.sources[(w, k)]
        across.setdefault(v, []).append(w)
        across.setdefault(w, []).append(v)
    share = repeats.enabled() and cands.classes.keys() >= cands.by_op.keys()  # classes: see Candidates
    readers = cands.readers() if share else {}
    solved: dict[object, tuple[tuple[int, ...], list[tuple[int, int, float]]]] = {}  # context -> solution
    unwritten: dict[int, int] = {}  # chosen specs not yet in the catalog (written before the next statement)
    copied: list[tuple[int, int, float, int]] = []  # dp_table rows of pieces that took a solution
    solved_by_sql = 0

    def flush() -> None:
        if unwritten:
            _write_chosen(catalog, cid, cands, unwritten)
            unwritten.clear()

    for group in independent_groups(graph, pieces, across):
        contexts = {pc.piece_id: _piece_context(pc, cands, choice, piece_of, readers) for pc in group} \
            if share else {}
        todo: list[Piece] = []
        firsts: set[object] = set()
        for pc in group:
            ctx = contexts.get(pc.piece_id)
            if ctx is None or (ctx not in solved and ctx not in firsts):
                todo.append(pc)
                if ctx is not None:
                    firsts.add(ctx)
        picked: dict[int, int] = {}
        solved_by_sql += len(todo)
        if todo:
            flush()  # the statement reads every choice made so far
            picked = _solve(catalog, cid, cands, todo, piece_of, group_sql, root_sql, memory_price, nodes, solved,
                            contexts)
        for pc in group:
            ctx = contexts.get(pc.piece_id)
            if ctx is None or pc.root in picked:
                continue
            specs, rows = solved[ctx]
            picked.update(zip(pc.members, specs))
            copied.extend((pc.members[j], cands.by_op[pc.members[j]][spec].output_tiling, cost, spec)
                          for j, spec, cost in rows)
        if share:  # in the order the traceback of the whole group visits them (a plan's cost sums in it)
            picked = {v: picked[v] for v in _traceback_order(group, nodes, piece_of)}
        unwritten.update(picked)  # the groups after this one read it
        choice.update(picked)
    flush()
    log.debug("dp: %d pieces, %d solved by SQL, the others by the solution of an equal context", len(pieces),
              solved_by_sql, extra={"rt_pieces": len(pieces), "rt_solved_by_sql": solved_by_sql})
    if copied:
        catalog.insert("dp_table", pa.table({
            "op_id": pa.array([r[0] for r in copied], pa.int32()),
            "tiling_id": pa.array([r[1] for r in copied], pa.int32()),
            "cost": pa.array([r[2] for r in copied], pa.float64()),
            "spec_id": pa.array([r[3] for r in copied], pa.int32())}), cid)
    if refine_choice:
        better = refine(graph, cands, choice, memory_price, pieces)
        seed = _expert_seed(graph, cands, better)
        if seed is not None:  # a mixture of experts: descend from expert parallelism too, keep the cheaper
            other = refine(graph, cands, seed, memory_price, pieces)
            if _objective(graph, cands, other, memory_price) < _objective(graph, cands, better, memory_price):
                better = other
        if better != choice:
            catalog.execute("DELETE FROM chosen WHERE compilation_id = ?", [cid])
            _write_chosen(catalog, cid, cands, better)
            choice = better
    return choice


def _objective(graph: Graph, cands: Candidates, choice: dict[int, int], memory_price: float) -> float:
    """What ``refine`` lowers: the plan's cost and the price of the bytes its specs keep resident."""
    resident = sum(cands.by_op[v][s].resident_bytes for v, s in choice.items())
    return plan_cost(graph, cands, choice) + memory_price * resident


def _expert_seed(graph: Graph, cands: Candidates, choice: dict[int, int]) -> dict[int, int] | None:
    """``choice`` with every operator that carries the experts of a mixture (``plans.expert_parallel``'s
    operators) on its cheapest eligible spec that splits them so; None for a graph without stacked expert
    weights.  Coordinate descent does not leave a plan that splits the experts' features for one that
    splits the experts, which moves every operator of the chain at once, so ``select_dp`` also descends
    from here."""
    from relational_tensors.dp_optimizer.plans import expert_parallel, stacked_weights

    if not stacked_weights(graph):  # most graphs: no index maps built, nothing added to planning
        return None
    wanted = expert_parallel(graph, cands.p)
    if not wanted:
        return None
    by_name = {graph.nodes[v].name: v for v in choice}
    seed = dict(choice)
    for name, split in wanted.items():
        v = by_name.get(name)
        if v is None:
            continue
        index, count = split.split("=")
        options = [(c.local_cost, s) for s, c in enumerate(cands.by_op[v])
                   if c.eligible and dict(c.spec.split).get(index, 1) == int(count)]
        if options:
            seed[v] = min(options)[1]
    return seed


def _solve(catalog: Catalog, cid: int, cands: Candidates, group: list[Piece], piece_of: dict[int, int],
           group_sql: str, root_sql: str, memory_price: float, nodes: Sequence[Node],
           solved: dict[object, tuple[tuple[int, ...], list[tuple[int, int, float]]]],
           contexts: Mapping[int, object]) -> dict[int, int]:
    """Algorithm 1 on independent pieces in one SQL statement, traced back; the solution of each piece
    with a context is kept in ``solved`` (its members' specs and their ``dp_table`` rows, by position)."""
    ops = [v for pc in group for wave in pc.waves for v in wave]
    heights = [h for pc in group for h, wave in enumerate(pc.waves) for _ in wave]
    members = [v for pc in group for v in pc.members]
    table: dict[int, dict[int, tuple[float, int]]] = {v: {} for v in members}
    for op_id, tiling, cost, spec in catalog.execute(group_sql, {  # the rows it inserts (RETURNING)
            "cid": cid, "ops": ops, "waves": heights, "memory_price": memory_price}).fetchall():  # type: ignore[arg-type]
        table[op_id][tiling] = (cost, spec)
    roots = {int(r[0]): (int(r[2]), float(r[3])) for r in catalog.execute(
        root_sql, {"cid": cid, "roots": [pc.root for pc in group]}).fetchall()}  # type: ignore[arg-type]
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
    for pc in group:
        ctx = contexts.get(pc.piece_id)
        if ctx is not None:
            solved[ctx] = (tuple(picked[v] for v in pc.members),
                           [(j, spec, cost) for j, v in enumerate(pc.members) for cost, spec in table[v].values()])
    return picked


def _traceback_order(group: list[Piece], nodes: Sequence[Node], piece_of: Mapping[int, int]) -> list[int]:
    """The members of ``group``'s pieces in the order ``_solve``'s traceback picks them: the roots, then
    depth first from the last root down its in-piece inputs."""
    order = [pc.root for pc in group]
    seen = set(order)
    stack = list(order)
    while stack:
        v = stack.pop()
        for i in nodes[v].inputs:
            if nodes[i].op is None or piece_of.get(i) != piece_of[v] or i in seen:
                continue
            seen.add(i)
            order.append(i)
            stack.append(i)
    return order


def _piece_context(pc: Piece, cands: Candidates, choice: Mapping[int, int], piece_of: Mapping[int, int],
                   readers: Mapping[int, list[tuple[int, int]]]) -> object:
    """Everything Algorithm 1 reads when it solves piece ``pc`` given the choices made so far: per member
    (in order) its class and, per input edge, nothing (a graph input), the class and chosen spec of a
    producer fixed before, the position of an in-piece producer, or the class of a producer planned later
    (its floor price); and the class, chosen spec and input position of each fixed reader of the root.
    Equal contexts have equal solutions, member by member (classes: ``Candidates.classes``)."""
    index = {v: j for j, v in enumerate(pc.members)}
    classes, sources, carried = cands.classes, cands.sources, cands.carried
    parts = []
    for v in pc.members:
        edges: list[object] = []
        for k in range(len(cands.by_op[v][0].required)):
            u = sources.get((v, k))
            if u is None:
                edges.append(None)
            elif u in choice:
                edges.append((classes[u], choice[u]))
            elif piece_of.get(u) == piece_of[v] and (v, k) not in carried:
                edges.append(index[u])
            else:
                edges.append((classes[u],))
        parts.append((classes[v], tuple(edges)))
    fixed = sorted((classes[w], choice[w], k) for w, k in readers.get(pc.root, ()) if w in choice)
    return tuple(parts), tuple(fixed)


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

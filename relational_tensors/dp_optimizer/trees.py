"""Cutting the graph into the pieces Algorithm 1 solves exactly (section 4.5).

Every edge out of a tensor with several consumers is cut; the pieces are trees
rooted at operators whose output is consumed zero or several times, or assigned
to a state (the next step's readers of the state price its output tiling).  With the
``linear`` tactic every operator also keeps at most one in-piece input (the
largest), so each piece is a path and each inner minimization ranges over a
single producer.  Pieces are optimized in decreasing size (operators, then
elements), each subject to the pieces fixed before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from relational_tensors.errors import PlanError
from relational_tensors.graph.graph import Graph

__all__ = ["Piece", "cut_pieces", "TACTICS"]

TACTICS = ("tree", "linear")


@dataclass(frozen=True)
class Piece:
    """One tree (or path) of operators: its root, members bottom-up, and DP waves."""

    piece_id: int
    root: int
    members: tuple[int, ...]          # topological order
    waves: tuple[tuple[int, ...], ...]  # operators whose in-piece producers are all in earlier waves
    elements: int

    @property
    def size(self) -> int:
        return len(self.members)


def cut_pieces(graph: Graph, tactic: str = "tree") -> tuple[list[Piece], dict[tuple[int, int], bool]]:
    """The pieces in the order they are optimized, and for each (op, input position) whether that edge is cut."""
    if tactic not in TACTICS:
        raise PlanError(f"unknown DP tactic {tactic!r}; choose one of {TACTICS}.")
    consumers = graph.consumers()
    nodes = graph.nodes
    values = set(graph.assignments.values())  # a state's value is a root: its next-step readers price it
    cut: dict[tuple[int, int], bool] = {}
    for n in graph.operators:
        for k, i in enumerate(n.inputs):
            src = nodes[i]
            cut[(n.id, k)] = src.op is None or len(consumers[i]) != 1 or i in values
    if tactic == "linear":
        for n in graph.operators:
            inner = [k for k, i in enumerate(n.inputs) if not cut[(n.id, k)]]
            if len(inner) > 1:
                keep = max(inner, key=lambda k: (nodes[n.inputs[k]].type.volume, -k))
                for k in inner:
                    cut[(n.id, k)] = k != keep
    parent: dict[int, int] = {}  # producer -> its in-piece consumer
    for n in graph.operators:
        for k, i in enumerate(n.inputs):
            if not cut[(n.id, k)]:
                parent[i] = n.id
    roots = [n.id for n in graph.operators if n.id not in parent]
    pieces = []
    for root in roots:
        members: list[int] = []
        stack = [root]
        while stack:
            v = stack.pop()
            members.append(v)
            stack.extend(i for k, i in enumerate(nodes[v].inputs) if not cut[(v, k)])
        members.sort()
        height: dict[int, int] = {}
        for v in members:  # ids are topological
            height[v] = 1 + max((height[i] for k, i in enumerate(nodes[v].inputs) if not cut[(v, k)]), default=-1)
        waves = tuple(tuple(v for v in members if height[v] == h) for h in range(max(height.values()) + 1))
        elements = sum(nodes[v].type.volume for v in members)
        pieces.append((root, tuple(members), waves, elements))
    pieces.sort(key=lambda t: (-len(t[1]), -t[3], t[0]))
    return [Piece(n, r, m, w, e) for n, (r, m, w, e) in enumerate(pieces)], cut

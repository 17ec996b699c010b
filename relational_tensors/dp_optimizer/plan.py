"""The logical plan: one join-agg spec per operator, and its cost under the model."""

from __future__ import annotations

from dataclasses import dataclass, field

from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.dp_optimizer.candidates import Candidate, Candidates
from relational_tensors.errors import PlanError
from relational_tensors.graph.graph import Graph

__all__ = ["LogicalPlan", "plan_cost", "edge_repartition"]


def edge_repartition(graph: Graph, cands: Candidates, choice: dict[int, int], op_id: int, k: int) -> float:
    """The repartition an input edge pays under ``choice``: 0 for graph inputs, else the price of the
    pair (producer's output tiling, tiling the spec reads), see :meth:`Candidates.edge_price`; an edge
    reading an assigned state is priced from the tiling of the state's value (``Graph.source_op``)."""
    i = cands.sources.get((op_id, k))
    if i is None:
        return 0.0
    mine = cands.by_op[op_id][choice[op_id]]
    theirs = cands.by_op[i][choice[i]]
    return cands.edge_price(op_id, k, theirs.output_tiling, mine.required[k])


def plan_cost(graph: Graph, cands: Candidates, choice: dict[int, int]) -> float:
    """Total cost of a complete choice: every spec's join and aggregation plus every repartition."""
    total = 0.0
    for op_id, spec_id in choice.items():
        total += cands.by_op[op_id][spec_id].local_cost
        for k in range(len(graph.nodes[op_id].inputs)):
            total += edge_repartition(graph, cands, choice, op_id, k)
    return total


@dataclass
class LogicalPlan:
    """A spec per operator (by node id), the candidates it was chosen from, and its cost."""

    graph: Graph
    candidates: Candidates
    choice: dict[int, int]
    selector: str
    cost_model: str
    cost: float = field(init=False)

    def __post_init__(self) -> None:
        self.cost = plan_cost(self.graph, self.candidates, self.choice)

    @property
    def p(self) -> int:
        return self.candidates.p

    def candidate(self, op: str | int) -> Candidate:
        node = self.graph.node(op) if isinstance(op, str) else self.graph.nodes[op]
        if node.op is None:
            raise PlanError(f"{node.name!r} is a graph input; it has no spec.")
        return self.candidates.by_op[node.id][self.choice[node.id]]

    def spec(self, op: str | int) -> JoinAggSpec:
        return self.candidate(op).spec

    def split(self, op: str | int) -> str:
        return self.spec(op).split_text

    def repartitions(self) -> list[tuple[str, int]]:
        """(consumer name, input position) of every edge that repartitions."""
        out = []
        for op_id in sorted(self.choice):
            for k in range(len(self.graph.nodes[op_id].inputs)):
                if edge_repartition(self.graph, self.candidates, self.choice, op_id, k) > 0:
                    out.append((self.graph.nodes[op_id].name, k))
        return out

"""The state of one compilation: what each pass of ``driver.compiler`` reads and writes, from the
graph and its options to the plan, the task DAG and the liveness.  ``CompiledGraph`` is made from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from relational_tensors.catalog import Catalog
from relational_tensors.dp_optimizer.candidates import Candidates
from relational_tensors.dp_optimizer.constraints import Constraints
from relational_tensors.dp_optimizer.plan import LogicalPlan
from relational_tensors.dp_optimizer.trees import Piece
from relational_tensors.driver.options import CompileOptions
from relational_tensors.graph.graph import Graph
from relational_tensors.machine.target import Target
from relational_tensors.physical.lower import Lowered
from relational_tensors.physical.tasks import Liveness

__all__ = ["CompileState"]


@dataclass
class CompileState:
    graph: Graph
    options: CompileOptions
    catalog: Catalog
    target: Target | None = None
    limits: dict[int, int] | None = None  # bytes each device may use (None: unknown, unchecked)
    limit: int | None = None              # the least of them: what a spec's working set must fit
    cid: int = -1
    candidates: Candidates | None = None
    pieces: list[Piece] = field(default_factory=list)
    cut: dict[tuple[int, int], bool] = field(default_factory=dict)
    choice: dict[int, int] = field(default_factory=dict)
    plan: LogicalPlan | None = None
    lowered: Lowered | None = None
    live: Liveness | None = None
    kept: dict[int, str] = field(default_factory=dict)  # assigned state -> how it is kept (default "as read")
    fold: bool = False  # a pipelined plan's micro-batch partials folded as they are made (to fit the memory)
    constraints: Constraints = field(default_factory=Constraints)
    collect: bool = False  # the caller had Python's cyclic collector on (see run and compiler._collecting)
    searched_programs: int = 0  # schedule_mode="search": programs searched, and how many the budget stopped
    search_timeouts: int = 0
    timings: dict[str, float] = field(default_factory=dict)

"""relational_tensors: every kernel is a join followed by an aggregation.

Write a computation once against ``Graph`` and let the compiler split every
operator over all devices by its join-agg specs.
"""

from relational_tensors.core.aggregation import AGGREGATIONS, LSE, MAX, MIN, SUM, Aggregation
from relational_tensors.core.spec import ANY, FunctionSpec, JoinAggSpec, ShardableIndex
from relational_tensors.core.tiling import Tiling
from relational_tensors.core.types import Box, Interval, TensorType, tensorDesc
from relational_tensors.errors import (
    ExchangeError, ExecError, GraphError, OutOfMemoryPlanError, PlanError, RelationalTensorsError, SpecError,
)
from relational_tensors.frontend.graph import Graph, Node, Tensor, createGraph
from relational_tensors.reference import execute_spec, reference
from relational_tensors.sql_specs import OPERATORS

__version__ = "0.1.0"

__all__ = [
    "Graph", "Node", "Tensor", "createGraph", "tensorDesc", "reference", "execute_spec",
    "TensorType", "Interval", "Box", "Tiling", "FunctionSpec", "JoinAggSpec", "ShardableIndex", "ANY",
    "Aggregation", "SUM", "MAX", "MIN", "LSE", "AGGREGATIONS", "OPERATORS",
    "RelationalTensorsError", "GraphError", "SpecError", "PlanError", "OutOfMemoryPlanError",
    "ExchangeError", "ExecError",
]

from relational_tensors.compiler import CompiledGraph, compile, compileGraph  # noqa: E402

__all__ += ["compileGraph", "compile", "CompiledGraph"]

from relational_tensors.frontend.parallelize import ParallelModule, parallelize  # noqa: E402
from relational_tensors.frontend.torch_fx import TorchGraph, from_torch  # noqa: E402

__all__ += ["from_torch", "parallelize", "TorchGraph", "ParallelModule"]

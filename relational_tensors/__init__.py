"""relational_tensors: every kernel is a join followed by an aggregation.

Write a computation once against ``Graph`` and let the compiler split every
operator over all devices by its join-agg specs.  This module only re-exports
the public API; each name lives in the layer that owns it.
"""

import logging as _logging

import relational_tensors.dp_optimizer.plans as plans
import relational_tensors.graph.optim as optim
from relational_tensors._version import __version__ as __version__
from relational_tensors.api.compile import compile as compile
from relational_tensors.api.compile import compileGraph as compileGraph
from relational_tensors.api.compile import load_plan as load_plan
from relational_tensors.api.compile import save_plan as save_plan
from relational_tensors.api.dynamo import dynamo_backend as dynamo_backend
from relational_tensors.api.generation import Decoder as Decoder
from relational_tensors.api.generation import decoder as decoder
from relational_tensors.api.generation import generate as generate
from relational_tensors.api.parallelize import ParallelModule as ParallelModule
from relational_tensors.api.parallelize import parallelize as parallelize
from relational_tensors.api.training import TrainStep as TrainStep
from relational_tensors.api.training import train_step as train_step
from relational_tensors.core.aggregation import AGGREGATIONS as AGGREGATIONS
from relational_tensors.core.aggregation import LSE as LSE
from relational_tensors.core.aggregation import MAX as MAX
from relational_tensors.core.aggregation import MIN as MIN
from relational_tensors.core.aggregation import SUM as SUM
from relational_tensors.core.aggregation import Aggregation as Aggregation
from relational_tensors.core.spec import ANY as ANY
from relational_tensors.core.spec import FunctionSpec as FunctionSpec
from relational_tensors.core.spec import JoinAggSpec as JoinAggSpec
from relational_tensors.core.spec import ShardableIndex as ShardableIndex
from relational_tensors.core.tiling import Tiling as Tiling
from relational_tensors.core.types import Box as Box
from relational_tensors.core.types import Interval as Interval
from relational_tensors.core.types import TensorType as TensorType
from relational_tensors.core.types import tensorDesc as tensorDesc
from relational_tensors.dp_optimizer.pipeline import Pipeline as Pipeline
from relational_tensors.driver.compiled import CompiledGraph as CompiledGraph
from relational_tensors.driver.options import CompileOptions as CompileOptions
from relational_tensors.errors import CatalogError as CatalogError
from relational_tensors.errors import CommandError as CommandError
from relational_tensors.errors import ExchangeError as ExchangeError
from relational_tensors.errors import ExecError as ExecError
from relational_tensors.errors import GraphError as GraphError
from relational_tensors.errors import OutOfMemoryPlanError as OutOfMemoryPlanError
from relational_tensors.errors import PlanError as PlanError
from relational_tensors.errors import RelationalTensorsError as RelationalTensorsError
from relational_tensors.errors import SpecError as SpecError
from relational_tensors.frontend.torch import TorchGraph as TorchGraph
from relational_tensors.frontend.torch import from_torch as from_torch
from relational_tensors.graph.graph import Graph as Graph
from relational_tensors.graph.graph import Node as Node
from relational_tensors.graph.graph import Tensor as Tensor
from relational_tensors.graph.graph import createGraph as createGraph
from relational_tensors.graph.reference import execute_spec as execute_spec
from relational_tensors.graph.reference import reference as reference
from relational_tensors.machine.target import Target as Target
from relational_tensors.sql_specs import OPERATORS as OPERATORS

__all__ = [
    "Graph", "Node", "Tensor", "createGraph", "tensorDesc", "reference", "execute_spec",
    "TensorType", "Interval", "Box", "Tiling", "FunctionSpec", "JoinAggSpec", "ShardableIndex", "ANY",
    "Aggregation", "SUM", "MAX", "MIN", "LSE", "AGGREGATIONS", "OPERATORS",
    "RelationalTensorsError", "GraphError", "SpecError", "PlanError", "OutOfMemoryPlanError",
    "ExchangeError", "ExecError", "CatalogError", "CommandError",
    "compileGraph", "compile", "CompiledGraph", "load_plan", "save_plan", "CompileOptions", "Target",
    "from_torch", "parallelize", "dynamo_backend", "TorchGraph", "ParallelModule", "optim", "plans", "train_step",
    "TrainStep", "Pipeline",
]

# a library prints nothing unless asked: its loggers ("relational_tensors.compile": per-pass timings at INFO)
# reach the application's handlers, never Python's last-resort stderr handler
_logging.getLogger("relational_tensors").addHandler(_logging.NullHandler())

"""Compiling a graph: ``compileGraph`` and ``compile`` validate the options once (``CompileOptions``,
the devices included) and hand them to the driver: ``driver.compiler.run`` here, or, for
``device="dist"``, ``driver.distributed`` (one process per device under torchrun), which runs the same
compiler on rank 0.  ``save_plan`` and ``load_plan`` write a compiled plan to a file and read it back
without planning.

>>> import relational_tensors as rt
>>> g = rt.Graph(); a = g.input("a", [64, 64]); b = g.input("b", [64, 64])
>>> _ = g.save(g.matmul(a, b), name="c")
>>> rt.compileGraph(g, device="cpu:8").plan.split("matmul_2")
'i=2,j=2,k=2'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from relational_tensors.catalog import Catalog
from relational_tensors.driver import compiler, distributed, pipelines, plan_file
from relational_tensors.driver.compiled import CompiledGraph
from relational_tensors.driver.options import CompileOptions
from relational_tensors.errors import GraphError, PlanError
from relational_tensors.graph.graph import Graph
from relational_tensors.machine.topology import Topology
from relational_tensors.runtime.binding import check_bind

__all__ = ["compileGraph", "compile", "save_plan", "load_plan"]


def _constraint_pairs(constraints: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if constraints is None:
        return ()
    if not isinstance(constraints, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in constraints.items()):
        raise GraphError("constraints maps operator names to splits and input or state names to layouts, e.g. "
                         f"{{'attention': 'heads_kv=8', 'x': 'S(0)', 'wq': 'R'}}; got {constraints!r}.")
    return tuple(sorted(constraints.items()))


def compileGraph(graph: Graph, device: object = None, selector: str = "dp", seed: int = 0,
                 cost_model: str = "paper", memory_per_device: int | None = None,
                 catalog: str | Path | Catalog | None = None, tactic: str = "tree",
                 label: str | None = None, schedule_mode: str = "naive",
                 topology: str | Topology | None = None, search_budget_s: float = 0.5, search_steps: int | None = None,
                 search_total_steps: int | None = 400,
                 calibration: str | None = None, attention: str = "triton", refine: bool = True,
                 keep_states: str = "auto", second_phase_inputs: Any = (),
                 constraints: Mapping[str, str] | None = None, pipeline: Any = None, process_group: Any = None,
                 timeout: float | None = None, transport: str | None = None,
                 bind: Mapping[str, Any] | None = None) -> CompiledGraph:
    """Plan ``graph`` for the devices named by ``device`` (see ``relational_tensors.machine.devices``).

    The options are those of :class:`~relational_tensors.driver.options.CompileOptions`, validated once here;
    ``catalog`` is a path to persist the catalog (default: in memory); ``topology`` None is hgx-h200
    (under ``device="dist"``: the measured topology file, else the GPUs' kind).  ``device="dist"`` plans for every
    rank of a torch.distributed launch (``process_group``: the group to run in, default the world;
    ``timeout``: seconds a rank waits for a transfer; ``transport``: ``nccl`` or ``gloo``, for GPU ranks), see
    ``relational_tensors.driver.distributed``.

    ``bind`` maps graph inputs to arrays the program reads in place (CUDA arrays on GPUs, NumPy arrays on
    virtual devices): the blocks that are contiguous runs of an array point into it and take no memory of
    the program's; the rest are copied from it once.  Bound inputs are constants: the caller keeps the arrays
    alive and unchanged, and a load of one is refused (``runtime/binding.py``).  Programs over the same
    weights share them this way.
    """
    dist = isinstance(device, str) and device.startswith("dist")
    if bind:
        if dist or pipeline == "auto":
            raise GraphError("bind= reads inputs in place from arrays of this process, for one compiled program; "
                             f"got device={device!r}, pipeline={pipeline!r}. Load the inputs instead.")
        if isinstance(graph, Graph):  # (before planning; anything else is refused by the compiler)
            check_bind(graph.inputs, bind)
    if not dist and (process_group is not None or timeout is not None or transport is not None):
        raise GraphError("process_group=, timeout= and transport= are for device='dist' (one process per device "
                         f"under torchrun); got device={device!r}.")
    options = CompileOptions(device=device, selector=selector, seed=seed, cost_model=cost_model,
                             memory_per_device=memory_per_device, tactic=tactic, label=label,
                             schedule_mode=schedule_mode, topology=CompileOptions.default("topology")
                             if topology is None else topology, search_budget_s=search_budget_s,
                             search_steps=search_steps, search_total_steps=search_total_steps,
                             calibration=calibration, attention=attention, refine=refine,
                             keep_states=keep_states, second_phase_inputs=frozenset(
                                 [second_phase_inputs] if isinstance(second_phase_inputs, str)
                                 else second_phase_inputs),
                             constraints=_constraint_pairs(constraints), pipeline=pipeline)
    if options.pipeline == "auto":
        if dist:
            raise PlanError("pipeline='auto' compiles and simulates several plans on one process; under "
                            "device='dist' give the pipeline (rt.Pipeline(stages, micro_batches)) or none.")
        return pipelines.compile_auto(graph, options, catalog)
    if dist:
        return distributed.compile_distributed(graph, options, catalog, process_group, timeout, transport,
                                               topology_given=topology is not None)
    return compiler.run(graph, options, catalog, bind)


def compile(graph: Graph, devices: object = None, **options: Any) -> CompiledGraph:
    """``compileGraph`` with the Pythonic keyword ``devices``."""
    known = ({f.name for f in fields(CompileOptions)} - {"device"}) | {"catalog", "process_group", "timeout",
                                                                         "transport", "bind"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise PlanError(f"unknown compile options {unknown}; the options are {sorted(known)}.")
    return compileGraph(graph, device=devices, **options)


def save_plan(cg: CompiledGraph, path: str | Path) -> None:
    """Write the compiled plan ``cg`` to ``path``; :func:`load_plan` rebuilds it without planning (see
    ``relational_tensors.driver.plan_file``)."""
    plan_file.save_plan(cg, path)


def load_plan(path: str | Path, graph: Graph, catalog: str | Path | Catalog | None = None) -> CompiledGraph:
    """The compiled plan saved at ``path``, for ``graph`` (the graph it was planned for)."""
    return plan_file.load_plan(path, graph, catalog)

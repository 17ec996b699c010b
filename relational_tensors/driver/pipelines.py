"""``pipeline="auto"``: the planner chooses the stages and micro-batches by pricing each choice.

The candidates are no pipeline and, for every stage count ``S`` of 2, 4 and 8 that divides the devices,
``S`` stages with ``2 S`` micro-batches under 1F1B (more stages than eight leave too few layers to each on
the models this plans).  Each is compiled (the DP's plan inside its stages)
into one catalog, labelled with its shape, and simulated on the target; the fastest one that fits the
memory is returned.  A candidate refused for memory is skipped; if every one is, the first refusal is
raised.  The catalog's ``compilations`` table holds every candidate's predicted time and peak:

    SELECT label, predicted_seconds, peak_bytes FROM compilations ORDER BY compilation_id
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from relational_tensors.catalog import Catalog
from relational_tensors.dp_optimizer.pipeline import Pipeline
from relational_tensors.driver import compiler
from relational_tensors.driver.compiled import CompiledGraph
from relational_tensors.driver.options import CompileOptions
from relational_tensors.errors import OutOfMemoryPlanError
from relational_tensors.graph.graph import Graph
from relational_tensors.machine.devices import parse_devices

__all__ = ["candidates", "compile_auto"]

log = logging.getLogger("relational_tensors.compile")


def candidates(p: int) -> list[Pipeline | None]:
    """No pipeline, then ``S`` stages of ``2 S`` micro-batches for S = 2, 4, 8 dividing ``p``.

    >>> [c.stages if c else 1 for c in candidates(16)]
    [1, 2, 4, 8]
    >>> [c.stages if c else 1 for c in candidates(6)]
    [1, 2]
    """
    return [None, *(Pipeline(s, 2 * s, "1f1b") for s in (2, 4, 8) if s <= p and p % s == 0)]


def compile_auto(graph: Graph, options: CompileOptions, catalog: str | Path | Catalog | None = None) -> CompiledGraph:
    """The fastest of :func:`candidates` that fits, each compiled with ``options`` into one catalog."""
    cat = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
    label = options.label or ",".join(graph.outputs)
    best: tuple[float, CompiledGraph] | None = None
    refused: OutOfMemoryPlanError | None = None
    for pipe in candidates(parse_devices(options.device).p):
        shape = "no pipeline" if pipe is None else f"pipeline {pipe.stages}x{pipe.micro_batches}"
        try:
            cg = compiler.run(graph, replace(options, pipeline=pipe, label=f"{label} ({shape})"), cat)
        except OutOfMemoryPlanError as e:
            refused = refused or e
            continue
        seconds = cg.simulate()
        log.info("pipeline choice: %s simulates to %.3f ms", shape, seconds * 1e3)
        if best is None or seconds < best[0]:
            best = (seconds, cg)
    if best is None:
        assert refused is not None
        raise refused
    return best[1]

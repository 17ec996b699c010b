"""The plans of a fixed set of graphs, written as text: ``explain()`` and every exchange program.

Each case is a graph, a device count and a cost model; its expected text lives in
``tests/fixtures/plans/<case>.txt``.  ``tests/test_plan_fixtures.py`` compiles each case again and
compares the text, so a change to the compiler that changes a plan shows up as a fixture diff, and
runs each plan on its ``cpu:p`` against ``rt.reference`` (on the inputs its ``FixtureGraph.feeds`` draws).
Rewrite the files (only in a commit that says why a plan changed) with::

    python tests/plan_fixtures.py
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, chain_feeds, llama_block, llama_feeds, matrix_chain

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "plans"
# pinned so that no plan depends on the memory of the host that compiles it (an H200's 141 GiB)
MEMORY_PER_DEVICE = 141 * (1 << 30)


def demo_block() -> rt.Graph:
    """The block ``relational-tensors demo`` plans: packed sequences, GQA, float32."""
    return llama_block(batch=2, seq=256, d_model=256, n_heads=8, n_kv_heads=2, d_ff=704, dtype="float32",
                       seq_ends=[64, 100, 256])


def block_128k() -> rt.Graph:
    """The LLaMA-3-8B-shaped block on one 128K-token sequence, float16."""
    return llama_block(batch=1, seq=131072, dtype="float16", **LLAMA3_8B)


def odd_block() -> rt.Graph:
    """A block whose sizes divide by nothing in sight: 777 tokens, 6 query and 3 kv heads, d_ff 500."""
    return llama_block(batch=1, seq=777, d_model=192, n_heads=6, n_kv_heads=3, d_ff=500, dtype="float32")


class FixtureGraph(NamedTuple):
    build: Callable[[], rt.Graph]
    counts: tuple[int, ...]  # the device counts p it is planned for
    # random inputs for it from a seed (every input, of its shape and dtype; an integer input such as token
    # ids or a mask needs valid values: see ``feeds_for`` in tests/cases.py)
    feeds: Callable[[rt.Graph, int], dict[str, np.ndarray]]


GRAPHS: dict[str, FixtureGraph] = {
    "demo_block": FixtureGraph(demo_block, (8, 16), llama_feeds),
    "chain_a": FixtureGraph(lambda: matrix_chain("A"), (6,), chain_feeds),
    "block_128k": FixtureGraph(block_128k, (8,), llama_feeds),
    "odd_block": FixtureGraph(odd_block, (5,), llama_feeds),
}
COST_MODELS = ("paper", "calibrated")
CASES: tuple[tuple[str, str, int, str], ...] = tuple(
    (f"{graph}_p{p}_{model}", graph, p, model)
    for graph, fixture in GRAPHS.items() for p in fixture.counts for model in COST_MODELS)


def compile_case(graph: str, p: int, cost_model: str) -> rt.CompiledGraph:
    """The compilation of one case: its graph for ``cpu:p`` with the case's options."""
    return rt.compileGraph(GRAPHS[graph].build(), device=f"cpu:{p}", cost_model=cost_model,
                           memory_per_device=MEMORY_PER_DEVICE)


def plan_text(graph: str, p: int, cost_model: str, cg: rt.CompiledGraph | None = None) -> str:
    """The plan of one case as text: the explain() table, then each exchange program by name (of ``cg``,
    the case's compilation, where given; compiled here otherwise)."""
    if cg is None:
        cg = compile_case(graph, p, cost_model)
    table = "".join(_untimed(line) for line in cg.explain(file=_Null(), width=160).splitlines(keepends=True))
    parts = [f"# {graph} on cpu:{p}, cost model {cost_model}\n", table, f"task DAG: {cg.dag.summary()}\n"]
    for name, text in cg.exchange_programs().items():
        parts.append(f"\n## exchange program of {name}\n{text}")
        if not text.endswith("\n"):
            parts.append("\n")
    return "".join(parts)


def _untimed(line: str) -> str:
    """The caption without its planning time (the one part of a plan that is measured, not decided)."""
    if "planned in" not in line:
        return line
    return re.sub(r"planned in [0-9.]+s", "planned in ?s", line).strip() + "\n"


class _Null:
    def write(self, text: str) -> int:
        return len(text)


def main(names: list[str]) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for case, graph, p, model in CASES:
        if names and case not in names:
            continue
        (FIXTURES / f"{case}.txt").write_text(plan_text(graph, p, model))
        print("wrote", case)


if __name__ == "__main__":
    main(sys.argv[1:])

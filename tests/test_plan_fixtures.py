"""Plans as text: every fixture case compiles to exactly the text in ``tests/fixtures/plans``."""

from __future__ import annotations

import difflib

import pytest
from plan_fixtures import CASES, FIXTURES, plan_text


@pytest.mark.parametrize(("case", "graph", "p", "cost_model"), CASES, ids=[c[0] for c in CASES])
def test_plan_matches_fixture(case: str, graph: str, p: int, cost_model: str) -> None:
    expected = (FIXTURES / f"{case}.txt").read_text()
    got = plan_text(graph, p, cost_model)
    if got != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), got.splitlines(True), "fixture", "now", n=2))
        pytest.fail(f"the plan of {case} differs from tests/fixtures/plans/{case}.txt "
                    f"(rewrite with `python tests/plan_fixtures.py {case}` only if the change is meant):\n"
                    f"{diff[:6000]}")

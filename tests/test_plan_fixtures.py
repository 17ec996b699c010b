"""Plans as text: every fixture case compiles to exactly the text in ``tests/fixtures/plans``; and plans
executed: each fixture's plan runs on its ``cpu:p`` and equals ``rt.reference``."""

from __future__ import annotations

import difflib
from collections.abc import Iterator

import numpy as np
import pytest
from cases import SIXTEEN_BIT_TOL
from plan_fixtures import CASES, FIXTURES, GRAPHS, compile_case, plan_text

import relational_tensors as rt
from relational_tensors.core.dtypes import FLOAT_DTYPES, numpy_dtype


def _check_text(case: str, got: str) -> None:
    expected = (FIXTURES / f"{case}.txt").read_text()
    if got != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), got.splitlines(True), "fixture", "now", n=2))
        pytest.fail(f"the plan of {case} differs from tests/fixtures/plans/{case}.txt "
                    f"(rewrite with `python tests/plan_fixtures.py {case}` only if the change is meant):\n"
                    f"{diff[:6000]}")


@pytest.mark.parametrize(("case", "graph", "p", "cost_model"), CASES, ids=[c[0] for c in CASES])
def test_plan_matches_fixture(case: str, graph: str, p: int, cost_model: str) -> None:
    _check_text(case, plan_text(graph, p, cost_model))


# Executing a plan: which fixtures run by default.  demo_block and odd_block take about a second a case.
# chain_a is the paper's chain A at full size (float16 matrices of up to 10240 x 16384, ~8e12 flops):
# its two cases take about 8 minutes and 8 GB on 2 cores, so they run with `-m slow` only.  block_128k is not
# run: LLaMA-3-8B's block over one 131072-token sequence is ~2e14 flops an evaluation (causal attention
# 1.4e14, the projections 5.7e13), about an hour for the plan and as long again for the reference on 2
# cores, with float32 activations of 7 GiB each ([131072, 14336]) against this host's 23 GB.  Its plan
# text is still checked above.
SLOW_TO_RUN = {"chain_a"}
NOT_RUN = {"block_128k": "LLaMA-3-8B block on 131072 tokens: ~2e14 flops and tens of GB per evaluation, "
                         "beyond a CPU test (its plan text is still compared)"}


def _run_param(case: str, graph: str, p: int, cost_model: str) -> object:
    marks = [pytest.mark.slow] if graph in SLOW_TO_RUN else []
    if graph in NOT_RUN:
        marks = [pytest.mark.skip(reason=NOT_RUN[graph])]
    return pytest.param(case, graph, p, cost_model, id=case, marks=marks)


# The error allowed, as max |plan - reference| over max |reference| of an output, by its dtype.  The plan
# runs the reference's NumPy kernels on blocks of the same inputs, so the two differ only in rounding: the
# order in which a split contraction's partial sums are added, and attention's softmax over key blocks.
# Re-associating a sum of n terms moves it by at most ~n unit roundoffs of the sum of |terms|; the longest
# contraction in these graphs is d_ff = 704 terms, ~4e-5 in float32 at the output's scale (the values
# here are O(1)), so 1e-4 bounds it; measured 1.7e-7 to 4.5e-7.  float64 (none here today): 1e-10, as
# tests/test_llama.py.  float16 and bfloat16: both sides compute in float32 and round each operator's
# output once, so a value near a rounding boundary lands one ulp apart and carries on through the
# operators after it: two ulps of the largest magnitude (SIXTEEN_BIT_TOL of tests/cases.py, 2e-3 for
# float16); chain_a measured 5.2e-4 (one float16 ulp) with the paper's cost model, 0 with the calibrated.
# A wrong plan (a misplaced block, a dropped partial sum, a mask off by a row) errs by the order of the
# output's scale, far above each bound.
RUN_TOL = {"float64": 1e-10, "float32": 1e-4, **SIXTEEN_BIT_TOL}


@pytest.fixture(scope="module")
def references() -> Iterator[dict]:
    """graph name -> (graph, feeds, reference outputs), one graph at a time: the cases of one graph (its
    device counts and cost models) run on the same inputs, so its reference is computed once."""
    cache: dict = {}
    yield cache
    cache.clear()


def _reference(references: dict, graph: str) -> tuple[rt.Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    if graph not in references:
        references.clear()  # hold one graph's inputs at a time (chain_a's are 1.9 GB)
        g = GRAPHS[graph].build()
        for n in g.inputs:  # the feeds functions draw normals: ids or masks need a feeds function of their own
            assert n.type.dtype in FLOAT_DTYPES, (
                f"{graph} has the {n.type.dtype} input {n.name}: give GRAPHS[{graph!r}] feeds that draw valid "
                f"values for it (see feeds_for in tests/cases.py)")
        feeds = GRAPHS[graph].feeds(g, 0)
        for n in g.inputs:
            assert feeds[n.name].shape == tuple(n.type.shape) and feeds[n.name].dtype == numpy_dtype(n.type.dtype)
        references[graph] = (g, feeds, rt.reference(g, feeds))
    return references[graph]


@pytest.mark.parametrize(("case", "graph", "p", "cost_model"), [_run_param(*c) for c in CASES])
def test_plan_fixture_runs(case: str, graph: str, p: int, cost_model: str, references: dict) -> None:
    g, feeds, want = _reference(references, graph)
    cg = compile_case(graph, p, cost_model)
    _check_text(case, plan_text(graph, p, cost_model, cg))  # the plan executed is the fixture's
    got = cg.run(feeds)
    assert set(got) == set(want) == set(g.outputs)
    for name, expected in want.items():
        dtype = g.nodes[g.outputs[name]].type.dtype
        out = np.asarray(got[name])
        assert out.shape == expected.shape and out.dtype == expected.dtype, f"{case}: output {name}"
        out64, expected64 = out.astype(np.float64), expected.astype(np.float64)
        assert np.isfinite(expected64).all() and np.isfinite(out64).all(), f"{case}: output {name} not finite"
        scale = float(np.max(np.abs(expected64), initial=0.0))
        err = float(np.max(np.abs(out64 - expected64), initial=0.0)) / max(scale, 1e-30)
        assert err <= RUN_TOL[dtype], (f"{case}: output {name} ({dtype}) differs from rt.reference by {err:.2e} "
                                       f"of its largest magnitude {scale:.3g} (allowed {RUN_TOL[dtype]:.0e})")

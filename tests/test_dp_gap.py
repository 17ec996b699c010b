"""The DP's plans on training graphs against the exact optimum of the same cost (a HiGHS MILP, in
bench/dp_gap.py): never better than it, the refined plan never worse than Algorithm 1's."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.dp_optimizer.plan import plan_cost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from dp_gap import exact_optimum, random_training_graph  # noqa: E402


@pytest.mark.parametrize("seed", range(4))
def test_exact_optimum_bounds_the_dp_and_refinement_helps(seed: int) -> None:
    g = random_training_graph(np.random.default_rng(seed))
    raw = rt.compileGraph(g, device="cpu:4", refine=False, memory_per_device=1 << 40)
    refined = rt.compileGraph(g, device="cpu:4", memory_per_device=1 << 40)
    best, choice, _ = exact_optimum(g, raw.plan.candidates)
    assert best == pytest.approx(plan_cost(g, raw.plan.candidates, choice))
    assert best <= refined.plan.cost * (1 + 1e-12) <= raw.plan.cost * (1 + 1e-12)


def test_exact_selector_plans_and_runs_at_the_optimum() -> None:
    g = random_training_graph(np.random.default_rng(19))
    cg = rt.compileGraph(g, device="cpu:4", selector="exact", memory_per_device=1 << 40)
    best, _, _ = exact_optimum(g, cg.plan.candidates)
    assert cg.plan.cost == pytest.approx(best, rel=1e-9)
    assert cg.sql("SELECT count(*) AS n FROM plan").column("n").to_pylist() == [len(g.operators)]
    feeds = {n.name: np.random.default_rng(0).standard_normal(n.type.shape).astype(np.float32)
             for n in g.inputs if not n.type.dtype.startswith("int")}
    feeds.update({n.name: np.zeros(n.type.shape, np.int64) for n in g.inputs if n.type.dtype.startswith("int")})
    want = rt.reference(g, feeds)
    got = cg.run(feeds)
    for k in g.outputs:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want[k]).max())))


def test_exact_selector_without_scipy_says_how_to_get_it(monkeypatch) -> None:
    import builtins
    real = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    g = rt.Graph()
    g.save(g.unary(g.input("x", [4, 4]), "relu"), name="y")
    with pytest.raises(rt.PlanError, match="pip install scipy"):
        rt.compileGraph(g, device="cpu:2", selector="exact")

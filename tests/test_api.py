"""The public API around a compilation: the paper's load / execute / offload spelling, typed options
shared with the command line, the target resolved once, and the public accessors bench uses."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.cli.main import build_parser
from relational_tensors.driver.options import CompileOptions


def _graph() -> tuple[rt.Graph, rt.Tensor, rt.Tensor, rt.Tensor]:
    g = rt.Graph()
    x = g.input("x", [10, 6])
    w = g.parameter("w", [6, 7])
    y = g.unary(g.matmul(x, w), "relu")
    g.save(y, name="y")
    return g, x, w, y


def test_load_execute_offload_by_handle_and_by_name() -> None:
    g, x, w, y = _graph()
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((10, 6)).astype(np.float32), rng.standard_normal((6, 7)).astype(np.float32)
    cg = rt.compileGraph(g, device="cpu:3")
    cg.load(x, xv)
    cg.load("w", wv)
    cg.execute()
    want = rt.reference(g, {"x": xv, "w": wv})["y"]
    np.testing.assert_allclose(cg.offload(y), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cg.offload("y"), want, rtol=1e-5, atol=1e-6)
    cg.load(x, 2 * xv)  # only the input that changes; the weight stays loaded
    cg.execute()
    np.testing.assert_allclose(cg.offload(y), rt.reference(g, {"x": 2 * xv, "w": wv})["y"], rtol=1e-5, atol=1e-6)


def test_load_and_offload_refuse_what_is_not_this_graphs() -> None:
    g, x, _, _ = _graph()
    other, ox, _, oy = _graph()
    cg = rt.compileGraph(g, device="cpu:2")
    with pytest.raises(rt.GraphError, match="tensor of another graph"):
        cg.load(ox, np.zeros((10, 6), np.float32))
    with pytest.raises(rt.GraphError, match="must be a tensor of the graph or its name"):
        cg.offload(3)  # type: ignore[arg-type]
    with pytest.raises(rt.GraphError, match="a dict and an array"):
        cg.load({"x": np.zeros((10, 6), np.float32)}, np.zeros(3))


def test_options_are_validated_once_and_shared_with_the_cli() -> None:
    with pytest.raises(rt.PlanError, match="unknown selector 'best'; choose one of"):
        CompileOptions(selector="best")
    with pytest.raises(rt.PlanError, match="search_budget_s must be a positive number"):
        CompileOptions(search_budget_s=float("nan"))
    parser = build_parser()
    plan = parser._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    by_flag = {a.dest: a for a in plan._actions}
    for flag, option in (("selector", "selector"), ("cost_model", "cost_model"), ("schedule", "schedule_mode"),
                         ("tactic", "tactic"), ("attention", "attention")):
        assert tuple(by_flag[flag].choices) == CompileOptions.choices(option)
        assert by_flag[flag].default == CompileOptions.default(option)


def test_one_target_per_compilation() -> None:
    g, *_ = _graph()
    cg = rt.compileGraph(g, device="cpu:4", topology="dgx-a100", cost_model="calibrated")
    assert cg.target.p == 4 and cg.target.topology.sites == (0, 1, 2, 3)
    assert cg.simulation() is cg.simulation()  # the compiled-for target, simulated once
    assert cg.simulate() == cg.simulation().time > 0
    assert cg.simulation("dgx-v100").topology.startswith("dgx-v100")
    assert [name for name, _, _ in rt.driver.compiler.PASSES] == [
        "target", "candidates", "pieces", "catalog", "select", "check", "lower", "search", "liveness",
        "fit_memory", "verify", "record"]


def test_inputs_loaded_one_at_a_time_must_all_be_there_by_execute() -> None:
    g, x, _, _ = _graph()
    cg = rt.compileGraph(g, device="cpu:2")
    cg.load(x, np.zeros((10, 6), np.float32))
    with pytest.raises(rt.ExecError, match=r"inputs \['w'\] have no value yet"):
        cg.execute()

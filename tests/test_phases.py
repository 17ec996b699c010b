"""Programs run in two phases: a forward whose activations stay on the devices, then its backward.

``second_phase_inputs`` splits a program's tasks: ``execute(phase=0)`` runs those that need none of
those inputs, ``execute(phase=1)`` the rest once they are loaded.  Checked against the single-device
reference, and through ``rt.parallelize``'s backward against torch autograd.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt


def _mlp_with_vjp(n: int, d: int, h: int) -> tuple[rt.Graph, list[str]]:
    g = rt.Graph()
    x, w1, w2 = g.input("x", [n, d], "float64"), g.parameter("w1", [d, h], "float64"), g.parameter("w2", [h, 5],
                                                                                                    "float64")
    y = g.save(g.matmul(g.unary(g.matmul(x, w1), "gelu"), w2), name="y")
    cot = g.input("cot", [n, 5], "float64")
    grads = g.vjp([y], [cot], [x, w1, w2])
    names = []
    for t, d_ in zip(("x", "w1", "w2"), grads):
        g.save(d_, name=f"grad.{t}")
        names.append(f"grad.{t}")
    return g, names


def _feeds(g: rt.Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n.name: rng.standard_normal(n.type.shape) for n in g.inputs}


@pytest.mark.parametrize("p", [1, 3, 4])
def test_a_forward_then_its_backward_equal_the_reference_and_the_backward_recomputes_nothing(p: int) -> None:
    g, grads = _mlp_with_vjp(10, 7, 9)
    feeds = _feeds(g, p)
    cg = rt.compileGraph(g, device=f"cpu:{p}", second_phase_inputs=["cot"])
    split = cg.dag.phase_split
    assert split is not None and 0 < split < len(cg.dag.tasks)
    forward_ops = {n.id for n in g.operators if not n.name.startswith("grad.")}
    assert all(t.op not in forward_ops for t in cg.dag.tasks[split:] if t.kind == "kernel")
    want = rt.reference(g, feeds)
    cg.load({k: v for k, v in feeds.items() if k != "cot"})  # the cotangent is not needed yet
    cg.execute(phase=0)
    np.testing.assert_allclose(cg.offload("y"), want["y"], rtol=1e-12)
    with pytest.raises(rt.ExecError, match="stale|execute"):
        cg.offload("grad.w1")
    for seed in (0, 1):  # a backward consumes what its forward left: another needs the forward again
        cot = np.random.default_rng(seed).standard_normal((10, 5))
        cg.load({"cot": cot})
        if seed:
            with pytest.raises(rt.ExecError, match="execute\\(phase=0\\) first"):
                cg.execute(phase=1)
            cg.execute(phase=0)
        cg.execute(phase=1)
        expect = rt.reference(g, {**feeds, "cot": cot})
        for name in grads:
            np.testing.assert_allclose(cg.offload(name), expect[name], rtol=1e-10, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(cg.offload("y"), want["y"], rtol=1e-12)
    cg.execute()  # a whole run still works
    np.testing.assert_allclose(cg.offload("grad.w2"), rt.reference(g, {**feeds, "cot": cot})["grad.w2"], rtol=1e-10)


def test_phase_misuse_is_refused() -> None:
    g, _ = _mlp_with_vjp(6, 4, 5)
    feeds = _feeds(g, 0)
    cg = rt.compileGraph(g, device="cpu:2", second_phase_inputs="cot")
    cg.load({k: v for k, v in feeds.items() if k != "cot"})
    with pytest.raises(rt.ExecError, match="phase=0 first|execute\\(phase=0\\)"):
        cg.execute(phase=1)
    cg.execute(phase=0)
    with pytest.raises(rt.ExecError, match="no value|load"):
        cg.execute(phase=1)  # the cotangent was never loaded
    cg.load({"cot": feeds["cot"]})
    cg.load({"x": feeds["x"]})  # a new first-phase input: the first phase must run again
    with pytest.raises(rt.ExecError, match="execute\\(phase=0\\)"):
        cg.execute(phase=1)
    with pytest.raises(rt.ExecError, match="phase must be"):
        cg.execute(phase=2)
    whole = rt.compileGraph(g, device="cpu:2")
    whole.load(feeds)
    with pytest.raises(rt.ExecError, match="second_phase_inputs"):
        whole.execute(phase=0)
    with pytest.raises(rt.GraphError, match="second_phase_inputs"):
        rt.compileGraph(g, device="cpu:2", second_phase_inputs=["nope"])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 13), d=st.integers(1, 8), h=st.integers(1, 9), p=st.integers(1, 5))
def test_any_shape_and_device_count_runs_its_phases_like_the_reference(n: int, d: int, h: int, p: int) -> None:
    g, grads = _mlp_with_vjp(n, d, h)
    feeds = _feeds(g, n + d)
    cg = rt.compileGraph(g, device=f"cpu:{p}", second_phase_inputs=["cot"])
    cg.load(feeds)
    cg.execute(phase=0)
    cg.execute(phase=1)
    want = rt.reference(g, feeds)
    for name in ["y", *grads]:
        np.testing.assert_allclose(cg.offload(name), want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_a_parallelized_module_called_twice_before_one_backward_equals_torch() -> None:
    """The second call's forward holds the devices when the first call's gradient is wanted: that
    backward runs its forward phase again from its saved inputs."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).double()
    twin = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).double()
    twin.load_state_dict(m.state_dict())
    x1, x2 = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    pm = rt.parallelize(m, (x1,), device="cpu:3")
    (pm(x1).square().sum() + 3 * pm(x2).sin().sum()).backward()
    x2t = x2.detach().clone().requires_grad_(True)
    (twin(x1).square().sum() + 3 * twin(x2t).sin().sum()).backward()
    for (k, p), q in zip(m.named_parameters(), twin.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(x2.grad.numpy(), x2t.grad.numpy(), rtol=1e-10, atol=1e-12)

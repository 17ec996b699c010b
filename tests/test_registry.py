"""The operator registry is the single source: every kind has a NumPy kernel, a GPU launcher, a cost
family and an entry in the operator test cases, and the check says which part is missing."""

from __future__ import annotations

import pytest
from cases import CASES, GRAD_CASES

import relational_tensors as rt
from relational_tensors.driver.registry import describe, operator_table, problems
from relational_tensors.kernels import launchers
from relational_tensors.sql_specs import OPERATORS

ALL_CASES = {**CASES, **{f"grad of {name}": make for name, make in GRAD_CASES.items()}}


def case_kinds(cases: dict = ALL_CASES) -> set[str]:
    """The operator kinds the forward and gradient test cases exercise (each case built in float32)."""
    kinds = set()
    for make in cases.values():
        g, name = make("float32")
        kinds |= {n.kind for n in g.operators}
    return kinds


def test_every_operator_is_complete() -> None:
    assert problems(case_kinds()) == []


def test_a_missing_launcher_is_named(monkeypatch) -> None:
    monkeypatch.delitem(launchers.LAUNCHERS, "rope")
    found = problems(case_kinds())
    assert len(found) == 1 and "'rope' has no GPU launcher" in found[0]
    with pytest.raises(rt.ExecError, match="operator kind 'rope' has no GPU launcher"):
        launchers.launcher_for("rope")


def test_a_missing_numpy_kernel_is_named(monkeypatch) -> None:
    from relational_tensors.sql_specs.base import Operator

    monkeypatch.setattr(OPERATORS["swiglu"], "kernel", Operator.kernel)
    found = problems(case_kinds())
    assert len(found) == 1 and "'swiglu'" in found[0] and "no NumPy kernel" in found[0]


def test_a_missing_test_case_is_named(monkeypatch) -> None:
    # (put_rows' cases go too: its gradient reads rows with an embedding lookup)
    cases = {name: make for name, make in ALL_CASES.items() if "embedding" not in name and "put_rows" not in name}
    found = problems(case_kinds(cases))
    assert found == [f"operator {kind!r} has no entry in the operator test cases (tests/cases.py)."
                     for kind in ("embedding", "embedding_grad", "put_rows")]


def test_an_unknown_cost_family_is_named(monkeypatch) -> None:
    monkeypatch.setattr(OPERATORS["softmax"], "cost_family", "vector")
    found = problems(case_kinds())
    assert len(found) == 1 and "'softmax' declares cost family 'vector'" in found[0]


def test_a_second_launcher_for_a_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        launchers.launcher("matmul")(lambda *args: None)


def test_the_registry_is_printable_and_a_catalog_table() -> None:
    text = describe()
    assert all(kind in text for kind in OPERATORS)
    assert operator_table().column("kind").to_pylist() == list(OPERATORS)
    g = rt.Graph()
    g.save(g.unary(g.input("x", [4, 4]), "relu"), name="y")
    cg = rt.compileGraph(g, device="cpu:2")
    rows = cg.sql("SELECT kind, cost_family, gpu_allocates FROM operator_kinds ORDER BY kind").to_pylist()
    assert {r["kind"] for r in rows} == set(OPERATORS)
    assert {"kind": "matmul", "cost_family": "matmul", "gpu_allocates": False} in rows
    assert {"kind": "einsum", "cost_family": "matmul", "gpu_allocates": None} in rows  # GEMM-shaped or not
    assert {"kind": "sql", "cost_family": "matmul", "gpu_allocates": True} in rows

"""The operator registry as one table: each operator kind with what it declares and what implements it.

The operators (``sql_specs.OPERATORS``) declare their indices, ⊕, spec builder, FLOPs, NumPy kernel and
cost family; the GPU backend registers a launcher per kind (``kernels.launchers.LAUNCHERS``), which says
whether its kernels allocate.  :func:`problems` lists every kind that lacks a part, and
:func:`operator_table` is what the catalog's ``operator_kinds`` table holds.

>>> problems()
[]
>>> print(describe().splitlines()[0][:101])
kind                 class                ⊕          cost family  GPU launcher  GPU allocates  gradie
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pyarrow as pa

from relational_tensors.kernels.launchers import LAUNCHERS, Launcher
from relational_tensors.machine.kernel_model import COST_FAMILIES
from relational_tensors.sql_specs import OPERATORS
from relational_tensors.sql_specs.base import Operator

__all__ = ["operator_rows", "operator_table", "describe", "problems"]


def operator_rows(operators: Mapping[str, type[Operator]] | None = None,
                  launchers: Mapping[str, Launcher] | None = None) -> list[dict[str, object]]:
    """One row per registered operator kind, in registration order."""
    operators = OPERATORS if operators is None else operators
    launchers = LAUNCHERS if launchers is None else launchers
    return [dict(kind=kind, op_class=cls.__name__, module=cls.__module__, aggregation=_aggregation(cls),
                 cost_family=cls.cost_family, numpy_kernel=cls.kernel is not Operator.kernel,
                 gpu_launcher=kind in launchers, gpu_allocates=_allocates(launchers.get(kind)), gradient=cls.gradient,
                 gpu_form=launchers[kind].gpu_form if kind in launchers else "none")
            for kind, cls in operators.items()]


def _allocates(found: Launcher | None) -> bool | None:
    """Whether a kind's GPU kernel allocates; None where each operator's parameters decide (or no launcher)."""
    return None if found is None or callable(found.allocates) else bool(found.allocates)


def _aggregation(cls: type[Operator]) -> str:
    """The ⊕ a kind declares: its name, or ``per op`` where each operator's parameters choose it."""
    agg = next(k.__dict__["aggregation"] for k in cls.__mro__ if "aggregation" in k.__dict__)
    return "per op" if isinstance(agg, property) else str(agg.name)


def operator_table() -> pa.Table:
    """The registry as an Arrow table (the catalog's ``operator_kinds``)."""
    rows = operator_rows()
    return pa.table({k: [r[k] for r in rows] for k in rows[0]})


def describe() -> str:
    """The registry as plain text, one kind a line."""
    head = ("kind", "class", "⊕", "cost family", "GPU launcher", "GPU allocates", "gradient", "on GPUs")
    lines = [(r["kind"], r["op_class"], r["aggregation"], r["cost_family"], "yes" if r["gpu_launcher"] else "NO",
              {True: "yes", False: "no", None: "per op"}[r["gpu_allocates"]], r["gradient"],  # type: ignore[index]
              r["gpu_form"]) for r in operator_rows()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *lines))


def problems(case_kinds: Iterable[str] | None = None, operators: Mapping[str, type[Operator]] | None = None,
             launchers: Mapping[str, Launcher] | None = None) -> list[str]:
    """What each operator kind lacks: a NumPy kernel, a GPU launcher, a known cost family, or (when
    ``case_kinds`` is given: the kinds the operator test cases exercise) a test case."""
    found = []
    covered = None if case_kinds is None else set(case_kinds)
    for row in operator_rows(operators, launchers):
        kind = row["kind"]
        if not row["numpy_kernel"]:
            found.append(f"operator {kind!r} ({row['module']}) has no NumPy kernel: define kernel().")
        if not row["gpu_launcher"]:
            found.append(f"operator {kind!r} has no GPU launcher: register one with @launcher({kind!r}) in "
                         "relational_tensors/kernels/launchers.py.")
        elif row["gpu_form"] != "kernel" and str(row["gpu_form"]).endswith((": ", "except ")):
            found.append(f"operator {kind!r} has a GPU launcher that may allocate without saying which forms do: "
                         "pass host_forms= to @launcher.")
        if row["cost_family"] not in COST_FAMILIES:
            found.append(f"operator {kind!r} declares cost family {row['cost_family']!r}; choose one of "
                         f"{COST_FAMILIES}.")
        if covered is not None and kind not in covered:
            found.append(f"operator {kind!r} has no entry in the operator test cases (tests/cases.py).")
    return found

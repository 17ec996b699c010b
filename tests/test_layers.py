"""The package's layering, read from its source: no import cycles, each layer imports only the layers
below it, no module past one clear purpose (800 lines), and a root that only re-exports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "relational_tensors"
ROOT = "relational_tensors"

# the layers a package may not import (module-level imports): the planners sit below the physical plan
FORBIDDEN = {
    "core": ("catalog", "target", "sql_specs", "frontend", "exchange", "dp_optimizer", "physical", "gpu_exec"),
    "catalog": ("target", "sql_specs", "frontend", "exchange", "dp_optimizer", "physical", "gpu_exec"),
    "target": ("catalog", "sql_specs", "frontend", "exchange", "dp_optimizer", "physical", "gpu_exec"),
    "sql_specs": ("catalog", "target", "frontend", "exchange", "dp_optimizer", "physical", "gpu_exec"),
    "frontend": ("catalog", "target", "exchange", "dp_optimizer", "physical", "gpu_exec"),
    "exchange": ("catalog", "sql_specs", "frontend", "dp_optimizer", "physical", "gpu_exec"),
    "dp_optimizer": ("exchange", "physical", "gpu_exec"),
    "physical": ("gpu_exec",),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of the package imported at module level (``from x import y`` counts x, and x.y where
    that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(ROOT)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT):
            found.add(node.module)
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                        (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists():
                    found.add(sub)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level (a package's __init__ counts as it)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules} for m, p in modules.items()}
    # importing a.b.c runs a/__init__ and a/b/__init__ first
    for m in graph:
        graph[m] |= {".".join(i.split(".")[:k]) for i in set(graph[m]) for k in range(2, len(i.split(".")))
                     if ".".join(i.split(".")[:k]) in modules and not m.startswith(".".join(i.split(".")[:k]))}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        parts = m.split(".")
        layer = parts[1] if len(parts) > 1 else None
        for d in sorted(deps):
            dparts = d.split(".")
            if layer in FORBIDDEN and len(dparts) > 1 and dparts[1] in FORBIDDEN[layer]:
                bad.append(f"{m} imports {d}")
            if len(dparts) == 1 and m != ROOT:
                bad.append(f"{m} imports the package root")
    return bad


def test_no_import_cycles() -> None:
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()) or [])}"


def test_layers_import_only_below() -> None:
    assert layer_violations(import_graph()) == []


def test_the_checks_catch_what_they_promise() -> None:
    graph = {"relational_tensors.a": {"relational_tensors.b"}, "relational_tensors.b": {"relational_tensors.a"}}
    assert find_cycle(graph) == ["relational_tensors.a", "relational_tensors.b", "relational_tensors.a"]
    bad = {"relational_tensors.dp_optimizer.costs": {"relational_tensors.exchange.search"},
           "relational_tensors.dp_optimizer.plan": {"relational_tensors.physical.lower"},
           "relational_tensors.frontend.graph": {"relational_tensors"}}
    assert len(layer_violations(bad)) == 3


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= 800, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by purpose (at most 800)."


def test_root_only_reexports() -> None:
    text = (PACKAGE / "__init__.py").read_text()
    assert "noqa" not in text
    tree = ast.parse(text)
    for node in tree.body:
        assert isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AugAssign, ast.Expr)), ast.dump(node)

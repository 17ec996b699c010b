"""The package's layering, read from its source and from the layer table of docs/architecture.md: no
import cycles between modules, each room imports only the rooms above it in the table, function-local
imports counted (imports under ``if TYPE_CHECKING:`` exempt), no module past one clear purpose (800
lines), and a root that only re-exports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "relational_tensors"
ROOT = "relational_tensors"
TABLE = PACKAGE.parent / "docs" / "architecture.md"


def layer_table(text: str | None = None) -> dict[str, int]:
    """Room (a folder of the package, or a root module's name) -> its row in the layer table."""
    text = TABLE.read_text() if text is None else text
    rows = re.findall(r"^\| *(\d+) *\| *(.+?) *\|", text, re.M)
    return {room: int(n) for n, rooms in rows for room in re.findall(r"`([\w.]+)`", rooms)}


def room(module: str) -> str:
    """The room of a module: its folder under the package, or the root module's own name."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Modules of the package that ``path`` imports anywhere (module level or inside functions; ``from x
    import y`` counts x, and x.y where that is a module; relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == ROOT}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != ROOT:
                continue
            found.add(base)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                        (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists():
                    found.add(sub)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's __init__ counts as it)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}
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


def layer_violations(graph: dict[str, set[str]], table: dict[str, int] | None = None) -> list[str]:
    """Imports against the layer table: into a room on a lower row, or of or from a room it lacks."""
    table = layer_table() if table is None else table
    bad = []
    for m, deps in sorted(graph.items()):
        if room(m) not in table:
            bad.append(f"{m} is in room {room(m)!r}, which the layer table does not list")
            continue
        for d in sorted(deps):
            if room(d) not in table:
                bad.append(f"{m} imports {d}, in room {room(d)!r}, which the layer table does not list")
            elif room(d) != room(m) and table[room(d)] >= table[room(m)]:
                bad.append(f"{m} (row {table[room(m)]}, {room(m)}) imports {d} (row {table[room(d)]}, {room(d)})")
    return bad


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_rooms_import_only_the_rows_above() -> None:
    assert layer_violations(import_graph()) == []


def test_every_room_has_a_row() -> None:
    rooms = {room(_module(p)) for p in PACKAGE.rglob("*.py")}
    assert sorted(rooms - set(layer_table())) == []
    assert sorted(set(layer_table()) - rooms) == [], "the table lists rooms the package does not have"


def test_no_folder_is_named_like_build_output() -> None:
    folders = {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    assert not folders & {"target", "build", "dist", "out"}


def test_the_checks_catch_what_they_promise(tmp_path: Path) -> None:
    graph = {"relational_tensors.a": {"relational_tensors.b"}, "relational_tensors.b": {"relational_tensors.a"}}
    assert find_cycle(graph) == ["relational_tensors.a", "relational_tensors.b", "relational_tensors.a"]
    table = layer_table("| 1 | `core` | x |\n| 2 | `graph`, `zoo` | y |\n| 3 | `runtime` | z |\n")
    assert table == {"core": 1, "graph": 2, "zoo": 2, "runtime": 3}
    bad = {"relational_tensors.core.types": {"relational_tensors.graph.graph"},      # upward
           "relational_tensors.graph.graph": {"relational_tensors.zoo.x"},            # a peer on its row
           "relational_tensors.runtime.a": {"relational_tensors.core.types", "relational_tensors.runtime.b"},
           "relational_tensors.nowhere.a": set()}
    assert len(layer_violations(bad, table)) == 3
    # a planted upward import inside a function, and one under TYPE_CHECKING (exempt)
    planted = tmp_path / "m.py"
    planted.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    import relational_tensors.api.training\n"
                       "def f():\n    from relational_tensors.driver import compiler\n    return compiler\n")
    found = _imports(planted, "relational_tensors.core.m")
    assert "relational_tensors.driver.compiler" in found and "relational_tensors.api.training" not in found
    assert layer_violations({"relational_tensors.core.m": found}) != []


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

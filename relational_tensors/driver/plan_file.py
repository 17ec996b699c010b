"""Compiled plans saved to a file and loaded again without planning.

``rt.save_plan(cg, path)`` writes the compiled program (the logical plan, the lowered task DAG with its exchange
programs, the liveness and memory plan, the options) and the compilation's catalog rows;
``rt.load_plan(path, graph)`` rebuilds the :class:`~relational_tensors.driver.compiler.CompiledGraph` for
``graph`` (the graph object the caller holds, so its tensor handles work) after checking that the
graph's fingerprint is the one the plan was made for, and restores the rows into a catalog (in memory
by default), so ``cg.sql`` and the named queries explain the loaded plan as they did the original.

The file is a short header (a magic line and one JSON line: format, package version, graph
fingerprint, device) followed by a pickle of the program.  The header is checked before anything is
unpickled; like any pickle, load only plan files you trust (your own).

>>> import os, tempfile, numpy as np, relational_tensors as rt
>>> g = rt.Graph(); a = g.input("a", [8, 8]); _ = g.save(g.matmul(a, a), name="c")
>>> path = os.path.join(tempfile.mkdtemp(), "mm.plan")
>>> cg = rt.compileGraph(g, device="cpu:4"); rt.save_plan(cg, path)
>>> again = rt.load_plan(path, g)
>>> out = again.run({"a": np.eye(8, dtype=np.float32)})["c"]
>>> again.plan.split("matmul_1") == cg.plan.split("matmul_1"), float(out.trace())
(True, 8.0)
"""

from __future__ import annotations

import datetime
import gc
import io
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relational_tensors.catalog import Catalog
from relational_tensors.errors import CatalogError, GraphError, PlanError
from relational_tensors.graph.graph import Graph, Node

if TYPE_CHECKING:
    from relational_tensors.driver.compiler import CompiledGraph

__all__ = ["save_plan", "load_plan", "dumps", "loads", "FORMAT"]

MAGIC = b"relational_tensors plan\n"
FORMAT = 2  # the layout of a plan file (header fields, pickled members); a new layout is a new number
# remade on load, or empty (nothing is loaded into a loaded plan)
_SKIP = ("_catalog", "_compilation_id", "_restore", "_executor", "ranks", "_simulations", "_states")


_SLOTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _slots(cls: type) -> tuple[tuple[str, Any], ...]:
    """Every slot of a slotted class, its bases' first (the fields of a ``slots=True`` dataclass), with
    the slot's own setter (a frozen dataclass's ``__setattr__`` refuses; its slots do not)."""
    found = _SLOTS.get(cls)
    if found is None:
        out: list[tuple[str, Any]] = []
        for klass in reversed(cls.__mro__):
            own = klass.__dict__.get("__slots__", ())
            for name in [own] if isinstance(own, str) else own:
                if not name.startswith("__"):
                    out.append((name, klass.__dict__[name].__set__))
        found = _SLOTS[cls] = tuple(out)
    return found


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    obj: Any = object.__new__(cls)
    for (_, setter), value in zip(_slots(cls), values):
        setter(obj, value)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles a compiled graph's members, leaving out its graph and its nodes (the caller's graph takes
    their place).

    Slotted dataclasses (boxes, intervals, function specs, tasks: most of a program) are pickled as
    their slot values and rebuilt by setting them, which loads several times faster than the
    dataclass's own ``__setstate__``."""

    def __init__(self, file: Any, graph: Graph) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.graph = graph

    def persistent_id(self, obj: Any) -> Any:
        if obj is self.graph:
            return "graph"
        if type(obj) is Node and obj.id < len(self.graph.nodes) and self.graph.nodes[obj.id] is obj:
            return ("node", obj.id)  # the task DAG's operator table: the caller's graph's own nodes
        return None

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if "__dataclass_fields__" in cls.__dict__ and "__slots__" in cls.__dict__:
            return _rebuild, (cls, tuple(getattr(obj, n) for n, _ in _slots(cls)))
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, graph: Graph) -> None:
        super().__init__(file)
        self.graph = graph

    def persistent_load(self, pid: Any) -> Any:
        if pid == "graph":
            return self.graph
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "node" and 0 <= pid[1] < len(self.graph.nodes):
            return self.graph.nodes[pid[1]]
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def _catalog_rows(cg: CompiledGraph) -> tuple[dict[str, Any], dict[str, Any]]:
    """The compilation's row of ``compilations`` and its rows of every other table, as Arrow tables."""
    cat, cid = cg.catalog, cg.compilation_id
    (row,) = cat.sql("SELECT * EXCLUDE (compilation_id, created) FROM compilations WHERE compilation_id = ?",
                     [cid]).to_pylist()
    tables = {}
    from relational_tensors.catalog.catalog import _memory

    for name, columns in _memory().schema.tables.items():
        if name == "compilations" or "compilation_id" not in {c.name for c in columns}:
            continue
        rows = cat.sql(f"SELECT * EXCLUDE (compilation_id) FROM {name} WHERE compilation_id = ?", [cid])
        if rows.num_rows:
            tables[name] = rows
    return row, tables


def dumps(cg: CompiledGraph) -> bytes:
    """``cg``'s program and catalog rows as the bytes of a plan file (see the module's docstring)."""
    from relational_tensors._version import __version__

    members = {k: v for k, v in vars(cg).items() if k not in _SKIP}
    row, tables = _catalog_rows(cg)
    header = {"format": FORMAT, "package": __version__, "fingerprint": cg.graph.fingerprint(),
              "device": str(cg.devices), "saved": datetime.datetime.now().isoformat(timespec="seconds")}
    buf = io.BytesIO()
    buf.write(MAGIC + json.dumps(header).encode() + b"\n")
    collecting = gc.isenabled()
    gc.disable()
    try:
        _Pickler(buf, cg.graph).dump({"members": members, "compilation": row, "tables": tables})
    finally:
        if collecting:
            gc.enable()
    return buf.getvalue()


def save_plan(cg: CompiledGraph, path: str | Path) -> None:
    """Write ``cg``'s program and catalog rows to ``path``."""
    data = dumps(cg)
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise PlanError(f"cannot write the plan to {str(path)!r}: {e.strerror or e}. Give a writable path.") from None


def _header(data: bytes, where: str) -> tuple[dict[str, Any], int]:
    """The checked header of a plan's bytes, and where its body starts (a file that is not a plan is refused)."""
    if not data.startswith(MAGIC):
        raise PlanError(f"{where} is not a relational_tensors plan file (it does not start with the plan "
                        "header); write one with rt.save_plan(cg, path).")
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC):end if end >= 0 else len(data)])
    except ValueError:
        raise PlanError(f"the plan file {where} has a damaged header; save the plan again.") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else "?"
        raise PlanError(f"the plan file {where} has format {found}; this package reads format {FORMAT}. "
                        "Plan the graph again and save it.")
    return header, end + 1


def loads(data: bytes, graph: Graph, catalog: str | Path | Catalog | None = None, where: str = "the plan"
          ) -> CompiledGraph:
    """The compiled plan in ``data`` (a plan file's bytes), for ``graph`` (which must be the graph it was
    planned for: equal fingerprints), without planning again; its catalog rows go into ``catalog``
    (default: a new in-memory catalog) as a new compilation when the plan is first explained."""
    from relational_tensors._version import __version__
    from relational_tensors.driver.compiled import CompiledGraph
    from relational_tensors.machine.devices import visible_gpus

    if not isinstance(graph, Graph):
        raise GraphError(f"load_plan needs the rt.Graph the plan was made for; got {type(graph).__name__}.")
    header, start = _header(data, where)
    if header.get("package") != __version__:
        raise PlanError(f"{where} was saved by relational_tensors {header.get('package')}; this is "
                        f"{__version__}, whose programs may differ. Plan the graph again and save it.")
    if header.get("fingerprint") != graph.fingerprint():
        raise PlanError(f"{where} was made for another graph (fingerprint "
                        f"{str(header.get('fingerprint'))[:12]}…, this graph's is {graph.fingerprint()[:12]}…): "
                        "a changed name, shape, dtype or operator changes it. Plan this graph with compileGraph.")
    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of small acyclic objects: the cyclic collector would only rescan them
    try:
        saved = _Unpickler(io.BytesIO(memoryview(data)[start:]), graph).load()
    except Exception as e:  # a truncated or damaged body
        raise PlanError(f"the plan file {where} is damaged ({type(e).__name__}); save the plan again.") from None
    finally:
        if collecting:
            gc.enable()
    if isinstance(catalog, Catalog) and catalog.read_only:
        raise CatalogError("load_plan writes the plan's rows into its catalog; give one opened for writing.")

    def restore() -> tuple[Catalog, int]:  # the rows go in when the plan is first explained (cg.catalog)
        cat = catalog if isinstance(catalog, Catalog) else Catalog(catalog)
        cid = cat.new_compilation(**saved["compilation"])
        for name, rows in saved["tables"].items():
            cat.insert(name, rows, cid)
        return cat, cid

    cg = CompiledGraph.__new__(CompiledGraph)
    vars(cg).update(saved["members"])
    cg._compilation_id, cg._restore = -1, restore  # cg.catalog puts the rows in
    cg._executor, cg.ranks, cg._simulations, cg._states = None, None, {}, {}
    if cg.devices.kind == "cuda" and visible_gpus() > max(cg.devices.physical):
        _ = cg.executor  # as compileGraph does: streams and arenas set up (and checked) before the first run
    return cg


def load_plan(path: str | Path, graph: Graph, catalog: str | Path | Catalog | None = None) -> CompiledGraph:
    """The compiled plan saved at ``path``, for ``graph`` (see :func:`loads`)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PlanError(f"cannot read the plan file {str(path)!r}: {e.strerror or e}.") from None
    return loads(data, graph, catalog, where=repr(str(path)))

"""Compiled plans saved to a file and loaded again without planning.

``rt.save_plan(cg, path)`` writes the compiled program (the logical plan, the lowered task DAG with its exchange
programs, the liveness and memory plan, the options) and the compilation's catalog rows;
``rt.load_plan(path, graph)`` rebuilds the :class:`~relational_tensors.driver.compiler.CompiledGraph` for
``graph`` (the graph object the caller holds, so its tensor handles work) after checking that the
graph's fingerprint is the one the plan was made for, and restores the rows into a catalog (in memory
by default), so ``cg.sql`` and the named queries explain the loaded plan as they did the original.

The file is a magic line, one JSON header line (format, package version, graph fingerprint, device, the
body's length and its SHA-256) and the body: the program as one JSON document and its binary blobs
(arrays as ``.npy``, catalog rows as Arrow IPC; ``driver.plan_codec``), each framed by its length.  The
checksum covers the header's fields and the whole body, so a damaged, truncated or edited file is
refused before anything is decoded; a file for another graph or another package version is refused
naming what differs; decoding never runs code from the file.  A save writes a temporary file beside the
target and renames it, so an interrupted save leaves the previous file as it was.

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

import contextlib
import datetime
import gc
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relational_tensors.catalog import Catalog
from relational_tensors.driver.plan_codec import decode, encode
from relational_tensors.errors import CatalogError, GraphError, PlanError
from relational_tensors.graph.graph import Graph

if TYPE_CHECKING:
    from relational_tensors.driver.compiler import CompiledGraph

__all__ = ["save_plan", "load_plan", "dumps", "loads", "FORMAT"]

MAGIC = b"relational_tensors plan\n"
FORMAT = 3  # the layout of a plan file (header fields, the encoded body); a new layout is a new number
# remade on load, or empty (nothing is loaded into a loaded plan)
_SKIP = ("_catalog", "_compilation_id", "_restore", "_executor", "ranks", "_simulations", "_states")


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


def _digest(header: dict[str, Any], body: bytes | memoryview) -> str:
    """SHA-256 of the header's fields (all but the digest itself, in a fixed order) and the body."""
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    h.update(body)
    return h.hexdigest()


def _frame(parts: list[bytes]) -> bytes:
    """``parts`` each preceded by its length (8 bytes, little-endian), after their count."""
    return struct.pack("<Q", len(parts)) + b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unframe(body: memoryview) -> list[bytes]:
    (count,), at = struct.unpack_from("<Q", body, 0), 8
    if count > len(body) // 8:
        raise PlanError("holds more parts than it has bytes")
    parts = []
    for _ in range(count):
        (size,) = struct.unpack_from("<Q", body, at)
        at += 8
        if at + size > len(body):
            raise PlanError("ends inside a part")
        parts.append(bytes(body[at:at + size]))
        at += size
    if at != len(body):
        raise PlanError("has bytes after its last part")
    return parts


def dumps(cg: CompiledGraph) -> bytes:
    """``cg``'s program and catalog rows as the bytes of a plan file (see the module's docstring)."""
    from relational_tensors._version import __version__

    members = {k: v for k, v in vars(cg).items() if k not in _SKIP}
    row, tables = _catalog_rows(cg)
    collecting = gc.isenabled()
    gc.disable()
    try:
        doc, blobs = encode({"members": members, "compilation": row, "tables": tables}, cg.graph)
    finally:
        if collecting:
            gc.enable()
    body = _frame([doc, *blobs])
    header = {"format": FORMAT, "package": __version__, "fingerprint": cg.graph.fingerprint(),
              "device": str(cg.devices), "saved": datetime.datetime.now().isoformat(timespec="seconds"),
              "body_bytes": len(body)}
    header["sha256"] = _digest(header, body)
    return MAGIC + json.dumps(header).encode() + b"\n" + body


def _write_atomically(path: str | Path, data: bytes, what: str) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``."""
    if not isinstance(path, (str, os.PathLike)):
        raise PlanError(f"a {what} is written to a path (a str or os.PathLike); got {type(path).__name__}.")
    target = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise PlanError(f"cannot write the {what} to {str(path)!r}: {e.strerror or e}. Give a writable path.") \
            from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def save_plan(cg: CompiledGraph, path: str | Path) -> None:
    """Write ``cg``'s program and catalog rows to ``path`` (atomically: see the module's docstring)."""
    from relational_tensors.driver.compiled import CompiledGraph as Compiled

    if not isinstance(cg, Compiled):
        raise PlanError(f"save_plan saves a compiled graph (rt.compileGraph's result); got {type(cg).__name__}.")
    _write_atomically(path, dumps(cg), "plan")


def _header(data: bytes, where: str) -> tuple[dict[str, Any], int]:
    """The checked header of a plan's bytes, and where its body starts (a file that is not a plan is refused)."""
    if not data.startswith(MAGIC):
        raise PlanError(f"{where} is not a relational_tensors plan file (it does not start with the plan "
                        "header); write one with rt.save_plan(cg, path).")
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC):end if end >= 0 else len(data)])
    except (ValueError, RecursionError):  # RecursionError: brackets nested deeper than json decodes
        raise PlanError(f"the plan file {where} has a damaged header; save the plan again.") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else "?"
        raise PlanError(f"the plan file {where} has format {found}; this package reads format {FORMAT}. "
                        "Plan the graph again and save it.")
    body = memoryview(data)[end + 1:] if end >= 0 else memoryview(b"")
    if header.get("body_bytes") != len(body):
        raise PlanError(f"the plan file {where} is truncated or extended: its header says {header.get('body_bytes')} "
                        f"bytes of program, and {len(body)} follow; save the plan again.")
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
    if catalog is not None and not isinstance(catalog, Catalog) and not (
            isinstance(catalog, (str, os.PathLike)) and isinstance(os.fspath(catalog), str) and os.fspath(catalog)):
        raise CatalogError(f"load_plan's catalog is a Catalog, the path of a DuckDB file (str or pathlib.Path), or "
                           f"None for one in memory; got {type(catalog).__name__} {catalog!r}. Give a path such as "
                           "'plans.duckdb', or leave it out.")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanError(f"a plan is read from bytes (a plan file's content); got {type(data).__name__}.")
    data = bytes(data)
    header, start = _header(data, where)
    if header.get("package") != __version__:
        raise PlanError(f"{where} was saved by relational_tensors {header.get('package')}; this is "
                        f"{__version__}, whose programs may differ. Plan the graph again and save it.")
    if header.get("fingerprint") != graph.fingerprint():
        raise PlanError(f"{where} was made for another graph (fingerprint "
                        f"{str(header.get('fingerprint'))[:12]}…, this graph's is {graph.fingerprint()[:12]}…): "
                        "a changed name, shape, dtype or operator changes it. Plan this graph with compileGraph.")
    if not isinstance(header.get("sha256"), str) or _digest(header, memoryview(data)[start:]) != header["sha256"]:
        raise PlanError(f"the plan file {where} is damaged or edited: its checksum does not match its header and "
                        "program; save the plan again.")
    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of small acyclic objects: the cyclic collector would only rescan them
    try:
        doc, *blobs = _unframe(memoryview(data)[start:])
        saved = decode(doc, blobs, graph)
        if not isinstance(saved, dict) or not {"members", "compilation", "tables"} <= set(saved):
            raise PlanError("does not hold a program")
    except PlanError as e:
        raise PlanError(f"the plan file {where} {e}; save the plan again.") from None
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
    if not isinstance(path, (str, os.PathLike)):
        raise PlanError(f"load_plan reads a plan file's path (a str or os.PathLike); got {type(path).__name__}.")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PlanError(f"cannot read the plan file {str(path)!r}: {e.strerror or e}.") from None
    return loads(data, graph, catalog, where=repr(str(path)))

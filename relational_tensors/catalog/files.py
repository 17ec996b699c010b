"""Catalog files: opening them (with errors that say what to do), telling a catalog from a DuckDB file of
the user's own, and bringing a catalog written by an older version up to this one.

The rules, so that nothing the user stored is lost:

* Reading (``read_only``) opens the file read-only and changes nothing in it; the connection is
  sandboxed (``SANDBOX``): it reads no other file and writes none.
* Writing adds the catalog's tables, columns and views only where they are missing, and replaces a
  view only when the catalog wrote it (its comment says so; in files older than catalog versions,
  when its text starts as the catalog's did).  An object of the user's own under one of the
  catalog's names is never replaced: the open is refused, naming it.
* A file with a newer catalog version than this package writes is read, never written.
* Every change happens in one transaction, and a file that is already current is not written.
"""

from __future__ import annotations

import datetime
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from relational_tensors.catalog.memory import PACKAGE, SEQUENCES, SHOWN, VERSION, VIEWS, Schema, views_sql
from relational_tensors.errors import CatalogError

__all__ = ["connect", "prepare", "check_readable", "split_statements", "MIGRATIONS", "SANDBOX", "READS",
           "WRITES"]

# The data steps of each catalog version, run after the missing tables and columns are added.
#   1: compilations.status and error (and catalog_version itself): the finished compilations of older
#      files (those with a plan_cost) are 'ok'; the others never finished (refused, failed or killed)
#      and keep a NULL status, so the persisted views do not show them as plans.
#   2: operator_kinds.gradient (a new column; older rows keep NULL).
#   3: state_layouts, edges.carried and spec_inputs.carried (older rows: false, as they had no states
#      priced across steps).
#   4: the physical plan (placements, exchange_programs, exchange_actions, tasks, edge_traffic,
#      device_memory, task_times, the op_times view) and compilations' topology, schedule_mode,
#      tactic, calibration, keep_states, graph_fingerprint, version, cost_unit, predicted_seconds and
#      peak_bytes (older compilations keep NULL: they were not recorded); a COMMENT ON every table and
#      column (from sql/schema.sql, applied by every migration).
#   6: operator_kinds.gpu_form (a new column; older rows keep NULL).
#   7: compilations.stages, micro_batches and pipeline_schedule, placements.stage and micro_batch (older
#      rows: NULL, as no pipeline was recorded).
#   5: candidate_specs.layout_cost (older rows: 0, as no layout was pinned), layout constraints,
#      compilations.memory_limit (older rows: NULL) and the table macros (sql/macros.sql).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("UPDATE compilations SET status = 'ok' WHERE status IS NULL AND plan_cost IS NOT NULL",),
}
_MARK = "relational_tensors catalog view"  # the comment on each view the catalog writes into a file
# how DuckDB prints the views of files written before catalog versions (every earlier views.sql)
_LEGACY_VIEWS = {
    "plan_inputs": "AS SELECT si.compilation_id, c.op_id, si.input_pos, si.required_tiling, si.producer_op,",
    "plan": "AS SELECT o.compilation_id, o.op_id, o.op_name, o.op_kind, s.split, s.spec_id,",
    "specs": "AS SELECT o.compilation_id, o.op_id, o.op_name, o.op_kind, s.spec_id, s.split, s.intervals,",
}
_WRITE_HINT = "compileGraph(graph, catalog=PATH) or `relational-tensors plan MODEL.py --catalog PATH`"


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# A sandboxed connection reaches its own file and nothing else: no other file is read or written (COPY,
# EXPORT, ATTACH, read_csv, INSTALL), no extension is loaded, and the statements it runs cannot turn that
# back on (lock_configuration).  Set at connect time, which is the only time DuckDB takes them from us.
SANDBOX = {"enable_external_access": False, "autoinstall_known_extensions": False,
           "autoload_known_extensions": False, "lock_configuration": True}
# The kinds of statement (DuckDB's own ``StatementType``, as its parser tells them) that user SQL runs on a
# catalog file: the reads on any connection, the writes on one opened for writing.  Every other kind
# (COPY, EXPORT, ATTACH, DETACH, LOAD, which is INSTALL too, EXTENSION, COPY_DATABASE, or one the duckdb
# module cannot name) reaches other files or databases.  The connection is what guarantees it (read-only,
# SANDBOX); these tables let a command refuse a statement by its kind before any of its script runs.
READS = frozenset({"SELECT", "EXPLAIN", "CALL", "PRAGMA", "PREPARE", "EXECUTE", "TRANSACTION",
                   "SET",     # SET VARIABLE, USE; settings are locked in the sandbox
                   "MULTI"})  # PIVOT: a temporary type, then a SELECT
WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "MERGE_INTO", "CREATE", "CREATE_FUNC", "DROP", "ALTER",
                    "VACUUM", "ANALYZE"})


def split_statements(script: str) -> list[tuple[str, str]]:
    """The statements of an SQL script with their kinds (a ``duckdb.StatementType`` name, or ``"unknown"``
    for a kind newer than the module's enum), as DuckDB splits and parses them; empty ones dropped.

    >>> split_statements("SELECT 1; COPY t TO 'x.csv';")
    [('SELECT 1;', 'SELECT'), ("COPY t TO 'x.csv';", 'COPY')]
    """
    try:
        found = duckdb.extract_statements(script)
    except duckdb.Error as e:
        raise CatalogError(f"the SQL does not parse: {' '.join(str(e).split())}") from None
    out = []
    for st in found:
        query = st.query.strip()
        if not query.rstrip(";").strip():
            continue
        try:
            kind = st.type.name
        except ValueError:  # UPDATE EXTENSIONS in duckdb 2.0
            kind = "unknown"
        out.append((query, kind))
    return out


# DuckDB's file layout (storage/single_file_block_manager.cpp): a main header (checksum, b"DUCK", version,
# flags) and two database headers, FILE_HEADER bytes each, then the blocks.  The database header with the
# higher iteration is the live one; after its checksum it holds iteration, meta_block, free_list,
# block_count and block_alloc_size (0 in old files: the default), all little-endian uint64.
_FILE_HEADER = 4096
_BLOCKS_START = 3 * _FILE_HEADER
_DEFAULT_BLOCK = 262144


def _promised_bytes(path: str) -> int | None:
    """The length the live database header of the DuckDB file ``path`` promises (its blocks' end), or
    None where the file is not one this check reads (too short, no magic, encrypted, an odd header)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_BLOCKS_START)
    except OSError:
        return None
    if len(head) < _BLOCKS_START or head[8:12] != b"DUCK" or struct.unpack_from("<Q", head, 20)[0] != 0:
        return None  # flags[0] != 0: an encrypted file, whose database headers are not plain text
    _, _, _, block_count, block_size = max(struct.unpack_from("<5Q", head, at + 8)
                                                   for at in (_FILE_HEADER, 2 * _FILE_HEADER))
    block_size = block_size or _DEFAULT_BLOCK
    if block_size & (block_size - 1) or not 4096 <= block_size <= 1 << 30 or block_count >= 1 << 40:
        return None
    return _BLOCKS_START + block_count * block_size


def _check_complete(con: duckdb.DuckDBPyConnection, path: str, promised: int, size: int) -> None:
    """Refuse a file cut short: one shorter than its header promises is read whole, table by table.

    A checkpoint may free the blocks at the end of the file and truncate it after writing the header,
    so a shorter file is not damaged by itself; it is when a block a table still uses lies past its
    end, which DuckDB finds only when a query reads it (an open and a count(*) succeed)."""
    try:
        tables = con.execute("SELECT schema_name, table_name FROM duckdb_tables() "
                             "WHERE database_name = current_database() AND NOT internal").fetchall()
        for schema, table in tables:
            con.execute(f'SELECT max(hash(t)) FROM "{schema}"."{table}" AS t').fetchall()  # every column read
    except duckdb.Error as e:
        raise CatalogError(
            f"the catalog file {path!r} is truncated or damaged: its header promises {promised} bytes, the file "
            f"has {size}, and reading it failed ({_first_line(e)}); got a file cut short (a copy or download "
            "that stopped early, a full disk). Nothing was changed. Restore it from a backup or copy it again, "
            "or compile into a new file.") from None


def connect(path: str, read_only: bool, sandboxed: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection to the catalog file ``path`` (``sandboxed``: see ``SANDBOX``), or a
    ``CatalogError`` that says why not and what to do."""
    mode = ("for reading" if read_only else "for writing") + (", sandboxed" if sandboxed else "")
    p = Path(path)
    if p.is_dir():
        raise CatalogError(f"a catalog is a DuckDB file; got {path!r}, which is a folder. "
                           f"Give a file path, e.g. {str(p / 'plans.duckdb')!r}.")
    if read_only and not p.exists():
        raise CatalogError(f"no catalog file {path!r} to read; got a path where nothing is. "
                           f"Write one first with {_WRITE_HINT.replace('PATH', path)}.")
    if not read_only and not p.parent.is_dir():
        raise CatalogError(f"cannot create the catalog file {path!r}: its folder {str(p.parent)!r} does not exist. "
                           "Create the folder, or give a path in an existing one.")
    promised = _promised_bytes(path) if p.is_file() else None
    try:
        con = duckdb.connect(path, read_only=read_only, config=dict(SANDBOX) if sandboxed else {})
    except duckdb.Error as e:
        text = str(e)
        if "Could not set lock" in text or "Conflicting lock" in text:
            pid = re.search(r"\(PID (\d+)\)", text)
            holder = f" (PID {pid.group(1)})" if pid else ""
            raise CatalogError(
                f"the catalog file {path!r} is locked by another process{holder}: DuckDB lets one process write "
                f"a file, or several read it, not both at once; got a conflicting lock opening it {mode}. Close "
                "the other process's connection to it (a compile still running, a `relational-tensors sql` "
                "session, a notebook), or use another file.") from None
        if "different configuration" in text:
            raise CatalogError(
                f"the catalog file {path!r} is already open in this process another way (for writing or "
                "read-only, sandboxed or not: a read-only Catalog is sandboxed), and DuckDB opens a file one "
                f"way per process; got a request to open it {mode}. Close the other Catalog or connection first "
                "(cat.close(), or cg.catalog.close() for a compiled graph's), or open it the same way.") from None
        if "not a valid DuckDB database" in text:
            raise CatalogError(
                f"{path!r} is not a DuckDB database file; got a file that DuckDB cannot read as one. Nothing was "
                "changed. Give the path of a catalog (or of a new file to write one).") from None
        if "Could not read enough bytes" in text or "Corrupt database file" in text:
            raise CatalogError(
                f"the catalog file {path!r} is truncated or damaged: DuckDB cannot read it ({_first_line(e)}); got "
                "a file cut short or changed on disk. Nothing was changed. Restore it from a backup or copy it "
                "again, or compile into a new file.") from None
        raise CatalogError(f"cannot open the catalog {path!r} {mode}: {_first_line(e)}. Check the path and its "
                           f"permissions, or give another file.") from None
    size = os.path.getsize(path) if promised is not None else 0
    if promised is not None and size < promised:
        try:
            _check_complete(con, path, promised, size)
        except BaseException:
            con.close()
            raise
    return con


@dataclass
class _Found:
    """What a file holds under the main schema: kind and comment per name, views' text, tables' columns."""

    kinds: dict[str, str] = field(default_factory=dict)
    comments: dict[str, str | None] = field(default_factory=dict)
    view_sql: dict[str, str] = field(default_factory=dict)
    columns: dict[str, set[str]] = field(default_factory=dict)
    version: int | None = None  # None: not a catalog; 0: a catalog from before catalog versions


def _inspect(con: duckdb.DuckDBPyConnection) -> _Found:
    found = _Found()
    for name, kind, comment, sql in con.execute(
            "SELECT table_name, 'table', comment, NULL FROM duckdb_tables() "
            "WHERE database_name = current_database() AND schema_name = 'main' AND NOT internal "
            "UNION ALL SELECT view_name, 'view', comment, sql FROM duckdb_views() "
            "WHERE database_name = current_database() AND schema_name = 'main' AND NOT internal "
            "UNION ALL SELECT sequence_name, 'sequence', comment, NULL FROM duckdb_sequences() "
            "WHERE database_name = current_database() AND schema_name = 'main'").fetchall():
        found.kinds[name] = kind
        found.comments[name] = comment
        if sql is not None:
            found.view_sql[name] = sql
    for table, column in con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() "
            "WHERE database_name = current_database() AND schema_name = 'main' AND NOT internal").fetchall():
        found.columns.setdefault(table, set()).add(column)
    if found.kinds.get("catalog_version") == "table" and {"version", "package"} <= found.columns["catalog_version"]:
        (top,), = con.execute("SELECT max(version) FROM catalog_version WHERE package = ?", [PACKAGE]).fetchall()
        found.version = None if top is None else int(top)
    if found.version is None and found.kinds.get("compilations") == "table" \
            and "compilation_id" in found.columns["compilations"] and found.kinds.get("compilation_seq") == "sequence":
        found.version = 0
    return found


def _listing(names: list[str], found: _Found) -> str:
    return ", ".join(f"{n} ({found.kinds[n]})" for n in names)


def check_readable(con: duckdb.DuckDBPyConnection, path: str) -> int:
    """The catalog version of a file opened read-only (refused if it is no catalog)."""
    found = _inspect(con)
    if found.version is None:
        has = sorted(found.kinds)
        what = f"objects {', '.join(has[:8])}{', ...' if len(has) > 8 else ''}" if has else "no tables"
        raise CatalogError(f"{path!r} is not a relational_tensors catalog: it has no catalog_version or "
                           f"compilations table; got a DuckDB file with {what}. Give the path of a catalog "
                           f"written by {_WRITE_HINT.replace('PATH', path)}.")
    return found.version


def _is_ours(view: str, found: _Found, schema: Schema) -> bool:
    if found.view_sql.get(view) == schema.views[view] or (found.comments.get(view) or "").startswith(_MARK):
        return True
    legacy = _LEGACY_VIEWS.get(view)  # a view no version before 1 wrote is never a legacy one
    return found.version == 0 and not found.comments.get(view) and legacy is not None and legacy in found.view_sql[view]


def _rename_hint(name: str, kind: str) -> str:
    if kind == "sequence":
        return f"DROP SEQUENCE {name} if nothing of yours uses it"
    return f"ALTER {kind.upper()} {name} RENAME TO my_{name}"


def prepare(con: duckdb.DuckDBPyConnection, path: str, schema: Schema, schema_sql: str, views_text: str) -> int:
    """Make a file opened for writing a catalog of this version, or refuse; returns its version."""
    found = _inspect(con)
    ours = {**{t: "table" for t in schema.tables}, **{v: "view" for v in VIEWS}, **{s: "sequence" for s in SEQUENCES}}
    if found.version is None:
        taken = [n for n in ours if n in found.kinds]
        if taken:
            raise CatalogError(
                f"{path!r} already has {_listing(taken, found)} of its own, and is not a relational_tensors "
                "catalog (it has no catalog_version table), so the catalog cannot use those names; got a DuckDB "
                "file whose objects would be replaced. Nothing was changed. Write the catalog to another file "
                f"(catalog='plans.duckdb'), or rename yours ({_rename_hint(taken[0], found.kinds[taken[0]])}).")
    elif found.version > VERSION:
        raise CatalogError(
            f"{path!r} was written by a newer relational_tensors (catalog version {found.version}; this one writes "
            f"version {VERSION}), so it is not written here; got a request to open it for writing. Nothing was "
            "changed. Read it with Catalog(path, read_only=True), upgrade relational_tensors to compile into it, "
            "or compile into another file.")
    else:
        foreign = [n for n, kind in ours.items() if n in found.kinds and found.kinds[n] != kind]
        foreign += [v for v in VIEWS if found.kinds.get(v) == "view" and not _is_ours(v, found, schema)]
        if foreign:
            fixes = "; ".join(_rename_hint(n, found.kinds[n]) for n in foreign)
            raise CatalogError(
                f"{path!r} is a relational_tensors catalog, but its {_listing(foreign, found)} is not the catalog's "
                "(replaced by hand, or made by another program); got an object the catalog did not write under "
                "a name it needs. Nothing was changed. To compile into this file, rename yours "
                f"({fixes}) and the catalog writes its own again; or compile into another file.")
    steps: list[str] = []
    notes: list[str] = []
    missing = [n for n in ours if ours[n] != "view" and n not in found.kinds]
    if "compilation_seq" in missing and found.kinds.get("compilations") == "table":
        (top,), = con.execute("SELECT coalesce(max(compilation_id), 0) FROM compilations").fetchall()
        steps.append(f"CREATE SEQUENCE compilation_seq START {int(top) + 1}")  # ids go on after the kept rows
    if missing:
        steps.append(schema_sql)  # CREATE ... IF NOT EXISTS: only what is missing
        notes += [f"added {n}" for n in missing]
    for table, columns in schema.tables.items():
        if table not in found.kinds:
            continue
        for c in columns:
            if c.name not in found.columns.get(table, set()):
                default = f" DEFAULT {c.default}" if c.default is not None else ""
                steps.append(f'ALTER TABLE {table} ADD COLUMN "{c.name}" {c.type}{default}')
                notes.append(f"added {table}.{c.name}")
    start = 0 if found.version is None else found.version
    if found.version is not None:
        for v in range(start + 1, VERSION + 1):
            steps += MIGRATIONS.get(v, ())
    if any(found.view_sql.get(v) != schema.views[v] for v in VIEWS):
        steps.append(views_sql(views_text, temp=False, shown=SHOWN))
        steps += [f"COMMENT ON VIEW {v} IS '{_MARK} (catalog version {VERSION})'" for v in VIEWS]
    if found.version != VERSION:  # every table and column carries its meaning (catalog.dictionary)
        from relational_tensors.catalog.comments import comment_statements

        steps += comment_statements(schema_sql)
    row: list[object] | None = None
    if found.version != VERSION:
        note = "created" if found.version is None else f"migrated from version {found.version}" + (
            f": {', '.join(notes)}" if notes else "")
        row = [VERSION, PACKAGE, datetime.datetime.now(), note]
    if not steps and row is None:
        return VERSION  # current: the file is not written
    try:
        con.execute("BEGIN TRANSACTION")
        for step in steps:
            con.execute(step)
        if row is not None:
            con.execute("INSERT INTO catalog_version VALUES (?, ?, ?, ?)", row)
        con.execute("COMMIT")
    except duckdb.Error as e:
        try:
            con.execute("ROLLBACK")
        except duckdb.Error:
            pass
        raise CatalogError(f"cannot bring the catalog {path!r} from version {start} to version {VERSION}: "
                           f"{_first_line(e)}. Nothing was changed; compile into another file, and report "
                           "this with the file's `SELECT * FROM catalog_version`.") from None
    return VERSION

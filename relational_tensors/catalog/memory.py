"""In-memory catalogs: databases attached to one DuckDB instance per process, copied from a template.

Starting a DuckDB instance costs ~15 ms and creating the schema ~7 ms more; a compilation opens an
in-memory catalog every time.  Attaching an empty in-memory database to an instance that is already
running and copying the schema (tables, sequence, views) into it from a template takes ~3 ms (the
process's first catalog creates its schema directly; the template is built when a second is opened).  Each
catalog has its own connection whose default database is its own, so unqualified names (``plan``,
``tensors``, the selectors' SQL) and TEMP views stay per catalog; its database is detached (and its
memory freed) when the catalog is closed or collected.  The template is also what a file opened for
writing is compared with: its tables, columns and views are the schema of this version.
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
from dataclasses import dataclass

import duckdb

__all__ = ["Column", "Schema", "shared", "views_sql", "VERSION", "PACKAGE", "VIEWS", "SEQUENCES", "SHOWN"]

VERSION = 7  # the catalog version this package writes (see files.MIGRATIONS)
PACKAGE = "relational_tensors"
VIEWS = ("plan_inputs", "plan", "specs", "op_times")  # in views.sql's order (plan reads plan_inputs)
SEQUENCES = ("compilation_seq",)
SHOWN = "SELECT compilation_id FROM compilations WHERE status = 'ok'"  # what the persisted views show
_TEMPLATE = "rt_template"


def views_sql(text: str, temp: bool, shown: str) -> str:
    """views.sql with its placeholders: TEMP views (narrowed) or persisted ones, over ``shown``."""
    return text.replace("{temp}", "TEMP" if temp else "").replace("{shown}", shown)


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    default: str | None


@dataclass(frozen=True)
class Schema:
    """The catalog's objects as this version creates them."""

    tables: dict[str, tuple[Column, ...]]  # in creation order
    views: dict[str, str]  # name -> DuckDB's text of its definition (persisted form)


class _Memory:
    def __init__(self, schema_sql: str, views_text: str) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.base = duckdb.connect(":memory:")
        self.names = itertools.count(1)
        self.schema_sql, self.views_text = schema_sql, views_text
        self.template = False  # built by the second open: a process that opens one catalog never pays for it
        self._schema: Schema | None = None

    @property
    def schema(self) -> Schema:
        if self._schema is None:
            with self.lock:
                self._ensure_template()
        assert self._schema is not None
        return self._schema

    def _create(self, con: duckdb.DuckDBPyConnection, name: str) -> None:
        """Attach database ``name`` and create the schema in it with ``con`` (left using it)."""
        con.execute(f"ATTACH ':memory:' AS {name}; USE {name}")
        con.execute(self.schema_sql)
        from relational_tensors.catalog.comments import comment_statements

        con.execute(";\n".join(comment_statements(self.schema_sql)))
        con.execute(views_sql(self.views_text, temp=False, shown=SHOWN))
        con.execute("INSERT INTO catalog_version VALUES (?, ?, ?, 'created')",
                    [VERSION, PACKAGE, datetime.datetime.now()])
        if self._schema is None:  # what this version creates: read once, before any row is written
            self._schema = _introspect(con, name)

    def _ensure_template(self) -> None:
        if not self.template:
            con = self.base.cursor()
            try:
                self._create(con, _TEMPLATE)
            finally:
                con.close()
            self.template = True

    def open(self) -> tuple[duckdb.DuckDBPyConnection, str]:
        """A new catalog database with the schema, and a connection that uses it."""
        with self.lock:
            name = f"rt_catalog_{next(self.names)}"
            con = self.base.cursor()
            if not self.template and self._schema is None:
                self._create(con, name)  # the process's first catalog: created directly
                return con, name
            self._ensure_template()
            self.base.execute(f"ATTACH ':memory:' AS {name}; COPY FROM DATABASE {_TEMPLATE} TO {name}")
        con.execute(f"USE {name}")
        return con, name

    def release(self, con: duckdb.DuckDBPyConnection, name: str) -> None:
        """Close the catalog's connection and detach its database (called once, by close() or when collected)."""
        try:
            con.close()
        except duckdb.Error:
            pass
        if os.getpid() != self.pid:
            return  # a forked child: the instance is the parent's
        with self.lock:
            try:
                self.base.execute(f"DETACH DATABASE IF EXISTS {name}")
            except duckdb.Error:
                pass


def _introspect(con: duckdb.DuckDBPyConnection, name: str) -> Schema:
    order = [t for (t,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = ? "
                                       "ORDER BY table_oid", [name]).fetchall()]
    tables: dict[str, list[Column]] = {t: [] for t in order}
    for table, column, type_, default in con.execute(
            "SELECT table_name, column_name, data_type, column_default FROM duckdb_columns() "
            "WHERE database_name = ? ORDER BY table_oid, column_index", [name]).fetchall():
        if table in tables:
            tables[table].append(Column(column, type_, default))
    views = dict(con.execute("SELECT view_name, sql FROM duckdb_views() WHERE database_name = ? AND NOT internal",
                             [name]).fetchall())
    return Schema({t: tuple(cols) for t, cols in tables.items()}, {v: views[v] for v in VIEWS})


_shared: _Memory | None = None
_lock = threading.Lock()


def shared(schema_sql: str, views_text: str) -> _Memory:
    """This process's instance (a forked child starts its own: DuckDB's threads do not survive a fork)."""
    global _shared
    memory = _shared
    if memory is None or memory.pid != os.getpid():
        with _lock:
            if _shared is None or _shared.pid != os.getpid():
                _shared = _Memory(schema_sql, views_text)
            memory = _shared
    return memory


def _forget() -> None:
    global _shared, _lock
    _shared, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)

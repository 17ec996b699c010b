"""A DuckDB connection holding the catalog: schema from ``sql/``, rows written as Arrow tables.

In memory by default; give a path to persist it, so the plans of several compilations can be compared
later with plain SQL.  A file is opened for writing (a compile: the catalog's tables are created, or
migrated from an older version, see :mod:`relational_tensors.catalog.files`) or, with ``read_only=True``,
for reading, which changes nothing in it and touches no other file (the connection is sandboxed:
``files.SANDBOX``).
"""

from __future__ import annotations

import datetime
import functools
import gc
import itertools
import os
import re
import weakref
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from relational_tensors.catalog.files import check_readable, connect, prepare
from relational_tensors.catalog.memory import VERSION, VIEWS, shared, views_sql
from relational_tensors.errors import CatalogError

__all__ = ["Catalog", "load_sql"]

MACROS_SINCE = 5  # the catalog version whose files hold the table macros (sql/macros.sql)

_counter = itertools.count()
STATUSES = ("ok", "refused", "failed")


@functools.lru_cache(maxsize=64)
def load_sql(name: str) -> str:
    """The text of ``sql/<name>``, shipped inside the package."""
    return resources.files("relational_tensors").joinpath("sql").joinpath(name).read_text()


@functools.lru_cache(maxsize=1)
def _query_names() -> tuple[str, ...]:
    queries = resources.files("relational_tensors").joinpath("sql").joinpath("queries")
    return tuple(sorted(p.name[:-4] for p in queries.iterdir() if p.name.endswith(".sql")))


def _views() -> str:
    """The views, then the table macros (sql/macros.sql), as the catalog writes them."""
    return load_sql("views.sql") + "\n" + load_sql("macros.sql")


def _memory() -> Any:
    return shared(load_sql("schema.sql"), _views())


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _cid(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CatalogError(f"a compilation id is an int; got {type(value).__name__} {value!r}. Use the id "
                           "new_compilation returned (cg.compilation_id).")
    return value


class Catalog:
    """The catalog of one or more compilations.

    ``Catalog()`` is in memory; ``Catalog(path)`` opens (or creates) a file for writing, adding what an
    older version's file lacks; ``Catalog(path, read_only=True)`` reads a file without changing it.
    ``sandboxed`` (default: ``read_only``) gives a connection that reaches no other file, loads no
    extension and keeps its settings (``files.SANDBOX``): ``COPY ... TO``, ``EXPORT DATABASE``,
    ``ATTACH``, ``read_csv``, ``INSTALL`` fail in it.  Export a result yourself: ``cat.sql(...)`` is a
    ``pyarrow.Table``.

    >>> cat = Catalog()
    >>> cat.sql("SELECT count(*) AS n FROM candidate_specs").column("n").to_pylist()
    [0]
    """

    VERSION = VERSION  # the catalog version this package writes

    def __init__(self, path: str | Path | None = None, read_only: bool = False, *,
                 sandboxed: bool | None = None) -> None:
        self.read_only = bool(read_only)
        self.sandboxed = self.read_only if sandboxed is None else bool(sandboxed)
        self._narrowed: int | None = None
        self._release: weakref.finalize | None = None
        self._pending: list[Callable[[Catalog], None]] = []  # deferred writes (defer), run before any read
        if path is None or path == ":memory:":
            if self.read_only or self.sandboxed:
                raise CatalogError(f"{'read_only' if self.read_only else 'sandboxed'} needs the path of a catalog "
                                   "file; got none (an in-memory catalog is shared by this process's compiles). "
                                   "Give the path: Catalog(path, read_only=True).")
            shared = _memory()
            self.path = ":memory:"
            self._con, name = shared.open()
            self._release = weakref.finalize(self, shared.release, self._con, name)
            self._release.atexit = False
            self.version = VERSION
            return
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path):
            raise CatalogError(f"a catalog is a path to a DuckDB file (str or pathlib.Path), or None for one in "
                               f"memory; got {type(path).__name__} {path!r}. Give a file path such as "
                               "'plans.duckdb'.")
        self.path = str(os.fspath(path))
        self._con = connect(self.path, self.read_only, self.sandboxed)
        try:
            if self.read_only:
                self.version = check_readable(self.con, self.path)
                if self.version < MACROS_SINCE:  # a file from before the macros: this connection has them
                    for statement in duckdb.extract_statements(views_sql(load_sql("macros.sql"), True, "")):
                        try:
                            self.con.execute(statement.query)
                        except duckdb.Error:  # it reads what the old file lacks: that macro stays missing
                            pass
            else:
                self.version = prepare(self.con, self.path, _memory().schema, load_sql("schema.sql"), _views())
        except BaseException:
            self._con.close()
            raise

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection, with every deferred write (``defer``) done."""
        while self._pending:
            write = self._pending.pop(0)
            collecting = gc.isenabled()
            gc.disable()  # the writes build many small objects and no cycles (as the compiler's passes do)
            try:
                write(self)
            finally:
                if collecting:
                    gc.enable()
        return self._con

    def defer(self, write: Callable[[Catalog], None]) -> None:
        """Do ``write(self)`` before this catalog is next read: an in-memory catalog's rows that nobody may
        ask for (a physical plan's tables) cost nothing until a query, ``explain`` or a close needs them; a
        file is written now, so that the file holds them whatever happens to this process."""
        if self.path == ":memory:":
            self._pending.append(write)
        else:
            write(self)

    def __repr__(self) -> str:
        return f"Catalog({self.path!r}{', read_only=True' if self.read_only else ''})"

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the contract views ------------------------------------------------------------------------

    def narrow(self, compilation_id: int | None) -> None:
        """Make ``plan``, ``specs`` and ``plan_inputs`` show one compilation (whatever its status) in this
        connection; ``None`` shows the persisted views again (every compilation with status ``ok``)."""
        if compilation_id is None:
            if self._narrowed is not None:
                self.con.execute("; ".join(f"DROP VIEW IF EXISTS temp.{v}" for v in reversed(VIEWS)))
                self._narrowed = None
            return
        cid = _cid(compilation_id)
        if cid == self._narrowed:
            return
        self._known(cid)
        try:
            self.con.execute(views_sql(load_sql("views.sql"), temp=True, shown=str(cid)))
        except duckdb.Error as e:
            raise CatalogError(
                f"cannot show compilation {cid} of the catalog {self.path!r}: {_first_line(e)}; the file lacks "
                "what the views read (it was written by an older relational_tensors, or a table was dropped). "
                "Open it for writing once (Catalog(path)) to add what is missing.") from None
        self._narrowed = cid

    def _known(self, cid: int) -> None:
        try:
            ids = [r[0] for r in self.con.execute("SELECT compilation_id FROM compilations ORDER BY 1").fetchall()]
        except duckdb.Error as e:
            raise CatalogError(f"the catalog {self.path!r} cannot list its compilations: {_first_line(e)}. "
                               "Open it for writing once (Catalog(path)) to add what is missing.") from None
        if cid not in ids:
            shown = ", ".join(map(str, ids[:20])) + (", ..." if len(ids) > 20 else "") if ids else "none"
            raise CatalogError(f"no compilation {cid} in the catalog {self.path!r}; known: {shown}. Use the id "
                               "of a compilation in it (cg.compilation_id, or SELECT * FROM compilations).")

    # --- writing ------------------------------------------------------------------------------------

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise CatalogError(f"the catalog {self.path!r} is open read-only; got a write ({what}). Open it "
                               "for writing with Catalog(path) to compile into it.")

    def _fields(self, fields: dict[str, Any]) -> None:
        known = [c.name for c in _memory().schema.tables["compilations"]]
        for name in fields:
            if name not in known:
                raise CatalogError(f"compilations has no column {name!r}; its columns are {', '.join(known)}. "
                                   "Give only those.")

    def new_compilation(self, **fields: Any) -> int:
        """Record a compilation that starts (status NULL until finish_compilation); returns its id."""
        self._writable("new_compilation")
        self._fields(fields)
        (cid,), = self._con.execute("SELECT nextval('compilation_seq')").fetchall()
        cid = int(cid)
        fields = dict(fields, compilation_id=cid, created=datetime.datetime.now())
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        self._con.execute(f"INSERT INTO compilations ({cols}) VALUES ({marks})", list(fields.values()))
        return cid

    def update_compilation(self, compilation_id: int, **fields: Any) -> None:
        """Set columns of a compilation.  Setting ``plan_cost`` without a ``status`` marks it ``ok`` (how the
        compiler ended a successful compilation before finish_compilation existed)."""
        self._writable("update_compilation")
        cid = _cid(compilation_id)
        self._fields(fields)
        if "plan_cost" in fields and "status" not in fields:
            fields = dict(fields, status="ok")
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        (updated,), = self._con.execute(f"UPDATE compilations SET {sets} WHERE compilation_id = ?",
                                       [*fields.values(), cid]).fetchall()
        if not updated:
            self._known(cid)

    def finish_compilation(self, compilation_id: int, status: str, error: object = None, **fields: Any) -> None:
        """End a compilation: ``status`` is ``ok`` (it made a plan), ``refused`` (no plan fits the memory) or
        ``failed`` (an error); ``error`` is why (an exception or its text); ``fields`` are other columns of
        ``compilations`` (``plan_cost``, ``planning_seconds``).  Only ``ok`` compilations show in the
        persisted ``plan``, ``specs`` and ``plan_inputs`` views."""
        if status not in STATUSES:
            raise CatalogError(f"a compilation's status is one of {', '.join(map(repr, STATUSES))}; got {status!r}. "
                               "Use 'ok' for a plan, 'refused' when none fits the memory, 'failed' for an error.")
        text = None if error is None else (" ".join(str(error).split()) or type(error).__name__)
        self.update_compilation(compilation_id, status=status, error=text, **fields)

    def insert(self, table: str, rows: pa.Table, compilation_id: int) -> None:
        """Append an Arrow table to ``table``, tagging every row with ``compilation_id``."""
        self._writable(f"insert into {table}")
        tables = _memory().schema.tables
        if table not in tables:
            raise CatalogError(f"no catalog table {table!r}; the tables are {', '.join(tables)}.")
        cid = _cid(compilation_id)
        name = f"_arrow_{next(_counter)}"
        self._con.register(name, rows)
        try:
            cols = ", ".join(f'"{c}"' for c in rows.column_names)  # quoted: a column may be a keyword (end)
            self._con.execute(f"INSERT INTO {table} (compilation_id, {cols}) SELECT {cid}, {cols} FROM {name}")
        finally:
            self._con.unregister(name)

    # --- reading ------------------------------------------------------------------------------------

    def execute(self, query: str, params: list[Any] | None = None) -> duckdb.DuckDBPyConnection:
        return self.con.execute(query, params or [])

    def sql(self, query: str, params: list[Any] | None = None) -> pa.Table:
        """Run ``query`` and return its result as a ``pyarrow.Table``."""
        try:
            rel = self.con.sql(query, params=params) if params else self.con.sql(query)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.Error as e:
            raise CatalogError(f"catalog query failed: {_first_line(e)}; got {query!r}.") from None

    def query(self, name: str, defaults: dict[str, Any] | None = None, **params: Any) -> pa.Table:
        """Run the named query ``sql/queries/<name>.sql`` with ``$param`` values; ``defaults`` fill the
        parameters the query uses that ``params`` do not give (``cid``: the compilation shown)."""
        known = _query_names()
        if not isinstance(name, str) or name not in known:
            raise CatalogError(f"no named query {name!r}: a named query is the name of a file in sql/queries, "
                               f"without .sql; known: {', '.join(known)}. Run any other SQL with cg.sql(...).")
        text = load_sql(f"queries/{name}.sql")
        for key, value in (defaults or {}).items():
            if f"${key}" in text and key not in params:
                params[key] = value
        wanted = sorted(set(re.findall(r"\$([A-Za-z_]\w*)", text)))
        missing = [k for k in wanted if k not in params]
        extra = sorted(set(params) - set(wanted))
        if missing:
            raise CatalogError(f"named query {name!r} takes the parameters {wanted}; {missing} not given. Give "
                               f"each one: cg.query({name!r}, {missing[0]}=...), or --param {missing[0]}=VALUE.")
        if extra:
            takes = f"the parameters {wanted}" if wanted else "no parameters"
            raise CatalogError(f"named query {name!r} takes {takes}; got {extra} as well. Leave those out.")
        try:
            rel = self.con.sql(text, params=params) if params else self.con.sql(text)
            return rel.to_arrow_table()
        except duckdb.Error as e:
            raise CatalogError(f"named query {name!r} failed: {_first_line(e)}") from None

    def close(self) -> None:
        """Close the connection (an in-memory catalog's database is freed); closing twice is harmless."""
        self._pending.clear()  # an in-memory catalog's deferred rows go with its database
        if self._release is not None:
            self._release()
        else:
            self._con.close()

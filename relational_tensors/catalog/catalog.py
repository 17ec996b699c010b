"""A DuckDB connection holding the catalog: schema from ``sql/``, rows written as Arrow tables.

In memory by default; give a path to persist it, so the plans of several
compilations can be compared later with plain SQL.
"""

from __future__ import annotations

import datetime
import itertools
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from relational_tensors.errors import PlanError

__all__ = ["Catalog", "load_sql"]

_counter = itertools.count()


def load_sql(name: str) -> str:
    """The text of ``sql/<name>``, shipped inside the package."""
    return resources.files("relational_tensors").joinpath("sql").joinpath(name).read_text()


class Catalog:
    """The catalog of one or more compilations.

    >>> cat = Catalog()
    >>> cat.sql("SELECT count(*) AS n FROM candidate_specs").column("n").to_pylist()
    [0]
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = str(path) if path is not None else ":memory:"
        try:
            self.con = duckdb.connect(self.path)
        except duckdb.Error as e:
            raise PlanError(f"cannot open the catalog {self.path!r}: {e}") from None
        self.con.execute(load_sql("schema.sql"))
        self._views(temp=False, compilation_id=None)

    def _views(self, temp: bool, compilation_id: int | None) -> None:
        text = load_sql("views.sql")
        cid = compilation_id
        subs = {
            "{temp}": "TEMP" if temp else "",
            "{where_si}": f"WHERE c.compilation_id = {cid}" if cid is not None else "",
            "{where_c}": f"WHERE c.compilation_id = {cid}" if cid is not None else "",
            "{where_s}": f"WHERE s.compilation_id = {cid}" if cid is not None else "",
        }
        for key, value in subs.items():
            text = text.replace(key, value)
        self.con.execute(text)

    def narrow(self, compilation_id: int) -> None:
        """Make ``plan``, ``specs`` and ``plan_inputs`` show one compilation in this connection."""
        self._views(temp=True, compilation_id=compilation_id)

    def new_compilation(self, **fields: Any) -> int:
        cid = int(self.con.execute("SELECT nextval('compilation_seq')").fetchone()[0])  # type: ignore[index]
        fields = dict(fields, compilation_id=cid, created=datetime.datetime.now())
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        self.con.execute(f"INSERT INTO compilations ({cols}) VALUES ({marks})", list(fields.values()))
        return cid

    def update_compilation(self, compilation_id: int, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.con.execute(f"UPDATE compilations SET {sets} WHERE compilation_id = ?", [*fields.values(), compilation_id])

    def insert(self, table: str, rows: pa.Table, compilation_id: int) -> None:
        """Append an Arrow table to ``table``, tagging every row with ``compilation_id``."""
        name = f"_arrow_{next(_counter)}"
        self.con.register(name, rows)
        try:
            cols = ", ".join(rows.column_names)
            self.con.execute(
                f"INSERT INTO {table} (compilation_id, {cols}) SELECT {compilation_id}, {cols} FROM {name}"
            )
        finally:
            self.con.unregister(name)

    def execute(self, query: str, params: list[Any] | None = None) -> duckdb.DuckDBPyConnection:
        return self.con.execute(query, params or [])

    def sql(self, query: str, params: list[Any] | None = None) -> pa.Table:
        """Run ``query`` and return its result as a ``pyarrow.Table``."""
        try:
            rel = self.con.sql(query, params=params) if params else self.con.sql(query)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.Error as e:
            raise PlanError(f"catalog query failed: {str(e).splitlines()[0]}; got {query!r}.") from None

    def query(self, name: str, **params: Any) -> pa.Table:
        """Run the named query ``sql/queries/<name>.sql`` with ``$param`` values."""
        try:
            text = load_sql(f"queries/{name}.sql")
        except FileNotFoundError:
            queries = resources.files("relational_tensors").joinpath("sql").joinpath("queries")
            known = sorted(p.name[:-4] for p in queries.iterdir() if p.name.endswith(".sql"))
            raise PlanError(f"no named query {name!r}; known: {known}.") from None
        try:
            rel = self.con.sql(text, params=params) if params else self.con.sql(text)
        except duckdb.Error as e:
            raise PlanError(f"named query {name!r} failed: {str(e).splitlines()[0]}") from None
        return rel.to_arrow_table()

    def close(self) -> None:
        self.con.close()

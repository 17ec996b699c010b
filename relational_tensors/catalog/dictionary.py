"""The catalog's data dictionary: a DuckDB ``COMMENT ON`` for every table and column, taken from the
comments of ``sql/schema.sql`` itself (the lines above a ``CREATE TABLE``, the ``--`` after a column),
and the dictionary as Markdown, read back from ``duckdb_tables()``/``duckdb_columns()``.

    python -m relational_tensors.catalog.dictionary > docs/catalog.md
"""

from __future__ import annotations

import re

import duckdb

__all__ = ["schema_comments", "comment_statements", "data_dictionary", "COMMON"]

# columns that mean the same in every table they appear in
COMMON = {
    "compilation_id": "the compilation the row belongs to (compilations.compilation_id)",
    "op_id": "an operator: its node id (operators.op_id)",
    "spec_id": "a candidate join-agg spec of the operator (candidate_specs.spec_id)",
    "input_pos": "which input of the operator (0-based)",
    "tensor_id": "a tensor: the id of the node that makes it (tensors.tensor_id)",
    "tiling_id": "an interned block set of a tensor (tilings.tiling_id)",
    "output_tiling": "the tiling of the operator's output under the spec (tilings.tiling_id)",
    "device": "a logical device, 0..p-1",
    "flops": "floating-point operations",
    "bytes": "bytes",
    "label": "a readable name",
}

_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+) \($")
_COLUMN = re.compile(r'^\s+("?\w+"?)\s+[A-Z][A-Z0-9_\[\]]*(?:\s+(?:DEFAULT\s+\S+|PRIMARY KEY))*,?\s*(?:--\s*(.*))?$')
_MORE = re.compile(r"^\s+--\s*(.*)$")


def schema_comments(schema_sql: str) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """(table -> comment, (table, column) -> comment) as ``schema.sql`` writes them; a column without a
    comment of its own gets its meaning from ``COMMON``."""
    tables: dict[str, str] = {}
    columns: dict[tuple[str, str], str] = {}
    above: list[str] = []
    table: str | None = None
    last: tuple[str, str] | None = None
    for line in schema_sql.splitlines():
        if table is None:
            m = _TABLE.match(line)
            if m:
                table, last = m.group(1), None
                tables[table] = " ".join(above).strip()
                above = []
            elif line.startswith("--"):
                above.append(line.lstrip("-").strip())
            elif not line.strip():
                above = []
            continue
        if line.startswith(");"):
            table = None
            continue
        more = _MORE.match(line)
        if more and last is not None:
            columns[last] = f"{columns[last]} {more.group(1).strip()}".strip()
            continue
        m = _COLUMN.match(line)
        if m:
            name = m.group(1).strip('"')
            last = (table, name)
            columns[last] = (m.group(2) or "").strip() or COMMON.get(name, "")
    return tables, columns


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def comment_statements(schema_sql: str) -> list[str]:
    """``COMMENT ON`` statements for every table and column that has a comment."""
    tables, columns = schema_comments(schema_sql)
    out = [f"COMMENT ON TABLE {t} IS {_quote(c)}" for t, c in tables.items() if c]
    out += [f'COMMENT ON COLUMN {t}."{c}" IS {_quote(text)}' for (t, c), text in columns.items() if text]
    return out


def data_dictionary(con: duckdb.DuckDBPyConnection, database: str | None = None) -> str:
    """The catalog's tables, views and columns with their comments, as Markdown, read from DuckDB
    (``database``: the catalog's database, by default the connection's current one)."""
    if database is None:
        (database,), = con.execute("SELECT current_database()").fetchall()
    where = f"database_name = {_quote(str(database))} AND "
    lines = ["# The catalog's data dictionary", "",
             "Generated from a fresh catalog's `duckdb_tables()`, `duckdb_views()` and `duckdb_columns()` "
             "(`python -m relational_tensors.catalog.dictionary`); the comments are `sql/schema.sql`'s.", ""]
    from relational_tensors.catalog.catalog import load_sql

    order = {t: k for k, t in enumerate(schema_comments(load_sql("schema.sql"))[0])}  # the schema file's order
    found = con.execute(f"SELECT table_name, comment FROM duckdb_tables() WHERE {where}schema_name = 'main'").fetchall()
    for name, comment in sorted(found, key=lambda r: (order.get(r[0], len(order)), r[0])):
        lines += [f"## {name}", "", comment or "", "", "| column | type | meaning |", "|---|---|---|"]
        for col, typ, text in con.execute(
                f"SELECT column_name, data_type, comment FROM duckdb_columns() WHERE {where}schema_name = 'main' "
                "AND table_name = ? ORDER BY column_index", [name]).fetchall():
            lines.append(f"| {col} | {typ} | {(text or '').replace('|', '/')} |")
        lines.append("")
    views = con.execute(f"SELECT view_name FROM duckdb_views() WHERE {where}schema_name = 'main' AND NOT internal "
                        "ORDER BY view_name").fetchall()
    if views:
        lines += ["## Views", "", "Narrowed to one compilation in `cg.sql()`; over every finished compilation "
                  "in a file.", ""]
        lines += [f"- `{v}`" for (v,) in views]
        lines.append("")
    return "\n".join(lines)


def _main() -> None:
    from relational_tensors.catalog import Catalog

    cat = Catalog()
    print(data_dictionary(cat.con), end="")


if __name__ == "__main__":
    _main()

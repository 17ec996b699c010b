"""The catalog's data dictionary as Markdown, read back from a fresh catalog's ``duckdb_tables()``,
``duckdb_views()`` and ``duckdb_columns()`` (the comments are ``sql/schema.sql``'s, see ``catalog.comments``).

    python -m relational_tensors.catalog.dictionary > docs/catalog.md
"""

from __future__ import annotations

import duckdb

from relational_tensors.catalog.catalog import Catalog, load_sql
from relational_tensors.catalog.comments import _quote, schema_comments

__all__ = ["data_dictionary"]


def data_dictionary(con: duckdb.DuckDBPyConnection, database: str | None = None) -> str:
    """The catalog's tables, views and columns with their comments, as Markdown, read from DuckDB
    (``database``: the catalog's database, by default the connection's current one)."""
    if database is None:
        (database,), = con.execute("SELECT current_database()").fetchall()
    where = f"database_name = {_quote(str(database))} AND "
    lines = ["# The catalog's data dictionary", "",
             "Generated from a fresh catalog's `duckdb_tables()`, `duckdb_views()` and `duckdb_columns()` "
             "(`python -m relational_tensors.catalog.dictionary`); the comments are `sql/schema.sql`'s.", ""]
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
    cat = Catalog()
    print(data_dictionary(cat.con), end="")


if __name__ == "__main__":
    _main()

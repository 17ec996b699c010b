"""The catalog's comments: a DuckDB ``COMMENT ON`` for every table and column, taken from the comments of
``sql/schema.sql`` itself (the lines above a ``CREATE TABLE``, the ``--`` after a column).
``catalog.dictionary`` reads them back as the data dictionary."""

from __future__ import annotations

import re

__all__ = ["schema_comments", "comment_statements", "COMMON"]

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

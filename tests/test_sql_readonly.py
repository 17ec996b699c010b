"""The ``sql`` and ``query`` commands reach the catalog file and nothing else: without ``--write`` the file
is opened read-only, and always in a sandboxed DuckDB connection (no other file read or written, no
extension, settings locked).  Statement kinds are DuckDB's own (``duckdb.StatementType``): a refused one
is a one-line ``CommandError`` naming the rule, the kind it got and the fix, before anything of its script
runs; a refusal leaves every file as it was."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from relational_tensors.catalog import Catalog
from relational_tensors.catalog.files import READS, WRITES, split_statements
from relational_tensors.cli import main as cli
from relational_tensors.cli.output import Ui
from relational_tensors.errors import CatalogError

MODEL = '''
import relational_tensors as rt

def build():
    g = rt.Graph()
    x = g.input("x", [16, 8]); w = g.parameter("w", [8, 16])
    g.save(g.matmul(x, w, name="mm"), name="y")
    return g
'''
SECRET = "not-for-the-catalog-4f1e"


def run(*args: object, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The command line's main in this process, its output and status captured as a subprocess's."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    finally:
        sys.stdin = saved
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def refused(r: subprocess.CompletedProcess[str], *words: str) -> str:
    assert r.returncode == 1, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relational-tensors: error: "), r.stderr
    assert "Traceback" not in r.stderr and SECRET not in r.stdout + r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its bytes' hash: a refusal must leave them all as they were."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sql")
    (d / "model.py").write_text(MODEL)
    assert run("plan", d / "model.py", "--devices", "cpu:2", "--catalog", d / "plans.duckdb", "-q").returncode == 0
    return d / "plans.duckdb"


@pytest.fixture
def catalog(made: Path, tmp_path: Path) -> Path:
    """A copy of the planned catalog in a folder of its own, beside a file the SQL must not read."""
    path = tmp_path / "plans.duckdb"
    path.write_bytes(made.read_bytes())
    (tmp_path / "secret.csv").write_text(f"token\n{SECRET}\n")
    return path


# statement -> the words its refusal says (the kind or the rule); {d} is the catalog's folder
NEVER = {
    "COPY compilations TO '{d}/copy.csv'": ("COPY statement", "with or without --write", "--csv"),
    "COPY (SELECT 1 AS one) TO '{d}/copy.parquet' (FORMAT parquet)": ("COPY statement",),
    "COPY compilations FROM '{d}/secret.csv'": ("COPY statement",),
    "EXPORT DATABASE '{d}/export'": ("EXPORT statement",),
    "ATTACH '{d}/other.duckdb' AS other": ("ATTACH statement",),
    "DETACH other": ("DETACH statement",),
    "INSTALL httpfs": ("LOAD statement", "INSTALL"),
    "LOAD json": ("LOAD statement",),
    "UPDATE EXTENSIONS": ("statement of a kind this duckdb module does not name",),
    "SELECT * FROM read_csv('{d}/secret.csv')": ("enable_external_access", "secret.csv"),
    "SELECT * FROM '{d}/secret.csv'": ("enable_external_access",),
    "SELECT * FROM read_text('{d}/secret.csv')": ("enable_external_access",),
    "SELECT * FROM read_blob('/etc/passwd')": ("enable_external_access",),
    "SELECT * FROM glob('{d}/*')": ("enable_external_access",),
    "SET enable_external_access = true": ("lock_configuration",),
    "RESET enable_external_access": ("lock_configuration",),
    "SET allowed_directories = ['/']": ("lock_configuration",),
    "PRAGMA enable_profiling": ("lock_configuration",),
}
NEEDS_WRITE = {
    "CREATE TABLE notes AS SELECT 1 AS n": "CREATE",
    "CREATE TEMP VIEW v AS SELECT 1 AS n": "CREATE",
    "INSERT INTO compilations (compilation_id) VALUES (99)": "INSERT",
    "UPDATE compilations SET label = 'x'": "UPDATE",
    "DELETE FROM compilations": "DELETE",
    "DROP VIEW plan": "DROP",
    "ALTER TABLE compilations ADD COLUMN mine INT": "ALTER",
    "COMMENT ON TABLE compilations IS 'mine'": "ALTER",
    "VACUUM": "VACUUM",
}


@pytest.mark.parametrize("statement", sorted(NEVER))
@pytest.mark.parametrize("write", [False, True])
def test_statements_that_reach_other_files_are_refused_even_with_write(catalog: Path, statement: str,
                                                                       write: bool) -> None:
    before = digest(catalog.parent)
    sql = statement.format(d=catalog.parent)
    refused(run("sql", *(["--write"] if write else []), catalog, sql), *NEVER[statement])
    assert digest(catalog.parent) == before  # nothing written, the catalog's bytes included


@pytest.mark.parametrize("statement", sorted(NEEDS_WRITE))
def test_statements_that_change_the_catalog_need_write(catalog: Path, statement: str) -> None:
    before = digest(catalog.parent)
    msg = refused(run("sql", catalog, statement), f"got a {NEEDS_WRITE[statement]} statement", "Add --write")
    assert "read-only unless --write" in msg
    assert digest(catalog.parent) == before


def test_a_secret_is_a_create_that_needs_a_file(catalog: Path) -> None:
    before = digest(catalog.parent)
    refused(run("sql", catalog, "CREATE PERSISTENT SECRET s (TYPE s3)"), "got a CREATE statement", "Add --write")
    refused(run("sql", "--write", catalog, "CREATE PERSISTENT SECRET s (TYPE s3)"), "enable_external_access")
    assert digest(catalog.parent) == before


def test_a_refused_statement_runs_nothing_of_its_script(catalog: Path) -> None:
    before = digest(catalog.parent)
    for args in (("SELECT 7 AS seven; COPY compilations TO 'x.csv'; SELECT 8 AS eight",), ()):
        stdin = "SELECT 7 AS seven; CREATE TABLE t AS SELECT 1 AS n;" if not args else ""
        r = run("sql", catalog, *args, stdin=stdin)
        assert "seven" not in r.stdout
        refused(r, "Nothing of the script ran")
    assert digest(catalog.parent) == before


def test_reads_run_and_change_nothing(catalog: Path) -> None:
    before = digest(catalog.parent)
    script = ("SELECT count(*) AS n FROM plan; EXPLAIN SELECT * FROM plan; DESCRIBE compilations; SHOW TABLES; "
              "SUMMARIZE SELECT 1 AS one; PRAGMA table_info('compilations'); CALL pragma_version(); "
              "PIVOT plan ON op_kind USING count(*); SET VARIABLE k = 41; SELECT getvariable('k') + 1 AS answer; "
              "PREPARE q AS SELECT $1 + 1 AS p; EXECUTE q(1); BEGIN; SELECT 1 AS inside; COMMIT; CHECKPOINT; "
              "SELECT current_setting('enable_external_access') AS external")
    got = json.loads(run("--json", "sql", catalog, script).stdout)
    assert got[0]["rows"] == [{"n": 1}]
    assert {"answer": 42} in [r for res in got for r in res["rows"]]
    assert got[-1]["rows"] == [{"external": False}]  # the sandbox is on
    assert digest(catalog.parent) == before


def test_write_runs_the_kinds_that_change_the_catalog(catalog: Path) -> None:
    script = ("CREATE TABLE notes (id INT, remark VARCHAR); INSERT INTO notes VALUES (1, 'fast'), (2, 'slow'); "
              "UPDATE notes SET remark = 'fastest' WHERE id = 1; DELETE FROM notes WHERE id = 2; "
              "ALTER TABLE notes ADD COLUMN seen BOOLEAN DEFAULT true; COMMENT ON TABLE notes IS 'mine'; "
              "CREATE VIEW note_view AS SELECT remark FROM notes; CREATE MACRO twice(a) AS 2 * a; "
              "CREATE TABLE scratch AS SELECT 1 AS n; DROP TABLE scratch; "
              "MERGE INTO notes USING (SELECT 3 AS id, 'new' AS remark) s ON notes.id = s.id "
              "WHEN NOT MATCHED THEN INSERT (id, remark) VALUES (s.id, s.remark); VACUUM; ANALYZE; CHECKPOINT")
    r = run("sql", "--write", catalog, script)
    assert r.returncode == 0, r.stderr
    assert set(p.name for p in catalog.parent.iterdir()) <= {"plans.duckdb", "plans.duckdb.wal", "secret.csv"}
    rows = json.loads(run("--json", "sql", catalog, "SELECT id, remark, seen, twice(id) AS t FROM notes "
                          "ORDER BY id").stdout)
    assert rows == [{"id": 1, "remark": "fastest", "seen": True, "t": 2}, {"id": 3, "remark": "new", "seen": True,
                                                                            "t": 6}]
    assert json.loads(run("--json", "sql", catalog, "SELECT * FROM note_view ORDER BY 1").stdout) == [
        {"remark": "fastest"}, {"remark": "new"}]


def test_the_statement_kinds_are_duckdbs_own() -> None:
    kinds = set(duckdb.StatementType.__members__)
    assert READS <= kinds and WRITES <= kinds and not READS & WRITES
    for never in ("COPY", "EXPORT", "ATTACH", "DETACH", "LOAD", "EXTENSION", "COPY_DATABASE", "INVALID"):
        assert never in kinds and never not in READS | WRITES
    with pytest.raises(CatalogError, match="the SQL does not parse"):
        split_statements("SELEC 1")


def test_the_prompt_refuses_and_goes_on(catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = digest(catalog.parent)
    args = argparse.Namespace(write=False, csv=False)
    saved, sys.stdin = sys.stdin, io.StringIO(f"COPY plan TO '{catalog.parent}/p.csv';\nSELECT 5 * 5\n AS sq;\n")
    try:
        with Catalog(catalog, read_only=True, sandboxed=True) as cat:
            assert cli._prompt(cat, Ui(json=False, quiet=False, debug=False), args) == 0
    finally:
        sys.stdin = saved
    out, err = capsys.readouterr()
    assert "COPY statement" in err and "25" in out
    assert digest(catalog.parent) == before


def test_the_query_command_binds_its_parameters(catalog: Path) -> None:
    before = digest(catalog.parent)
    evil = f"matmul'; COPY compilations TO '{catalog.parent}/q.csv'; --"
    r = run("--json", "query", catalog, "cheapest_candidates", "--param", f"kind={evil}")
    assert r.returncode == 0 and json.loads(r.stdout) == []  # a kind no operator has, not a statement
    r = run("--json", "query", catalog, "plan_diff", "--param", "a=--1", "--param", "b=1")
    refused(r, "plan_diff")  # '--1' is text, not a number: DuckDB says so, nothing crashes
    assert digest(catalog.parent) == before


def test_a_read_only_catalog_is_sandboxed_in_the_library_too(catalog: Path) -> None:
    before = digest(catalog.parent)
    with Catalog(catalog, read_only=True) as cat:
        assert cat.sandboxed
        for sql in (f"COPY compilations TO '{catalog.parent}/lib.csv'", f"SELECT * FROM '{catalog.parent}/secret.csv'",
                    f"EXPORT DATABASE '{catalog.parent}/exp'", "SET enable_external_access = true"):
            with pytest.raises(CatalogError, match="catalog query failed"):
                cat.sql(sql)
        assert cat.sql("SELECT count(*) AS n FROM compilations").column("n").to_pylist() == [1]
    assert digest(catalog.parent) == before
    with pytest.raises(CatalogError, match="sandboxed needs the path of a catalog file"):
        Catalog(sandboxed=True)
    with Catalog(catalog) as writer:  # written by a compile: not sandboxed unless asked
        assert not writer.sandboxed

"""The catalog on bad input: files it does not own, locked files, reads that must not write, files of
older and newer versions, unfinished compilations and named queries.  Every refusal is a CatalogError
(a PlanError) that names the rule, what it got and how to fix it; nothing the user stored is lost."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

import relational_tensors as rt
from relational_tensors.catalog import Catalog, load_sql
from relational_tensors.errors import CatalogError


def _weights_chain(rows: int, width: int, layers: int) -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [rows, width])
    for n in range(layers):
        x = g.matmul(x, g.parameter(f"w{n}", [width, width]))
    g.save(x, name="y")
    return g


def small_graph() -> rt.Graph:
    return _weights_chain(16, 64, 3)


def refused_graph() -> rt.Graph:
    """Each operator fits a device, the plan as a whole needs more (ten resident weights)."""
    return _weights_chain(64, 256, 10)


def raw(path: Path, *statements: str, read_only: bool = False) -> list[list[tuple]]:
    """Run statements on the file with plain duckdb (the user's own connection), then close it."""
    con = duckdb.connect(str(path), read_only=read_only)
    try:
        return [con.execute(s).fetchall() for s in statements]
    finally:
        con.close()


def write_catalog(path: Path) -> None:
    cat = Catalog(path)
    cat.close()


# --- 1. a file with objects of the user's own under the catalog's names ------------------------------


def test_a_users_tables_and_views_named_like_the_catalogs_are_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "mine.duckdb"
    raw(path, "CREATE TABLE tensors (id INTEGER, payload VARCHAR)", "INSERT INTO tensors VALUES (1, 'keep me')",
        "CREATE VIEW plan AS SELECT 42 AS answer")
    with pytest.raises(CatalogError, match="already has") as e:
        Catalog(path)
    msg = str(e.value)
    assert "tensors (table)" in msg and "plan (view)" in msg and "another file" in msg and "got" in msg
    with pytest.raises(CatalogError, match="not a relational_tensors catalog"):
        Catalog(path, read_only=True)
    with pytest.raises(rt.PlanError, match="already has"):
        rt.compileGraph(small_graph(), device="cpu:2", catalog=path)
    assert raw(path, "SELECT * FROM tensors", "SELECT * FROM plan") == [[(1, "keep me")], [(42,)]]


def test_a_users_view_replacing_the_catalogs_plan_view_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    write_catalog(path)
    raw(path, "CREATE OR REPLACE VIEW plan AS SELECT 'my own' AS mine")
    with pytest.raises(CatalogError, match=r"plan \(view\).*not the catalog's") as e:
        Catalog(path)
    assert "rename yours" in str(e.value) and "ALTER VIEW plan RENAME TO" in str(e.value)
    assert raw(path, "SELECT * FROM plan") == [[("my own",)]]
    # reading does not touch it either
    assert Catalog(path, read_only=True).sql("SELECT mine FROM plan").column("mine").to_pylist() == ["my own"]


def test_a_catalog_table_replaced_by_a_view_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    write_catalog(path)
    raw(path, "DROP TABLE dp_table", "CREATE VIEW dp_table AS SELECT 1 AS x")
    with pytest.raises(CatalogError, match=r"dp_table \(view\)"):
        Catalog(path)
    assert raw(path, "SELECT * FROM dp_table") == [[(1,)]]


def test_unrelated_objects_of_the_user_stay_when_a_catalog_is_added(tmp_path: Path) -> None:
    path = tmp_path / "mine.duckdb"
    raw(path, "CREATE TABLE measurements (x DOUBLE)", "INSERT INTO measurements VALUES (1.5)",
        "CREATE VIEW doubled AS SELECT 2 * x AS y FROM measurements")
    with pytest.raises(CatalogError, match="not a relational_tensors catalog.*measurements"):
        Catalog(path, read_only=True)
    cg = rt.compileGraph(small_graph(), device="cpu:2", catalog=path)
    cg.catalog.close()
    assert raw(path, "SELECT * FROM doubled", "SELECT count(*) FROM compilations") == [[(3.0,)], [(1,)]]


# --- 2. a file locked by another process ------------------------------------------------------------


def test_a_file_locked_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    write_catalog(path)
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
                               "print('holding', flush=True); time.sleep(60)", str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        for read_only in (False, True):
            with pytest.raises(CatalogError, match="is locked by another process") as e:
                Catalog(path, read_only=read_only)
            msg = str(e.value)
            assert str(path) in msg and f"PID {holder.pid}" in msg and "Close" in msg and "got" in msg
    finally:
        holder.kill()
        holder.wait()


def test_one_file_open_for_writing_and_for_reading_in_one_process(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    writer = Catalog(path)
    try:
        with pytest.raises(CatalogError, match="already open in this process") as e:
            Catalog(path, read_only=True)
        assert "close()" in str(e.value)
    finally:
        writer.close()
    Catalog(path, read_only=True).close()


def test_files_that_are_not_catalogs(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="no catalog file") as e:
        Catalog(tmp_path / "none.duckdb", read_only=True)
    assert "catalog=" in str(e.value)
    assert not (tmp_path / "none.duckdb").exists()
    junk = tmp_path / "junk.duckdb"
    junk.write_text("not a database " * 100)
    with pytest.raises(CatalogError, match="not a DuckDB database"):
        Catalog(junk)
    assert junk.read_text() == "not a database " * 100
    with pytest.raises(CatalogError, match="is a folder"):
        Catalog(tmp_path)
    with pytest.raises(CatalogError, match="folder .* does not exist"):
        Catalog(tmp_path / "no" / "such" / "plans.duckdb")
    with pytest.raises(CatalogError, match="a path to a DuckDB file.*got int"):
        Catalog(3)  # type: ignore[arg-type]
    with pytest.raises(CatalogError, match="read_only needs the path of a catalog file"):
        Catalog(read_only=True)


def _cut_catalog(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "cut.duckdb"
    rt.compileGraph(small_graph(), device="cpu:2", catalog=path).catalog.close()
    data = path.read_bytes()[:path.stat().st_size // 2]
    path.write_bytes(data)
    return path, data


def test_a_truncated_catalog_is_refused_naming_the_file_and_left_as_it_was(tmp_path: Path) -> None:
    path, data = _cut_catalog(tmp_path)
    for open_it in (lambda: Catalog(path, read_only=True), lambda: Catalog(path),
                    lambda: rt.compileGraph(small_graph(), device="cpu:2", catalog=path)):
        with pytest.raises(CatalogError, match="truncated or damaged") as e:
            open_it()
        assert repr(str(path)) in str(e.value) and "header promises" in str(e.value)
        assert path.read_bytes() == data


def test_a_file_shorter_than_its_header_whose_tail_blocks_are_free_opens(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # a checkpoint truncates the free blocks at a file's end after writing the header that still counts them
    from relational_tensors.catalog import files

    path = tmp_path / "plans.duckdb"
    rt.compileGraph(small_graph(), device="cpu:2", catalog=path).catalog.close()
    monkeypatch.setattr(files, "_promised_bytes", lambda p: path.stat().st_size + 262144)
    with Catalog(path, read_only=True) as cat:
        assert cat.sql("SELECT count(*) AS n FROM compilations").column("n").to_pylist() == [1]


# --- 3. reads do not write; writes migrate ----------------------------------------------------------


def test_reading_does_not_write_or_recreate_what_the_user_dropped(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    cg = rt.compileGraph(small_graph(), device="cpu:2", catalog=path)
    cg.catalog.close()
    raw(path, "DROP TABLE dp_table", "CHECKPOINT")
    before = path.read_bytes()
    cat = Catalog(path, read_only=True)
    with pytest.raises(rt.PlanError, match="dp_table"):
        cat.sql("SELECT * FROM dp_table")
    with pytest.raises(CatalogError, match="open read-only") as e:
        cat.new_compilation(label="x")
    assert "Catalog(path)" in str(e.value)
    cat.close()
    assert path.read_bytes() == before
    assert raw(path, "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'dp_table'") == [[(0,)]]


def test_writing_recreates_only_what_is_missing_and_ids_go_on(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    cat = Catalog(path)
    first = cat.new_compilation(label="kept")
    cat.close()
    raw(path, "DROP TABLE dp_table", "DROP SEQUENCE compilation_seq")
    cat = Catalog(path)
    assert cat.new_compilation(label="next") == first + 1
    assert cat.sql("SELECT label FROM compilations ORDER BY 1").column("label").to_pylist() == ["kept", "next"]
    assert cat.sql("SELECT count(*) AS n FROM dp_table").column("n").to_pylist() == [0]
    cat.close()


def test_read_only_catalog_narrows_and_answers_queries(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    g = small_graph()
    a = rt.compileGraph(g, device="cpu:2", catalog=path)
    b = rt.compileGraph(g, device="cpu:4", catalog=path, selector="greedy")
    a.catalog.close()
    b.catalog.close()
    cat = Catalog(path, read_only=True)
    assert cat.read_only and cat.version == Catalog.VERSION
    assert cat.sql("SELECT count(DISTINCT compilation_id) AS n FROM plan").column("n").to_pylist() == [2]
    cat.narrow(b.compilation_id)
    assert cat.query("plan_cost").column("total").to_pylist()[0] == pytest.approx(b.plan.cost)
    assert cat.sql("SELECT DISTINCT compilation_id FROM specs").column("compilation_id").to_pylist() == [
        b.compilation_id]
    cat.narrow(None)
    assert cat.sql("SELECT count(DISTINCT compilation_id) AS n FROM specs").column("n").to_pylist() == [2]
    with pytest.raises(CatalogError, match="no compilation 99.*known: 1, 2"):
        cat.narrow(99)
    with pytest.raises(CatalogError, match="compilation id is an int; got str"):
        cat.narrow("1; DROP TABLE plan")  # type: ignore[arg-type]
    cat.close()


def old_catalog(path: Path) -> None:
    """A file as written before the catalog had a version: today's tables minus the new columns."""
    con = duckdb.connect(str(path))
    con.execute(load_sql("schema.sql"))
    con.execute("DROP TABLE catalog_version")
    con.execute("ALTER TABLE compilations DROP COLUMN status")
    con.execute("ALTER TABLE compilations DROP COLUMN error")
    con.execute("ALTER TABLE spec_inputs DROP COLUMN floor")
    # the views as the old version wrote them (over every compilation)
    every = "SELECT compilation_id FROM compilations"
    old_views = load_sql("views.sql").replace("{temp}", "").replace("{shown}", every)
    con.execute(old_views)
    con.execute("DROP VIEW op_times")  # a view of a later version
    con.execute("INSERT INTO compilations (compilation_id, label, devices, plan_cost, planning_seconds) "
                "VALUES (1, 'finished', 2, 10.0, 0.5), (2, 'refused', 2, NULL, NULL)")
    con.execute("SELECT nextval('compilation_seq'), nextval('compilation_seq')")
    con.execute("INSERT INTO spec_inputs (compilation_id, op_id, spec_id, input_pos, repartition) "
                "VALUES (1, 2, 0, 0, 3.5)")
    con.close()


def test_an_old_file_gains_the_new_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    old_catalog(path)
    # reading an old file works and changes nothing
    reader = Catalog(path, read_only=True)
    assert reader.version == 0
    assert reader.sql("SELECT label FROM compilations ORDER BY 1").column("label").to_pylist() == [
        "finished", "refused"]
    assert reader.sql("SELECT * FROM plan_diff(1, 1)").num_rows == 0  # the macros, for this connection only
    reader.close()
    assert raw(path, "SELECT count(*) FROM duckdb_functions() WHERE function_name = 'plan_diff'") == [[(0,)]]
    cat = Catalog(path)
    assert cat.version == Catalog.VERSION
    rows = cat.sql("SELECT compilation_id, label, plan_cost, status, error FROM compilations ORDER BY 1").to_pylist()
    assert rows == [
        {"compilation_id": 1, "label": "finished", "plan_cost": 10.0, "status": "ok", "error": None},
        {"compilation_id": 2, "label": "refused", "plan_cost": None, "status": None, "error": None},
    ]
    assert cat.sql("SELECT repartition, floor FROM spec_inputs").to_pylist() == [{"repartition": 3.5, "floor": 0.0}]
    assert cat.sql("SELECT max(version) AS v FROM catalog_version").column("v").to_pylist() == [Catalog.VERSION]
    assert cat.new_compilation(label="new") == 3  # the sequence goes on
    cat.close()
    assert raw(path, "SELECT count(*) FROM duckdb_functions() WHERE function_type = 'table_macro' "
                     "AND function_name IN ('plan_diff', 'chosen_vs_cheapest', 'traffic_by_device_pair', "
                     "'time_by_kind')") == [[(4,)]]  # written with the migration
    cg = rt.compileGraph(small_graph(), device="cpu:2", catalog=path)
    assert cg.sql("SELECT count(*) AS n FROM plan").column("n").to_pylist()[0] == 3
    cg.catalog.close()


def test_a_file_of_a_newer_version_is_read_but_not_written(tmp_path: Path) -> None:
    path = tmp_path / "new.duckdb"
    write_catalog(path)
    raw(path, "INSERT INTO catalog_version VALUES (99, 'relational_tensors', now(), 'from the future')")
    with pytest.raises(CatalogError, match="newer relational_tensors") as e:
        Catalog(path)
    assert "catalog version 99" in str(e.value) and "upgrade" in str(e.value)
    Catalog(path, read_only=True).close()


# --- 4. compilations have a status; the persisted plan view shows finished plans only -----------------


def test_a_refused_compilation_is_not_shown_as_a_plan(tmp_path: Path) -> None:
    path = tmp_path / "plans.duckdb"
    g = refused_graph()
    ok = rt.compileGraph(g, device="cpu:2", catalog=path)
    need = max(ok.memory().values())
    ok.catalog.close()
    with pytest.raises(rt.OutOfMemoryPlanError):
        rt.compileGraph(g, device="cpu:2", catalog=path, memory_per_device=need - 1)
    cat = Catalog(path, read_only=True)
    statuses = cat.sql("SELECT compilation_id, status FROM compilations ORDER BY 1").to_pylist()
    assert len(statuses) == 2 and statuses[0]["status"] == "ok" and statuses[1]["status"] != "ok"
    for view in ("plan", "plan_inputs", "specs"):
        shown = cat.sql(f"SELECT DISTINCT compilation_id FROM {view}").column("compilation_id").to_pylist()
        assert shown == [ok.compilation_id], view
    refused = statuses[1]["compilation_id"]
    cat.narrow(refused)  # narrowed to it, its rows are there to look at
    assert cat.sql("SELECT count(*) AS n FROM specs").column("n").to_pylist()[0] > 0
    cat.close()


def test_finish_compilation_records_status_and_error() -> None:
    cat = Catalog()
    a, b, c = (cat.new_compilation(label=name) for name in "abc")
    cat.finish_compilation(a, "ok", plan_cost=1.5, planning_seconds=0.25)
    cat.finish_compilation(b, "refused", error="device 0 needs 10 bytes but has 9")
    cat.finish_compilation(c, "failed", error="boom")
    rows = cat.sql("SELECT label, status, error, plan_cost FROM compilations ORDER BY 1").to_pylist()
    assert [(r["status"], r["error"], r["plan_cost"]) for r in rows] == [
        ("ok", None, 1.5), ("refused", "device 0 needs 10 bytes but has 9", None), ("failed", "boom", None)]
    with pytest.raises(CatalogError, match="status is one of 'ok', 'refused', 'failed'; got 'done'"):
        cat.finish_compilation(a, "done")
    with pytest.raises(CatalogError, match="compilations has no column 'nonsense'.*planning_seconds"):
        cat.finish_compilation(a, "ok", nonsense=1)
    with pytest.raises(CatalogError, match="no compilation 77"):
        cat.finish_compilation(77, "ok")
    with pytest.raises(CatalogError, match="no catalog table 'plan; DROP TABLE tensors'"):
        cat.insert("plan; DROP TABLE tensors", None, a)  # type: ignore[arg-type]


# --- 5. named queries stay in sql/queries -------------------------------------------------------------


@pytest.mark.parametrize("name", ["../schema", "../views", "queries/../../schema", "/etc/passwd", "plan_cost.sql",
                                  "", "plan cost"])
def test_a_named_query_is_a_plain_name(name: str) -> None:
    with pytest.raises(rt.PlanError, match=re.escape(f"no named query {name!r}")) as e:
        Catalog().query(name)
    msg = str(e.value)
    assert ("known: cheapest_candidates, chosen_vs_cheapest, compilations, plan_cost, plan_diff, plan_times, "
            "repartitions, time_by_kind, traffic_by_device_pair") in msg and "cg.sql" in msg


def test_in_memory_catalogs_are_independent() -> None:
    a, b = Catalog(), Catalog()
    a.new_compilation(label="a")
    assert a.sql("SELECT count(*) AS n FROM compilations").column("n").to_pylist() == [1]
    assert b.sql("SELECT count(*) AS n FROM compilations").column("n").to_pylist() == [0]
    assert b.new_compilation(label="b") == 1
    a.close()
    b.close()
    with pytest.raises(rt.PlanError, match="closed"):
        a.sql("SELECT 1")

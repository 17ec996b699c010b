"""The physical plan in the catalog: placements, exchange programs and actions, tasks, edge traffic,
device memory, task times, and the compilations' new columns, each against the Python objects they
record (``cg.dag``, ``cg.lowered``, ``cg.memory()``, the simulator), in one persisted file holding
several compilations."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.graph.models import llama_block, llama_training_graph


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[rt.CompiledGraph]]:
    path = tmp_path_factory.mktemp("catalog") / "plans.duckdb"
    block = llama_block(1, 40, 64, 4, 2, 96, dtype="float32", seq_ends=(17, 40))
    step = llama_training_graph(1, 20, 32, 4, 2, 40, 37, optimizer="adamw")
    out = [rt.compileGraph(block, device="cpu:2", catalog=str(path)),
           rt.compileGraph(block, device="cpu:5", catalog=str(path), cost_model="calibrated"),
           rt.compileGraph(step, device="cpu:4", catalog=str(path), keep_states="sharded")]
    return path, out


def _rows(cg: rt.CompiledGraph, query: str) -> list[dict]:
    """``query`` over this compilation's rows: {cid} in it is the compilation's id; the physical tables
    hold every compilation of the file (only the views are narrowed to one)."""
    return cg.sql(query.replace("{cid}", str(cg.compilation_id))).to_pylist()


def test_edge_traffic_adds_up_to_the_copies_of_the_task_dag(compiled: tuple[Path, list]) -> None:
    for cg in compiled[1]:
        total = _rows(cg, "SELECT coalesce(sum(bytes), 0) AS b FROM edge_traffic WHERE compilation_id = {cid}")[0]["b"]
        assert int(total) == cg.dag.bytes_moved()
        pairs = defaultdict(int)
        for t in cg.dag.transfers():
            pairs[(t.src_device, t.device)] += cg.dag.buffers[t.outputs[0]].nbytes
        got = {(r["src_device"], r["dst_device"]): int(r["b"]) for r in _rows(
            cg, "SELECT src_device, dst_device, sum(bytes) AS b FROM edge_traffic WHERE compilation_id = {cid} "
                "GROUP BY ALL")}
        assert got == dict(pairs)


def test_device_memory_equals_the_memory_report(compiled: tuple[Path, list]) -> None:
    for cg in compiled[1]:
        rows = {r["device"]: r for r in _rows(cg, "SELECT * FROM device_memory WHERE compilation_id = {cid}")}
        assert {d: r["peak_bytes"] for d, r in rows.items()} == cg.memory()
        for d, cats in cg.memory_by_category().items():
            for name, nbytes in cats.items():
                assert rows[d][name.replace(" ", "_")] == nbytes, (d, name)
        peak = _rows(cg, "SELECT peak_bytes FROM compilations WHERE compilation_id = {cid}")[0]["peak_bytes"]
        assert peak == max(cg.memory().values())


def test_placements_tasks_and_programs_are_the_lowered_plan(compiled: tuple[Path, list]) -> None:
    for cg in compiled[1]:
        placed = defaultdict(dict)
        for r in _rows(cg, "SELECT op_id, function_index, device FROM placements WHERE compilation_id = {cid}"):
            placed[r["op_id"]][r["function_index"]] = r["device"]
        assert {op: tuple(v[g] for g in range(len(v))) for op, v in placed.items()} == cg.lowered.placement
        tasks = _rows(cg, "SELECT task_id, kind, op_id, device, src_device, label FROM tasks "
                          "WHERE compilation_id = {cid} ORDER BY task_id")
        assert [(r["kind"], r["op_id"], r["device"], r["src_device"], r["label"]) for r in tasks] == [
            (t.kind, t.op, t.device, t.src_device, t.label) for t in cg.dag.tasks]
        texts = {r["program"]: r["text"]
                 for r in _rows(cg, "SELECT program, text FROM exchange_programs WHERE compilation_id = {cid}")}
        assert texts == cg.exchange_programs()
        sent = _rows(cg, "SELECT coalesce(sum(bytes * len(dest_devices)), 0) AS b FROM exchange_actions "
                     "WHERE compilation_id = {cid}")[0]["b"]
        assert int(sent) >= 0


def test_task_times_per_device_equal_the_simulator(compiled: tuple[Path, list]) -> None:
    for cg in compiled[1]:
        sim = cg.simulation(record=True)
        want = defaultdict(float)
        for t in sim.tasks:
            want[t.device] += t.end - t.start
        got = {r["device"]: r["s"] for r in _rows(
            cg, "SELECT device, sum(seconds) AS s FROM task_times WHERE compilation_id = {cid} GROUP BY ALL")}
        assert got.keys() == want.keys()
        for d in want:
            assert got[d] == pytest.approx(want[d], rel=1e-12, abs=1e-15)
        per_op = _rows(cg, "SELECT sum(seconds) AS s FROM op_times")[0]["s"]
        assert per_op == pytest.approx(sum(want.values()), rel=1e-12)
        predicted = _rows(cg, "SELECT predicted_seconds AS t FROM compilations WHERE compilation_id = {cid}")[0]["t"]
        assert predicted == pytest.approx(sim.time)
        cg.simulation(record=True)  # recorded again: replaces, never doubles
        recorded = _rows(cg, "SELECT count(*) AS n FROM task_times WHERE compilation_id = {cid}")[0]["n"]
        assert recorded == len(sim.tasks)


def test_compilations_say_how_each_plan_was_made(compiled: tuple[Path, list]) -> None:
    path, cgs = compiled
    con = cgs[0].catalog  # the file's connection: every compilation in it
    rows = con.sql("SELECT compilation_id, topology, schedule_mode, tactic, calibration, keep_states, "
                   "graph_fingerprint, version, cost_unit FROM compilations ORDER BY compilation_id").to_pylist()
    assert [r["cost_unit"] for r in rows] == ["elements", "seconds", "elements"]
    assert rows[0]["graph_fingerprint"] == rows[1]["graph_fingerprint"] != rows[2]["graph_fingerprint"]
    assert all(r["topology"] and r["schedule_mode"] == "naive" and r["tactic"] == "tree" and r["version"]
               for r in rows)
    assert rows[2]["keep_states"] == "sharded"
    limits = con.sql("SELECT memory_limit, memory_per_device FROM compilations ORDER BY 1").to_pylist()
    assert all(r["memory_limit"] is None and r["memory_per_device"] > 0 for r in limits)  # the devices' memory
    # every physical table has rows for every compilation, in one file
    for table in ("placements", "exchange_programs", "tasks", "device_memory"):
        n = con.sql(f"SELECT count(DISTINCT compilation_id) AS n FROM {table}").to_pylist()[0]["n"]
        assert n == len(cgs), table


def test_a_graph_fingerprint_changes_with_any_part_of_the_graph() -> None:
    def build(name: str = "y", scale: float = 2.0) -> rt.Graph:
        g = rt.Graph()
        x = g.input("x", [4, 3])
        g.save(g.unary(x, "scale", scale), name=name)
        return g

    assert build().fingerprint() == build().fingerprint()
    assert build().fingerprint() != build(name="z").fingerprint()
    assert build().fingerprint() != build(scale=3.0).fingerprint()


def test_copy_tasks_are_labelled_with_their_exchange_program() -> None:
    g = llama_block(1, 32, 32, 4, 2, 48, dtype="float32")
    cg = rt.compileGraph(g, device="cpu:4")
    names = set(cg.exchange_programs())
    copies = cg.dag.transfers()
    assert copies and all(t.label.split(": ", 1)[0] in names for t in copies)
    feeds = {n.name: np.random.default_rng(0).standard_normal(n.type.shape).astype(np.float32) for n in g.inputs}
    np.testing.assert_allclose(cg.run(feeds)[next(iter(g.outputs))], rt.reference(g, feeds)[next(iter(g.outputs))],
                               rtol=1e-4, atol=1e-4)


def test_every_table_and_column_carries_its_meaning_and_the_docs_say_the_same() -> None:
    from relational_tensors.catalog import Catalog
    from relational_tensors.catalog.dictionary import data_dictionary

    cat = Catalog()
    (db,), = cat.con.execute("SELECT current_database()").fetchall()
    bare = cat.con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = ? AND schema_name = 'main' "
                           "AND (comment IS NULL OR comment = '')", [db]).fetchall()
    assert bare == []
    bare = cat.con.execute(
        "SELECT c.table_name, c.column_name FROM duckdb_columns() c JOIN duckdb_tables() t "
        "ON t.database_name = c.database_name AND t.table_name = c.table_name "
        "WHERE c.database_name = ? AND c.schema_name = 'main' AND (c.comment IS NULL OR c.comment = '')",
        [db]).fetchall()
    assert bare == []
    committed = (Path(__file__).parent.parent / "docs" / "catalog.md").read_text()
    assert data_dictionary(cat.con) == committed, (
        "docs/catalog.md is stale: python -m relational_tensors.catalog.dictionary > docs/catalog.md")


def test_stock_duckdb_reads_every_view_and_comment_of_a_persisted_catalog(tmp_path: Path) -> None:
    import subprocess
    import sys

    from relational_tensors.catalog.memory import VIEWS

    path = tmp_path / "one.duckdb"
    cg = rt.compileGraph(llama_block(1, 16, 32, 4, 2, 48, dtype="float32"), device="cpu:2", catalog=str(path))
    cg.simulate(record=True)
    cg.catalog.close()
    script = ("import duckdb, sys\n"
              "con = duckdb.connect(sys.argv[1], read_only=True)\n"
              "for v in sys.argv[2:]:\n"
              "    print(v, len(con.execute(f'SELECT * FROM {v}').fetchall()))\n"
              "q = \"SELECT count(*) FROM duckdb_columns() WHERE comment <> ''\"\n"
              "print('comments', con.execute(q).fetchall()[0][0])\n"
              "for m in ('plan_diff(1, 1)', 'chosen_vs_cheapest(1)', 'traffic_by_device_pair(1)', 'time_by_kind(1)'):\n"
              "    print(m.split('(')[0], len(con.execute(f'SELECT * FROM {m}').fetchall()))\n")
    out = subprocess.run([sys.executable, "-c", script, str(path), *VIEWS], capture_output=True, text=True, check=True)
    counts = dict(line.split() for line in out.stdout.splitlines())
    assert all(int(counts[v]) > 0 for v in VIEWS) and int(counts["comments"]) >= 150
    # the table macros are in the file too, so the stock client runs the research questions as well
    ops = len(cg.graph.operators)
    assert [int(counts[m]) for m in ("plan_diff", "chosen_vs_cheapest")] == [ops, ops]
    assert int(counts["traffic_by_device_pair"]) > 0 and int(counts["time_by_kind"]) > 0


def test_the_table_macros_answer_what_the_named_queries_answer(compiled: tuple[Path, list]) -> None:
    _, (a, b, step) = compiled
    step.simulate(record=True)
    for cg, name, params, call in [
            (b, "plan_diff", {"a": a.compilation_id, "b": b.compilation_id},
             f"plan_diff({a.compilation_id}, {b.compilation_id})"),
            (b, "chosen_vs_cheapest", {}, f"chosen_vs_cheapest({b.compilation_id})"),
            (step, "traffic_by_device_pair", {}, f"traffic_by_device_pair({step.compilation_id})"),
            (step, "time_by_kind", {}, f"time_by_kind({step.compilation_id})")]:
        got = cg.sql(f"SELECT * FROM {call}").to_pylist()
        assert got and got == cg.query(name, **params).to_pylist(), name
    diff = b.sql(f"SELECT * FROM plan_diff({a.compilation_id}, {b.compilation_id})").to_pylist()
    assert len(diff) == len(a.graph.operators) and any(r["changed"] for r in diff)  # p=2 against p=5

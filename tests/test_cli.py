"""The command line, end to end (its main in this process, the entry point in subprocesses), and the
plan views it prints (placements, tiling grids)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import relational_tensors as rt
from relational_tensors.cli import main as cli
from relational_tensors.core.types import Box
from relational_tensors.driver.visualize import Layout, placement_notation, plan_rows, show_tiling
from relational_tensors.graph.models import llama_block
from relational_tensors.machine.devices import visible_gpus

MLP = '''
import relational_tensors as rt

def build():
    g = rt.Graph()
    x = g.input("x", [64, 32]); w1 = g.parameter("w1", [32, 64]); w2 = g.parameter("w2", [64, 32])
    h = g.unary(g.matmul(x, w1, name="up"), "relu", name="act")
    g.save(g.matmul(h, w2, name="down"), name="y")
    return g
'''

# a module-level graph whose [2, 3] output splits into at most 6 blocks
SMALL = '''
import relational_tensors as rt

graph = rt.Graph()
a = graph.input("a", [2, 3])
graph.save(graph.unary(a, "relu", name="r"), name="y")
'''

TORCH_MLP = '''
import torch

def build():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return module, (torch.randn(4, 8),)
'''

FILES = {"mlp.py": MLP, "small.py": SMALL, "torch_mlp.py": TORCH_MLP, "nobuild.py": "x = 1\n",
         "broken.py": "def build():\n    raise RuntimeError('no weights here')\n"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for name, text in FILES.items():
        (d / name).write_text(text)
    return d


def run_cli_process(*args: object, cwd: Path | None = None, stdin: str | None = None
                    ) -> subprocess.CompletedProcess[str]:
    """The command line as users run it: ``python -m relational_tensors`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "relational_tensors", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, input=stdin, timeout=120)


def run_cli(*args: object, cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command line's ``main`` in this process (a process start costs more than most commands), its
    output and exit status captured as a subprocess's; with a working directory, in a subprocess."""
    if cwd is not None:
        return run_cli_process(*args, cwd=cwd, stdin=stdin)
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            _stdin(io.StringIO(stdin if stdin is not None else "")):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _stdin(stream: io.StringIO) -> Iterator[None]:
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout


def one_line_error(r: subprocess.CompletedProcess[str], *words: str) -> str:
    """The failure contract: nonzero status, one stderr line with the program's prefix, no traceback."""
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("relational-tensors: error: ")
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0]
    return lines[0]


def check_chrome_trace(path: Path) -> list[dict[str, Any]]:
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ts"] >= 0 and e["dur"] > 0
    assert all(e["ph"] in ("X", "M") for e in events)
    return events


# ---------------------------------------------------------------------------------------------- commands


def test_help_lists_every_command() -> None:
    out = ok(run_cli("--help"))
    for command in ("demo", "plan", "explain", "simulate", "trace", "exchange", "sql", "calibrate"):
        assert command in out


def test_plan_prints_the_table_with_placements_and_the_predicted_time(models: Path) -> None:
    out = ok(run_cli("plan", models / "mlp.py", "--devices", "cpu:4"))
    assert "placement" in out and "up" in out and "down" in out
    assert "predicted time of one execution on hgx-h200" in out


def test_plan_json_carries_rows_and_prediction(models: Path) -> None:
    r = run_cli("--json", "plan", models / "mlp.py", "--devices", "4", "--topology", "dgx-a100",
                "--selector", "greedy", "--cost-model", "bytes", "--seed", "1")
    doc = json.loads(ok(r))
    assert (doc["p"], doc["devices"], doc["topology"]) == (4, "cuda:0,1,2,3", "dgx-a100")
    assert (doc["selector"], doc["cost_model"]) == ("greedy", "bytes")
    assert doc["predicted_s"] > 0
    assert [row["op_name"] for row in doc["rows"]] == ["up", "act", "down"]
    assert all(row["placement"] for row in doc["rows"])


def test_plan_with_the_calibrated_model_and_search(models: Path) -> None:
    r = run_cli("--json", "plan", models / "mlp.py", "--devices", "4", "--topology", "dgx-a100",
                "--cost-model", "calibrated", "--schedule", "search", "--search-budget", "0.05",
                "--attention", "flash")
    doc = json.loads(ok(r))
    assert doc["cost_model"] == "calibrated" and doc["predicted_s"] > 0
    out = ok(run_cli("explain", models / "mlp.py", "--devices", "cpu:4", "--cost-model", "calibrated"))
    assert "cost model=calibrated (µs)" in out and "total cost" in out


def test_plan_with_a_hand_plan_constraints_and_a_saved_plan(models: Path, tmp_path: Path) -> None:
    saved = tmp_path / "mlp.plan"
    doc = json.loads(ok(run_cli("--json", "plan", models / "mlp.py", "--devices", "cpu:4", "--plan", "megatron_tp",
                                "--constraint", "x=S(0)", "--save-plan", saved)))
    splits = {row["op_name"]: row["split"] for row in doc["rows"]}
    assert splits["up"].endswith("k=4") and "j=4" in splits["down"]  # column- then row-parallel
    g = cli.load_graph(str(models / "mlp.py"))
    again = rt.load_plan(saved, g)
    assert {n.name: again.plan.split(n.id) for n in g.operators} == splits and again.constraints()["x"] == "S(0)"
    one_line_error(run_cli("plan", models / "mlp.py", "--devices", "cpu:4", "--constraint", "x"), "NAME=VALUE")
    r = run_cli("plan", models / "mlp.py", "--devices", "cpu:4", "--plan", "tp")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_two_constraints_on_one_tensor_are_refused_naming_both(models: Path) -> None:
    r = run_cli("plan", models / "mlp.py", "--devices", "cpu:4", "--constraint", "x=R", "--constraint", "x=S(0)")
    one_line_error(r, "--constraint x=R", "--constraint x=S(0)")
    ok(run_cli("plan", models / "mlp.py", "--devices", "cpu:4", "--constraint", "x=R", "--constraint", "x=R", "-q"))


def test_module_level_graph_with_a_memory_limit(models: Path) -> None:
    out = ok(run_cli("plan", models / "small.py", "--devices", "cpu:2", "--memory-per-device", "1MiB", "--quiet"))
    assert " r " in out and "predicted_s" in out


def test_torch_module_factory_is_traced(models: Path) -> None:
    pytest.importorskip("torch")
    doc = json.loads(ok(run_cli("plan", models / "torch_mlp.py", "--devices", "cpu:2", "--json")))
    assert doc["p"] == 2 and any(row["op_kind"] == "matmul" for row in doc["rows"])


def test_explain_prints_the_table_only(models: Path) -> None:
    out = ok(run_cli("explain", models / "mlp.py", "--devices", "cpu:2"))
    assert "placement" in out and "total cost" in out and "predicted" not in out


def test_simulate_prints_seconds(models: Path) -> None:
    quiet = float(ok(run_cli("simulate", models / "mlp.py", "--topology", "pcie", "-q")))
    doc = json.loads(ok(run_cli("simulate", models / "mlp.py", "--topology", "pcie", "--json")))
    assert quiet > 0 and doc["predicted_s"] == pytest.approx(quiet) and doc["topology"] == "pcie"


def test_topology_from_a_json_file(models: Path, tmp_path: Path) -> None:
    from relational_tensors.machine.machines import get_topology

    (tmp_path / "a100.json").write_text(get_topology("dgx-a100").to_json())
    by_file = json.loads(ok(run_cli("simulate", models / "mlp.py", "--topology", tmp_path / "a100.json", "--json")))
    assert by_file["topology"] == "dgx-a100"
    by_name = rt.compileGraph(cli.load_graph(str(models / "mlp.py")), device="cpu:8").simulate("dgx-a100")
    assert by_file["predicted_s"] == pytest.approx(by_name)


def test_trace_writes_a_chrome_trace(models: Path, tmp_path: Path) -> None:
    out = ok(run_cli("trace", models / "mlp.py", tmp_path / "plan.json", "--devices", "cpu:4"))
    assert str(tmp_path / "plan.json") in out
    check_chrome_trace(tmp_path / "plan.json")


def test_exchange_prints_one_program(models: Path) -> None:
    out = ok(run_cli("exchange", models / "mlp.py", "down", "--devices", "cpu:4"))
    assert "GPUS: 0, 1, 2, 3" in out and "IN:" in out and "OUT:" in out
    doc = json.loads(ok(run_cli("--json", "exchange", models / "mlp.py", "y", "--devices", "cpu:4")))
    assert doc["op"] == "save:y" and "PARTITIONS:" in doc["program"]


def test_exchange_of_an_unknown_operator_names_the_known_ones(models: Path) -> None:
    one_line_error(run_cli("exchange", models / "mlp.py", "nope"), "'nope'", "up, act, down")


@pytest.mark.parametrize("args, words", [
    (("plan", "missing.py"), ("no such file", "missing.py")),
    (("plan", "nobuild.py"), ("neither build() nor a module-level graph",)),
    (("simulate", "broken.py"), ("build() failed", "no weights here")),
    (("plan", "mlp.py", "--topology", "nope"), ("unknown topology 'nope'", "hgx-h200")),
    (("explain", "small.py", "--devices", "cpu:0"), ("device count must be at least 1", "'cpu:0'")),
    (("plan", "mlp.py", "--devices", "tpu:3"), ("'tpu:3'",)),
], ids=["missing-file", "no-build", "build-raises", "unknown-topology", "zero-devices", "bad-device"])
def test_bad_input_is_one_line_on_stderr(models: Path, args: tuple[str, ...], words: tuple[str, ...]) -> None:
    one_line_error(run_cli(*args, cwd=models), *words)


def test_debug_shows_the_traceback(models: Path) -> None:
    r = run_cli("--debug", "plan", "missing.py", cwd=models)
    assert r.returncode != 0 and "Traceback" in r.stderr and "CommandError" in r.stderr


@pytest.fixture(scope="module")
def catalog(models: Path) -> Path:
    path = models / "plans.duckdb"
    for devices in ("cpu:2", "cpu:4"):
        ok(run_cli("plan", models / "mlp.py", "--devices", devices, "--catalog", path, "-q"))
    return path


def test_sql_queries_a_catalog_written_by_plan(catalog: Path) -> None:
    q = "SELECT device, plan_cost FROM compilations ORDER BY compilation_id"
    assert [row["device"] for row in json.loads(ok(run_cli("sql", catalog, q, "--json")))] == ["cpu:2", "cpu:4"]
    out = ok(run_cli("sql", catalog, "SELECT op_name, split FROM plan WHERE compilation_id = 2 ORDER BY op_id"))
    assert "op_name" in out and "down" in out and "3 rows" in out


def test_sql_errors(catalog: Path, tmp_path: Path) -> None:
    one_line_error(run_cli("sql", catalog, "SELEC nonsense"), "syntax error")
    one_line_error(run_cli("sql", tmp_path / "none.duckdb", "SELECT 1"), "no catalog file")


@pytest.mark.parametrize("command", [("sql", "SELECT count(*) FROM compilations"), ("query", "plan_cost")])
def test_a_truncated_catalog_is_refused_naming_the_file(catalog: Path, tmp_path: Path,
                                                        command: tuple[str, str]) -> None:
    cut = tmp_path / "cut.duckdb"
    data = catalog.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    one_line_error(run_cli(command[0], cut, command[1]), "truncated or damaged", str(cut))
    assert cut.read_bytes() == data[:len(data) // 2]


def test_sql_runs_a_script_of_multi_line_statements_from_stdin_a_file_or_the_argument(catalog: Path,
                                                                                       tmp_path: Path) -> None:
    script = ("-- two statements over several lines, each result shown\n"
              "SELECT count(*) AS n_ops\n  FROM plan\n WHERE compilation_id = 1;\n\n"
              "SELECT 41 + 1\n    AS answer;\n")
    for r in (run_cli("sql", catalog, stdin=script), run_cli("sql", catalog, script)):
        out = ok(r)
        assert "n_ops" in out and "answer" in out and "42" in out
    f = tmp_path / "script.sql"
    f.write_text(script)
    got = json.loads(ok(run_cli("--json", "sql", catalog, "-f", f)))  # several statements: each with its rows
    assert [list(res["rows"][0]) for res in got] == [["n_ops"], ["answer"]]
    # the project's own multi-line named query, through stdin
    from relational_tensors.catalog import load_sql

    out = ok(run_cli("sql", catalog, stdin=load_sql("queries/repartitions.sql").replace("$cid", "1")))
    assert "rows in" in out
    # a script that does not parse runs nothing; one that fails stops there, after the results before it
    r = run_cli("sql", catalog, "SELECT 7 AS seven; SELEC nonsense; SELECT 'never' AS unreached")
    assert "seven" not in r.stdout
    one_line_error(r, "syntax error")
    r = run_cli("sql", catalog, "SELECT 7 AS seven; SELECT * FROM no_such_table; SELECT 'never' AS unreached")
    assert "seven" in r.stdout and "unreached" not in r.stdout
    one_line_error(r, "no_such_table")


def test_sql_reads_never_change_the_file_and_writes_need_write(catalog: Path) -> None:
    import hashlib

    before = hashlib.sha256(catalog.read_bytes()).hexdigest()
    ok(run_cli("sql", catalog, "SELECT * FROM plan; SELECT * FROM compilations; FROM tasks LIMIT 3"))
    assert hashlib.sha256(catalog.read_bytes()).hexdigest() == before
    one_line_error(run_cli("sql", catalog, "DELETE FROM chosen WHERE compilation_id = 1"), "--write")
    assert hashlib.sha256(catalog.read_bytes()).hexdigest() == before
    out = ok(run_cli("sql", "--csv", catalog, "SELECT compilation_id, device FROM compilations ORDER BY 1"))
    assert out.splitlines()[:3] == ['"compilation_id","device"', '1,"cpu:2"', '2,"cpu:4"']
    notes = catalog.parent / "notes.duckdb"
    notes.write_bytes(catalog.read_bytes())  # a copy: --write changes it, the module's file stays as planned
    ok(run_cli("sql", "--write", notes, "CREATE TABLE my_notes AS SELECT 'fast' AS remark"))
    assert "fast" in ok(run_cli("sql", notes, "SELECT remark FROM my_notes"))
    wide = ok(run_cli("sql", catalog, "SELECT * FROM compilations WHERE compilation_id = 1"))
    assert "-- row 1" in wide and "graph_fingerprint :" in wide  # too wide for a table: shown vertically


def test_calibrate_without_a_gpu_is_a_clear_error() -> None:
    if visible_gpus():
        pytest.skip("a GPU is visible: calibrate would measure it")
    one_line_error(run_cli("calibrate", "--quick"), "GPU")


def test_calibrate_hands_its_arguments_to_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("relational_tensors.kernels.probes")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "relational_tensors.kernels.probes", fake)
    assert cli.main(["--quiet", "calibrate", "--out", "c.json", "--quick"]) == 3
    assert seen == [["--out", "c.json", "--quick"]]


def test_demo_runs_checks_and_writes_a_trace(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    r = run_cli("demo", "--trace", tmp_path / "demo.json", "--topology", "dgx-h100", cwd=tmp_path)
    took = time.perf_counter() - t0
    out = ok(r)
    assert took < 30, f"the demo took {took:.1f}s"
    assert "OK" in out and "MISMATCH" not in out
    assert "predicted time of one execution on dgx-h100" in out
    assert str(tmp_path / "demo.json") in out.replace("\n", "")
    check_chrome_trace(tmp_path / "demo.json")


def test_parse_bytes() -> None:
    assert cli.parse_bytes("2KiB") == 2048 and cli.parse_bytes("3 GB") == 3 * 10**9
    with pytest.raises(Exception, match="byte count"):
        cli.parse_bytes("lots")


# ---------------------------------------------------------------------------------------------- plan views


def matmul_plan(m: int, k: int, n: int, p: int) -> Any:
    g = rt.Graph()
    a = g.input("a", [m, k])
    w = g.parameter("w", [k, n])
    g.save(g.matmul(a, w, name="mm"), name="y")
    return rt.compileGraph(g, device=f"cpu:{p}")


def test_rows_split_is_S0_and_the_weight_is_replicated() -> None:
    cg = matmul_plan(64, 4, 4, 2)
    assert cg.plan.split("mm") == "i=2,j=1,k=1"
    assert (placement_notation(cg, "mm"), placement_notation(cg, "a"), placement_notation(cg, "w")) == \
        ("S(0)", "S(0)", "R")
    grid = show_tiling(cg, "mm")
    assert "[S(0)]" in grid and "[0,32)" in grid and "[32,64)" in grid
    assert "0,1" in show_tiling(cg, "w")  # both devices read the whole weight


def test_contraction_split_is_a_partial_sum() -> None:
    cg = matmul_plan(4, 64, 4, 2)
    assert cg.plan.split("mm") == "i=1,j=2,k=1"  # j is the contracted index here
    assert placement_notation(cg, "mm") == "P(sum)"
    assert (placement_notation(cg, "a"), placement_notation(cg, "w")) == ("S(1)", "S(0)")
    assert "0+1" in show_tiling(cg, "mm")


def test_column_and_two_dimensional_splits() -> None:
    cg = matmul_plan(4, 4, 64, 2)
    assert cg.plan.split("mm") == "i=1,j=1,k=2" and placement_notation(cg, "mm") == "S(1)"
    cg = matmul_plan(64, 64, 64, 8)
    assert cg.plan.split("mm") == "i=2,j=2,k=2"
    assert placement_notation(cg, "mm") == "S(0)S(1)P(sum)"
    assert placement_notation(cg, "w") == "S(0)S(1)R"


def test_data_parallel_llama_block_is_S0_throughout() -> None:
    g = llama_block(batch=4, seq=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=48)
    cg = rt.compileGraph(g, device="cpu:4")
    assert all(cg.plan.split(n.id).split(",")[0] in ("batch=4", "b0=4") for n in g.operators)
    assert placement_notation(cg, "y") == placement_notation(cg, "ffn_residual") == "S(0)"
    assert placement_notation(cg, "x") == "S(0)" and placement_notation(cg, "wq") == "R"
    rows = plan_rows(cg)
    assert {r["placement"] for r in rows} == {"S(0)"}
    assert list(rows[0])[:5] == ["op_name", "op_kind", "split", "output_tiling", "placement"]


def test_three_split_dimensions_draw_one_grid_per_block_of_the_first() -> None:
    g = rt.Graph()
    a = g.input("a", [2, 2, 2])
    g.save(g.unary(a, "relu", name="r"), name="y")
    cg = rt.compileGraph(g, device="cpu:8")
    assert cg.plan.split("r") == "d0=2,d1=2,d2=2"
    assert placement_notation(cg, "r") == "S(0)S(1)S(2)"
    text = show_tiling(cg, "r")
    assert "d0 [0,1)" in text and "d0 [1,2)" in text and "d1 \\ d2" in text


def test_input_read_differently_by_two_consumers() -> None:
    g = rt.Graph()
    x = g.input("x", [64, 4])
    w = g.parameter("w", [4, 4])
    t = g.input("t", [4, 64])
    g.save(g.matmul(x, w, name="rows"), name="y")
    g.save(g.matmul(g.matmul(t, x, name="contract"), w, name="after"), name="z")
    cg = rt.compileGraph(g, device="cpu:2")
    assert [cg.plan.split(op) for op in ("rows", "contract", "after")] == ["i=2,j=1,k=1", "i=1,j=2,k=1",
                                                                          "i=1,j=1,k=2"]
    assert placement_notation(cg, "x") == "S(0)"  # both consumers read halves of its rows
    assert placement_notation(cg, "w") == "R by rows; S(1) by after"
    text = show_tiling(cg, "w")
    assert "read by rows" in text and "read by after" in text and "0,1" in text
    with pytest.raises(rt.GraphError, match="no tensor named 'nope'"):
        show_tiling(cg, "nope")


def layout(blocks: dict[Box, tuple[int, ...]], partial: str | None = None) -> Layout:
    return Layout("t", Box((0, 0), (8, 4)), ("a", "b"), blocks, partial, "test")


def test_notation_of_uneven_mixed_and_overlapping_layouts() -> None:
    halves = {Box((0, 0), (4, 4)): (0,), Box((4, 0), (8, 4)): (1,)}
    assert layout(halves).notation() == "S(0)"
    assert layout({Box((0, 0), (2, 4)): (0,), Box((2, 0), (8, 4)): (1,)}).notation() == "-"  # uneven
    assert layout({Box((0, 0), (4, 4)): (0, 1), Box((4, 0), (8, 4)): (2,)}, "sum").notation() == "-"  # mixed
    assert layout({Box((0, 0), (8, 4)): (0, 1), Box((4, 0), (8, 4)): (2,)}).notation() == "-"  # overlapping
    assert layout({Box((0, 0), (8, 4)): (0, 1, 2)}, "lse").notation() == "P(lse)"
    assert layout({Box((0, 0), (8, 4)): (0, 1, 2)}).notation() == "R"
    assert layout({Box((0, 0), (8, 4)): (0,)}).notation() == "R"
    assert layout({Box((0, 0), (4, 4)): (0, 2), Box((4, 0), (8, 4)): (1, 3)}, "max").notation() == "S(0)P(max)"


def test_every_named_query_runs_from_the_command_line(catalog: Path) -> None:
    from relational_tensors.cli.main import _query_list

    params = {"plan_diff": ["--param", "a=1", "--param", "b=2"], "cheapest_candidates": ["--param", "kind=matmul"]}
    names = _query_list()
    assert {"plan_diff", "chosen_vs_cheapest", "traffic_by_device_pair", "time_by_kind", "repartitions"} <= set(names)
    for name in names:
        out = ok(run_cli("query", catalog, name, *params.get(name, [])))
        assert f"{name} on compilation 2" in out, name  # the latest compilation by default
    rows = json.loads(ok(run_cli("--json", "query", catalog, "plan_diff", "--param", "a=1", "--param", "b=2")))
    assert rows and {"split_a", "split_b", "changed"} <= set(rows[0])
    first = json.loads(ok(run_cli("--json", "query", catalog, "traffic_by_device_pair", "--compilation", "1")))
    assert all(r["src_device"] in (0, 1) for r in first)  # compilation 1 was planned for 2 devices
    one_line_error(run_cli("query", catalog, "plan_diff"), "not given")
    one_line_error(run_cli("query", catalog, "no_such_query"), "no named query")
    one_line_error(run_cli("query", catalog, "repartitions", "--param", "bad"), "NAME=VALUE")


def test_a_long_compile_shows_its_passes_and_the_library_prints_nothing(monkeypatch, capsys, caplog) -> None:
    import io
    import logging

    from rich.console import Console

    g = llama_block(1, 64, 64, 4, 2, 128)
    clock = iter(range(0, 10_000, 2))  # every reading two seconds later: the bar appears at the first pass
    from relational_tensors.cli import output as cli_output

    monkeypatch.setattr(cli_output.time, "monotonic", lambda: float(next(clock)))
    ui = cli.Ui(json=False, quiet=False, debug=False)
    buf = io.StringIO()
    ui.err = Console(file=buf, force_terminal=True, width=120)
    with caplog.at_level(logging.INFO, logger="relational_tensors.compile"), ui.compiling("planning"):
        rt.compileGraph(g, device="cpu:2")
    assert "passes" in buf.getvalue() and "planning: " in buf.getvalue()
    timed = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("pass lower") for m in timed) and timed[-1].startswith("compiled ")
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # nothing printed by the library itself

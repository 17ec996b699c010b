"""The graph API and the compile options: every nonsense value is refused with a typed error that
states the rule and what it got; values that are fine in another spelling (a NumPy integer size) work.

Each case failed before (a raw TypeError, ValueError or duckdb exception, or silent acceptance)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import relational_tensors as rt

SQL_LITERAL = "SELECT A.i, SUM(A.v * 'x') AS v FROM A GROUP BY A.i"


def _block(g: rt.Graph) -> rt.Tensor:
    return g.input("x", [1, 8, 2, 4])


GRAPH_CASES = {
    "rmsnorm eps None": (lambda g: g.rmsnorm(g.input("x", [4, 4]), g.input("w", [4]), None),
                         "rmsnorm eps must be a finite number >= 0; got None"),
    "rmsnorm eps string": (lambda g: g.rmsnorm(g.input("x", [4, 4]), g.input("w", [4]), "1e-5"),
                           "rmsnorm eps must be a finite number >= 0; got '1e-5'"),
    "rmsnorm eps inf": (lambda g: g.rmsnorm(g.input("x", [4, 4]), g.input("w", [4]), float("inf")),
                        "got inf"),
    "layernorm eps negative": (lambda g: g.layernorm(g.input("x", [4, 4]), g.input("w", [4]), g.input("b", [4]),
                                                     -1.0), "layernorm eps must be a finite number >= 0; got -1.0"),
    "scale nan": (lambda g: g.unary(g.input("x", [4]), "scale", float("nan")),
                  "the arg of unary 'scale' must be a finite number; got nan"),
    "add_scalar inf": (lambda g: g.unary(g.input("x", [4]), "add_scalar", float("-inf")), "got -inf"),
    "rope base inf": (lambda g: g.rope(_block(g), float("inf")), "rope base must be a finite number > 0; got inf"),
    "rope base nan": (lambda g: g.rope(_block(g), float("nan")), "got nan"),
    "rope seq_ends int": (lambda g: g.rope(_block(g), 500.0, 8), "rope seq_ends must be a list of integers; got 8"),
    "attention scale nan": (lambda g: g.attention(_block(g), _block_kv(g, "k"), _block_kv(g, "v"),
                                                  scale=float("nan")), "attention scale must be a finite number"),
    "sum repeated axis": (lambda g: g.sum(g.input("x", [4, 4]), (0, 0)),
                          r"sum takes each axis once; got axes=\(0, 0\)"),
    "sum axis and its negative": (lambda g: g.sum(g.input("x", [4, 4]), (1, -1)), "sum takes each axis once"),
    "dtype None": (lambda g: g.input("x", [4], None), "dtype must be one of .*; got None"),
    "dims not strings": (lambda g: g.input("x", [4, 4], dims=(1, 2)), r"dimension names must be non-empty strings"),
    "dims empty string": (lambda g: g.input("x", [4, 4], dims=("a", "")), "non-empty strings"),
    "shape an int": (lambda g: g.input("x", 5), "a tensor shape is a sequence of positive integers; got 5"),
    "shape with a float": (lambda g: g.input("x", [4, 2.0]), "tensor dimensions must be positive integers"),
    "shape of a bool": (lambda g: g.input("x", [True, 4]), "tensor dimensions must be positive integers"),
    "shape beyond int64 bytes": (lambda g: g.input("x", [2**40, 2**40]), r"at most 2\*\*62 bytes"),
    "sql string literal": (lambda g: g.sql(SQL_LITERAL, A=(g.input("a", [4, 4]), ("i", "j"))), "literal 'x'"),
}


def _block_kv(g: rt.Graph, name: str) -> rt.Tensor:
    return g.input(name, [1, 8, 2, 4])


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_graph_api_refuses(case: str) -> None:
    build, words = GRAPH_CASES[case]
    with pytest.raises(rt.GraphError, match=words):
        build(rt.Graph())


def test_numpy_integer_sizes_are_sizes() -> None:
    g = rt.Graph()
    x = g.input("x", [np.int64(6), np.int32(4)])
    assert x.shape == (6, 4) and all(type(s) is int for s in x.shape)
    g.save(g.unary(x, "relu"), name="y")
    feeds = {"x": np.arange(24, dtype=np.float32).reshape(6, 4) - 12}
    np.testing.assert_array_equal(rt.compileGraph(g, device="cpu:2").run(feeds)["y"], np.maximum(feeds["x"], 0))


def _tiny() -> rt.Graph:
    g = rt.Graph()
    g.save(g.unary(g.input("x", [4, 4]), "relu"), name="y")
    return g


OPTION_CASES = {
    "seed negative": (dict(seed=-1, selector="random"), rt.PlanError, r"seed must be an integer in \[0, 2\*\*31\)"),
    "seed string": (dict(seed="abc"), rt.PlanError, "seed must be an integer; got 'abc'|got 'abc'"),
    "seed too large": (dict(seed=2**40), rt.PlanError, "seed must be an integer"),
    "memory beyond int64": (dict(memory_per_device=2**70), rt.PlanError, r"at most 2\*\*62"),
    "memory a float": (dict(memory_per_device=1e9), rt.PlanError, "memory_per_device must be a positive number"),
    "budget negative": (dict(search_budget_s=-1), rt.PlanError, "search_budget_s must be a positive number"),
    "budget nan": (dict(search_budget_s=float("nan")), rt.PlanError, "search_budget_s must be a positive number"),
    "label not a string": (dict(label=3), rt.PlanError, "label must be a string"),
    "calibration not a path": (dict(calibration=3), rt.PlanError, "calibration must be the path"),
    "topology a number": (dict(topology=42), rt.PlanError, "topology must be a topology name"),
    "topology empty": (dict(topology=""), rt.ExchangeError, "unknown topology ''"),
    "topology unknown": (dict(topology="no-such-machine"), rt.ExchangeError, "unknown topology 'no-such-machine'"),
    "device bytes": (dict(device=b"cpu:2"), rt.PlanError, "device must be None, an int count"),
    "device count huge": (dict(device=10**9), rt.PlanError, "at most 1024 logical devices; got 1,000,000,000"),
    "cpu count huge": (dict(device="cpu:100000"), rt.PlanError, "at most 1024 logical devices; got 100,000"),
    "gpu list huge": (dict(device=list(range(2000))), rt.PlanError, "at most 1024 logical devices"),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_compile_options_refuse(case: str) -> None:
    options, error, words = OPTION_CASES[case]
    options = {"device": "cpu:2", **options}
    with pytest.raises(error, match=words):
        rt.compileGraph(_tiny(), **options)


def test_a_graph_that_saves_nothing_is_refused() -> None:
    g = rt.Graph()
    g.unary(g.input("x", [4]), "relu")
    with pytest.raises(rt.PlanError, match="the graph saves no output"):
        rt.compileGraph(g, device="cpu:2")


def test_load_of_something_else_and_an_unwritable_trace(tmp_path) -> None:
    cg = rt.compileGraph(_tiny(), device="cpu:2")
    with pytest.raises(rt.ExecError, match="load takes a dict of input name -> array.*got NoneType"):
        cg.load(None)  # type: ignore[arg-type]
    with pytest.raises(rt.ExecError, match="cannot write the trace to .*Give a writable path"):
        cg.trace(str(tmp_path / "no" / "such" / "dir" / "t.json"))


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relational_tensors", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_cli_refuses_in_one_line(tmp_path) -> None:
    model = tmp_path / "model.py"
    model.write_text("import relational_tensors as rt\ndef build():\n    g = rt.Graph(); x = g.input('x', [8, 4])\n"
                     "    g.save(g.unary(x, 'relu'), name='y'); return g\n")
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\ndef build():\n    sys.exit(3)\n")
    for args, words in ((["plan", str(model), "--memory-per-device", "1e400"], "at most 2**62 bytes"),
                        (["plan", str(exits)], "build() called sys.exit(3)")):
        r = _cli(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert words in r.stderr, r.stderr


def test_cli_json_has_no_nan(tmp_path) -> None:
    catalog = tmp_path / "c.duckdb"
    rt.compileGraph(_tiny(), device="cpu:2", catalog=str(catalog))
    r = _cli("--json", "sql", str(catalog), "SELECT 'nan'::DOUBLE AS x, 1.5::DOUBLE AS y")
    assert r.returncode == 0, r.stderr
    assert "NaN" not in r.stdout
    assert json.loads(r.stdout) == [{"x": None, "y": 1.5}]

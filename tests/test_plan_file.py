"""Plans saved and reloaded (``rt.save_plan``, ``rt.load_plan``): the same program without planning again,
bit-identical results, the catalog rows restored, and every file or graph that does not match refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.graph.models import add_llama_block, llama_block, llama_training_feeds, llama_training_graph


def _feeds(g: rt.Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {n.name: rng.standard_normal(n.type.shape).astype(n.type.dtype) for n in g.inputs}


@pytest.mark.parametrize("p,options", [(4, {}), (3, {"cost_model": "calibrated"}),
                                       (4, {"schedule_mode": "search", "search_steps": 20}),
                                       (4, {"constraints": {"x": "S(1)", "attention": "heads_kv=2"}})])
def test_a_reloaded_plan_is_the_same_program_and_gives_the_same_bits(tmp_path: Path, p: int,
                                                                     options: dict) -> None:
    g = llama_block(2, 24, 32, 4, 2, 40)
    cg = rt.compileGraph(g, device=f"cpu:{p}", **options)
    rt.save_plan(cg, tmp_path / "block.plan")
    again = rt.load_plan(tmp_path / "block.plan", g)
    assert again.graph is g and again.plan.choice == cg.plan.choice
    assert again.exchange_programs() == cg.exchange_programs() and again.memory() == cg.memory()
    assert again.constraints() == cg.constraints() and again.explain() == cg.explain()
    feeds = _feeds(g)
    assert np.array_equal(again.run(feeds)["y"], cg.run(feeds)["y"])
    assert again.offload(g.tensor(g.outputs["y"])).shape == (2, 24, 32)  # the caller's tensor handles work
    query = "SELECT op_name, split, total_cost FROM plan ORDER BY op_id"
    assert again.sql(query).to_pylist() == cg.sql(query).to_pylist()
    assert again.simulate() == cg.simulate()


def test_a_reloaded_training_step_keeps_training_bit_for_bit(tmp_path: Path) -> None:
    g = llama_training_graph(2, 16, 32, 4, 2, 48, 64, optimizer="adamw")
    cg = rt.compileGraph(g, device="cpu:4", keep_states="sharded")
    rt.save_plan(cg, tmp_path / "step.plan")
    again = rt.load_plan(tmp_path / "step.plan", g)
    feeds = llama_training_feeds(g)
    states = [n.name for n in g.inputs if n.role == "state"]
    got = []
    for c in (cg, again):
        c.load(feeds)
        for _ in range(2):
            c.execute()
        got.append({s: c.offload(s) for s in [*states, "loss"]})
    assert all(np.array_equal(got[0][k], got[1][k]) for k in got[0])
    assert again.state_layouts() == cg.state_layouts()


def test_a_plan_loads_into_a_catalog_file_as_a_new_compilation(tmp_path: Path) -> None:
    g = llama_block(1, 16, 32, 4, 2, 40)
    cg = rt.compileGraph(g, device="cpu:2", label="original")
    rt.save_plan(cg, tmp_path / "b.plan")
    again = rt.load_plan(tmp_path / "b.plan", g, catalog=tmp_path / "c.duckdb")
    rows = again.sql("SELECT label, status, graph_fingerprint FROM compilations").to_pylist()
    assert rows == [{"label": "original", "status": "ok", "graph_fingerprint": g.fingerprint()}]
    again.catalog.close()
    with rt.catalog.Catalog(tmp_path / "c.duckdb", read_only=True) as cat:
        assert cat.sql("SELECT count(*) AS n FROM plan").to_pylist() == [{"n": len(g.operators)}]


def test_a_plan_for_another_graph_or_a_damaged_file_is_refused(tmp_path: Path) -> None:
    g = llama_block(1, 16, 32, 4, 2, 40)
    path = tmp_path / "b.plan"
    rt.save_plan(rt.compileGraph(g, device="cpu:2"), path)
    for other in (llama_block(1, 17, 32, 4, 2, 40), llama_block(1, 16, 32, 4, 2, 40, eps=1e-6)):
        with pytest.raises(rt.PlanError, match="made for another graph"):
            rt.load_plan(path, other)
    renamed = rt.Graph()  # the same computation, one input named differently
    x = renamed.input("tokens", [1, 16, 32], dims=("batch", "seq", "model"))
    renamed.save(add_llama_block(renamed, x, n_heads=4, n_kv_heads=2, d_ff=40), name="y")
    with pytest.raises(rt.PlanError, match="made for another graph"):
        rt.load_plan(path, renamed)
    data = path.read_bytes()
    (tmp_path / "short.plan").write_bytes(data[: len(data) // 2])
    with pytest.raises(rt.PlanError, match="truncated"):
        rt.load_plan(tmp_path / "short.plan", g)
    (tmp_path / "text.plan").write_text("SELECT 1;\n")
    with pytest.raises(rt.PlanError, match="not a relational_tensors plan file"):
        rt.load_plan(tmp_path / "text.plan", g)
    (tmp_path / "old.plan").write_bytes(data.replace(b'"format": 3', b'"format": 0', 1))
    with pytest.raises(rt.PlanError, match="format 0"):
        rt.load_plan(tmp_path / "old.plan", g)
    (tmp_path / "version.plan").write_bytes(data.replace(b'"package": "', b'"package": "0.0.0-', 1))
    with pytest.raises(rt.PlanError, match="saved by relational_tensors 0.0.0-"):
        rt.load_plan(tmp_path / "version.plan", g)
    with pytest.raises(rt.PlanError, match="cannot read"):
        rt.load_plan(tmp_path / "missing.plan", g)
    with pytest.raises(rt.GraphError, match="rt.Graph"):
        rt.load_plan(path, "g")  # type: ignore[arg-type]
    with pytest.raises(rt.PlanError, match="cannot write"):
        rt.save_plan(rt.compileGraph(g, device="cpu:2"), tmp_path / "no" / "such" / "dir.plan")


def test_a_header_nested_too_deep_or_a_catalog_that_is_no_path_is_refused(tmp_path: Path) -> None:
    from relational_tensors.driver.plan_file import MAGIC

    g = rt.Graph()
    x, w = g.input("x", [10, 6]), g.parameter("w", [6, 5])
    g.save(g.matmul(x, w), name="y")
    path = tmp_path / "mm.plan"
    rt.save_plan(rt.compileGraph(g, device="cpu:3"), path)
    data = path.read_bytes()
    body = data[data.index(b"\n", len(MAGIC)) + 1:]
    (tmp_path / "deep.plan").write_bytes(MAGIC + b"[" * 100_000 + b"]" * 100_000 + b"\n" + body)
    with pytest.raises(rt.PlanError, match="damaged header"):
        rt.load_plan(tmp_path / "deep.plan", g)
    for catalog in (3, 2.5, b"c.duckdb", "", ["c.duckdb"]):
        with pytest.raises(rt.CatalogError, match="catalog is a Catalog, the path of a DuckDB file"):
            rt.load_plan(path, g, catalog=catalog)  # type: ignore[arg-type]
    again = rt.load_plan(path, g, catalog=tmp_path / "c.duckdb")  # a path or None still loads
    assert again.plan.choice == rt.load_plan(path, g).plan.choice

"""Memory: with no memory_per_device a plan is checked against the memory of the target it is for
(each GPU's, an absent machine's from its topology, the host's available memory shared among virtual
CPU devices), refused before it runs, and the limit used is recorded with the compilation."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.graph.models import llama_block, llama_feeds
from relational_tensors.machine import target as target_module


def _wide(rows: int, cols: int) -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", [rows, cols])
    g.save(g.matmul(x, g.parameter("w", [cols, 8])), name="y")
    return g


def test_virtual_cpu_devices_share_the_hosts_available_memory(monkeypatch) -> None:
    monkeypatch.setattr(target_module, "host_available_memory", lambda: 4 * 40_000)  # 40 kB per device of 4
    with pytest.raises(rt.OutOfMemoryPlanError, match=r"needs at least [\d,]+ bytes .* the host's available memory "
                                                      r"per virtual device is 40,000 bytes"):
        rt.compileGraph(_wide(1000, 64), device="cpu:4")  # 256 kB of x alone: 64 kB a device
    cg = rt.compileGraph(_wide(1000, 64), device="cpu:4", memory_per_device=10**6)  # a pinned limit wins
    feeds = {"x": np.ones((1000, 64), np.float32), "w": np.ones((64, 8), np.float32)}
    np.testing.assert_allclose(cg.run(feeds)["y"], np.full((1000, 8), 64.0))


def test_the_limit_used_is_recorded_not_printed(monkeypatch) -> None:
    monkeypatch.setattr(target_module, "host_available_memory", lambda: 3 * 10**9)
    cg = rt.compileGraph(_wide(100, 16), device="cpu:3")
    rows = cg.sql("SELECT memory_per_device FROM compilations").to_pylist()
    assert rows[-1]["memory_per_device"] == 10**9
    assert "1,000,000,000" not in cg.explain(file=open("/dev/null", "w"))


def test_an_absent_machine_is_checked_against_its_topologys_memory() -> None:
    big = _wide(4_000_000, 100_000)  # 1.6 TB of float32: 200 GB a device on 8
    with pytest.raises(rt.OutOfMemoryPlanError, match=r"dgx-a100 GPU per logical device is 42,949,672,960 bytes"):
        rt.compileGraph(big, device=8, topology="dgx-a100")
    with pytest.raises(rt.OutOfMemoryPlanError, match=r"hgx-h200 GPU per logical device is 151,397,597,184 bytes"):
        rt.compileGraph(big, device=8)


def test_the_refusal_quotes_the_peak_of_the_best_plan_found() -> None:
    g = llama_block(batch=1, seq=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96)
    free = max(rt.compileGraph(g, device="cpu:4", memory_per_device=10**9).memory().values())
    leaner = max(rt.compileGraph(g, device="cpu:4", memory_per_device=int(0.9 * free)).memory().values())
    assert leaner < free  # the memory price found a leaner plan
    with pytest.raises(rt.OutOfMemoryPlanError, match="under the best plan found") as refused:
        rt.compileGraph(g, device="cpu:4", memory_per_device=leaner - 1)
    quoted = int(str(refused.value).split(" needs ")[1].split(" bytes")[0].replace(",", ""))
    assert quoted <= leaner


def test_a_refused_compilation_is_recorded_with_its_reason_and_is_no_plan(tmp_path) -> None:
    path = tmp_path / "plans.duckdb"
    rt.compileGraph(_wide(100, 16), device="cpu:2", catalog=path)
    with pytest.raises(rt.OutOfMemoryPlanError):
        rt.compileGraph(_wide(1000, 64), device="cpu:4", memory_per_device=10_000, catalog=path)
    from relational_tensors.catalog import Catalog

    with Catalog(path, read_only=True) as cat:
        rows = cat.sql("SELECT status, error FROM compilations ORDER BY compilation_id").to_pylist()
        planned = cat.sql("SELECT DISTINCT compilation_id FROM plan").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "refused"]
    assert "needs at least" in rows[1]["error"] and rows[0]["error"] is None
    assert planned == [{"compilation_id": 1}]


def test_a_plan_re_chosen_to_fit_runs_and_equals_the_reference() -> None:
    g = llama_block(batch=1, seq=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96)
    free = rt.compileGraph(g, device="cpu:4", memory_per_device=10**9)
    limit = int(0.9 * max(free.memory().values()))
    cg = rt.compileGraph(g, device="cpu:4", memory_per_device=limit)  # the fit_memory pass re-chooses
    assert max(cg.memory().values()) <= limit < max(free.memory().values())
    assert any(cg.plan.split(n.name) != free.plan.split(n.name) for n in g.operators)
    feeds = llama_feeds(g)
    np.testing.assert_allclose(cg.run(feeds)["y"], rt.reference(g, feeds)["y"], rtol=1e-4, atol=1e-5)
    assert cg.executor.peak == [cg.memory()[d] for d in range(4)]

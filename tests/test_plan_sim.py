"""The whole-plan simulator and traces, and the paper's ExProg examples end to end from text."""

from __future__ import annotations

import json

import pytest

import relational_tensors as rt
from relational_tensors.exchange.closure import check
from relational_tensors.exchange.simulator import simulate
from relational_tensors.exchange.text import parse
from relational_tensors.models import LLAMA3_8B, llama_block
from relational_tensors.target.topology import get_topology

A100 = get_topology("dgx-a100")
LAT = A100.route(0, 1).latency
GB = 1e9


def test_paper_example_two_gpus_from_text() -> None:
    prog = parse("""
        GPUS: 0, 1
        IN: A @ 0 (size: 1 GB), B @ 1 (size: 1 GB)
        OUT: A+B @ 0, 1
        A @ 0 -> 1; B @ 1 -> 0
        A+B @ 0; A+B @ 1
    """)
    check(prog)
    # both atoms cross at once (each GPU's egress and ingress carry one flow), then each side
    # aggregates locally: read two atoms, write one, at HBM bandwidth
    expected = LAT + GB / 300e9 + 3 * GB / 1555e9
    assert simulate(prog, A100).time == pytest.approx(expected, rel=1e-9)


def test_paper_example_four_gpus_from_text() -> None:
    prog = parse("""
        GPUS: 0, 1, 2, 3
        IN: A @ 0, B @ 1, C @ 2, D @ 3
        OUT: A+B+C+D @ 0, 1, 2, 3
        B @ 1 -> 0; C @ 2 -> 0; D @ 3 -> 0
        A+B+C+D @ 0 -> 1, 2, 3
    """)
    check(prog)
    # three 1 GB atoms share GPU 0's ingress (100 GB/s each), then a 5-read/1-write aggregation,
    # then a multicast whose three flows share GPU 0's egress
    expected = 2 * LAT + 3 * GB / 300e9 + 5 * GB / 1555e9 + 3 * GB / 300e9
    assert simulate(prog, A100).time == pytest.approx(expected, rel=1e-9)


def test_paper_example_sized_partitions_from_text() -> None:
    prog = parse("""
        GPUS: 0, 1, 2, 3, 4, 5, 6, 7
        PARTITIONS: G1 {size 4}, G2 {size 4}
        IN: A @ 0, B @ 4
        OUT: A @ G1
        OUT: B @ G2
        A @ 0 -> G1
        B @ 4 -> G2
    """)
    check(prog)
    result = simulate(prog, A100)
    assert result.valid
    # the best membership keeps A's owner in G1 and B's in G2: 3 copies out of each source
    assert 0 in result.membership["G1"] and 4 in result.membership["G2"]
    assert result.time == pytest.approx(LAT + 3 * GB / 300e9, rel=1e-9)


@pytest.fixture(scope="module")
def block() -> rt.CompiledGraph:
    return rt.compileGraph(llama_block(1, 8192, dtype="float16", **LLAMA3_8B), device=8, topology="dgx-a100")


def test_whole_plan_schedule_is_consistent(block: rt.CompiledGraph) -> None:
    result = block.simulation()
    assert result.time == pytest.approx(block.simulate())
    by_id = {t.task: t for t in result.tasks}
    for task in block.dag.tasks:
        if task.kind == "load":
            continue
        me = by_id[task.id]
        for b in task.inputs:  # inputs exist before a task starts
            producer = next((t for t in block.dag.tasks if b in t.outputs), None)
            if producer is not None and producer.kind != "load":
                assert by_id[producer.id].end <= me.start + 1e-15
    for d in range(block.p):  # one compute queue per device: no overlap
        spans = sorted((t.start, t.end) for t in result.tasks if t.device == d and t.kind != "copy")
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
    assert result.time == max(t.end for t in result.tasks)


def test_lone_copy_runs_at_link_speed() -> None:
    g = rt.Graph()  # a softmax along rows (split by rows), then one along columns: 2 blocks swap
    y = g.softmax(g.softmax(g.input("x", [4096, 4096], "float16"), axis=1), axis=0)
    g.save(y, name="y")
    cg = rt.compileGraph(g, device=2, topology="dgx-a100")
    copies = [t for t in cg.simulation().tasks if t.kind == "copy"]
    assert len(copies) == 2
    for c in copies:  # the two copies go opposite ways: each has a whole egress and ingress
        assert c.end - c.start == pytest.approx(LAT + c.bytes / 300e9, rel=1e-9)


def test_data_parallel_prediction_is_the_kernel_time(block: rt.CompiledGraph) -> None:
    cg = rt.compileGraph(llama_block(128, 1024, dtype="float16", **LLAMA3_8B), device=8, topology="dgx-a100")
    result = cg.simulation()
    on0 = sum(t.end - t.start for t in result.tasks if t.device == 0)
    assert result.time == pytest.approx(on0)  # no transfers, no waiting: device 0 is busy all along


def test_trace_has_a_track_per_device(block: rt.CompiledGraph, tmp_path) -> None:
    path = block.trace(str(tmp_path / "plan.json"))
    data = json.loads(open(path).read())
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {f"device {d}" for d in range(8)}
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in slices} >= {"kernel", "copy"}
    assert data["otherData"]["predicted_s"] == pytest.approx(block.simulate())


def test_simulating_other_topologies(block: rt.CompiledGraph) -> None:
    a100, h200, v100 = (block.simulate(t) for t in ("dgx-a100", "hgx-h200", "dgx-v100"))
    assert h200 < a100 < v100


def test_calibration_curves_interpolate_and_hold_their_ends(tmp_path) -> None:
    from relational_tensors.target.kernel_model import KernelModel

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"curves": {"matmul": [[1e9, 1e14], [1e12, 5e14]]}}))
    model = KernelModel.from_calibration(A100, str(path))
    lat = A100.launch_latency
    small, mid, big = (model.time(f, 0, "float16", "matmul") - lat for f in (1e6, 10 ** 10.5, 1e15))
    assert small == pytest.approx(1e6 / 1e14)  # below the curve: the smallest point's rate, no floor
    assert big == pytest.approx(1e15 / 5e14)   # above it: the largest point's rate
    assert 10 ** 10.5 / 5e14 < mid < 10 ** 10.5 / 1e14  # between: interpolated in log-size


@pytest.mark.parametrize("gpus", [1, 4, 8, 12])
def test_the_shipped_calibration_serves_every_size_of_its_machine(gpus: int) -> None:
    # a subset (hgx-h200[4]) or a widened switch has the machine's GPUs, so its calibration; the
    # lookup used to miss the subsets and fall back to default efficiencies
    from relational_tensors.target.kernel_model import CALIBRATIONS, KernelModel

    model = KernelModel.from_calibration(get_topology("hgx-h200", gpus=gpus))
    assert model.source == str(CALIBRATIONS / "hgx-h200.json") and model.curves
    assert KernelModel.from_calibration(get_topology("dgx-a100", gpus=gpus)).source == "defaults"

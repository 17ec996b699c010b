"""The whole-plan simulator and traces, and the paper's ExProg examples end to end from text."""

from __future__ import annotations

import json

import pytest

import relational_tensors as rt
from relational_tensors.errors import PlanError
from relational_tensors.exchange.closure import check
from relational_tensors.exchange.membership import fastest_membership
from relational_tensors.exchange.simulator import simulate
from relational_tensors.exchange.text import parse
from relational_tensors.graph.models import LLAMA3_8B, llama_block
from relational_tensors.machine.machines import get_topology
from relational_tensors.physical.simulate import _busy_cost, _compute_cost, simulate_plan

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
    result = fastest_membership(prog, A100)
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
    from relational_tensors.machine.kernel_model import KernelModel

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
    from relational_tensors.machine.kernel_model import CALIBRATIONS, KernelModel

    model = KernelModel.from_calibration(get_topology("hgx-h200", gpus=gpus))
    assert model.source == str(CALIBRATIONS / "hgx-h200.json") and model.curves
    assert KernelModel.from_calibration(get_topology("dgx-a100", gpus=gpus)).source == "defaults"


def _two_products(n: int) -> rt.Graph:
    g = rt.Graph()
    for i, (a, b) in enumerate((("a", "b"), ("c", "d"))):
        g.save(g.matmul(g.input(a, [n, n], "float16"), g.input(b, [n, n], "float16")), name=f"y{i}")
    return g


def test_logical_devices_of_one_gpu_share_its_compute() -> None:
    """Two large products on two logical devices of one GPU: neither device waits on the other in the
    plan, but the GPU does the work of both, so the prediction is near twice that of two GPUs (the
    work at the GPU's best rate, a little under each product's time alone); on another topology the
    same plan's devices stand for GPUs of their own."""
    cg = rt.compileGraph(_two_products(8192), device="cuda:0,0")
    t = cg.target
    assert t.shared_gpus == (0, 0) and cg.dag.bytes_moved() == 0
    apart = simulate_plan(cg.dag, cg.graph, t.topology, t.kernels).time
    shared = cg.simulation()
    assert shared.time == pytest.approx(simulate_plan(cg.dag, cg.graph, t.topology, t.kernels, (0, 0)).time)
    kernels = [k for k in cg.dag.tasks if k.kind == "kernel"]
    busy = sum(_busy_cost(cg.dag, cg.graph, k, t.kernels, _compute_cost(cg.dag, cg.graph, k, t.kernels))
               for k in kernels)
    assert shared.time >= busy  # the GPU's compute is one resource
    assert 1.7 * apart < shared.time <= 2 * apart + 1e-12
    assert cg.simulate(t.topology) == pytest.approx(apart)  # a topology named: a GPU per device


def test_small_tasks_of_logical_devices_overlap() -> None:
    """Small kernels leave the GPU mostly idle alone (launch latency, low rates at small sizes): side by
    side on four logical devices of one GPU they overlap, so the prediction stays far under their times
    summed, and each device's tasks still run one at a time."""
    cg = rt.compileGraph(_two_products(256), device="cuda:0,0,0,0")
    result = cg.simulation()
    alone = {t.task: _compute_cost(cg.dag, cg.graph, cg.dag.tasks[t.task], cg.target.kernels)
             for t in result.tasks if t.kind != "copy"}
    assert result.time < 0.6 * sum(alone.values())
    for d in range(cg.p):
        spans = sorted((t.start, t.end) for t in result.tasks if t.device == d and t.kind != "copy")
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
        for t in result.tasks:  # no task runs faster than alone
            if t.device == d and t.kind != "copy":
                assert t.end - t.start >= alone[t.task] * (1 - 1e-9)


def test_copies_between_logical_devices_of_one_gpu_go_through_its_memory() -> None:
    """The two blocks a row split and a column split swap: on two logical devices of one GPU both copies
    read and write its memory at once, so each moves at a quarter of its bandwidth."""
    g = rt.Graph()
    g.save(g.softmax(g.softmax(g.input("x", [4096, 4096], "float16"), axis=1), axis=0), name="y")
    cg = rt.compileGraph(g, device="cuda:0,0")
    copies = [t for t in cg.simulation().tasks if t.kind == "copy"]
    assert len(copies) == 2 and copies[0].start == copies[1].start
    for c in copies:
        assert c.end - c.start == pytest.approx(c.bytes / (cg.target.topology.hbm_bandwidth / 4), rel=1e-9)


def test_simulating_with_the_wrong_number_of_physical_devices_is_refused() -> None:
    cg = rt.compileGraph(_two_products(64), device="cuda:0,0")
    with pytest.raises(PlanError, match="physical GPU of each; got 3"):
        simulate_plan(cg.dag, cg.graph, cg.target.topology, cg.target.kernels, (0, 0, 0))


@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_the_simulation_prices_the_gpu_executors_fused_kernels(device: str) -> None:
    """On GPUs the executor runs each group of elementwise tasks as one kernel at its last task and does
    nothing for a sibling another kernel writes or a reshape that keeps its input's bytes: the simulation
    prices the group's kernel by the bytes it reads and writes and those tasks at nothing, so an AdamW
    update is one kernel's time, not one per operator."""
    from relational_tensors.graph.models import llama_training_graph
    from relational_tensors.runtime.fusion import simulated_issue

    g = llama_training_graph(1, 256, 128, 4, 2, 256, 512, dtype="bfloat16", optimizer="adamw",
                             master_dtype="float32")
    cg = rt.compileGraph(g, device=device)
    t = cg.target
    issue = simulated_issue(cg.dag, cg.live)
    assert issue.fused and issue.free and not set(issue.fused) & issue.free
    result = cg.simulation()
    plain = simulate_plan(cg.dag, cg.graph, t.topology, t.kernels, t.shared_gpus)
    assert result.time < plain.time
    spans = {x.task: x.end - x.start for x in result.tasks}
    assert all(spans[tid] == 0.0 for tid in issue.free)
    if device == "cuda:0":  # alone on its GPU, a task takes its own time
        for tid, (nbytes, dtype) in issue.fused.items():
            assert spans[tid] == pytest.approx(t.kernels.time(0.0, nbytes, dtype, "compute"))
    off = simulated_issue(cg.dag, cg.live, fuse=False)
    assert not off.fused and off.free < issue.free

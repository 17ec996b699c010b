"""The hand-written PyTorch baselines (bench/baselines) and the measured-topology builder
(bench/measure_topology.py), without GPUs: gloo on CPU in float32 at toy sizes.

Tensor, sequence and data parallelism on 2 and 4 ranks each equal the single-process block, and the
row-sharded chains equal the single-process chains; the single-process block equals
``rt.reference`` of ``llama_block``.  A topology built from a bandwidth matrix survives
``to_json``/``from_json`` and plans and simulates a graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

import relational_tensors as rt  # noqa: E402
from relational_tensors.models import llama_block  # noqa: E402
from relational_tensors.target.topology import Topology  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import measure_topology as mt  # noqa: E402
from baselines import run as baseline_run  # noqa: E402
from baselines.block import block_params, make_input, reference_block  # noqa: E402
from baselines.chain import reference_chain  # noqa: E402
from baselines.common import SHAPES, BlockShape, NotApplicable, free_port, parse_workload  # noqa: E402
from baselines.llama_tp import kv_plan  # noqa: E402

CPU, F32 = torch.device("cpu"), torch.float32
TINY = SHAPES["tiny"]  # d_model 64, 8 heads, 4 kv heads, d_ff 128
ODD_KV = BlockShape(96, 12, 3, 96)  # 3 kv heads on 4 ranks: tp repeats kv heads, grouping off enable_gqa's
CHAIN_SCALE = 256
COMMON = ["--warmups", "0", "--rounds", "1", "--check", "--chain-scale", str(CHAIN_SCALE)]
# per world size: (command lines, the block workloads and shapes they cover)
CASES = {
    2: [["--shape", "tiny", "--strategy", "best", "--workload", "2x32,40,A,B,C,D,E"]],
    4: [["--shape", "tiny", "--strategy", "best", "--workload", "6x30,30,A,B,C,D,E"],  # uneven token and batch splits
        ["--d-model", "96", "--heads", "12", "--kv-heads", "3", "--d-ff", "96", "--strategy", "tp",
         "--workload", "2x24"]],
}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda w: f"world{w}")
def spawned(request, tmp_path_factory):
    """Every case of one world size, run by ``world`` gloo processes; rank 0's results and outputs."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"world{world}")
    argvs = [[*argv, *COMMON, "--save-outputs", str(tmp / f"run{i}")] for i, argv in enumerate(CASES[world])]
    torch.multiprocessing.spawn(baseline_run.worker, args=(world, free_port(), argvs, str(tmp / "out.json")),
                                nprocs=world, join=True)
    results = json.loads((tmp / "out.json").read_text())
    return world, tmp, results


def _single_process(label: str, shape: BlockShape) -> torch.Tensor:
    kind, what = parse_workload(label)
    if kind == "chain":
        return reference_chain(what, 0, CPU, F32, CHAIN_SCALE)
    return reference_block(*what, shape, 0, CPU, F32)


def test_every_strategy_equals_the_single_process_run(spawned) -> None:
    world, tmp, results = spawned
    compared = []
    for i, result in enumerate(results):
        shape = BlockShape(**result["header"]["shape"])
        for row in result["rows"]:
            if row["status"] == "not applicable":
                continue
            assert row["status"] == "ok", row
            assert row["check"]["ok"], row  # rank 0's own comparison
            saved = tmp / f"run{i}" / f"{row['workload']}_{row['strategy']}_w{world}.pt"
            out = torch.load(saved)
            torch.testing.assert_close(out, _single_process(row["workload"], shape), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, row=row: f"{row['strategy']} on {row['workload']}, "
                                                              f"{world} ranks: {m}")
            compared.append((row["workload"], row["strategy"]))
    blocks = {s for w, s in compared if w not in "ABCDE"}
    chains = {w for w, s in compared if s == "chain"}
    assert blocks == {"tp", "sp", "dp"} and chains == set("ABCDE"), compared


def test_statuses_and_best(spawned) -> None:
    world, _, results = spawned
    rows = {(r["workload"], r["strategy"]): r for r in results[0]["rows"]}
    single = "40" if world == 2 else "30"
    assert rows[(single, "dp")]["status"] == "not applicable"
    assert "batch >= world" in rows[(single, "dp")]["reason"]
    best = results[0]["best"]
    assert best[single]["strategy"] in ("tp", "sp") and set(best[single]["tried"]) == {"tp", "sp"}
    assert all(best[c]["strategy"] == "chain" for c in "ABCDE")
    assert all(r["ms"] > 0 and r["world"] == world for r in results[0]["rows"] if r["status"] == "ok")
    if world == 4:  # 3 kv heads do not split over 4 ranks: tp computes the kv heads each rank reads
        (odd,) = results[1]["rows"]
        assert odd["status"] == "ok" and "does not divide" in odd["note"]


def test_kv_plan() -> None:
    assert kv_plan(TINY, 4, 3) == (6, 8, 3, 4, None, "")
    q0, q1, k0, k1, wanted, note = kv_plan(ODD_KV, 4, 1)  # query heads 3..5 read kv heads 0, 1, 1
    assert (q0, q1, k0, k1, wanted) == (3, 6, 0, 2, [0, 1, 1]) and "n_kv_heads=3" in note
    with pytest.raises(NotApplicable, match="n_heads % world == 0; got n_heads=8, world=3"):
        kv_plan(TINY, 3, 0)


def test_single_process_block_equals_the_reference() -> None:
    """The baselines' block is the block our compiler runs: rt.reference of llama_block, same weights."""
    g = llama_block(2, 24, d_model=TINY.d_model, n_heads=TINY.n_heads, n_kv_heads=TINY.n_kv_heads, d_ff=TINY.d_ff)
    feeds = {k: v.numpy() for k, v in block_params(TINY, 3, CPU, F32).items()}
    feeds["x"] = make_input(2, 24, TINY, 3, CPU, F32).numpy()
    want = rt.reference(g, feeds)["y"]
    got = reference_block(2, 24, TINY, 3, CPU, F32).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_torchrun_entry_point(tmp_path) -> None:
    """``torchrun ... run.py --strategy best --check --json``: two ranks, one block and one chain."""
    out = tmp_path / "res.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(BENCH / "baselines" / "run.py"), "--device", "cpu", "--shape", "tiny", "--strategy", "best",
           "--workload", "2x16,C", "--chain-scale", "512", "--rounds", "2", "--check", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["header"]["world"] == 2 and data["header"]["backend"] == "gloo"
    assert set(data["best"]) == {"2x16", "C"} and data["best"]["C"]["strategy"] == "chain"
    assert all(r["check"]["ok"] and len(r["ms_all"]) == 2 for r in data["rows"] if r["status"] == "ok")
    assert "| workload | best | mean (ms) |" in res.stdout


# --- the measured topology ----------------------------------------------------------------------------

GB = 1e9
HOPPER = {"float16": 989e12, "bfloat16": 989e12, "tf32": 494.5e12, "float32": 67e12}


def _ring(n: int, near: float, far: float) -> list[list[float]]:
    """Neighbours on a ring at ``near`` bytes/s, every other pair at ``far``."""
    return [[0.0 if i == j else near if (i - j) % n in (1, n - 1) else far for j in range(n)] for i in range(n)]


def _synthetic(name: str, near: float = 300 * GB, far: float = 100 * GB) -> Topology:
    return mt.topology_from_bandwidth(_ring(4, near, far), name=name, hbm_bandwidth=4000 * GB,
                                      memory_bytes=80 << 30, peak_flops=HOPPER, egress=[400 * GB] * 4,
                                      ingress=[350 * GB] * 4)


def test_topology_from_bandwidth_round_trips(tmp_path) -> None:
    t = _synthetic("ring-4")
    assert t.route(0, 1).resources == ("p2p(0->1)", "egress(0)", "ingress(1)")
    assert t.bandwidth(0, 1) == 300 * GB and t.bandwidth(0, 2) == 100 * GB
    assert t.resources["ingress(3)"] == 350 * GB
    assert Topology.from_json(t.to_json()) == t
    path = tmp_path / "topology.json"
    path.write_text(t.to_json())
    assert Topology.from_json(path) == t and Topology.from_json(str(path)) == t


def test_compile_and_simulate_against_a_measured_topology(tmp_path) -> None:
    path = tmp_path / "topology.json"
    path.write_text(_synthetic("ring-4").to_json())
    topo = Topology.from_json(path)
    g = llama_block(1, 32, d_model=64, n_heads=8, n_kv_heads=4, d_ff=128)
    cg = rt.compileGraph(g, device=4, topology=topo)  # get_topology takes a Topology object as it is
    fast = cg.simulate()
    slow = cg.simulate(_synthetic("ring-4-slow", near=3 * GB, far=1 * GB))
    assert 0 < fast < slow
    sub = rt.compileGraph(g, device=2, topology=topo)  # a plan for fewer GPUs uses the first sites
    assert {b.device for b in sub.dag.buffers.values()} == {0, 1}
    assert 0 < sub.simulate() < sub.simulate(_synthetic("ring-4-slow", near=3 * GB, far=1 * GB))


def test_topology_builder_rejects_bad_matrices() -> None:
    with pytest.raises(ValueError, match="3x3 matrix"):
        mt.topology_from_bandwidth([[0, 1], [1, 0], [1, 1]], name="x", hbm_bandwidth=1, memory_bytes=1,
                                   peak_flops=HOPPER)
    with pytest.raises(ValueError, match=r"positive bandwidth.*\(1, 0, 0.0\)"):
        mt.topology_from_bandwidth([[0, 5], [0, 0]], name="x", hbm_bandwidth=1, memory_bytes=1, peak_flops=HOPPER)


SMI = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tSYS\tPIX\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\tPXB\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tSYS\tNODE\t48-95\t1\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPIX\tPXB\tNODE\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_parse_nvidia_smi_topo_and_build_from_raw() -> None:
    parsed = mt.parse_nvidia_smi_topo(SMI)
    assert parsed["gpus"] == 4 and parsed["links"][3] == ["SYS", "SYS", "SYS", "X"]
    assert parsed["nvlinks"][0] == [0, 18, 18, 0]
    lat = mt.link_latencies(parsed["links"])
    assert lat[0][1] < lat[0][3]
    raw = {"gpus": 4, "names": ["NVIDIA H200"] * 4, "memory_bytes": [150 << 30] * 4, "hbm": [4.1e12, 4.0e12] * 2,
           "bandwidth": _ring(4, 300 * GB, 100 * GB), "latency": lat}
    t = mt.build(raw)
    assert t.name == "measured-nvidia-h200-x4" and t.flops("float16") == 989e12
    assert t.bandwidth(1, 2) == 300 * GB and t.route(0, 3).latency == lat[0][3]
    with pytest.raises(ValueError, match="no GPU matrix"):
        mt.parse_nvidia_smi_topo("No devices were found")


# --- the multi-GPU driver's merge ---------------------------------------------------------------------

def test_multigpu_smoke_and_merge(tmp_path) -> None:
    """``multigpu.py ours --smoke`` (virtual CPU devices, toy sizes, both cost models) and ``merge`` with a
    baselines file: one row per workload, PyTorch / ours and the 1 -> n speed-up per cost model."""
    out = tmp_path / "mg"
    cmd = [sys.executable, str(BENCH / "multigpu.py"), "ours", "--smoke", "--gpus", "1,2", "--workloads", "1K",
           "--chains", "C", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ours = json.loads((out / "ours.json").read_text())
    rows = {(r["workload"], r["gpus"], r["cost_model"]): r for r in ours["rows"]}
    assert set(rows) == {(w, n, m) for w in ("1K", "C") for n, m in ((1, "paper"), (2, "paper"), (2, "calibrated"))}
    assert all(r["status"] == "ok" and r["max_rel_diff_vs_1gpu"] < 1e-5 for r in rows.values())
    header = {"backend": "gloo", "dtype": "float32", "device": "cpu", "torch": torch.__version__,
              "rounds": "1 timed", "world": 2}
    best = {"1K": {"strategy": "tp", "ms": 10.0}, "C": {"strategy": "chain", "ms": 4.0}}
    base_rows = [{"workload": w, "strategy": b["strategy"], "world": 2, "status": "ok", "ms": b["ms"],
                  "check": {"ok": True, "max_rel": 0.0}} for w, b in best.items()]
    (out / "baselines_n2.json").write_text(json.dumps({"header": header, "rows": base_rows, "best": best}))
    res = subprocess.run([sys.executable, str(BENCH / "multigpu.py"), "merge", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    md = (out / "multigpu.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| 1K |")][0].split(" | ")
    want_ratio = " / ".join(f"{10.0 / rows[('1K', 2, m)]['ms']:.2f}x" for m in ("paper", "calibrated"))
    want_speed = " / ".join(f"{rows[('1K', 1, 'paper')]['ms'] / rows[('1K', 2, m)]['ms']:.2f}x"
                            for m in ("paper", "calibrated"))
    assert want_ratio in table and want_speed in table
    assert "geomean (blocks)" in md
    try:  # the plot needs the 'bench' extra
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "multigpu.png").exists()

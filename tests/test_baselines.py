"""The hand-written PyTorch baselines (bench/baselines) and the measured-topology builder
(bench/measure_topology.py), without GPUs: gloo on CPU in float32 at toy sizes.

Tensor, sequence and data parallelism on 2 and 4 ranks each equal the single-process block, and the
row-sharded chains equal the single-process chains; the single-process block equals
``rt.reference`` of ``llama_block``.  The training steps of DDP and FSDP2 on 2 ranks (``--train``) give
the parameters and AdamW moments of a single-process eager step over the whole batch after 2 steps.  A
topology built from a bandwidth matrix survives ``to_json``/``from_json`` and plans and simulates a graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.nn.functional as F

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

import relational_tensors as rt  # noqa: E402
from relational_tensors.graph.models import llama_block  # noqa: E402
from relational_tensors.machine.topology import Topology  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import measure_topology as mt  # noqa: E402
from baselines import run as baseline_run  # noqa: E402
from baselines.block import PARAMS, block_forward, block_params, make_input, param_shapes, reference_block  # noqa: E402
from baselines.chain import reference_chain  # noqa: E402
from baselines.common import SHAPES, BlockShape, NotApplicable, free_port, parse_workload  # noqa: E402
from baselines.llama_tp import kv_plan  # noqa: E402
from baselines.train import HYPER, loss_weight, train_batch, train_weights  # noqa: E402

CPU, F32 = torch.device("cpu"), torch.float32
TINY = SHAPES["tiny"]  # d_model 64, 8 heads, 4 kv heads, d_ff 128
ODD_KV = BlockShape(96, 12, 3, 96)  # 3 kv heads on 4 ranks: tp repeats kv heads, grouping off enable_gqa's
CHAIN_SCALE = 256
COMMON = ["--warmups", "0", "--rounds", "1", "--check", "--chain-scale", str(CHAIN_SCALE)]
# per world size: (command lines, the block workloads and shapes they cover)
# --train: float32, so that DDP and FSDP2 differ from one process only in the order the gradients' partial
# sums are added (a tight bound: a wrong split, loss weight or reduction is far outside it), on an uneven
# split (3 sequences on 2 ranks) and one sequence, which data parallelism does not cut; and the
# benchmark's configuration (bfloat16 activations, FSDP2 gathering bfloat16 parameters) at a bfloat16
# bound on an even split
CASES = {
    2: [["--shape", "tiny", "--strategy", "best", "--workload", "2x32,40,A,B,C,D,E"],
        ["--train", "--shape", "tiny", "--strategy", "best", "--workload", "3x16,40"],
        ["--train", "--dtype", "bfloat16", "--shape", "tiny", "--strategy", "best", "--workload", "2x16"]],
    4: [["--shape", "tiny", "--strategy", "best", "--workload", "6x30,30,A,B,C,D,E"],  # uneven token and batch splits
        ["--d-model", "96", "--heads", "12", "--kv-heads", "3", "--d-ff", "96", "--strategy", "tp",
         "--workload", "2x24"]],
}


# four ranks under -m slow (they take the default run's longest setup); two ranks cover every strategy
@pytest.fixture(scope="module", params=[pytest.param(w, marks=pytest.mark.slow) if w > 2 else w for w in sorted(CASES)],
                ids=lambda w: f"world{w}")
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
        if result["header"]["mode"] == "train":
            continue
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


# --- the training steps (DDP, FSDP2) -------------------------------------------------------------------

STEPS = 2  # run.py's --check-steps default
# (AdamW moments: largest difference over the largest magnitude; parameters: largest difference over
# lr * steps, the most AdamW moves an element).  float32: rounding of the reduction order only (measured
# 7e-7 and 1.5e-4).  bfloat16: every rank's matmuls round differently and FSDP2 computes with bfloat16 norm
# weights where the autocast reference has float32 ones (measured 1.7e-2); a near-zero gradient can change
# sign, moving an element ~2 lr away in a step (measured 2.0), so there the parameters' bound only catches
# gross errors and the moments (which, unlike AdamW's update, scale with the gradients) carry the check.
TRAIN_TOLERANCE = {"float32": (1e-4, 1e-2), "bfloat16": (5e-2, 4.0)}


def _eager_training(label: str, shape: BlockShape, dtype: torch.dtype) -> tuple[dict, dict, list[float]]:
    """STEPS single-process steps over the whole batch, written out here: the block's forward on a dict of
    leaf tensors, torch's default AdamW.  The parameters after them, the optimizer state and the losses."""
    batch, seq = parse_workload(label)[1]
    w = {k: torch.from_numpy(v).requires_grad_() for k, v in train_weights(shape, 0).items()}
    x, target = (torch.from_numpy(a).to(dtype) for a in train_batch(batch, seq, shape.d_model, 0))
    opt = torch.optim.AdamW(list(w.values()), **HYPER)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != F32):
            y = block_forward(x, w, shape)
        loss = F.mse_loss(y.float(), target.float())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return w, opt.state, losses


def _training(results: list[dict]) -> list[tuple[int, dict]]:
    return [(i, r) for i, r in enumerate(results) if r["header"]["mode"] == "train"]


def test_training_steps_equal_the_single_process_step(spawned) -> None:
    world, tmp, results = spawned
    if not _training(results):
        pytest.skip(f"the training steps run on 2 ranks; this is {world}")
    compared = []
    for i, result in _training(results):
        shape, dtype = BlockShape(**result["header"]["shape"]), result["header"]["dtype"]
        moments_tol, params_tol = TRAIN_TOLERANCE[dtype]
        for row in result["rows"]:
            if row["status"] == "not applicable":
                continue
            assert row["status"] == "ok" and row["check"]["ok"], row  # rank 0's own comparison
            saved = torch.load(tmp / f"run{i}" / f"{row['workload']}_{row['strategy']}_w{world}_train.pt")
            w, opt_state, losses = _eager_training(row["workload"], shape, getattr(torch, dtype))
            w0 = train_weights(shape, 0)
            what = f"{row['strategy']} on {row['workload']} in {dtype}"
            moved = 0.0
            for name in PARAMS:
                got = saved["state"][f"param.{name}"]
                param_diff = float((got - w[name].detach()).abs().max()) / (HYPER["lr"] * STEPS)
                assert param_diff <= params_tol, f"{what}: {name} is {param_diff:.2e} lr x steps off"
                moved = max(moved, float((got - torch.from_numpy(w0[name])).abs().max()) / (HYPER["lr"] * STEPS))
                for kind in ("exp_avg", "exp_avg_sq"):
                    want = opt_state[w[name]][kind]
                    rel = float((saved["state"][f"{kind}.{name}"] - want).abs().max() / want.abs().max())
                    assert rel <= moments_tol, f"{what}: {kind} of {name} is {rel:.2e} off"
            assert moved > 0.5, f"{what}: the parameters hardly moved ({moved:.2f} lr x steps): a vacuous check"
            np.testing.assert_allclose(saved["losses"], losses, rtol=moments_tol)
            compared.append((row["workload"], row["strategy"], dtype))
    assert {(w, s) for w, s, d in compared if d == "float32"} == {("3x16", "ddp"), ("3x16", "fsdp")}, compared
    assert {(w, s) for w, s, d in compared if d == "bfloat16"} == {("2x16", "ddp"), ("2x16", "fsdp")}, compared


def test_training_statuses_and_best(spawned) -> None:
    world, _, results = spawned
    if not _training(results):
        pytest.skip(f"the training steps run on 2 ranks; this is {world}")
    result = _training(results)[0][1]
    rows = {(r["workload"], r["strategy"]): r for r in result["rows"]}
    for strategy in ("ddp", "fsdp"):  # one sequence is not cut over the ranks
        assert rows[("40", strategy)]["status"] == "not applicable"
        assert "batch >= world" in rows[("40", strategy)]["reason"]
        ok = rows[("3x16", strategy)]
        assert ok["optimizer"] == "fused" or ok["optimizer"].startswith("foreach ("), ok  # which AdamW ran
        assert f"AdamW {ok['optimizer']}" in ok["note"]
    assert "40" not in result["best"] and result["best"]["3x16"]["strategy"] in ("ddp", "fsdp")
    assert result["header"]["train"]["adamw"]["lr"] == HYPER["lr"] and result["header"]["dtype"] == "float32"


def test_training_step_is_gpu_train_s() -> None:
    """The same weights, batch, hyperparameters and bfloat16 rounding as bench/gpu_train.py's step."""
    import gpu_train
    import ml_dtypes

    assert {k: list(v) for k, v in param_shapes(SHAPES["llama3-8b"]).items()} == gpu_train.WEIGHTS
    assert list(param_shapes(SHAPES["llama3-8b"])) == list(gpu_train.WEIGHTS)  # the order the weights are drawn
    assert HYPER == {"lr": gpu_train.LR, "betas": gpu_train.BETAS, "eps": gpu_train.ADAM_EPS,
                     "weight_decay": gpu_train.WEIGHT_DECAY}
    shapes = {k: list(v) for k, v in param_shapes(TINY).items()}
    want = gpu_train.initial_weights(TINY.d_model, shapes)
    assert all(np.array_equal(train_weights(TINY, 0)[k], want[k]) for k in PARAMS)
    x, target = train_batch(3, 8, 64, 0)
    rng = np.random.default_rng(1)  # gpu_train's batch: x, then target
    assert np.array_equal(x, rng.standard_normal((3, 8, 64), dtype=np.float32))
    assert np.array_equal(target, rng.standard_normal((3, 8, 64), dtype=np.float32))
    ours_bits = x.astype(ml_dtypes.bfloat16).view(np.int16)
    torch_bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(ours_bits, torch_bits)
    assert [loss_weight(r, 2, 3) for r in (1, 2)] == [2 / 3, 4 / 3]


def test_training_command_lines() -> None:
    """multigpu.sh's GPU command line parses (bfloat16 on CUDA, both strategies); wrong mixes are refused."""
    args = baseline_run.arguments(["--train", "--device", "cuda", "--strategy", "best", "--workload",
                                   "8K,4x2K,32x1K", "--check", "--json", "x.json"])
    assert args.dtype == "bfloat16" and args.check_steps == 2
    assert [(f, s) for f, s, _ in args.workloads] == [("block", (1, 8192)), ("block", (4, 2048)), ("block", (32, 1024))]
    assert baseline_run._strategies("block", args.strategies, train=True) == ["ddp", "fsdp"]
    assert baseline_run.arguments(["--train", "--device", "cpu"]).dtype == "float32"
    for bad in (["--strategy", "ddp"], ["--train", "--strategy", "tp"], ["--train", "--workload", "C"],
                ["--train", "--check-steps", "0"]):
        with pytest.raises(SystemExit):
            baseline_run.arguments(bad)


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

@pytest.mark.slow  # two subprocesses of the bench driver, about 20 s: `pytest -m slow` runs it
def test_multigpu_smoke_and_merge(tmp_path) -> None:
    """``multigpu.py ours --smoke`` and ``train --smoke`` (virtual CPU devices, toy sizes, both cost models)
    and ``merge`` with baselines files: one row per workload, PyTorch / ours and the 1 -> n speed-up per
    cost model, for the forward and for the training step."""
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
    import multigpu

    assert multigpu.main(["train", "--smoke", "--gpus", "1,2", "--workloads", "4x2K", "--rounds", "2",
                          "--out", str(out)]) == 0
    train = {(r["gpus"], r["cost_model"]): r for r in json.loads((out / "ours_train.json").read_text())["rows"]}
    assert set(train) == {(1, "paper"), (2, "paper"), (2, "calibrated")}
    assert all(r["status"] == "ok" and r["last_loss_rel_diff_vs_1gpu"] < 1e-3
               and r["masters_max_diff_vs_1gpu_over_lr_steps"] < 0.5 for r in train.values()), train
    assert max(r["first_loss"] for r in train.values()) - min(r["first_loss"] for r in train.values()) < 1e-3
    check = {"ok": True, "max_rel": 1e-2, "params_max_over_lr_steps": 0.5, "losses": [2.67, 2.66]}
    train_rows = [{"workload": "4x2K", "strategy": s, "world": 2, "status": "ok", "ms": ms, "check": check,
                   "note": f"{s}; AdamW fused"} for s, ms in (("ddp", 20.0), ("fsdp", 30.0))]
    train_rows.append({"workload": "8K", "strategy": "ddp", "world": 2, "status": "not applicable",
                       "reason": "ddp gives every rank whole sequences"})
    (out / "baselines_train_n2.json").write_text(json.dumps({"header": {**header, "dtype": "bfloat16"},
                                                             "rows": train_rows, "best": {}}))
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
    assert "**Training step" in md
    trained = [line for line in md.splitlines() if line.startswith("| 4x2K |")][0].split(" | ")
    assert "20.00" in trained and "30.00" in trained
    assert " / ".join(f"{20.0 / train[(2, m)]['ms']:.2f}x" for m in ("paper", "calibrated")) in trained
    assert "| 8K | DDP | 2 | not applicable | - | ddp gives every rank whole sequences |" in md
    ddp_on_1_and_2 = [line for line in md.splitlines() if line.startswith("| 8K |")][0].split(" | ")[3:5]
    assert ddp_on_1_and_2 == ["-", "n/a"]
    try:  # the plot needs the 'bench' extra
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "multigpu.png").exists()

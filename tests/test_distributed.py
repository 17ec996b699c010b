"""One process per device (``device="dist"``): torchrun launches of 2, 3 and 4 CPU ranks over gloo run
the LLaMA block, a matrix chain and an AdamW training step, each rank's results equal to the
single-process reference; rank 0 plans and the others load its plan; different graphs on different
ranks and a rank that leaves mid-run end every rank with an ExecError; the point-to-point schedule and
its deadlock checker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.core.types import Box
from relational_tensors.graph.models import llama_block
from relational_tensors.physical import p2p
from relational_tensors.physical.p2p import (
    Group,
    check_groups,
    check_schedule,
    grouped_schedules,
    is_transfer,
    schedules,
)
from relational_tensors.physical.tasks import RecomposePayload, TaskDAG
from relational_tensors.runtime.dist_streams import stream_schedule
from relational_tensors.runtime.memory_plan import MemoryPlan, plan_memory

PROGRAMS = Path(__file__).parent / "dist" / "programs.py"
ROOT = Path(__file__).parent.parent


def torchrun(n: int, out: Path, *args: str, timeout: float = 240,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           str(PROGRAMS), str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_computes_what_the_reference_computes(tmp_path: Path, world: int) -> None:
    out = tmp_path / "res.json"
    r = torchrun(world, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world"] == world
    for rank, results in enumerate(data["ranks"]):
        for name in ("block", "chain", "step"):
            res = results[name]
            assert res["ok"], f"rank {rank} {name}: {res.get('trace')}"
            # float32, contractions split up to `world` ways: rounding relative to the largest magnitude
            assert res["err"] <= 1e-5, (rank, name, res["err"])
        assert results["block"]["rank0_only"]
        if world > 2:  # transfers were posted in groups of several (batch_isend_irecv over gloo)
            assert results["block"]["groups"] < results["block"]["transfers"], results["block"]
        assert results["mesh"]["ok"] and results["mesh"]["p"] == world and results["mesh"]["err"] <= 1e-5
        assert results["chain"]["topology"].startswith("hgx-h200")  # no GPU, no measured file: the default
        mod = results["module"]  # rt.parallelize(..., device="dist"), float64: forward and backward
        assert mod["ok"] and mod["err"] <= 1e-12 and mod["grad_err"] <= 1e-12, mod
        assert results["mismatch"]["ok"] and results["mismatch"]["refused"], results["mismatch"]
    losses = {results["step"]["loss"] for results in data["ranks"]}
    assert len(losses) == 1  # every rank offloads the same loss
    for rank, results in enumerate(data["ranks"]):  # a plan over a group of the last two ranks
        sub = results["subgroup"]
        assert sub["ok"] and sub["member"] == (rank >= world - 2), sub
        assert not sub["member"] or (sub["p"] == 2 and sub["err"] <= 1e-5 and sub["rank1_only"]), sub
        assert not sub["member"] or sub["transfers"] > 0, sub  # peers named by their rank in the group


@pytest.mark.slow
def test_a_pipelined_step_over_four_ranks_equals_one_process(tmp_path: Path) -> None:
    """device="dist" with pipeline stages: four gloo ranks, two stages of two, two micro-batches under
    1F1B; every rank's states after two steps equal those of the same plan on cpu:4 in one process."""
    out = tmp_path / "res.json"
    r = torchrun(4, out, "--only", "pipeline")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(4):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["p"] == 4 and res["stages"] == 2, res
        assert res["err"] <= 1e-6, (rank, res)


@pytest.mark.slow
def test_the_run_command_under_torchrun(tmp_path: Path) -> None:
    model = tmp_path / "mlp.py"
    model.write_text("import relational_tensors as rt\n\n\ndef build():\n    g = rt.Graph()\n"
                     "    x = g.input('x', [64, 32])\n"
                     "    w1 = g.parameter('w1', [32, 64]); w2 = g.parameter('w2', [64, 32])\n"
                     "    h = g.unary(g.matmul(x, w1, name='up'), 'relu', name='act')\n"
                     "    g.save(g.matmul(h, w2, name='down'), name='y')\n    return g\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "relational_tensors", "--json", "run", str(model), "--devices", "dist", "--check",
                        "--rounds", "2"], capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)  # rank 0 reports, rank 1 prints nothing
    assert doc["ok"] and doc["p"] == 2 and len(doc["execute_s"]) == 2
    assert doc["outputs"][0]["output"] == "y" and doc["outputs"][0]["max_relative_difference"] <= 1e-5


@pytest.mark.slow
def test_two_nodes_rendezvous_on_localhost(tmp_path: Path) -> None:
    """Two torchrun launches of two ranks each, joined as two nodes (--nnodes 2): one world of four."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    out = tmp_path / "res.json"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                               str(port), str(PROGRAMS), str(out), "--only", "chain"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
             for node in (0, 1)]
    logs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in logs]
    data = json.loads(out.read_text())
    assert data["world"] == 4 and all(r["chain"]["ok"] and r["chain"]["err"] <= 1e-5 for r in data["ranks"])


@pytest.mark.slow
def test_a_measured_topology_file_prices_the_distributed_plan(tmp_path: Path) -> None:
    measured = ROOT / "bench" / "results" / "multigpu" / "topology.json"
    out = tmp_path / "res.json"
    r = torchrun(2, out, "--only", "chain", env={"RELATIONAL_TENSORS_TOPOLOGY": str(measured)})
    assert r.returncode == 0, r.stderr[-2000:]
    name = json.loads(measured.read_text())["name"]
    assert all(res["chain"]["ok"] and res["chain"]["topology"] == name for res in json.loads(out.read_text())["ranks"])


@pytest.mark.slow
def test_a_rank_that_leaves_ends_the_others_with_an_exec_error(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    r = torchrun(3, out, "--only", "killed")
    for rank in (0, 1):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["error"] and f"rank {rank}" in res["error"] and "copy task" in res["error"], (res, r.stderr[-2000:])


@pytest.mark.slow
def test_a_stalled_rank_ends_the_others_within_the_timeout(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    torchrun(3, out, "--only", "stalled")
    for rank in (0, 1):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["error"] and f"rank {rank}" in res["error"] and "copy task" in res["error"], res
        assert 2.5 <= res["seconds"] <= 11, res  # the 3 s timeout, not the 12 s the stalled rank sleeps


@pytest.mark.slow
def test_a_rank_that_exits_before_compiling_ends_the_others_with_an_exec_error(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    r = torchrun(3, out, "--only", "early", timeout=120)
    for rank in (0, 1):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["error"] and f"rank {rank}" in res["error"] and "did not form" in res["error"], \
            (res, r.stderr[-2000:])
        assert res["seconds"] <= 15, res  # the 3 s timeout (and torch's own retries), not the 300 s default


@pytest.mark.parametrize("group", ["world", 0, object()])
def test_a_process_group_of_another_kind_is_refused(group: object) -> None:
    pytest.importorskip("torch")
    g = llama_block(1, 8, 16, 2, 1, 24)
    with pytest.raises(rt.GraphError, match="ProcessGroup"):
        rt.compileGraph(g, device="dist:cpu", process_group=group)


@pytest.mark.slow
def test_a_checkpoint_is_read_shard_by_shard(tmp_path: Path) -> None:
    """Each of 4 ranks reads only its quarter of a 256 MiB checkpoint: its resident set grows by less than
    its blocks plus 64 MiB (a whole-file read would grow by the file)."""
    from safetensors.numpy import save_file

    path = tmp_path / "big.safetensors"
    rng = np.random.default_rng(1)
    save_file({f"w{i}": rng.standard_normal((2048, 4096), dtype=np.float32) for i in range(8)}, str(path))
    out = tmp_path / "res.json"
    r = torchrun(4, out, "--only", "checkpoint", env={"RT_CHECKPOINT": str(path)})
    for rank in range(4):
        res = json.loads(Path(f"{out}.{rank}").read_text()) if Path(f"{out}.{rank}").exists() else r.stderr[-3000:]
        assert isinstance(res, dict), res
        assert res["loaded"] and res["err"] <= 1e-3, res  # float32 dot products of 2048 terms
        assert res["kept"] == 8 * 2048 * 1024 * 4, res  # a quarter of each weight's columns
        assert res["growth"] < res["kept"] + (64 << 20), res


def _gpu_results(out: Path, r: subprocess.CompletedProcess[str]) -> list[dict]:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = [ranks["gpu" if "gpu" in ranks else "nccl"] for ranks in json.loads(out.read_text())["ranks"]]
    for rank, res in enumerate(results):
        assert res["ok"], (rank, res.get("trace"))
        assert res["float32"]["executor"] == "DistCupyExecutor"
        # the same kernels, split the same way: float32 rounding only; bf16 against the reference at the
        # bf16 tolerance the single-process GPU tests use (4 eps * sqrt(256) relative to the largest value)
        assert res["float32"]["vs_single"] <= 1e-5 and res["float32"]["vs_reference"] <= 1e-4, res
        assert res["bfloat16"]["vs_reference"] <= 4 * 8e-3 * 16, res
        assert res["float32"]["runs_differ"] <= 1e-6 and res["bfloat16"]["runs_differ"] <= 1e-6, res
        assert res["float32"]["groups"] < res["float32"]["transfers"], res  # batched transfers
        assert res["step"] <= 1e-4, res
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_ranks_sharing_one_gpu_give_the_single_process_results(tmp_path: Path, world: int) -> None:
    from relational_tensors.machine.devices import visible_gpus

    if not visible_gpus():
        pytest.skip("no CUDA GPU visible (or CuPy not installed)")
    out = tmp_path / "res.json"
    results = _gpu_results(out, torchrun(world, out, "--only", "gpu", timeout=540))
    assert not any(res["float32"]["captured"] for res in results)  # host-staged: eager


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["0", "1"])
def test_nccl_ranks_give_the_single_process_results(tmp_path: Path, graphs: str) -> None:
    """A GPU per rank, transfers over NCCL on each rank's communication stream; with
    RELATIONAL_TENSORS_NCCL_GRAPHS=1 the second run is captured into a CUDA graph and the third replays it."""
    from relational_tensors.machine.devices import visible_gpus

    gpus = visible_gpus()
    if gpus < 2:
        pytest.skip(f"NCCL needs a GPU per rank: {gpus} visible, 2 needed")
    out = tmp_path / "res.json"
    world = min(gpus, 4)
    r = torchrun(world, out, "--only", "nccl", timeout=540, env={"RELATIONAL_TENSORS_NCCL_GRAPHS": graphs})
    results = _gpu_results(out, r)
    assert all(res["float32"]["captured"] == (graphs == "1") for res in results), results


def _dag(copies: list[tuple[int, int]], p: int = 3) -> TaskDAG:
    dag = TaskDAG(p)
    for src, dst in copies:
        a = dag.buffer(src, Box((0,), (2,)), "float32", 0)
        b = dag.buffer(dst, Box((0,), (2,)), "float32", 0)
        dag.add("copy", dst, (a,), (b,), src_device=src)
    return dag


def _block(dag: TaskDAG, device: int) -> int:
    return dag.buffer(device, Box((0,), (2,)), "float32", 0)


def _copy(dag: TaskDAG, src_buf: int, dst: int) -> int:
    out = _block(dag, dst)
    dag.add("copy", dst, (src_buf,), (out,), src_device=dag.buffers[src_buf].device)
    return out


def _kernel(dag: TaskDAG, device: int, *ins: int) -> int:
    out = _block(dag, device)
    dag.add("aggregate", device, ins, (out,))
    return out


def _tasks(groups: list[list[Group]]) -> list[list[list[int]]]:
    return [[[op.task for op in group] for group in rank] for rank in groups]


def test_the_schedule_follows_the_dag_and_groups_independent_transfers() -> None:
    dag = _dag([(0, 1), (1, 0), (2, 0), (1, 2)])
    assert [(o.kind, o.peer) for o in schedules(dag)[0]] == [("send", 1), ("recv", 1), ("recv", 2)]
    assert _tasks(grouped_schedules(dag)) == [[[0, 1, 2]], [[0, 1, 3]], [[2, 3]]]
    check_schedule(dag)
    # rank 0 sends two blocks; rank 1 relays the first to rank 2 (its send depends on its receive), while
    # rank 2 takes both in one group (the relay depends on no transfer of rank 2's); a kernel on rank 2
    # ends its group; rank 0 then takes a block from each
    dag = TaskDAG(3)
    a, b = _block(dag, 0), _block(dag, 0)
    a1 = _copy(dag, a, 1)                     # task 0
    b2 = _copy(dag, b, 2)                     # task 1
    a2 = _copy(dag, a1, 2)                    # task 2
    c2 = _kernel(dag, 2, a2, b2)              # task 3
    _copy(dag, c2, 0), _copy(dag, a1, 0)      # tasks 4, 5
    assert _tasks(grouped_schedules(dag)) == [[[0, 1], [4, 5]], [[0], [2, 5]], [[1, 2], [4]]]
    check_schedule(dag)


def test_a_transfer_that_depends_on_a_member_through_another_rank_opens_a_new_group() -> None:
    dag = TaskDAG(2)
    x1 = _copy(dag, _block(dag, 0), 1)        # task 0: rank 0 sends x
    y1 = _kernel(dag, 1, x1)                  # task 1: rank 1 computes y from it
    _copy(dag, y1, 0)                         # task 2: and sends y back
    assert _tasks(grouped_schedules(dag)) == [[[0], [2]], [[0], [2]]]  # rank 0 met 0 and 2 in a row
    _copy(dag, _block(dag, 1), 0)             # task 3: independent of task 2: same group
    assert _tasks(grouped_schedules(dag))[0] == [[0], [2, 3]]


def test_groups_do_not_span_the_pause_between_phases() -> None:
    dag = _dag([(0, 1), (1, 0), (0, 1)], p=2)
    assert _tasks(grouped_schedules(dag)) == [[[0, 1, 2]], [[0, 1, 2]]]
    dag.phase_split = 2
    assert _tasks(grouped_schedules(dag)) == [[[0, 1], [2]], [[0, 1], [2]]]
    check_schedule(dag)


def _op(task: int, kind: str, peer: int) -> p2p.P2POp:
    return p2p.P2POp(task, kind, peer)


def test_the_checker_models_groups_posted_and_completed_together() -> None:
    # rank 0 posts one group to ranks 1 and 2; rank 1 receives in one group what rank 0 and rank 2 send,
    # and rank 2 sends only after its own receive from rank 0: every group gets posted
    ok = [[(_op(0, "send", 1), _op(1, "send", 2))],
          [(_op(0, "recv", 0), _op(2, "recv", 2))],
          [(_op(1, "recv", 0),), (_op(2, "send", 1),)]]
    check_groups(ok)
    # rank 1 waits in one group for rank 0's block and for rank 2's, which rank 2 sends only once it has
    # what rank 1 sends after that group: the group cannot complete
    crossed = [[(_op(0, "send", 1),)],
               [(_op(0, "recv", 0), _op(3, "recv", 2)), (_op(1, "send", 2),)],
               [(_op(1, "recv", 1),), (_op(3, "send", 1),)]]
    with pytest.raises(rt.ExchangeError, match=r"can deadlock: rank 1 at copy task 3 \(recv from rank 2\) in a "
                                               r"group of 2, rank 2 at copy task 1"):
        check_groups(crossed)
    # both ranks receive before they send, one group each: refused; in one group each: fine (posted together)
    with pytest.raises(rt.ExchangeError, match="can deadlock: rank 0 at copy task 1"):
        check_groups([[(_op(1, "recv", 1),), (_op(0, "send", 1),)], [(_op(0, "recv", 0),), (_op(1, "send", 0),)]])
    check_groups([[(_op(1, "recv", 1), _op(0, "send", 1))], [(_op(0, "recv", 0), _op(1, "send", 0))]])


def test_the_checker_refuses_lonely_reordered_and_repeated_transfers() -> None:
    with pytest.raises(rt.ExchangeError, match="without a partner"):
        check_groups([[(_op(0, "send", 1),)], []])
    with pytest.raises(rt.ExchangeError, match="without a partner"):  # the receive names another sender
        check_groups([[(_op(0, "send", 1),)], [(_op(0, "recv", 2),)], []])
    # two transfers from rank 0 to rank 1, received in the other order: fine with tags, not with NCCL
    with pytest.raises(rt.ExchangeError, match="in another order .*copy task 0 sent, 1 expected"):
        check_groups([[(_op(0, "send", 1), _op(1, "send", 1))], [(_op(1, "recv", 0), _op(0, "recv", 0))]])
    with pytest.raises(rt.ExchangeError, match="posts copy task 0 twice"):
        check_groups([[(_op(0, "send", 1),), (_op(0, "send", 1),)], [(_op(0, "recv", 0),)]])
    with pytest.raises(rt.ExchangeError, match="empty group"):
        check_groups([[()], []])


@pytest.mark.parametrize("p", [2, 5, 8])
def test_every_plan_of_the_block_has_a_deadlock_free_schedule(p: int) -> None:
    for options in ({}, {"cost_model": "calibrated"}, {"schedule_mode": "search", "search_steps": 10}):
        cg = rt.compileGraph(llama_block(1, 32, 32, 4, 2, 40), device=f"cpu:{p}", **options)
        check_schedule(cg.dag)
        sends = sum(len([o for o in ops if o.kind == "send"]) for ops in schedules(cg.dag))
        assert sends == sum(1 for t in cg.dag.tasks if t.kind == "copy" and t.src_device != t.device)
        groups = grouped_schedules(cg.dag)
        assert [[op for g in rank for op in g] for rank in groups] == schedules(cg.dag)  # the order is kept
        if p > 2:  # the exchanges' transfers go out together
            assert sum(map(len, groups)) < 2 * sends


def _two_stream_hazards(cg: rt.CompiledGraph, plan: MemoryPlan, rank: int) -> list[tuple[int, int]]:
    """Pairs of this rank's tasks that touch the same bytes (one writing) with nothing ordering them on its
    two streams: kernels in order on one, groups in order on the other, events between them as
    ``stream_schedule`` says; the transfers of one group run at once."""
    dag = cg.dag
    sched = stream_schedule(dag, plan, rank)
    member = {op.task: g for g, group in enumerate(sched.groups) for op in group}
    posts = {group[-1].task: g for g, group in enumerate(sched.groups)}
    seen: dict[int, tuple[int, int]] = {}  # task -> (latest kernel, latest group) done before it ends
    kernels, comm = (-1, -1), (-1, -1)
    group_seen: list[tuple[int, int]] = []
    for t in dag.tasks:
        if t.kind == "load" or not (rank in (t.src_device, t.device) if is_transfer(t) else t.device == rank):
            continue
        if is_transfer(t):
            g = posts.get(t.id)
            if g is not None:
                after = sched.after[g]
                base = seen[after] if after is not None else (-1, -1)
                comm = (max(comm[0], base[0]), g)
                group_seen.append(comm)
                for op in sched.groups[g]:
                    seen[op.task] = comm
            continue
        g = sched.waits.get(t.id)
        base = group_seen[g] if g is not None else (-1, -1)
        kernels = (t.id, max(kernels[1], base[1]))
        seen[t.id] = kernels

    def ordered(a: int, b: int) -> bool:  # a before b in the DAG: is a done before b starts?
        if a in member:
            return seen[b][1] >= member[a] and member.get(b) != member[a]  # one group's transfers run at once
        return seen[b][0] >= a

    accesses = []  # (task, buffer, the box of it touched, whether it writes)
    for t in dag.tasks:
        if t.kind == "load" or t.id not in seen or (t.kind == "kernel" and t.outputs[0] in plan.reshaped):
            continue
        for b in t.inputs:
            accesses.append((t.id, b, dag.buffers[b].box, False))
        for b in t.outputs:
            # a recompose writes its pieces' cells: a block copied into place is left as it is
            cells = t.payload.cells if isinstance(t.payload, RecomposePayload) else (dag.buffers[b].box,)
            accesses += [(t.id, b, cell, True) for cell in cells]
    accesses = [a for a in accesses if dag.buffers[a[1]].device == rank]
    bad = []
    for i, (ta, ba, box_a, wa) in enumerate(accesses):
        _, lo_a, hi_a = plan.byte_range(dag, ba)
        for tb, bb, box_b, wb in accesses[i + 1:]:
            if ta == tb or not (wa or wb):
                continue
            _, lo_b, hi_b = plan.byte_range(dag, bb)
            if hi_a <= lo_b or hi_b <= lo_a:
                continue
            if plan.root(ba) == plan.root(bb) and dag.buffers[ba].tensor == dag.buffers[bb].tensor and \
                    not box_a.overlaps(box_b):
                continue  # disjoint blocks of one buffer
            first, second = sorted((ta, tb))
            if (first in member) == (second in member) and member.get(first) != member.get(second) or \
                    first not in member and second not in member:
                continue  # one stream, in order
            if not ordered(first, second):
                bad.append((first, second))
    return bad


@pytest.mark.parametrize("p", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_gpu_ranks_two_streams_are_hazard_free(p: int) -> None:
    """Without a GPU: each GPU rank's kernels and groups of transfers, ordered by the events its stream
    schedule issues, never touch the same bytes unordered (block, training step, packed sequences)."""
    from relational_tensors.graph.models import llama_training_graph

    cases = [(llama_block(2, 24, 32, 4, 2, 40, dtype="float16"), {}),
             (llama_block(1, 48, 32, 8, 2, 88, dtype="float16", seq_ends=[5, 17, 20, 33, 48]), {}),
             (llama_training_graph(2, 16, 32, 4, 2, 48, 64, optimizer="adamw"), {"keep_states": "sharded"})]
    for g, options in cases:
        cg = rt.compileGraph(g, device=f"cpu:{p}", **options)
        plan = plan_memory(cg.dag, cg.live)
        for rank in range(p):
            assert _two_stream_hazards(cg, plan, rank) == [], rank


def test_dist_outside_a_launch_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(rt.ExecError, match="torchrun"):
        rt.compileGraph(llama_block(1, 8, 16, 2, 1, 24), device="dist")
    with pytest.raises(rt.GraphError, match="device='dist'"):
        rt.compileGraph(llama_block(1, 8, 16, 2, 1, 24), device="cpu:2", timeout=5)
    with pytest.raises(rt.ExecError, match="rank="):
        cg = rt.compileGraph(llama_block(1, 8, 16, 2, 1, 24), device="cpu:2")
        cg.offload("y", rank=0)

"""Programs run under torchrun by tests/test_distributed.py: every rank plans with device="dist", runs,
and compares what it offloads with the single-process NumPy reference; rank 0 writes the results.

    torchrun --standalone --nproc-per-node N tests/dist/programs.py OUT.json [--only NAME]
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

import relational_tensors as rt
from relational_tensors.graph.models import (
    chain_feeds,
    llama_block,
    llama_feeds,
    llama_training_feeds,
    llama_training_graph,
    matrix_chain,
)


def block() -> dict:
    g = llama_block(2, 24, 32, 4, 2, 40)
    feeds = llama_feeds(g, seed=1)
    cg = rt.compileGraph(g, device="dist")
    got = cg.run(feeds)["y"]
    want = rt.reference(g, feeds)["y"]
    only = cg.offload("y", rank=0)  # the others get None
    groups = cg.executor.groups  # this rank's transfers, each group one batch_isend_irecv
    return {"err": float(np.abs(got - want).max() / np.abs(want).max()),
            "rank0_only": (only is not None) == (cg.executor.rank == 0),
            "groups": len(groups), "transfers": sum(map(len, groups))}


def chain() -> dict:
    g = matrix_chain("C", dtype="float32", scale=64)
    feeds = chain_feeds(g, seed=2)
    cg = rt.compileGraph(g, device="dist", cost_model="calibrated")
    name = next(iter(g.outputs))
    got, want = cg.run(feeds)[name], rt.reference(g, feeds)[name]
    return {"err": float(np.abs(got - want).max() / np.abs(want).max()), "topology": cg.target.topology.name}


def mesh() -> dict:
    """A one-dimensional DeviceMesh as the process group."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    g = matrix_chain("C", dtype="float32", scale=128)
    feeds = chain_feeds(g, seed=5)
    cg = rt.compileGraph(g, device="dist", process_group=m)
    got, want = cg.run(feeds)["y"], rt.reference(g, feeds)["y"]
    return {"p": cg.p, "err": float(np.abs(got - want).max() / np.abs(want).max())}


def step() -> dict:
    g = llama_training_graph(2, 16, 32, 4, 2, 48, 64, optimizer="adamw")
    feeds = llama_training_feeds(g)
    cg = rt.compileGraph(g, device="dist", keep_states="sharded")
    cg.load(feeds)
    for _ in range(2):
        cg.execute()
    local = rt.compileGraph(g, device="cpu:3")  # the same step, one process
    local.load(feeds)
    for _ in range(2):
        local.execute()
    return {"err": _states_err(g, cg, local), "loss": float(np.asarray(cg.offload("loss")).reshape(-1)[0])}


def _states_err(g: rt.Graph, cg: rt.CompiledGraph, local: rt.CompiledGraph) -> float:
    """The largest difference of a state between two compilations, relative to its largest magnitude."""
    return max(float(np.abs(cg.offload(s) - local.offload(s)).max() / (np.abs(local.offload(s)).max() + 1e-30))
               for s in (n.name for n in g.inputs if n.role == "state"))


def pipeline() -> dict:
    """A pipelined step (2 stages of 2 ranks, 2 micro-batches, 1F1B): each rank runs its stage's tasks; two
    steps equal one process's on cpu:4."""
    g = llama_training_graph(4, 8, 32, 4, 2, 48, 64, layers=2, optimizer="adamw")
    feeds = llama_training_feeds(g)
    pipe = rt.Pipeline(2, 2, "1f1b")
    cg = rt.compileGraph(g, device="dist", pipeline=pipe)
    local = rt.compileGraph(g, device="cpu:4", pipeline=pipe)
    for c in (cg, local):
        c.load(feeds)
        for _ in range(2):
            c.execute()
    return {"err": _states_err(g, cg, local), "p": cg.p, "stages": cg.plan.pipeline.stages}  # type: ignore[attr-defined]


def mismatch() -> dict:
    """A rank holding another graph: every rank refuses before anything runs."""
    import torch.distributed as dist

    g = llama_block(1, 8 + dist.get_rank() % 2, 16, 2, 1, 24)  # rank 1 builds a longer sequence
    try:
        rt.compileGraph(g, device="dist")
    except rt.ExecError as e:
        return {"refused": "different graphs" in str(e)}
    return {"refused": False}


def _run_without_the_last(cg: rt.CompiledGraph) -> dict:
    """Run ``cg`` on the ranks but the last (gone or stalled): the ExecError each gets, and how soon."""
    t0 = time.perf_counter()
    try:
        cg.execute()
        cg.offload("y")
    except rt.ExecError as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    return {"error": None}


def killed() -> dict:
    """The last rank leaves in the middle of the run: every other rank ends with an ExecError."""
    import os

    import torch.distributed as dist

    g = llama_block(2, 24, 32, 4, 2, 40)
    cg = rt.compileGraph(g, device="dist")
    rank, world = dist.get_rank(), dist.get_world_size()
    cg.load(llama_feeds(g, seed=1))
    if rank == world - 1:
        os._exit(0)  # gone without a word (a zero status: the launcher leaves the others running)
    return _run_without_the_last(cg)


def stalled() -> dict:
    """The last rank stalls before the run: the others give up after the 3 s timeout with an ExecError."""
    import torch.distributed as dist

    g = llama_block(2, 24, 32, 4, 2, 40)
    cg = rt.compileGraph(g, device="dist", timeout=3)
    cg.load(llama_feeds(g, seed=1))
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(12)
        return {"error": "stalled on purpose"}
    return _run_without_the_last(cg)


def subgroup() -> dict:
    """A plan over a user's process group (the last two ranks: with 3 or more, their ranks in the group are
    not their global ranks), composed with the rest of the job."""
    import torch.distributed as dist

    world = dist.get_world_size()
    members = [world - 2, world - 1]
    group = dist.new_group(members)  # every rank takes part in making it
    if dist.get_rank() not in members:
        return {"member": False}
    g = matrix_chain("C", dtype="float32", scale=128)
    feeds = chain_feeds(g, seed=3)
    cg = rt.compileGraph(g, device="dist", process_group=group)
    got, want = cg.run(feeds)["y"], rt.reference(g, feeds)["y"]
    only = cg.offload("y", rank=1)  # group rank 1: the last global rank
    return {"member": True, "p": cg.p, "err": float(np.abs(got - want).max() / np.abs(want).max()),
            "rank1_only": (only is not None) == (dist.get_rank() == world - 1),
            "transfers": sum(map(len, cg.executor.groups))}


def checkpoint() -> dict:
    """Weights read shard by shard from the checkpoint at $RT_CHECKPOINT (w0..w{n-1}, [rows, cols] float32,
    each held S(1)): the growth of this rank's resident set while it loads, sampled every 0.2 ms."""
    import os
    import threading

    from safetensors import safe_open

    path = os.environ["RT_CHECKPOINT"]
    with safe_open(path, framework="numpy") as f:
        keys = sorted(f.keys())
        rows, cols = f.get_slice(keys[0]).get_shape()
    g = rt.Graph()
    x = g.input("x", [16, rows])
    for k in keys:
        g.save(g.matmul(x, g.parameter(k, [rows, cols]), name=f"mm_{k}"), name=f"y_{k}")
    cg = rt.compileGraph(g, device="dist", constraints={k: "S(1)" for k in keys})

    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0002)

    base = rss()
    watcher = threading.Thread(target=watch)
    watcher.start()
    loaded = cg.load_checkpoint(path)
    done.set()
    watcher.join()
    ex = cg.executor
    kept = sum(ex.dag.buffers[b].nbytes for k in keys for _, b in ex.dag.inputs[k] if ex._holds(b))
    xs = np.random.default_rng(0).standard_normal((16, rows)).astype(np.float32)
    cg.load({"x": xs})
    cg.execute()
    with safe_open(path, framework="numpy") as f:  # the check reads the whole file, after the measurement
        err = max(float(np.abs(cg.offload(f"y_{k}") - xs @ f.get_tensor(k)).max()) for k in keys)
    return {"growth": max(peak[0] - base, 0), "kept": kept, "file": os.path.getsize(path),
            "loaded": loaded == keys, "err": err}


def module() -> dict:
    """A torch module through rt.parallelize(..., device="dist"): forward and backward on every rank."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).double()
    x = torch.randn(12, 16, dtype=torch.float64)
    fast = rt.parallelize(net, (x,), device="dist")
    xr = x.clone().requires_grad_(True)
    got = fast(xr)
    got.sum().backward()
    xw = x.clone().requires_grad_(True)
    want = net(xw)
    want.sum().backward()
    return {"err": float((got - want).abs().max() / want.abs().max()),
            "grad_err": float((xr.grad - xw.grad).abs().max() / xw.grad.abs().max())}


PROGRAMS = {"block": block, "chain": chain, "step": step, "mismatch": mismatch, "subgroup": subgroup,
            "module": module, "mesh": mesh}
def early() -> dict:
    """The last rank exits before compiling: the others' group never forms, and they end with an ExecError
    within the 3 s timeout."""
    if os.environ["RANK"] == str(int(os.environ["WORLD_SIZE"]) - 1):
        os._exit(0)
    g = llama_block(1, 8, 16, 2, 1, 24)
    t0 = time.perf_counter()
    try:
        rt.compileGraph(g, device="dist", timeout=3)
    except rt.ExecError as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    return {"error": None}


SOLO = {"killed": killed, "stalled": stalled, "checkpoint": checkpoint, "early": early, "pipeline": pipeline}


def _gpu_ranks(transport: str) -> dict:
    """GPU ranks running the block in float32 and bfloat16 and an AdamW step, against the single-process
    CuPy executor and the reference; the block runs three times (eager, then captured into a CUDA graph
    and replayed where the NCCL program may be captured), each run's output the same."""
    import os

    from relational_tensors.machine.devices import visible_gpus

    world = int(os.environ["WORLD_SIZE"])  # the group is made by the first device="dist" compile
    gpu = int(os.environ.get("LOCAL_RANK", "0")) % visible_gpus()  # as device="dist" picks it
    shared = "cuda:" + ",".join([str(gpu)] * world)
    out: dict = {}
    for dtype in ("float32", "bfloat16"):
        g = llama_block(2, 64, 128, 8, 4, 256, dtype=dtype)
        feeds = llama_feeds(g, seed=1)
        cg = rt.compileGraph(g, device="dist:cuda", transport=transport)
        cg.load(feeds)
        runs = []
        for _ in range(3):
            cg.execute()
            runs.append(np.asarray(cg.offload("y"), dtype=np.float64))
        got = runs[0]
        single = np.asarray(rt.compileGraph(g, device=shared).run(feeds)["y"], dtype=np.float64)
        ref = np.asarray(rt.reference(g, feeds)["y"], dtype=np.float64)
        scale = np.abs(ref).max()
        out[dtype] = {"vs_single": float(np.abs(got - single).max() / scale),
                      "vs_reference": float(np.abs(got - ref).max() / scale),
                      "runs_differ": float(max(np.abs(r - got).max() for r in runs) / scale),
                      "captured": cg.executor.graph_exec is not None,
                      "groups": len(cg.executor.groups), "transfers": sum(map(len, cg.executor.groups)),
                      "executor": type(cg.executor).__name__}
    g = llama_training_graph(2, 16, 32, 4, 2, 48, 64, optimizer="adamw")
    feeds = llama_training_feeds(g)
    cg = rt.compileGraph(g, device="dist:cuda", transport=transport, keep_states="sharded")
    local_cg = rt.compileGraph(g, device="cpu:3")
    for c in (cg, local_cg):
        c.load(feeds)
        for _ in range(3):
            c.execute()
    states = [n.name for n in g.inputs if n.role == "state"]
    out["step"] = max(float(np.abs(cg.offload(s) - local_cg.offload(s)).max() /
                            (np.abs(local_cg.offload(s)).max() + 1e-30)) for s in states)
    return out


def gpu() -> dict:
    """GPU ranks sharing one GPU, transfers staged through the host over gloo."""
    return _gpu_ranks("gloo")


def nccl() -> dict:
    """GPU ranks on a GPU each, transfers over NCCL (CUDA graphs where $RELATIONAL_TENSORS_NCCL_GRAPHS=1)."""
    return _gpu_ranks("nccl")


GPU_PROGRAMS = {"gpu": gpu, "nccl": nccl}  # programs after which the group is broken: each rank reports alone


def main() -> None:
    out_path = sys.argv[1]
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    results: dict = {}
    if only in SOLO:
        import torch.distributed as dist

        result = SOLO[only]()
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
        return
    for name, fn in ({only: {**PROGRAMS, **GPU_PROGRAMS}[only]} if only else PROGRAMS).items():
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn(), "seconds": time.perf_counter() - t0}
        except Exception as e:  # reported, not hidden: the test shows it
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    import torch.distributed as dist

    if not dist.is_initialized():  # a program failed before device='dist' made the group: report it anyway
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "ranks": gathered}, f, indent=1)
    dist.barrier()  # every rank is done with every group before any tears its own down
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's threads of the groups made above (a subgroup, a DeviceMesh) can abort the interpreter's own
    # exit on a loaded machine ("terminate called without an active exception"); the results are out
    os._exit(0)


if __name__ == "__main__":
    main()

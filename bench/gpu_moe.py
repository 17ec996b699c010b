"""A Mixtral-shaped mixture-of-experts layer on one GPU, as a PyTorch user runs it: transformers'
``MixtralSparseMoeBlock`` (8 experts, top-2, 4096 wide, 14,336 intermediate) on 8,192 tokens in bfloat16,
forward and training step (loss mean(y²), ``torch.optim.AdamW``, which ours is handed as a user hands it),
side by side in one run:

* ``eager`` and ``compile``: the block itself and ``torch.compile`` of it (transformers' experts loop);
* ``grouped_mm``: the routed tokens sorted by expert and the experts' products as ``torch._grouped_mm``
  (where the installed torch has it; its training step runs through torch's own gradient of
  ``_grouped_mm``, and the table says so where that torch has none): the dispatching baseline;
* ``parallelize`` / ``train_step``: ours through ``rt.parallelize`` and ``rt.train_step`` on ``cuda:0`` and
  on 8 logical devices of it (``cuda:0,0,0,0,0,0,0,0``), CUDA tensors in and out; ``graph``: the compiled
  program's ``execute`` alone.

``capacity`` (not in the default modes): the same layer built with the graph API, its experts with a
capacity of 1.25 per group of tokens (``moe_layer_graph(experts_compute="grouped", capacity_factor=1.25)``:
``[groups, experts, capacity, d]`` buffers through batched GEMMs; a training step with AdamW and float32
masters), the compiled program's ``execute`` on ``cuda:0`` and on 8 logical devices, where the planner
exchanges the buffers all-to-all between the groups' devices and the experts' (its values are not the
block's: a capacity drops pairs; its FLOPs are 1.25x the routed ones).

Our experts follow the block's ``config._experts_implementation`` (``--experts-impl``): ``eager``, the
default, traces them grouped (the routed pairs sorted by expert, each row through its own expert);
``batched_mm`` densely (every token through every expert, weighted by zero off the router's picks: 4x the
routed FLOPs here).  The table gives the routed expert TFLOP/s (the FLOPs a dispatch does,
2 · tokens · top_k · 3 · hidden · intermediate, over each time) beside this GPU's dense matmul rate.
2 warm-ups and 10 timed rounds, CUDA events, medians.

    python bench/gpu_moe.py [--tokens 8192] [--modes eager,compile,grouped_mm,user,graph,capacity]
                            [--experts-impl eager|batched_mm] [--out bench/results]
    python bench/gpu_moe.py --smoke --modes eager,compile,grouped_mm,user   # tiny shapes on cpu:1 and cpu:2,
                                                                         # wall-clock: the script's own check
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_user_path import engine_ms  # bench/gpu_user_path.py: the engine alone, CUDA events
from gpu_user_path import time_ms as cuda_ms

import relational_tensors as rt

DEVICES = ("cuda:0", "cuda:0,0,0,0,0,0,0,0")


def time_ms(fn: Callable[[], Any], cuda: bool) -> float:
    """gpu_user_path's CUDA-event timing on a GPU; wall-clock medians of the same rounds for --smoke."""
    if cuda:
        return cuda_ms(fn)
    for _ in range(2):
        fn()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


EXPERTS_IMPL = "eager"  # --experts-impl
SHAPE: dict[str, int] = {}  # the layer's sizes, for the capacity mode
MODES = "eager,compile,grouped_mm,user,graph"


def block(tokens: int, smoke: bool, device: str, dtype: Any) -> tuple[Callable[[], Any], torch.Tensor, dict]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    shape = dict(hidden_size=64, intermediate_size=96) if smoke else dict(hidden_size=4096, intermediate_size=14336)
    config = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **shape)
    config._experts_implementation = EXPERTS_IMPL  # how ours traces the experts (grouped or dense)

    def make() -> Any:
        torch.manual_seed(0)
        m = MixtralSparseMoeBlock(config)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
        return m.to(device, dtype)
    x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype) * 0.1
    return make, x, dict(tokens=tokens, top_k=2, hidden=config.hidden_size, ff=config.intermediate_size, experts=8)


def grouped_mm_forward(m: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The dispatching baseline: route, sort the (token, slot) pairs by expert, one grouped product per
    projection over the experts' row groups, weight and add back."""
    experts = m.experts

    def run(x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, x.shape[-1])
        _, weights, ids = m.gate(h)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = h[order // ids.shape[1]]
        offs = torch.cumsum(torch.bincount(flat, minlength=experts.num_experts), 0).to(torch.int32)
        gu = torch._grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = gu.chunk(2, dim=-1)
        y = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=offs)
        out = torch.zeros_like(h, dtype=torch.float32)
        out.index_add_(0, order // ids.shape[1], y.float() * weights.reshape(-1)[order, None].float())
        return out.to(h.dtype).view_as(x)
    return run


def loss_fn(m: Any, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().square().mean()


def capacity_rows(shape: dict, train: bool, cuda: bool, devices: tuple) -> dict:
    """The graph API's layer with a capacity of 1.25, its program's ``execute`` on each device string."""
    import numpy as np

    from relational_tensors.graph.models import optimizer_feeds
    from relational_tensors.graph.moe import moe_layer_graph

    out: dict[str, Any] = {}
    dtype = "bfloat16" if cuda else "float32"
    g = moe_layer_graph(shape["tokens"], shape["hidden"], shape["experts"], shape["top_k"], shape["ff"], dtype=dtype,
                        training=train, experts_compute="grouped", capacity_factor=1.25)
    rng = np.random.default_rng(0)
    feeds = optimizer_feeds(g, {n.name: (rng.standard_normal(n.type.shape) * (0.1 if n.name == "x" else 0.02))
                                .astype(np.float32) for n in g.inputs}, lr=1e-5)
    for device in devices:
        try:
            cg = rt.compileGraph(g, device=device)
            cg.load(feeds)
            out[f"capacity 1.25 graph {device}"] = engine_ms(cg) if cuda else time_ms(cg.execute, False)
        except Exception as e:  # recorded, not hidden
            out[f"capacity 1.25 graph {device}"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
    return out


def rows_for(mode: str, make: Callable[[], Any], x: torch.Tensor, train: bool, cuda: bool, devices: tuple) -> dict:
    out: dict[str, Any] = {}
    if mode == "capacity":
        return capacity_rows(SHAPE, train, cuda, devices)
    try:
        if mode in ("eager", "compile", "grouped_mm"):
            model = make()
            if mode == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
                out[mode] = "torch._grouped_mm is not in this torch"
                return out
            if train:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                if mode == "grouped_mm":
                    grouped = grouped_mm_forward(model)
                    fn: Callable[..., torch.Tensor] = lambda m, x: grouped(x).float().square().mean()  # noqa: E731
                else:
                    fn = torch.compile(loss_fn) if mode == "compile" else loss_fn

                def step() -> None:
                    opt.zero_grad(set_to_none=True)
                    fn(model, x).backward()
                    opt.step()
                out[mode] = time_ms(step, cuda)
            else:
                call = grouped_mm_forward(model) if mode == "grouped_mm" else \
                    (torch.compile(model) if mode == "compile" else model)
                with torch.no_grad():
                    if mode == "grouped_mm":  # the baseline computes the block's output
                        torch.testing.assert_close(call(x), model(x), rtol=3e-2, atol=3e-2)
                    out[mode] = time_ms(lambda: call(x), cuda)
        else:
            for device in devices:
                model = make()
                if train:
                    st = rt.train_step(model, loss_fn, (x,), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                                       device=device)
                    st(x)
                    target = st.compiled
                    key = f"train_step {device}"
                    user_call: Callable[[], Any] = lambda s=st: s(x)  # noqa: E731
                else:  # under no_grad, as eager's forward: with grad a call runs the training program
                    pm = rt.parallelize(model.eval(), (x,), device=device)
                    with torch.no_grad():
                        pm(x)
                    target = pm.compiled
                    key = f"parallelize {device}"

                    def user_call(p: Any = pm) -> Any:
                        with torch.no_grad():
                            return p(x)
                if mode == "user":
                    out[key] = time_ms(user_call, cuda)
                else:
                    out[f"graph {device}"] = engine_ms(target) if cuda else time_ms(target.execute, False)
    except Exception as e:  # recorded, not hidden: the table shows what failed
        out[mode] = f"{type(e).__name__}: {str(e)[:200]}"
        traceback.print_exc()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--experts-impl", default="eager", choices=("eager", "batched_mm"),
                    help="the block's config._experts_implementation: eager traces grouped, batched_mm densely")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    global EXPERTS_IMPL
    EXPERTS_IMPL = a.experts_impl
    cuda = not a.smoke
    devices = ("cpu:1", "cpu:2") if a.smoke else DEVICES
    tokens = 64 if a.smoke else a.tokens
    make, x, shape = block(tokens, a.smoke, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    SHAPE.update(shape)
    routed = 2.0 * shape["tokens"] * shape["top_k"] * 3 * shape["hidden"] * shape["ff"]
    rate = None
    if cuda:
        a_ = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: a_ @ a_, True)
        rate = 2 * 8192**3 / (ms * 1e-3) / 1e12
        del a_
    results: dict[str, dict[str, Any]] = {}
    for train in (False, True):
        row = results.setdefault("training step" if train else "forward", {})
        for mode in a.modes.split(","):
            row.update(rows_for(mode, make, x, train, cuda, devices))
            print("training" if train else "forward", row, flush=True)
            write(a, results, routed, rate, shape)  # after every mode: a run cut short keeps what it timed


def write(a: argparse.Namespace, results: dict, routed: float, rate: float | None, shape: dict) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else platform.processor()
    command = "python bench/gpu_moe.py" + (" --smoke" if a.smoke else f" --tokens {a.tokens}")
    command += f" --modes {a.modes}" if a.modes != MODES else ""
    command += f" --experts-impl {a.experts_impl}" if a.experts_impl != "eager" else ""
    record = {"command": command,
              "commit": commit or "unknown", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "machine": f"{machine}, {platform.node()}", "shape": shape,
              "routed_expert_flops": routed, "dense_matmul_tflops": rate, "ms": results}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_moe_smoke" if a.smoke else "gpu_moe"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    lines = [f"## {shape['experts']} experts, top-{shape['top_k']}, {shape['tokens']} tokens, "
             f"{shape['hidden']} wide, {shape['ff']} intermediate",
             "", f"`{record['command']}` at {record['commit']}, {record['date']}, {record['machine']}", "",
             f"dense bf16 matmul rate: {rate:.0f} TFLOP/s" if rate else "dense matmul rate: not measured (smoke run)",
             "", "| step | mode | ms | routed expert TFLOP/s |", "|---|---|---|---|"]
    for step, row in results.items():
        for mode, ms in row.items():
            flops = routed * (3 if step.startswith("training") else 1)  # backward: twice the forward's
            tf = f"{flops / (ms * 1e-3) / 1e12:.1f}" if isinstance(ms, float) else "-"
            lines.append(f"| {step} | {mode} | {ms if not isinstance(ms, float) else f'{ms:.2f}'} | {tf} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Where a user path's time goes on one GPU: host time per call, GPU busy time, idle GPU time, and the
kernels by family, for torch.compile and for ours on the same module and batch.

``gpu_user_path.py`` times each path end to end (a CUDA event before the call, one after, the host
waiting for the second).  This script explains those numbers: per mode it reports

* ``host_ms``: the host's time inside one call when nothing waits for it (median of 10, after 2
  warm-ups; a call that synchronizes shows the GPU's time here);
* ``wall_ms``: the end-to-end time of a call as ``gpu_user_path.py`` measures it;
* ``busy_ms``: the time some kernel or copy ran during one call (CUPTI, through ``torch.profiler``,
  which also sees the kernels of a replayed CUDA graph), averaged over 3 profiled calls;
* ``idle_ms``: ``wall_ms - busy_ms``, the GPU waiting for the host;
* with ``--cprofile``, the host's 25 heaviest Python functions over 20 calls;
* the 20 kernel families (name up to its first ``<``, ``(`` or ``_kernel``) with the most GPU time, per call.

Workloads and modes are those of ``gpu_user_path.py`` (``compile``, ``user``, ``backend``; ``--train``
for the training step).

    python bench/gpu_user_profile.py [--workloads "block 1x4K"] [--modes compile,user] [--train] [--cprofile]
                                     [--out bench/results/gpu_user_profile.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step_timeline import union  # noqa: E402
from gpu_user_path import optimizer, time_ms, workload  # noqa: E402

import relational_tensors as rt  # noqa: E402


def family(name: str) -> str:
    """A kernel's family: its name up to the template arguments or parameter list."""
    base = re.split(r"[<(]", name, maxsplit=1)[0].strip()
    return base[:80] or name[:80]


def host_profile(fn: Callable[[], Any], calls: int = 20) -> list[str]:
    """The host's Python functions by own time over ``calls`` calls (cProfile), the 25 heaviest."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    for _ in range(calls):
        pr.enable()
        fn()
        pr.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue().splitlines()


def profile(fn: Callable[[], Any], calls: int = 3) -> dict[str, Any]:
    """Host time per call, end-to-end time, and the GPU's busy time and kernel families per call."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(10):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    wall = time_ms(fn)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans, fams = [], {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, dur = e.time_range.start, e.time_range.end - e.time_range.start
        spans.append((start, start + dur))
        f = family(e.name)
        n, t = fams.get(f, (0, 0.0))
        fams[f] = (n + 1, t + dur / 1e3)
    busy = union(spans) / 1e3 / calls  # profiler microseconds to ms
    top = sorted(fams.items(), key=lambda kv: -kv[1][1])[:20]
    return {"host_ms": statistics.median(host), "wall_ms": wall, "busy_ms": busy, "idle_ms": wall - busy,
            "kernels_per_call": sum(n for n, _ in fams.values()) / calls,
            "families": [{"family": f, "count": n / calls, "ms": t / calls} for f, (n, t) in top]}


def forward_fn(name: str, mode: str) -> Callable[[], Any]:
    make, inputs, _, _ = workload(name)
    model = make().eval()
    args = tuple(x for x in inputs if x is not None)
    call = (lambda m: m(*args)) if name.startswith("block") else \
        (lambda m: m(input_ids=inputs[0], attention_mask=inputs[1]))
    if mode == "compile":
        target: Any = torch.compile(model)
    elif mode == "user":
        example = args if name.startswith("block") else \
            {"input_ids": inputs[0], **({"attention_mask": inputs[1]} if inputs[1] is not None else {})}
        target = rt.parallelize(model, example, device="cuda:0")
    else:
        torch._dynamo.reset()
        target = torch.compile(model, backend=rt.dynamo_backend, options={"device": "cuda:0"}, dynamic=False)

    def run() -> None:
        with torch.no_grad():
            call(target)
    return run


def train_fn(name: str, mode: str) -> Callable[[], Any]:
    make, _, loss_fn, batch = workload(name)
    model = make().train()
    if mode == "user":
        st = rt.train_step(model, loss_fn, batch, optimizer=optimizer(model), device="cuda:0")
        return lambda: st(*batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if mode == "compile":
        fn = torch.compile(loss_fn)
    else:
        torch._dynamo.reset()
        fn = torch.compile(loss_fn, backend=rt.dynamo_backend, options={"device": "cuda:0"}, dynamic=False)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        fn(model, *batch).backward()
        opt.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="block 1x4K")
    ap.add_argument("--modes", default="compile,user")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="also the host's Python functions by own time")
    ap.add_argument("--out", default="bench/results/gpu_user_profile.json")
    a = ap.parse_args()
    rows: dict[str, Any] = {}
    for name in a.workloads.split(","):
        for mode in a.modes.split(","):
            key = f"{name} {'training' if a.train else 'forward'} {mode}"
            try:
                fn = (train_fn if a.train else forward_fn)(name, mode)
                rows[key] = profile(fn)
                if a.cprofile:
                    rows[key]["host_profile"] = host_profile(fn)
            except Exception as e:  # recorded, not hidden
                rows[key] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
            r = rows[key]
            print(key, {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}, flush=True)
            for f in r.get("families", [])[:12]:
                print(f"    {f['ms']:8.3f} ms  x{f['count']:6.1f}  {f['family']}", flush=True)
            torch.cuda.empty_cache()
    record = {"command": "python bench/gpu_user_profile.py " + " ".join(
        f"--{k.replace('_', '-')} {v!r}" for k, v in vars(a).items() if k != "out" and v not in (False, None)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{torch.cuda.get_device_name(0)}, {platform.node()}", "rows": rows}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

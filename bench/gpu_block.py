"""The LLaMA-3-8B-shaped block on one GPU: ours (with our Triton attention kernel, and with a library
FlashAttention kernel where it applies: ``attention="flash"``) against PyTorch eager and torch.compile (SDPA),
and the FLOP roofline at this GPU's measured matmul rate; then ours on 2, 4 and 8 virtual devices
of the same GPU, planned with the paper's cost model and with the calibrated one.  FP16, 2 warm-ups and
10 timed rounds, CUDA events.

    python bench/gpu_block.py [--workloads 1K,8K,8x1K,128x1K,128K] [--out bench/results]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
from common import WORKLOADS, busy_ms_by_kind, matmul_rate  # bench/common.py

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, llama_block, llama_feeds
from relational_tensors.machine.calibrate import time_cuda, time_wall

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with CuPy and PyTorch

D, HQ, HKV, DFF = LLAMA3_8B["d_model"], LLAMA3_8B["n_heads"], LLAMA3_8B["n_kv_heads"], LLAMA3_8B["d_ff"]
DH = D // HQ
EPS, BASE = 1e-5, 500000.0


def block_flops(b: int, s: int) -> float:
    t = b * s
    mm = 2 * t * (D * D + 2 * D * HKV * DH + D * D + 3 * D * DFF)
    attn = 4 * b * HQ * DH * (s * (s + 1) // 2)
    return float(mm + attn)


def torch_block(torch, feeds: dict, b: int, s: int):
    import torch.nn.functional as F

    dev = "cuda"
    p = {k: torch.from_numpy(v).to(dev) for k, v in feeds.items()}
    pos = torch.arange(s, device=dev, dtype=torch.float64)
    inv = BASE ** (-torch.arange(0, DH, 2, device=dev, dtype=torch.float64) / DH)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos().half()[None, :, None, :], ang.sin().half()[None, :, None, :]

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).half() * w

    def rope(x):
        x1, x2 = x[..., : DH // 2], x[..., DH // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def block(x):
        h = rms(x, p["attn_norm"])
        q = rope((h @ p["wq"]).view(b, s, HQ, DH))
        k = rope((h @ p["wk"]).view(b, s, HKV, DH))
        v = (h @ p["wv"]).view(b, s, HKV, DH)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x2 = x + a.transpose(1, 2).reshape(b, s, D) @ p["wo"]
        h2 = rms(x2, p["ffn_norm"])
        return x2 + (F.silu(h2 @ p["w1"]) * (h2 @ p["w3"])) @ p["w2"]

    return block, p["x"]


def jax_block(feeds: dict, b: int, s: int):
    """The same block in JAX (jax.jit, jax.nn.dot_product_attention with grouped kv heads, on cuDNN's
    fused flash attention where JAX has it, else XLA's): returns a function that runs it once and waits
    for the result, the result itself, and the attention implementation used."""
    import jax
    import jax.numpy as jnp

    p = {k: jnp.asarray(v) for k, v in feeds.items()}
    ang = np.arange(s, dtype=np.float64)[:, None] * (BASE ** (-np.arange(0, DH, 2, dtype=np.float64) / DH))[None, :]
    cos = jnp.asarray(np.cos(ang).astype(np.float16))[None, :, None, :]
    sin = jnp.asarray(np.sin(ang).astype(np.float16))[None, :, None, :]

    def rms(x, w):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)).astype(jnp.float16) * w

    def rope(x):
        x1, x2 = x[..., : DH // 2], x[..., DH // 2:]
        return jnp.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)

    def block(x, p, implementation):
        h = rms(x, p["attn_norm"])
        q = rope((h @ p["wq"]).reshape(b, s, HQ, DH))
        k = rope((h @ p["wk"]).reshape(b, s, HKV, DH))
        v = (h @ p["wv"]).reshape(b, s, HKV, DH)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        x2 = x + a.reshape(b, s, D) @ p["wo"]
        h2 = rms(x2, p["ffn_norm"])
        return x2 + (jax.nn.silu(h2 @ p["w1"]) * (h2 @ p["w3"])) @ p["w2"]

    failed = ""
    for implementation in ("cudnn", None):
        f = jax.jit(functools.partial(block, implementation=implementation))
        try:
            y = f(p["x"], p)
        except Exception as e:  # noqa: BLE001 - no cuDNN attention for this build or shape: XLA's
            failed = f"cudnn failed: {type(e).__name__}: {str(e)[:120]}; "
            continue
        return (lambda f=f: f(p["x"], p).block_until_ready()), y, failed + (implementation or "xla")
    raise RuntimeError(failed)


def main() -> None:
    import cupy
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--virtual", default="2,4,8")
    ap.add_argument("--virtual-cost-models", default="paper,calibrated",
                    help="plan the logical-device runs with each of these cost models")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    rate = matmul_rate()
    print(f"matmul rate {rate / 1e12:.0f} TFLOP/s (fp16 8192^3)", flush=True)
    rows = {}
    for name in args.workloads.split(","):
        b, s = WORKLOADS[name]
        g = llama_block(b, s, dtype="float16", **LLAMA3_8B)
        feeds = llama_feeds(g, seed=1)
        t0 = time.perf_counter()
        cg = rt.compileGraph(g, device="cuda:0")
        compile_s = time.perf_counter() - t0
        cg.load(feeds)
        ex = cg.executor
        ours = time_cuda(cg.execute, ex.streams[0])
        y = cg.offload("y", like="cupy")
        kinds = busy_ms_by_kind(cg)
        # the same plan with a library FlashAttention kernel (flash-attn, else PyTorch's) where it applies
        try:
            cgf = rt.compileGraph(g, device="cuda:0", attention="flash")
            cgf.load(feeds)
            flash = time_cuda(cgf.execute, cgf.executor.streams[0])
            yf = cgf.offload("y", like="cupy")
            rows_flash = {"ours_flash_ms": statistics.mean(flash), "ours_flash_all": flash,
                          "flash_max_abs_diff_vs_ours": float(cupy.max(cupy.abs(yf.astype(cupy.float32)
                                                                             - y.astype(cupy.float32))))}
            del cgf, yf
        except Exception as e:  # noqa: BLE001 - report it and go on with the rest
            rows_flash = {"ours_flash_error": f"{type(e).__name__}: {e}"}
        cupy.get_default_memory_pool().free_all_blocks()
        block, x = torch_block(torch, feeds, b, s)
        with torch.no_grad():
            stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
            eager = time_cuda(cast(Callable[[], None], lambda block=block, x=x: block(x)), stream)
            ref = block(x)
            compiled = torch.compile(block)
            comp = time_cuda(cast(Callable[[], None], lambda compiled=compiled, x=x: compiled(x)), stream)
        diff = float(cupy.max(cupy.abs(y.astype(cupy.float32) - cupy.asarray(ref.float()))))
        del ref
        torch.cuda.empty_cache()
        try:  # JAX where installed (its own allocator: grows as needed, see XLA_PYTHON_CLIENT_PREALLOCATE)
            run_jax, jy, impl = jax_block(feeds, b, s)
            jax_times = time_wall(run_jax)
            rows_jax = {"jax_ms": statistics.mean(jax_times), "jax_all": jax_times, "jax_attention": impl,
                        "jax_max_abs_diff_vs_ours": float(np.max(np.abs(np.asarray(jy, dtype=np.float32)
                                                                        - cupy.asnumpy(y).astype(np.float32))))}
            del run_jax, jy
        except Exception as e:  # noqa: BLE001 - absent, or out of memory at this size
            rows_jax = {"jax_error": f"{type(e).__name__}: {str(e)[:300]}"}
        roof = block_flops(b, s) / rate * 1e3
        rows[name] = {"ours_ms": statistics.mean(ours), "eager_ms": statistics.mean(eager),
                      "compile_ms": statistics.mean(comp), "roofline_ms": roof, "compile_s": compile_s,
                      "max_abs_diff_vs_torch": diff, "ours_all": ours,
                      "ours_eager_breakdown_ms": {k: round(v, 4) for k, v in
                                                  sorted(kinds.items(), key=lambda kv: -kv[1])},
                      **rows_flash, **rows_jax}
        for p in [int(v) for v in args.virtual.split(",") if v] if s * b >= 8192 else []:
            for model in args.virtual_cost_models.split(","):
                key = f"virtual{p}" + ("" if model == "paper" else f"_{model}")
                cgv = rt.compileGraph(g, device="cuda:" + ",".join(["0"] * p), cost_model=model)
                cgv.load(feeds)
                exv = cgv.executor
                tv = time_cuda(cgv.execute, exv.streams[0])
                yv = cgv.offload("y", like="cupy")
                rows[name][f"{key}_ms"] = statistics.mean(tv)
                rows[name][f"{key}_tasks"] = dict(cgv.dag.counts())
                rows[name][f"{key}_busy_ms_all_streams"] = busy_ms_by_kind(cgv)
                rows[name][f"{key}_max_abs_diff"] = float(cupy.max(cupy.abs(yv.astype(cupy.float32)
                                                                          - y.astype(cupy.float32))))
                del cgv, exv
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[name].items()
                     if k not in ("ours_all", "ours_flash_all", "jax_all")},
              flush=True)
        del cg, ex, y
        torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
    geo = lambda key: math.exp(sum(math.log(r[key]) for r in rows.values()) / len(rows))  # noqa: E731
    summary = {k: geo(k) for k in ("ours_ms", "eager_ms", "compile_ms", "roofline_ms")}
    for key in ("ours_flash_ms", "jax_ms"):
        if all(key in r for r in rows.values()):
            summary[key] = geo(key)
    out = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "matmul_tflops": rate / 1e12,
           "torch": torch.__version__, "python": platform.python_version(), "dtype": "float16",
           "rounds": "2 warm-ups + 10 timed, CUDA events", "workloads": rows, "geomean": summary}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_block.json").write_text(json.dumps(out, indent=2))
    lines = ["| workload | ours (ms) | ours, flash attention (ms) | torch eager (ms) | torch.compile (ms) |"
             " JAX jit (ms) | roofline (ms) | ours / roofline | 2 virt. (paper / calibrated) | 4 virt. | 8 virt. |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def virtual(r: dict, p: int) -> str:
        got = [f"{r[k]:.2f}" for k in (f"virtual{p}_ms", f"virtual{p}_calibrated_ms") if k in r]
        return " / ".join(got) or "-"

    for n, r in rows.items():
        virt = " | ".join(virtual(r, p) for p in (2, 4, 8))
        fl = f"{r['ours_flash_ms']:.2f}" if "ours_flash_ms" in r else "-"
        jx = f"{r['jax_ms']:.2f}" if "jax_ms" in r else "-"
        lines.append(f"| {n} | {r['ours_ms']:.2f} | {fl} | {r['eager_ms']:.2f} | {r['compile_ms']:.2f} | {jx} | "
                     f"{r['roofline_ms']:.2f} | {r['ours_ms'] / r['roofline_ms']:.2f} | {virt} |")
    fl = f"{summary['ours_flash_ms']:.2f}" if "ours_flash_ms" in summary else "-"
    jx = f"{summary['jax_ms']:.2f}" if "jax_ms" in summary else "-"
    lines.append(f"| geomean | {summary['ours_ms']:.2f} | {fl} | {summary['eager_ms']:.2f} | "
                 f"{summary['compile_ms']:.2f} | {jx} | "
                 f"{summary['roofline_ms']:.2f} | {summary['ours_ms'] / summary['roofline_ms']:.2f} | | | |")
    (path / "gpu_block.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

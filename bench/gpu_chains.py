"""The paper's matrix chains A-E on one GPU: ours (compiled for one device) against PyTorch
(cuBLAS matmuls in the same order) and JAX (jit), FP16, 2 warm-ups and 10 timed rounds.
Ours and PyTorch are timed with CUDA events; JAX with the wall clock around block_until_ready.

    python bench/gpu_chains.py [--chains A,B,C,D,E] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import cast

import relational_tensors as rt
from relational_tensors.graph.models import CHAINS, chain_feeds, matrix_chain
from relational_tensors.machine.calibrate import time_cuda, time_wall


def main() -> None:
    import cupy
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--chains", default="A,B,C,D,E")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows = {}
    for name in args.chains.split(","):
        dims, order = CHAINS[name]
        g = matrix_chain(name, "float16")
        feeds = chain_feeds(g, seed=0)  # on every CPU core: chain E alone is 3.8 G values
        cg = rt.compileGraph(g, device="cuda:0")
        cg.load(feeds)
        ours = time_cuda(cg.execute, cg.executor.streams[0])
        y = cg.offload("y", like="cupy")
        mats = {int(k[1:]): torch.from_numpy(v).cuda() for k, v in feeds.items()}

        def chain(node, mats):
            if isinstance(node, int):
                return mats[node]
            return chain(node[0], mats) @ chain(node[1], mats)

        with torch.no_grad():
            stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
            tt = time_cuda(cast(Callable[[], None], lambda order=order, mats=mats: chain(order, mats)), stream)
            ref = chain(order, mats)
        jax_ms = None
        try:
            import jax
            import jax.numpy as jnp

            jm = {i: jnp.asarray(v) for i, v in ((int(k[1:]), v) for k, v in feeds.items())}

            def jchain(node, m):
                return m[node] if isinstance(node, int) else jchain(node[0], m) @ jchain(node[1], m)

            f = jax.jit(lambda m, order=order: jchain(order, m))
            jax_ms = statistics.mean(time_wall(cast(Callable[[], None], lambda f=f, jm=jm: f(jm).block_until_ready())))
            del jm
        except Exception as e:  # JAX absent or unable to share the GPU
            print(f"JAX skipped: {type(e).__name__}: {e}")
        rel = float(cupy.max(cupy.abs(y.astype(cupy.float32) - cupy.asarray(ref.float())))) / max(
            1e-6, float(ref.float().abs().max()))
        rows[name] = {"ours_ms": statistics.mean(ours), "torch_ms": statistics.mean(tt), "jax_ms": jax_ms,
                      "ours_vs_torch": statistics.mean(ours) / statistics.mean(tt), "max_rel_diff_vs_torch": rel}
        print(name, rows[name], flush=True)
        del cg, y, mats, ref
        torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_chains.json").write_text(json.dumps({"gpu": "H200", "dtype": "float16", "workloads": rows}, indent=2))
    lines = ["| chain | ours (ms) | PyTorch (ms) | JAX (ms) | ours / PyTorch |", "|---|---|---|---|---|"]
    for n, r in rows.items():
        jx = f"{r['jax_ms']:.2f}" if r["jax_ms"] is not None else "-"
        lines.append(f"| {n} | {r['ours_ms']:.2f} | {r['torch_ms']:.2f} | {jx} | {r['ours_vs_torch']:.3f} |")
    (path / "gpu_chains.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

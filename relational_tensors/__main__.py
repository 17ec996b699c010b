"""Command line: ``relational-tensors demo`` (the README's main job)."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    import relational_tensors as rt
    from relational_tensors.devices import visible_gpus
    from relational_tensors.models import llama_block, llama_feeds

    console = Console()
    device = args.device or (None if visible_gpus() else "cpu:8")
    g = llama_block(batch=2, seq=256, d_model=256, n_heads=8, n_kv_heads=2, d_ff=704, dtype="float32",
                    seq_ends=[64, 100, 256])
    console.print("[bold]LLaMA-style block[/]: batch 2 x 256 tokens (packed: 3 sequences), d_model 256, "
                  "8 query / 2 kv heads, d_ff 704, float32")
    t0 = time.perf_counter()
    cg = rt.compileGraph(g, device=device, topology=args.topology)
    planned = time.perf_counter() - t0
    cg.explain()
    console.print(f"planned for {cg.devices} in {planned:.3f}s; task DAG: {cg.dag.summary()}")
    feeds = llama_feeds(g)
    t0 = time.perf_counter()
    out = cg.run(feeds)["y"]
    ran = time.perf_counter() - t0
    ref = rt.reference(g, feeds)["y"]
    err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    ok = err < 1e-4
    peak = max(cg.memory().values())
    console.print(f"ran on {cg.p} devices in {ran:.2f}s; peak memory per device {peak / 2**20:.1f} MiB; "
                  f"max relative difference from the single-device reference: {err:.1e} "
                  + ("[green]OK[/]" if ok else "[red]MISMATCH[/]"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relational-tensors", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan, run and check a LLaMA-style block on every device (or 8 virtual CPUs)")
    d.add_argument("--device", default=None, help="cpu:N, cuda:0,1,... (default: every GPU, else cpu:8)")
    d.add_argument("--topology", default="hgx-h200", help="the machine the plan is simulated on")
    d.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

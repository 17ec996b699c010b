"""Command line: ``relational-tensors demo`` (the README's main job)."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import relational_tensors as rt
    from relational_tensors.dp_optimizer import interval_requests
    from relational_tensors.models import llama_block, llama_feeds
    from relational_tensors.reference import execute_spec

    console = Console()
    p = args.devices
    g = llama_block(batch=2, seq=96, d_model=128, n_heads=8, n_kv_heads=2, d_ff=352, dtype="float32",
                    seq_ends=None)
    feeds = llama_feeds(g)
    t0 = time.perf_counter()
    values: dict[int, np.ndarray] = {}
    for n in g.nodes:
        values[n.id] = feeds[n.name] if n.op is None else rt.execute_spec(n.op, n.op.spec(), [values[i] for i in n.inputs])
    console.print(f"[bold]LLaMA-style block[/] batch=2 seq=96 d_model=128 heads=8/2 d_ff=352, float32, "
                  f"reference in {time.perf_counter() - t0:.2f}s")
    table = Table(title=f"every balanced join-agg spec at p={p}, executed on {p} virtual devices vs the reference")
    for col in ("operator", "kind", "balanced specs", "example split", "max |error|"):
        table.add_column(col)
    worst = 0.0
    for n in g.operators:
        inputs = [values[i] for i in n.inputs]
        specs = [s for s in (n.op.spec(r) for r in interval_requests(n.op, p)) if s.balanced]
        err = max((float(np.max(np.abs(execute_spec(n.op, s, inputs) - values[n.id]))) for s in specs), default=0.0)
        worst = max(worst, err)
        table.add_row(n.name, n.kind, str(len(specs)), specs[0].split_text if specs else "-", f"{err:.1e}")
    console.print(table)
    ok = worst < 1e-3
    console.print(("[green]all specs match the reference[/]" if ok else "[red]mismatch[/]") + f" (worst {worst:.1e})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relational-tensors", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="decompose a LLaMA-style block and check it against the reference")
    d.add_argument("--devices", type=int, default=8)
    d.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

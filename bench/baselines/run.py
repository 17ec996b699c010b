"""Time the hand-written PyTorch baselines on N GPUs, one process per GPU.

    python -m torch.distributed.run --nproc_per_node N bench/baselines/run.py \\
        --strategy tp|sp|dp|chain|best --workload 8K[,1K,8x1K,128x1K,128K,A,...] [--check] [--json out.json]
    python -m torch.distributed.run --nproc_per_node N bench/baselines/run.py --train \\
        --strategy ddp|fsdp|best --workload 8K[,4x2K,32x1K] [--check] [--json out.json]

Strategies: ``tp`` (Megatron tensor parallelism), ``sp`` (sequence parallelism), ``dp`` (data
parallelism), ``chain`` (row-sharded matrix chain, for the workloads A-E) and ``best`` (every one that
applies to the workload; the fastest is reported, as the paper's hand-tuned baseline picks per
workload).  Several strategies may be given, comma-separated.  Each case runs 2 warm-ups and 10 timed
rounds (``--warmups``, ``--rounds``) and reports the slowest rank's mean.  ``--check`` gathers the
output and compares it on rank 0 with a single-process run on the same seeded weights.

``--train`` times the block's training step instead (``bench/gpu_train.py``'s step: forward, MSE
against a random target, backward, AdamW on float32 master weights; ``baselines/train.py``) with
``ddp`` (DistributedDataParallel) and ``fsdp`` (FSDP2 ``fully_shard``); ``best`` is both.  Its
``--check`` runs ``--check-steps`` fresh steps and compares the parameters and AdamW moments on rank 0
with a single-process eager run over the whole batch.

On CUDA: NCCL and float16 (``--train``: bfloat16).  Without CUDA (or ``--device cpu``): gloo and
float32, e.g. ``torchrun --nproc_per_node 2 bench/baselines/run.py --device cpu --shape tiny --workload
2x32 --check``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from baselines.block import reference_block
from baselines.chain import prepare_chain, reference_chain
from baselines.common import (
    SHAPES,
    WORKLOADS,
    BlockShape,
    Dist,
    NotApplicable,
    Prepared,
    init_dist,
    parse_workload,
    summary,
    time_rounds,
)
from baselines.llama_dp import prepare_dp
from baselines.llama_sp import prepare_sp
from baselines.llama_tp import prepare_tp
from baselines.train import HYPER, TRAIN_STRATEGIES, TrainPrepared, compare_states, reference_train

__all__ = ["BLOCK_STRATEGIES", "arguments", "run", "worker", "main"]

BLOCK_STRATEGIES: dict[str, Callable[[Dist, BlockShape, int, int, int], Prepared]] = {
    "tp": prepare_tp, "sp": prepare_sp, "dp": prepare_dp,
}
ALL_STRATEGIES = (*BLOCK_STRATEGIES, "chain", *TRAIN_STRATEGIES, "best")
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# --train --check: (AdamW moments: largest difference over the largest magnitude; parameters: largest
# difference over lr * steps).  float32 differs from the single process only in the order the gradients'
# partial sums are added (per rank, then reduced); bfloat16 also in the rounding of every rank's matmuls
# (and FSDP2 computes with bfloat16 norm weights, the autocast reference with float32 ones), which can
# turn the sign of a near-zero gradient and so move a parameter about 2 lr away in a step: there the
# parameters' bound only catches gross errors (a mis-gathered parameter is off by its magnitude, 1e2-1e3 lr).
TRAIN_TOLERANCE = {torch.float32: (1e-4, 1e-2), torch.float16: (5e-2, 4.0), torch.bfloat16: (5e-2, 4.0)}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    ap.add_argument("--strategy", default="best", help=f"comma-separated, of {ALL_STRATEGIES} (default best)")
    ap.add_argument("--workload", default=",".join(WORKLOADS),
                    help="comma-separated: [batch x]tokens[K] (1K, 8x1K, 2x32) or a chain A-E")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="the block's sizes")
    ap.add_argument("--d-model", type=int, help="override the shape's d_model")
    ap.add_argument("--heads", type=int, help="override the shape's query heads")
    ap.add_argument("--kv-heads", type=int, help="override the shape's key/value heads")
    ap.add_argument("--d-ff", type=int, help="override the shape's FFN width")
    ap.add_argument("--chain-scale", type=int, default=1, help="divide every chain dimension (default 1)")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                    help="default float16 on CUDA, float32 on CPU")
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", action="store_true",
                    help="time the block's training step (bench/gpu_train.py's) with ddp and fsdp instead")
    ap.add_argument("--check", action="store_true", help="compare each output with a single-process run")
    ap.add_argument("--check-steps", type=int, default=2, help="--train --check: the steps compared (default 2)")
    ap.add_argument("--tolerance", type=float, help="largest |out - ref| / max|ref| a check accepts "
                    "(default 1e-4 in float32, 2e-2 in float16; --train: of the AdamW moments, 1e-4 in "
                    "float32, 5e-2 in bfloat16)")
    ap.add_argument("--json", type=Path, help="write the results here (rank 0)")
    ap.add_argument("--save-outputs", type=Path, help=argparse.SUPPRESS)  # tests: rank 0 saves gathered outputs
    args = ap.parse_args(argv)
    asked = [s.strip() for s in args.strategy.split(",") if s.strip()]
    bad = [s for s in asked if s not in ALL_STRATEGIES]
    if bad or not asked:
        ap.error(f"--strategy takes {ALL_STRATEGIES}; got {args.strategy!r}.")
    if args.rounds < 1 or args.warmups < 0 or args.chain_scale < 1:
        ap.error(f"--rounds must be >= 1, --warmups >= 0 and --chain-scale >= 1; got {args.rounds}, "
                 f"{args.warmups}, {args.chain_scale}.")
    try:
        block_shape(args)
    except ValueError as e:
        ap.error(str(e))
    train = set(TRAIN_STRATEGIES)
    wrong = [s for s in asked if s != "best" and (s in train) != args.train]
    if wrong:
        ap.error(f"{wrong}: ddp and fsdp time the training step and need --train; with --train only ddp, fsdp "
                 f"and best run.")
    if args.check_steps < 1:
        ap.error(f"--check-steps must be >= 1; got {args.check_steps}.")
    if args.train and args.dtype is None:  # gpu_train's activations: bfloat16 on a GPU
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        args.dtype = "bfloat16" if cuda else "float32"
    args.strategies = asked
    try:
        args.workloads = [parse_workload(w.strip()) + (w.strip(),) for w in args.workload.split(",") if w.strip()]
    except ValueError as e:
        ap.error(str(e))
    if args.train and any(family != "block" for family, _, _ in args.workloads):
        ap.error(f"--train runs the block's training step; the chains have none (got {args.workload!r}).")
    return args


def block_shape(args: argparse.Namespace) -> BlockShape:
    base = SHAPES[args.shape]
    return BlockShape(args.d_model or base.d_model, args.heads or base.n_heads, args.kv_heads or base.n_kv_heads,
                      args.d_ff or base.d_ff, base.eps, base.rope_base)


def _strategies(family: str, asked: Sequence[str], train: bool = False) -> list[str]:
    """The strategies to run for a workload of ``family``: ``best`` expands to every one of the family
    (with ``train``: every training strategy)."""
    family_strategies = list(TRAIN_STRATEGIES) if train else list(BLOCK_STRATEGIES) if family == "block" else ["chain"]
    out: list[str] = []
    for s in asked:
        for t in (family_strategies if s == "best" else [s]):
            if t not in out:
                out.append(t)
    return out


def _agree(ctx: Dist, code: int) -> int:
    """The worst status over the ranks (0 ok, 1 not applicable, 2 error), so that all ranks go on alike."""
    if ctx.world == 1:
        return code
    t = torch.tensor([code], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _release(ctx: Dist) -> None:
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


P = TypeVar("P")


def set_up(ctx: Dist, row: dict[str, Any], make: Callable[[], P]) -> P | None:
    """``make()`` on every rank: its result where every rank set the case up, else None with the row's status
    (not applicable, or an error) and reason set, the memory released; the ranks agree before any times."""
    prep, code, reason = None, 0, ""
    try:
        prep = make()
    except NotApplicable as e:
        code, reason = 1, str(e)
    except Exception as e:  # noqa: BLE001 - one failing case (out of memory, say) must not stop the others
        code, reason = 2, f"{type(e).__name__}: {e}"
    agreed = _agree(ctx, code)
    if agreed:
        prep = None
        _release(ctx)
        row.update(status="not applicable" if agreed == 1 else "error",
                   reason=reason or "another rank could not set this case up")
    return prep


def run_case(ctx: Dist, args: argparse.Namespace, family: str, spec: Any, label: str, strategy: str) -> dict[str, Any]:
    """Set up, time and (with ``--check``) verify one strategy on one workload; the row for rank 0."""
    if args.train:
        return run_train_case(ctx, args, spec, label, strategy)
    row: dict[str, Any] = {"workload": label, "strategy": strategy, "world": ctx.world}
    shape = block_shape(args)

    def make() -> Prepared:
        if family == "chain" and strategy != "chain":
            raise NotApplicable(f"{strategy} is a block strategy; chain {spec} runs with --strategy chain.")
        if family == "block" and strategy == "chain":
            raise NotApplicable(f"chain is the matrix-chain strategy; workload {label} is a block.")
        if family == "chain":
            return prepare_chain(ctx, spec, args.seed, args.chain_scale)
        batch, seq = spec
        return BLOCK_STRATEGIES[strategy](ctx, shape, batch, seq, args.seed)

    prep = set_up(ctx, row, make)
    if prep is None:
        return row
    row["note"] = prep.note
    try:
        times = time_rounds(prep.step, ctx, args.warmups, args.rounds)
        row.update(status="ok", **summary(times), ms_all=times)
        if args.check or args.save_outputs:
            with torch.no_grad():
                out = prep.gather(prep.step())
            prep = None
            _release(ctx)
            try:
                if ctx.rank == 0:
                    row["check"] = _check(ctx, args, family, spec, out, label, strategy)
            finally:  # the other ranks wait here for rank 0's single-process run, even when it fails
                del out
                ctx.barrier()
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"{type(e).__name__}: {e}")
    prep = None
    _release(ctx)
    return row


def _check(ctx: Dist, args: argparse.Namespace, family: str, spec: Any, out: torch.Tensor, label: str,
           strategy: str) -> dict[str, Any]:
    if args.save_outputs:
        args.save_outputs.mkdir(parents=True, exist_ok=True)
        torch.save(out.cpu(), args.save_outputs / f"{label}_{strategy}_w{ctx.world}.pt")
    if family == "chain":
        ref = reference_chain(spec, args.seed, ctx.device, ctx.dtype, args.chain_scale)
    else:
        ref = reference_block(spec[0], spec[1], block_shape(args), args.seed, ctx.device, ctx.dtype)
    if tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "reason": f"shape {tuple(out.shape)} vs single-process {tuple(ref.shape)}"}
    diff = float((out.float() - ref.float()).abs().max())
    scale = float(ref.float().abs().max()) or 1.0
    tol = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[ctx.dtype]
    return {"ok": diff / scale <= tol, "max_abs": diff, "max_rel": diff / scale, "tolerance": tol}


def run_train_case(ctx: Dist, args: argparse.Namespace, spec: tuple[int, int], label: str,
                   strategy: str) -> dict[str, Any]:
    """Set up, time and (with ``--check``) verify one training strategy on one workload; the row for rank 0."""
    row: dict[str, Any] = {"workload": label, "strategy": strategy, "world": ctx.world}
    batch, seq = spec
    prep = set_up(ctx, row, lambda: TRAIN_STRATEGIES[strategy](ctx, block_shape(args), batch, seq, args.seed))
    if prep is None:
        return row
    try:
        times = time_rounds(prep.step, ctx, args.warmups, args.rounds)
        row.update(status="ok", **summary(times), ms_all=times, optimizer=prep.optimizer(),
                   note=f"{prep.note}; AdamW {prep.optimizer()}")
        prep = None
        _release(ctx)
        if args.check or args.save_outputs:
            check = _check_train(ctx, args, spec, label, strategy)
            if ctx.rank == 0:
                row["check"] = check
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"{type(e).__name__}: {e}")
    prep = None
    _release(ctx)
    return row


def _check_train(ctx: Dist, args: argparse.Namespace, spec: tuple[int, int], label: str,
                 strategy: str) -> dict[str, Any]:
    """``--check-steps`` steps of a fresh setup, their global losses, and (rank 0) the parameters and AdamW
    moments after them against a single-process eager run over the whole batch."""
    batch, seq = spec
    shape = block_shape(args)
    fresh: TrainPrepared | None = TRAIN_STRATEGIES[strategy](ctx, shape, batch, seq, args.seed)
    assert fresh is not None
    losses = []
    for _ in range(args.check_steps):
        part = fresh.step().float().reshape(1)
        losses.append(float(ctx.all_reduce(part).item()) / ctx.world)  # the weighted losses sum to world x global
    state = fresh.state()
    state = {k: v.float().cpu() for k, v in state.items()} if ctx.rank == 0 else {}
    fresh = None
    _release(ctx)
    try:
        if ctx.rank != 0:
            return {}
        if args.save_outputs:
            args.save_outputs.mkdir(parents=True, exist_ok=True)
            torch.save({"state": state, "losses": losses},
                       args.save_outputs / f"{label}_{strategy}_w{ctx.world}_train.pt")
        want, ref_losses = reference_train(batch, seq, shape, args.seed, ctx.device, ctx.dtype, args.check_steps)
        found = compare_states(state, want, args.check_steps)
        moments, params = TRAIN_TOLERANCE[ctx.dtype]
        if args.tolerance is not None:
            moments = args.tolerance
        loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses))
        rel = max(found["exp_avg_max_rel"], found["exp_avg_sq_max_rel"])
        return {"ok": rel <= moments and found["params_max_over_lr_steps"] <= params and loss_rel <= moments,
                "max_rel": rel, **found, "loss_max_rel": loss_rel, "losses": losses, "reference_losses": ref_losses,
                "steps": args.check_steps, "tolerance": {"moments": moments, "params_over_lr_steps": params,
                                                         "losses": moments}}
    finally:  # the other ranks wait here for rank 0's single-process run, even when it fails
        del state
        ctx.barrier()


def run(ctx: Dist, args: argparse.Namespace, echo: bool = True) -> dict[str, Any]:
    """Every asked strategy on every asked workload; the rows, and the best strategy of each workload."""
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    if args.dtype and DTYPES[args.dtype] != ctx.dtype:  # a group of several command lines (the tests)
        ctx = replace(ctx, dtype=DTYPES[args.dtype])
    for family, spec, label in args.workloads:
        for strategy in _strategies(family, args.strategies, args.train):
            row = run_case(ctx, args, family, spec, label, strategy)
            rows.append(row)
            if echo and ctx.rank == 0:
                print(_line(row), flush=True)
        done = [r for r in rows if r["workload"] == label and r["status"] == "ok"
                and r.get("check", {}).get("ok", True)]
        if done:
            win = min(done, key=lambda r: r["ms"])
            best[label] = {"strategy": win["strategy"], "ms": win["ms"], "ms_min": win["ms_min"],
                           "tried": {r["strategy"]: r["ms"] for r in done}}
    return {"header": _header(ctx, args), "rows": rows, "best": best}


def _line(row: dict[str, Any]) -> str:
    head = f"{row['workload']:>8} {row['strategy']:>5} x{row['world']}: "
    if row["status"] != "ok":
        return head + f"{row['status']}: {row['reason']}"
    text = head + f"{row['ms']:.3f} ms (min {row['ms_min']:.3f})"
    if "check" in row:
        c = row["check"]
        text += (f"; check {'ok' if c['ok'] else 'FAILED'}"
                 + (f" (max rel diff {c['max_rel']:.2e})" if "max_rel" in c else f" ({c.get('reason')})"))
    return text + (f"; {row['note']}" if row.get("note") else "")


def _header(ctx: Dist, args: argparse.Namespace) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if ctx.backend == "nccl" else None
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "world": ctx.world, "backend": ctx.backend, "nccl": nccl, "device": gpu or "cpu",
            "dtype": str(ctx.dtype).removeprefix("torch."), "shape": vars(block_shape(args)),
            "chain_scale": args.chain_scale, "seed": args.seed,
            "mode": "train" if args.train else "forward",
            **({"train": {"step": "bench/gpu_train.py's: forward, MSE against a random target in float32, "
                                  "backward, AdamW on float32 master weights; the batch split by sequences",
                          "adamw": {k: list(v) if isinstance(v, tuple) else v for k, v in HYPER.items()},
                          "check_steps": args.check_steps}} if args.train else {}),
            "rounds": f"{args.warmups} warm-ups + {args.rounds} timed; "
                      + ("CUDA events" if ctx.events else "perf_counter") + ", barrier before each round, "
                      "slowest rank's time"}


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table (one row per case), then the best strategy per workload."""
    lines = ["| workload | strategy | GPUs | mean (ms) | min (ms) | check | note |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] == "ok":
            c = r.get("check")
            check = "-" if c is None else ("ok" if c["ok"] else "FAILED") + (
                f" ({c['max_rel']:.1e})" if "max_rel" in c else "")
            lines.append(f"| {r['workload']} | {r['strategy']} | {r['world']} | {r['ms']:.3f} | {r['ms_min']:.3f} "
                         f"| {check} | {r.get('note', '')} |")
        else:
            lines.append(f"| {r['workload']} | {r['strategy']} | {r['world']} | - | - | - | "
                         f"{r['status']}: {r['reason']} |")
    lines += ["", "| workload | best | mean (ms) |", "|---|---|---|"]
    lines += [f"| {w} | {b['strategy']} | {b['ms']:.3f} |" for w, b in result["best"].items()]
    return "\n".join(lines)


def _failed(result: dict[str, Any]) -> bool:
    return any(r["status"] == "error" or not r.get("check", {}).get("ok", True) for r in result["rows"])


def worker(rank: int, world: int, port: int, argvs: Sequence[Sequence[str]], out: str) -> None:
    """One rank on CPU with gloo, for ``torch.multiprocessing.spawn`` (the tests): runs each command line
    of ``argvs`` in one process group and has rank 0 write the list of results as JSON to ``out``."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    ctx = init_dist("cpu", "float32", rank=rank, world=world)
    try:
        results = [run(ctx, arguments([*argv, "--device", "cpu"]), echo=False) for argv in argvs]
        if rank == 0:
            Path(out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(argv)
    ctx = init_dist(args.device, args.dtype)
    try:
        result = run(ctx, args)
        if ctx.rank == 0:
            print(markdown(result))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=1) + "\n")
                print(f"wrote {args.json}")
    finally:
        dist.destroy_process_group()
    return 1 if ctx.rank == 0 and _failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention's backward on one GPU: our Triton kernels (Δ = rowsum(dO·O), dq, dk|dv) against PyTorch SDPA's
backward (the flash backend, and cuDNN where this PyTorch has it), single-sequence causal GQA with 32 query
heads, 8 kv heads, head dim 128, bfloat16, at 8K and 32K tokens.

FLOP convention: the backward counts 2.5 times the forward's matmul FLOPs (forward: QKᵀ and PV, 4·s²·d per
query head; backward: QKᵀ again, dO·Vᵀ, dS·K, dSᵀ·Q and Pᵀ·dO, 10·s²·d), halved for the causal mask:
5·s²·d·heads_q.  Our log-sum-exp pass (``attention_lse``, which a training step's forward kernel writes
where the plan's blocks line up, ``memory_plan.sibling_tasks``, and recomputes elsewhere) is timed and
reported apart, outside those TFLOP/s.

Ours is timed as the executor runs it (each kernel's configuration the fastest of its candidates on the
first launch), and with ``--sweep`` every candidate configuration of the dq and dk|dv kernels is timed and
checked on its own, for tuning the candidate lists.

Each run first checks our gradients against SDPA's (bfloat16 tolerance, relative to the largest magnitude)
and stops if they differ; then 2 warm-ups and 10 timed rounds with CUDA events per measurement.  Results
go to bench/results/gpu_attention_bwd.json and .md.

    python bench/gpu_attention_bwd.py [--tokens 8192,32768] [--backends flash,cudnn,flash-det,cudnn-det] [--sweep]
                                       [--heads 32,8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
TOLERANCE = 3e-2  # bfloat16 inputs, P and dS rounded to 16 bits on both sides, float32 accumulation


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768", help="sequence lengths, comma-separated (default 8192,32768)")
    ap.add_argument("--backends", default="flash,cudnn,flash-det,cudnn-det",
                    help="SDPA backends to compare against, comma-separated among flash, cudnn, efficient; a -det\n"
                         "suffix runs it under torch.use_deterministic_algorithms(True) (not warn_only: PyTorch\n"
                         "keeps its non-deterministic kernel with a warning there)")
    ap.add_argument("--heads", default=f"{HEADS_Q},{HEADS_KV}",
                    help=f"query and kv heads (default {HEADS_Q},{HEADS_KV}; 4,1: one of eight head shards)")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per measurement (default 10)")
    ap.add_argument("--warmups", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time and check every candidate configuration of the dq and dk|dv kernels")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="directory for gpu_attention_bwd.json and .md")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in str(args.tokens).split(",") if t]
    args.backends = [b for b in str(args.backends).split(",") if b]
    args.heads_q, args.heads_kv = (int(h) for h in str(args.heads).split(","))
    if args.heads_q % args.heads_kv:
        ap.error(f"--heads takes query heads a multiple of kv heads; got {args.heads}")
    bad = sorted({b.removesuffix("-det") for b in args.backends} - {"flash", "cudnn", "efficient"})
    if bad or not args.tokens or min(args.tokens) < 1:
        ap.error(f"--backends takes flash, cudnn, efficient (each with an optional -det) and --tokens positive "
                 f"lengths; got {bad or args.tokens}")
    return args


def backward_flops(tokens: int, causal: bool = True, heads_q: int = HEADS_Q) -> float:
    """2.5 times the forward's matmul FLOPs (4·s²·d per query head), halved under a causal mask.

    >>> backward_flops(1024) / 1e9
    21.47483648
    """
    return 2.5 * 4.0 * tokens * tokens * HEAD_DIM * heads_q * (0.5 if causal else 1.0)


def _relative(got: Any, want: Any) -> float:
    scale = float(want.abs().max().float())
    return float((got.float() - want.float()).abs().max()) / max(scale, 1e-30)


REPEATS = 5  # backward passes compared bit for bit: does a kernel give the same gradient every run?


def _same_bits(grads: Sequence[Any], again: Sequence[Any]) -> bool:
    import torch

    return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(grads, again))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from relational_tensors.kernels import triton_attention_grad as tg
    from relational_tensors.kernels.common import DevBuf, bind_triton_to_cupy
    from relational_tensors.kernels.launchers import key_query_limits
    from relational_tensors.kernels.scratch import dkv_scratch
    from relational_tensors.machine.calibrate import time_cuda

    bind_triton_to_cupy()
    dev = "cuda"
    heads_q, heads_kv = args.heads_q, args.heads_kv
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None),
                "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def buf(t: torch.Tensor) -> DevBuf:
        return DevBuf(t.data_ptr(), tuple(t.shape), str(t.dtype).replace("torch.", ""), 0, tuple(t.stride()))

    def timed(fn) -> float:
        with stream:  # our kernels launch on CuPy's current stream: PyTorch's, here
            return statistics.mean(time_cuda(fn, stream, args.rounds, args.warmups))

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "shape": {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": HEAD_DIM,
                                     "dtype": "bfloat16", "causal": True, "batch": 1},
                           "flops": "2.5 x forward matmul FLOPs (4 s^2 d heads_q), halved for causal",
                           "rounds": args.rounds, "warmups": args.warmups, "rows": []}
    scale = 1.0 / math.sqrt(HEAD_DIM)

    def measure(s: int) -> dict[str, Any]:
        gen = torch.Generator(device=dev).manual_seed(s)
        q, do = (torch.randn(1, s, heads_q, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
                 for _ in range(2))
        k, v = (torch.randn(1, s, heads_kv, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        lo_h, hi_h = np.zeros(s, dtype=np.int64), np.arange(1, s + 1)  # causal: row r sees keys [0, r + 1)
        qlo_h, qhi_h = key_query_limits(lo_h, hi_h, s)
        lo, hi, qlo, qhi = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(dev)
                            for a in (lo_h, hi_h, qlo_h, qhi_h))
        flops = backward_flops(s, heads_q=heads_q)
        row: dict[str, Any] = {"tokens": s, "gflop": flops / 1e9, "sdpa": {}}

        # the references: SDPA's forward once per backend, its backward timed alone
        ref_grads = None
        for name in args.backends:
            backend = backends[name.removesuffix("-det")]
            deterministic = name.endswith("-det")
            if backend is None:
                row["sdpa"][name] = {"error": "this PyTorch has no such SDPA backend"}
                continue
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            found = None
            for gqa in ("native", "kv expanded"):  # a backend without GQA reads k and v repeated per query head
                try:
                    torch.use_deterministic_algorithms(deterministic)  # warn_only would keep the fast kernel
                    with sdpa_kernel(backend), warnings.catch_warnings(record=True) as said:
                        warnings.simplefilter("always")
                        kx, vx = (kk, vv) if gqa == "native" else \
                            (t.repeat_interleave(heads_q // heads_kv, dim=2) for t in (kk, vv))
                        o = F.scaled_dot_product_attention(qq.transpose(1, 2), kx.transpose(1, 2), vx.transpose(1, 2),
                                                           is_causal=True, enable_gqa=gqa == "native").transpose(1, 2)
                        grads = torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
                        same = all(_same_bits(grads, torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
                                   for _ in range(REPEATS - 1))
                        ms = timed(lambda o=o, qq=qq, kk=kk, vv=vv: torch.autograd.grad(o, (qq, kk, vv), do,
                                                                                       retain_graph=True))
                    found = gqa
                    break
                except RuntimeError as e:  # no kernel of this backend for these inputs
                    row["sdpa"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                finally:
                    torch.use_deterministic_algorithms(False)
            if found is None:
                print(s, name, "unavailable:", row["sdpa"][name]["error"][:120], flush=True)
                continue
            row["sdpa"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "gqa": found, "same_bits": same,
                                 "warnings": sorted({str(w.message)[:200] for w in said})}
            print(s, f"sdpa {name} (GQA {found}): {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s, same bits over "
                     f"{REPEATS} backward passes: {same}", flush=True)
            if ref_grads is None:
                ref_grads, o_ref = grads, o.detach().contiguous()
            del o, grads
        if ref_grads is None:
            raise SystemExit(f"no SDPA backend among {args.backends} runs these inputs: nothing to check ours against")

        # ours: lse (the forward's, recomputed), then Δ, dq and dk|dv from it
        lse = torch.empty(1, s, heads_q, device=dev, dtype=torch.float32)
        delta = torch.empty_like(lse)
        dq = torch.empty_like(q)
        dkv = torch.empty(1, s, heads_kv, 2 * HEAD_DIM, device=dev, dtype=torch.bfloat16)
        bq, bk, bv, bdo, bo = (buf(t) for t in (q, k, v, do, o_ref))
        blse, bdelta, bdq, bdkv = buf(lse), buf(delta), buf(dq), buf(dkv)
        blo, bhi, bqlo, bqhi = buf(lo), buf(hi), buf(qlo), buf(qhi)

        def ours_lse() -> None:
            tg.attention_lse(bq, bk, blse, blo, bhi, 0, 0, scale)

        def ours_delta() -> None:
            tg.attention_delta(bo, bdo, bdelta)

        def ours_dq() -> None:
            tg.attention_dq(bq, bk, bv, bdo, blse, bdelta, bdq, blo, bhi, 0, 0, scale)

        # the scratch the executor gives a dk|dv pass that splits its query heads (a small grid)
        need = dkv_scratch(1, s, heads_kv, heads_q // heads_kv, 2 * HEAD_DIM)
        scratch = buf(torch.empty(max(need, 1), device=dev, dtype=torch.float32)) if need else None

        def ours_dkv() -> None:
            tg.attention_dkv(bq, bk, bv, bdo, blse, bdelta, bdkv, bqlo, bqhi, 0, 0, scale, scratch=scratch)

        def ours_backward() -> None:
            ours_delta()
            ours_dq()
            ours_dkv()

        with stream:  # the first launches choose each kernel's configuration
            ours_lse()
            ours_backward()
        stream.synchronize()
        first = (dq.clone(), dkv.clone())
        same = True
        for _ in range(REPEATS - 1):
            with stream:
                ours_backward()
            stream.synchronize()
            same = same and _same_bits(first, (dq, dkv))
        errors = {"dq": _relative(dq, ref_grads[0]), "dk": _relative(dkv[..., :HEAD_DIM], ref_grads[1]),
                  "dv": _relative(dkv[..., HEAD_DIM:], ref_grads[2])}
        row["max_error_vs_sdpa"] = errors
        print(s, "error vs SDPA (of the largest magnitude):", {n: f"{e:.2e}" for n, e in errors.items()}, flush=True)
        if max(errors.values()) > TOLERANCE:
            raise SystemExit(f"our gradients differ from SDPA's at {s} tokens: {errors} > {TOLERANCE}; not timing")
        times = {"lse": timed(ours_lse), "delta": timed(ours_delta), "dq": timed(ours_dq), "dkv": timed(ours_dkv),
                 "backward": timed(ours_backward)}
        row["ours"] = {"ms": times, "tflops": flops / times["backward"] / 1e9, "same_bits": same,
                       "tflops_with_lse": flops / (times["backward"] + times["lse"]) / 1e9,
                       "configs": {str(key): list(cfg) for key, cfg in tg._chosen.items()}}  # every shape so far
        print(s, f"ours: {times['backward']:.3f} ms {flops / times['backward'] / 1e9:.0f} TFLOP/s (delta "
                 f"{times['delta']:.3f}, dq {times['dq']:.3f}, dk|dv {times['dkv']:.3f}; lse {times['lse']:.3f}), "
                 f"same bits over {REPEATS} backward passes: {same}", flush=True)
        if args.sweep:
            row["sweep"] = sweep(bq, bk, bv, bdo, blse, bdelta, bdq, bdkv, blo, bhi, bqlo, bqhi, dq, dkv, ref_grads, s,
                                 scratch)
        return row

    def sweep(bq, bk, bv, bdo, blse, bdelta, bdq, bdkv, blo, bhi, bqlo, bqhi, dq, dkv, ref_grads,
              s: int, scratch) -> dict[str, Any]:
        """Every candidate configuration of the dq and the dk|dv kernel forced in turn: ms and the error
        against SDPA (a configuration that cannot launch here, for shared memory or registers, says why)."""
        launches = {"dq": lambda cfg: tg.attention_dq(bq, bk, bv, bdo, blse, bdelta, bdq, blo, bhi, 0, 0, scale,
                                                      config=cfg),
                    "dkv": lambda cfg: tg.attention_dkv(bq, bk, bv, bdo, blse, bdelta, bdkv, bqlo, bqhi, 0, 0, scale,
                                                        config=cfg, scratch=scratch)}
        found: dict[str, Any] = {}
        for kind, launch in launches.items():
            found[kind] = {}
            for cfg in tg.ROW_CONFIGS[kind]:
                try:
                    with stream:
                        launch(cfg)
                    stream.synchronize()
                except Exception as e:  # noqa: BLE001 - out of shared memory or registers for this config
                    found[kind][str(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    continue
                err = (_relative(dq, ref_grads[0]) if kind == "dq" else
                       max(_relative(dkv[..., :HEAD_DIM], ref_grads[1]), _relative(dkv[..., HEAD_DIM:], ref_grads[2])))
                ms = timed(lambda cfg=cfg, launch=launch: launch(cfg))
                found[kind][str(cfg)] = {"ms": ms, "max_error_vs_sdpa": err}
                print(s, kind, cfg, f"{ms:.3f} ms, error {err:.1e}", flush=True)
        return found

    for s in args.tokens:
        out["rows"].append(measure(s))
        torch.cuda.empty_cache()
    return out


def _bits(timed: dict[str, Any]) -> str:
    """Whether repeated backward passes gave the same bits (results from before the check: not recorded)."""
    same = timed.get("same_bits")
    return "n/a" if same is None else f"yes ({REPEATS} runs)" if same else "no"


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table (ms and TFLOP/s side by side)."""
    names = sorted({n for r in result["rows"] for n in r["sdpa"]})
    head = ["tokens", "ours ms (Δ + dq + dk\\|dv)", "ours TFLOP/s", "ours same bits", "ours lse ms"]
    for n in names:
        head += [f"SDPA {n} ms", f"SDPA {n} TFLOP/s", f"SDPA {n} same bits", f"ours / SDPA {n}"]
    head.append("max error vs SDPA")
    lines = [f"# Attention backward, {result['gpu']} (torch {result['torch']})", "",
             f"Causal GQA, {result['shape']['heads_q']} query heads, {result['shape']['heads_kv']} kv heads, head dim "
             f"{HEAD_DIM}, bfloat16, one sequence; "
             f"FLOPs: {result['flops']}; {result['warmups']} warm-ups + {result['rounds']} timed rounds, CUDA events. "
             "Ours is Δ, dq and dk|dv from a saved log-sum-exp; our lse pass (where the forward does not write it) "
             "is the separate column.  'same bits': whether repeated backward passes on the same inputs gave "
             "bit-identical gradients; a -det backend ran under torch.use_deterministic_algorithms(True).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        ours = r["ours"]
        cells = [str(r["tokens"]), f"{ours['ms']['backward']:.3f} ({ours['ms']['delta']:.3f} + {ours['ms']['dq']:.3f} "
                 f"+ {ours['ms']['dkv']:.3f})", f"{ours['tflops']:.0f}", _bits(ours), f"{ours['ms']['lse']:.3f}"]
        for n in names:
            got = r["sdpa"].get(n, {})
            if "ms" in got:
                ratio = ours["tflops"] / got["tflops"]
                cells += [f"{got['ms']:.3f}", f"{got['tflops']:.0f}", _bits(got), f"{ratio:.2f}"]
            else:  # not asked for, or refused by PyTorch (its error in the JSON)
                cells += ["refused: " + got["error"][:60].replace("|", "/") if "error" in got else "n/a"] + ["n/a"] * 3
        cells.append(f"{max(r['max_error_vs_sdpa'].values()):.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    for r in result["rows"]:
        for kind, configs in r.get("sweep", {}).items():
            lines += ["", f"{r['tokens']} tokens, every {kind} configuration (BLOCK_M, BLOCK_N, warps, stages, loads):",
                      ""] + [f"- {c}: " + (f"{v['ms']:.3f} ms, error {v['max_error_vs_sdpa']:.1e}" if "ms" in v
                                           else v["error"]) for c, v in configs.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_attention_bwd.json").write_text(json.dumps(result, indent=2))
    (path / "gpu_attention_bwd.md").write_text(markdown(result))
    print(markdown(result), file=sys.stdout)


if __name__ == "__main__":
    main()

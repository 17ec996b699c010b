"""A training step of the LLaMA-3-8B-shaped block on one GPU: ours against PyTorch eager and torch.compile.

The step is forward, backward and AdamW: bfloat16 activations and parameters with float32 master
weights and moments (ours: ``adamw(master_dtype="float32")``; PyTorch: float32 parameters under
``torch.autocast(bfloat16)``, SDPA attention, ``torch.optim.AdamW(fused=True)``), the mean-square error
against a random target as the loss (the block has none of its own), the same initial weights and batch.
PyTorch runs eager, with ``torch.compile(model)``, and with the whole step compiled (where torch compiles
it).  Ours runs on one device and on 2, 4 and 8 logical devices of the same GPU, those planned with the paper's
cost model and with the calibrated one.  2 warm-ups and 10 timed
rounds each, CUDA events; the FLOP roofline at the measured bf16 matmul rate (forward matmuls x 3,
attention x 3.5: its backward recomputes the scores, FlashAttention-2's convention); the per-kernel-kind
breakdown of our step (a profiled run, a CUDA event around every task).  Before timing, the first step's
loss and the parameters after three steps are compared with PyTorch's eager run.

    python bench/gpu_train.py [--workloads 8K,4x2K,32x1K] [--virtual 2,4,8] [--virtual-cost-models paper,calibrated]
                              [--skip-ours] [--torch-modes eager,model,step] [--recompute] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import busy_ms_by_kind, matmul_rate  # bench/common.py

import relational_tensors as rt
from relational_tensors.graph.models import LLAMA3_8B, add_llama_block
from relational_tensors.graph.optim import adamw
from relational_tensors.machine.calibrate import time_cuda

D, HQ, HKV, DFF = LLAMA3_8B["d_model"], LLAMA3_8B["n_heads"], LLAMA3_8B["n_kv_heads"], LLAMA3_8B["d_ff"]
DH = D // HQ
EPS, BASE = 1e-5, 500000.0
LR, BETAS, ADAM_EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
WORKLOADS = {"8K": (1, 8192), "4x2K": (4, 2048), "32x1K": (32, 1024)}
WEIGHTS = {"attn_norm": [D], "wq": [D, HQ * DH], "wk": [D, HKV * DH], "wv": [D, HKV * DH], "wo": [HQ * DH, D],
           "ffn_norm": [D], "w1": [D, DFF], "w3": [D, DFF], "w2": [DFF, D]}


def step_graph(b: int, s: int, d_model: int = D, n_heads: int = HQ, n_kv_heads: int = HKV,
               d_ff: int = DFF, recompute: bool = False) -> tuple[rt.Graph, Any]:
    """The block's training step as one graph: bfloat16 states for the weights, float32 masters and
    moments, the MSE against ``target`` in float32, AdamW at the input ``lr``; with ``recompute`` the
    block is one ``g.recompute()`` region (only its input and output kept for the backward)."""
    g = rt.Graph()
    x = g.input("x", [b, s, d_model], "bfloat16", dims=("batch", "seq", "model"))
    target = g.input("target", [b, s, d_model], "bfloat16", dims=("batch", "seq", "model"))
    with g.recompute() if recompute else contextlib.nullcontext():
        y = add_llama_block(g, x, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff, eps=EPS, rope_base=BASE,
                            leaf=g.state)
    loss = g.save(g.mse(g.cast(y, "float32"), g.cast(target, "float32"), name="mse"), name="loss")
    params = g.trainable()
    lr = g.input("lr", [1], "float32")
    opt = adamw(g, params, g.grad(loss, params), lr, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY,
                master_dtype="float32")
    return g, opt


def initial_weights(d_model: int, weights: dict[str, list[int]], seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights: norms near one, projections scaled by 1/sqrt(fan-in)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weights.items():
        if len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
    return out


def our_feeds(g: rt.Graph, opt: Any, w: dict[str, np.ndarray], x: np.ndarray, target: np.ndarray) -> dict:
    import ml_dtypes

    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()}
    feeds = {**bf16, "x": x, "target": target, "lr": np.array([LR], np.float32)}
    feeds.update(opt.initial({k: v for k, v in w.items()}))
    return feeds


def block_flops(b: int, s: int) -> float:
    """The step's matmul FLOPs: forward x 3 for the projections, x 3.5 for causal attention."""
    t = b * s
    mm = 2 * t * (D * HQ * DH + 2 * D * HKV * DH + HQ * DH * D + 3 * D * DFF)
    attn = 4 * b * HQ * DH * (s * (s + 1) // 2)
    return float(3 * mm + 3.5 * attn)


def torch_step(torch: Any, w: dict[str, np.ndarray], x: np.ndarray, target: np.ndarray, s: int,
               compile_mode: str) -> tuple[Any, Any, Any]:
    """PyTorch's step (eager, ``model`` compiled, or the whole step compiled): returns the step function,
    the module and its optimizer."""
    import torch.nn.functional as F

    dev = "cuda"
    pos = torch.arange(s, device=dev, dtype=torch.float64)
    inv = BASE ** (-torch.arange(0, DH, 2, device=dev, dtype=torch.float64) / DH)
    ang = pos[:, None] * inv[None, :]
    cos = ang.cos().to(torch.bfloat16)[None, :, None, :]
    sin = ang.sin().to(torch.bfloat16)[None, :, None, :]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for k, v in w.items():
                self.register_parameter(k, torch.nn.Parameter(torch.from_numpy(v.copy()).to(dev)))

        def rms(self, h: Any, weight: Any) -> Any:  # LLaMA's RMSNorm: float32 statistics
            hf = h.float()
            return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)

        @staticmethod
        def rope(t: Any) -> Any:
            t1, t2 = t[..., : DH // 2], t[..., DH // 2:]
            return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

        def forward(self, xb: Any) -> Any:
            b, s_, _ = xb.shape
            h = self.rms(xb, self.attn_norm)
            q = self.rope((h @ self.wq).view(b, s_, HQ, DH))
            k = self.rope((h @ self.wk).view(b, s_, HKV, DH))
            v = (h @ self.wv).view(b, s_, HKV, DH)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            x2 = xb + a.transpose(1, 2).reshape(b, s_, HQ * DH) @ self.wo
            h2 = self.rms(x2, self.ffn_norm)
            return x2 + (F.silu(h2 @ self.w1) * (h2 @ self.w3)) @ self.w2

    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY,
                            fused=True)
    xt = torch.from_numpy(x.view(np.int16)).to(dev).view(torch.bfloat16)  # the same bf16 bits
    tt = torch.from_numpy(target.view(np.int16)).to(dev).view(torch.bfloat16)
    forward = torch.compile(model) if compile_mode == "model" else model

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = forward(xt)
        loss = F.mse_loss(y.float(), tt.float())
        loss.backward()
        opt.step()
        return loss

    return (torch.compile(step) if compile_mode == "step" else step), model, opt


def run_ours(g: rt.Graph, feeds: dict, device: str, cost_model: str = "paper") -> dict[str, Any]:
    import cupy

    t0 = time.perf_counter()
    cg = rt.compileGraph(g, device=device, cost_model=cost_model)
    plan_s = time.perf_counter() - t0
    cg.load(feeds)
    cg.execute()
    first_loss = float(np.asarray(cg.offload("loss")).reshape(-1)[0])
    cg.execute()
    cg.execute()  # three steps: the parameters compared with PyTorch's after the same three
    params = {k: np.asarray(cg.offload(k)).astype(np.float32) for k in WEIGHTS}
    ms = time_cuda(cg.execute, cg.executor.streams[0])
    row = {"ms": statistics.mean(ms), "all_ms": ms, "plan_s": plan_s, "first_loss": first_loss,
           "predicted_peak_bytes": max(cg.memory().values()), "predicted_total_bytes": sum(cg.memory().values()),
           "arena_bytes": sum(cg.executor.arena_bytes.values()),
           "pool_used_bytes": cupy.get_default_memory_pool().used_bytes(), "breakdown_ms": busy_ms_by_kind(cg)}
    row["outside_arena_bytes"] = row["pool_used_bytes"] - row["arena_bytes"]  # what the pool holds besides the arenas
    del cg
    cupy.get_default_memory_pool().free_all_blocks()
    return row | {"params_after_3": params}


def main() -> None:
    import cupy
    import ml_dtypes
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--virtual", default="2,4,8")
    ap.add_argument("--virtual-cost-models", default="paper,calibrated",
                    help="cost models that plan the logical-device runs (paper, calibrated)")
    ap.add_argument("--skip-ours", action="store_true", help="only PyTorch's steps and the roofline")
    ap.add_argument("--recompute", action="store_true",
                    help="ours with the block as one g.recompute() region (activation checkpointing): the "
                         "breakdown's 'recomputation' is the time of the operators made again")
    ap.add_argument("--torch-modes", default="eager,model,step",
                    help="PyTorch's steps to time: eager, model (torch.compile(model)), step (the whole step compiled)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    rate = matmul_rate()
    print(f"matmul rate {rate / 1e12:.0f} TFLOP/s (fp16 8192^3)", flush=True)
    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    rows: dict[str, dict[str, Any]] = {}
    for name in args.workloads.split(","):
        b, s = WORKLOADS[name]
        rng = np.random.default_rng(1)
        w = initial_weights(D, WEIGHTS)
        x = rng.standard_normal((b, s, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
        target = rng.standard_normal((b, s, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
        row: dict[str, Any] = {"roofline_ms": block_flops(b, s) / rate * 1e3}
        torch_params: dict[str, np.ndarray] = {}
        for mode in [m for m in args.torch_modes.split(",") if m]:
            key = {"eager": "torch_eager", "model": "torch_compile", "step": "torch_compile_step"}[mode]
            try:
                fn, model, _ = torch_step(torch, w, x, target, s, mode)
                first = float(fn())
                fn()
                fn()
                if mode == "eager":
                    torch_params = {k: v.detach().float().cpu().numpy() for k, v in model.named_parameters()}
                    row["torch_first_loss"] = first
                ms = time_cuda(fn, stream)
                row[f"{key}_ms"] = statistics.mean(ms)
                row[f"{key}_all_ms"] = ms
                print(name, key, f"{row[f'{key}_ms']:.3f} ms, first loss {first:.6f}", flush=True)
            except Exception as e:  # noqa: BLE001 - a mode torch cannot run here is reported, the rest go on
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            model = fn = None
            torch.cuda.empty_cache()
        if not args.skip_ours:
            g, opt = step_graph(b, s, recompute=args.recompute)
            feeds = our_feeds(g, opt, w, x, target)
            runs = [("cuda:0", "paper", "ours1")] + [
                ("cuda:" + ",".join(["0"] * int(p)), model, f"ours{p}" + ("" if model == "paper" else f"_{model}"))
                for p in args.virtual.split(",") if p for model in args.virtual_cost_models.split(",") if model]
            for device, model, tag in runs:
                try:
                    r = run_ours(g, feeds, device, model)
                except Exception as e:  # noqa: BLE001
                    row[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(name, device, model, row[f"{tag}_error"], flush=True)
                    continue
                got = r.pop("params_after_3")
                print(name, device, model, {k: v for k, v in r.items() if k not in ("all_ms",)}, flush=True)
                if torch_params:  # bf16 parameters against PyTorch's float32 masters after three steps
                    r["params_max_rel_diff_vs_torch"] = max(
                        float(np.max(np.abs(got[k] - torch_params[k])) / max(np.max(np.abs(torch_params[k])), 1e-30))
                        for k in WEIGHTS)
                row.update({f"{tag}_{k}": v for k, v in r.items()})
        rows[name] = row
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                     if not k.endswith("all_ms") and not k.endswith("breakdown_ms")}, flush=True)
        write(rows, args, rate)


def write(rows: dict[str, dict[str, Any]], args: argparse.Namespace, rate: float) -> None:
    """gpu_train.json and .md of the workloads measured so far (written after each, so a run cut short keeps
    what it measured)."""
    import cupy
    import torch

    keys = ["torch_eager_ms", "torch_compile_ms", "torch_compile_step_ms", "roofline_ms", "ours1_ms"]
    summary = {}
    for key in keys:
        vals = [float(r[key]) for r in rows.values() if r.get(key) is not None]
        if vals and len(vals) == len(rows):  # a geometric mean only over every workload
            summary[key] = math.exp(sum(math.log(v) for v in vals) / len(vals))
    out = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "matmul_tflops": rate / 1e12,
           "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "rounds": "2 warm-ups + 10 timed, CUDA events",
           "recompute": args.recompute, "workloads": rows, "geomean": summary}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_train.json").write_text(json.dumps(out, indent=2))
    cols = ["ours1_ms", "torch_eager_ms", "torch_compile_ms", "torch_compile_step_ms", "roofline_ms"]
    virt = [f"ours{p}" + ("" if model == "paper" else f"_{model}") + "_ms" for p in args.virtual.split(",") if p
            for model in args.virtual_cost_models.split(",") if model]
    lines = ["| workload | ours, 1 device (ms) | torch eager (ms) | torch.compile model (ms) | torch.compile step (ms) "
             "| roofline (ms) | ours / roofline | " + " | ".join(f"ours, {k[4:-3].replace('_', ' logical, ')}"
                                                           + (" (ms)" if "_" in k[4:-3] else " logical (ms)")
                                                           for k in virt) + " |",
             "|---" * (6 + len(virt)) + "|---|"]

    def cell(r: dict, k: str) -> str:
        return f"{r[k]:.2f}" if k in r else "-"

    for n, r in list(rows.items()) + [("geomean", summary)]:
        ratio = f"{r['ours1_ms'] / r['roofline_ms']:.2f}" if "ours1_ms" in r else "-"
        lines.append(f"| {n} | " + " | ".join(cell(r, k) for k in cols) + f" | {ratio} | "
                     + " | ".join(cell(r, k) for k in virt) + " |")
    (path / "gpu_train.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

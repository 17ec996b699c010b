"""Our kernels one at a time against PyTorch's on one GPU: attention (every configuration the
executor may pick, against SDPA flash attention), RoPE and RMSNorm (against the same formulas under
torch.compile), and train-mode dropout (against torch's ``F.dropout``).  FP16, LLaMA-3-8B shapes (32 query
heads, 8 kv heads, head dim 128, d_model 4096), 2 warm-ups and 10 timed rounds with CUDA events (5 for
attention at 128K tokens).

    python bench/gpu_kernels.py [--tokens 8192,131072] [--out bench/results]   # -> gpu_kernels.json
    python bench/gpu_kernels.py --sweep   # attention over a grid of configurations -> gpu_kernels_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def main() -> None:
    import cupy
    import torch
    import torch.nn.functional as F

    from relational_tensors.kernels import triton_attention as ta
    from relational_tensors.kernels.common import DevBuf, bind_triton_to_cupy
    from relational_tensors.kernels.triton_norms import rmsnorm
    from relational_tensors.kernels.triton_random import dropout
    from relational_tensors.kernels.triton_rope import rope
    from relational_tensors.machine.calibrate import time_cuda

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,131072")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", action="store_true",
                    help="time a grid of attention configurations (tile sizes, warps, stages, warp specialization) "
                         "besides the executor's own, and skip RoPE and RMSNorm")
    args = ap.parse_args()
    bind_triton_to_cupy()
    dev = "cuda"
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def buf(t: torch.Tensor) -> DevBuf:
        return DevBuf(t.data_ptr(), tuple(t.shape), str(t.dtype).replace("torch.", ""), 0)

    def timed(fn, rounds: int = 10) -> float:
        with stream:  # our kernels launch on CuPy's current stream: PyTorch's, here
            return statistics.mean(time_cuda(fn, stream, rounds))

    hq, hkv, dh, dm = 32, 8, 128, 4096
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "attention": {}, "rope": {},
                 "rmsnorm": {}, "dropout": {}}
    for s in [int(v) for v in args.tokens.split(",")]:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, s, hq, dh, device=dev, dtype=torch.float16, generator=g)
        k = torch.randn(1, s, hkv, dh, device=dev, dtype=torch.float16, generator=g)
        v = torch.randn(1, s, hkv, dh, device=dev, dtype=torch.float16, generator=g)
        lo = torch.zeros(s, device=dev, dtype=torch.int32)
        hi = torch.arange(1, s + 1, device=dev, dtype=torch.int32)
        o = torch.empty_like(q)
        rounds = 10 if s <= 16384 else 5
        flops = 4 * hq * dh * s * (s + 1) / 2
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True).transpose(1, 2)
            sdpa = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True), rounds)
        row: dict[str, Any] = {"sdpa_ms": sdpa, "sdpa_tflops": flops / sdpa / 1e9, "configs": {}}
        scale = 1 / math.sqrt(dh)
        base_args = (buf(q), buf(k), buf(v), buf(o), None, buf(lo), buf(hi))
        cfgs = set(ta.CONFIGS)
        if args.sweep:
            cfgs |= {(bm, bn, w, st, 1, 1, tma) for bm, w in ((64, 4), (128, 8)) for bn in (64, 128)
                     for st in (2, 3, 4) for tma in (0, 1)}
        kargs, consts, _, tma = ta.launch_arguments(*base_args, 0, 0, scale)
        for cfg in sorted(cfgs):
            try:
                ms = timed(lambda cfg=cfg, kargs=kargs, consts=consts, s=s, tma=tma:
                           ta._launch(cfg, kargs, consts, s, hq, tma), rounds)
            except Exception as e:  # noqa: BLE001 - report and go on
                row["configs"][str(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            diff = float((o.float() - ref.float()).abs().max())
            row["configs"][str(cfg)] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_diff_vs_sdpa": diff}
            print(s, cfg, f"{ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s diff {diff:.4f}", flush=True)
        print(s, f"sdpa {sdpa:.3f} ms {flops / sdpa / 1e9:.0f} TFLOP/s", flush=True)
        out["attention"][s] = row
        if args.sweep:
            continue

        # RoPE of the query projection (32 heads) and RMSNorm of the residual stream
        x = torch.randn(1, s, hq, dh, device=dev, dtype=torch.float16)
        y = torch.empty_like(x)
        starts = torch.zeros(s, device=dev, dtype=torch.int64)
        inv = 500000.0 ** (-torch.arange(0, dh, 2, device=dev, dtype=torch.float64) / dh)
        ang = torch.arange(s, device=dev, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().half()[None, :, None, :], ang.sin().half()[None, :, None, :]

        def torch_rope(x, cos=cos, sin=sin):
            x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        crope = torch.compile(torch_rope)
        nbytes = 2 * x.numel() * 2
        ours = timed(lambda x=x, y=y, starts=starts: rope(buf(x), buf(y), buf(starts), 0, 500000.0))
        theirs = timed(lambda crope=crope, x=x: crope(x))
        out["rope"][s] = {"ours_ms": ours, "compile_ms": theirs, "ours_GBps": nbytes / ours / 1e6,
                          "max_abs_diff": float((y.float() - crope(x).float()).abs().max())}
        print(s, "rope", out["rope"][s], flush=True)
        h = torch.randn(1, s, dm, device=dev, dtype=torch.float16)
        w = torch.randn(dm, device=dev, dtype=torch.float16)
        hn = torch.empty_like(h)

        def torch_rms(x, w=w):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).half() * w

        crms = torch.compile(torch_rms)
        nbytes = 2 * h.numel() * 2
        ours = timed(lambda h=h, w=w, hn=hn: rmsnorm(buf(h), buf(w), buf(hn), 1e-5))
        theirs = timed(lambda crms=crms, h=h: crms(h))
        out["rmsnorm"][s] = {"ours_ms": ours, "compile_ms": theirs, "ours_GBps": nbytes / ours / 1e6,
                             "max_abs_diff": float((hn.float() - crms(h).float()).abs().max())}
        print(s, "rmsnorm", out["rmsnorm"][s], flush=True)
        # dropout of the residual stream, p = 0.1: ours draws Philox per element from a device-side state
        state = torch.tensor([1234, 5], device=dev, dtype=torch.int64)
        ours = timed(lambda h=h, hn=hn, state=state: dropout(buf(h), buf(state), buf(hn), (0, 0, 0), tuple(h.shape),
                                                             0.1, 1))
        theirs = timed(lambda h=h: F.dropout(h, 0.1, training=True))
        out["dropout"][s] = {"ours_ms": ours, "torch_ms": theirs, "ours_GBps": nbytes / ours / 1e6,
                             "kept": float((hn != 0).float().mean())}
        print(s, "dropout", out["dropout"][s], flush=True)
        torch.cuda.empty_cache()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / ("gpu_kernels_sweep.json" if args.sweep else "gpu_kernels.json")).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

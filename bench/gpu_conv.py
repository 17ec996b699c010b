"""Our convolution beside PyTorch's ``conv2d`` (cuDNN) on one GPU, side by side in one run: a
ResNet-50-like 3x3 layer (batch 32, 64 -> 64 channels, 56x56, padding 1) and a ViT-B/16 patch embedding
(batch 32, 3 -> 768 channels, 224x224, kernel = stride = 16), in bfloat16 and float16.  Ours is the
compiled one-operator graph on 1 device and on 4 logical devices of the same GPU (CUDA-graph replay),
theirs ``F.conv2d`` eagerly and under ``torch.compile``; 2 warm-ups and 10 timed rounds, CUDA events.
The results are checked against each other first (16-bit tolerance).

    python bench/gpu_conv.py [--out bench/results/gpu_conv.md]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from common import write_table  # bench/common.py (scripts run from the repository root)

LAYERS = {  # name: (x shape, w shape, stride, padding)
    "resnet50_3x3": ((32, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    "vit_b16_patch": ((32, 3, 224, 224), (768, 3, 16, 16), 16, 0),
}


def main() -> None:
    import cupy
    import torch
    import torch.nn.functional as F

    import relational_tensors as rt
    from relational_tensors.machine.calibrate import time_cuda

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gpu_conv.md")
    args = ap.parse_args()
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    data: dict[str, Any]
    rows, data = [], {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": {}}
    for name, (xs, ws, stride, pad) in LAYERS.items():
        for dtype in ("bfloat16", "float16"):
            tdt = getattr(torch, dtype)
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(xs, device="cuda", dtype=tdt, generator=gen)
            w = torch.randn(ws, device="cuda", dtype=tdt, generator=gen) / np.sqrt(np.prod(ws[1:]))
            flops = 2.0 * np.prod(ws) * xs[0] * ((xs[2] + 2 * pad - ws[2]) // stride + 1) ** 2
            want = F.conv2d(x, w, stride=stride, padding=pad)
            entry: dict = {"flops": flops}
            def cudnn(x=x, w=w, stride=stride, pad=pad) -> None:
                F.conv2d(x, w, stride=stride, padding=pad)

            def conv(a, b, stride=stride, pad=pad):
                return F.conv2d(a, b, stride=stride, padding=pad)

            compiled = torch.compile(conv)
            theirs = statistics.mean(time_cuda(cudnn, stream))
            tcomp = statistics.mean(time_cuda(
                cast(Callable[[], None], lambda compiled=compiled, x=x, w=w: compiled(x, w)), stream))
            entry.update(cudnn_ms=theirs, compile_ms=tcomp)
            for devices in ("cuda:0", "cuda:0,0,0,0"):
                g = rt.Graph()
                y = g.conv(g.input("x", list(xs), dtype), g.input("w", list(ws), dtype), stride=stride, padding=pad)
                g.save(y, name="y")
                cg = rt.compileGraph(g, device=devices)
                cg.load({"x": x, "w": w})
                cg.execute()
                got = torch.from_numpy(np.asarray(cg.offload("y"), dtype=np.float32))  # bfloat16 via ml_dtypes
                ref = want.float().cpu()
                err = float((got - ref).abs().max() / ref.abs().max())
                assert err < (2e-2 if dtype == "bfloat16" else 4e-3), (name, dtype, devices, err)
                ours = statistics.mean(time_cuda(cg.execute, cg.executor.streams[0]))
                entry[devices] = {"ms": ours, "error": err, "split": cg.plan.split(y.name)}
            data["layers"][f"{name}/{dtype}"] = entry
            one, four = entry["cuda:0"]["ms"], entry["cuda:0,0,0,0"]["ms"]
            rows.append(f"| {name} | {dtype} | {theirs:.3f} | {tcomp:.3f} | {one:.3f} | {four:.3f} | "
                        f"{theirs / one:.2f}x | {flops / one / 1e9:.0f} | {entry['cuda:0,0,0,0']['split']} |")
    lines = [f"Convolution on {data['gpu']} (torch {data['torch']}), ms per call, 2 warm-ups + 10 rounds, CUDA events",
             "", "| layer | dtype | cuDNN | torch.compile | ours, 1 device | ours, 4 logical | cuDNN / ours | "
             "ours TFLOP/s | 4-device split |", "|---|---|---|---|---|---|---|---|---|", *rows]
    write_table(args.out, lines, data)


if __name__ == "__main__":
    main()

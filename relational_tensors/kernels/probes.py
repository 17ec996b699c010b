"""``relational-tensors calibrate``: measure this GPU's kernels and write a calibration file.

Times our own kernels (cuBLAS matmuls, the Triton attention kernel, a memory-bound elementwise
kernel) over a range of sizes with CUDA events (2 warm-ups, 10 rounds; ``machine.calibrate``), and
writes the achieved rates as the curves the kernel cost model interpolates.

    relational-tensors calibrate [--out calibration.json] [--quick]
"""

from __future__ import annotations

import argparse
import math
from functools import partial

from relational_tensors.errors import ExecError
from relational_tensors.machine.calibrate import median_seconds, write_calibration
from relational_tensors.machine.devices import visible_gpus

__all__ = ["main", "measure"]


def measure(quick: bool = False) -> dict:
    """Measure matmul, attention and memory rates on GPU 0; returns the calibration dict."""
    import cupy
    import numpy as np

    from relational_tensors.kernels import triton_elementwise as te
    from relational_tensors.kernels.blas import matmul
    from relational_tensors.kernels.common import DevBuf, bind_triton_to_cupy
    from relational_tensors.kernels.triton_attention import attention

    bind_triton_to_cupy()
    stream = cupy.cuda.Stream(non_blocking=True)

    def buf(arr: cupy.ndarray, dtype: str = "float16") -> DevBuf:
        return DevBuf(arr.data.ptr, tuple(arr.shape), dtype, 0)

    curves: dict[str, list[list[float]]] = {"matmul": [], "attention": [], "memory": []}
    with stream:
        sizes = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)] if quick else [
            (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
            (16384, 4096, 4096), (4096, 4096, 14336), (8192, 14336, 4096), (16384, 16384, 16384)]
        for m, k, n in sizes:
            a = cupy.random.standard_normal((m, k), dtype=cupy.float32).astype(cupy.float16)
            b = cupy.random.standard_normal((k, n), dtype=cupy.float32).astype(cupy.float16)
            c = cupy.empty((m, n), dtype=cupy.float16)
            mm_args = (buf(a), buf(b), buf(c), stream.ptr)
            t = median_seconds(partial(matmul, *mm_args))
            curves["matmul"].append([2.0 * m * n * k, 2.0 * m * n * k / t])
        # up to the 128K-token sequence of the paper's largest workload: the rate still changes past 32K
        for seq in ([1024, 8192] if quick else [1024, 4096, 8192, 32768, 131072]):
            hq, hkv, d = 32, 8, 128
            q = cupy.random.standard_normal((1, seq, hq, d), dtype=cupy.float32).astype(cupy.float16)
            k = cupy.random.standard_normal((1, seq, hkv, d), dtype=cupy.float32).astype(cupy.float16)
            v = cupy.random.standard_normal((1, seq, hkv, d), dtype=cupy.float32).astype(cupy.float16)
            o = cupy.empty_like(q)
            rows = np.arange(seq)
            lo = cupy.asarray(np.zeros(seq, np.int32))
            hi = cupy.asarray((rows + 1).astype(np.int32))
            attn_args = (buf(q), buf(k), buf(v), buf(o), None, buf(lo, "int32"), buf(hi, "int32"), 0, 0,
                         1 / math.sqrt(d))
            t = median_seconds(partial(attention, *attn_args))
            flops = 4.0 * hq * d * seq * (seq + 1) / 2
            curves["attention"].append([flops, flops / t])
        for n in ([1 << 22, 1 << 28] if quick else [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]):
            x = cupy.random.standard_normal(n, dtype=cupy.float32).astype(cupy.float16)
            y = cupy.empty_like(x)
            unary_args = (buf(x), buf(y), "relu")
            t = median_seconds(partial(te.unary, *unary_args))
            curves["memory"].append([4.0 * n, 4.0 * n / t])
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {"gpu": name, "curves": curves}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="relational-tensors calibrate", description=__doc__)
    ap.add_argument("--out", default="calibration.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if visible_gpus() == 0:
        raise ExecError("calibration measures a GPU, and none is visible (CuPy and a CUDA driver are needed).")
    measured = measure(args.quick)
    data = write_calibration(measured["curves"], measured["gpu"], args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} points" for k, v in data["curves"].items()))
    return 0

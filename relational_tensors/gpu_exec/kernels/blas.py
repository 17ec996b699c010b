"""Matrix products through cuBLAS (cublasGemmStridedBatchedEx): fp16, bf16, fp32 and fp64, fp32
accumulation for the 16-bit types, on the caller's stream, writing into a given buffer.

cuBLAS is called through its C API (ctypes) with a handle and a fixed workspace of our own per
stream: CuPy's wrappers refuse to run while a stream is being captured, a preset workspace keeps
cuBLAS from allocating inside a CUDA graph, and products running at once on different streams (the
logical devices of one GPU) must not share a workspace."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from relational_tensors.gpu_exec.kernels.common import DevBuf

__all__ = ["matmul"]

# cudaDataType and cublasComputeType values
_CUDA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
_COMPUTE = {"float16": 68, "bfloat16": 68, "float32": 68, "float64": 70}  # CUBLAS_COMPUTE_32F / _64F
_ONE: dict[int, np.ndarray] = {68: np.array(1.0, np.float32), 70: np.array(1.0, np.float64)}
_ZERO: dict[int, np.ndarray] = {68: np.array(0.0, np.float32), 70: np.array(0.0, np.float64)}
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20

_lib: Any = None
_handles: dict[tuple[int, int], tuple[int, Any]] = {}  # (GPU, stream) -> (handle, workspace array)


def _cublas() -> Any:
    global _lib
    if _lib is None:
        import cupy  # noqa: F401  (loads libcublas into the process)
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (idem)

        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise OSError("libcublas could not be loaded")
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasGemmStridedBatchedEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, i64, vp, i32, i32,
                                                   i64, vp, vp, i32, i32, i64, i32, i32, i32]
        _lib = lib
    return _lib


def _handle(device: int, stream_ptr: int) -> int:
    key = (device, stream_ptr)
    if key not in _handles:
        import cupy

        lib = _cublas()
        with cupy.cuda.Device(device):
            h = ctypes.c_void_p()
            _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
            ws = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
            _check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.data.ptr), WORKSPACE_BYTES), "cublasSetWorkspace")
            _check(lib.cublasSetStream_v2(h, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
        assert h.value is not None  # cublasCreate succeeded, so it wrote a handle
        _handles[key] = (h.value, ws)
    return _handles[key][0]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def matmul(a: DevBuf, b: DevBuf, out: DevBuf, stream_ptr: int) -> None:
    """out[..., m, n] = a[..., m, k] @ b[k, n], batched a[..., m, k] @ b[..., k, n], or one a[m, k] shared
    by batched b[..., k, n] (a convolution's weights against its im2col columns); all contiguous."""
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    shared_a = len(a.shape) == 2 and len(b.shape) > 2
    batch = (b.size // (k * n) if shared_a else a.size // (m * k)) if m * k and k * n else 0
    if out.size == 0:
        return
    if k == 0:
        raise ValueError("matmul with an empty contraction is handled by the caller")
    lib = _cublas()
    handle = _handle(out.device, stream_ptr)
    stride_b = k * n if len(b.shape) > 2 else 0
    if not stride_b:
        # one shared b: the contiguous batch of a is one tall matrix, so one GEMM.  As a batched GEMM the
        # block's products over 128 x 1024 rows took 88 ms on an H200, the same products over 131072
        # rows of one sequence 77 ms (bench/results/gpu_block.json, per-task profile)
        m, batch = m * batch, 1
    ctype = _COMPUTE[out.dtype]
    dt = _CUDA_TYPE[a.dtype]
    # row-major C = A @ B is column-major C^T = B^T @ A^T
    status = lib.cublasGemmStridedBatchedEx(
        ctypes.c_void_p(handle), 0, 0, n, m, k, ctypes.c_void_p(_ONE[ctype].ctypes.data),
        ctypes.c_void_p(b.ptr), dt, n, stride_b,
        ctypes.c_void_p(a.ptr), dt, k, 0 if shared_a else m * k,
        ctypes.c_void_p(_ZERO[ctype].ctypes.data),
        ctypes.c_void_p(out.ptr), _CUDA_TYPE[out.dtype], n, m * n,
        batch, ctype, _GEMM_DEFAULT,
    )
    _check(status, f"cublasGemmStridedBatchedEx ({m}x{k} @ {k}x{n}, batch {batch}, {a.dtype})")

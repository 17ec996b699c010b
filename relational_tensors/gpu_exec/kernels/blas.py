"""Matrix products through cuBLAS (gemmStridedBatchedEx): fp16, bf16, fp32 and fp64, fp32
accumulation for the 16-bit types, on the caller's stream, writing into a given buffer."""

from __future__ import annotations

import numpy as np

from relational_tensors.gpu_exec.kernels.common import DevBuf

__all__ = ["matmul"]

# cudaDataType and cublasComputeType values
_CUDA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
_COMPUTE = {"float16": 68, "bfloat16": 68, "float32": 68, "float64": 70}  # CUBLAS_COMPUTE_32F / _64F
_ONE = {68: np.array(1.0, np.float32), 70: np.array(1.0, np.float64)}
_ZERO = {68: np.array(0.0, np.float32), 70: np.array(0.0, np.float64)}
_GEMM_DEFAULT = -1


def matmul(a: DevBuf, b: DevBuf, out: DevBuf, stream_ptr: int) -> None:
    """out[..., m, n] = a[..., m, k] @ b[k, n] or batched b[..., k, n]; all contiguous."""
    from cupy.cuda import cublas, device

    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    batch = a.size // (m * k) if m * k else 0
    if out.size == 0:
        return
    if k == 0:
        raise ValueError("matmul with an empty contraction is handled by the caller")
    stride_b = k * n if len(b.shape) > 2 else 0
    handle = device.get_cublas_handle()
    cublas.setStream(handle, stream_ptr)
    ctype = _COMPUTE[out.dtype]
    dt = _CUDA_TYPE[a.dtype]
    # row-major C = A @ B is column-major C^T = B^T @ A^T
    cublas.gemmStridedBatchedEx(
        handle, 0, 0, n, m, k, _ONE[ctype].ctypes.data,
        b.ptr, dt, n, stride_b,
        a.ptr, dt, k, m * k,
        _ZERO[ctype].ctypes.data,
        out.ptr, _CUDA_TYPE[out.dtype], n, m * n,
        batch, ctype, _GEMM_DEFAULT,
    )

"""Matrix products through cuBLAS (cublasGemmStridedBatchedEx): fp16, bf16, fp32 and fp64, fp32
accumulation for the 16-bit types, on the caller's stream, writing into a given buffer.

cuBLAS is called through its C API (ctypes) with a handle and a fixed workspace of our own per
stream: CuPy's wrappers refuse to run while a stream is being captured, a preset workspace keeps
cuBLAS from allocating inside a CUDA graph, and products running at once on different streams (the
logical devices of one GPU) must not share a workspace."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.kernels.common import DevBuf

__all__ = ["matmul", "einsum_gemm", "einsum_gemm_plan", "Gemm"]

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


def _fuse(buf: DevBuf, letters: tuple[str, ...], group: tuple[str, ...]) -> tuple[int, int] | None:
    """(size, stride) of the letters ``group`` of ``buf`` fused into one dimension in that order (the last
    letter innermost), or None when the memory layout does not allow it; size-1 letters fit anywhere."""
    size, stride, expected = 1, None, None
    for c in reversed(group):
        n, s = buf.shape[letters.index(c)], buf.strides[letters.index(c)]
        if n == 1:
            continue
        if expected is not None and s != expected:
            return None
        stride = s if stride is None else stride
        expected = s * n
        size *= n
    return size, (1 if stride is None else stride)


def _operand(rows: tuple[int, int], cols: tuple[int, int]) -> tuple[int, int] | None:
    """How cuBLAS (column-major) reads a logical matrix of ``rows`` (size, stride) by ``cols``: (op, ld),
    op 0 = as stored column-major, 1 = transposed; None when neither dimension has unit stride."""
    (r, sr), (c, sc) = rows, cols
    if r == 1 or sr == 1:
        ld = sc if c > 1 else max(r, 1)
        if ld >= max(r, 1):
            return 0, ld
    if c == 1 or sc == 1:
        ld = sr if r > 1 else max(c, 1)
        if ld >= max(c, 1):
            return 1, ld
    return None


@dataclass(frozen=True)
class Gemm:
    """One cublasGemmStridedBatchedEx call in column-major terms: C (m x n) = op_a(A) @ op_b(B), ``batch``
    times, each operand a pointer, a leading dimension and a batch stride (elements)."""

    op_a: int
    op_b: int
    m: int
    n: int
    k: int
    a: int
    lda: int
    stride_a: int
    b: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int


def einsum_gemm_plan(a: DevBuf, b: DevBuf, out: DevBuf, la: tuple[str, ...], lb: tuple[str, ...],
                     lo: tuple[str, ...]) -> Gemm | None:
    """``out = einsum(la, lb -> lo)`` as one strided-batched GEMM when the einsum is a (batched) matrix
    product whose index groups lie in memory as fusible runs: batch indices in all three, rows in ``a``
    and ``out``, columns in ``b`` and ``out``, contracted ones in ``a`` and ``b``, each operand with a unit
    stride in its matrix part.  A gradient's ``dA = dC @ Bᵀ`` and ``dB = Aᵀ @ dC`` (the batch summed as
    part of the contraction) are such products.  Leading output indices of one operand only may be a
    batch the other operand is shared by (batch stride 0): a 1×1 convolution ``fc,ncp->nfp`` is one GEMM
    per image with the weights shared.  None for any other einsum, or an empty one."""
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(lo)) != len(lo) or a.dtype != b.dtype:
        return None
    if a.dtype not in _CUDA_TYPE or out.dtype not in _CUDA_TYPE or out.size == 0:
        return None
    shared = tuple(c for c in lo if c in la and c in lb)
    plan = _gemm_plan(a, b, out, la, lb, lo, shared)
    for lead in range(1, len(lo) - 1):  # a leading output index of one operand as a broadcast batch
        if plan is not None or lo[lead - 1] in shared or (lo[lead - 1] in la) == (lo[lead - 1] in lb):
            break
        plan = _gemm_plan(a, b, out, la, lb, lo, (*lo[:lead], *(c for c in shared if c not in lo[:lead])))
    return plan


def _gemm_plan(a: DevBuf, b: DevBuf, out: DevBuf, la: tuple[str, ...], lb: tuple[str, ...], lo: tuple[str, ...],
               batch: tuple[str, ...]) -> Gemm | None:
    """:func:`einsum_gemm_plan` with the given ``batch`` indices (an operand without one of them is read
    again for every batch entry)."""
    rows = tuple(c for c in lo if c in la and c not in lb and c not in batch)
    cols = tuple(c for c in lo if c in lb and c not in la and c not in batch)
    inner = tuple(c for c in la if c in lb and c not in lo)
    if set(la) - set(batch + rows + inner) or set(lb) - set(batch + cols + inner) or set(lo) - set(la + lb):
        return None  # an index summed within one operand, or an output index of neither
    fused: list[list[tuple[int, int]]] = []
    for buf, letters, groups in ((a, la, (batch, rows, inner)), (b, lb, (batch, inner, cols)),
                                 (out, lo, (batch, rows, cols))):
        dims = [_fuse(buf, letters, tuple(c for c in g if c in letters)) for g in groups]
        if any(d is None for d in dims):
            return None
        fused.append([d for d in dims if d is not None])
    (nba, sba), (m, sam), (k, sak) = fused[0]
    (nbb, sbb), (_, sbk), (n, sbn) = fused[1]
    (nb, sbo), (_, som), (_, son) = fused[2]
    if k == 0:
        return None
    if nba not in (1, nb) or nbb not in (1, nb):
        return None  # an operand with part of the batch: its entries are not one stride apart
    sba, sbb = (sba if nba > 1 else 0), (sbb if nbb > 1 else 0)  # an operand without the batch is shared
    c_layout = _operand((n, son), (m, som))  # C = outᵀ (n x m) = bᵀ aᵀ, or out as stored
    if c_layout is None:
        return None
    if c_layout[0] == 0:  # out row-major in (rows, cols): C = outᵀ = bᵀ aᵀ
        mm, nn, first, second = n, m, _operand((n, sbn), (k, sbk)), _operand((k, sak), (m, sam))
        pa, pb, sa, sb = b.ptr, a.ptr, sbb, sba
    else:  # out column-major: C = out = a b
        mm, nn, first, second = m, n, _operand((m, sam), (k, sak)), _operand((k, sbk), (n, sbn))
        pa, pb, sa, sb = a.ptr, b.ptr, sba, sbb
    if first is None or second is None:
        return None
    one = nb > 1
    return Gemm(first[0], second[0], mm, nn, k, pa, first[1], sa if one else 0, pb, second[1], sb if one else 0,
                c_layout[1], sbo if one else 0, nb)


def einsum_gemm(a: DevBuf, b: DevBuf, out: DevBuf, la: tuple[str, ...], lb: tuple[str, ...],
                lo: tuple[str, ...], stream_ptr: int) -> bool:
    """Run ``out = einsum(la, lb -> lo)`` as one cuBLAS GEMM (:func:`einsum_gemm_plan`) on the stream, float32
    accumulation for 16-bit operands; False, having done nothing, when it is no such product."""
    g = einsum_gemm_plan(a, b, out, la, lb, lo)
    if g is None:
        return False
    lib = _cublas()
    handle = _handle(out.device, stream_ptr)
    ctype = _COMPUTE[out.dtype]
    dt = _CUDA_TYPE[a.dtype]
    status = lib.cublasGemmStridedBatchedEx(
        ctypes.c_void_p(handle), g.op_a, g.op_b, g.m, g.n, g.k, ctypes.c_void_p(_ONE[ctype].ctypes.data),
        ctypes.c_void_p(g.a), dt, g.lda, g.stride_a, ctypes.c_void_p(g.b), dt, g.ldb, g.stride_b,
        ctypes.c_void_p(_ZERO[ctype].ctypes.data), ctypes.c_void_p(out.ptr), _CUDA_TYPE[out.dtype], g.ldc,
        g.stride_c, g.batch, ctype, _GEMM_DEFAULT,
    )
    _check(status, f"cublasGemmStridedBatchedEx ({la}, {lb} -> {lo}, {a.dtype} -> {out.dtype})")
    return True

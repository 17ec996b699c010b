"""Matrix products: ``matmul`` and ``einsum`` as cuBLAS GEMMs on the blocks as they lie (an einsum that is
no matrix product runs through CuPy, which allocates)."""

from __future__ import annotations

from typing import Any

from relational_tensors.core.dtypes import bf16_bits_to_float32, compute_dtype, float32_to_bf16_bits
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.blas import einsum_gemm_plan
from relational_tensors.kernels.common import DevBuf
from relational_tensors.kernels.launchers.base import FLOATS, host_kernel, launcher


@launcher("matmul")
def _matmul(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.blas import matmul

    a, b = ins
    if a.shape[-1] == 0:
        tc.fill(out, 0.0)
    else:
        matmul(a, b, out, stream)


def _einsum_allocates(op: Any) -> bool:
    """A product of two operands (a matmul's gradients among them) is one cuBLAS GEMM into the output
    block; any other einsum goes through cupy.einsum, which allocates."""
    ins, out = op._parsed()
    return len(ins) != 2 or not _gemm_able(ins[0], ins[1], out, op.input_types[0].shape, op.input_types[1].shape,
                                           op.input_types[0].dtype)


def _gemm_able(la: tuple[str, ...], lb: tuple[str, ...], lo: tuple[str, ...], sa: tuple[int, ...],
               sb: tuple[int, ...], dtype: str) -> bool:
    """Whether contiguous blocks of these operands make one GEMM (``einsum_gemm_plan``); a block of a
    tensor only drops sizes, which never makes a product of the whole tensor unplannable."""
    if 0 in sa or 0 in sb:
        return True  # empty blocks: zeros written, nothing allocated
    sizes = dict(zip(la, sa)) | dict(zip(lb, sb))
    so = tuple(sizes[c] for c in lo)
    return einsum_gemm_plan(DevBuf(0, sa, dtype, 0), DevBuf(0, sb, dtype, 0), DevBuf(0, so, dtype, 0),
                            la, lb, lo) is not None


@launcher("einsum", allocates=_einsum_allocates,
          host_forms="an einsum of three or more operands, or of two that no GEMM computes (cupy.einsum)")
def _einsum(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """A two-operand einsum that is a (batched) matrix product, the matmul gradients among them, is one
    cuBLAS GEMM on the blocks as they lie (nothing allocated, so it is captured); any other einsum runs
    through CuPy in the compute dtype."""
    import cupy

    from relational_tensors.kernels.blas import einsum_gemm
    from relational_tensors.sql_specs.einsum import einsum_letters

    letters, res = op._parsed()
    if len(ins) == 2 and out.dtype in FLOATS and (out.size == 0 or ins[0].size == 0 or ins[1].size == 0):
        if out.size:  # an empty contraction
            from relational_tensors.kernels import triton_copy as tc

            tc.fill(out, 0.0)
        return
    if len(ins) == 2 and einsum_gemm(ins[0], ins[1], out, letters[0], letters[1], res, stream):
        return
    bf16 = out.dtype == "bfloat16"
    arrays = [b.cupy() for b in ins]
    dst = out.cupy()
    with cupy.cuda.ExternalStream(stream):
        sub = einsum_letters(letters, res)
        work = compute_dtype(out.dtype)  # 16-bit floats in float32, float64 stays float64
        operands = [bf16_bits_to_float32(a, cupy) if b.dtype == "bfloat16" else a.astype(work)
                    for a, b in zip(arrays, ins)]
        result = cupy.einsum(sub, *operands)
        dst[...] = float32_to_bf16_bits(result, cupy) if bf16 else result.astype(dst.dtype)


def _grouped_on_host(op: Any) -> bool:
    return bool(op.input_types[0].dtype == "float64")  # tl.dot has no float64 product


@launcher("grouped_matmul", allocates=_grouped_on_host, host_forms="float64 (the NumPy kernel on host copies)")
def _grouped_matmul(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Each row of the block times its expert's weights, for the experts of the block (Triton)."""
    if _grouped_on_host(op):
        host_kernel(op, f, ins, out, stream)
        return
    from relational_tensors.kernels import triton_experts as tx

    tx.grouped_matmul(ins[0], ins[1], ins[2], out, f.inputs[1].lower[0], op.trans_w)


def _grouped_weight_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """Each expert's span of rows."""
    from relational_tensors.kernels.scratch import grouped_weight_grad_scratch

    return None if _grouped_on_host(op) else ((grouped_weight_grad_scratch(f.output.shape[0]),), "int64")


@launcher("grouped_weight_grad", allocates=_grouped_on_host, scratch=_grouped_weight_grad_scratch,
          host_forms="float64 (the NumPy kernel on host copies)")
def _grouped_weight_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Each expert's weight gradient over its rows of the block (Triton, summed in row order)."""
    if _grouped_on_host(op):
        host_kernel(op, f, ins, out, stream)
        return
    from relational_tensors.kernels import triton_experts as tx

    tx.grouped_weight_grad(ins[0], ins[1], ins[2], out, f.output.lower[0], consts["scratch"])

"""Data movement: reshape, permute, expand, slice, concat, pad, embedding lookups and the embedding
gradient (strided copies and fills, no arithmetic), and routing's selections (top-k positions, one-hot
rows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import host_kernel, launcher


@launcher("reshape")
def _reshape(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.common import DevBuf

    x = ins[0]
    tc.copy_box(DevBuf(x.ptr, out.shape, x.dtype, x.device), out)


@launcher("permute")
def _permute(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc

    tc.copy_box(ins[0].permuted(op.perm), out)


@launcher("expand")
def _expand(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """A broadcast copy: the input block read with stride 0 along the dimensions it repeats."""
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.common import DevBuf

    x = ins[0]
    strides = tuple(0 if a == 1 and n != 1 else s for a, n, s in zip(x.shape, out.shape, x.strides))
    tc.copy_box(DevBuf(x.ptr, out.shape, x.dtype, x.device, strides), out)


@launcher("slice")
def _slice(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc

    tc.copy_box(ins[0], out)


@launcher("concat")
def _concat(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc

    axis = op._axis()
    at = 0
    for blk in ins:
        n = blk.shape[axis]
        if n and blk.size:
            lower = tuple(at if d == axis else 0 for d in range(len(out.shape)))
            tc.copy_box(blk, out.sub(lower, blk.shape))
        at += n


def _zero_constant(op: Any) -> dict[str, np.ndarray]:
    return {"zero": np.zeros(8, dtype=np.uint8)}  # zero bits: 0 in every dtype


@launcher("pad", constants=_zero_constant)
def _pad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Zeros (a zero read with stride 0 into any strides), then the input block copied to its place along
    the axis (the gradient of a slice)."""
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.common import DevBuf

    zero = consts["zero"]
    tc.copy_box(DevBuf(zero.ptr, out.shape, out.dtype, zero.device, (0,) * len(out.shape)), out)
    x = ins[0]
    if x.size:
        axis = op.params()["axis"]
        at = f.inputs[0].lower[axis] + op.start - f.output.lower[axis]
        lower = tuple(at if d == axis else 0 for d in range(len(out.shape)))
        tc.copy_box(x, out.sub(lower, x.shape))


@launcher("embedding")
def _embedding(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc

    tc.embedding(ins[0], ins[1], out, f.inputs[0].lower[0])


def _embedding_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str]:
    """The sort keys of the block's token ids, and the partial rows of long runs."""
    from relational_tensors.kernels.scratch import embedding_grad_scratch

    return (embedding_grad_scratch(f.inputs[0].volume, f.inputs[1].shape[-1]),), "int64"


@launcher("embedding_grad", scratch=_embedding_grad_scratch)
def _embedding_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels.triton_embedding_grad import embedding_grad

    embedding_grad(ins[0], ins[1], out, consts["scratch"], f.output.lower[0])


@launcher("put_rows")
def _put_rows(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc

    tc.put_rows(ins[0], ins[1], ins[2], out, f.output.lower[0])


MAX_TOPK_ROW = 16384  # a row the top-k kernel holds whole in one program; longer ones run on the host
MAX_TOPK_K = 64  # picks the kernel unrolls; more run on the host


def _topk_on_host(op: Any) -> bool:
    return bool(op.input_types[0].shape[-1] > MAX_TOPK_ROW or op.k > MAX_TOPK_K)


@launcher("topk", allocates=_topk_on_host,
          host_forms="rows longer than 16,384 or k above 64 (the NumPy kernel on host copies)")
def _topk(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Rows up to ``MAX_TOPK_ROW`` long in one Triton program each, up to ``MAX_TOPK_K`` picks unrolled;
    longer rows (top-k over a vocabulary) and more picks on host copies."""
    if _topk_on_host(op):
        host_kernel(op, f, ins, out, stream)
        return
    from relational_tensors.kernels import triton_routing as tr

    tr.topk(ins[0], out, op.k, op.largest)


@launcher("one_hot")
def _one_hot(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_routing as tr

    tr.one_hot(ins[0], out, f.output.lower[-1])


@launcher("take_along")
def _take_along(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_routing as tr

    tr.take_along(ins[0], ins[1], out, f.inputs[0].lower[-1])


@launcher("capacity_route")
def _capacity_route(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Each group's pairs placed in its experts' buffers, one program per (group, expert)."""
    from relational_tensors.kernels import triton_experts as tx

    tx.capacity_route(ins[0], out, op.experts, op.capacity, op.what)


@launcher("routed_gather")
def _routed_gather(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """Rows gathered by a routing map (the experts' dispatch and combine); the inverse map is the
    gradient's."""
    from relational_tensors.kernels import triton_experts as tx

    tx.routed_gather(ins[0], ins[1], out, op.per_row(), f.inputs[0].lower[1])


@launcher("route_index")
def _route_index(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    """The routed pairs' counting sort by expert, one program per expert (the op keeps its pairs whole)."""
    from relational_tensors.kernels import triton_experts as tx

    tx.route_index(ins[0], out, op.experts, op.what)

"""What one fused elementwise kernel computes (``FusedExpr``), and how it reads its operands: the
description the executor's fusion pass (``runtime.fusion``) builds and the kernel generator
(``kernels.triton_fused``) compiles."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from relational_tensors.kernels.common import contiguous_strides, merge_dims

__all__ = ["FusedExpr", "SCALAR_OPS", "broadcast_strides", "access", "geometry"]

SCALAR_OPS = frozenset({"scale", "add_scalar", "pow", "fill"})  # unary ops that read their scalar argument


@dataclass(frozen=True, slots=True)
class FusedExpr:
    """What one fused kernel computes, apart from its buffers, sizes and scalar values (its cache key).

    Values are numbered loads first, then steps.  ``loads``: per operand (dtype, access), access one of
    ``"full"`` (the group's shape, contiguous), ``"scalar"`` (one element, broadcast) and ``"strided"``;
    ``steps``: (kind, op, value numbers, dtype of its block), kind ``"unary"``, ``"binary"``, ``"cast"`` or
    ``"where"`` (condition, value if true, value if false; the condition a boolean load);
    ``stores``: (value number, dtype of the block written).  Each unary op in ``SCALAR_OPS`` takes the
    next scalar argument."""

    loads: tuple[tuple[str, str], ...]
    steps: tuple[tuple[str, str, tuple[int, ...], str], ...]
    stores: tuple[tuple[int, str], ...]


def broadcast_strides(shape: Sequence[int], block: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """The element strides that read a block of shape ``block`` broadcast to ``shape`` (NumPy's rules):
    0 along the dimensions it repeats.

    >>> broadcast_strides((4, 3), (1, 3), (3, 1))
    (0, 1)
    """
    pad = len(shape) - len(block)
    return tuple(0 if i < pad or (block[i - pad] == 1 and n != 1) else strides[i - pad] for i, n in enumerate(shape))


def access(shape: Sequence[int], block: Sequence[int], strides: Sequence[int]) -> str:
    """How a fused kernel over ``shape`` reads an operand block: ``"full"`` (every element, in order),
    ``"scalar"`` (one element for all) or ``"strided"``.

    >>> access((4, 3), (4, 3), (3, 1)), access((4, 3), (1,), (1,)), access((4, 3), (3,), (1,))
    ('full', 'scalar', 'strided')
    """
    n, size = math.prod(shape), math.prod(block)
    if size == n and (n <= 1 or all(s == c for s, c, e in zip(broadcast_strides(shape, block, strides),
                                                               contiguous_strides(tuple(shape)), shape) if e != 1)):
        return "full"
    return "scalar" if size == 1 else "strided"


def geometry(shape: Sequence[int], strided: Sequence[tuple[int, ...]]) -> tuple[tuple[int, int, int],
                                                                                list[tuple[int, ...]]] | None:
    """The sizes of dimensions 1-3 and each strided operand's 4 strides (from its broadcast strides) that
    index ``shape`` in a rank-4 kernel, or None when more than 4 dimensions remain after merging."""
    merged, strides = merge_dims(tuple(shape), contiguous_strides(tuple(shape)), *strided)
    if len(merged) > 4:
        return None
    pad = 4 - len(merged)
    sizes = (1,) * pad + merged
    return (sizes[1], sizes[2], sizes[3]), [(0,) * pad + s for s in strides[1:]]

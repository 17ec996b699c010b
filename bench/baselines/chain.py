"""The matrix chains A-E, row-sharded: the paper's PyTorch chain baseline (cuBLAS + NCCL).

Every product ``L @ R`` is computed row-sharded: its left operand's rows are split across the ranks
and its right operand is whole on every rank.  A leaf on the left is sliced by rows; a leaf on the
right is replicated; a sub-product needed whole (on the right) is all-gathered.  The result is
all-gathered at the end.  Dimensions and parenthesizations are ``relational_tensors.graph.models.CHAINS``
(``scale`` divides every dimension, as ``matrix_chain`` does).

>>> sorted(sharded_leaves(((1, 2), (((3, 4), ((5, 6), (7, 8))), 9))))
[1, 3, 5, 7]
"""

from __future__ import annotations

import math

import torch

from relational_tensors.graph.models import CHAINS, chain_dims

from .common import Dist, Prepared, gather_dim, seeded, split_range, split_sizes

__all__ = ["sharded_leaves", "prepare_chain", "reference_chain"]

_SEEDS_PER_CHAIN = 64  # seed s draws M_i from s*64 + i


def _pair(node: object) -> tuple[object, object]:
    """The two operands of a product node (a nested pair of matrix indices)."""
    pair: tuple[object, object] = node  # type: ignore[assignment]
    return pair


def _leftmost(node: object) -> int:
    while not isinstance(node, int):
        node = _pair(node)[0]
    return node


def sharded_leaves(node: object) -> set[int]:
    """The matrices that are the left operand of some product computed row-sharded: each sub-product's
    leftmost matrix."""
    if isinstance(node, int):
        return {node}
    left, right = _pair(node)
    return sharded_leaves(left) | (set() if isinstance(right, int) else sharded_leaves(right))


def _matrix(i: int, dims: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    rows = dims[i - 1]
    return seeded((rows, dims[i]), seed * _SEEDS_PER_CHAIN + i, device, dtype, scale=1.0 / math.sqrt(rows))


def prepare_chain(ctx: Dist, name: str, seed: int, scale: int = 1) -> Prepared:
    """Set up chain ``name`` on this rank: its rows of each sharded matrix, the others whole."""
    dims, order = chain_dims(name, scale), CHAINS[name][1]
    sharded = sharded_leaves(order)
    mats = {}
    for i in range(1, len(dims)):
        full = _matrix(i, dims, seed, ctx.device, ctx.dtype)
        if i in sharded:
            lo, hi = split_range(dims[i - 1], ctx.world, ctx.rank)
            full = full[lo:hi].contiguous()
        mats[i] = full

    def rows_sizes(node: object) -> list[int]:
        return split_sizes(dims[_leftmost(node) - 1], ctx.world)

    def local(node: object) -> torch.Tensor:  # this rank's rows of the sub-product
        if isinstance(node, int):
            return mats[node]
        left, right = _pair(node)
        return local(left) @ whole(right)

    def whole(node: object) -> torch.Tensor:  # the sub-product on every rank
        if isinstance(node, int):
            return mats[node]
        return gather_dim(ctx, local(node), 0, rows_sizes(node))

    def step() -> torch.Tensor:
        with torch.no_grad():
            return whole(order)

    return Prepared(step, lambda y: y, f"row-sharded matrices {sorted(sharded)}, the rest replicated")


def reference_chain(name: str, seed: int, device: torch.device, dtype: torch.dtype, scale: int = 1) -> torch.Tensor:
    """The chain on one device, in its fixed order, on the whole matrices of ``seed``."""
    dims, order = chain_dims(name, scale), CHAINS[name][1]
    mats = {i: _matrix(i, dims, seed, device, dtype) for i in range(1, len(dims))}

    def value(node: object) -> torch.Tensor:
        if isinstance(node, int):
            return mats[node]
        left, right = _pair(node)
        return value(left) @ value(right)

    with torch.no_grad():
        return value(order)

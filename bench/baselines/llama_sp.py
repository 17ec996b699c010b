"""Sequence parallelism for the block: tokens sharded, keys and values all-gathered for attention.

Rank r holds tokens [r0, r1) of every sequence (contiguous, balanced) and the whole weights.  Norms,
projections, FFN and residuals are local.  RoPE uses the tokens' global positions; keys and values are
all-gathered (one collective for both), and the rank's queries attend keys [0, r1) under a causal
mask aligned to their global positions, so the last rank does the most attention work (the causal
load imbalance the paper notes for this baseline).  The output stays sharded by tokens.
"""

from __future__ import annotations

import torch

from .block import block_forward, block_params, make_input
from .common import BlockShape, Dist, NotApplicable, Prepared, gather_dim, split_range, split_sizes

__all__ = ["prepare_sp"]


def prepare_sp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> Prepared:
    """Set up sequence parallelism on this rank: the whole seeded weights and its tokens of the input."""
    if seq < ctx.world:
        raise NotApplicable(f"sp gives every rank at least one token of each sequence, so it needs "
                            f"seq >= world; got seq={seq}, world={ctx.world}.")
    r0, r1 = split_range(seq, ctx.world, ctx.rank)
    sizes = split_sizes(seq, ctx.world)
    hkv = shape.n_kv_heads
    p = block_params(shape, seed, ctx.device, ctx.dtype)
    x = make_input(batch, seq, shape, seed, ctx.device, ctx.dtype)[:, r0:r1].contiguous()

    def gather_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = gather_dim(ctx, torch.cat((k, v), dim=2), 1, sizes)[:, :r1]  # later tokens are never attended
        return kv[:, :, :hkv], kv[:, :, hkv:]

    def step() -> torch.Tensor:
        with torch.no_grad():
            return block_forward(x, p, shape, pos0=r0, gather_kv=gather_kv)

    return Prepared(step, lambda y: gather_dim(ctx, y, 1, sizes))

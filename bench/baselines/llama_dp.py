"""Data parallelism for the block: whole sequences sharded across ranks, weights replicated.

Rank r runs the single-device block on its sequences [b0, b1) of the batch (balanced, contiguous);
nothing is exchanged.  A batch smaller than the world cannot be split this way.
"""

from __future__ import annotations

import torch

from .block import block_forward, block_params, make_input
from .common import BlockShape, Dist, NotApplicable, Prepared, gather_dim, split_range, split_sizes

__all__ = ["prepare_dp"]


def prepare_dp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> Prepared:
    """Set up data parallelism on this rank: the whole seeded weights and its sequences of the input."""
    if batch < ctx.world:
        raise NotApplicable(f"dp gives every rank whole sequences, so it needs batch >= world; got "
                            f"batch={batch}, world={ctx.world}.  Use tp or sp for a single sequence.")
    b0, b1 = split_range(batch, ctx.world, ctx.rank)
    p = block_params(shape, seed, ctx.device, ctx.dtype)
    x = make_input(batch, seq, shape, seed, ctx.device, ctx.dtype)[b0:b1].contiguous()

    def step() -> torch.Tensor:
        with torch.no_grad():
            return block_forward(x, p, shape)

    sizes = split_sizes(batch, ctx.world)
    return Prepared(step, lambda y: gather_dim(ctx, y, 0, sizes))

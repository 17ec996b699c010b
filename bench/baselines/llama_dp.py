"""Data parallelism for the block: whole sequences sharded across ranks, weights replicated.

Rank r runs the single-device block on its sequences [b0, b1) of the batch (balanced, contiguous);
nothing is exchanged.  A batch smaller than the world cannot be split this way.
"""

from __future__ import annotations

from .block import prepare_sharded
from .common import BlockShape, Dist, NotApplicable, Prepared

__all__ = ["prepare_dp"]


def prepare_dp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> Prepared:
    """Set up data parallelism on this rank: the whole seeded weights and its sequences of the input."""
    if batch < ctx.world:
        raise NotApplicable(f"dp gives every rank whole sequences, so it needs batch >= world; got "
                            f"batch={batch}, world={ctx.world}.  Use tp or sp for a single sequence.")
    return prepare_sharded(ctx, shape, batch, seq, seed, dim=0)

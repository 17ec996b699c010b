"""Sequence parallelism for the block: tokens sharded, keys and values all-gathered for attention.

Rank r holds tokens [r0, r1) of every sequence (contiguous, balanced) and the whole weights.  Norms,
projections, FFN and residuals are local.  RoPE uses the tokens' global positions; keys and values are
all-gathered (one collective for both), and the rank's queries attend keys [0, r1) under a causal
mask aligned to their global positions, so the last rank does the most attention work (the causal
load imbalance the paper notes for this baseline).  The output stays sharded by tokens.
"""

from __future__ import annotations

import torch

from .block import prepare_sharded
from .common import BlockShape, Dist, NotApplicable, Prepared, gather_dim

__all__ = ["prepare_sp"]


def prepare_sp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> Prepared:
    """Set up sequence parallelism on this rank: the whole seeded weights and its tokens of the input."""
    if seq < ctx.world:
        raise NotApplicable(f"sp gives every rank at least one token of each sequence, so it needs "
                            f"seq >= world; got seq={seq}, world={ctx.world}.")
    hkv = shape.n_kv_heads

    def forward(r0: int, r1: int, sizes: list[int]) -> dict:
        def gather_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kv = gather_dim(ctx, torch.cat((k, v), dim=2), 1, sizes)[:, :r1]  # later tokens are never attended
            return kv[:, :, :hkv], kv[:, :, hkv:]

        return {"pos0": r0, "gather_kv": gather_kv}

    return prepare_sharded(ctx, shape, batch, seq, seed, dim=1, forward=forward)

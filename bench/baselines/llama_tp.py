"""Megatron-style tensor parallelism for the block: heads and FFN columns split across ranks.

Column-parallel q/k/v/w1/w3 (each rank holds ``n_heads / world`` query heads, their key/value heads
and ``d_ff / world`` FFN columns), row-parallel o/w2 whose partial products are summed by one
all-reduce each.  Every rank holds the whole input and ends with the whole output; the norms and
residuals are computed on every rank.

Key/value heads split with the query heads when ``n_kv_heads % world == 0``.  Otherwise each rank
computes the key/value heads its query heads read (some computed on several ranks), and says so.

>>> kv_plan(BlockShape(64, 8, 4, 128), world=2, rank=1)
(4, 8, 2, 4, None, '')
>>> kv_plan(BlockShape(64, 8, 2, 128), world=4, rank=1)[:4]
(2, 4, 0, 1)
"""

from __future__ import annotations

import torch

from .block import block_forward, block_params, make_input
from .common import BlockShape, Dist, NotApplicable, Prepared, split_range

__all__ = ["prepare_tp", "kv_plan"]


def kv_plan(shape: BlockShape, world: int, rank: int) -> tuple[int, int, int, int, list[int] | None, str]:
    """This rank's query heads [q0, q1), key/value heads [k0, k1), the key/value head of each local query
    head when ``enable_gqa``'s grouping does not give it (else None), and a note when kv heads repeat."""
    hq, hkv = shape.n_heads, shape.n_kv_heads
    if hq % world:
        raise NotApplicable(f"tp splits the {hq} query heads over the ranks, so it needs n_heads % world == 0; "
                            f"got n_heads={hq}, world={world}.  Use sp or dp, or a world size dividing {hq}.")
    group = hq // hkv
    q0, q1 = hq * rank // world, hq * (rank + 1) // world
    if hkv % world == 0:
        return q0, q1, hkv * rank // world, hkv * (rank + 1) // world, None, ""
    k0, k1 = q0 // group, (q1 - 1) // group + 1
    note = (f"n_kv_heads={hkv} does not divide by world={world}: each rank computes the key/value heads its "
            f"query heads read (rank {rank}: kv heads {k0}..{k1 - 1}), so some are computed on several ranks")
    wanted = [(q0 + j) // group - k0 for j in range(q1 - q0)]
    n_q, n_kv = q1 - q0, k1 - k0
    grouped = n_q % n_kv == 0 and wanted == [j // (n_q // n_kv) for j in range(n_q)]
    return q0, q1, k0, k1, None if grouped else wanted, note


def prepare_tp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> Prepared:
    """Set up tensor parallelism on this rank: its slices of the seeded weights and the whole input."""
    q0, q1, k0, k1, wanted, note = kv_plan(shape, ctx.world, ctx.rank)
    if shape.d_ff % ctx.world:
        raise NotApplicable(f"tp splits the FFN's {shape.d_ff} columns evenly, so it needs d_ff % world == 0; "
                            f"got d_ff={shape.d_ff}, world={ctx.world}.")
    dh = shape.head_dim
    f0, f1 = split_range(shape.d_ff, ctx.world, ctx.rank)
    cols = {"wq": (q0 * dh, q1 * dh), "wk": (k0 * dh, k1 * dh), "wv": (k0 * dh, k1 * dh), "w1": (f0, f1),
            "w3": (f0, f1)}
    rows = {"wo": (q0 * dh, q1 * dh), "w2": (f0, f1)}

    def take(name: str, full: torch.Tensor) -> torch.Tensor:
        if name in cols:
            return full[:, cols[name][0]:cols[name][1]]
        if name in rows:
            return full[rows[name][0]:rows[name][1]]
        return full  # the norms: every rank applies them to the whole activations

    p = block_params(shape, seed, ctx.device, ctx.dtype, take)
    x = make_input(batch, seq, shape, seed, ctx.device, ctx.dtype)
    index = None if wanted is None else torch.tensor(wanted, device=ctx.device)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return block_forward(x, p, shape, reduce=ctx.all_reduce, kv_index=index)

    return Prepared(step, lambda y: y, note)

"""Pricing rules of data movement on a target, shared by both planners.

The whole-plan simulator (``physical.simulate``) times each ⊕, slice and assembly task with
:func:`combine_seconds` and :func:`move_seconds`; the calibrated cost model (``dp_optimizer.costs``)
prices a whole exchange with :func:`exchange_seconds`, which applies the same two rules to the tasks
the naive program would run (which producer copy each reader sits with, the busiest device's bytes,
the slicing before and the ⊕ and assembly after), so the DP and the simulator charge one set of rules.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import itemsize, partial_dtype
from relational_tensors.core.types import Box

__all__ = ["exchange_seconds", "colocate", "device_bandwidth", "combine_seconds", "move_seconds"]


def combine_seconds(kernels: Any, volume: float, copies: float, nbytes: float, dtype: str) -> float:
    """One ⊕ of ``copies`` partial copies of ``volume`` elements, reading and writing ``nbytes``."""
    return kernels.time(volume * (copies - 1), nbytes, dtype, "memory")


def move_seconds(kernels: Any, nbytes: float, dtype: str) -> float:
    """Slicing or assembling ``nbytes`` on one device: every byte read once and written once."""
    return kernels.time(0.0, 2 * nbytes, dtype, "memory")


def colocate(overlap: list[list[float]], copies: list[int], readers: list[int]) -> list[list[tuple[int, int]]]:
    """Which producer blocks the readers share a device with: the placement's greedy rule on one input,
    most overlap first.  ``overlap[i][j]`` is what distinct producer block i holds of distinct read block
    j, made ``copies[i]`` times and read ``readers[j]`` times.  Each device holds one producer copy and
    one reader, so block i hosts at most ``copies[i]`` readers.  Returns, per read block, the pairs
    (producer block, readers sitting with it); a reader overlapping no free copy is left out (it sits
    with a copy it does not need).

    >>> colocate([[4, 0], [0, 4]], [1, 1], [1, 1])  # two rows read as themselves, each where it is made
    [[(0, 1)], [(1, 1)]]
    >>> colocate([[4], [4], [4], [4]], [1, 1, 1, 1], [4])  # the whole read four times: one reader per row
    [[(0, 1), (1, 1), (2, 1), (3, 1)]]
    >>> colocate([[4], [4]], [1, 1], [4])  # two rows, four readers of the whole: two sit with nothing they need
    [[(0, 1), (1, 1)]]
    """
    pairs = [(i, j) for i in range(len(copies)) for j in range(len(readers)) if overlap[i][j] > 0]
    pairs.sort(key=lambda ij: -overlap[ij[0]][ij[1]])  # most overlap first; ties in (i, j) order (a stable sort)
    return _greedy(pairs, copies, readers)


def _greedy(pairs: Iterable[tuple[int, int]], copies: list[int], readers: list[int]) -> list[list[tuple[int, int]]]:
    """:func:`colocate`'s assignment along ``pairs`` (producer block, read block), best first."""
    free, waiting = list(copies), list(readers)
    homes: list[list[tuple[int, int]]] = [[] for _ in readers]
    left = min(sum(free), sum(waiting))  # once no copy is free or no reader waits, no pair places anyone
    if not left:
        return homes
    for i, j in pairs:
        f = free[i]
        if f:
            w = waiting[j]
            if w:
                n = f if f < w else w
                homes[j].append((i, n))
                free[i] = f - n
                waiting[j] = w - n
                left -= n
                if not left:
                    break
    return homes


def exchange_seconds(blocks: tuple[Box, ...], reads: tuple[Box, ...], dtype: str, aggregation: str,
                     kernels: Any, bandwidth: float, latency: float = 0.0) -> float:
    """The time of one exchange as the whole-plan simulator charges it, under the naive program.

    ``blocks[f]`` is the output block of producer function f (a block made m times is m partial
    copies, combined with ``aggregation``); ``reads[g]`` is the block reader g needs (empty: none).
    Each reader sits with the copy :func:`colocate` gives it and receives every other copy's overlap
    with its block.  The time is the busiest device's ingress or egress at ``bandwidth`` (plus one
    ``latency``), then the slowest reader's ⊕ of its cells' copies and assembly of its block, each
    compute step timed as a kernel of ``kernels`` (the simulator's roofline).  Atoms are read in
    place and copies and ⊕ write into the block being assembled (``physical.views``), so slicing costs
    a pass only for log-sum-exp partials; assembly costs a pass over the part of a reader's block that
    a whole block on its own device holds, when that block is not the read block itself.

    >>> from relational_tensors.machine.kernel_model import KernelModel
    >>> from relational_tensors.machine.machines import get_topology
    >>> km = KernelModel(get_topology("dgx-a100"))
    >>> rows = tuple(Box((i, 0), (i + 1, 4)) for i in range(4))
    >>> cols = tuple(Box((0, j), (4, j + 1)) for j in range(4))
    >>> exchange_seconds(rows, rows, "float16", "sum", km, 1.0)
    0.0
    >>> t = exchange_seconds(rows, cols, "float16", "sum", km, 1.0)  # each reader gets 3 of its 4 elements
    >>> math.isclose(t, 6.0 + move_seconds(km, 2, "float16"))  # 6 B at 1 B/s, then its own element copied in
    True
    """
    width = itemsize(dtype)
    wide = itemsize(partial_dtype(dtype))  # an unaggregated partial is kept (and moved) in its partial dtype
    # boxes by their corners (equal boxes have equal corners; hashing the corners skips Box's own hash)
    made = Counter([(b.lower, b.upper) for b in blocks])
    wanted = Counter([(r.lower, r.upper) for r in reads if 0 not in r.shape])  # an empty box reads nothing
    if not wanted:
        return 0.0
    us, copies = list(made), list(made.values())
    vs, readers = list(wanted), list(wanted.values())
    rank = len(blocks[0].lower)
    lse = aggregation == "lse" and rank > 0  # an lse partial carries a float32 per row

    def nbytes(volume: float, last: int, partial: bool) -> float:
        if not partial:
            return volume * width
        return volume * wide + (volume / max(last, 1) * 4 if lse else 0.0)

    # every pair (producer block i, read block j) at once: the elements they share, and the bytes of
    # block i's copy a reader of j needs (whole numbers of bytes, so every sum below is exact)
    nu, nv = len(us), len(vs)
    lo_u, hi_u = (np.array(c, dtype=np.int64).reshape(nu, rank) for c in zip(*us))
    lo_v, hi_v = (np.array(c, dtype=np.int64).reshape(nv, rank) for c in zip(*vs))
    side = np.minimum(hi_u[:, None], hi_v[None]) - np.maximum(lo_u[:, None], lo_v[None])
    elements = np.where((side > 0).all(axis=2), side.prod(axis=2), 0)
    partial = np.array(copies) > 1
    moved = elements * np.where(partial, wide, width)[:, None].astype(np.float64)
    if lse:  # a partial's float32 per row of its last dimension
        last = np.maximum(side[:, :, -1], 1)
        moved = np.where(partial[:, None] & (elements > 0), moved + elements / last * 4, moved)
    ii, jj = moved.nonzero()  # row-major: (i, j) order
    best = np.argsort(-moved[ii, jj], kind="stable")  # most overlap first, ties in (i, j) order
    homes = _greedy(zip(ii[best].tolist(), jj[best].tolist()), copies, readers)
    # every reader gets every copy of its cells except the one on its device; the busiest device is a
    # reader (or copy) whose own copy (reader) keeps the least, or none when some have nothing local
    gets = (np.array(copies, dtype=np.float64)[:, None] * moved).sum(axis=0).tolist()
    sends = (moved * np.array(readers, dtype=np.float64)).sum(axis=1).tolist()
    busiest = 0.0
    least = [math.inf] * nu  # per producer block: the least that a reader sitting with it needs of it
    hosts = [0] * nu  # and how many readers sit with it
    local = [0.0] * nv  # per read block: the most a reader copies from its own device's block
    for j, (n, home) in enumerate(zip(readers, homes)):
        kept, sitting = math.inf, 0
        for i, k in home:
            here = moved[i, j]
            if here < kept:
                kept = here
            if here < least[i]:
                least[i] = here
            if not partial[i] and us[i] != vs[j] and here > local[j]:
                local[j] = float(here)  # a whole block that is not the read block is copied into it
            hosts[i] += k
            sitting += k
        busiest = max(busiest, gets[j] - (float(kept) if sitting == n else 0.0))
    for i, m in enumerate(copies):
        busiest = max(busiest, sends[i] - (float(least[i]) if hosts[i] == m else 0.0))
    move_s = busiest / bandwidth + latency if busiest > 0 else 0.0
    # the overlay of every block and read: per dimension the sorted breakpoints, and how many of its
    # cells each read block (and, for lse partials, each producer block) is cut into
    breaks = [np.unique(np.concatenate((lo_u[:, d], hi_u[:, d], lo_v[:, d], hi_v[:, d]))) for d in range(rank)]

    def cells(lo: np.ndarray, hi: np.ndarray) -> list[int]:
        n = np.ones(len(lo), dtype=np.int64)
        for d, points in enumerate(breaks):
            n *= points.searchsorted(hi[:, d], "left") - points.searchsorted(lo[:, d], "right") + 1
        return n.tolist()

    slice_s = 0.0
    if lse:
        for i, ((lo, hi), n) in enumerate(zip(us, cells(lo_u, hi_u))):
            if copies[i] > 1 and sends[i] and n > 1:  # only lse partials are cut up
                shape = tuple(h - low for low, h in zip(lo, hi))
                size = nbytes(math.prod(shape), shape[-1] if rank else 1, copies[i] > 1)
                slice_s = max(slice_s, move_seconds(kernels, size, dtype))
    finish_s = 0.0
    covered = (np.array(copies, dtype=np.int64)[:, None] * elements).sum(axis=0).tolist()
    finishes: dict[tuple[int, int, int, float, float], float] = {}  # read blocks alike finish alike
    for (lo, hi), n, total, mine in zip(vs, cells(lo_v, hi_v), covered, local):
        shape = tuple(h - low for low, h in zip(lo, hi))
        volume = math.prod(shape)
        cover = total / volume  # copies of each element
        key = (volume, shape[-1] if rank else 1, n, cover, mine)
        t = finishes.get(key)
        if t is None:
            t = _finish(kernels, volume, key[1], n, cover, dtype, nbytes, lse, width, wide)
            if mine:  # the assembly copies the part already on the reader's device
                t += move_seconds(kernels, mine, dtype)
            finishes[key] = t
        finish_s = max(finish_s, t)
    return slice_s + move_s + finish_s


def _finish(kernels: Any, volume: int, last: int, cells: int, cover: float, dtype: str,
            nbytes: Callable[[float, int, bool], float], lse: bool, width: int, wide: int) -> float:
    """A reader's compute after its bytes arrive: the ⊕ of its cells' copies, and writing partials into
    its block of ``volume`` elements (``last`` of them along its last dimension)."""
    t = 0.0
    if cover > 1.0 + 1e-9:  # one ⊕ per cell, of the copies that hold it
        cell = nbytes(volume, last, True) / cells
        t += cells * combine_seconds(kernels, volume / cells, cover, (cover + 1) * cell, dtype)
    if lse and cover > 1.0 + 1e-9:  # lse partials are finalized into the block
        t += move_seconds(kernels, volume * width, dtype)
    elif cover > 1.0 + 1e-9 and wide != width:  # partials wider than the output are rounded into the block
        t += move_seconds(kernels, volume * wide, dtype)
    # otherwise copies and ⊕ write into the block (the part already on the reader's device is priced
    # by the caller, which knows the reader's home)
    return t


def device_bandwidth(topo: Any) -> float:
    """Bytes/s each device sends to the others while all of them do (a uniform all-to-all), limited by
    the interconnect resource the most routes share.

    >>> from relational_tensors.machine.machines import get_topology
    >>> device_bandwidth(get_topology("dgx-a100")) / 1e9  # an NVSwitch: each GPU's own link
    300.0
    """
    sites = topo.sites
    if len(sites) < 2:
        return float(topo.hbm_bandwidth)
    load: Counter[str] = Counter(r for a in sites for b in sites if a != b for r in topo.route(a, b).resources)
    if not load:
        return float(topo.hbm_bandwidth)
    seconds_per_byte = max(n / topo.resources[r] for r, n in load.items())  # each pair moving one byte
    return (len(sites) - 1) / seconds_per_byte

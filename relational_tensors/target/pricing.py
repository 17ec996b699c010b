"""Pricing rules of data movement on a target, shared by both planners.

The whole-plan simulator (``physical.simulate``) times each ⊕, slice and assembly task with
:func:`combine_seconds` and :func:`move_seconds`; the calibrated cost model (``dp_optimizer.costs``)
prices a whole exchange with :func:`exchange_seconds`, which applies the same two rules to the tasks
the naive program would run (which producer copy each reader sits with, the busiest device's bytes,
the slicing before and the ⊕ and assembly after), so the DP and the simulator charge one set of rules.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from typing import Any

from relational_tensors.core.dtypes import itemsize, partial_dtype
from relational_tensors.core.types import Box

__all__ = ["exchange_seconds", "colocate", "device_bandwidth", "combine_seconds", "move_seconds"]


def combine_seconds(kernels: Any, volume: float, copies: float, nbytes: float, dtype: str) -> float:
    """One ⊕ of ``copies`` partial copies of ``volume`` elements, reading and writing ``nbytes``."""
    return kernels.time(volume * (copies - 1), nbytes, dtype, "memory")


def move_seconds(kernels: Any, nbytes: float, dtype: str) -> float:
    """Slicing or assembling ``nbytes`` on one device: every byte read once and written once."""
    return kernels.time(0.0, 2 * nbytes, dtype, "memory")


def _overlap(a: Box, b: Box) -> tuple[int, int]:
    """Elements two boxes share, and the extent of their overlap along the last dimension."""
    vol, side = 1, 1
    for al, au, bl, bu in zip(a.lower, a.upper, b.lower, b.upper):
        side = (au if au < bu else bu) - (al if al > bl else bl)
        if side <= 0:
            return 0, 0
        vol *= side
    return vol, side


def _cells(box: Box, breaks: list[list[int]]) -> int:
    """How many cells of the overlay (per-dimension sorted breakpoints ``breaks``) ``box`` is cut into."""
    n = 1
    for d, points in enumerate(breaks):
        n *= bisect_left(points, box.upper[d]) - bisect_right(points, box.lower[d]) + 1
    return n


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
    free, waiting = list(copies), list(readers)
    homes: list[list[tuple[int, int]]] = [[] for _ in readers]
    order = sorted(((i, j) for i in range(len(copies)) for j in range(len(readers)) if overlap[i][j] > 0),
                   key=lambda ij: (-overlap[ij[0]][ij[1]], ij))
    for i, j in order:
        n = min(free[i], waiting[j])
        if n:
            homes[j].append((i, n))
            free[i] -= n
            waiting[j] -= n
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
    place and copies and ⊕ write into the block being assembled (``physical.views``), so slicing
    and assembly cost a pass only for log-sum-exp partials.

    >>> from relational_tensors.target.kernel_model import KernelModel
    >>> from relational_tensors.target.topology import get_topology
    >>> km = KernelModel(get_topology("dgx-a100"))
    >>> rows = tuple(Box((i, 0), (i + 1, 4)) for i in range(4))
    >>> cols = tuple(Box((0, j), (4, j + 1)) for j in range(4))
    >>> exchange_seconds(rows, rows, "float16", "sum", km, 1.0)
    0.0
    >>> exchange_seconds(rows, cols, "float16", "sum", km, 1.0)  # each reader gets 3 of its 4 elements: 6 B at 1 B/s
    6.0
    """
    width = itemsize(dtype)
    wide = itemsize(partial_dtype(dtype))  # an unaggregated partial is kept (and moved) in its partial dtype
    made = Counter(blocks)
    wanted = Counter(r for r in reads if not r.is_empty)
    if not wanted:
        return 0.0
    us, copies = list(made), list(made.values())
    vs, readers = list(wanted), list(wanted.values())
    rank = blocks[0].rank
    lse = aggregation == "lse" and rank > 0  # an lse partial carries a float32 per row

    def nbytes(volume: float, last: int, partial: bool) -> float:
        if not partial:
            return volume * width
        return volume * wide + (volume / max(last, 1) * 4 if lse else 0.0)

    elements = [[0] * len(vs) for _ in us]
    moved = [[0.0] * len(vs) for _ in us]  # bytes of block i's copy that a reader of j needs
    for i, b in enumerate(us):
        for j, r in enumerate(vs):
            ov, last = _overlap(b, r)
            if ov:
                elements[i][j] = ov
                moved[i][j] = nbytes(ov, last, copies[i] > 1)
    homes = colocate(moved, copies, readers)
    # every reader gets every copy of its cells except the one on its device; the busiest device is a
    # reader (or copy) whose own copy (reader) keeps the least, or none when some have nothing local
    busiest = 0.0
    hosted: list[list[float]] = [[] for _ in us]
    for j, n in enumerate(readers):
        gets = sum(copies[i] * moved[i][j] for i in range(len(us)))
        kept = [moved[i][j] for i, _ in homes[j]]
        busiest = max(busiest, gets - (min(kept) if sum(k for _, k in homes[j]) == n else 0.0))
        for i, k in homes[j]:
            hosted[i] += [moved[i][j]] * k
    sends = [sum(readers[j] * moved[i][j] for j in range(len(vs))) for i in range(len(us))]
    for i, m in enumerate(copies):
        busiest = max(busiest, sends[i] - (min(hosted[i]) if len(hosted[i]) == m else 0.0))
    move_s = busiest / bandwidth + latency if busiest > 0 else 0.0
    breaks = [sorted({x for b in (*us, *vs) for x in (b.lower[d], b.upper[d])}) for d in range(rank)]
    slice_s = 0.0
    for i, b in enumerate(us):
        if lse and copies[i] > 1 and sends[i] and _cells(b, breaks) > 1:  # only lse partials are cut up
            shape = b.shape
            size = nbytes(math.prod(shape), shape[-1] if rank else 1, copies[i] > 1)
            slice_s = max(slice_s, move_seconds(kernels, size, dtype))
    finish_s = 0.0
    for j, r in enumerate(vs):
        cells = _cells(r, breaks)
        shape = r.shape
        volume = math.prod(shape)
        cover = sum(copies[i] * elements[i][j] for i in range(len(us))) / volume  # copies of each element
        t = 0.0
        if cover > 1.0 + 1e-9:  # one ⊕ per cell, of the copies that hold it
            cell = nbytes(volume, shape[-1] if rank else 1, True) / cells
            t += cells * combine_seconds(kernels, volume / cells, cover, (cover + 1) * cell, dtype)
        if lse and cover > 1.0 + 1e-9:  # lse partials are finalized into the block
            t += move_seconds(kernels, volume * width, dtype)
        elif cover > 1.0 + 1e-9 and wide != width:  # partials wider than the output are rounded into the block
            t += move_seconds(kernels, volume * wide, dtype)
        # otherwise copies and ⊕ write into the block; only atoms already on the reader's device are
        # copied by its recompose, a share too small (and too placement-dependent) to price here
        finish_s = max(finish_s, t)
    return slice_s + move_s + finish_s


def device_bandwidth(topo: Any) -> float:
    """Bytes/s each device sends to the others while all of them do (a uniform all-to-all), limited by
    the interconnect resource the most routes share.

    >>> from relational_tensors.target.topology import get_topology
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

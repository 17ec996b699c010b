"""The membership search: the sites of the partitions declared by size that make a program fastest.

:func:`~relational_tensors.exchange.simulator.simulate` runs a program under the membership it is
given; :func:`fastest_membership` chooses one, simulating each candidate and keeping the best run by
:func:`~relational_tensors.exchange.simulator.better`.  With at most :data:`MAX_EXHAUSTIVE` possible
memberships every one is tried; beyond that a local search climbs from the first valid one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import ExProg
from relational_tensors.exchange.closure import free_sites, is_valid, membership_moves, memberships
from relational_tensors.exchange.simulator import SimResult, better, check_topology, simulate
from relational_tensors.machine.topology import Topology

__all__ = ["fastest_membership", "MAX_EXHAUSTIVE"]

MAX_EXHAUSTIVE = 5040  # up to this many memberships (7 partitions of one GPU over 7) every one is simulated
_MAX_SCAN = 5040       # beyond it: how many choices to scan for a valid starting point of the local search
_MAX_ROUNDS = 64       # and how many improving moves the local search may make


def fastest_membership(prog: ExProg, topology: Topology) -> SimResult:
    """The best run of ``prog`` on ``topology`` over the memberships of its partitions declared by size.

    With at most :data:`MAX_EXHAUSTIVE` possible memberships every valid one is simulated
    (``search == "exhaustive"``); beyond that a local search (swap two sites between partitions, or a
    partition's site with a free GPU) starts from the first valid choice (``"local"``).  Runs are
    compared by :func:`~relational_tensors.exchange.simulator.better`, so ties go to the earlier
    choice.  With no valid choice the first choice's (invalid) run is returned; a local search that
    finds no valid start among the first choices raises ExchangeError instead.  A program without
    partitions declared by size is simulated as it is (``"fixed"``).  The membership chosen is the
    result's ``membership``.

    >>> from relational_tensors.exchange.text import parse
    >>> from relational_tensors.machine.machines import get_topology
    >>> prog = parse("GPUS: 0 1 2\\nPARTITIONS: G {size 1}\\nIN: A @ 2\\nOUT: A @ G\\nA @ 2 -> G")
    >>> r = fastest_membership(prog, get_topology("dgx-a100"))
    >>> r.membership, r.time, r.search  # G on the site of its data: nothing moves
    ({'G': (2,)}, 0.0, 'exhaustive')
    """
    top = check_topology(topology, "fastest_membership")
    sized = [p for p in prog.partitions if p.members is None]
    if not sized:
        return simulate(prog, top)
    count = _count_memberships(prog)
    if count == 0:
        raise ExchangeError(
            f"no membership fits the sized partitions {[(p.name, p.size) for p in sized]} into the GPUs "
            f"{prog.gpus} left by the explicit partitions; shrink the partitions or declare more GPUs.")
    if count <= MAX_EXHAUSTIVE:
        best: SimResult | None = None
        for choice in memberships(prog):
            if is_valid(prog, choice):
                run = simulate(prog, top, choice)
                if better(best, run):
                    best = run
        return dataclasses.replace(best or simulate(prog, top, next(memberships(prog))), search="exhaustive")
    start = next((choice for choice in itertools.islice(memberships(prog), _MAX_SCAN) if is_valid(prog, choice)),
                 None)
    if start is None:
        raise ExchangeError(
            f"none of the first {_MAX_SCAN} of {count} memberships of {[p.name for p in sized]} makes the "
            "program valid; pass membership= to simulate explicitly.")
    best = simulate(prog, top, start)
    for _ in range(_MAX_ROUNDS):
        step: SimResult | None = None
        for choice in _neighbours(prog, best.membership):
            if is_valid(prog, choice):
                run = simulate(prog, top, choice)
                if better(step, run):
                    step = run
        if step is None or not better(best, step):
            break
        best = step
    return dataclasses.replace(best, search="local")


def _count_memberships(prog: ExProg) -> int:
    count, left = 1, len(free_sites(prog))
    for p in prog.partitions:
        if p.members is None:
            count *= math.comb(left, p.size) if p.size <= left else 0
            left -= p.size
    return count


def _neighbours(prog: ExProg, membership: Mapping[str, tuple[int, ...]]) -> Iterator[dict[str, tuple[int, ...]]]:
    """Memberships of the partitions declared by size one move away: two swap a site, or one trades a
    site for a free GPU."""
    names = [p.name for p in prog.partitions if p.members is None]
    sized = {name: membership[name] for name in names}
    used = {s for sites in membership.values() for s in sites}
    free = [g for g in free_sites(prog) if g not in used]
    for _, moved, _ in membership_moves(sized, names, free):
        yield moved

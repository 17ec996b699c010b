"""The naive synthesizer of exchange program bodies: gather every required aggregate at each reader.

A *synthesizer* takes a program without a body and the devices of its partitions (its membership) and
returns a body and the membership it chose; the naive one keeps the membership.
"""

from __future__ import annotations

from collections.abc import Callable

from relational_tensors.exchange.ast import Action, ExProg

__all__ = ["Membership", "Synthesizer", "naive", "naive_body"]

Membership = dict[str, tuple[int, ...]]
Synthesizer = Callable[[ExProg, Membership], tuple[frozenset[Action], Membership]]


def naive(prog: ExProg, membership: Membership) -> tuple[frozenset[Action], Membership]:
    """The naive synthesizer: keep the placement, gather and aggregate at each reader."""
    return naive_body(prog, membership), membership


def naive_body(prog: ExProg, membership: Membership | None = None) -> frozenset[Action]:
    """Gather each required aggregate's atoms at each reading site and aggregate there."""
    where: dict[str, list[int]] = {}
    for a in prog.inputs:
        where.setdefault(a.atom, []).append(a.site)
    actions: set[Action] = set()
    for req in prog.outputs:
        for target in req.targets:
            for t in prog.sites_of(target, membership):
                for atom in sorted(req.aggregate):
                    sites = where[atom]
                    if t not in sites:
                        actions.add(Action(frozenset({atom}), sites[0], (t,)))
                if len(req.aggregate) > 1:
                    actions.add(Action(req.aggregate, t))
    return frozenset(actions)

"""The ExProg language (section 5.2): the abstract syntax shared by the parser,
the closure, the simulator, synthesis and lowering.

A program declares sites (``GPUS``), optional ``PARTITIONS`` (explicit groups,
or groups declared by size whose membership the compiler picks), an ``IN``
state (atoms at sites, with sizes in bytes), an ``OUT`` requirement
(aggregates at sites or partitions), and a body that is a *set* of actions
``X @ s -> d1, d2`` (aggregate X at s, then send it), ``X @ s`` (aggregate
locally) and ``X @ G`` (aggregate at every site of partition G).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Aggregate", "Place", "Partition", "InAtom", "Requirement", "Action", "ExProg", "exact_cover",
           "aggregate_text"]

Aggregate = frozenset  # a ⊕-combination of atom names: frozenset[str]
Place = "int | str"     # a site id, or a partition name


def aggregate_text(agg: frozenset[str]) -> str:
    """Canonical spelling ``A+B+C`` (atoms sorted)."""
    return "+".join(sorted(agg))


@dataclass(frozen=True, slots=True)
class Partition:
    """A named group of sites; ``members`` is None when only the size is declared."""

    name: str
    size: int
    members: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class InAtom:
    """``IN: A @ 0 (size: 1.0 GB)`` -- an atom resident at a site; size in bytes."""

    atom: str
    site: int
    size: int = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Requirement:
    """``OUT: A+B @ 0, 1`` -- the aggregate must exist at every listed site or partition."""

    aggregate: frozenset[str]
    targets: tuple[int | str, ...]


@dataclass(frozen=True, slots=True)
class Action:
    """``X @ source -> dests``: aggregate X at source (a site, or every site of a partition), then send it."""

    aggregate: frozenset[str]
    source: int | str
    dests: tuple[int | str, ...] = ()


@dataclass(frozen=True)
class ExProg:
    """A whole program.  ``body`` is a set: the order of actions carries no meaning."""

    gpus: tuple[int, ...]
    partitions: tuple[Partition, ...] = ()
    inputs: tuple[InAtom, ...] = ()
    outputs: tuple[Requirement, ...] = ()
    body: frozenset[Action] = field(default_factory=frozenset)

    def partition(self, name: str) -> Partition | None:
        return next((p for p in self.partitions if p.name == name), None)

    def moved(self, shift: int) -> ExProg:
        """The same program with every site ``shift`` sites on (partitions keep their names): the program of
        the same exchange among other devices, as a later pipeline stage has."""
        def site(s: int | str) -> int | str:
            return s + shift if isinstance(s, int) else s

        return ExProg(self.gpus,
                      tuple(Partition(p.name, p.size, None if p.members is None else
                                      tuple(m + shift for m in p.members)) for p in self.partitions),
                      tuple(InAtom(a.atom, a.site + shift, a.size) for a in self.inputs),
                      tuple(Requirement(r.aggregate, tuple(site(t) for t in r.targets)) for r in self.outputs),
                      frozenset(Action(a.aggregate, site(a.source), tuple(site(d) for d in a.dests))
                                for a in self.body))

    def atom_sizes(self) -> dict[str, int]:
        """Size of each atom (an atom listed at several sites has one size)."""
        return {a.atom: a.size for a in self.inputs}

    def with_body(self, actions: Iterable[Action]) -> ExProg:
        return ExProg(self.gpus, self.partitions, self.inputs, self.outputs, frozenset(actions))

    def sites_of(self, place: int | str, membership: Mapping[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
        """The sites a place names, using ``membership`` for partitions declared by size."""
        if isinstance(place, int):
            return (place,)
        part = self.partition(place)
        if part is None:
            return ()
        if part.members is not None:
            return part.members
        return tuple(membership[place]) if membership and place in membership else ()


def exact_cover(target: frozenset[str], present: Iterable[frozenset[str]]) -> list[frozenset[str]] | None:
    """Aggregates among ``present`` that are pairwise disjoint and union to ``target``, or None.

    Prefers ``target`` itself, then covers with fewer parts.

    >>> sorted(map(sorted, exact_cover(frozenset("ABC"), [frozenset("AB"), frozenset("C"), frozenset("A")])))
    [['A', 'B'], ['C']]
    """
    parts = [p for p in set(present) if p and p <= target]
    if target in parts:
        return [target]
    by_atom: dict[str, list[frozenset[str]]] = {}
    for p in sorted(parts, key=lambda p: (-len(p), sorted(p))):
        for a in p:
            by_atom.setdefault(a, []).append(p)

    def search(remaining: frozenset[str]) -> list[frozenset[str]] | None:
        if not remaining:
            return []
        atom = min(remaining, key=lambda a: (len(by_atom.get(a, ())), a))
        for p in by_atom.get(atom, ()):
            if p <= remaining:
                rest = search(remaining - p)
                if rest is not None:
                    return [p, *rest]
        return None

    return search(target)

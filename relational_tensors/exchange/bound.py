"""The lower bound of an exchange program's time on a topology: what its busiest endpoint cannot avoid.

The search (:mod:`~relational_tensors.exchange.search`) leaves alone a program whose naive run is
within :data:`NEAR` of :func:`lower_bound`: no body could gain more.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import ExProg, aggregate_text
from relational_tensors.exchange.naive import Membership
from relational_tensors.exchange.simulator import check_topology
from relational_tensors.machine.topology import Route, Topology

__all__ = ["lower_bound", "at_bound", "NEAR"]

NEAR = 1e-3  # relative: a naive run this close to its lower bound is not searched


def lower_bound(prog: ExProg, topology: Topology, membership: Membership | None = None, *,
                free_moves: bool = True) -> float:
    """A time that no valid body of ``prog`` beats on ``topology``: the busiest endpoint's bytes over its bandwidth.

    A site's endpoints are the resources that every route into it (ingress) or out of it
    (egress) crosses.  A site receives at least one aggregate inside each aggregate required
    there that its IN atoms cannot form (counted for pairwise-disjoint requirements, which
    need distinct ones); the only holder of an atom read elsewhere sends it out at least once
    inside some required aggregate (counted for atoms that no requirement reads together).
    An endpoint that must carry bytes needs its routes' least latency plus the bytes over its
    bandwidth; a site with no shared endpoint (a mesh of separate links) adds latency only.
    Aggregation stages are not counted.  Partitions declared by size count at the site where
    they cost least: any GPU outside the explicit partitions, or with ``free_moves=False``
    (the search only swaps) the sites ``membership`` gives them.

    >>> from relational_tensors.exchange.text import parse
    >>> from relational_tensors.machine.machines import get_topology
    >>> prog = parse('''GPUS: 0, 1, 2
    ... IN: A @ 0 (size: 450 MB), B @ 1 (size: 450 MB), C @ 1 (size: 450 MB)
    ... OUT: A @ 1, 2, B+C @ 2''')
    >>> round(lower_bound(prog, get_topology("hgx-h200")) * 1e3, 3)  # 2 receives A and B+C: 900 MB at 450 GB/s, + 2 us
    2.002
    """
    top = check_topology(topology, "lower_bound")
    sites = tuple(prog.gpus)
    if len(sites) < 2:
        return 0.0
    caps = top.capacities()
    sizes = prog.atom_sizes()
    holders: dict[str, set[int]] = defaultdict(set)
    for inp in prog.inputs:
        holders[inp.atom].add(inp.site)
    explicit = {p.name: tuple(p.members) for p in prog.partitions if p.members is not None}
    sized = {p.name: p.size for p in prog.partitions if p.members is None}
    fixed: dict[int, set[frozenset]] = defaultdict(set)      # site -> aggregates required there
    wanted: dict[str, set[frozenset]] = defaultdict(set)     # partition declared by size -> aggregates
    for r in prog.outputs:
        for t in r.targets:
            if isinstance(t, int):
                fixed[t].add(r.aggregate)
            elif t in explicit:
                for s in explicit[t]:
                    fixed[s].add(r.aggregate)
            elif t in sized:
                wanted[t].add(r.aggregate)
            else:
                raise ExchangeError(f"OUT names partition {t!r}, which PARTITIONS does not declare "
                                    f"(declared: {sorted([*explicit, *sized])}).")
    taken = {s for members in explicit.values() for s in members}
    if free_moves or membership is None:
        places = [s for s in sites if s not in taken]
    else:
        places = sorted({s for name in sized for s in membership.get(name, ())})

    def size(agg: Iterable[str]) -> int:
        return min(sizes.get(a, 0) for a in agg)

    def endpoint(routes: list[Route]) -> tuple[float, float]:
        """(seconds per byte of the slowest resource every route crosses, the least latency)."""
        common = set(routes[0].resources).intersection(*(r.resources for r in routes[1:]))
        return max((1.0 / caps[r] for r in common), default=0.0), min(r.latency for r in routes)

    ingress = {d: endpoint([top.route(s, d) for s in sites if s != d]) for d in sites}
    egress = {s: endpoint([top.route(s, d) for d in sites if d != s]) for s in sites}

    def seconds(nbytes: int, port: tuple[float, float]) -> float:
        return port[1] + nbytes * port[0] if nbytes else 0.0

    own: dict[int, set[str]] = defaultdict(set)
    for inp in prog.inputs:
        own[inp.site].add(inp.atom)
    # largest first (then by name): the greedy disjoint choices below keep the big aggregates
    order = sorted({r.aggregate for r in prog.outputs}, key=lambda x: (-size(x), aggregate_text(x)))
    rank = {x: i for i, x in enumerate(order)}
    nbytes_of = {x: size(x) for x in order}

    def inbound(aggs: list[frozenset], d: int) -> float:
        nbytes, covered, mine = 0, set[str](), own[d]
        for x in aggs:
            if covered.isdisjoint(x) and not x <= mine:
                covered |= x
                nbytes += nbytes_of[x]
        return seconds(nbytes, ingress[d])

    bound = 0.0
    # egress: atoms with one holder that some requirement away from it reads
    readers: dict[str, set[str]] = defaultdict(set)   # atom -> the sized partitions reading it
    leaving: dict[int, set[str]] = defaultdict(set)
    together: dict[str, set[str]] = defaultdict(set)  # atom -> the atoms some requirement reads with it
    for r in prog.outputs:
        for a in r.aggregate:
            together[a] |= r.aggregate
            if len(holders[a]) != 1:
                continue
            (s,) = holders[a]
            for t in r.targets:
                if isinstance(t, int) or t in explicit:
                    if any(x != s for x in prog.sites_of(t)):
                        leaving[s].add(a)
                else:
                    readers[a].add(t)
    for a, parts in readers.items():
        (s,) = holders[a]
        if len(parts) > 1 or any(sized[t] > 1 for t in parts) or s not in places:
            leaving[s].add(a)
    for s, atoms in leaving.items():
        nbytes, blocked = 0, set[str]()
        for a in sorted(atoms, key=lambda a: (-sizes.get(a, 0), a)):
            if a not in blocked:
                blocked |= together[a]
                nbytes += sizes.get(a, 0)
        bound = max(bound, seconds(nbytes, egress[s]))
    # ingress: the sites, then each partition declared by size at its cheapest place (a place that
    # does not raise the bound ends the scan; the sites holding most of what it reads come first)
    for d in sites:
        bound = max(bound, inbound(sorted(fixed[d], key=rank.__getitem__), d))
    for name, aggs in wanted.items():
        held = Counter(h for x in aggs for a in x for h in holders[a])
        start = tuple(membership.get(name, ())) if membership else ()
        cheapest = None
        for d in sorted(places, key=lambda d: (d not in start, -held[d], d)):
            secs = inbound(sorted(fixed[d] | aggs, key=rank.__getitem__), d)
            cheapest = secs if cheapest is None else min(cheapest, secs)
            if cheapest <= bound:
                break
        bound = max(bound, cheapest or 0.0)
    return bound


def at_bound(time_s: float, bound: float) -> bool:
    """Whether a run of ``time_s`` is within :data:`NEAR` of ``bound``: no rewrite could gain more."""
    return time_s <= bound * (1 + NEAR)

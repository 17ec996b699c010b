"""What an ExProg computes (Definition 5.5): its closure, and whether it is valid.

A *state* is a set of pairs ``(aggregate, site)``.  The program starts from one
``({A}, s)`` per ``IN: A @ s``.  An action ``X @ s -> D`` is *enabled* when the state
holds aggregates at ``s`` that are pairwise disjoint and union to ``X``; firing it adds
``(X, s)`` and ``(X, d)`` for every site ``d`` of ``D``.  The *closure* is the least state
that contains the initial one and is closed under firing.  A program is *well-formed*
when every action is enabled in its closure, and *valid* when it is well-formed and the
closure holds ``(X, t)`` for every ``OUT: X @ t``.

An action whose source is a partition ``G`` is one collective step: it is enabled when it
is enabled at every site of ``G``, and firing it forms ``X`` at all of them.

Partitions declared by size only get their sites from a *membership*
(``{"G2": (4, 5)}``); a program using them is valid when some membership makes it valid.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping

from ..errors import ExchangeError
from .ast import Action, ExProg, Partition, aggregate_text, exact_cover
from .text import action_key, action_text, size_text

__all__ = ["State", "Membership", "initial_state", "enabled", "closure", "check", "is_valid", "memberships",
           "free_sites", "find_membership", "membership_moves"]

State = frozenset  # frozenset[tuple[frozenset[str], int]]: (aggregate, site) pairs
Membership = Mapping[str, tuple[int, ...]]  # size-declared partition name -> its sites

_Held = dict[int, set[frozenset[str]]]  # the state indexed by site


# --- places --------------------------------------------------------------------------------------------

def _size_only(prog: ExProg) -> list[Partition]:
    return [p for p in prog.partitions if p.members is None]


def _resolve(prog: ExProg, membership: Membership | None) -> dict[str, tuple[int, ...]]:
    """Sites of every partition; size-declared ones come from ``membership``."""
    parts: dict[str, tuple[int, ...]] = {}
    for p in prog.partitions:
        if p.members is not None:
            parts[p.name] = tuple(p.members)
        elif membership is not None and p.name in membership:
            parts[p.name] = tuple(membership[p.name])
        else:
            raise ExchangeError(f"partition {p.name} is declared by size only ({{size {p.size}}}) and the "
                                f"membership gives it no sites; got membership {dict(membership or {})}; pass "
                                f"one from memberships(prog), or call check/find_membership to try them all")
    return parts


def _sites(place: int | str, parts: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    if isinstance(place, int):
        return (place,)
    if place not in parts:
        raise ExchangeError(f"unknown partition {place!r}; declared: {', '.join(parts) or 'none'}")
    return parts[place]


# --- the closure ---------------------------------------------------------------------------------------

def initial_state(prog: ExProg, membership: Membership | None = None) -> State:
    """``{({A}, s) : IN A @ s}``.  ``membership`` is accepted for a uniform signature; IN names sites only.

    >>> from relational_tensors.exchange.text import parse
    >>> sorted((sorted(x), s) for x, s in initial_state(parse("GPUS: 0 1\\nIN: A @ 0, B @ 1")))
    [(['A'], 0), (['B'], 1)]
    """
    return frozenset((frozenset({a.atom}), a.site) for a in prog.inputs)


def _covered(target: frozenset[str], present: Iterable[frozenset[str]]) -> bool:
    parts = [p for p in present if p <= target]
    if target in parts:
        return True
    if frozenset().union(*parts) != target:  # cheap test first: some atom never arrived
        return False
    return exact_cover(target, parts) is not None


def _index(state: Iterable[tuple[frozenset[str], int]]) -> _Held:
    held: _Held = defaultdict(set)
    for agg, site in state:
        held[site].add(frozenset(agg))
    return held


def enabled(action: Action, state: Iterable[tuple[frozenset[str], int]], prog: ExProg,
            membership: Membership | None = None) -> bool:
    """Whether ``state`` holds, at every source site, disjoint aggregates that union to the action's.

    >>> from relational_tensors.exchange.text import parse
    >>> p = parse("GPUS: 0 1\\nIN: A @ 0, B @ 0, C @ 1\\nA+B @ 0 -> 1\\nA+B+C @ 1")
    >>> [enabled(a, initial_state(p), p) for a in sorted(p.body, key=action_key)]
    [True, False]
    """
    held = _index(state)
    parts = {} if isinstance(action.source, int) else _resolve(prog, membership)
    sources = _sites(action.source, parts)
    return bool(sources) and all(_covered(action.aggregate, held.get(s, ())) for s in sources)


def _fixpoint(prog: ExProg, parts: Mapping[str, tuple[int, ...]]) -> tuple[_Held, set[Action]]:
    """Closure by worklist: an action is rechecked only when one of its source sites gained an aggregate.

    Returns the state indexed by site and the actions that fired.
    """
    held: _Held = defaultdict(set)
    for a in prog.inputs:
        held[a.site].add(frozenset({a.atom}))
    steps: list[tuple[Action, tuple[int, ...], tuple[int, ...]]] = []  # (action, sources, sources and dests)
    watchers: dict[int, list[int]] = defaultdict(list)
    for act in sorted(prog.body, key=action_key):
        sources = _sites(act.source, parts)
        if not sources:
            continue  # an empty partition forms nothing; check() reports it
        dests = tuple(d for place in act.dests for d in _sites(place, parts))
        for s in set(sources):
            watchers[s].append(len(steps))
        steps.append((act, sources, sources + dests))
    pending = set(range(len(steps)))
    fired: set[Action] = set()
    changed = set(held)
    while changed and pending:
        candidates = sorted({i for s in changed for i in watchers.get(s, ()) if i in pending})
        changed = set()
        for i in candidates:
            act, sources, reached = steps[i]
            if all(_covered(act.aggregate, held[s]) for s in sources):
                pending.discard(i)
                fired.add(act)
                for s in reached:
                    if act.aggregate not in held[s]:
                        held[s].add(act.aggregate)
                        changed.add(s)
    return held, fired


def closure(prog: ExProg, membership: Membership | None = None) -> State:
    """The least state that contains the initial one and is closed under firing enabled actions.

    >>> from relational_tensors.exchange.text import parse
    >>> p = parse("GPUS: 0 1\\nIN: A @ 0, B @ 1\\nA @ 0 -> 1; A+B @ 1 -> 0")
    >>> sorted((aggregate_text(x), s) for x, s in closure(p))
    [('A', 0), ('A', 1), ('A+B', 0), ('A+B', 1), ('B', 1)]
    """
    held, _ = _fixpoint(prog, _resolve(prog, membership))
    return frozenset((agg, site) for site, aggs in held.items() for agg in aggs)


# --- structure: everything that does not depend on the closure -------------------------------------------

def _sizes_text(sizes: Mapping[str, int], atoms: Iterable[str]) -> str:
    return ", ".join(f"{a} {size_text(sizes[a])}" for a in sorted(atoms))


def _check_structure(prog: ExProg) -> None:
    gpus = set(prog.gpus)
    gpus_text = f"GPUS ({', '.join(map(str, prog.gpus))})"
    for g in prog.gpus:
        if prog.gpus.count(g) > 1:
            raise ExchangeError(f"GPUS lists site {g} {prog.gpus.count(g)} times; list each site once")

    names = [p.name for p in prog.partitions]
    for n in names:
        if names.count(n) > 1:
            raise ExchangeError(f"partition {n} is declared {names.count(n)} times; give each partition one "
                                f"declaration")
    owner: dict[int, Partition] = {}
    for p in prog.partitions:
        if (p.size if p.members is None else len(p.members)) < 1:
            raise ExchangeError(f"partition {p.name} has no sites; a partition needs at least one site")
        for s in p.members or ():
            if s not in gpus:
                raise ExchangeError(f"partition {p.name} {{{', '.join(map(str, p.members or ()))}}} has site {s}, "
                                    f"which is not in {gpus_text}; add it to GPUS or remove it from {p.name}")
            if s in owner:
                if owner[s] is p:
                    raise ExchangeError(f"partition {p.name} lists site {s} twice; list each site once")
                raise ExchangeError(f"partitions must be disjoint; got {p.name} overlapping {owner[s].name} "
                                    f"at site {s}; remove site {s} from one of them")
            owner[s] = p
    free = len(gpus - set(owner))
    sized = _size_only(prog)
    needed = sum(p.size for p in sized)
    if needed > free:
        raise ExchangeError(
            f"partitions cannot be disjoint within {gpus_text}: explicit partitions leave {free} free site(s) "
            f"but the partitions declared by size need {needed} "
            f"({', '.join(f'{p.name} size {p.size}' for p in sized)}); add GPUs or shrink the partitions")

    sizes: dict[str, int] = {}
    for a in prog.inputs:
        if a.site not in gpus:
            raise ExchangeError(f"IN {a.atom} @ {a.site}: site {a.site} is not in {gpus_text}")
        if sizes.setdefault(a.atom, a.size) != a.size:
            raise ExchangeError(f"IN gives atom {a.atom} two sizes, {size_text(sizes[a.atom])} and "
                                f"{size_text(a.size)}; one atom has one size")

    def place_ok(place: int | str, where: str) -> None:
        if isinstance(place, int):
            if place not in gpus:
                raise ExchangeError(f"{where}: site {place} is not in {gpus_text}")
        elif place not in names:
            raise ExchangeError(f"{where}: unknown partition {place}; declared: {', '.join(names) or 'none'}")

    def aggregate_ok(agg: frozenset[str], where: str) -> None:
        unknown = sorted(a for a in agg if a not in sizes)
        if unknown:
            raise ExchangeError(f"{where}: atom {unknown[0]} is not in IN (IN atoms: "
                                f"{', '.join(sorted(sizes)) or 'none'}); place it with IN or drop it")
        if len({sizes[a] for a in agg}) > 1:
            raise ExchangeError(f"{where}: atoms combined by ⊕ must have the same size; got "
                                f"{_sizes_text(sizes, agg)}")

    for r in prog.outputs:
        where = f"OUT {aggregate_text(r.aggregate)} @ {', '.join(map(str, r.targets))}"
        for t in r.targets:
            place_ok(t, where)
        aggregate_ok(r.aggregate, where)
    for act in sorted(prog.body, key=action_key):
        where = f"action '{action_text(act)}'"
        for place in (act.source, *act.dests):
            place_ok(place, where)
        aggregate_ok(act.aggregate, where)


def _check_membership(prog: ExProg, membership: Membership) -> None:
    sized = {p.name: p for p in _size_only(prog)}
    extra = sorted(set(membership) - set(sized))
    if extra:
        raise ExchangeError(f"membership names {extra[0]}, which is not a partition declared by size "
                            f"(those are: {', '.join(sized) or 'none'})")
    taken = {s: p.name for p in prog.partitions if p.members is not None for s in p.members}
    for name, p in sized.items():
        sites = tuple(membership.get(name, ()))
        if len(sites) != p.size:
            raise ExchangeError(f"membership gives {name} {len(sites)} site(s) {sites}; it is declared "
                                f"{{size {p.size}}}")
        for s in sites:
            if s not in prog.gpus:
                raise ExchangeError(f"membership puts site {s}, which is not in GPUS, into {name}")
            if s in taken:
                raise ExchangeError(f"membership puts site {s} into {name} and {taken[s]}; partitions must "
                                    f"be disjoint")
            taken[s] = name


# --- validity --------------------------------------------------------------------------------------------

def _held_text(aggs: Iterable[frozenset[str]]) -> str:
    return ", ".join(sorted(map(aggregate_text, aggs))) or "nothing"


def _why_disabled(act: Action, held: _Held, parts: Mapping[str, tuple[int, ...]]) -> str:
    for s in _sites(act.source, parts):
        aggs = held.get(s, set())
        if _covered(act.aggregate, aggs):
            continue
        at = f"site {s}" if isinstance(act.source, int) else f"site {s} (of {act.source})"
        parts_there = [a for a in aggs if a <= act.aggregate]
        missing = act.aggregate - frozenset().union(*parts_there)
        if missing:
            return f"at {at} the closure lacks {', '.join(sorted(missing))} (holds {_held_text(aggs)})"
        return (f"at {at} the closure holds {_held_text(parts_there)}, which no disjoint choice unions to "
                f"{aggregate_text(act.aggregate)}")
    return "its source has no sites"


def _check_semantics(prog: ExProg, membership: Membership) -> None:
    parts = _resolve(prog, membership)
    held, fired = _fixpoint(prog, parts)
    idle = sorted(prog.body - fired, key=action_key)
    if idle:
        more = f" ({len(idle) - 1} more action(s) never enabled)" if len(idle) > 1 else ""
        raise ExchangeError(f"program is not well-formed: action '{action_text(idle[0])}' is never enabled: "
                            f"{_why_disabled(idle[0], held, parts)}{more}; make its inputs reach its source "
                            f"or delete it")
    for r in prog.outputs:
        for t in r.targets:
            for s in _sites(t, parts):
                if r.aggregate not in held.get(s, ()):
                    at = f"site {s}" if isinstance(t, int) else f"site {s} (of {t})"
                    raise ExchangeError(
                        f"OUT requirement {aggregate_text(r.aggregate)} @ {', '.join(map(str, r.targets))} is not "
                        f"satisfied: {aggregate_text(r.aggregate)} is never formed at {at}, which holds "
                        f"{_held_text(held.get(s, ()))}; add an action that forms it there")


def check_structure(prog: ExProg, membership: Membership) -> None:
    """The checks of ``check`` that need no closure: sites, partitions, atoms and ``membership``.  Enough
    for a program whose delivery the lowering already proved by firing it (the naive synthesizer's)."""
    _check_structure(prog)
    _check_membership(prog, membership)


def check(prog: ExProg, membership: Membership | None = None) -> None:
    """Raise ExchangeError unless the program is valid (for ``membership``, or for some membership).

    >>> from relational_tensors.exchange.text import parse
    >>> check(parse("GPUS: 0 1\\nIN: A @ 0, B @ 1\\nOUT: A+B @ 0, 1\\nA @ 0 -> 1; A+B @ 1 -> 0"))
    >>> check(parse("GPUS: 0 1\\nIN: A @ 0, B @ 1\\nOUT: A+B @ 0, 1\\nA @ 0 -> 1; A+B @ 1"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    relational_tensors.errors.ExchangeError: OUT requirement A+B @ 0, 1 is not satisfied: ... site 0, which holds A; ...
    """
    _check_structure(prog)
    if membership is not None:
        _check_membership(prog, membership)
        _check_semantics(prog, membership)
        return
    if not _size_only(prog):
        _check_semantics(prog, {})
        return
    first: tuple[dict[str, tuple[int, ...]], ExchangeError] | None = None
    tried = 0
    for m in _candidates(prog):
        try:
            _check_semantics(prog, m)
            return
        except ExchangeError as err:
            tried += 1
            first = first or (m, err)
    assert first is not None  # _check_structure guaranteed at least one membership
    shown = ", ".join(f"{n} {{{', '.join(map(str, s))}}}" for n, s in first[0].items())
    raise ExchangeError(f"no membership of the partitions declared by size makes the program valid "
                        f"({tried} tried, up to renaming unused sites); with the first, {shown}: {first[1]}")


def is_valid(prog: ExProg, membership: Membership | None = None) -> bool:
    """``check`` as a boolean."""
    try:
        check(prog, membership)
    except ExchangeError:
        return False
    return True


# --- memberships ----------------------------------------------------------------------------------------

def free_sites(prog: ExProg) -> list[int]:
    """The GPUS sites no explicit partition names, sorted: where partitions declared by size may go."""
    taken = {s for p in prog.partitions if p.members is not None for s in p.members}
    return sorted(set(prog.gpus) - taken)


def _assign(sized: list[Partition], free: list[int],
            choices: Callable[[Partition, list[int]], Iterable[tuple[int, ...]]]
            ) -> Iterator[dict[str, tuple[int, ...]]]:
    def go(i: int, left: list[int], acc: dict[str, tuple[int, ...]]) -> Iterator[dict[str, tuple[int, ...]]]:
        if i == len(sized):
            yield dict(acc)
            return
        for pick in choices(sized[i], left):
            acc[sized[i].name] = pick
            yield from go(i + 1, [s for s in left if s not in pick], acc)
        acc.pop(sized[i].name, None)

    yield from go(0, free, {})


def memberships(prog: ExProg) -> Iterator[dict[str, tuple[int, ...]]]:
    """Every assignment of free GPUS sites to the partitions declared by size, disjoint from each
    other and from the explicit partitions; partitions in declaration order, sites as
    ``itertools.combinations`` of the sorted free sites.  Lazy: there can be very many.

    >>> from relational_tensors.exchange.text import parse
    >>> list(memberships(parse("GPUS: 0 1 2\\nPARTITIONS: E {1}, G {size 1}, H {size 1}")))
    [{'G': (0,), 'H': (2,)}, {'G': (2,), 'H': (0,)}]
    """
    yield from _assign(_size_only(prog), free_sites(prog), lambda p, left: itertools.combinations(left, p.size))


def _candidates(prog: ExProg) -> Iterator[dict[str, tuple[int, ...]]]:
    """The memberships ``check`` tries: one per class of memberships equal up to renaming sites.

    Sites that the program never names (unused GPUs) are interchangeable, so only how many of
    them each partition takes matters: a partition takes the lowest unused ones.  Partitions
    never named in OUT or the body only need room, so they take the lowest sites left, last.
    """
    named = {a.site for a in prog.inputs}
    named |= {t for r in prog.outputs for t in r.targets if isinstance(t, int)}
    named |= {p for a in prog.body for p in (a.source, *a.dests) if isinstance(p, int)}
    used_names = {t for r in prog.outputs for t in r.targets} | {p for a in prog.body for p in (a.source, *a.dests)}
    sized = _size_only(prog)
    referenced = [p for p in sized if p.name in used_names]
    idle = [p for p in sized if p.name not in used_names]

    def choices(p: Partition, left: list[int]) -> Iterator[tuple[int, ...]]:
        if p.name not in used_names:
            yield tuple(left[:p.size])
            return
        unused = [s for s in left if s not in named]
        for pick in itertools.combinations(left, p.size):
            spare = [s for s in pick if s not in named]
            if spare == unused[:len(spare)]:
                yield pick

    order = {p.name: i for i, p in enumerate(sized)}
    for m in _assign(referenced + idle, free_sites(prog), choices):
        yield dict(sorted(m.items(), key=lambda kv: order[kv[0]]))


def find_membership(prog: ExProg) -> dict[str, tuple[int, ...]] | None:
    """The first membership (in ``check``'s order) that makes the program valid, or None.

    ``{}`` when the program is valid and has no partitions declared by size.  Call ``check``
    to learn why it returns None.

    >>> from relational_tensors.exchange.text import parse
    >>> find_membership(parse('''GPUS: 0 1 2
    ... PARTITIONS: G {size 1}
    ... IN: A @ 2
    ... OUT: A @ G'''))
    {'G': (2,)}
    """
    try:
        _check_structure(prog)
    except ExchangeError:
        return None
    candidates = _candidates(prog) if _size_only(prog) else iter([{}])
    for m in candidates:
        try:
            _check_semantics(prog, m)
        except ExchangeError:
            continue
        return m
    return None


def membership_moves(membership: Mapping[str, tuple[int, ...]], names: list[str], free: list[int]
                     ) -> Iterator[tuple[str, dict[str, tuple[int, ...]], dict[int, int]]]:
    """Memberships one move away, each with its kind and the sites it exchanges: two of the partitions
    ``names`` trade a site ("swap"), or one trades a site for a GPU of ``free`` ("move").

    >>> [(k, m) for k, m, _ in membership_moves({"G": (0,), "H": (1,)}, ["G", "H"], [2])][:2]
    [('swap', {'G': (1,), 'H': (0,)}), ('move', {'G': (2,), 'H': (1,)})]
    """
    def moved(name: str, old: int, new: int) -> tuple[int, ...]:
        return tuple(sorted(new if s == old else s for s in membership[name]))

    for i, p in enumerate(names):
        for q in names[i + 1:]:
            for a in membership[p]:
                for b in membership[q]:
                    yield "swap", {**membership, p: moved(p, a, b), q: moved(q, b, a)}, {a: b, b: a}
        for a in membership[p]:
            for f in free:
                yield "move", {**membership, p: moved(p, a, f)}, {a: f, f: a}


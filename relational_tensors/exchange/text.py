"""The text form of ExProg (section 5.2): ``parse`` reads it, ``to_text`` writes it back.

Grammar, one statement per line (``#`` starts a comment, blank lines are skipped)::

    GPUS: 0, 1, 2, 3                        sites; commas optional
    PARTITIONS: G1 {0, 1}, G2 {size 2}      explicit members, or a size whose members the compiler picks
    IN: A @ 0 (size: 512 MB), B @ 1         atom @ site; size in GB | MB | KB | B (decimal), default 1 GB
    OUT: A+B @ 0, 1, A+B+C @ G2             aggregate @ sites or partitions; a piece with '@' starts a new entry
    A @ 0 -> 1; A+B @ 1 -> 0                any other line: actions separated by ';'
    A+B @ 0                                 local aggregation
    A+B @ G1                                aggregation at every site of G1

A section keyword may repeat; its entries accumulate in order.  Atom and partition names
are made of letters, digits and ``_ . : -``; they may not be integers (those are sites)
nor begin with a section keyword and its colon.

The printer is canonical: ``to_text(p1) == to_text(p2)`` exactly when ``p1 == p2``, and
``parse(to_text(p)) == p``.  Tuples keep their order (it is part of an ``ExProg``'s value:
GPUS, partitions and their members, IN, OUT, targets, destinations); sets are sorted (the
atoms of an aggregate, and the body, which is printed one action per line, smallest
aggregates first, then by aggregate, source and destinations).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from ..errors import ExchangeError
from .ast import Action, ExProg, InAtom, Partition, Requirement, aggregate_text

__all__ = ["parse", "to_text", "is_name", "size_text", "action_text", "action_key"]

_SECTION = re.compile(r"^(GPUS|PARTITIONS|IN|OUT)\s*:(.*)$")
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
_INTEGER = re.compile(r"-?[0-9]+")
_SITE = re.compile(r"[0-9]+")
_KEYWORD_PREFIX = re.compile(r"(GPUS|PARTITIONS|IN|OUT):")
# Decimal units: 1 GB = 10**9 bytes.  Largest first, for the printer.
UNITS = (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1))
_UNIT = {name: factor for name, factor in UNITS}
DEFAULT_SIZE = 10**9
_PARTITION = re.compile(r"^([^{}\s]+)\s*\{(.*)\}$")
_SIZE_ONLY = re.compile(r"^size\s+([0-9]+)$")
_IN = re.compile(r"^([^@()]+?)\s*@\s*([^@()]+?)\s*(?:\(\s*size\s*:\s*([0-9.]+)\s*([A-Za-z]+)\s*\))?$")

FORMS = {
    "GPUS": "'GPUS: 0, 1, 2, 3' (site numbers, commas optional)",
    "PARTITIONS": "'PARTITIONS: G1 {0, 1}, G2 {size 2}'",
    "IN": "'IN: A @ 0 (size: 512 MB)' (atom @ site, optional size in GB, MB, KB or B)",
    "OUT": "'OUT: A+B @ 0, 1' (aggregate @ sites or partitions)",
    "action": "'X @ s -> d1, d2', 'X @ s' or 'X @ G' (X an aggregate like A+B, s a site or partition)",
}


class _LineError(Exception):
    """A problem inside one line; ``parse`` adds the line number, the text and the expected form."""


# --- names, places, aggregates ---------------------------------------------------------------------------

def is_name(text: str) -> bool:
    """Whether ``text`` can name an atom or a partition.

    >>> [is_name(t) for t in ("A", "x.1:a-b", "12", "-3", "IN:A", "A+B")]
    [True, True, False, False, False, False]
    """
    return bool(_NAME.fullmatch(text)) and not _INTEGER.fullmatch(text) and not _KEYWORD_PREFIX.match(text)


def _name(text: str, what: str) -> str:
    text = text.strip()
    if not is_name(text):
        raise _LineError(f"{what} {text!r} is not a name (letters, digits, _ . : -; not an integer)")
    return text


def _site(text: str) -> int:
    text = text.strip()
    if not _SITE.fullmatch(text):
        raise _LineError(f"{text!r} is not a site (a non-negative integer)")
    return int(text)


def _place(text: str) -> int | str:
    text = text.strip()
    if not text:
        raise _LineError("missing a site or partition name")
    if _SITE.fullmatch(text):
        return int(text)
    return _name(text, "place")


def _aggregate(text: str) -> frozenset[str]:
    atoms = [_name(part, "atom") for part in text.split("+")]
    repeated = sorted({a for a in atoms if atoms.count(a) > 1})
    if repeated:
        # A+A would be A ⊕ A, not A: refuse rather than silently drop the repeat.
        raise _LineError(f"atom {repeated[0]} appears twice in aggregate {text.strip()!r}")
    return frozenset(atoms)


def _places(text: str) -> tuple[int | str, ...]:
    return tuple(_place(p) for p in _split_top(text, "place"))


def _split_top(text: str, what: str) -> list[str]:
    """Split on commas outside braces and parentheses; empty pieces are errors."""
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    if any(not p.strip() for p in pieces):
        raise _LineError(f"empty {what} in a comma-separated list")
    return [p.strip() for p in pieces]


def _size(number: str, unit: str) -> int:
    factor = _UNIT.get(unit.upper())
    if factor is None:
        raise _LineError(f"unknown size unit {unit!r} (use GB, MB, KB or B)")
    try:
        value = Decimal(number) * factor
    except InvalidOperation:
        raise _LineError(f"{number!r} is not a number") from None
    if value != value.to_integral_value():
        raise _LineError(f"size {number} {unit} is not a whole number of bytes")
    return int(value)


def size_text(nbytes: int) -> str:
    """A byte count in the largest decimal unit that holds it exactly.

    >>> size_text(512_000_000), size_text(1_500_000_000), size_text(7)
    ('512 MB', '1500 MB', '7 B')
    """
    for unit, factor in UNITS:
        if nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    raise AssertionError("unreachable: the byte unit divides every integer")


# --- sections ----------------------------------------------------------------------------------------

def _gpus(body: str) -> list[int]:
    return [_site(t) for t in body.replace(",", " ").split()]


def _partitions(body: str) -> list[Partition]:
    out = []
    for entry in _split_top(body, "partition"):
        m = _PARTITION.match(entry)
        if not m:
            raise _LineError(f"cannot read partition {entry!r}")
        name, inside = _name(m.group(1), "partition"), m.group(2).strip()
        sized = _SIZE_ONLY.match(inside)
        if sized:
            out.append(Partition(name, int(sized.group(1))))
        else:
            members = tuple(_site(t) for t in inside.replace(",", " ").split())
            out.append(Partition(name, len(members), members))
    return out


def _inputs(body: str) -> list[InAtom]:
    out = []
    for entry in _split_top(body, "IN entry"):
        m = _IN.match(entry)
        if not m:
            raise _LineError(f"cannot read IN entry {entry!r}")
        atom, site = _name(m.group(1), "atom"), _site(m.group(2))
        size = _size(m.group(3), m.group(4)) if m.group(3) is not None else DEFAULT_SIZE
        out.append(InAtom(atom, site, size))
    return out


def _outputs(body: str) -> list[Requirement]:
    # Commas separate both entries and the targets of one entry: a piece holding '@'
    # starts a new requirement, any other piece is one more target of the previous one.
    entries: list[tuple[frozenset[str], list[int | str]]] = []
    for piece in _split_top(body, "OUT entry"):
        if "@" in piece:
            agg, _, target = piece.partition("@")
            if "@" in target:
                raise _LineError(f"two '@' in {piece!r}")
            entries.append((_aggregate(agg), [_place(target)]))
        elif entries:
            entries[-1][1].append(_place(piece))
        else:
            raise _LineError(f"an OUT entry starts with 'aggregate @', got {piece!r}")
    return [Requirement(agg, tuple(targets)) for agg, targets in entries]


def _action(text: str) -> Action:
    left, arrow, right = text.partition("->")
    if "->" in right:
        raise _LineError("one '->' per action; write a relay X @ s -> r -> d as 'X @ s -> r; X @ r -> d'")
    agg, at, source = left.partition("@")
    if not at or "@" in source:
        raise _LineError(f"an action needs exactly one '@', got {text.strip()!r}")
    if not agg.strip():
        raise _LineError("an action needs an aggregate before '@'")
    if arrow and not right.strip():
        raise _LineError("'->' needs at least one destination")
    dests = _places(right) if arrow else ()
    return Action(_aggregate(agg), _place(source), dests)


def parse(text: str) -> ExProg:
    """Read an ExProg from its text form.

    >>> p = parse('''
    ... GPUS: 0, 1
    ... IN: A @ 0, B @ 1 (size: 512 MB)
    ... OUT: A+B @ 0, 1
    ... A @ 0 -> 1; B @ 1 -> 0; A+B @ 0   # both sides aggregate
    ... A+B @ 1''')
    >>> p.gpus, p.inputs[1].size, len(p.body)
    ((0, 1), 512000000, 4)
    >>> parse("GPUS: 0\\nA @ -> 1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    relational_tensors.errors.ExchangeError: line 2: 'A @ -> 1': missing a site or partition name; expected ...
    """
    gpus: list[int] = []
    partitions: list[Partition] = []
    inputs: list[InAtom] = []
    outputs: list[Requirement] = []
    body: list[Action] = []
    readers: dict[str, tuple[Callable[[str], list], list]] = {
        "GPUS": (_gpus, gpus), "PARTITIONS": (_partitions, partitions),
        "IN": (_inputs, inputs), "OUT": (_outputs, outputs)}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        section = _SECTION.match(line)
        form = FORMS[section.group(1)] if section else FORMS["action"]
        try:
            if section:
                reader, sink = readers[section.group(1)]
                sink.extend(reader(section.group(2)))
            else:
                for piece in line.split(";"):
                    if not piece.strip():
                        raise _LineError("empty action between ';'")
                    body.append(_action(piece))
        except _LineError as err:
            raise ExchangeError(f"line {number}: {line!r}: {err}; expected {form}") from None
    return ExProg(tuple(gpus), tuple(partitions), tuple(inputs), tuple(outputs), frozenset(body))


# --- printing ----------------------------------------------------------------------------------------

def _place_key(place: int | str) -> tuple[int, int, str]:
    return (0, place, "") if isinstance(place, int) else (1, 0, place)


def action_key(action: Action) -> tuple:
    """Printing order of the body: smaller aggregates first (roughly dataflow order), then
    aggregate, source and destinations."""
    return (len(action.aggregate), aggregate_text(action.aggregate), _place_key(action.source),
            tuple(_place_key(d) for d in action.dests))


def action_text(action: Action) -> str:
    """``A+B @ 0 -> 1, G2``."""
    head = f"{aggregate_text(action.aggregate)} @ {action.source}"
    return f"{head} -> {', '.join(map(str, action.dests))}" if action.dests else head


def _check_site(value: object, where: str) -> None:
    if type(value) is not int or value < 0:
        raise ExchangeError(f"{where}: a site is a non-negative int; got {value!r}")


def _check_place(value: object, where: str) -> None:
    if isinstance(value, str):
        if not is_name(value):
            raise ExchangeError(f"{where}: {value!r} is not a partition name (letters, digits, _ . : -; "
                                f"not an integer); rename it")
    else:
        _check_site(value, where)


def _check_aggregate(agg: object, where: str) -> None:
    if not isinstance(agg, frozenset) or not agg:
        raise ExchangeError(f"{where}: an aggregate is a non-empty frozenset of atom names; got {agg!r}")
    for atom in agg:
        if not isinstance(atom, str) or not is_name(atom):
            raise ExchangeError(f"{where}: {atom!r} is not an atom name (letters, digits, _ . : -; "
                                f"not an integer); rename it")


def _check_printable(prog: ExProg) -> None:
    """Refuse programs that have no text form, rather than print text that reads back differently."""
    for g in prog.gpus:
        _check_site(g, "GPUS")
    for p in prog.partitions:
        if not isinstance(p.name, str):
            raise ExchangeError(f"PARTITIONS: a partition name is a str; got {p.name!r}")
        _check_place(p.name, "PARTITIONS")
        if p.members is None:
            if type(p.size) is not int or p.size < 0:
                raise ExchangeError(f"PARTITIONS: {p.name} has size {p.size!r}; a size is a non-negative int")
        else:
            for s in p.members:
                _check_site(s, f"PARTITIONS {p.name}")
            if p.size != len(p.members):
                raise ExchangeError(f"PARTITIONS: {p.name} lists {len(p.members)} members {p.members} but "
                                    f"size {p.size}; make size equal to the number of members")
    for a in prog.inputs:
        if not isinstance(a.atom, str) or not is_name(a.atom):
            raise ExchangeError(f"IN: {a.atom!r} is not an atom name (letters, digits, _ . : -; not an integer)")
        _check_site(a.site, f"IN {a.atom}")
        if type(a.size) is not int or a.size < 0:
            raise ExchangeError(f"IN {a.atom}: size is a non-negative int of bytes; got {a.size!r}")
    for r in prog.outputs:
        _check_aggregate(r.aggregate, "OUT")
        if not r.targets:
            raise ExchangeError(f"OUT {aggregate_text(r.aggregate)}: a requirement needs at least one target")
        for t in r.targets:
            _check_place(t, f"OUT {aggregate_text(r.aggregate)}")
    for act in prog.body:
        _check_aggregate(act.aggregate, "action")
        where = f"action {aggregate_text(act.aggregate)}"
        _check_place(act.source, where)
        for d in act.dests:
            _check_place(d, where)


def to_text(prog: ExProg, check: bool = True) -> str:
    """The canonical text of a program; ``parse(to_text(p)) == p``.  ``check=False`` skips the refusal of
    programs without a text form, for programs the lowering built and verified (its atom names are its own).

    >>> from relational_tensors.exchange.ast import ExProg, InAtom, Requirement, Action
    >>> p = ExProg((0, 1), inputs=(InAtom("A", 0), InAtom("B", 1, 512_000_000)),
    ...            outputs=(Requirement(frozenset("AB"), (1,)),),
    ...            body=frozenset({Action(frozenset("A"), 0, (1,)), Action(frozenset("BA"), 1)}))
    >>> print(to_text(p), end="")
    GPUS: 0, 1
    IN: A @ 0
    IN: B @ 1 (size: 512 MB)
    OUT: A+B @ 1
    <BLANKLINE>
    A @ 0 -> 1
    A+B @ 1
    """
    if check:
        _check_printable(prog)
    lines = ["GPUS: " + ", ".join(map(str, prog.gpus)) if prog.gpus else "GPUS:"]
    if prog.partitions:
        lines.append("PARTITIONS: " + ", ".join(
            f"{p.name} {{size {p.size}}}" if p.members is None else f"{p.name} {{{', '.join(map(str, p.members))}}}"
            for p in prog.partitions))
    for a in prog.inputs:
        size = "" if a.size == DEFAULT_SIZE else f" (size: {size_text(a.size)})"
        lines.append(f"IN: {a.atom} @ {a.site}{size}")
    for r in prog.outputs:
        lines.append(f"OUT: {aggregate_text(r.aggregate)} @ {', '.join(map(str, r.targets))}")
    if prog.body:
        lines.append("")
        lines.extend(action_text(a) for a in sorted(prog.body, key=action_key))
    return "\n".join(lines) + "\n"

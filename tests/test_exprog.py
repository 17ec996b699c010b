"""ExProg text form and closure (section 5.2, Definition 5.5): round trips, the paper's
examples, a fuzz against a brute-force reference closure, and every ExchangeError."""

from __future__ import annotations

import itertools
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relational_tensors.errors import ExchangeError
from relational_tensors.exchange.ast import Action, ExProg, InAtom, Partition, Requirement
from relational_tensors.exchange.closure import (
    check,
    closure,
    enabled,
    find_membership,
    initial_state,
    is_valid,
    memberships,
)
from relational_tensors.exchange.text import parse, to_text

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
GB = 10**9


def agg(text: str) -> frozenset[str]:
    return frozenset(text.split("+"))


def esc(text: str) -> str:
    return re.escape(text)


def round_trips(prog: ExProg) -> str:
    text = to_text(prog)
    assert parse(text) == prog, text
    assert to_text(parse(text)) == text
    return text


# --- text form: hand-written programs -----------------------------------------------------------------

BRIEF = """
GPUS: 0, 1, 2, 3
PARTITIONS: G1 {0, 1}, G2 {size 2}
IN: A @ 0 (size: 1.0 GB), B @ 1 (size: 512 MB)
IN: C @ 2
OUT: A+B @ 0, 1
OUT: A+B+C @ G2
A @ 0 -> 1
B @ 1 -> 0; A+B @ 0
A+B @ G1
A+B @ 0 -> 2, 3
"""

BRIEF_CANONICAL = """\
GPUS: 0, 1, 2, 3
PARTITIONS: G1 {0, 1}, G2 {size 2}
IN: A @ 0
IN: B @ 1 (size: 512 MB)
IN: C @ 2
OUT: A+B @ 0, 1
OUT: A+B+C @ G2

A @ 0 -> 1
B @ 1 -> 0
A+B @ 0
A+B @ 0 -> 2, 3
A+B @ G1
"""


def test_parse_every_form() -> None:
    prog = parse(BRIEF)
    assert prog == ExProg(
        gpus=(0, 1, 2, 3),
        partitions=(Partition("G1", 2, (0, 1)), Partition("G2", 2)),
        inputs=(InAtom("A", 0, GB), InAtom("B", 1, 512_000_000), InAtom("C", 2, GB)),
        outputs=(Requirement(agg("A+B"), (0, 1)), Requirement(agg("A+B+C"), ("G2",))),
        body=frozenset({Action(agg("A"), 0, (1,)), Action(agg("B"), 1, (0,)), Action(agg("A+B"), 0),
                        Action(agg("A+B"), "G1"), Action(agg("A+B"), 0, (2, 3))}))
    assert round_trips(prog) == BRIEF_CANONICAL


def test_parse_is_lenient_about_layout() -> None:
    text = """
    # a comment line, then blank lines

    GPUS: 0 1 2   3          # no commas
    GPUS: 4
    PARTITIONS: x.1:a-b{0,1}
    PARTITIONS:   G_2 { size 1 }
    IN: B+@1    # a typo, fixed below
    """
    with pytest.raises(ExchangeError, match=esc("line 8: 'IN: B+@1': atom 'B+' is not a name")):
        parse(text)
    text = text.replace("IN: B+@1", "IN:A@0(size:2GB),B @ 1 (size: 0.5 kb)")
    text += "B@1->0,x.1:a-b ; A+B@x.1:a-b->G_2\nA+B @ G_2"
    prog = parse(text)
    assert prog.gpus == (0, 1, 2, 3, 4)
    assert prog.partitions == (Partition("x.1:a-b", 2, (0, 1)), Partition("G_2", 1))
    assert prog.inputs == (InAtom("A", 0, 2 * GB), InAtom("B", 1, 500))
    assert prog.body == {Action(agg("B"), 1, (0, "x.1:a-b")), Action(agg("A+B"), "x.1:a-b", ("G_2",)),
                         Action(agg("A+B"), "G_2")}
    assert "IN: B @ 1 (size: 500 B)" in round_trips(prog)


def test_out_entries_and_targets_share_commas() -> None:
    prog = parse("GPUS: 0 1 2\nIN: A @ 0, B @ 1\nOUT: A+B @ 0, 1, B+A @ G, A @ 2")
    assert prog.outputs == (Requirement(agg("A+B"), (0, 1)), Requirement(agg("A+B"), ("G",)),
                            Requirement(agg("A"), (2,)))
    assert "OUT: A+B @ G\n" in round_trips(prog)


@pytest.mark.parametrize("nbytes, shown", [(GB, None), (2 * GB, "2 GB"), (1_500_000_000, "1500 MB"),
                                           (512_000_000, "512 MB"), (4_096, "4096 B"), (3_000, "3 KB"),
                                           (0, "0 GB"), (7, "7 B")])
def test_sizes_print_in_the_largest_exact_unit(nbytes: int, shown: str | None) -> None:
    text = round_trips(ExProg((0,), inputs=(InAtom("A", 0, nbytes),)))
    assert ("(size:" not in text) if shown is None else (f"IN: A @ 0 (size: {shown})" in text)


def test_tuples_keep_their_order_and_sets_are_sorted() -> None:
    prog = ExProg((3, 1, 2), (Partition("Z", 2, (2, 1)), Partition("A", 1)),
                  (InAtom("b", 3), InAtom("a", 1)), (Requirement(agg("b+a"), (2, "Z", 1)),),
                  frozenset({Action(agg("b+a"), 3, (2, 1)), Action(agg("a"), 1, ("Z", 3)), Action(agg("b"), "A")}))
    assert round_trips(prog) == ("GPUS: 3, 1, 2\nPARTITIONS: Z {2, 1}, A {size 1}\nIN: b @ 3\nIN: a @ 1\n"
                                 "OUT: a+b @ 2, Z, 1\n\na @ 1 -> Z, 3\nb @ A\na+b @ 3 -> 2, 1\n")


def test_empty_program_round_trips() -> None:
    assert round_trips(ExProg(())) == "GPUS:\n"
    assert parse("") == ExProg(()) == parse("# nothing\n\n")


# --- text form: random programs -------------------------------------------------------------------------

NAME_CHARS = string.ascii_letters + string.digits + "_.:-"
names = st.text(NAME_CHARS, min_size=1, max_size=5).filter(
    lambda s: not re.fullmatch(r"-?[0-9]+", s) and not re.match(r"(GPUS|PARTITIONS|IN|OUT):", s))
sizes = st.one_of(st.just(GB), st.integers(0, 10**13),
                  st.builds(lambda k, u: k * u, st.integers(0, 5000), st.sampled_from([1, 10**3, 10**6, 10**9])))


@st.composite
def programs(draw) -> ExProg:
    """Any printable program: syntax only, most are not valid."""
    gpus = tuple(draw(st.lists(st.integers(0, 20), min_size=2, max_size=8, unique=True)))
    site = st.one_of(st.sampled_from(gpus), st.integers(0, 30))
    atoms = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    part_names = draw(st.lists(names, max_size=3, unique=True))
    partitions = tuple(
        draw(st.one_of(st.builds(lambda m, n=n: Partition(n, len(m), tuple(m)), st.lists(site, max_size=4)),
                       st.builds(lambda k, n=n: Partition(n, k), st.integers(0, 8)))) for n in part_names)
    place = st.one_of(site, st.sampled_from(part_names)) if part_names else site
    aggregate = st.frozensets(st.sampled_from(atoms), min_size=1)
    inputs = draw(st.lists(st.builds(InAtom, st.sampled_from(atoms), site, sizes), max_size=6))
    outputs = draw(st.lists(st.builds(Requirement, aggregate, st.lists(place, min_size=1, max_size=3).map(tuple)),
                            max_size=3))
    body = draw(st.frozensets(st.builds(Action, aggregate, place, st.lists(place, max_size=3).map(tuple)),
                              max_size=8))
    return ExProg(gpus, partitions, tuple(inputs), tuple(outputs), body)


@FAST
@given(programs())
def test_random_programs_round_trip(prog: ExProg) -> None:
    round_trips(prog)


@FAST
@given(programs(), st.randoms(use_true_random=False))
def test_body_lines_can_be_shuffled_and_joined(prog: ExProg, rnd) -> None:
    head, _, body = to_text(prog).partition("\n\n")
    actions = body.splitlines()
    rnd.shuffle(actions)
    joined = "; ".join(actions[: len(actions) // 2]) + "\n" + "\n".join(actions[len(actions) // 2:])
    assert parse(head + "\n" + joined) == prog


# --- the paper's examples -------------------------------------------------------------------------------

TWO_GPUS = "GPUS: 0, 1\nIN: A @ 0, B @ 1\nOUT: A+B @ 0, 1\n"
FOUR_GPUS = "GPUS: 0, 1, 2, 3\nIN: A @ 0, B @ 1, C @ 2, D @ 3\nOUT: A+B+C+D @ 0, 1, 2, 3\n"
PLACED_BY_COMPILER = """
GPUS: 0, 1, 2, 3, 4, 5, 6, 7
PARTITIONS: G1 {size 4}, G2 {size 4}
IN: A @ 4, B @ 5, C @ 0, D @ 1
OUT: A+B @ G1
OUT: C+D @ G2
A @ 4 -> 5; B @ 5 -> 4; A+B @ 4 -> 6; A+B @ 5 -> 7
C @ 0 -> 1; D @ 1 -> 0; C+D @ 0 -> 2; C+D @ 1 -> 3
"""


@pytest.mark.parametrize("text", [
    TWO_GPUS + "A @ 0 -> 1; B @ 1 -> 0; A+B @ 0; A+B @ 1",
    TWO_GPUS + "A @ 0 -> 1; A+B @ 1 -> 0",
    FOUR_GPUS + "A @ 0 -> 3; B @ 1 -> 3; C @ 2 -> 3; A+B+C+D @ 3 -> 0, 1, 2",  # reduce, then multicast
    FOUR_GPUS + "A @ 0 -> 1; C @ 2 -> 3; A+B @ 1 -> 3; C+D @ 3 -> 1\nA+B+C+D @ 1 -> 0; A+B+C+D @ 3 -> 2",  # tree
    PLACED_BY_COMPILER,
], ids=["two-gpus", "two-gpus-relay", "four-reduce-multicast", "four-tree", "placed-by-compiler"])
def test_paper_examples_parse_validate_and_print_back(text: str) -> None:
    prog = parse(text)
    check(prog)
    assert is_valid(prog)
    assert parse(round_trips(prog)) == prog
    assert reference_is_valid(prog)


def test_compiler_chooses_the_membership() -> None:
    prog = parse(PLACED_BY_COMPILER)
    assert find_membership(prog) == {"G1": (4, 5, 6, 7), "G2": (0, 1, 2, 3)}
    assert sum(1 for _ in memberships(prog)) == 70  # C(8, 4) choices for G1, G2 takes the rest
    check(prog, {"G1": (4, 5, 6, 7), "G2": (0, 1, 2, 3)})
    with pytest.raises(ExchangeError, match=esc("OUT requirement A+B @ G1 is not satisfied: A+B is never formed at "
                                                "site 0 (of G1)")):
        check(prog, {"G1": (0, 1, 2, 3), "G2": (4, 5, 6, 7)})
    # Without the two sends into G1's free sites, no membership works.
    broken = prog.with_body(a for a in prog.body if a.dests != (6,) and a.dests != (7,))
    assert find_membership(broken) is None and not is_valid(broken)
    with pytest.raises(ExchangeError, match=r"no membership of the partitions declared by size makes the program "
                                            r"valid \(\d+ tried.*with the first, G1 \{0, 1, 2, 3\}, G2 \{4, 5, 6, 7\}: "
                                            r"OUT requirement A\+B @ G1"):
        check(broken)


def test_unused_sites_are_tried_once() -> None:
    # Sites 2..9 appear nowhere but in GPUS: which of them G takes does not matter.
    prog = parse("GPUS: 0 1 2 3 4 5 6 7 8 9\nPARTITIONS: G {size 3}\nIN: A @ 0\nOUT: A @ G\nA @ 0 -> G")
    assert find_membership(prog) == {"G": (0, 1, 2)}
    assert sum(1 for _ in memberships(prog)) == 120
    assert is_valid(prog)


def test_partition_source_is_one_collective_step() -> None:
    # A+B @ G needs A+B's parts at every site of G; it forms A+B at all of them and sends from each.
    prog = parse("GPUS: 0 1 2\nPARTITIONS: G {0, 1}\nIN: A @ 0, B @ 0, A @ 1\nOUT: A+B @ 2\nA+B @ G -> 2")
    assert not enabled(next(iter(prog.body)), initial_state(prog), prog)
    with pytest.raises(ExchangeError, match=esc("action 'A+B @ G -> 2' is never enabled: at site 1 (of G) the "
                                                "closure lacks B (holds A)")):
        check(prog)
    fixed = parse(to_text(prog) + "B @ 0 -> 1")
    check(fixed)
    assert {(frozenset("AB"), s) for s in (0, 1, 2)} <= closure(fixed)


def test_closure_without_membership_for_a_sized_partition() -> None:
    prog = parse(PLACED_BY_COMPILER)
    with pytest.raises(ExchangeError, match=r"partition G1 is declared by size only \(\{size 4\}\).*memberships"):
        closure(prog)
    assert (agg("A+B"), 7) in closure(prog, {"G1": (4, 5, 6, 7), "G2": (0, 1, 2, 3)})


# --- fuzz against a brute-force reference ------------------------------------------------------------------

def reference_sites(prog: ExProg, place, membership) -> list[int]:
    if isinstance(place, int):
        return [place]
    part = next(p for p in prog.partitions if p.name == place)
    return list(part.members if part.members is not None else membership[place])


def reference_enabled_at(target: frozenset[str], state: set, site: int) -> bool:
    """Every subfamily of the aggregates at ``site``, grown one aggregate at a time: which unions
    of pairwise disjoint members can be formed?"""
    unions = {frozenset()}
    for y, s in state:
        if s == site and y <= target:
            unions |= {u | y for u in unions if not u & y}
    return target in unions


def reference_closure(prog: ExProg, membership) -> set:
    state = {(frozenset({a.atom}), a.site) for a in prog.inputs}
    while True:
        grown = set(state)
        for act in prog.body:
            sources = reference_sites(prog, act.source, membership)
            if sources and all(reference_enabled_at(act.aggregate, state, s) for s in sources):
                for s in sources + [d for place in act.dests for d in reference_sites(prog, place, membership)]:
                    grown.add((act.aggregate, s))
        if grown == state:
            return state
        state = grown


def reference_valid(prog: ExProg, membership) -> bool:
    state = reference_closure(prog, membership)
    for act in prog.body:
        sources = reference_sites(prog, act.source, membership)
        if not sources or not all(reference_enabled_at(act.aggregate, state, s) for s in sources):
            return False
    return all((r.aggregate, s) in state
               for r in prog.outputs for t in r.targets for s in reference_sites(prog, t, membership))


def reference_memberships(prog: ExProg) -> list[dict]:
    """All memberships, from ordered draws of the free sites (independent of ``memberships``)."""
    sized = [p for p in prog.partitions if p.members is None]
    taken = {s for p in prog.partitions if p.members for s in p.members}
    free = [g for g in prog.gpus if g not in taken]
    found = set()
    for draw in itertools.permutations(free, sum(p.size for p in sized)):
        groups, i = [], 0
        for p in sized:
            groups.append((p.name, tuple(sorted(draw[i:i + p.size]))))
            i += p.size
        found.add(tuple(groups))
    return [dict(g) for g in sorted(found)]


def reference_is_valid(prog: ExProg) -> bool:
    return any(reference_valid(prog, m) for m in reference_memberships(prog))


@st.composite
def preambles(draw, max_gpus: int = 5) -> ExProg:
    """Well-typed preambles: sites in GPUS, atoms of one size, disjoint partitions that fit."""
    n = draw(st.integers(2, max_gpus))
    gpus = tuple(draw(st.permutations(range(n))))
    atoms = [f"A{i}" for i in range(draw(st.integers(1, 4)))]
    inputs = tuple(InAtom(a, s) for a in atoms
                   for s in draw(st.lists(st.sampled_from(gpus), min_size=1, max_size=2, unique=True)))
    partitions, free = [], list(gpus)
    if draw(st.booleans()):
        members = tuple(draw(st.lists(st.sampled_from(free), min_size=1, max_size=2, unique=True)))
        partitions.append(Partition("E", len(members), members))
        free = [g for g in free if g not in members]
    for name in ("G", "H")[: draw(st.integers(0, 2))]:
        if free:
            k = draw(st.integers(1, min(2, len(free))))
            partitions.append(Partition(name, k))
            free = free[k:]
    places = st.one_of(st.sampled_from(gpus), st.sampled_from([p.name for p in partitions])) if partitions \
        else st.sampled_from(gpus)
    outputs = tuple(draw(st.lists(st.builds(Requirement, st.frozensets(st.sampled_from(atoms), min_size=1),
                                            st.lists(places, min_size=1, max_size=2, unique=True).map(tuple)),
                                  min_size=1, max_size=3)))
    return ExProg(gpus, tuple(partitions), inputs, outputs)


def naive_body(prog: ExProg) -> set[Action]:
    """For every OUT X @ t: send each atom of X from its first IN site to t, then aggregate X at t."""
    first = {}
    for a in prog.inputs:
        first.setdefault(a.atom, a.site)
    body = set()
    for r in prog.outputs:
        for t in r.targets:
            for atom in r.aggregate:
                if first[atom] != t:
                    body.add(Action(frozenset({atom}), first[atom], (t,)))
            body.add(Action(r.aggregate, t))
    return body


@st.composite
def mutated(draw, max_gpus: int = 5) -> ExProg:
    prog = draw(preambles(max_gpus))
    body = sorted(naive_body(prog), key=repr)
    names = [p.name for p in prog.partitions]
    place = st.one_of(st.sampled_from(prog.gpus), st.sampled_from(names)) if names else st.sampled_from(prog.gpus)
    atoms = sorted(prog.atom_sizes())
    for _ in range(draw(st.integers(0, 4))):
        if not body:
            break
        i = draw(st.integers(0, len(body) - 1))
        kind = draw(st.sampled_from(["drop", "source", "dests", "add"]))
        if kind == "drop":
            body.pop(i)
        elif kind == "source":
            body[i] = Action(body[i].aggregate, draw(place), body[i].dests)
        elif kind == "dests":
            body[i] = Action(body[i].aggregate, body[i].source,
                             tuple(draw(st.lists(st.sampled_from(body[i].dests), unique=True)))
                             if body[i].dests else ())
        else:
            body.append(Action(draw(st.frozensets(st.sampled_from(atoms), min_size=1)), draw(place),
                               tuple(draw(st.lists(place, max_size=2, unique=True)))))
    return prog.with_body(body)


@settings(FAST, max_examples=150)
@given(preambles())
def test_naive_program_is_valid(prog: ExProg) -> None:
    naive = prog.with_body(naive_body(prog))
    check(naive)
    assert reference_is_valid(naive)


@settings(FAST, max_examples=400)
@given(mutated())
def test_check_judges_as_the_reference(prog: ExProg) -> None:
    expected = reference_is_valid(prog)
    assert is_valid(prog) == expected
    assert (find_membership(prog) is not None) == expected
    for m in reference_memberships(prog)[:6]:
        assert closure(prog, m) == reference_closure(prog, m)
        assert is_valid(prog, m) == reference_valid(prog, m)
    parse(round_trips(prog))


@settings(FAST, max_examples=100)
@given(mutated(max_gpus=8).filter(lambda p: all(q.members is not None for q in p.partitions)))
def test_closure_matches_the_reference_on_eight_gpus(prog: ExProg) -> None:
    assert closure(prog) == reference_closure(prog, {})
    assert is_valid(prog) == reference_valid(prog, {})


@settings(FAST, max_examples=100)
@given(preambles())
def test_memberships_are_every_assignment(prog: ExProg) -> None:
    ours = [tuple(m.items()) for m in memberships(prog)]
    assert len(ours) == len(set(ours))
    assert set(ours) == {tuple(m.items()) for m in reference_memberships(prog)}


# --- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("GPUS: 0, x", "line 1: 'GPUS: 0, x': 'x' is not a site (a non-negative integer); expected 'GPUS: 0, 1, 2, 3'"),
    ("GPUS: 0\nPARTITIONS: G1 0, 1", "line 2: 'PARTITIONS: G1 0, 1': cannot read partition 'G1 0'; expected "
                                     "'PARTITIONS: G1 {0, 1}, G2 {size 2}'"),
    ("IN: A @ G1", "line 1: 'IN: A @ G1': 'G1' is not a site"),
    ("IN: A @ 0 (size: 2 TB)", "unknown size unit 'TB' (use GB, MB, KB or B); expected 'IN: A @ 0 (size: 512 MB)'"),
    ("IN: A @ 0 (size: 1.5 B)", "size 1.5 B is not a whole number of bytes"),
    ("IN: A @ 0 (size: 1.2.3 GB)", "'1.2.3' is not a number"),
    ("IN: A, B @ 1", "cannot read IN entry 'A'"),
    ("IN: 12 @ 0", "atom '12' is not a name (letters, digits, _ . : -; not an integer)"),
    ("OUT: A+B", "an OUT entry starts with 'aggregate @', got 'A+B'; expected 'OUT: A+B @ 0, 1'"),
    ("OUT: A @ 0 @ 1", "two '@' in 'A @ 0 @ 1'"),
    ("OUT: A @ 0,, 1", "empty OUT entry in a comma-separated list"),
    ("\n\nA @ -> 1", "line 3: 'A @ -> 1': missing a site or partition name; expected 'X @ s -> d1, d2', 'X @ s' or "
                     "'X @ G'"),
    ("A -> 1", "an action needs exactly one '@', got 'A -> 1'"),
    ("A @ 0 ->", "'->' needs at least one destination"),
    ("A @ 0 -> 1 -> 2", "one '->' per action; write a relay X @ s -> r -> d as 'X @ s -> r; X @ r -> d'"),
    ("A @ 0;; B @ 1", "empty action between ';'"),
    ("A+A @ 0", "atom A appears twice in aggregate 'A+A'"),
    ("A++B @ 0", "atom '' is not a name"),
    ("@ 0", "an action needs an aggregate before '@'"),
    ("in: A @ 0", "line 1: 'in: A @ 0': atom 'in: A' is not a name"),
])
def test_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(ExchangeError, match=esc(message)):
        parse(text)


@pytest.mark.parametrize("prog, message", [
    (ExProg((0, -1)), "GPUS: a site is a non-negative int; got -1"),
    (ExProg((0, True)), "GPUS: a site is a non-negative int; got True"),
    (ExProg((0,), (Partition("G", 3, (0,)),)), "G lists 1 members (0,) but size 3"),
    (ExProg((0,), (Partition("7", 1),)), "'7' is not a partition name"),
    (ExProg((0,), inputs=(InAtom("A B", 0),)), "IN: 'A B' is not an atom name"),
    (ExProg((0,), inputs=(InAtom("A", 0, -5),)), "IN A: size is a non-negative int of bytes; got -5"),
    (ExProg((0,), outputs=(Requirement(frozenset(), (0,)),)), "OUT: an aggregate is a non-empty frozenset"),
    (ExProg((0,), outputs=(Requirement(agg("A"), ()),)), "OUT A: a requirement needs at least one target"),
    (ExProg((0,), body=frozenset({Action(agg("A"), "x y")})), "action A: 'x y' is not a partition name"),
])
def test_unprintable_programs_are_refused(prog: ExProg, message: str) -> None:
    with pytest.raises(ExchangeError, match=esc(message)):
        to_text(prog)


HEAD = "GPUS: 0, 1, 2, 3\nIN: A @ 0, B @ 1\n"


@pytest.mark.parametrize("text, message", [
    ("GPUS: 0, 1, 1", "GPUS lists site 1 2 times; list each site once"),
    (HEAD + "IN: C @ 9", "IN C @ 9: site 9 is not in GPUS (0, 1, 2, 3)"),
    (HEAD + "OUT: A @ 0, 5", "OUT A @ 0, 5: site 5 is not in GPUS (0, 1, 2, 3)"),
    (HEAD + "A @ 7 -> 1", "action 'A @ 7 -> 1': site 7 is not in GPUS (0, 1, 2, 3)"),
    (HEAD + "A @ 0 -> 8", "action 'A @ 0 -> 8': site 8 is not in GPUS (0, 1, 2, 3)"),
    (HEAD + "PARTITIONS: G {0, 4}", "partition G {0, 4} has site 4, which is not in GPUS (0, 1, 2, 3)"),
    (HEAD + "OUT: A @ G9", "OUT A @ G9: unknown partition G9; declared: none"),
    (HEAD + "PARTITIONS: G {0}\nA @ 0 -> H", "action 'A @ 0 -> H': unknown partition H; declared: G"),
    (HEAD + "PARTITIONS: G {0}\nA @ H", "action 'A @ H': unknown partition H; declared: G"),
    (HEAD + "PARTITIONS: G {0, 1}, H {1, 2}", "partitions must be disjoint; got H overlapping G at site 1"),
    (HEAD + "PARTITIONS: G {0, 0}", "partition G lists site 0 twice"),
    (HEAD + "PARTITIONS: G {0}, G {1}", "partition G is declared 2 times"),
    (HEAD + "PARTITIONS: G {}", "partition G has no sites"),
    (HEAD + "PARTITIONS: G {size 0}", "partition G has no sites"),
    (HEAD + "PARTITIONS: E {0, 1}, G {size 2}, H {size 1}",
     "partitions cannot be disjoint within GPUS (0, 1, 2, 3): explicit partitions leave 2 free site(s) but the "
     "partitions declared by size need 3 (G size 2, H size 1)"),
    (HEAD + "A+C @ 0", "action 'A+C @ 0': atom C is not in IN (IN atoms: A, B)"),
    (HEAD + "OUT: A+Z @ 0", "OUT A+Z @ 0: atom Z is not in IN (IN atoms: A, B)"),
    (HEAD + "IN: C @ 2 (size: 2 MB)\nOUT: A+B+C @ 0", "OUT A+B+C @ 0: atoms combined by ⊕ must have the same size; "
                                                     "got A 1 GB, B 1 GB, C 2 MB"),
    (HEAD + "IN: C @ 2 (size: 2 MB)\nA+C @ 0", "action 'A+C @ 0': atoms combined by ⊕ must have the same size; "
                                              "got A 1 GB, C 2 MB"),
    (HEAD + "IN: A @ 3 (size: 4 KB)", "IN gives atom A two sizes, 1 GB and 4 KB"),
    (HEAD + "A+B @ 0 -> 1", "program is not well-formed: action 'A+B @ 0 -> 1' is never enabled: at site 0 the "
                            "closure lacks B (holds A); make its inputs reach its source or delete it"),
    ("GPUS: 0, 1, 2\nIN: A @ 1, B @ 1, B @ 2, C @ 2\nA+B @ 1 -> 0; B+C @ 2 -> 0; A+B+C @ 0",
     "program is not well-formed: action 'A+B+C @ 0' is never enabled: at site 0 the closure holds A+B, B+C, which "
     "no disjoint choice unions to A+B+C"),
    (HEAD + "A+B @ 2; A+B @ 0 -> 1", "action 'A+B @ 0 -> 1' is never enabled: at site 0 the closure lacks B "
                                     "(holds A) (1 more action(s) never enabled)"),
    (HEAD + "A @ 0 -> 9; A+B @ 0 -> 1; A @ 3", "action 'A @ 0 -> 9'"),
    (HEAD + "A+B @ 0 -> 1; A @ 3", "action 'A @ 3' is never enabled: at site 3 the closure lacks A (holds "
                                   "nothing) (1 more action(s) never enabled)"),
    (HEAD + "OUT: A+B @ 0, 1\nB @ 1 -> 0; A+B @ 0",
     "OUT requirement A+B @ 0, 1 is not satisfied: A+B is never formed at site 1, which holds B; add an action that "
     "forms it there"),
    (HEAD + "PARTITIONS: G {1, 2}\nOUT: A+B @ G\nB @ 1 -> 0; A+B @ 0 -> 1",
     "OUT requirement A+B @ G is not satisfied: A+B is never formed at site 2 (of G), which holds nothing"),
])
def test_check_errors(text: str, message: str) -> None:
    prog = parse(text)
    with pytest.raises(ExchangeError, match=esc(message)):
        check(prog)
    assert not is_valid(prog) and find_membership(prog) is None


def test_membership_errors() -> None:
    prog = parse("GPUS: 0 1 2 3\nPARTITIONS: E {0}, G {size 2}\nIN: A @ 1\nOUT: A @ G\nA @ 1 -> G")
    check(prog, {"G": (1, 2)})
    for membership, message in [({"G": (1,)}, "membership gives G 1 site(s) (1,); it is declared {size 2}"),
                                ({"G": (1, 9)}, "membership puts site 9, which is not in GPUS, into G"),
                                ({"G": (0, 1)}, "membership puts site 0 into G and E; partitions must be disjoint"),
                                ({"G": (1, 2), "E": (3,)}, "membership names E, which is not a partition declared "
                                                           "by size (those are: G)")]:
        with pytest.raises(ExchangeError, match=esc(message)):
            check(prog, membership)
        assert not is_valid(prog, membership)

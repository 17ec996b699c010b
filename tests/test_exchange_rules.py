"""The rewrite rules of the exchange search, one fixture each.

``tests/fixtures/exchange_rules/<rule>.txt`` holds a small program before and after its rule, in the
exchange's text form: ``# topology:`` names the machine, ``## before`` and ``## after`` start the two
programs, and a ``# membership:`` line in a section gives its partitions declared by size their sites.
The rule applied to the program before must propose the program after, and that program, tidied as
the search tidies it, must be valid.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relational_tensors.exchange.ast import ExProg
from relational_tensors.exchange.body import Problem, as_step, tidy, to_actions
from relational_tensors.exchange.closure import check
from relational_tensors.exchange.rules import RULES, Rule, apply, rule_name
from relational_tensors.exchange.text import parse, to_text
from relational_tensors.machine.machines import get_topology
from relational_tensors.machine.topology import Topology

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "exchange_rules"

Membership = dict[str, tuple[int, ...]]


def _membership(section: str) -> Membership:
    """``# membership: FA = 5, FB = 4`` (a partition's sites separated by spaces), or {} without one."""
    line = re.search(r"^# membership:(.*)$", section, re.M)
    if line is None:
        return {}
    pairs = [part.split("=") for part in line.group(1).split(",")]
    return {name.strip(): tuple(int(s) for s in sites.split()) for name, sites in pairs}


def read_fixture(path: Path) -> tuple[Topology, ExProg, Membership, ExProg, Membership]:
    """The topology, and the program and membership before and after, of one fixture."""
    head, _, rest = path.read_text().partition("## before\n")
    before, _, after = rest.partition("## after\n")
    machine = re.search(r"^# topology: (\S+)$", head, re.M)
    assert machine and after, f"{path.name}: needs '# topology: <name>', '## before' and '## after' lines"
    return get_topology(machine.group(1)), parse(before), _membership(before), parse(after), _membership(after)


@pytest.mark.parametrize("rule", RULES, ids=rule_name)
def test_the_rule_rewrites_its_fixture(rule: Rule) -> None:
    path = FIXTURES / f"{rule.__name__}.txt"
    assert path.exists(), f"rule {rule_name(rule)} has no fixture; write {path}: a small program before and after it"
    top, before, start, after, moved = read_fixture(path)
    check(before, start)
    assert after.with_body(()) == before.with_body(()), "a rule rewrites the body (and membership), nothing else"
    proposed = [(to_text(p), m) for p, m in apply(rule, before, top, start)]
    assert (to_text(after), moved) in proposed, (
        f"{rule_name(rule)} does not propose the fixture's 'after'; it proposes:\n"
        + "\n".join(f"{m}\n{text}" for text, m in proposed))
    tidied = tidy(Problem(before, top, free_moves=True), frozenset(map(as_step, after.body)), moved)
    assert tidied is not None, f"{rule_name(rule)}: tidying cannot make the fixture's 'after' deliver OUT"
    check(after.with_body(to_actions(tidied)), moved)


def test_every_fixture_is_a_rule() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*.txt")) == sorted(rule.__name__ for rule in RULES)


def test_a_rule_that_does_not_apply_proposes_nothing() -> None:
    alone = parse("GPUS: 0, 1\nIN: A @ 0\nOUT: A @ 1\nA @ 0 -> 1")  # one transfer, nothing to fuse, split or move
    proposed = {rule_name(rule): apply(rule, alone, get_topology("dgx-a100")) for rule in RULES}
    assert {name for name, found in proposed.items() if found} == set()

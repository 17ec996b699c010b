"""Plan files damaged, truncated, edited or crafted: each is refused with a PlanError, or (where a change
touches nothing the file means) loads the bit-identical program; loading never runs code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.driver import plan_file
from relational_tensors.graph.models import llama_block, llama_feeds

G = llama_block(1, 12, 16, 4, 2, 24)
FEEDS = llama_feeds(G, 0)
CG = rt.compileGraph(G, device="cpu:3")
DATA = plan_file.dumps(CG)
WANT = CG.run(FEEDS)


def _outcome(data: bytes) -> str:
    try:
        again = plan_file.loads(data, G)
    except rt.PlanError:
        return "refused"
    got = again.run(FEEDS)
    assert all(np.array_equal(got[k], WANT[k]) for k in WANT), "a changed file loaded a different program"
    return "identical"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(1, 255)), min_size=1, max_size=3))
def test_byte_flips_are_refused_or_harmless(flips: list[tuple[int, int]]) -> None:
    data = bytearray(DATA)
    for at, x in flips:
        data[at] ^= x
    _outcome(bytes(data))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, len(DATA) - 1))
def test_truncations_are_refused(keep: int) -> None:
    assert _outcome(DATA[:keep]) == "refused"


@pytest.mark.parametrize("field", ["fingerprint", "package", "device", "body_bytes", "sha256", "saved", "format"])
def test_an_edited_header_field_is_refused(field: str) -> None:
    end = DATA.index(b"\n", len(plan_file.MAGIC))
    header = json.loads(DATA[len(plan_file.MAGIC):end])
    header[field] = 7 if field in ("body_bytes", "format") else "edited"
    edited = plan_file.MAGIC + json.dumps(header).encode() + DATA[end:]
    with pytest.raises(rt.PlanError):
        plan_file.loads(edited, G)


def _signed(doc: object, blobs: list[bytes]) -> bytes:
    """A well-formed, correctly checksummed plan file whose body is ``doc``: what a crafted file can be."""
    body = plan_file._frame([json.dumps(doc).encode(), *blobs])
    end = DATA.index(b"\n", len(plan_file.MAGIC))
    header = json.loads(DATA[len(plan_file.MAGIC):end])
    header["body_bytes"] = len(body)
    header["sha256"] = plan_file._digest(header, body)
    return plan_file.MAGIC + json.dumps(header).encode() + b"\n" + body


@pytest.mark.parametrize("doc", [
    ["O", "os:system", None, None],                                   # a callable outside the package
    ["O", "builtins:eval", None, None],
    ["O", "relational_tensors.driver.plan_file:save_plan", None, None],  # a function, not a class
    ["O", "relational_tensors.errors:PlanError", None, None],           # an exception class
    ["A", 0, "object"],                                                 # an array of Python objects
    ["R", 5],                                                           # a reference to nothing yet
    ["D", "members"],                                                   # a key without its value
    ["Q", 1],                                                           # an unknown tag
    {"members": 1},                                                     # an untagged object
])
def test_a_crafted_body_runs_nothing_and_is_refused(doc: object, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    blobs = [b""]
    with pytest.raises(rt.PlanError):
        plan_file.loads(_signed(doc, blobs), G)
    assert not marker.exists()


def test_a_save_interrupted_leaves_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "b.plan"
    rt.save_plan(CG, path)
    before = path.read_bytes()

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plan_file.os, "replace", fail)
    with pytest.raises(rt.PlanError, match="No space left"):
        rt.save_plan(CG, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["b.plan"]


@pytest.mark.parametrize("bad", [None, 3, ["a.plan"]])
def test_paths_of_the_wrong_kind_are_refused(bad: object) -> None:
    with pytest.raises(rt.PlanError, match="path"):
        rt.load_plan(bad, G)  # type: ignore[arg-type]
    with pytest.raises(rt.PlanError, match="path"):
        rt.save_plan(CG, bad)  # type: ignore[arg-type]

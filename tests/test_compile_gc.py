"""Python's cyclic collector while planning: off in the passes whose garbage grows with the plan, on (at a
raised young-generation threshold) while exchange programs are searched, whose reference cycles grow with
the search's effort; the caller's settings come back as they were."""

from __future__ import annotations

import gc
import logging

import pytest

import relational_tensors as rt
from relational_tensors.exchange import searcher
from relational_tensors.graph.models import llama_block

GRAPH = llama_block(1, 16, 32, 4, 2, 40)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch):
    """The collector's (enabled, young threshold) at each pass's start ("pass") and in each search."""
    states: list[tuple[str, bool, int]] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("pass") and record.getMessage().endswith("begins"):
                states.append(("pass", gc.isenabled(), gc.get_threshold()[0]))

    def probed(*args, **kwargs):
        states.append(("search", gc.isenabled(), gc.get_threshold()[0]))
        return searching(*args, **kwargs)

    searching = searcher.search_program  # as the whole lowering's Searcher calls it
    monkeypatch.setattr(searcher, "search_program", probed)
    log = logging.getLogger("relational_tensors.compile")
    handler, level, before, enabled = Probe(), log.level, gc.get_threshold(), gc.isenabled()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield states
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        gc.set_threshold(*before)
        (gc.enable if enabled else gc.disable)()


def test_the_collector_runs_while_searching_only_and_comes_back(seen: list) -> None:
    gc.enable()
    before = gc.get_threshold()
    rt.compileGraph(GRAPH, device="cpu:4", topology="dgx-v100", schedule_mode="search", search_total_steps=20)
    assert gc.isenabled() and gc.get_threshold() == before
    assert {(on, young >= 100_000) for kind, on, young in seen if kind == "search"} == {(True, True)}
    assert {on for kind, on, _ in seen if kind == "pass"} == {False}
    with pytest.raises(rt.PlanError):  # a refused compile gives them back too
        rt.compileGraph(GRAPH, device="cpu:4", selector="best")
    assert gc.isenabled() and gc.get_threshold() == before


@pytest.mark.parametrize("caller", ["disabled", "threshold 0"])
def test_a_caller_without_automatic_collection_keeps_it_off(seen: list, caller: str) -> None:
    if caller == "disabled":
        gc.disable()
    else:
        gc.enable()
        gc.set_threshold(0, 10, 10)
    before = (gc.isenabled(), gc.get_threshold())
    rt.compileGraph(GRAPH, device="cpu:2", topology="dgx-v100", schedule_mode="search", search_total_steps=10)
    assert (gc.isenabled(), gc.get_threshold()) == before
    assert seen and all(not on or young == 0 for _, on, young in seen)

"""Planning keeps Python's cyclic collector running (at a higher young-generation threshold) and leaves
the caller's collector settings as it found them."""

from __future__ import annotations

import gc
import logging

import pytest

import relational_tensors as rt
from relational_tensors.models import llama_block


class _Probe(logging.Handler):
    """Notes the collector's state each time a compile pass begins."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[bool, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((gc.isenabled(), gc.get_threshold()[0]))


@pytest.fixture
def probe():
    log = logging.getLogger("relational_tensors.compile")
    handler, level = _Probe(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    before = gc.get_threshold()
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        gc.set_threshold(*before)


def test_the_collector_runs_while_planning_and_its_settings_come_back(probe: _Probe) -> None:
    g = llama_block(1, 16, 32, 4, 2, 40)
    before = gc.get_threshold()
    rt.compileGraph(g, device="cpu:4", schedule_mode="search", search_total_steps=20)
    assert gc.get_threshold() == before and gc.isenabled()
    assert probe.seen and all(on and young >= 100_000 for on, young in probe.seen)
    with pytest.raises(rt.PlanError):  # a refused compile restores them too
        rt.compileGraph(g, device="cpu:4", selector="best")
    assert gc.get_threshold() == before


def test_a_caller_that_turned_automatic_collection_off_keeps_it_off(probe: _Probe) -> None:
    gc.set_threshold(0, 10, 10)
    rt.compileGraph(llama_block(1, 16, 32, 4, 2, 40), device="cpu:2")
    assert gc.get_threshold() == (0, 10, 10)
    assert probe.seen and all(young == 0 for _, young in probe.seen)

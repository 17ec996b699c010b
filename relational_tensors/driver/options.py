"""The options of one compilation, typed and validated once at the API boundary.

Every option with a fixed set of values declares it here and nowhere else: ``compileGraph`` checks
against it and the command line builds its ``choices`` from it.

>>> CompileOptions(selector="greedy").selector
'greedy'
>>> CompileOptions.choices("schedule_mode")
('naive', 'search', 'ai')
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from relational_tensors.core.numbers import is_integer, is_number
from relational_tensors.dp_optimizer.costs import COST_MODEL_NAMES
from relational_tensors.dp_optimizer.pipeline import Pipeline, parse_pipeline
from relational_tensors.dp_optimizer.select import SELECTORS
from relational_tensors.dp_optimizer.trees import TACTICS
from relational_tensors.errors import PlanError
from relational_tensors.machine.topology import Topology

__all__ = ["CompileOptions", "SCHEDULE_MODES", "ATTENTION_KERNELS", "KEEP_STATES"]

SCHEDULE_MODES = ("naive", "search", "ai")  # "ai" is the paper's name for "search"
KEEP_STATES = ("auto", "as read", "sharded")
ATTENTION_KERNELS = ("triton", "flash")
MAX_MEMORY = 1 << 62  # bytes: what the catalog's BIGINT columns (and any device) can hold


def _choice(default: str, choices: tuple[str, ...], what: str) -> Any:
    return field(default=default, metadata={"choices": choices, "what": what})


@dataclass(frozen=True)
class CompileOptions:
    """Where and how to plan: the devices, the selector, cost model, DP tactic, exchange synthesis, topology
    and limits.

    ``device`` names the devices (``"cpu:N"``, ``"cuda:0,1"``, ``"cuda:0,0,0,0"`` for logical devices of one
    GPU, a ``DeviceSet``, ``"dist"`` for one process per device under torchrun; None: every visible GPU, else
    one virtual CPU device per core; see ``machine.devices``);
    ``selector`` is ``dp`` (Algorithm 1, then with ``refine`` a coordinate descent on the whole-plan cost
    across the tensors the DP cuts), ``greedy`` or ``random`` (with ``seed``); ``cost_model`` is
    ``paper`` (elements), ``bytes`` or ``calibrated`` (seconds on ``topology`` with the kernel rates of
    ``calibration``, by default the file shipped for the machine); ``memory_per_device`` (bytes) bounds
    each device's working set and peak; ``tactic`` is ``tree`` or ``linear``; ``schedule_mode`` is
    ``naive`` or ``search`` (alias ``ai``: at most ``search_total_steps`` proposals judged over the plan's
    programs, spread by their naive times, and ``search_steps`` per program (None: no such cap), which
    makes the search reproducible for a ``seed``; ``search_budget_s`` seconds per program as a cap that the
    plan reports when it stopped a search); ``attention`` picks
    the GPU attention kernel; ``label`` names the compilation in the catalog; ``keep_states`` says how
    assigned states stay on the devices between executions: ``as read`` (the blocks their readers read),
    ``sharded`` (one copy of their value's blocks, gathered for each reader), or ``auto`` (as read, and
    sharded where a plan would not fit the memory otherwise); ``second_phase_inputs`` names inputs loaded
    only for a second phase of each execution (``execute(phase=1)``, after ``execute(phase=0)`` ran
    every task that needs none of them: a forward pass whose activations the backward then reads);
    ``constraints`` pins operators' splits (operator name -> ``idx=n,...`` in ``candidate_specs.split``'s
    notation; the indices not named stay the optimizer's) and the layouts of graph inputs and states
    (name -> ``R``, ``S(d)`` or ``dim=n,...``; see ``dp_optimizer.constraints``); ``pipeline`` cuts the devices
    into stages of consecutive layers and the batch into micro-batches (``rt.Pipeline(stages, micro_batches,
    schedule)`` or a dict of those; see ``dp_optimizer.pipeline``; ``"auto"``: the fastest of a few, simulated,
    see ``driver.pipelines``): the splits and constraints are then the plan of one stage, for ``p / stages``
    devices.
    """

    device: object = None
    selector: str = _choice("dp", SELECTORS, "selector")
    seed: int = 0
    cost_model: str = _choice("paper", COST_MODEL_NAMES, "cost model")
    memory_per_device: int | None = None
    tactic: str = _choice("tree", TACTICS, "DP tactic")
    label: str | None = None
    schedule_mode: str = _choice("naive", SCHEDULE_MODES, "schedule_mode")
    topology: str | Topology = "hgx-h200"
    search_budget_s: float = 0.5
    search_steps: int | None = None
    search_total_steps: int | None = 400
    calibration: str | Path | None = None
    attention: str = _choice("triton", ATTENTION_KERNELS, "attention kernel")
    refine: bool = True
    keep_states: str = _choice("auto", KEEP_STATES, "keep_states")
    second_phase_inputs: frozenset[str] = frozenset()
    constraints: tuple[tuple[str, str], ...] = ()  # (name, split such as "heads_kv=8" or layout such as "S(0)")
    pipeline: Pipeline | str | None = None  # "auto": chosen by driver.pipelines

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise PlanError(f"unknown {f.metadata['what']} {value!r}; choose one of {choices}.")
        seed = self.seed
        if not is_integer(seed) or not 0 <= seed < 2**31:
            raise PlanError(f"seed must be an integer in [0, 2**31); got {seed!r}.")
        m = self.memory_per_device
        if m is not None and (not is_integer(m) or not 0 < m <= MAX_MEMORY):
            raise PlanError(f"memory_per_device must be a positive number of bytes, at most 2**62; got {m!r}.")
        if self.label is not None and not isinstance(self.label, str):
            raise PlanError(f"label must be a string or None; got {self.label!r}.")
        if self.calibration is not None and not isinstance(self.calibration, (str, os.PathLike)):
            raise PlanError(f"calibration must be the path of a calibration file or None; got {self.calibration!r}.")
        if not isinstance(self.topology, (str, Topology)):
            raise PlanError(f"topology must be a topology name, the path of a topology JSON file or a Topology; "
                            f"got {self.topology!r}.")
        later = self.second_phase_inputs
        if not isinstance(later, frozenset) or not all(isinstance(n, str) for n in later):
            raise PlanError(f"second_phase_inputs must be input names; got {later!r}.")
        if not isinstance(self.refine, bool):
            raise PlanError(f"refine must be True or False; got {self.refine!r}.")
        steps = self.search_steps
        if steps is not None and (not is_integer(steps) or not 0 < steps <= 10**9):
            raise PlanError(f"search_steps must be a positive whole number of proposals, or None; got {steps!r}.")
        total = self.search_total_steps
        if total is not None and (not is_integer(total) or not 0 <= total <= 10**9):
            raise PlanError(f"search_total_steps must be a whole number of proposals (0 searches nothing), or None "
                            f"for no limit over the plan; got {total!r}.")
        object.__setattr__(self, "pipeline", parse_pipeline(self.pipeline))
        if self.pipeline is not None and later:
            raise PlanError("a pipelined plan runs every micro-batch's forward and backward in one execution; "
                            "second_phase_inputs splits an execution in two. Drop one of them.")
        b = self.search_budget_s
        if not is_number(b) or not 0 < b < math.inf:
            raise PlanError(f"search_budget_s must be a positive number of seconds; got {b!r}.")

    @staticmethod
    def choices(name: str) -> tuple[str, ...]:
        """The values option ``name`` accepts."""
        for f in fields(CompileOptions):
            if f.name == name and "choices" in f.metadata:
                return tuple(f.metadata["choices"])
        raise KeyError(f"option {name!r} has no fixed set of values")

    @staticmethod
    def default(name: str) -> Any:
        """The default value of option ``name``."""
        return next(f.default for f in fields(CompileOptions) if f.name == name)

    @property
    def searched(self) -> bool:
        """Exchange programs are searched, not only built naively."""
        return self.schedule_mode in ("search", "ai")

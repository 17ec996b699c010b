"""The result of compilation: a graph with its plan, its program, and the catalog that explains it.

``CompiledGraph`` loads inputs, runs the task DAG on its executor (NumPy virtual devices or CuPy GPUs),
offloads outputs and states, simulates and traces the program, and answers SQL over its catalog.
``relational_tensors.driver.compiler`` makes one; ``relational_tensors.driver.plan_file`` saves and reloads one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from relational_tensors.catalog import Catalog
from relational_tensors.core.feeds import STALE_OUTPUTS, coerce_feed
from relational_tensors.errors import ExecError, GraphError, PlanError
from relational_tensors.graph.graph import Tensor
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.machine.target import Target
from relational_tensors.machine.topology import Topology
from relational_tensors.physical.simulate import PlanSimResult
from relational_tensors.runtime import Ranks, executor_for

if TYPE_CHECKING:
    from relational_tensors.driver.state import CompileState

__all__ = ["CompiledGraph"]


class CompiledGraph:
    """A graph with its plan, and the catalog that explains it."""

    def __init__(self, state: CompileState, bind: Mapping[str, Any] | None = None) -> None:
        assert state.plan is not None and state.target is not None
        assert state.lowered is not None and state.live is not None
        self.graph = state.graph
        self.target = state.target
        self.devices = state.target.devices
        self.plan = state.plan
        self._catalog = state.catalog
        self._compilation_id = state.cid
        self._restore: Callable[[], tuple[Catalog, int]] | None = None  # a loaded plan's rows, put in on demand
        self.options = state.options
        self.layouts = state.constraints.layouts  # pinned input or state id -> the (block, device) it is held in
        self.timings = state.timings
        self.search = (state.searched_programs, state.search_timeouts)  # programs searched, stopped by the clock
        self.pieces = state.pieces
        self.lowered = state.lowered
        self.dag = state.lowered.dag
        self.live = state.live
        self._executor: Any = None
        self.ranks: Ranks | None = None  # the process group it runs over, one rank per device (run_on_ranks)
        self._simulations: dict[Any, PlanSimResult] = {}
        self._simulated_issue: Any = None  # how the GPU executor issues the tasks (simulation(), found once)
        self._states: dict[str, np.ndarray] = {}  # host copies of the states no operator assigns
        self._bind = dict(bind or {})  # inputs read in place from these arrays (compileGraph's bind=)
        if self.devices.kind == "cuda" and visible_gpus() > max(self.devices.physical):
            _ = self.executor  # peer access, streams and arenas are set up (and checked) at compile time

    @property
    def p(self) -> int:
        return self.devices.p

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle, torch.save and copy all come here: a live program (its DuckDB catalog connection, the
        # devices' buffers, a process group) is no value to serialize; its plan file is
        raise PlanError("a CompiledGraph cannot be pickled or copied (torch.save pickles it): it holds a live "
                        f"DuckDB catalog connection and the program's buffers on {self.devices}. Save its plan "
                        "with rt.save_plan(cg, path) and rebuild it without planning with rt.load_plan(path, "
                        "graph), giving the graph it was planned for.")

    @property
    def catalog(self) -> Catalog:
        """The catalog that explains this plan (a loaded plan's rows are put into it when first asked for)."""
        if self._restore is not None:
            self._catalog, self._compilation_id = self._restore()
            self._restore = None
        return self._catalog

    @property
    def compilation_id(self) -> int:
        """This plan's id in ``catalog`` (its ``compilations`` row)."""
        _ = self.catalog
        return self._compilation_id

    def sql(self, query: str) -> pa.Table:
        """Run SQL over the catalog; ``plan``, ``specs`` and ``plan_inputs`` show this compilation."""
        self.catalog.narrow(self.compilation_id)
        return self.catalog.sql(query)

    def query(self, name: str, **params: Any) -> pa.Table:
        """A named query from ``sql/queries`` (repartitions, cheapest_candidates, plan_cost, compilations,
        plan_diff, chosen_vs_cheapest, traffic_by_device_pair, time_by_kind, plan_times) over this compilation
        (``$cid`` defaults to its id)."""
        self.catalog.narrow(self.compilation_id)
        return self.catalog.query(name, defaults={"cid": self.compilation_id}, **params)

    def spec(self, op: str) -> Any:
        return self.plan.spec(op)

    # --- execution -----------------------------------------------------------------
    @property
    def executor(self) -> Any:
        """The backend that runs this program here (NumPy virtual devices, CuPy GPUs, or this rank's share
        under ``device="dist"``), made on first use."""
        if self._executor is None:
            self._executor = executor_for(self.devices, self.dag, self.live, self.options.attention, self.ranks,
                                          where=self.target.topology.name, bind=self._bind)
        return self._executor

    def run_on_ranks(self, ranks: Ranks) -> None:
        """Run this program as one rank of ``ranks`` (the distributed path: every rank holds the same plan)."""
        self.ranks = ranks
        self._executor = None
        _ = self.executor

    def _name(self, tensor: Tensor | str, role: str) -> str:
        """The name of a graph tensor given by handle or by name."""
        if isinstance(tensor, Tensor):
            if tensor.graph is not self.graph:
                raise GraphError(f"{role} {tensor.name!r} is a tensor of another graph; pass a tensor of the "
                                 "compiled graph, or its name.")
            return tensor.name
        if isinstance(tensor, str):
            return tensor
        raise GraphError(f"{role} must be a tensor of the graph or its name; got {type(tensor).__name__}.")

    def load(self, feeds: dict[str, Any] | Tensor | str, array: Any = None) -> None:
        """Place graph inputs straight into the blocks the plan needs, on their devices: ``load({name:
        array, ...})``, or ``load(x, array)`` for one input given by handle or name.  A dict's first load
        needs every input; later ones may name only those that change (weights stay loaded); inputs
        loaded one at a time must all be there by ``execute()``."""
        if isinstance(feeds, (Tensor, str)):  # one input: the others may follow before execute
            one = {self._name(feeds, "load's input"): array}
            self.executor.load(one, partial=True)
            self._keep_states(one)
            return
        if not isinstance(feeds, Mapping) or array is not None:
            both = isinstance(feeds, Mapping)  # a dict and an array is a misuse of the API, not of the run
            error = GraphError if both else ExecError
            raise error("load takes a dict of input name -> array, or one tensor (or its name) and one array; "
                        f"got {'a dict and an array' if both else type(feeds).__name__}.")
        self.executor.load(feeds)
        self._keep_states(feeds)

    def load_checkpoint(self, path: str | Path) -> list[str]:
        """Load every graph input that the safetensors checkpoint at ``path`` holds, each process reading
        only the slices of the blocks it keeps (``relational_tensors.driver.checkpoint``); returns the names
        loaded (the others are left for ``load``; bound inputs are not read).  Under ``device="dist"`` every
        rank calls it."""
        from relational_tensors.driver.checkpoint import read_pieces

        ex = self.executor
        wanted = {}
        for name, blocks in self.dag.inputs.items():
            if name in self._bind:  # read in place from the array it was bound to
                continue
            t = self.graph.node(name).type
            boxes = list(dict.fromkeys(box for box, b in blocks if ex._holds(b)))
            if boxes:
                wanted[name] = (t.shape, boxes)
        pieces = read_pieces(path, wanted, getattr(self.graph, "origins", {}))
        ex.load(pieces, partial=True, owned=True)
        self._keep_states(pieces)
        return sorted(pieces)

    def _keep_states(self, feeds: Mapping[str, Any]) -> None:
        """Host copies of the unassigned states loaded (they never change; assigned ones are read back
        from the blocks the devices keep)."""
        from relational_tensors.runtime.numpy_backend import block_pieces

        for name, value in feeds.items():
            node = self.graph.node(name)
            if node.role == "state" and node.id not in self.graph.assignments:
                if block_pieces(name, value, node.type) is None:  # pieces: offload reads the devices' blocks
                    self._states[name] = coerce_feed(name, value, node.type)

    def memory_by_category(self) -> dict[int, dict[str, int]]:
        """Per device, the bytes live at its peak by what they are (``Graph.memory_categories``: parameters,
        optimizer state, inputs, gradients, activations for the backward, optimizer update, other; on GPUs
        the kernels' scratch is "other"): the split the compiler's liveness pass made."""
        return {d: dict(parts) for d, parts in self.live.at_peak.items()}

    def execute(self, phase: int | None = None) -> None:
        """Run the task DAG once (inputs stay loaded; run it again after loading new ones); every
        assigned state (``g.assign``) ends it holding its next value, in the blocks the plan keeps it in
        (``state_layouts()``), on the devices.

        A program compiled with ``second_phase_inputs`` also runs in two phases: ``execute(phase=0)``
        runs every task that needs none of those inputs (its saved outputs can then be offloaded), and
        after they are loaded ``execute(phase=1)`` the rest, reading what the first phase left on the
        devices."""
        self.executor.execute(phase)

    def offload(self, output: Tensor | str, like: str = "numpy", rank: int | None = None) -> Any:
        """The saved output ``output`` (its name, or the saved tensor) as one array (``like="cupy"``
        keeps it on the GPU); a state's name gives its current value, ``<state>.next`` the value the
        last execution assigned it.  A plan run with ``device="dist"`` assembles it on every rank (every
        rank calls offload), or with ``rank=`` on that rank only (the others get None)."""
        name = self._name(output, "offload's output")
        ex = self.executor
        distributed = hasattr(ex, "world")
        if rank is not None and (not distributed or isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < ex.world):
            raise ExecError(f"offload(rank=...) names a rank of a plan run with device='dist' (0..world-1); got "
                            f"rank={rank!r} for a plan on {self.devices}.")
        where = {"rank": rank} if distributed else {"like": like} if self.devices.kind == "cuda" else {}
        if isinstance(output, Tensor) and name not in self.graph.outputs and name not in self.dag.assigned:
            saved = [n for n, i in self.graph.outputs.items() if i == output.id]
            if saved:
                name = saved[0]
        state = self.graph.next_names().get(name)
        if state is not None:  # the value assigned: the state's blocks hold it after the execution
            if not ex.fresh:
                if not ex.runs:
                    raise ExecError("execute the program before offloading results: cg.execute().")
                raise ExecError(STALE_OUTPUTS)
            name = self.graph.nodes[state].name
        if name in self.dag.assigned:
            return ex.state(name, **where)
        if name not in self.graph.outputs and name in self._states:  # an unassigned state: as loaded
            return self._states[name].copy()
        if name not in self.graph.outputs and name in self.dag.inputs and self.graph.node(name).role == "state":
            return ex.state(name, **where)  # loaded in pieces: from the blocks the devices keep
        return ex.offload(name, **where)

    def synchronize(self) -> None:
        """Wait for every device to finish what execute() queued."""
        ex = self.executor
        if hasattr(ex, "synchronize"):
            ex.synchronize()

    def close(self) -> None:
        """Release what running needed: under ``device="dist"``, wait for every rank and tear down the
        process group the compile initialized (a group passed as ``process_group=`` stays up).  Call it on
        every rank, after the last ``offload``."""
        ex = self._executor
        if ex is not None and hasattr(ex, "close"):
            ex.close()

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """load, execute and offload every saved output."""
        self.load(feeds)
        self.execute()
        return {name: self.offload(name) for name in self.graph.outputs}

    def simulate(self, topology: str | Topology | None = None, calibration: str | None = None,
                 record: bool = False) -> float:
        """Predicted seconds for one execution on ``topology`` (default: the one compiled for); with
        ``record``, every task's predicted start and end go into the catalog's ``task_times`` (source
        ``simulated:<topology>``)."""
        return self.simulation(topology, calibration, record).time

    def simulation(self, topology: str | Topology | None = None, calibration: str | None = None,
                   record: bool = False) -> PlanSimResult:
        """The simulated timeline of one execution on ``topology`` (default: the target compiled for,
        with its kernel model; logical devices of one GPU share it there, and stand for GPUs of their own
        on another topology), every task with its predicted start and end.  The first simulation of the
        compiled-for target sets the compilation's ``predicted_seconds``."""
        from relational_tensors.physical.simulate import simulate_plan

        target = self.target if topology is None and calibration is None else Target.on(
            self.devices, self.target.topology if topology is None else topology,
            calibration or (self.options.calibration if topology is None else None))
        shared = target.shared_gpus if topology is None else None
        key = (target.topology, target.kernels.source, shared)
        if key not in self._simulations:
            self._simulations[key] = simulate_plan(self.dag, self.graph, target.topology, target.kernels, shared,
                                                   self._issue())
            if target is self.target and not self.catalog.read_only:
                self.catalog.update_compilation(self.compilation_id, predicted_seconds=self._simulations[key].time)
        result = self._simulations[key]
        if record:
            self._record_times(result, f"simulated:{target.topology.name}")
        return result

    def _issue(self) -> Any:
        """How the executor issues the tasks, for the simulator: on GPUs the fused groups and the tasks it
        does nothing for (``runtime.fusion.simulated_issue``, found once); None on CPU devices."""
        if self.devices.kind != "cuda":
            return None
        if self._simulated_issue is None:
            from relational_tensors.runtime.fusion import simulated_issue

            self._simulated_issue = simulated_issue(self.dag, self.live)
        return self._simulated_issue

    def _record_times(self, result: PlanSimResult, source: str) -> None:
        """A timeline into ``task_times`` (replacing one recorded before from the same source)."""
        from relational_tensors.physical.record import task_time_table

        self.catalog.execute("DELETE FROM task_times WHERE compilation_id = ? AND source = ?",
                             [self.compilation_id, source])
        self.catalog.insert("task_times", task_time_table(result.tasks, lambda t: self.dag.tasks[t].op, source),
                            self.compilation_id)

    def trace(self, path: str, topology: str | None = None, calibration: str | None = None,
              measured: bool | None = None) -> str:
        """Write a Chrome/Perfetto trace; returns the path.  On GPUs with loaded inputs (or
        ``measured=True``) the timeline is measured with CUDA events, else simulated."""
        from relational_tensors.physical.trace import write_trace

        if measured is None:
            measured = self.devices.kind == "cuda" and self._executor is not None and self._executor.loaded
        result = self.profile() if measured else self.simulation(topology, calibration)
        try:
            return str(write_trace(result, path))
        except OSError as e:
            raise ExecError(f"cannot write the trace to {str(path)!r}: {e.strerror or e}. Give a writable path.") from e

    def profile(self, record: bool = False) -> PlanSimResult:
        """Run once on the GPUs with a CUDA event around every task; the measured timeline (with ``record``
        also in the catalog's ``task_times``, source ``measured:<devices>``)."""
        from relational_tensors.physical.simulate import TaskTime

        ex = self.executor
        if not hasattr(ex, "profile"):
            raise ExecError("profile() measures GPU runs; this program runs on virtual CPU devices.")
        times = []
        fused = getattr(ex, "profile_kinds", {})  # a fused group's time, at its last task: its own kind and label
        for tid, start, end in ex.profile():
            t = self.dag.tasks[tid]
            kind, label = fused.get(tid, (t.kind, t.label))
            times.append(TaskTime(tid, kind, label, t.device, t.src_device, start * 1e-3, end * 1e-3,
                                  sum(self.dag.buffers[b].nbytes for b in t.outputs)))
        result = PlanSimResult(max((t.end for t in times), default=0.0), tuple(times), f"measured on {self.devices}")
        if record:
            self._record_times(result, f"measured:{self.devices}")
        return result

    def memory(self) -> dict[int, int]:
        """Peak bytes per device under this plan (loaded inputs included)."""
        return dict(self.live.peak)

    def exchange_programs(self) -> dict[str, str]:
        """Each operator's exchange program (and each saved output's), as ExProg text."""
        from relational_tensors.exchange.text import to_text

        return {name: to_text(prog) for name, prog in self.lowered.programs.items()}

    def constraints(self) -> dict[str, str]:
        """The constraints that reproduce this plan: every operator's chosen split, and the layouts the
        plan was given for graph inputs and states (pass them as
        ``compileGraph(graph, constraints=cg.constraints())``, with the same options)."""
        given = {t: v for t, v in self.options.constraints if self.graph.node(t).id in self.layouts}
        return {**given, **{n.name: self.plan.split(n.id) for n in self.graph.operators}}

    def state_layouts(self) -> list[dict[str, Any]]:
        """How each assigned state is kept on the devices between executions (the catalog's
        ``state_layouts``): ``kept`` is "as read" (the blocks its readers read) or "sharded" (its value's
        blocks, gathered for each reader), with its DTensor-style placement and bytes."""
        from relational_tensors.driver.visualize import kept_layouts

        return kept_layouts(self.graph, self.lowered)

    def explain(self, file: Any = None, width: int = 160) -> str:
        """Print (and return) the plan as a table: op, split, output tiling, placement, costs, repartitions;
        then the states kept between executions, if any."""
        from relational_tensors.driver.visualize import plan_table, state_table

        text = plan_table(self, width=width) + state_table(self, width=width)
        print(text, end="", file=file)
        return text

    def show_tiling(self, tensor: str, width: int = 120, file: Any = None) -> str:
        """Print (and return) which device holds which block of ``tensor`` (an operator, input or saved name)."""
        from relational_tensors.driver.visualize import show_tiling

        text = show_tiling(self, tensor, width)
        print(text, end="", file=file)
        return text

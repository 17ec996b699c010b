"""The physical plan as Arrow tables for the catalog: where every function spec runs, every exchange
program and its actions, every task, the bytes each edge moves between which devices, each device's
peak memory by category, and (on demand) the simulated or measured time of every task.

Built from a lowered plan (``Lowered``) and its liveness, once per compilation by the compiler's
``record`` pass; ``task_times`` when a simulation or a profile is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from relational_tensors.dp_optimizer.pipeline import PipelinedPlan
from relational_tensors.dp_optimizer.plan import LogicalPlan
from relational_tensors.exchange.ast import ExProg, aggregate_text
from relational_tensors.physical.lower import Lowered
from relational_tensors.physical.tasks import Liveness

__all__ = ["physical_tables", "task_time_table", "MEMORY_CATEGORIES"]

# the memory report's categories (Graph.memory_categories), as device_memory's columns
MEMORY_CATEGORIES = ("parameters", "optimizer state", "inputs", "activations for the backward", "gradients",
                     "optimizer update", "other")



def _table(columns: dict[str, tuple[pa.DataType, list[Any]]]) -> pa.Table:
    return pa.table({k: pa.array(v, t) for k, (t, v) in columns.items()})


def _action_rows(prog: ExProg, membership: dict[str, tuple[int, ...]]) -> list[tuple[Any, ...]]:
    """(action, source, destinations, atoms, aggregated, bytes) of every action of ``prog`` at each site it
    fires from, in the order the lowering fires them."""
    sizes = prog.atom_sizes()
    out = []
    ordered = sorted(prog.body, key=lambda a: (aggregate_text(a.aggregate), str(a.source), [str(d) for d in a.dests]))
    for k, act in enumerate(ordered):
        dests = [d for dest in act.dests for d in prog.sites_of(dest, membership)]
        text = aggregate_text(act.aggregate)
        nbytes = max((sizes.get(a, 0) for a in act.aggregate), default=0)
        for source in prog.sites_of(act.source, membership):
            out.append((k, source, dests, text, len(act.aggregate) > 1, nbytes))
    return out


def physical_tables(plan: LogicalPlan, lowered: Lowered, live: Liveness) -> dict[str, pa.Table]:
    """Catalog table name -> its rows (without ``compilation_id``) for one lowered plan (``live`` made
    with memory categories, ``liveness(dag, category=...)``).  The identical layers of a deep model
    share their specs and programs, so each spec's blocks and each program's actions are laid out once."""
    graph = plan.graph
    dag = lowered.dag
    op_of = {n.name: n.id for n in graph.operators}
    out: dict[str, pa.Table] = {}

    blocks: dict[int, tuple[list[str], list[float]]] = {}  # id(spec) -> its output blocks and FLOPs
    specs = []
    place_ops: list[int] = []
    place_index: list[int] = []
    place_device: list[int] = []
    place_block: list[str] = []
    place_flops: list[float] = []
    place_stage: list[int | None] = []
    place_micro: list[int | None] = []
    staged = plan if isinstance(plan, PipelinedPlan) else None
    for op_id, where in sorted(lowered.placement.items()):
        spec = plan.spec(op_id)
        if id(spec) not in blocks:
            specs.append(spec)  # kept alive: its id stays its own
            blocks[id(spec)] = ([str(f.output) for f in spec.functions], [float(f.flops) for f in spec.functions])
        block_texts, flops = blocks[id(spec)]
        place_ops += [op_id] * len(where)
        place_index += range(len(where))
        place_device += where
        place_block += block_texts
        place_flops += flops
        micro = staged.micro_of.get(op_id) if staged is not None else None
        place_stage += [staged.stage_of[op_id] if staged is not None else None] * len(where)
        place_micro += list(micro) if micro is not None else [None] * len(where)
    out["placements"] = _table({"op_id": (pa.int32(), place_ops), "function_index": (pa.int32(), place_index),
                                "device": (pa.int32(), place_device), "output_block": (pa.string(), place_block),
                                "flops": (pa.float64(), place_flops), "stage": (pa.int32(), place_stage),
                                "micro_batch": (pa.int32(), place_micro)})

    from relational_tensors.exchange.text import to_text

    names = list(lowered.programs)
    programs = [lowered.programs[n] for n in names]
    readers = [op_of.get(n) for n in names]
    # the lowering shares one program object (and membership) among the identical layers of a deep
    # model: each is printed and laid out once, by identity
    texts: dict[int, str] = {}
    for prog in programs:
        if id(prog) not in texts:
            texts[id(prog)] = to_text(prog, check=False)  # verified programs of the lowering's own atoms
    out["exchange_programs"] = _table({"program": (pa.string(), names), "op_id": (pa.int32(), readers),
                                       "atoms": (pa.int32(), [len(p.inputs) for p in programs]),
                                       "actions": (pa.int32(), [len(p.body) for p in programs]),
                                       "text": (pa.string(), [texts[id(p)] for p in programs])})
    laid: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    acts: list[tuple[Any, ...]] = []
    for name, prog, reader in zip(names, programs, readers):
        membership = lowered.memberships.get(name, {})
        ids = (id(prog), id(membership))
        if ids not in laid:
            laid[ids] = _action_rows(prog, membership)
        acts += [(name, reader, *row) for row in laid[ids]]
    columns: list[tuple[Any, ...]] = list(zip(*acts)) if acts else [() for _ in range(8)]
    out["exchange_actions"] = _table({
        "program": (pa.string(), list(columns[0])), "op_id": (pa.int32(), list(columns[1])),
        "action": (pa.int32(), list(columns[2])), "source_device": (pa.int32(), list(columns[3])),
        "dest_devices": (pa.list_(pa.int32()), list(columns[4])), "atoms": (pa.string(), list(columns[5])),
        "aggregated": (pa.bool_(), list(columns[6])), "bytes": (pa.int64(), list(columns[7]))})

    nbytes = {b: buf.nbytes for b, buf in dag.buffers.items()}
    tasks = dag.tasks
    waits = dag.producers()
    task_bytes = [sum(nbytes[b] for b in t.outputs) for t in tasks]
    out["tasks"] = _table({
        "task_id": (pa.int32(), [t.id for t in tasks]), "kind": (pa.string(), [t.kind for t in tasks]),
        "op_id": (pa.int32(), [t.op for t in tasks]), "device": (pa.int32(), [t.device for t in tasks]),
        "src_device": (pa.int32(), [t.src_device for t in tasks]), "bytes": (pa.int64(), task_bytes),
        "inputs": (pa.list_(pa.int32()), [list(waits[t.id]) for t in tasks]),
        "label": (pa.string(), [t.label for t in tasks])})
    traffic: dict[tuple[int, int | None, str, int, int], int] = {}
    for t, moved in zip(tasks, task_bytes):
        if t.kind == "copy":
            src = dag.buffers[t.inputs[0]]
            key = (src.tensor, t.op, t.label.split(": ", 1)[0], src.device, t.device)
            traffic[key] = traffic.get(key, 0) + moved
    keys = sorted(traffic, key=lambda k: (k[0], -1 if k[1] is None else k[1], k[2], k[3], k[4]))
    out["edge_traffic"] = _table({
        "producer_tensor": (pa.int32(), [k[0] for k in keys]),
        "producer_op": (pa.int32(), [k[0] if graph.nodes[k[0]].op is not None else None for k in keys]),
        "consumer_op": (pa.int32(), [k[1] for k in keys]),
        "program": (pa.string(), [k[2] for k in keys]),
        "src_device": (pa.int32(), [k[3] for k in keys]),
        "dst_device": (pa.int32(), [k[4] for k in keys]),
        "bytes": (pa.int64(), [traffic[k] for k in keys])})

    devices = sorted(live.peak)
    mem: dict[str, tuple[pa.DataType, list[Any]]] = {
        "device": (pa.int32(), devices),
        "peak_bytes": (pa.int64(), [live.peak[d] for d in devices]),
        "resident_bytes": (pa.int64(), [live.resident.get(d, 0) for d in devices])}
    for c in MEMORY_CATEGORIES:
        mem[c.replace(" ", "_")] = (pa.int64(), [live.at_peak.get(d, {}).get(c, 0) for d in devices])
    out["device_memory"] = _table(mem)
    return out


def task_time_table(times: Sequence[Any], op_of_task: Callable[[int], int | None], source: str) -> pa.Table:
    """``task_times`` rows for a simulated or measured timeline (``PlanSimResult.tasks``)."""
    return _table({"task_id": (pa.int32(), [t.task for t in times]),
                   "op_id": (pa.int32(), [op_of_task(t.task) for t in times]),
                   "device": (pa.int32(), [t.device for t in times]),
                   "kind": (pa.string(), [t.kind for t in times]),
                   "start": (pa.float64(), [t.start for t in times]),
                   "end": (pa.float64(), [t.end for t in times]),
                   "seconds": (pa.float64(), [t.end - t.start for t in times]),
                   "source": (pa.string(), [source] * len(times))})


"""Where an operator's function specs run: the greedy placement of the lowering (``physical.lower``).

Each function spec goes to the device that already holds most of the bytes it reads; ties go to a hint
(the lowering passes one only for an operator none of whose inputs is placed yet), then to the identity.
"""

from __future__ import annotations

import numpy as np

from relational_tensors.core.dtypes import itemsize
from relational_tensors.core.spec import JoinAggSpec
from relational_tensors.core.types import Box
from relational_tensors.dp_optimizer.plan import LogicalPlan

__all__ = ["place"]


def place(plan: LogicalPlan, op_id: int, placement: dict[int, tuple[int, ...]],
          memo: dict | None = None, held: dict[int, tuple[tuple[Box, int], ...]] | None = None,
          hint: tuple[int, ...] | None = None, spec: JoinAggSpec | None = None,
          devices: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Devices for the function specs of ``op_id``: most co-resident input bytes first; on ties ``hint``
    (function spec -> device, the placement of the last operator with the same output blocks), then the
    identity.  ``spec`` places another spec of the operator than the plan's (a pipeline stage's blocks),
    ``devices`` only on those devices (a stage's group; the identity then maps function spec g to the
    group's device g).

    ``held`` gives the (block, device) of inputs that are no operator's output but are kept on the
    devices (sharded states).  ``memo`` caches the answer by the specs and producer placements
    involved, which repeat across the identical layers of a deep model."""
    graph = plan.graph
    node = graph.nodes[op_id]
    spec = plan.spec(op_id) if spec is None else spec
    held = held or {}
    inputs = [(k, tuple((ff.output, w) for ff, w in zip(plan.spec(i).functions, placement[i])))
              if graph.nodes[i].op is not None else (k, held[i])
              for k, i in enumerate(node.inputs) if graph.nodes[i].op is not None or i in held]
    group = tuple(range(plan.p)) if devices is None else tuple(devices)
    key = (spec, tuple(inputs), hint, group)
    if memo is not None and key in memo:
        return memo[key]
    column = {d: c for c, d in enumerate(group)}
    p, devices_n = spec.p, len(group)  # fewer function specs than devices when the operator is too small
    # score[g, d]: bytes of the inputs of function spec g already on device d (integer overlap volumes of
    # every needed block with every held block, on arrays: p x p intersections per input at p = 128)
    score = np.zeros((p, devices_n), dtype=np.int64)
    for k, blocks in inputs:
        blocks = tuple((box, column[d]) for box, d in blocks if d in column)
        if not blocks:
            continue
        width, rank = itemsize(spec.input_types[k].dtype), spec.input_types[k].rank
        need_lo, need_hi = (np.array([getattr(f.inputs[k], side) for f in spec.functions], dtype=np.int64)
                            .reshape(p, rank) for side in ("lower", "upper"))
        held_lo, held_hi = (np.array([getattr(box, side) for box, _ in blocks], dtype=np.int64)
                            .reshape(len(blocks), rank) for side in ("lower", "upper"))
        sides = (np.minimum(need_hi[:, None, :], held_hi[None, :, :])
                 - np.maximum(need_lo[:, None, :], held_lo[None, :, :]))
        overlap = np.prod(np.maximum(sides, 0), axis=2) * width  # [p, blocks]
        np.add.at(score.T, np.array([d for _, d in blocks]), overlap.T)
    gs, ds = np.divmod(np.arange(p * devices_n), devices_n)
    if hint is not None and len(hint) == p:
        hinted = ds != np.asarray([column.get(d, -1) for d in hint], dtype=np.int64)[gs]
    else:
        hinted = ds != gs
    # most co-resident bytes first, then the hint, then the identity (g on device g), then by (g, d)
    order = np.lexsort((ds, gs, gs != ds, hinted, -score.ravel()))
    out: dict[int, int] = {}
    used: set[int] = set()
    for at in order.tolist():
        g, d = divmod(at, devices_n)
        if g not in out and d not in used:
            out[g] = d
            used.add(d)
            if len(out) == p:
                break
    result = tuple(group[out[g]] for g in range(p))
    if memo is not None:
        memo[key] = result
    return result

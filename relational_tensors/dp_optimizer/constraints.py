"""Constraints on a plan: operators' splits and the layouts of graph inputs and states.

A constraint names a node of the graph.  On an operator it fixes the counts of some of its
shardable indices (``"heads_kv=8"``, ``candidate_specs.split``'s notation); the indices not named
stay the optimizer's.  On a graph input, parameter or state it fixes the layout the tensor is held
in on the devices, in DTensor-like notation:

* ``R``: the whole tensor on every device;
* ``S(d)``: dimension ``d`` split into ``p`` near-equal blocks (fewer when it is shorter), block
  ``b`` on device ``b``;
* an explicit tiling, ``dim=n,...`` (a dimension by its name or position): ``n_1·n_2·…`` blocks in
  row-major order, each held by ``p // blocks`` devices (block ``b`` on devices ``b``, ``b + blocks``,
  …), the DTensor placement ``[R, S(d)]`` over a two-axis mesh.

A pinned tensor is served to its readers from those blocks by exchange programs, like an
operator's output, and its readers' specs pay for the move (:func:`layout_prices`); an assigned
state so pinned also keeps its value in those blocks, and the operator that makes the value pays
for writing it there.  ``P(sum)`` describes partial results of an operator, not a tensor loaded
from the host, so it is refused for inputs and states.

>>> from relational_tensors.core.types import TensorType
>>> t = TensorType.zero((6, 4), "float32", ("rows", "cols"))
>>> [(str(b), d) for b, d in parse_layout("x", t, "S(0)", 3)]
[('[0,2)x[0,4)', 0), ('[2,4)x[0,4)', 1), ('[4,6)x[0,4)', 2)]
>>> [(str(b), d) for b, d in parse_layout("x", t, "cols=2", 4)]
[('[0,6)x[0,2)', 0), ('[0,6)x[2,4)', 1), ('[0,6)x[0,2)', 2), ('[0,6)x[2,4)', 3)]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from relational_tensors.core.spec import ShardableIndex
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError

__all__ = ["Constraints", "Held", "parse_constraints", "parse_layout", "layout_kind"]

Held = tuple[tuple[Box, int], ...]  # (block, device) of each copy a pinned tensor is held in

# ASCII digits only: str.isdigit() takes "²" and "٣", which int() then refuses or reads as 3
_COUNT = re.compile(r"[0-9]+")
_POSITION = re.compile(r"-?[0-9]+")
_SHARD = re.compile(r"^S\((-?[0-9]+)\)$")
_PARTIAL = re.compile(r"^P\((\w*)\)$")


@dataclass(frozen=True)
class Constraints:
    """The parsed constraints of one compilation."""

    splits: dict[int, dict[str, int]] = field(default_factory=dict)  # operator id -> index -> count
    layouts: dict[int, Held] = field(default_factory=dict)           # input or state id -> its blocks
    kinds: dict[str, str] = field(default_factory=dict)              # target name -> "split" or "layout"


def layout_kind(value: str) -> str:
    """``replicated``, ``sharded`` or ``tiled``: how a layout string reads (before it is checked)."""
    text = value.replace(" ", "")
    return "replicated" if text == "R" else "sharded" if _SHARD.match(text) else "tiled"


def parse_layout(name: str, t: TensorType, value: str, p: int) -> Held:
    """The (block, device) copies ``value`` holds tensor ``name`` of type ``t`` in on ``p`` devices."""
    text = str(value).replace(" ", "")
    space = t.box
    hint = (f"write R (whole on every device), S(d) for d in 0..{t.rank - 1} (split over the devices), or a "
            f"tiling such as {t.names[0] if t.rank else 'dim'}=2 over its dimensions "
            f"({', '.join(f'{n}={s}' for n, s in zip(t.names, t.shape)) or 'none: it is a scalar'})")
    if text == "R":
        return tuple((space, d) for d in range(p))
    if _PARTIAL.match(text):
        raise GraphError(f"{name!r} is a graph input or state, loaded whole-valued: {text} describes partial "
                         f"results of an operator, not a layout it can be held in; {hint}.")
    counts = [1] * t.rank
    shard = _SHARD.match(text)
    if shard:
        d = int(shard.group(1))
        if not -t.rank <= d < t.rank:
            raise GraphError(f"a layout of {name!r} (rank {t.rank}) names dimension {d} in {value!r}; {hint}.")
        d %= t.rank
        counts[d] = min(p, t.shape[d])
    else:
        named: dict[int, str] = {}
        for part in text.split(","):
            key, sep, count = part.partition("=")
            dim = t.names.index(key) if key in t.names else int(key) if _POSITION.fullmatch(key) else None
            if not sep or dim is None or not -t.rank <= dim < t.rank or not _COUNT.fullmatch(count) or int(count) < 1:
                raise GraphError(f"a layout of {name!r} is R, S(d) or dim=n,...; got {value!r}; {hint}.")
            dim %= t.rank
            if dim in named:
                raise GraphError(f"a layout of {name!r} gives each dimension one count; got {value!r}, which names "
                                 f"dimension {dim} ({t.names[dim]}) twice ({named[dim]} and {part}); keep one.")
            named[dim] = part
            counts[dim] = int(count)
    blocks = 1
    for c in counts:
        blocks *= c
    if blocks > p:
        raise GraphError(f"the layout {value!r} of {name!r} has {blocks} blocks, more than the {p} devices; "
                         f"{hint}.")
    per_dim = []
    for d, c in enumerate(counts):
        ivs = ShardableIndex(t.names[d], t.shape[d]).near_equal(c)
        if ivs is None:
            raise GraphError(f"the layout {value!r} of {name!r} splits dimension {d} (extent {t.shape[d]}) into "
                             f"{c} blocks, more than its extent; {hint}.")
        per_dim.append(ivs)
    boxes = [Box.from_intervals(ivs) for ivs in itertools.product(*per_dim)]
    copies = p // blocks
    return tuple((box, b + blocks * r) for r in range(copies) for b, box in enumerate(boxes))


def parse_constraints(nodes: Sequence, pairs: Sequence[tuple[str, str]], p: int) -> Constraints:
    """``pairs`` (target name, value) checked against the graph's ``nodes``: a split for an operator, a
    layout for a graph input, parameter or state."""
    out = Constraints()
    by_name = {n.name: n for n in nodes}
    seen: dict[str, str] = {}
    for target, value in pairs:
        if target in seen:
            raise GraphError(f"a node takes one constraint; {target!r} got two, {seen[target]!r} and {value!r}; "
                             f"keep the one you mean.")
        seen[target] = value
        node = by_name.get(target)
        if node is None:
            ops = [n.name for n in nodes if n.op is not None][:6]
            leaves = [n.name for n in nodes if n.op is None][:4]
            raise GraphError(f"constraints name operators, graph inputs or states of the graph; {target!r} is "
                             f"none (operators: {', '.join(ops)}, ...; inputs: {', '.join(leaves)}, ...).")
        if node.op is None:
            out.layouts[node.id] = parse_layout(target, node.type, value, p)
            out.kinds[target] = "layout"
            continue
        indices = {x.name: x.extent for x in node.op.requestable()}
        want: dict[str, int] = {}
        for part in str(value).replace(" ", "").split(","):
            key, sep, count = part.partition("=")
            if not sep or key not in indices or not _COUNT.fullmatch(count) or int(count) < 1:
                raise GraphError(f"a constraint on {target!r} is idx=n,... over its shardable indices "
                                 f"({', '.join(f'{k}={v}' for k, v in indices.items()) or 'none'}); got {value!r}.")
            if key in want:
                raise GraphError(f"a constraint on {target!r} gives each index one count; got {value!r}, which "
                                 f"names {key!r} twice; keep one.")
            want[key] = int(count)
        out.splits[node.id] = want
        out.kinds[target] = "split"
    return out

"""Reverse-mode automatic differentiation over a ``Graph``.

``vjp`` walks the graph backwards from the outputs, from the last node to the first (node ids are a
topological order), and asks each operator on a path from a differentiated tensor to an output for the
gradients of its inputs (``Operator.vjp``, declared in the operator's own module).  The gradient
operators are appended to the same graph, so the planner lays out forward and backward together.  A
tensor read by several operators gets the sum of their gradients.

Only floating tensors carry gradients; integer tensors (ids, targets) are never differentiated.  A
tensor asked for that no output depends on is refused, unless ``allow_unused=True``, which gives it zeros
(torch's ``allow_unused`` gives None; a zero tensor can be saved and planned like any other).
"""

from __future__ import annotations

from typing import Any

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.grad import add_all, build

__all__ = ["vjp", "grad", "flows"]

# ``g`` below is a graph.graph.Graph and the tensors its Tensors (this module is imported by graph.py)


def _tensors(g: Any, what: str, xs: object) -> list[Any]:
    items = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    if not items or any(getattr(t, "graph", None) is not g for t in items):
        raise GraphError(f"{what} must be a tensor of this graph or a non-empty list of them; got {xs!r}.")
    return items


def _check_flag(allow_unused: object) -> None:
    if not isinstance(allow_unused, bool):  # a truthy string would quietly give zeros
        raise GraphError(f"allow_unused is True (zero gradients for tensors no output depends on) or False; got "
                         f"{allow_unused!r}.")


def vjp(g: Any, outputs: object, cotangents: object, wrt: object, allow_unused: bool = False) -> list[Any]:
    """The gradients with respect to ``wrt`` of ``Σ_i <outputs[i], cotangents[i]>``, appended to ``g``."""
    _check_flag(allow_unused)
    outs = _tensors(g, "outputs", outputs)
    cots = _tensors(g, "cotangents", cotangents)
    targets = _tensors(g, "wrt", wrt)
    if len(outs) != len(cots):
        raise GraphError(f"vjp needs one cotangent per output; got {len(outs)} outputs and {len(cots)} cotangents.")
    for o, c in zip(outs, cots):
        if o.type.shape != c.type.shape or o.type.dtype != c.type.dtype:
            raise GraphError(f"a cotangent must have its output's shape and dtype; output {o.name!r} is {o.type}, "
                             f"its cotangent {c.name!r} is {c.type}.")
    for t in (*outs, *targets):
        if t.type.dtype not in FLOAT_DTYPES:
            raise GraphError(f"only floating tensors have gradients; {t.name!r} is {t.type}.")
    if len({t.id for t in targets}) != len(targets):
        raise GraphError(f"wrt names a tensor twice: {[t.name for t in targets]}.")

    nodes = g.nodes[: max(t.id for t in (*outs, *targets)) + 1]
    needed = _needed(nodes, targets, outs)

    clones: dict[int, Any] = {}  # operators of g.recompute() regions, made again for the backward
    regions: dict[int, int] = g.recomputed
    readers = g.consumers() if regions else {}
    outputs = set(g.outputs.values())

    def reread(i: int) -> Any:
        """Tensor ``i`` as the backward reads it: recomputed from its region's inputs if it was made inside
        a ``g.recompute()`` region (not one of the region's outputs, the checkpoints, which are kept), else
        the forward's own."""
        region = regions.get(i)
        if region is None or i in outputs or any(regions.get(c) != region for c in readers[i] if c < len(nodes)):
            return g.tensor(i)
        if i not in clones:
            node = g.nodes[i]
            operands = [reread(j) for j in node.inputs]
            scope, g.name_scope = g.name_scope, "recompute."
            try:
                clones[i] = g.apply(node.op, *operands)
            finally:
                g.name_scope = scope
        return clones[i]

    parts: dict[int, list[Any]] = {}
    for o, c in zip(outs, cots):
        parts.setdefault(o.id, []).append(c)
    grads: dict[int, Any] = {}
    for n in reversed(nodes):
        if n.id not in needed or n.id not in parts:
            continue
        scope, g.name_scope = g.name_scope, f"grad.{n.name}."  # the gradient's nodes are named after n
        try:
            total = add_all(g, parts.pop(n.id))
            grads[n.id] = total
            wanted = tuple(i in needed for i in n.inputs)
            if n.op is None or not any(wanted):
                continue
            inputs = tuple(reread(i) for i in n.inputs)
            try:
                got = n.op.vjp(g, inputs, reread(n.id), total, wanted)
            except GraphError as e:  # say which node, and where a traced module computes it
                where = getattr(g, "source", {}).get(n.name)
                raise GraphError(f"cannot differentiate {n.name!r}: {e}" + (f" (at {where})" if where else "")) \
                    from None
        finally:
            g.name_scope = scope
        for i, w, d in zip(n.inputs, wanted, got):
            if w and d is not None:
                if d.type.shape != g.nodes[i].type.shape:
                    raise AssertionError(f"{n.op.kind} gave a gradient of shape {d.type.shape} for an input of "
                                         f"shape {g.nodes[i].type.shape}")
                parts.setdefault(i, []).append(d)

    result = []
    for t in targets:
        if t.id in grads:
            result.append(grads[t.id])
        elif allow_unused:
            result.append(build(g, "unary", (t,), op="fill", arg=0.0))
        else:
            raise GraphError(
                f"no output depends on {t.name!r} through a differentiable path, so it has no gradient; remove it "
                "from wrt, or pass allow_unused=True for a zero gradient."
            )
    return result


def _needed(nodes: list[Any], targets: list[Any], outs: list[Any]) -> set[int]:
    """The tensors a gradient flows through: floating, reached from some wrt tensor, and reaching some output."""
    reached = {t.id for t in targets}
    for n in nodes:
        if n.id not in reached and n.type.dtype in FLOAT_DTYPES and any(i in reached for i in n.inputs):
            reached.add(n.id)
    # back from the outputs through reached tensors only: a path that passes an integer (a histogram's bin
    # ids) carries no gradient
    live = {o.id for o in outs if o.id in reached}
    for n in reversed(nodes):
        if n.id in live:
            live.update(i for i in n.inputs if i in reached)
    return live


def flows(g: Any, outputs: object, wrt: object) -> list[bool]:
    """Per tensor of ``wrt``: whether some output depends on it through floating tensors, so that it has a
    gradient (torch gives the others ``None``)."""
    outs = _tensors(g, "outputs", outputs)
    targets = _tensors(g, "wrt", wrt)
    nodes = g.nodes[: max(t.id for t in (*outs, *targets)) + 1]
    needed = _needed(nodes, targets, outs)
    fed = {i for n in nodes if n.id in needed and n.op is not None for i in n.inputs} | {o.id for o in outs}
    return [t.id in needed and t.id in fed and t.type.dtype in FLOAT_DTYPES for t in targets]


def grad(g: Any, loss: object, wrt: object, allow_unused: bool = False) -> list[Any]:
    """The gradients of the scalar ``loss`` (a tensor of one element) with respect to each of ``wrt``."""
    _check_flag(allow_unused)  # before the seed is appended: a refused call leaves g as it was
    if isinstance(loss, (list, tuple)):
        raise GraphError(f"grad takes one scalar loss tensor; got {loss!r}. Use g.vjp for several outputs.")
    (out,) = _tensors(g, "loss", loss)
    if out.type.volume != 1:
        raise GraphError(f"grad needs a scalar loss (one element); {out.name!r} has shape {out.type.shape}. Reduce it "
                         "first (g.sum, g.mean), or use g.vjp(outputs, cotangents, wrt).")
    t = out.type
    seed = build(g, "full", (), shape=tuple(t.shape), value=1.0, dtype=t.dtype, names=tuple(t.names))
    return vjp(g, [out], [seed], wrt, allow_unused)

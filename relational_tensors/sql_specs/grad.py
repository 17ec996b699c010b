"""What an operator's vector-Jacobian product builds with, and the helpers the rules share.

An operator's ``vjp`` appends graph operators that compute the gradient of each wanted input from
the gradient of its output (the cotangent).  It sees the graph only through :class:`Builder`, which
appends one abstract operator applied to earlier tensors, so the operator modules never import the
frontend.  Helpers here build operators by kind from the registry (``OPERATORS``), which keeps the
operator modules free of imports of each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import OPERATORS, Builder, Grads, Handle

__all__ = ["build", "reduce_to", "expand_to", "reshape_to", "add_all", "not_differentiable", "einsum_grads",
           "index_letters", "SECOND_ORDER"]

# the ``gradient`` of a gradient operator: why it has none
SECOND_ORDER = "a gradient operator (second derivatives are not built)"


def build(b: Builder, kind: str, operands: Sequence[Handle], **params: Any) -> Any:
    """Append the operator ``kind`` with ``params`` applied to ``operands``."""
    op = OPERATORS[kind](tuple(t.type for t in operands), **params)  # type: ignore[call-arg]
    return b.apply(op, *operands)


def not_differentiable(kind: str, why: str) -> GraphError:
    return GraphError(f"{kind} has no gradient: {why}.")


def reshape_to(b: Builder, x: Handle, t: TensorType) -> Any:
    """``x`` reshaped to the shape of ``t`` (nothing appended when it already has it)."""
    if x.type.shape == t.shape:
        return x
    return build(b, "reshape", (x,), shape=tuple(t.shape))


def reduce_to(b: Builder, dy: Handle, t: TensorType) -> Any:
    """The gradient ``dy`` of a broadcast result, summed back to the shape of the operand ``t``:
    over the leading dimensions ``t`` lacks and the dimensions where ``t`` has size 1."""
    full = dy.type.shape
    lead = len(full) - t.rank
    axes = [d for d in range(len(full)) if d < lead or (t.shape[d - lead] == 1 and full[d] != 1)]
    out = build(b, "reduce", (dy,), op="sum", axes=tuple(axes), keepdims=True) if axes else dy
    return reshape_to(b, out, t)


def expand_to(b: Builder, x: Handle, t: TensorType) -> Any:
    """``x`` (of ``t``'s rank, size 1 where it is broadcast) repeated to the shape of ``t``."""
    if x.type.shape == t.shape:
        return x
    return build(b, "expand", (x,), shape=tuple(t.shape))


def add_all(b: Builder, parts: Sequence[Handle]) -> Any:
    """The sum of ``parts`` (gradients of one tensor used several times), as a balanced tree of adds."""
    parts = list(parts)
    while len(parts) > 1:
        nxt = [build(b, "binary", (x, y), op="add") for x, y in zip(parts[::2], parts[1::2])]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def index_letters(dims: Sequence[Sequence[str | None]]) -> dict[str, str]:
    """A distinct einsum letter per index name, in order of appearance (index names such as ``b0`` or
    ``experts`` are not letters): what ``numpy.einsum`` and its kin read."""
    names: dict[str, None] = {}
    for d in dims:
        for n in d:
            if n is None:
                raise GraphError("an einsum gradient needs every dimension named; got a broadcast dimension.")
            names.setdefault(n)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if len(names) > len(alphabet):
        raise GraphError(f"an einsum takes at most {len(alphabet)} indices; got {len(names)}.")
    return dict(zip(names, alphabet))


def _spec(ins: Sequence[Sequence[str]], out: Sequence[str], named: bool) -> str:
    """An einsum spec: letters joined, or names separated by spaces."""
    if named:
        return ", ".join(" ".join(part) for part in ins) + " -> " + " ".join(out)
    return ",".join("".join(part) for part in ins) + "->" + "".join(out)


def einsum_grads(kind: str, b: Builder, dims_in: Sequence[Sequence[str]], dims_out: Sequence[str],
                 inputs: Sequence[Handle], cotangent: Handle, wanted: Sequence[bool], named: bool = False) -> Grads:
    """The gradients of a sum of products ``out[O] = Σ Π_k x_k[L_k]``: for operand k, the einsum of the
    cotangent with the other operands onto ``L_k``, repeated along the indices only ``x_k`` has.  ``named``:
    the gradients' einsums keep the index names (an einsum written with names), else they take letters."""
    if named:
        for d in [*dims_in, dims_out]:
            if any(n is None for n in d):
                raise GraphError("an einsum gradient needs every dimension named; got a broadcast dimension.")
        letters = {n: n for d in [*dims_in, dims_out] for n in d}
    else:
        letters = index_letters([*dims_in, dims_out])
    subs = [tuple(letters[n] for n in d) for d in dims_in]
    out_sub = tuple(letters[n] for n in dims_out)
    grads: list[Any] = []
    for k, (sub, x) in enumerate(zip(subs, inputs)):
        if not wanted[k]:
            grads.append(None)
            continue
        if len(set(sub)) != len(sub):
            shown = " ".join(sub) if named else "".join(sub)
            raise not_differentiable(kind, f"operand {k} repeats an index ({shown!r}, a diagonal); its gradient "
                                     "would write a diagonal. Write the repeated index as two indices")
        others = [(s, t) for j, (s, t) in enumerate(zip(subs, inputs)) if j != k]
        present = set(out_sub).union(*(set(s) for s, _ in others))
        kept = tuple(c for c in sub if c in present)
        spec = _spec([out_sub, *(s for s, _ in others)], kept, named)
        g = build(b, "einsum", (cotangent, *(t for _, t in others)), subscripts=spec)
        if kept != sub:  # indices only this operand has: the gradient is the same along them
            shape = tuple(n if c in present else 1 for c, n in zip(sub, x.type.shape))
            g = expand_to(b, reshape_to(b, g, x.type.with_(shape=shape)), x.type)
        grads.append(g)
    return tuple(grads)

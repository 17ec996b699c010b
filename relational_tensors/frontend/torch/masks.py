"""Attention masks read as the structure attention's specs exploit, and what is left as mask inputs.

SDPA takes one ``attn_mask``: boolean (True where a query may see a key) or float (added to the scaled
scores).  Models build it from constants (a causal triangle, a sliding window, packed-sequence blocks,
T5's relative position bias) and from their inputs (HF's ``attention_mask`` of real tokens), joined by
``&`` or ``+``, broadcast and expanded.  :func:`attention_form` takes it apart:

* the constant part, uniform over batch and heads, is matched against every (causal alignment,
  packed sequences, window) the attention operator knows, by building each candidate with the
  operator's own key ranges; a match becomes those options, so query blocks read only their keys;
* a boolean factor of the inputs that varies only along batch and keys becomes ``key_padding``;
* what remains becomes a ``mask`` (boolean) or ``bias`` (float) input, exact but without structure.

A float mask's blocked entries are -inf or at most half the dtype's lowest value (HF fills with
``finfo.min``); those become structure, and the finite rest a bias.  A row whose every key is blocked
then gives 0 (SDPA's fused kernels), where HF's ``finfo.min`` fill gives the mean of the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from relational_tensors.core.types import TensorType
from relational_tensors.frontend.torch.common import _Const, _op_name, _packet
from relational_tensors.frontend.torch.convert import _torch, _torch_dtype, host
from relational_tensors.graph.graph import Tensor
from relational_tensors.sql_specs.attention import AttentionOp

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator

__all__ = ["AttentionForm", "attention_form", "constant_structure", "host"]


@dataclass
class AttentionForm:
    """The keyword arguments of ``Graph.attention`` a mask becomes."""

    causal: bool | str = False
    seq_ends: tuple[int, ...] | None = None
    window: int | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)  # key_padding, mask, bias

    def kwargs(self) -> dict[str, Any]:
        return dict(causal=self.causal, seq_ends=self.seq_ends, window=self.window, **self.extra)


def visible(sq: int, skv: int, causal: bool | str, ends: tuple[int, ...] | None, window: int | None) -> np.ndarray:
    """[sq, skv]: where the attention operator with these options lets a query see a key."""
    q, k = TensorType.zero((1, sq, 1, 1)), TensorType.zero((1, skv, 1, 1))
    op = AttentionOp((q, k, k), causal, ends, None, window)
    lo, hi = op._key_limits(np.arange(sq))
    cols = np.arange(skv)
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


def _packed_ends(allowed: np.ndarray) -> tuple[int, ...] | None:
    """The sequence ends of a block-diagonal pattern (each row's first visible key starts its block)."""
    sq = allowed.shape[0]
    if allowed.shape[1] != sq or not allowed.any(axis=1).all():
        return None
    starts = allowed.argmax(axis=1)
    ends = sorted({int(s) for s in starts} - {0}) + [sq]
    return tuple(ends) if len(ends) > 1 else None


def constant_structure(allowed: np.ndarray) -> tuple[bool | str, tuple[int, ...] | None, int | None] | None:
    """(causal, seq_ends, window) whose visibility is exactly ``allowed`` [sq, skv], or None.

    >>> tri = np.tril(np.ones((6, 6), bool))
    >>> constant_structure(tri), constant_structure(tri & ~np.tril(tri, -3))
    ((True, None, None), (True, None, 3))
    """
    sq, skv = allowed.shape
    if allowed.all():
        return (False, None, None)
    modes: list[bool | str] = [False, True] if sq == skv else [False, "top_left", "bottom_right"]
    ends_options = [None] + ([e] if (e := _packed_ends(allowed)) is not None else [])
    rows, cols = np.nonzero(allowed)
    for causal in modes:
        offset = skv - sq if causal == "bottom_right" else 0
        dist = np.abs(rows + offset - cols)
        windows = [None] + ([int(dist.max()) + 1] if dist.size else [])
        for ends in ends_options:
            for window in windows:
                if np.array_equal(visible(sq, skv, causal, ends, window), allowed):
                    return (causal, ends, window)
    return None


def _factors(tr: _Translator, node: Any, op: str) -> list[Any]:
    """The operands of a tree of ``op`` (``and`` of booleans, ``add`` of floats) under broadcasts."""
    if not hasattr(node, "meta"):
        return [node]
    packet = _packet(node)
    if packet in ("expand", "expand_as", "contiguous", "clone", "alias", "lift_fresh_copy"):
        return _factors(tr, node.args[0], op)
    if op == "and" and packet in ("__and__", "logical_and", "bitwise_and"):
        return _factors(tr, node.args[0], op) + _factors(tr, node.args[1], op)
    if op == "add" and _op_name(node) == "aten.add.Tensor" and node.kwargs.get("alpha", 1) == 1 \
            and all(hasattr(x, "meta") for x in node.args[:2]):
        return _factors(tr, node.args[0], op) + _factors(tr, node.args[1], op)
    return [node]


def _rank4(shape: tuple[int, ...], qrank: int) -> tuple[int, ...]:
    """A mask's shape broadcast against queries of rank ``qrank`` as [batch, heads, sq, skv]."""
    shape = (1,) * (qrank - len(shape)) + tuple(shape)
    return shape if qrank == 4 else (shape[0], 1, *shape[1:])


def attention_form(tr: _Translator, mask: Any, mask_node: Any, batch: int, heads: int, sq: int, skv: int,
                   dtype: str, qrank: int = 4) -> AttentionForm:
    """What SDPA's ``attn_mask`` (its value ``mask``, its fx node ``mask_node``) becomes, for queries
    [batch, heads, sq] (of rank ``qrank``: 3 without a heads axis) and skv keys computed in ``dtype``."""
    torch = _torch()
    form = AttentionForm()
    if mask is None:
        return form
    is_bool = (mask.value.dtype == torch.bool) if isinstance(mask, _Const) else mask.dtype == "bool"
    leaves = _factors(tr, mask_node, "and" if is_bool else "add") if mask_node is not None else [mask]
    constant: Any = None
    runtime: list[Tensor] = []
    for leaf in leaves:
        value = tr._arg(leaf) if hasattr(leaf, "meta") else leaf
        if isinstance(value, _Const) and value.live:  # a trained parameter (a learned bias): computed
            value = tr.sym(value)
        if isinstance(value, _Const):
            v = host(value.value)
            if is_bool:
                constant = v if constant is None else constant & v
            else:
                constant = v.to(torch.float64) if constant is None else constant + v.to(torch.float64)
        else:
            runtime.append(value)
    if constant is not None:
        _constant_part(tr, form, constant.reshape(_rank4(tuple(constant.shape), qrank)), is_bool, sq, skv, dtype)
    for t in runtime:
        _runtime_part(tr, form, tr.reshape(t, _rank4(t.shape, qrank)), is_bool, batch, sq, skv, dtype)
    return form


def _constant_part(tr: _Translator, form: AttentionForm, full: Any, is_bool: bool, sq: int, skv: int,
                   dtype: str) -> None:
    torch = _torch()
    if is_bool:
        allowed, bias = full, None
    else:
        lowest = torch.finfo(_torch_dtype(dtype)).min  # SDPA's float mask is in the queries' dtype
        blocked = torch.isneginf(full) | (full <= lowest / 2)
        allowed, bias = ~blocked, torch.where(blocked, torch.zeros(()), full)
    flat = allowed.broadcast_to((*allowed.shape[:2], sq, skv)).reshape(-1, sq, skv)
    first = flat[0]
    structure = constant_structure(host(first).numpy()) if bool((flat == first).all()) else None
    if structure is not None:
        form.causal, form.seq_ends, form.window = structure
    else:  # exact, without structure: a boolean mask input
        shape = tuple(allowed.shape[:2]) + (sq, skv)
        form.extra["mask"] = tr.materialize(_Const(allowed.broadcast_to(shape).contiguous(), None,
                                                   f"{tr.prefix}.mask"), "bool")
    if bias is not None and bool((bias != 0).any()):
        shape = tuple(bias.shape[:2]) + (sq, skv)
        b = tr.materialize(_Const(bias.broadcast_to(shape).contiguous(), None, f"{tr.prefix}.bias"), dtype)
        form.extra["bias"] = b


def _runtime_part(tr: _Translator, form: AttentionForm, t: Tensor, is_bool: bool, batch: int, sq: int, skv: int,
                  dtype: str) -> None:
    shape = t.shape
    for axis, want in ((2, sq), (3, skv)):  # the operator's masks have whole query and key axes
        if shape[axis] != want and not (is_bool and axis == 2 and shape[1] == 1):
            t = tr.repeat(t, axis, want)
    if not is_bool:  # an additive mask computed from the inputs: exactly SDPA's float mask, as a bias
        t = tr.cast(t, dtype)
        form.extra["bias"] = tr.binary(form.extra["bias"], t, "add") if "bias" in form.extra else t
        return
    t = tr.cast(t, "bool")
    if shape[1:3] == (1, 1) and shape[3] == skv:  # varies along batch and keys only: key padding
        pad = tr.reshape(t, (shape[0], skv))
        pad = tr.repeat(pad, 0, batch) if shape[0] != batch else pad
        old = form.extra.get("key_padding")
        form.extra["key_padding"] = pad if old is None else tr.binary(old, pad, "logical_and")
        return
    old = form.extra.get("mask")
    form.extra["mask"] = t if old is None else tr.binary(old, t, "logical_and")

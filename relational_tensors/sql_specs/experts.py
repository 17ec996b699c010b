"""Sparse expert computation: the routed pairs sorted by expert, and products over each expert's rows.

A mixture-of-experts layer routes each token to ``k`` experts: ``ids[t, j]`` is the ``j``-th expert of token
``t``.  Computed densely, every token goes through every expert (``experts / k`` times the FLOPs the routing
asks for).  Here the ``P = tokens · k`` routed pairs are laid out as the rows of one buffer sorted by
expert (stable: token order, then rank), as grouped-GEMM MoE implementations lay them out, and each row
is multiplied by its own expert's weights only.

* ``route_index(ids, experts, what)`` makes the integer maps of that layout from the router's choices:
  ``"token"`` (``[P]``: the token each sorted row holds),
  ``"dest"`` (``[t, k]``: the sorted row of each pair, the inverse map) and ``"group"`` (``[P]``: each
  sorted row's expert).  A counting sort over all pairs: the pairs and rows stay whole.
* ``grouped_matmul(xs[P, h], w[e, h, f], group[P]) -> [P, f]``: row ``p`` times ``w[group[p]]``.  As a
  join of rows with experts on ``group[p] = e`` it splits rows, ``h`` (⊕ = sum) and ``f`` anywhere, and
  the experts too (⊕ = sum): a block of experts ``[e0, e1)`` computes the rows routed there and zeros
  elsewhere, which is expert parallelism (the sum over expert blocks is the combine's exchange).
  ``trans_w`` reads ``w`` as ``[e, f, h]`` (the data gradient's product, without a transposed copy).
* ``grouped_weight_grad(xs[P, h], dy[P, f], group[P], experts) -> [e, h, f]``: expert ``e``'s weight
  gradient, the sum over its rows of ``xs[p]ᵀ dy[p]``; rows split with ⊕ = sum, experts, ``h`` and ``f``
  anywhere.

The maps are made on the device from the router's output, so no count reaches the host and the
buffers' sizes (``P`` rows) are static: the plan and the captured graph hold for any routing.  The cost
model prices a block of experts by the share of the rows it is expected to get: uniform routing, or the
``routing`` hint (each expert's share of the routed pairs, a measured histogram) the products carry, which
the catalog's ``operators.params`` shows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.numbers import is_number
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import positive_count
from relational_tensors.sql_specs.grad import build

__all__ = ["RouteIndexOp", "GroupedMatmulOp", "GroupedWeightGradOp", "CapacityRouteOp", "RoutedGatherOp", "route_maps",
           "capacity_maps", "check_routing", "ROUTE_MAPS", "CAPACITY_MAPS"]

ROUTE_MAPS = ("token", "dest", "group")


def route_maps(ids: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token, dest, group) of the router's choices ``ids[t, k]`` (see the module docstring).  An id
    outside ``[0, experts)`` (a dropped pair's sentinel) sorts after every expert and gets group
    ``experts``, which no expert's rows hold."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    key = np.where((flat >= 0) & (flat < experts), flat, experts)
    source = np.argsort(key, kind="stable").astype(np.int64)
    dest = np.empty_like(source)
    dest[source] = np.arange(source.size, dtype=np.int64)
    k = np.shape(ids)[1] if np.ndim(ids) == 2 else 1
    return source // k, dest.reshape(np.shape(ids)), key[source]


@register
@dataclass(frozen=True, eq=True)
class RouteIndexOp(IndexedOp):
    """``route_index(ids[t, k], experts, what) -> int64``: the sorted layout's ``token [t·k]``,
    ``dest [t, k]`` or ``group [t·k]`` (see the module docstring).

    >>> from relational_tensors.core.types import TensorType as T
    >>> RouteIndexOp((T.zero((6, 2), "int64"),), 4, "token").signature()
    'tokens k -> rows'
    """

    kind = "route_index"
    experts: int = 1
    what: str = "token"
    gradient = "its input and output are integer ids"

    def infer(self) -> TensorType:
        (ids,) = self.input_types
        if ids.dtype not in ("int32", "int64") or ids.rank != 2:
            raise GraphError(f"route_index takes the router's choices, int ids of shape [tokens, k]; got {ids}.")
        positive_count("route_index's number of experts", self.experts)
        if self.what not in ROUTE_MAPS:
            raise GraphError(f"route_index makes one of {ROUTE_MAPS}; got what={self.what!r}.")
        if self.what == "dest":
            return TensorType.zero(ids.shape, "int64", ids.names)
        return TensorType.zero((ids.shape[0] * ids.shape[1],), "int64", ("rows",))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (("tokens", "k"),)

    def dims_out(self) -> tuple[str | None, ...]:
        return ("tokens", "k") if self.what == "dest" else ("rows",)

    def unshardable(self) -> frozenset[str]:
        return frozenset({"tokens", "k", "rows"})  # a sort over every pair

    def params(self) -> dict[str, object]:
        return {"experts": self.experts, "what": self.what}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(inputs[0].volume * max(1, int(np.log2(max(inputs[0].volume, 2)))))

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        token, dest, group = route_maps(blocks[0], self.experts)
        return {"token": token, "dest": dest, "group": group}[self.what]


def check_routing(kind: str, routing: Any, experts: int) -> tuple[float, ...] | None:
    """A routing hint as a tuple of floats, refused unless it is one finite non-negative share per expert,
    not all zero (None: uniform routing)."""
    if routing is None:
        return None
    shares = tuple(routing) if isinstance(routing, (tuple, list)) else ()
    if len(shares) != experts or not all(is_number(r) and 0 <= float(r) < math.inf for r in shares) \
            or not sum(float(r) for r in shares) > 0:
        raise GraphError(f"{kind}'s routing hint is each of the {experts} experts' share of the routed pairs (a "
                         f"tuple of {experts} non-negative numbers, not all zero); got {routing!r}.")
    return tuple(float(r) for r in shares)


def _share(routing: tuple[float, ...] | None, experts: int, e0: int, e1: int) -> float:
    """The share of the routed rows experts ``[e0, e1)`` get: uniform, or by the hint."""
    if routing is None:
        return (e1 - e0) / experts
    return sum(routing[e0:e1]) / sum(routing)


def _check_rows(kind: str, rows: TensorType, group: TensorType) -> None:
    if group.dtype not in ("int32", "int64") or group.shape != rows.shape[:1]:
        raise GraphError(f"{kind} needs group ids, int of shape [rows] = [{rows.shape[0]}]; got {group}.")


@register
@dataclass(frozen=True, eq=True)
class GroupedMatmulOp(IndexedOp):
    """``grouped_matmul(xs[rows, h], w[experts, h, f], group[rows]) -> [rows, f]``: each row times its
    group's weights (``trans_w``: ``w`` is ``[experts, f, h]``, read transposed).  A group outside
    ``[0, experts)`` gives a row of zeros.

    >>> from relational_tensors.core.types import TensorType as T
    >>> GroupedMatmulOp((T.zero((12, 8)), T.zero((4, 8, 16)), T.zero((12,), "int64"))).signature()
    'rows hidden, experts hidden ff, rows -> rows ff'
    """

    kind = "grouped_matmul"
    trans_w: bool = False
    routing: tuple[float, ...] | None = None  # each expert's expected share of the rows (None: uniform)
    contraction = True

    def infer(self) -> TensorType:
        xs, w, group = self.input_types
        if xs.rank != 2 or w.rank != 3 or xs.dtype not in FLOAT_DTYPES or w.dtype != xs.dtype:
            raise GraphError(f"grouped_matmul needs rows [rows, h] and weights [experts, h, f] of one floating "
                             f"dtype; got {xs} and {w}.")
        h, f = (w.shape[2], w.shape[1]) if self.trans_w else (w.shape[1], w.shape[2])
        if xs.shape[1] != h:
            raise GraphError(f"grouped_matmul multiplies rows of width {xs.shape[1]} by weights whose input width is "
                             f"{h} ({'[experts, f, h]' if self.trans_w else '[experts, h, f]'}: {w.shape}).")
        _check_rows("grouped_matmul", xs, group)
        check_routing("grouped_matmul", self.routing, w.shape[0])
        return TensorType.zero((xs.shape[0], f), xs.dtype, ("rows", "ff"))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        w = ("experts", "ff", "hidden") if self.trans_w else ("experts", "hidden", "ff")
        return (("rows", "hidden"), w, ("rows",))

    def dims_out(self) -> tuple[str | None, ...]:
        return ("rows", "ff")

    def params(self) -> dict[str, object]:
        return {"trans_w": self.trans_w, "routing": list(self.routing) if self.routing else "uniform"}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        # each row meets one expert: a block of experts computes its share of the rows
        share = _share(self.routing, self.input_types[1].shape[0], inputs[1].lower[0], inputs[1].upper[0])
        return 2.0 * output.volume * inputs[0].shape[1] * share

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        xs, w, group = blocks
        e0, e1 = f.inputs[1].lower[0], f.inputs[1].upper[0]
        x = self._compute(xs)
        out = np.zeros((x.shape[0], w.shape[1] if self.trans_w else w.shape[2]), dtype=x.dtype)
        group = np.asarray(group)
        for e in np.unique(group[(group >= e0) & (group < e1)]):
            rows = group == e
            we = self._compute(w[e - e0])
            out[rows] = x[rows] @ (we.T if self.trans_w else we)
        return self._result(out)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        xs, w, group = inputs
        dxs = build(b, "grouped_matmul", (cotangent, w, group), trans_w=not self.trans_w,
                    routing=self.routing) if wanted[0] else None
        dw = None
        if wanted[1]:
            experts = w.type.shape[0]
            dw = build(b, "grouped_weight_grad", (cotangent, xs, group) if self.trans_w else (xs, cotangent, group),
                       experts=experts, routing=self.routing)
        return (dxs, dw, None)


@register
@dataclass(frozen=True, eq=True)
class GroupedWeightGradOp(IndexedOp):
    """``grouped_weight_grad(xs[rows, h], dy[rows, f], group[rows], experts) -> [experts, h, f]``: per
    expert, the sum over its rows of ``xs[p]ᵀ · dy[p]`` (float32 sums, rounded to the inputs' dtype).

    >>> from relational_tensors.core.types import TensorType as T
    >>> GroupedWeightGradOp((T.zero((12, 8)), T.zero((12, 16)), T.zero((12,), "int64")), 4).signature()
    'rows hidden, rows ff, rows -> experts hidden ff'
    """

    kind = "grouped_weight_grad"
    experts: int = 1
    routing: tuple[float, ...] | None = None  # as grouped_matmul's
    contraction = True
    gradient = "it is a first-order gradient; differentiating it again is not supported"

    def infer(self) -> TensorType:
        xs, dy, group = self.input_types
        if xs.rank != 2 or dy.rank != 2 or xs.shape[0] != dy.shape[0] or xs.dtype not in FLOAT_DTYPES \
                or dy.dtype != xs.dtype:
            raise GraphError(f"grouped_weight_grad needs rows [rows, h] and gradients [rows, f] of one floating "
                             f"dtype; got {xs} and {dy}.")
        positive_count("grouped_weight_grad's number of experts", self.experts)
        _check_rows("grouped_weight_grad", xs, group)
        check_routing("grouped_weight_grad", self.routing, self.experts)
        return TensorType.zero((self.experts, xs.shape[1], dy.shape[1]), xs.dtype, ("experts", "hidden", "ff"))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (("rows", "hidden"), ("rows", "ff"), ("rows",))

    def dims_out(self) -> tuple[str | None, ...]:
        return ("experts", "hidden", "ff")

    def params(self) -> dict[str, object]:
        return {"experts": self.experts, "routing": list(self.routing) if self.routing else "uniform"}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        share = _share(self.routing, self.experts, output.lower[0], output.upper[0])  # the block's experts' rows
        return 2.0 * inputs[0].volume * inputs[1].shape[1] * share

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        xs, dy, group = blocks
        e0, e1 = f.output.lower[0], f.output.upper[0]
        x, d = self._compute(xs), self._compute(dy)
        out = np.zeros(f.output.shape, dtype=x.dtype)
        group = np.asarray(group)
        for e in np.unique(group[(group >= e0) & (group < e1)]):
            rows = group == e
            out[e - e0] = x[rows].T @ d[rows]
        return self._result(out)


# --- a capacity per expert: fixed-size buffers that the plan can exchange all-to-all ----------------------------

CAPACITY_MAPS = ("slot", "pair")


def capacity_maps(ids: np.ndarray, experts: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot ``[groups, tokens · k]``, pair ``[groups, experts · capacity]``) of the router's choices
    ``ids [groups, tokens, k]`` (see :class:`CapacityRouteOp`)."""
    ids = np.asarray(ids, dtype=np.int64)
    groups = ids.shape[0]
    flat = ids.reshape(groups, -1)
    n = flat.shape[1]
    key = np.where((flat >= 0) & (flat < experts), flat, experts)
    order = np.argsort(key, axis=1, kind="stable")  # per group: by expert, then token order and rank
    ranked = np.take_along_axis(key, order, axis=1)
    at = np.broadcast_to(np.arange(n, dtype=np.int64), ranked.shape)
    starts = np.where(np.diff(ranked, axis=1, prepend=-1) != 0, at, 0)  # where each expert's run begins
    rank = at - np.maximum.accumulate(starts, axis=1)  # place within the run
    kept = (ranked < experts) & (rank < capacity)
    slot_sorted = np.where(kept, ranked * capacity + rank, -1)
    slot = np.empty_like(slot_sorted)
    np.put_along_axis(slot, order, slot_sorted, axis=1)
    pair = np.full((groups, experts * capacity), -1, dtype=np.int64)
    rows = np.broadcast_to(np.arange(groups)[:, None], kept.shape)
    pair[rows[kept], slot_sorted[kept]] = order[kept]
    return slot, pair


@register
@dataclass(frozen=True, eq=True)
class CapacityRouteOp(IndexedOp):
    """``capacity_route(ids[groups, tokens, k], experts, capacity, what) -> int64``: the places of the routed
    pairs in per-expert buffers of ``capacity`` rows, each group of tokens with buffers of its own (GShard's
    groups).  Within a group an expert takes its pairs first come first served (token order, then rank);
    a pair past its expert's capacity, or with an id outside ``[0, experts)``, is dropped.

    * ``"slot"`` ``[groups, tokens · k]``: pair ``t·k + j``'s row ``e·capacity + c`` in its group's
      ``[experts · capacity]`` rows, -1 where dropped;
    * ``"pair"`` ``[groups, experts · capacity]``: the pair each row holds, -1 where none (the inverse map).

    Groups split anywhere (each group routes alone); the rest of a group stays whole.

    >>> from relational_tensors.core.types import TensorType as T
    >>> CapacityRouteOp((T.zero((4, 6, 2), "int64"),), 4, 3, "pair").signature()
    'groups tokens k -> groups slots'
    """

    kind = "capacity_route"
    experts: int = 1
    capacity: int = 1
    what: str = "slot"
    gradient = "its input and output are integer ids"

    def infer(self) -> TensorType:
        (ids,) = self.input_types
        if ids.dtype not in ("int32", "int64") or ids.rank != 3:
            raise GraphError(f"capacity_route takes the router's choices per group, int ids of shape "
                             f"[groups, tokens, k]; got {ids}.")
        positive_count("capacity_route's number of experts", self.experts)
        positive_count("capacity_route's capacity", self.capacity)
        if self.what not in CAPACITY_MAPS:
            raise GraphError(f"capacity_route makes one of {CAPACITY_MAPS}; got what={self.what!r}.")
        groups, tokens, k = ids.shape
        if self.what == "slot":
            return TensorType.zero((groups, tokens * k), "int64", ("groups", "pairs"))
        return TensorType.zero((groups, self.experts * self.capacity), "int64", ("groups", "slots"))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (("groups", "tokens", "k"),)

    def dims_out(self) -> tuple[str | None, ...]:
        return ("groups", "pairs") if self.what == "slot" else ("groups", "slots")

    def unshardable(self) -> frozenset[str]:
        return frozenset({"tokens", "k", "pairs", "slots"})  # a sort over each group's pairs

    def params(self) -> dict[str, object]:
        return {"experts": self.experts, "capacity": self.capacity, "what": self.what}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        per = inputs[0].volume // max(inputs[0].shape[0], 1)
        return float(inputs[0].volume * max(1, int(np.log2(max(per, 2)))))

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        slot, pair = capacity_maps(blocks[0], self.experts, self.capacity)
        return slot if self.what == "slot" else pair


@register
@dataclass(frozen=True, eq=True)
class RoutedGatherOp(IndexedOp):
    """``routed_gather(x[groups, rows, h], index[groups, m], inverse[groups, rows · d]) -> [groups, m, h]``:
    ``out[g, i] = x[g, index[g, i] // d]``, zeros where ``index[g, i]`` is -1.  ``index`` and ``inverse`` are
    each other's inverse (``inverse[g, index[g, i]] = i`` wherever ``index`` is set, and the other way
    round), as ``capacity_route``'s slot and pair maps are: the dispatch into the experts' buffers is
    ``routed_gather(x, pair, slot)`` (``d = k``: a token's k pairs read its row), the combine back
    ``routed_gather(buffers, slot, pair)``.  The forward reads ``index``; the gradient is the gather the other
    way, through ``inverse`` (``dx[g, r] = Σ_q dy[g, inverse[g, r·d + q]]``), with no scatter and no atomics.

    Groups join all three; ``m`` and ``h`` split anywhere; ``rows`` too, ⊕ = sum (a block of rows gives the
    ones it holds and zeros elsewhere, as the embedding's vocabulary does).  With ``groups`` split across
    devices on one side and experts on the other (``[groups, experts · capacity]`` buffers), the exchange
    between them is an all-to-all.

    >>> from relational_tensors.core.types import TensorType as T
    >>> RoutedGatherOp((T.zero((4, 6, 8)), T.zero((4, 12), "int64"), T.zero((4, 12), "int64"))).signature()
    'groups rows hidden, groups m, groups pos -> groups m hidden'
    """

    kind = "routed_gather"

    def infer(self) -> TensorType:
        x, index, inverse = self.input_types
        if x.rank != 3 or x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"routed_gather reads floating rows [groups, rows, h]; got {x}.")
        for name, t in (("index", index), ("inverse", inverse)):
            if t.dtype not in ("int32", "int64") or t.rank != 2 or t.shape[0] != x.shape[0]:
                raise GraphError(f"routed_gather's {name} is an int map of shape [groups, n] with groups = "
                                 f"{x.shape[0]}; got {t}.")
        if x.shape[1] == 0 or inverse.shape[1] % x.shape[1]:
            raise GraphError(f"routed_gather's inverse has d entries per row of x ([groups, rows · d], rows = "
                             f"{x.shape[1]}); got {inverse.shape}.")
        return TensorType.zero((x.shape[0], index.shape[1], x.shape[2]), x.dtype, ("groups", "m", "hidden"))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (("groups", "rows", "hidden"), ("groups", "m"), ("groups", "pos"))

    def dims_out(self) -> tuple[str | None, ...]:
        return ("groups", "m", "hidden")

    def unshardable(self) -> frozenset[str]:
        return frozenset({"pos"})  # the inverse is read whole per group (the gradient's map, and the check)

    def per_row(self) -> int:
        x, _, inverse = self.input_types
        return inverse.shape[1] // x.shape[1]

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(output.volume)

    def kernel_bytes(self, input_bytes: Sequence[float], output_bytes: float) -> float:
        """A gather reads the rows it writes (at most the output's bytes), not its whole block of x."""
        x, index, inverse = input_bytes
        return min(x, output_bytes) + index + output_bytes

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, index, inverse = blocks
        index, inverse = np.asarray(index, np.int64), np.asarray(inverse, np.int64)
        positions = self.input_types[2].shape[1]
        if index.size and (index.min() < -1 or index.max() >= positions):
            raise ExecError(f"routed_gather's index holds positions in [0, {positions}) or -1; got values from "
                            f"{int(index.min())} to {int(index.max())}.")
        m0 = f.inputs[1].lower[1]
        g, i = np.nonzero(index >= 0)
        if np.any(inverse[g, index[g, i]] != i + m0):
            raise ExecError("routed_gather's index and inverse maps are not each other's inverse (inverse[g, "
                            "index[g, i]] must be i); build them with capacity_route's slot and pair maps.")
        r0, r1 = f.inputs[0].lower[1], f.inputs[0].upper[1]
        src = np.where(index >= 0, index // self.per_row(), -1)
        mine = (src >= r0) & (src < r1)
        rows = np.take_along_axis(x, np.clip(src - r0, 0, max(r1 - r0 - 1, 0))[..., None], axis=1)
        return self._result(np.where(mine[..., None], rows, np.zeros((), dtype=x.dtype)))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x, index, inverse = inputs
        if not wanted[0]:
            return None, None, None
        groups, rows, h = x.type.shape
        d = self.per_row()
        back = build(b, "routed_gather", (cotangent, inverse, index))  # [groups, rows · d, h]
        if d > 1:
            back = build(b, "reduce", (build(b, "reshape", (back,), shape=(groups, rows, d, h)),), op="sum",
                         axes=(2,))
        return back, None, None

"""Mixture-of-experts layers in the graph API: the router (gates, selection bias, top-k), the experts
computed densely, grouped by expert (dropless), or in per-group buffers of a capacity, shared experts and
the router's auxiliary losses; and a whole MoE layer's graph (forward or training step).

>>> g = moe_layer_graph(tokens=16, d_model=8, experts=4, top_k=2, d_ff=12, dtype="float32")
>>> sorted({n.kind for n in g.operators} & {"topk", "einsum", "swiglu"})
['einsum', 'swiglu', 'topk']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relational_tensors.errors import GraphError
from relational_tensors.graph.graph import Graph, Tensor
from relational_tensors.graph.optim import adamw
from relational_tensors.sql_specs.common import positive_count
from relational_tensors.sql_specs.experts import (
    CapacityRouteOp,
    GroupedMatmulOp,
    RoutedGatherOp,
    RouteIndexOp,
    check_routing,
)

__all__ = ["MoeLosses", "GATES", "add_moe_ffn", "moe_layer_graph", "default_capacity_groups", "MIXTRAL_8X7B_MOE",
           "QWEN3_30B_A3B_MOE"]


@dataclass
class MoeLosses:
    """The router's auxiliary losses of one MoE layer, float32 ``[1]``: ``balance`` the load-balancing loss
    as transformers' ``load_balancing_loss_func`` computes it (experts · Σ_e f_e · P_e, f_e the fraction of
    tokens routed to expert e over the top_k slots, P_e its mean router probability: top_k when perfectly
    balanced; Switch Transformer's loss at top_k = 1) and ``z`` the router z-loss of ST-MoE (the mean over
    tokens of logsumexp(logits)²)."""

    balance: Tensor
    z: Tensor


GATES = ("softmax", "softmax_topk", "sigmoid")


def add_moe_ffn(g: Graph, x: Tensor, *, experts: int, top_k: int, d_ff: int, prefix: str = "",
                norm_topk: bool = True, leaf: Any = None, gate: str = "softmax", selection_bias: bool = False,
                scaling: float = 1.0, shared_d_ff: int = 0, capacity_factor: float | None = None,
                capacity_groups: int | None = None, losses: list[MoeLosses] | None = None,
                experts_compute: str = "dense", routing_hint: Sequence[float] | None = None) -> Tensor:
    """Append a mixture-of-experts SwiGLU FFN over tokens ``x [tokens, d]``.

    The router: ``gate="softmax"`` (softmax over the experts, then the ``top_k``: Mixtral, Qwen-MoE),
    ``"softmax_topk"`` (the top_k logits, then a softmax over them) or ``"sigmoid"`` (per-expert sigmoid
    scores: DeepSeek-V3), all in float32; ``selection_bias`` adds a per-expert bias (``<prefix>router_bias``,
    DeepSeek-V3's load-balancing correction) to the scores used to *choose* experts, not to weight them;
    ``norm_topk`` renormalizes the chosen weights to sum to 1 and ``scaling`` multiplies them.
    ``capacity_factor``: the tokens form ``capacity_groups`` consecutive groups (GShard's groups; default
    :func:`default_capacity_groups`), and within a group each expert takes at most
    ``ceil(capacity_factor · group tokens · top_k / experts)`` routed pairs, first come (token order, then
    rank) first served; a pair past it is dropped (weight 0), as GShard and Switch drop them.  Which pairs
    drop depends on the groups, never on the plan.  None is dropless, as the HF models compute.
    ``shared_d_ff``: a shared expert of that width every token goes through (DeepSeek, Qwen2-MoE).
    ``losses``: a list the layer's :class:`MoeLosses` is appended to.

    ``experts_compute="dense"``: every token through every expert, each output weighted by the token's
    weight for that expert (zero where the router did not pick it).  ``"grouped"``: the ``tokens · top_k``
    routed pairs gathered into rows sorted by expert (``route_index``), each row through its own expert
    only (``grouped_matmul``: ``top_k / experts`` of the dense FLOPs), and each token's rows gathered back
    and weighted (``sql_specs/experts.py``); ``routing_hint`` (each expert's expected share of the routed
    pairs, a measured histogram) prices its products, uniform routing if None.  ``"grouped"`` with a
    capacity: each group's pairs gathered into ``[groups, experts, capacity, d]`` buffers
    (``capacity_route``, ``routed_gather``), the experts' products batched GEMMs over them, and the rows
    gathered back: with the groups split over devices for the dispatch and the experts for the products,
    the exchanges between them are all-to-alls.  The stacked expert weights are
    ``[experts, ...]`` with the
    dimension named ``experts``; the products over it are the ones expert parallelism splits."""
    if gate not in GATES:
        raise GraphError(f"add_moe_ffn's gate is one of {GATES}; got {gate!r}.")
    if not 1 <= top_k <= experts:
        raise GraphError(f"add_moe_ffn routes each token to 1 <= top_k <= experts ({experts}) experts; got {top_k}.")
    if routing_hint is not None and experts_compute != "grouped":
        raise GraphError("a routing_hint prices the grouped experts' products; give experts_compute='grouped' "
                         "(the dense form computes every expert for every token whatever the routing).")
    if routing_hint is not None and capacity_factor is not None:
        raise GraphError("a routing_hint prices the dropless grouped experts' products; with a capacity_factor the "
                         "experts' buffers hold capacity rows whatever the routing, so leave one of the two out.")
    hint = check_routing("add_moe_ffn", routing_hint, experts)  # before any node is added
    if experts_compute not in ("dense", "grouped"):
        raise GraphError(f"add_moe_ffn's experts_compute is 'dense' or 'grouped'; got {experts_compute!r}.")
    if capacity_factor is not None and not capacity_factor > 0:
        raise GraphError(f"capacity_factor is a positive number (or None: dropless); got {capacity_factor!r}.")
    if capacity_groups is not None:
        if capacity_factor is None:
            raise GraphError("capacity_groups groups the tokens for a capacity per expert; give capacity_factor too "
                             "(without one the layer is dropless and has no groups).")
        check_groups(capacity_groups, x.shape[0])
    tokens, d = x.shape
    dtype = x.dtype
    make = g.parameter if leaf is None else leaf

    def param(name: str, shape: Sequence[int], dims: Sequence[str], kind: str = dtype) -> Tensor:
        return make(prefix + name, shape, kind, dims=tuple(dims))

    logits = g.matmul(x, param("router", [d, experts], ("hidden", "experts")), name=prefix + "router_proj")
    logits = g.cast(logits, "float32") if dtype != "float32" else logits
    if gate == "softmax_topk":
        top_logits, ids = g.topk(logits, top_k, name=prefix + "route")
        top = g.softmax(top_logits, -1, name=prefix + "route_softmax")
        probs = g.softmax(logits, -1, name=prefix + "router_softmax")  # for the balance loss
    else:
        probs = g.softmax(logits, -1, name=prefix + "router_softmax") if gate == "softmax" else \
            g.unary(logits, "sigmoid", name=prefix + "router_sigmoid")
        if selection_bias:
            bias = g.input(prefix + "router_bias", [experts], "float32", dims=("experts",))  # set by a rule, not
            chooser = g.add(probs, g.reshape(bias, [1, experts]), name=prefix + "route_scores")  # by gradients
            ids = g.topk(chooser, top_k, name=prefix + "route")[1]
            top = g.take_along(probs, ids, name=prefix + "route_weights")
        else:
            top, ids = g.topk(probs, top_k, name=prefix + "route")
    if norm_topk:
        top = g.div(top, g.sum(top, -1, keepdims=True), name=prefix + "route_norm")
    if scaling != 1.0:
        top = g.unary(top, "scale", float(scaling), name=prefix + "route_scale")
    hot = g.one_hot(ids, experts, "float32", name=prefix + "route_hot")  # [tokens, k, experts]
    slot = pair = None
    if capacity_factor is not None:
        groups = default_capacity_groups(tokens) if capacity_groups is None else capacity_groups
        capacity = math.ceil(capacity_factor * (tokens // groups) * top_k / experts)
        by_group = g.reshape(ids, [groups, tokens // groups, top_k], name=prefix + "route_groups",
                             dims=("groups", "tokens", "k"))

        def route(what: str) -> Tensor:
            return g.apply(CapacityRouteOp((by_group.type,), experts, capacity, what), by_group,
                           name=f"{prefix}route_{what}")
        slot, pair = route("slot"), route("pair")  # [groups, tokens · k], [groups, experts · capacity]
        if experts_compute == "dense":  # the dropped pairs weigh 0
            placed = g.cast(slot, "float32", name=prefix + "route_placed")  # -1 where dropped
            none = g.unary(placed, "fill", -0.5, name=prefix + "route_none")
            kept = g.cast(g.binary(placed, none, "greater"), "float32", name=prefix + "route_kept")
            top = g.mul(top, g.reshape(kept, [tokens, top_k]), name=prefix + "route_capped")
    w1 = param("w1", [experts, d, d_ff], ("experts", "hidden", "ff"))
    w3 = param("w3", [experts, d, d_ff], ("experts", "hidden", "ff"))
    w2 = param("w2", [experts, d_ff, d], ("experts", "ff", "hidden"))
    if experts_compute == "grouped" and slot is not None and pair is not None:
        y = _capacity_experts(g, x, slot, pair, top, (w1, w3, w2), experts, prefix)
    elif experts_compute == "grouped":
        y = _grouped_experts(g, x, ids, top, (w1, w3, w2), experts, prefix, hint)
    else:
        weights = g.einsum("tokens k, tokens k experts -> tokens experts", top, hot,
                           name=prefix + "combine_weights")
        weights = g.cast(weights, dtype) if dtype != "float32" else weights
        into = "tokens hidden, experts hidden ff -> tokens experts ff"
        gate_h = g.einsum(into, x, w1, name=prefix + "expert_gate")
        up = g.einsum(into, x, w3, name=prefix + "expert_up")
        act = g.swiglu(gate_h, up, name=prefix + "expert_swiglu")
        down = g.einsum("tokens experts ff, experts ff hidden -> tokens experts hidden", act, w2,
                        name=prefix + "expert_down")
        y = g.einsum("tokens experts hidden, tokens experts -> tokens hidden", down, weights,
                     name=prefix + "combine")
    if shared_d_ff:
        sg = g.matmul(x, param("shared_w1", [d, shared_d_ff], ("hidden", "ff")), name=prefix + "shared_gate")
        su = g.matmul(x, param("shared_w3", [d, shared_d_ff], ("hidden", "ff")), name=prefix + "shared_up")
        sd = g.matmul(g.swiglu(sg, su, name=prefix + "shared_swiglu"),
                      param("shared_w2", [shared_d_ff, d], ("ff", "hidden")), name=prefix + "shared_down")
        y = g.add(y, sd, name=prefix + "shared_add")
    if losses is not None:
        routed = g.sum(g.reshape(hot, [tokens * top_k, experts]), 0, name=prefix + "route_counts")  # [experts]
        share = g.unary(routed, "scale", 1.0 / tokens)
        mean_prob = g.mean(probs, 0, name=prefix + "router_mean_prob")
        balance = g.unary(g.sum(g.mul(share, mean_prob), -1, keepdims=True), "scale", float(experts),
                          name=prefix + "balance_loss")
        lse = g.logsumexp(logits, -1, name=prefix + "router_lse")
        z = g.mean(g.mul(lse, lse), -1, keepdims=True, name=prefix + "z_loss")
        losses.append(MoeLosses(balance, z))
    return y


def _grouped_experts(g: Graph, x: Tensor, ids: Tensor, top: Tensor, weights: tuple[Tensor, Tensor, Tensor],
                     experts: int, prefix: str, routing: tuple[float, ...] | None = None) -> Tensor:
    """The routed experts over rows sorted by expert: ``x [tokens, d]`` gathered into one row per routed
    pair, each row's SwiGLU FFN with its own expert's ``(w1, w3, w2)``, and each token's rows gathered back
    and summed with the router's weights ``top [tokens, k]``."""
    w1, w3, w2 = weights

    def route(what: str) -> Tensor:
        return g.apply(RouteIndexOp((ids.type,), experts, what), ids, name=f"{prefix}route_{what}")

    token, dest, group = route("token"), route("dest"), route("group")
    xs = g.embedding(x, token, name=prefix + "dispatch")  # [pairs, d], sorted by expert
    def product(rows: Tensor, w: Tensor, name: str) -> Tensor:
        return g.apply(GroupedMatmulOp((rows.type, w.type, group.type), routing=routing), rows, w, group,
                       name=prefix + name)

    act = g.swiglu(product(xs, w1, "expert_gate"), product(xs, w3, "expert_up"), name=prefix + "expert_swiglu")
    down = product(act, w2, "expert_down")
    back = g.embedding(down, dest, name=prefix + "gather_back")  # [tokens, k, d]
    top = g.cast(top, x.dtype) if x.dtype != "float32" else top
    return g.einsum("tokens k hidden, tokens k -> tokens hidden", back, top, name=prefix + "combine")


def default_capacity_groups(tokens: int, most: int = 64) -> int:
    """The default number of token groups of a capacity: the largest power of two up to ``most`` that
    divides ``tokens``, so that up to that many devices dispatch their own tokens.

    >>> default_capacity_groups(8192), default_capacity_groups(12), default_capacity_groups(7)
    (64, 4, 1)
    """
    groups = 1
    while groups * 2 <= most and tokens % (groups * 2) == 0:
        groups *= 2
    return groups


def check_groups(groups: Any, tokens: int) -> None:
    """``capacity_groups``, refused unless it is a positive int that divides the token count."""
    if positive_count("capacity_groups", groups) and tokens % groups:
        raise GraphError(f"capacity_groups is a positive number of token groups that divides the {tokens} tokens; "
                         f"got {groups!r}.")


# the experts' products over the buffers laid out experts first
_CAPACITY_IN = "experts groups capacity hidden, experts hidden ff -> experts groups capacity ff"
_CAPACITY_OUT = "experts groups capacity ff, experts ff hidden -> experts groups capacity hidden"


def _capacity_experts(g: Graph, x: Tensor, slot: Tensor, pair: Tensor, top: Tensor,
                      weights: tuple[Tensor, Tensor, Tensor], experts: int, prefix: str) -> Tensor:
    """The routed experts over per-group buffers of a fixed capacity: each group's tokens gathered into
    ``[groups, experts, capacity, d]`` (empty rows zero), the SwiGLU FFN as batched products over the
    experts (on the buffers laid out experts first), and each pair's row gathered back and summed with the
    router's weights ``top [tokens, k]`` (a dropped pair's row is zero)."""
    w1, w3, w2 = weights
    tokens, d = x.shape
    groups, slots = pair.shape
    capacity, k = slots // experts, top.shape[1]
    xg = g.reshape(x, [groups, tokens // groups, d], name=prefix + "tokens_by_group",
                   dims=("groups", "tokens", "hidden"))
    buf = g.apply(RoutedGatherOp((xg.type, pair.type, slot.type)), xg, pair, slot, name=prefix + "dispatch")
    buf = g.reshape(buf, [groups, experts, capacity, d], name=prefix + "expert_buffers",
                    dims=("groups", "experts", "capacity", "hidden"))
    # experts first: each expert's rows of every group are one [groups · capacity, d] matrix, so each product
    # is one batched GEMM over the experts (with the groups between them no GEMM reads the rows at one stride)
    buf = g.permute(buf, (1, 0, 2, 3), name=prefix + "by_expert")
    gate = g.einsum(_CAPACITY_IN, buf, w1, name=prefix + "expert_gate")
    up = g.einsum(_CAPACITY_IN, buf, w3, name=prefix + "expert_up")
    act = g.swiglu(gate, up, name=prefix + "expert_swiglu")
    down = g.einsum(_CAPACITY_OUT, act, w2, name=prefix + "expert_down")
    down = g.permute(down, (1, 0, 2, 3), name=prefix + "by_group")
    down = g.reshape(down, [groups, slots, d], name=prefix + "expert_rows", dims=("groups", "slots", "hidden"))
    back = g.apply(RoutedGatherOp((down.type, slot.type, pair.type)), down, slot, pair, name=prefix + "gather_back")
    back = g.reshape(back, [tokens, k, d], name=prefix + "pair_rows")
    top = g.cast(top, x.dtype) if x.dtype != "float32" else top
    return g.einsum("tokens k hidden, tokens k -> tokens hidden", back, top, name=prefix + "combine")


def moe_layer_graph(tokens: int, d_model: int, experts: int, top_k: int, d_ff: int, dtype: str = "bfloat16",
                    training: bool = False, master_dtype: str | None = "float32", balance_coef: float = 0.0,
                    z_coef: float = 0.0, **router: Any) -> Graph:
    """One pre-norm mixture-of-experts FFN layer with its residual over ``tokens`` tokens (output ``y``);
    with ``training`` a whole step: the loss ``mean(y²)`` plus ``balance_coef`` times the load-balancing
    loss and ``z_coef`` times the router z-loss (saved as ``balance_loss`` and ``z_loss`` when asked for),
    every gradient, and AdamW on the weights (states, with ``master_dtype`` masters and moments).
    ``router``: ``add_moe_ffn``'s gate, selection_bias, scaling, shared_d_ff, capacity_factor,
    capacity_groups, experts_compute and routing_hint."""
    g = Graph()
    x = g.input("x", [tokens, d_model], dtype, dims=("tokens", "hidden"))
    leaf = g.state if training else None
    norm = (g.state if training else g.parameter)("ffn_norm", [d_model], dtype, dims=("hidden",))
    h = g.rmsnorm(x, norm, 1e-5, name="ffn_rmsnorm")
    found: list[MoeLosses] = []
    wanted = balance_coef != 0.0 or z_coef != 0.0
    y = g.add(x, add_moe_ffn(g, h, experts=experts, top_k=top_k, d_ff=d_ff, leaf=leaf,
                             losses=found if wanted else None, **router), name="residual")
    if not training:
        g.save(y, name="y")
        return g
    y32 = g.cast(y, "float32") if dtype != "float32" else y
    loss = g.mean(g.mul(y32, y32), [0, 1], keepdims=True, name="task_loss")
    for coef, part in ((balance_coef, "balance"), (z_coef, "z")):
        if coef != 0.0:
            term = getattr(found[0], part)
            g.save(term, name=f"{part}_loss")
            loss = g.add(loss, g.unary(term, "scale", float(coef)))
    loss = g.save(g.reshape(loss, [], name="loss"), name="loss")
    params = g.trainable()
    adamw(g, params, g.grad(loss, params), g.input("lr", [1], dtype), master_dtype=master_dtype)
    return g


# Mixtral-8x7B's and Qwen3-30B-A3B's MoE layers
MIXTRAL_8X7B_MOE: dict[str, Any] = dict(d_model=4096, experts=8, top_k=2, d_ff=14336)
QWEN3_30B_A3B_MOE: dict[str, Any] = dict(d_model=2048, experts=128, top_k=8, d_ff=768)

"""Ready-made graphs: the LLaMA-style transformer block of the paper's experiments.

>>> g = llama_block(batch=1, seq=16, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48)
>>> [n.kind for n in g.operators][:4]
['rmsnorm', 'matmul', 'reshape', 'matmul']
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import GraphError
from relational_tensors.graph.graph import Graph, Tensor
from relational_tensors.graph.optim import adamw, sgd
from relational_tensors.sql_specs.experts import GroupedMatmulOp, RouteIndexOp, check_routing

__all__ = ["MoeLosses", "moe_constants", "GATES", "CausalLM", "lm_prefill_graph", "lm_decode_graph", "cache_name",
           "llama_block", "add_llama_block", "add_moe_ffn", "moe_layer_graph", "MIXTRAL_8X7B_MOE",
           "QWEN3_30B_A3B_MOE", "llama_feeds", "llama_training_graph", "llama_training_feeds",
           "standard_normal", "LLAMA3_8B", "matrix_chain",
           "chain_dims", "chain_feeds", "CHAINS"]

# the paper's LLaMA-3-8B-shaped block
LLAMA3_8B: dict[str, Any] = dict(d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336)


def add_llama_block(g: Graph, x: Tensor, *, n_heads: int, n_kv_heads: int, d_ff: int, prefix: str = "",
                    seq_ends: Sequence[int] | None = None, eps: float = 1e-5, rope_base: float = 500000.0,
                    leaf: Any = None) -> Tensor:
    """Append one pre-norm block (RMSNorm, GQA attention with RoPE, SwiGLU FFN, two residuals) to ``g``;
    its weights are made by ``leaf`` (default ``g.parameter``; ``g.state`` for a training step)."""
    b, s, d = x.shape
    dh = d // n_heads
    dtype = x.dtype
    make = g.parameter if leaf is None else leaf

    def param(name: str, shape: Sequence[int]) -> Tensor:
        return make(prefix + name, shape, dtype)

    h = g.rmsnorm(x, param("attn_norm", [d]), eps, name=prefix + "attn_rmsnorm")
    q = g.reshape(g.matmul(h, param("wq", [d, n_heads * dh]), name=prefix + "q_proj"), [b, s, n_heads, dh])
    k = g.reshape(g.matmul(h, param("wk", [d, n_kv_heads * dh]), name=prefix + "k_proj"), [b, s, n_kv_heads, dh])
    v = g.reshape(g.matmul(h, param("wv", [d, n_kv_heads * dh]), name=prefix + "v_proj"), [b, s, n_kv_heads, dh])
    q = g.rope(q, rope_base, seq_ends, name=prefix + "q_rope")
    k = g.rope(k, rope_base, seq_ends, name=prefix + "k_rope")
    a = g.attention(q, k, v, causal=True, seq_ends=seq_ends, name=prefix + "attention")
    o = g.matmul(g.reshape(a, [b, s, n_heads * dh]), param("wo", [n_heads * dh, d]), name=prefix + "o_proj")
    x2 = g.add(x, o, name=prefix + "attn_residual")
    h2 = g.rmsnorm(x2, param("ffn_norm", [d]), eps, name=prefix + "ffn_rmsnorm")
    gate = g.matmul(h2, param("w1", [d, d_ff]), name=prefix + "gate_proj")
    up = g.matmul(h2, param("w3", [d, d_ff]), name=prefix + "up_proj")
    down = g.matmul(g.swiglu(gate, up, name=prefix + "swiglu"), param("w2", [d_ff, d]), name=prefix + "down_proj")
    return g.add(x2, down, name=prefix + "ffn_residual")


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
                losses: list[MoeLosses] | None = None, experts_compute: str = "dense",
                routing_hint: Sequence[float] | None = None) -> Tensor:
    """Append a mixture-of-experts SwiGLU FFN over tokens ``x [tokens, d]``.

    The router: ``gate="softmax"`` (softmax over the experts, then the ``top_k``: Mixtral, Qwen-MoE),
    ``"softmax_topk"`` (the top_k logits, then a softmax over them) or ``"sigmoid"`` (per-expert sigmoid
    scores: DeepSeek-V3), all in float32; ``selection_bias`` adds a per-expert bias (``<prefix>router_bias``,
    DeepSeek-V3's load-balancing correction) to the scores used to *choose* experts, not to weight them;
    ``norm_topk`` renormalizes the chosen weights to sum to 1 and ``scaling`` multiplies them.
    ``capacity_factor``: each expert takes at most ``ceil(capacity_factor · tokens · top_k / experts)`` routed
    pairs, first come (token order, then rank) first served; a pair past it is dropped (weight 0), as
    GShard and Switch drop them; None is dropless, as the HF models compute.  ``shared_d_ff``: a shared
    expert of that width every token goes through (DeepSeek, Qwen2-MoE).  ``losses``: a list the layer's
    :class:`MoeLosses` is appended to.

    ``experts_compute="dense"``: every token through every expert, each output weighted by the token's
    weight for that expert (zero where the router did not pick it).  ``"grouped"``: the ``tokens · top_k``
    routed pairs gathered into rows sorted by expert (``route_index``), each row through its own expert
    only (``grouped_matmul``: ``top_k / experts`` of the dense FLOPs), and each token's rows gathered back
    and weighted (``sql_specs/experts.py``); ``routing_hint`` (each expert's expected share of the routed
    pairs, a measured histogram) prices its products, uniform routing if None.  The stacked expert weights are
    ``[experts, ...]`` with the
    dimension named ``experts``; the products over it are the ones expert parallelism splits."""
    if gate not in GATES:
        raise GraphError(f"add_moe_ffn's gate is one of {GATES}; got {gate!r}.")
    if not 1 <= top_k <= experts:
        raise GraphError(f"add_moe_ffn routes each token to 1 <= top_k <= experts ({experts}) experts; got {top_k}.")
    if routing_hint is not None and experts_compute != "grouped":
        raise GraphError("a routing_hint prices the grouped experts' products; give experts_compute='grouped' "
                         "(the dense form computes every expert for every token whatever the routing).")
    hint = check_routing("add_moe_ffn", routing_hint, experts)  # before any node is added
    if experts_compute not in ("dense", "grouped"):
        raise GraphError(f"add_moe_ffn's experts_compute is 'dense' or 'grouped'; got {experts_compute!r}.")
    if capacity_factor is not None and not capacity_factor > 0:
        raise GraphError(f"capacity_factor is a positive number (or None: dropless); got {capacity_factor!r}.")
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
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * tokens * top_k / experts)
        pairs = g.reshape(hot, [tokens * top_k, experts], name=prefix + "route_pairs")
        # each pair's place in its expert's queue: the pairs before it (token order, then rank) routed there
        order = g.input(prefix + "route_order", [tokens * top_k, tokens * top_k], "float32")  # moe_constants
        before = g.einsum("pe,pq->qe", pairs, order, name=prefix + "route_queue")
        place = g.reshape(g.sum(g.mul(before, pairs), -1), [tokens, top_k], name=prefix + "route_place")
        limit = g.unary(place, "fill", float(capacity), name=prefix + "route_capacity")
        kept = g.cast(g.binary(place, limit, "less"), "float32", name=prefix + "route_kept")
        top = g.mul(top, kept, name=prefix + "route_capped")
    w1 = param("w1", [experts, d, d_ff], ("experts", "hidden", "ff"))
    w3 = param("w3", [experts, d, d_ff], ("experts", "hidden", "ff"))
    w2 = param("w2", [experts, d_ff, d], ("experts", "ff", "hidden"))
    if experts_compute == "grouped":
        y = _grouped_experts(g, x, ids, top, (w1, w3, w2), experts, prefix, hint)
    else:
        weights = g.einsum("tk,tke->te", top, hot, name=prefix + "combine_weights")
        weights = g.cast(weights, dtype) if dtype != "float32" else weights
        gate_h = g.einsum("th,ehf->tef", x, w1, name=prefix + "expert_gate")
        up = g.einsum("th,ehf->tef", x, w3, name=prefix + "expert_up")
        act = g.swiglu(gate_h, up, name=prefix + "expert_swiglu")
        down = g.einsum("tef,efh->teh", act, w2, name=prefix + "expert_down")
        y = g.einsum("teh,te->th", down, weights, name=prefix + "combine")
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
    return g.einsum("tkh,tk->th", back, top, name=prefix + "combine")


def moe_constants(g: Graph) -> dict[str, np.ndarray]:
    """The values of the constant inputs ``add_moe_ffn`` made in ``g`` (with a capacity: the order of the
    routed pairs, ``[p, q] = 1`` where pair p comes before pair q), for the feeds."""
    out: dict[str, np.ndarray] = {}
    for n in g.inputs:
        if n.name.endswith("route_order"):
            out[n.name] = np.triu(np.ones(n.type.shape, dtype=np.float32), 1)
    return out


def moe_layer_graph(tokens: int, d_model: int, experts: int, top_k: int, d_ff: int, dtype: str = "bfloat16",
                    training: bool = False, master_dtype: str | None = "float32", balance_coef: float = 0.0,
                    z_coef: float = 0.0, **router: Any) -> Graph:
    """One pre-norm mixture-of-experts FFN layer with its residual over ``tokens`` tokens (output ``y``);
    with ``training`` a whole step: the loss ``mean(y²)`` plus ``balance_coef`` times the load-balancing
    loss and ``z_coef`` times the router z-loss (saved as ``balance_loss`` and ``z_loss`` when asked for),
    every gradient, and AdamW on the weights (states, with ``master_dtype`` masters and moments).
    ``router``: ``add_moe_ffn``'s gate, selection_bias, scaling, shared_d_ff and capacity_factor."""
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


def cache_name(layer: int, which: str) -> str:
    """The graph name of layer ``layer``'s cached keys (``which="k"``) or values (``"v"``)."""
    return f"cache.{layer}.{which}"


@dataclass(frozen=True, eq=False)
class CausalLM:
    """A LLaMA-style causal language model for generation (``rt.generate``, ``rt.decoder``): token embedding,
    ``layers`` pre-norm blocks (GQA attention with rotary positions, SwiGLU FFN), final RMSNorm and LM head.

    ``weights`` maps each parameter of :func:`lm_prefill_graph` to its array (``embed`` [vocab, d],
    ``l<i>.wq`` [d, heads * head_dim], ..., ``norm`` [d], ``lm_head`` [d, vocab]; ``inv_freq`` is made
    here); without weights the model plans and simulates but does not run."""

    vocab: int
    d_model: int
    layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    eps: float = 1e-5
    rope_base: float = 500000.0
    dtype: str = "float32"
    weights: Any = None  # Mapping[str, np.ndarray] | None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's name and shape (``inv_freq`` excluded)."""
        d, dh = self.d_model, self.head_dim
        out: dict[str, tuple[int, ...]] = {"embed": (self.vocab, d)}
        for i in range(self.layers):
            out.update({f"l{i}.attn_norm": (d,), f"l{i}.wq": (d, self.n_heads * dh),
                        f"l{i}.wk": (d, self.n_kv_heads * dh), f"l{i}.wv": (d, self.n_kv_heads * dh),
                        f"l{i}.wo": (self.n_heads * dh, d), f"l{i}.ffn_norm": (d,), f"l{i}.w1": (d, self.d_ff),
                        f"l{i}.w3": (d, self.d_ff), f"l{i}.w2": (self.d_ff, d)})
        out.update({"norm": (d,), "lm_head": (d, self.vocab)})
        return out

    def inv_freq(self) -> np.ndarray:
        """The rotary frequencies, float32 (as transformers computes them)."""
        dh = self.head_dim
        return (1.0 / (self.rope_base ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / dh))).astype(
            np.float32)

    def feeds(self) -> dict[str, np.ndarray]:
        """The weights as graph feeds, checked against their shapes and cast to the model's dtype."""
        if self.weights is None:
            raise GraphError("this CausalLM has no weights; give CausalLM(..., weights={name: array}) to run it "
                             "(without weights it plans and simulates only).")
        out: dict[str, np.ndarray] = {}
        for name, shape in self.parameter_shapes().items():
            if name not in self.weights:
                raise GraphError(f"CausalLM weights lack {name!r} of shape {shape}.")
            value = np.asarray(self.weights[name])
            if value.shape != shape:
                raise GraphError(f"CausalLM weight {name!r} has shape {value.shape}; the model needs {shape}.")
            out[name] = value.astype(numpy_dtype(self.dtype), copy=False)
        out["inv_freq"] = self.inv_freq()
        return out


def _rotary(g: Graph, x: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """Rotate-half rotary embedding of ``x [b, s, h, dh]`` with ``cos``/``sin`` ``[b, s, 1, dh]``."""
    half = x.shape[-1] // 2
    x1, x2 = g.slice(x, -1, 0, half), g.slice(x, -1, half, x.shape[-1])
    rotated = g.concat([g.unary(x2, "neg"), x1], -1)
    return g.add(g.mul(x, cos), g.mul(rotated, sin), name=name)


def _lm_body(g: Graph, lm: CausalLM, ids: Tensor, positions: Tensor,
             attend: Any) -> Tensor:
    """Embedding, the blocks and the final norm over the tokens ``ids [b, s]`` at ``positions [b, s]``;
    ``attend(layer, q, k, v)`` returns each layer's attention output ``[b, s, heads, head_dim]``.  Returns
    the last position's normalized hidden state ``[b, d]``."""
    b, s = ids.shape
    d, dh, dtype = lm.d_model, lm.head_dim, lm.dtype
    x = g.embedding(g.parameter("embed", [lm.vocab, d], dtype), ids, name="embed_tokens")
    angles = g.mul(g.reshape(g.cast(positions, "float32"), [b, s, 1]),
                   g.reshape(g.parameter("inv_freq", [dh // 2], "float32"), [1, 1, dh // 2]), name="rope_angles")
    angles = g.reshape(g.concat([angles, angles], -1), [b, s, 1, dh])
    cos, sin = g.unary(angles, "cos"), g.unary(angles, "sin")
    if dtype != "float32":
        cos, sin = g.cast(cos, dtype), g.cast(sin, dtype)
    for i in range(lm.layers):
        p = f"l{i}."

        def param(name: str, shape: Sequence[int], p: str = p) -> Tensor:
            return g.parameter(p + name, shape, dtype)

        h = g.rmsnorm(x, param("attn_norm", [d]), lm.eps, name=p + "attn_rmsnorm")
        q = g.reshape(g.matmul(h, param("wq", [d, lm.n_heads * dh]), name=p + "q_proj"), [b, s, lm.n_heads, dh])
        k = g.reshape(g.matmul(h, param("wk", [d, lm.n_kv_heads * dh]), name=p + "k_proj"), [b, s, lm.n_kv_heads, dh])
        v = g.reshape(g.matmul(h, param("wv", [d, lm.n_kv_heads * dh]), name=p + "v_proj"), [b, s, lm.n_kv_heads, dh])
        q, k = _rotary(g, q, cos, sin, p + "q_rope"), _rotary(g, k, cos, sin, p + "k_rope")
        a = attend(i, q, k, v)
        o = g.matmul(g.reshape(a, [b, s, lm.n_heads * dh]), param("wo", [lm.n_heads * dh, d]), name=p + "o_proj")
        x = g.add(x, o, name=p + "attn_residual")
        h2 = g.rmsnorm(x, param("ffn_norm", [d]), lm.eps, name=p + "ffn_rmsnorm")
        gate = g.matmul(h2, param("w1", [d, lm.d_ff]), name=p + "gate_proj")
        up = g.matmul(h2, param("w3", [d, lm.d_ff]), name=p + "up_proj")
        down = g.matmul(g.swiglu(gate, up, name=p + "swiglu"), param("w2", [lm.d_ff, d]), name=p + "down_proj")
        x = g.add(x, down, name=p + "ffn_residual")
    last = g.reshape(g.slice(x, 1, s - 1, s), [b, d]) if s > 1 else g.reshape(x, [b, d])
    return g.rmsnorm(last, g.parameter("norm", [d], dtype), lm.eps, name="final_norm")


def lm_prefill_graph(lm: CausalLM, batch: int, length: int) -> Graph:
    """The prompt's forward of ``batch`` prompts of ``length`` tokens: inputs ``ids`` [b, s] int64,
    ``keys_ok`` [b, s] bool (real tokens) and ``positions`` [b, s] int64; outputs ``logits`` [b, vocab] (the
    last position's) and each layer's keys and values ``cache.<i>.k`` / ``cache.<i>.v`` [b, s, kv_heads,
    head_dim]."""
    g = Graph()
    ids = g.input("ids", [batch, length], "int64")
    keys_ok = g.input("keys_ok", [batch, length], "bool")
    positions = g.input("positions", [batch, length], "int64")

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g.save(k, name=cache_name(i, "k"))
        g.save(v, name=cache_name(i, "v"))
        return g.attention(q, k, v, causal=True, key_padding=keys_ok, name=f"l{i}.attention")

    h = _lm_body(g, lm, ids, positions, attend)
    g.save(g.matmul(h, g.parameter("lm_head", [lm.d_model, lm.vocab], lm.dtype), name="lm_head_proj"), name="logits")
    return g


def lm_decode_graph(lm: CausalLM, batch: int, max_len: int) -> Graph:
    """One decode step of ``batch`` sequences over a cache of ``max_len`` positions: inputs ``ids`` [b, 1],
    ``keys_ok`` [b, max_len] (the positions each sequence sees, this step's included), ``positions`` [b, 1]
    and ``write`` [b, max_len] (True where each sequence writes this step); states ``cache.<i>.k`` /
    ``cache.<i>.v`` [b, max_len, kv_heads, head_dim], assigned the step's cache; output ``logits``."""
    g = Graph()
    ids = g.input("ids", [batch, 1], "int64")
    keys_ok = g.input("keys_ok", [batch, max_len], "bool")
    positions = g.input("positions", [batch, 1], "int64")
    write = g.reshape(g.input("write", [batch, max_len], "bool"), [batch, max_len, 1, 1])
    dh = lm.head_dim

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        written = []
        for which, new in (("k", k), ("v", v)):
            state = g.state(cache_name(i, which), [batch, max_len, lm.n_kv_heads, dh], lm.dtype)
            written.append(g.assign(state, g.where(write, new, state, name=f"l{i}.cache_{which}_write")))
        return g.attention(q, written[0], written[1], key_padding=keys_ok, name=f"l{i}.attention")

    h = _lm_body(g, lm, ids, positions, attend)
    g.save(g.matmul(h, g.parameter("lm_head", [lm.d_model, lm.vocab], lm.dtype), name="lm_head_proj"), name="logits")
    return g


def llama_block(batch: int, seq: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int,
                dtype: str = "float32", seq_ends: Sequence[int] | None = None, layers: int = 1,
                eps: float = 1e-5, rope_base: float = 500000.0) -> Graph:
    """A graph of ``layers`` LLaMA-style blocks on x[batch, seq, d_model], saving ``y``."""
    g = Graph()
    x = g.input("x", [batch, seq, d_model], dtype, dims=("batch", "seq", "model"))
    for n in range(layers):
        prefix = f"l{n}." if layers > 1 else ""
        x = add_llama_block(g, x, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff, prefix=prefix,
                            seq_ends=seq_ends, eps=eps, rope_base=rope_base)
    g.save(x, name="y")
    return g


def llama_training_graph(batch: int, seq: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int,
                         vocab: int, dtype: str = "float32", seq_ends: Sequence[int] | None = None, layers: int = 1,
                         ignore_index: int | None = None, eps: float = 1e-5, rope_base: float = 500000.0,
                         optimizer: str | None = None, master_dtype: str | None = None) -> Graph:
    """A language model's training graph: token ids -> embedding -> ``layers`` LLaMA-style blocks -> final
    RMSNorm -> LM head -> cross-entropy against the next-token ``targets``, with the gradient of the loss
    with respect to every parameter.  Saves ``loss`` and ``grad.<parameter>`` for each parameter; with
    ``optimizer="adamw"`` (or ``"sgd"``) the parameters are states and the step ends with their update
    (input ``lr``) instead of saving the gradients; ``master_dtype`` keeps master weights and moments in that
    dtype (mixed precision)."""
    g = Graph()
    ids = g.input("ids", [batch, seq], "int64", dims=("batch", "seq"))
    targets = g.input("targets", [batch, seq], "int64", dims=("batch", "seq"))
    leaf = g.state if optimizer is not None else g.parameter

    def weight(name: str, shape: Sequence[int]) -> Tensor:
        return leaf(name, shape, dtype)

    x = g.embedding(weight("embed", [vocab, d_model]), ids, name="embed_lookup")
    for n in range(layers):
        prefix = f"l{n}." if layers > 1 else ""
        x = add_llama_block(g, x, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff, prefix=prefix,
                            seq_ends=seq_ends, eps=eps, rope_base=rope_base, leaf=leaf)
    h = g.rmsnorm(x, weight("final_norm", [d_model]), eps, name="final_rmsnorm")
    logits = g.matmul(h, weight("lm_head", [d_model, vocab]), name="lm_head_proj")
    loss = g.save(g.cross_entropy(logits, targets, ignore_index=ignore_index, name="loss"), name="loss")
    params = g.trainable()
    grads = g.grad(loss, params)
    if optimizer is None:
        for p, d in zip(params, grads):
            g.save(d, name=f"grad.{p.name}")
        return g
    lr = g.input("lr", [1], dtype)
    if optimizer == "adamw":
        adamw(g, params, grads, lr, master_dtype=master_dtype)
    elif optimizer == "sgd":
        sgd(g, params, grads, lr, momentum=0.9, master_dtype=master_dtype)
    else:
        raise GraphError(f"optimizer must be None, 'adamw' or 'sgd'; got {optimizer!r}.")
    return g


# the states rt.optim adds, and their initial values (torch's: zero moments and step, a first-step flag)
OPTIMIZER_STATES = {".exp_avg": 0.0, ".exp_avg_sq": 0.0, "adamw.step": 0.0, ".momentum_buffer": 0.0,
                    ".sgd_first_step": 1.0}  # and ".master": a copy of its parameter


def llama_training_feeds(g: Graph, seed: int = 0, lr: float = 1e-3) -> dict[str, np.ndarray]:
    """:func:`llama_feeds` for the parameters, token ids and targets drawn over the vocabulary, and for a
    training step (``optimizer=``) the optimizer's initial states and the learning rate ``lr``."""
    vocab = g.node("embed").type.shape[0]
    rng = np.random.default_rng(seed)
    feeds = llama_feeds(g, seed)
    for name in ("ids", "targets"):
        feeds[name] = rng.integers(0, vocab, size=g.node(name).type.shape)
    for n in g.inputs:
        fill = next((v for suffix, v in OPTIMIZER_STATES.items() if n.name.endswith(suffix)), None)
        if n.role == "state" and fill is not None:
            feeds[n.name] = np.full(n.type.shape, fill, dtype=numpy_dtype(n.type.dtype))
        elif n.role == "state" and n.name.endswith(".master"):
            feeds[n.name] = np.asarray(feeds[n.name[: -len(".master")]], np.float64).astype(numpy_dtype(n.type.dtype))
        elif n.name == "lr":
            feeds[n.name] = np.full(n.type.shape, lr, dtype=numpy_dtype(n.type.dtype))
    return feeds


def standard_normal(seed: np.random.SeedSequence, shape: Sequence[int], chunk: int = 1 << 22) -> np.ndarray:
    """float32 standard normals of ``shape``, drawn in fixed chunks of ``chunk`` values, each from its
    own generator spawned from ``seed`` and filled on a thread pool (NumPy's generators release the
    GIL): the values depend on the seed and the chunk size only, not on the number of threads."""
    out = np.empty(math.prod(shape), np.float32)
    count = max(1, -(-out.size // chunk))
    # the children spawn() would make, built without advancing ``seed`` (a second call draws the same)
    seeds = [np.random.SeedSequence(seed.entropy, spawn_key=(*seed.spawn_key, i), pool_size=seed.pool_size)
             for i in range(count)]

    def fill(i: int) -> None:
        np.random.default_rng(seeds[i]).standard_normal(out=out[i * chunk:(i + 1) * chunk], dtype=np.float32)

    if count == 1:
        fill(0)
    else:
        with ThreadPoolExecutor(min(count, os.cpu_count() or 1)) as pool:
            list(pool.map(fill, range(count)))
    return out.reshape(tuple(shape))


def _normal_inputs(g: Graph, seed: int) -> Iterator[tuple[Any, np.ndarray]]:
    """Each input of ``g`` with float32 standard normals of its shape (input i from child i of ``seed``)."""
    root = np.random.SeedSequence(seed)
    for i, n in enumerate(g.inputs):
        yield n, standard_normal(np.random.SeedSequence(root.entropy, spawn_key=(i,)), n.type.shape)


def llama_feeds(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every input of ``g`` (weights scaled by 1/sqrt(fan-in), norms near 1)."""
    feeds = {}
    for n, a in _normal_inputs(g, seed):
        if "norm" in n.name:
            a = 1.0 + 0.1 * a
        elif n.role == "parameter":
            a *= np.float32(1 / np.sqrt(n.type.shape[0]))
        feeds[n.name] = a.astype(numpy_dtype(n.type.dtype), copy=False)
    return feeds


def chain_feeds(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random matrices for a chain (:func:`matrix_chain`): normals scaled by 1/sqrt(rows), so every
    product keeps values near one."""
    feeds = {}
    for n, a in _normal_inputs(g, seed):
        a *= np.float32(1 / np.sqrt(n.type.shape[0]))
        feeds[n.name] = a.astype(numpy_dtype(n.type.dtype), copy=False)
    return feeds


# The matrix chains A-E of the paper's section 6: dimensions and the fixed parenthesization
# (nested pairs of matrix indices, 1-based as in the paper).
ChainOrder: TypeAlias = int | tuple["ChainOrder", "ChainOrder"]
CHAINS: dict[str, tuple[tuple[int, ...], ChainOrder]] = {
    "A": ((10240, 16384, 6144, 16384, 6144, 16384, 6144, 16384, 6144, 10240),
          ((1, 2), (((3, 4), ((5, 6), (7, 8))), 9))),
    "B": ((9216, 20480, 5120, 20480, 5120, 9216), ((1, 2), ((3, 4), 5))),
    "C": ((10240, 12288, 32768, 2048), (1, (2, 3))),
    "D": ((24576, 1536, 20480, 20480, 20480, 20480, 20480, 20480, 1536, 24576),
          (1, ((2, (3, (4, (5, (6, (7, 8)))))), 9))),
    "E": ((49152, 1024, *([20480] * 10), 1024, 49152),
          (1, ((2, (3, (4, (5, (6, (7, (8, (9, (10, (11, 12)))))))))), 13))),
}


def chain_dims(name: str, scale: int = 1) -> tuple[int, ...]:
    """The dimensions of chain ``name``, each divided by ``scale`` (at least 1).

    >>> chain_dims("C", scale=1024)
    (10, 12, 32, 2)
    """
    dims, _ = CHAINS[name]
    return tuple(max(1, d // scale) for d in dims)


def matrix_chain(name: str, dtype: str = "float16", scale: int = 1) -> Graph:
    """The paper's chain ``name`` (A-E) as a graph of matmuls in its fixed order, saving ``y``;
    ``scale`` divides every dimension (for tests at small sizes).

    >>> [n.kind for n in matrix_chain("C", scale=1024).operators]
    ['matmul', 'matmul']
    """
    dims, order = chain_dims(name, scale), CHAINS[name][1]
    g = Graph()
    mats = {i: g.input(f"M{i}", [dims[i - 1], dims[i]], dtype) for i in range(1, len(dims))}

    def build(node: ChainOrder) -> Tensor:
        if isinstance(node, int):
            return mats[node]
        left, right = node
        return g.matmul(build(left), build(right))

    g.save(build(order), name="y")
    return g

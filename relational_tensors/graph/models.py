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
from relational_tensors.graph.optim import adamw, clip_grad_norm, sgd

__all__ = ["CausalLM", "lm_prefill_graph", "lm_decode_graph", "cache_name",
           "llama_block", "add_llama_block", "llama_feeds", "llama_training_graph", "llama_training_feeds",
           "optimizer_feeds", "standard_normal", "LLAMA3_8B", "LLAMA3_70B", "matrix_chain",
           "chain_dims", "chain_feeds", "CHAINS"]

# the paper's LLaMA-3-8B-shaped block
LLAMA3_8B: dict[str, Any] = dict(d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336)
LLAMA3_70B: dict[str, Any] = dict(d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672)  # and 80 layers


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
                         optimizer: str | None = None, master_dtype: str | None = None,
                         max_grad_norm: float | None = None) -> Graph:
    """A language model's training graph: token ids -> embedding -> ``layers`` LLaMA-style blocks -> final
    RMSNorm -> LM head -> cross-entropy against the next-token ``targets``, with the gradient of the loss
    with respect to every parameter.  Saves ``loss`` and ``grad.<parameter>`` for each parameter; with
    ``optimizer="adamw"`` (or ``"sgd"``) the parameters are states and the step ends with their update
    (input ``lr``) instead of saving the gradients; ``master_dtype`` keeps master weights and moments in that
    dtype (mixed precision); ``max_grad_norm`` clips the gradients to that global norm first (in the master
    dtype), as ``torch.nn.utils.clip_grad_norm_`` does."""
    if max_grad_norm is not None and optimizer is None:
        raise GraphError(f"max_grad_norm clips the gradients an optimizer applies; got max_grad_norm={max_grad_norm} "
                         "without one. Give optimizer='adamw' or 'sgd', or leave max_grad_norm out.")
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
    if max_grad_norm is not None:
        if master_dtype is not None:
            grads = [g.cast(d, master_dtype) if d.dtype != master_dtype else d for d in grads]
        grads = clip_grad_norm(g, grads, max_grad_norm)
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
    return optimizer_feeds(g, feeds, lr)


def optimizer_feeds(g: Graph, feeds: dict[str, np.ndarray], lr: float = 1e-3) -> dict[str, np.ndarray]:
    """``feeds`` (values of the parameters among them) with a training step's optimizer states set to their
    initial values (zero moments, a step of zero, masters copied from their parameters) and the learning
    rate ``lr``."""
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

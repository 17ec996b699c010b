"""A transformers causal LM's prefill and decode step as pure functions of tensors, and their graphs with
the key/value cache as states.

transformers keeps the cache in a ``Cache`` object that its attention layers update as they run.  Here
the cache is explicit: :func:`decode_graph` traces one decode step of ``batch`` sequences, each layer's keys
and values ``[batch, max_len, kv_heads, head_dim]`` (the attention operator's layout) graph inputs that
become states (``g.state``), and the step's keys and values, written into them at each sequence's write
position (a boolean ``[batch, max_len]`` input, one True per row, none for an idle row), assigned back
(``g.assign``): the cache stays on the devices, laid out as the plan chooses.  :func:`prefill_graph` traces
the prompt's forward and returns its keys and values as outputs, which the caller writes into the decode
program's states.

The attention mask is built here, not by the model: a boolean ``[batch, 1, queries, keys]`` mask (an
additive float one for eager attention), from which keys are real (``keys_ok``), causality, and the sliding
window of the layers that have one (transformers' rule: query index minus key index below the window, on
cache indices).  The frontend reads it as causal attention with key padding (``frontend/torch/masks.py``),
so the attention kernels need no mask tensor.  Positions (``position_ids``) are inputs, as transformers'
``generate`` computes them from the attention mask.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import warnings
from typing import Any

from relational_tensors.errors import GraphError
from relational_tensors.frontend.torch.convert import _torch
from relational_tensors.frontend.torch.torch_graph import TorchGraph
from relational_tensors.frontend.torch.translator import from_torch
from relational_tensors.graph.models import cache_name

__all__ = ["CacheShape", "cache_shape", "prefill_graph", "decode_graph", "cache_name"]


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What a model's key/value cache is: per layer, keys ``[batch, length, kv_heads, key_dim]`` and values
    ``[..., value_dim]`` of ``dtype``; ``window`` per layer (None: full attention)."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: Any  # a torch dtype
    windows: tuple[int | None, ...]
    layer_types: tuple[str, ...] | None  # transformers' per-layer mask keys, where the model takes a dict of masks


def _config(model: Any) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise GraphError(f"generation takes a transformers causal language model (a model with a config, such as "
                         f"LlamaForCausalLM); got {type(model).__name__}.")
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def cache_shape(model: Any) -> CacheShape:
    """The cache of transformers model ``model``, read from its config."""
    config = _config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    value_dim = getattr(config, "v_head_dim", None) or head_dim
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    windows: tuple[int | None, ...]
    if types is not None and _takes_mask_dict(model):
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        layer_types: tuple[str, ...] | None = tuple(types)
    else:
        windows, layer_types = (window,) * layers, None
    if getattr(config, "use_sliding_window", True) is False:
        windows = (None,) * layers
    dtype = next(model.parameters()).dtype
    return CacheShape(layers, kv_heads, head_dim, value_dim, dtype, windows, layer_types)


def _takes_mask_dict(model: Any) -> bool:
    """Whether the model's decoder reads ``attention_mask`` as a dict of masks by layer type (transformers'
    models with sliding and full layers)."""
    inner = getattr(model, "model", model)
    try:
        source = inspect.getsource(type(inner).forward)
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping" in source and "isinstance" in source


@functools.cache
def _cache_class() -> type:
    from transformers.cache_utils import Cache

    base: Any = Cache

    class StepCache(base):  # type: ignore[misc, valid-type]
        """The keys and values of one step, as the attention layers see them: the prompt's own (prefill), or
        the cache with this step's written at the write position (decode); ``new`` records each layer's."""

        def __init__(self, past: list[tuple[Any, Any]] | None, write: Any, layers: int,
                     paged: tuple[Any, Any] | None = None) -> None:
            # decode: ``write`` is [batch], the pool row each sequence writes; ``paged`` the pool row of each
            # of its positions [batch, length] (None: unpaged, a sequence's positions in order)
            self.past, self.write, self.paged = past, write, paged
            self.new: list[tuple[Any, Any] | None] = [None] * layers
            self.layers: list[Any] = []

        def update(self, key: Any, value: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if self.past is None:
                self.new[layer_idx] = (key.transpose(1, 2), value.transpose(1, 2))
                return key, value
            past_k, past_v = self.past[layer_idx]
            if key.shape[2] != 1:
                raise GraphError(f"a decode step writes one token per sequence; layer {layer_idx} got keys of "
                                 f"{key.shape[2]} positions.")
            # each layer's cache is a pool of rows [rows, heads, dim]: write each sequence's row (put_rows, in
            # the state's own block), then read its positions: a paged pool through the table of rows, an
            # unpaged one ([batch * length] rows, a sequence's positions in order) as it lies
            pool_k = past_k.index_put((self.write,), key[:, :, 0])
            pool_v = past_v.index_put((self.write,), value[:, :, 0])
            self.new[layer_idx] = (pool_k, pool_v)
            if self.paged is not None:
                return pool_k[self.paged].transpose(1, 2), pool_v[self.paged].transpose(1, 2)
            b = key.shape[0]
            return (pool_k.reshape(b, -1, *pool_k.shape[1:]).transpose(1, 2),
                    pool_v.reshape(b, -1, *pool_v.shape[1:]).transpose(1, 2))

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

        @property
        def is_compileable(self) -> bool:
            return False

    return StepCache


def _masks(shape: CacheShape, allowed: tuple[Any, ...], distance: Any, dtype: Any, eager: bool) -> Any:
    """The 4-D mask(s) the model's layers read: the ``&`` of the factors ``allowed`` (each [batch or 1,
    queries or 1, keys]) and, per window, keys within it (``distance``, query index minus key index, below
    the window).  Each factor gets its heads axis before they are joined, so that the traced mask is an
    ``&`` of its parts: the frontend reads a constant one (the causal triangle, a window) as the attention's
    structure and one that varies along batch and keys as key padding (``masks.attention_form``), where a
    mask joined first and then expanded is one dense boolean mask."""
    torch = _torch()

    def finish(parts: tuple[Any, ...]) -> Any:
        ok = functools.reduce(operator.and_, [part[:, None] for part in parts])
        return torch.where(ok, 0.0, torch.finfo(dtype).min).to(dtype) if eager else ok

    def windowed(window: int | None) -> tuple[Any, ...]:
        return allowed if window is None else (*allowed, distance < window)

    if shape.layer_types is None:
        return finish(windowed(shape.windows[0]))
    return {kind: finish(windowed(w)) for kind, w in zip(shape.layer_types, shape.windows)}


def _call_model(model: Any, ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1]


def _eager(model: Any) -> bool:
    return getattr(_config(model), "_attn_implementation", "sdpa") == "eager"


def _step_modules(model: Any, shape: CacheShape) -> tuple[type, type]:
    torch = _torch()
    eager = _eager(model)
    base: Any = torch.nn.Module

    class Prefill(base):  # type: ignore[misc, valid-type]
        """(ids [b, s], keys_ok [b, s], positions [b, s]) -> (last logits [b, vocab], k0, v0, k1, ...)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: Any, keys_ok: Any, positions: Any) -> Any:
            s = ids.shape[1]
            index = torch.arange(s, device=ids.device)
            allowed = (keys_ok[:, None, :], (index[None, :] <= index[:, None])[None])
            cache = _cache_class()(None, None, shape.layers)
            distance = (index[:, None] - index[None, :])[None]
            logits = _call_model(self.model, ids, _masks(shape, allowed, distance, shape.dtype, eager), positions,
                                 cache)
            return (logits, *[t for kv in cache.new for t in kv])

    class Decode(base):  # type: ignore[misc, valid-type]
        """(ids [b, 1], keys_ok [b, L], positions [b, 1], write [b, L], k0, v0, ...) -> (logits, k0', v0', ...).
        Each layer's cache is a pool ``[rows, kv_heads, dim]``, and this step's keys and values go to one row
        per sequence: unpaged, ``b * L`` rows, position j of sequence b at row ``b * L + j``, the written one
        at the position ``write`` marks (position 0 where a row marks none: an idle slot, whose cache a join
        replaces); paged, (..., write [b, L], rows [b, L], write_rows [b], k0, v0, ...), position j of
        sequence b at pool row ``rows[b, j]``, the written one ``write_rows[b]``."""

        def __init__(self, paged: bool) -> None:
            super().__init__()
            self.model, self.paged = model, paged

        def forward(self, ids: Any, keys_ok: Any, positions: Any, write: Any, *rest: Any) -> Any:
            tables, past = (rest[:2], rest[2:]) if self.paged else (None, rest)
            length = keys_ok.shape[1]
            index = torch.arange(length, device=ids.device, dtype=torch.float32)  # exact to 2**24 positions
            at = (write.to(torch.float32) * index).sum(1)  # each sequence's write position: its query's index
            distance = (at[:, None] - index[None, :])[:, None, :]
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(shape.layers)]
            if tables is None:
                rows = torch.arange(ids.shape[0], device=ids.device) * length + at.to(torch.int64)
                cache = _cache_class()(pairs, rows, shape.layers)
            else:
                cache = _cache_class()(pairs, tables[1], shape.layers, tables[0])
            logits = _call_model(self.model, ids, _masks(shape, (keys_ok[:, None, :],), distance, shape.dtype, eager),
                                 positions, cache)
            return (logits, *[t for kv in cache.new for t in kv])

    return Prefill, Decode


def _examples(model: Any, batch: int, length: int) -> tuple[Any, Any, Any]:
    torch = _torch()
    device = next(model.parameters()).device
    ids = torch.zeros((batch, length), dtype=torch.int64, device=device)
    ok = torch.ones((batch, length), dtype=torch.bool, device=device)
    return ids, ok, torch.zeros((batch, length), dtype=torch.int64, device=device)


def _trace(module: Any, example: tuple[Any, ...]) -> TorchGraph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_torch(module, example, module_values=False)  # the decoder reads the model's tensors itself


def _rename_outputs(g: TorchGraph, shape: CacheShape) -> None:
    """Outputs ``logits`` and, per layer, ``cache.<i>.k`` / ``cache.<i>.v``."""
    names = ["logits"] + [cache_name(i, w) for i in range(shape.layers) for w in "kv"]
    if len(g.output_names) != len(names):
        raise GraphError(f"the traced step returned {len(g.output_names)} outputs, not the logits and "
                         f"{2 * shape.layers} cache tensors; this is a bug in generation, please report it.")
    g.outputs = {new: g.outputs[old] for old, new in zip(g.output_names, names)}
    g.output_names = tuple(names)
    g.output_leaves = tuple(("saved", n) for n in names)


def prefill_graph(model: Any, batch: int, length: int) -> TorchGraph:
    """The prompt's forward for ``batch`` prompts of ``length`` tokens: inputs ``ids``, ``keys_ok`` (the
    attention mask, boolean) and ``positions``; outputs ``logits`` (the last position's) and each layer's
    keys and values ``cache.<i>.k`` / ``cache.<i>.v`` of the prompt."""
    shape = cache_shape(model)
    prefill, _ = _step_modules(model, shape)
    g = _trace(prefill(), _examples(model, batch, length))
    _rename_outputs(g, shape)
    return g


def decode_graph(model: Any, batch: int, max_len: int, pool_rows: int | None = None) -> TorchGraph:
    """One decode step of ``batch`` sequences over a cache of ``max_len`` positions: inputs ``ids`` [b, 1],
    ``keys_ok`` [b, max_len] (the cache positions each sequence sees, the written one included),
    ``positions`` [b, 1] and ``write`` [b, max_len] (True at the position each sequence writes this step; a
    row without one, an idle slot, writes its position 0); states ``cache.<i>.k`` / ``cache.<i>.v``, each
    ``[b * max_len, kv_heads, dim]`` (sequence b's positions in order from row ``b * max_len``), assigned
    this step's cache; output ``logits``.

    With ``pool_rows`` the cache is paged: each state a pool ``[pool_rows, kv_heads, dim]`` that all sequences
    share, and two more inputs, ``rows`` [b, max_len] (the pool row of each of a sequence's positions) and
    ``write_rows`` [b] (the row each sequence writes this step; an idle one writes a row nobody reads)."""
    torch = _torch()
    shape = cache_shape(model)
    _, decode = _step_modules(model, shape)
    device = next(model.parameters()).device
    ids, _, positions = _examples(model, batch, 1)
    ok = torch.ones((batch, max_len), dtype=torch.bool, device=device)
    write = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
    write[:, 0] = True
    lead = (batch * max_len if pool_rows is None else pool_rows,)
    given: tuple[Any, ...] = (ids, ok, positions, write)
    if pool_rows is not None:
        rows = torch.zeros((batch, max_len), dtype=torch.int64, device=device)
        given = (*given, rows, torch.arange(batch, dtype=torch.int64, device=device) % pool_rows)
    past = []
    for _ in range(shape.layers):
        past.append(torch.zeros((*lead, shape.kv_heads, shape.key_dim), dtype=shape.dtype, device=device))
        past.append(torch.zeros((*lead, shape.kv_heads, shape.value_dim), dtype=shape.dtype, device=device))
    g = _trace(decode(pool_rows is not None), (*given, *past))
    _rename_outputs(g, shape)
    first = len(given)
    names = list(g.input_names)
    for at, table in ((4, "rows"), (5, "write_rows"))[:first - 4]:  # the paged step's tables (traced as *rest)
        traced = names[at]
        assert traced is not None  # the paged step reads both
        node = g.node(traced)
        g.nodes[node.id] = dataclasses.replace(node, name=table)
        g._names.add(table)
        names[at] = table
    g.input_names = tuple(names)
    caches = g.input_names[first:]
    for i, name in enumerate(caches):  # the cache inputs become states, assigned the step's cache
        if name is None:
            raise GraphError("a decode step reads every layer's cache; this model's step ignores one. This is a bug "
                             "in generation, please report it.")
        state = cache_name(i // 2, "kv"[i % 2])
        node = g.node(name)
        g.nodes[node.id] = dataclasses.replace(node, role="state", name=state)
        g._names.add(state)
        value = g.tensor(g.outputs.pop(state))
        g.assign(g.tensor(node.id), value)
    g.input_names = (*g.input_names[:first], *[None] * len(caches))
    g.output_names, g.output_leaves = ("logits",), (("saved", "logits"),)
    return g

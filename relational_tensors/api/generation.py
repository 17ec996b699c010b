"""Generating tokens from a transformers causal LM with planned programs: ``rt.generate`` and ``rt.decoder``.

A :class:`Decoder` holds two kinds of program over one model, each planned on its own (its splits chosen for
its shapes): the **prefill** of a batch of prompts (one program per batch size and padded prompt length) and
the **decode step** (one per batch size), whose key/value cache is a state of the plan, kept on the devices
between steps in the layout the plan chose (``frontend/torch/decoding.py`` builds both graphs).  After a
prefill the prompt's keys and values are written into the decode program's cache states; each step then
loads four small inputs (the new tokens, their positions, the write position and which cache positions each
sequence sees), runs, and returns the last logits as a torch tensor on the plan's device.

Batches follow transformers' ``generate``: prompts padded on the left (``attention_mask`` 0 on padding), all
sequences writing the same cache position each step, positions counted over real tokens only.  Prompt
lengths are padded further on the left to a multiple of :data:`PROMPT_BUCKET` (fewer prefill programs);
models with a sliding window, whose masks count padded positions, keep the exact length.

:func:`generate` runs the loop: greedy (``argmax``) or sampled with temperature, top-k and top-p as
transformers' logits processors apply them, with torch on the logits' device (a seeded ``torch.Generator``:
the same seed gives the same tokens); finished sequences (``eos_token_id``) continue with ``pad_token_id``,
and the loop stops when all have finished.  It returns what ``model.generate`` returns: the prompts and the
new tokens, ``[batch, prompt + new]``.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Sequence
from typing import Any

from relational_tensors.api.compile import compileGraph
from relational_tensors.api.device_io import output, stage
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.frontend.torch.convert import _torch, numpy_to_torch, torch_to_numpy
from relational_tensors.frontend.torch.decoding import CacheShape, cache_name, cache_shape, decode_graph, prefill_graph
from relational_tensors.frontend.torch.translator import TorchGraph

__all__ = ["Decoder", "decoder", "generate", "PROMPT_BUCKET", "LENGTH_BUCKET"]

PROMPT_BUCKET = 16  # prompt lengths padded (on the left) to a multiple of this: one prefill program per bucket
LENGTH_BUCKET = 256  # rt.generate's cache length: prompt + new tokens rounded up to a multiple of this


class _Program:
    """One traced step compiled: its parameters loaded at the first run, then only what changes."""

    def __init__(self, graph: TorchGraph, device: Any, options: dict[str, Any]) -> None:
        self.graph = graph
        self.compiled = compileGraph(graph, device=device, **options)
        self.loaded = False

    @property
    def cuda(self) -> bool:
        return bool(self.compiled.devices.kind == "cuda")

    def feed(self, x: Any) -> Any:
        return x.detach() if self.cuda else torch_to_numpy(x)

    def load(self, feeds: dict[str, Any]) -> None:
        values = {name: self.feed(x) for name, x in feeds.items()}
        if not self.loaded:
            self.compiled.load({**self.graph.parameters, **values})
            self.loaded = True
        elif not stage(self.compiled, values):
            self.compiled.load(values)

    def result(self, name: str) -> Any:
        if self.cuda and hasattr(self.compiled.executor, "offload_into"):
            return output(self.compiled, name)
        return numpy_to_torch(self.compiled.offload(name))

    def run(self, feeds: dict[str, Any], outputs: Sequence[str]) -> list[Any]:
        self.load(feeds)
        self.compiled.execute()
        return [self.result(name) for name in outputs]


class Decoder:
    """Prefill and decode programs of one model (see the module docstring): ``prefill(ids, attention_mask)``
    starts a batch and returns its next-token logits ``[batch, vocab]``; ``decode(next_tokens)`` appends one
    token per sequence and returns the next logits.  ``max_batch`` and ``max_len`` (prompt and generated
    tokens) bound what it accepts; ``device`` and ``compile_options`` are those of ``rt.compileGraph``."""

    def __init__(self, model: Any, max_batch: int, max_len: int, device: Any = None, **compile_options: Any) -> None:
        for what, value in (("max_batch", max_batch), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphError(f"decoder's {what} is a positive int; got {value!r}.")
        self.model = model
        self.shape: CacheShape = cache_shape(model)
        self.max_batch, self.max_len = max_batch, max_len
        self.device = device
        self.options = compile_options
        self._prefills: dict[tuple[int, int], _Program] = {}
        self._decodes: dict[int, _Program] = {}
        self._batch: int | None = None  # the running batch's size, its next write position, its inputs
        self._at = 0
        self._keys_ok: Any = None
        self._positions: Any = None
        self._pending: dict[str, Any] = {}  # caches for a decode program not yet loaded

    # --- programs ---------------------------------------------------------------------------------------
    def prefill_program(self, batch: int, length: int) -> _Program:
        """The prefill program of ``batch`` prompts of ``length`` tokens (planned at first use)."""
        key = (batch, length)
        if key not in self._prefills:
            self._prefills[key] = _Program(prefill_graph(self.model, batch, length), self.device, self.options)
        return self._prefills[key]

    def decode_program(self, batch: int) -> _Program:
        """The decode step of ``batch`` sequences over the ``max_len`` cache (planned at first use)."""
        if batch not in self._decodes:
            self._decodes[batch] = _Program(decode_graph(self.model, batch, self.max_len), self.device, self.options)
        return self._decodes[batch]

    def explain(self, file: Any = None, width: int = 160) -> str:
        """The plans of the programs made so far: each prefill's and each decode step's."""
        out = io.StringIO()
        for (b, s), p in sorted(self._prefills.items()):
            out.write(f"== prefill: {b} prompts of {s} tokens ==\n")
            out.write(p.compiled.explain(file=io.StringIO(), width=width))
        for b, p in sorted(self._decodes.items()):
            out.write(f"== decode step: {b} sequences, cache of {self.max_len} positions ==\n")
            out.write(p.compiled.explain(file=io.StringIO(), width=width))
        text = out.getvalue()
        if file is not None:
            print(text, file=file, end="")
        return text

    # --- running ----------------------------------------------------------------------------------------
    def _bucket(self, length: int) -> int:
        rounded = -(-length // PROMPT_BUCKET) * PROMPT_BUCKET
        if any(w is not None for w in self.shape.windows) or rounded >= self.max_len:
            return length
        return rounded

    def prefill(self, input_ids: Any, attention_mask: Any = None) -> Any:
        """Start a batch: ``input_ids [batch, prompt]`` padded on the left, ``attention_mask`` 1 on real
        tokens (default: all real).  Returns the logits of each prompt's next token ``[batch, vocab]``."""
        torch = _torch()
        ids, mask = _prompt(input_ids, attention_mask)
        b, s = ids.shape
        if b > self.max_batch:
            raise ExecError(f"this decoder takes at most max_batch={self.max_batch} sequences; got {b}. Make the "
                            "decoder with a larger max_batch.")
        if s >= self.max_len:
            raise ExecError(f"a prompt of {s} tokens leaves no room to generate in a cache of max_len="
                            f"{self.max_len} positions; make the decoder with a larger max_len.")
        length = self._bucket(s)
        if length > s:  # more padding on the left: masked, positions unchanged
            ids = torch.cat([torch.zeros((b, length - s), dtype=ids.dtype), ids], 1)
            mask = torch.cat([torch.zeros((b, length - s), dtype=mask.dtype), mask], 1)
        positions = (mask.to(torch.int64).cumsum(-1) - 1).clamp(min=0)
        program = self.prefill_program(b, length)
        place = program.compiled.devices
        dev = f"cuda:{place.physical[0]}" if program.cuda else "cpu"
        ids, mask, positions = ids.to(dev), mask.to(dev), positions.to(dev)
        names = ["logits"] + [cache_name(i, w) for i in range(self.shape.layers) for w in "kv"]
        logits, *kv = program.run({"ids": ids, "keys_ok": mask, "positions": positions}, names)
        step = self.decode_program(b)
        caches = {}
        for name, t in zip(names[1:], kv):
            full = torch.zeros((b, t.shape[1], self.max_len, t.shape[3]), dtype=t.dtype, device=t.device)
            full[:, :, :length] = t
            caches[name] = full
        self._keys_ok = torch.zeros((b, self.max_len), dtype=torch.bool, device=dev)
        self._keys_ok[:, :length] = mask
        self._positions = positions[:, -1:] + 1
        if step.loaded:
            step.load(caches)
        else:
            self._pending = caches
        self._batch, self._at = b, length
        return logits

    def decode(self, next_tokens: Any) -> Any:
        """Append ``next_tokens [batch]`` (or ``[batch, 1]``) to the running batch; returns the logits of the
        token after them ``[batch, vocab]``."""
        torch = _torch()
        if self._batch is None:
            raise ExecError("decode continues a batch that prefill started; call prefill(input_ids) first.")
        if self._at >= self.max_len:
            raise ExecError(f"the cache holds max_len={self.max_len} positions, all used; make the decoder with a "
                            "larger max_len.")
        step = self.decode_program(self._batch)
        tokens = torch.as_tensor(next_tokens).reshape(-1, 1).to(torch.int64).to(self._keys_ok.device)
        if tokens.shape[0] != self._batch:
            raise ExecError(f"decode takes one token per sequence of the batch ({self._batch}); got "
                            f"{tokens.shape[0]}.")
        write = torch.zeros((self.max_len,), dtype=torch.bool, device=tokens.device)
        write[self._at] = True
        self._keys_ok[:, self._at] = True
        feeds = {"ids": tokens, "keys_ok": self._keys_ok, "positions": self._positions, "write": write}
        if not step.loaded:
            feeds.update(self._pending)
            self._pending = {}
        (logits,) = step.run(feeds, ["logits"])
        self._positions = self._positions + 1
        self._at += 1
        return logits

    def __repr__(self) -> str:
        return (f"Decoder({type(self.model).__name__}, max_batch={self.max_batch}, max_len={self.max_len}, "
                f"prefills={sorted(self._prefills)}, decodes={sorted(self._decodes)})")


def _prompt(input_ids: Any, attention_mask: Any) -> tuple[Any, Any]:
    torch = _torch()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                   torch.int32):
        raise GraphError(f"input_ids is an integer torch tensor [batch, prompt]; got "
                         f"{_describe(input_ids)}.")
    ids = input_ids.detach().to("cpu", torch.int64)
    if attention_mask is None:
        mask = torch.ones(ids.shape, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(ids.shape):
            raise GraphError(f"attention_mask has input_ids' shape {tuple(ids.shape)} (1 on real tokens, 0 on "
                             f"padding); got {_describe(attention_mask)}.")
        mask = attention_mask.detach().to("cpu") != 0
        if bool((mask[:, 1:].to(torch.int8) < mask[:, :-1].to(torch.int8)).any()):
            raise GraphError("prompts are padded on the left (attention_mask 0 before the real tokens, as "
                             "transformers' generate expects); a row has padding after a real token. Pad with "
                             "tokenizer.padding_side = 'left'.")
    if ids.shape[1] == 0 or not bool(mask.any(-1).all()):
        raise GraphError("every prompt needs at least one real token; got an empty prompt.")
    return ids, mask


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__} of shape {tuple(shape)} and dtype {getattr(x, 'dtype', None)}" if shape is not None \
        else type(x).__name__


# --- generate ---------------------------------------------------------------------------------------------------

_DECODERS: weakref.WeakKeyDictionary[Any, dict[Any, Decoder]] = weakref.WeakKeyDictionary()


def decoder(model: Any, max_batch: int = 1, max_len: int = 2048, device: Any = None, **compile_options: Any) -> Decoder:
    """A :class:`Decoder` for ``model`` (a transformers causal LM): prefill and decode programs planned for
    ``device`` (as ``rt.compileGraph``'s), the cache ``max_len`` positions long."""
    return Decoder(model, max_batch, max_len, device, **compile_options)


def _select(logits: Any, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
            generator: Any) -> Any:
    """The next tokens from ``logits [batch, vocab]``: greedy, or sampled after transformers' temperature,
    top-k and top-p processors (in that order)."""
    torch = _torch()
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, index = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= (1 - top_p)
        drop[..., -1:] = False  # the most likely token stays
        scores = scores.masked_fill(drop.scatter(1, index, drop), float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _check_sampling(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
                    max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GraphError(f"max_new_tokens is a positive int; got {max_new_tokens!r}.")
    if not do_sample:
        return
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise GraphError(f"temperature divides the logits, a number > 0; got {temperature!r}. For greedy tokens "
                         "pass do_sample=False.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise GraphError(f"top_k keeps the k most likely tokens, an int >= 1 or None; got {top_k!r}.")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise GraphError(f"top_p keeps the most likely tokens whose probabilities sum to top_p, in (0, 1]; got "
                         f"{top_p!r}.")


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def generate(model: Any, input_ids: Any, attention_mask: Any = None, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, seed: int | None = None, device: Any = None,
             **compile_options: Any) -> Any:
    """Generate up to ``max_new_tokens`` tokens after each prompt of ``input_ids [batch, prompt]`` (padded on
    the left, ``attention_mask`` 1 on real tokens) with ``model``, a transformers causal LM, planned for
    ``device``; returns ``[batch, prompt + new]`` as ``model.generate`` does.  ``eos_token_id`` and
    ``pad_token_id`` default to the model's generation config; ``seed`` seeds a generator of its own for
    sampling (default: torch's global one, as transformers draws: ``torch.manual_seed`` makes it repeat).
    ``top_k`` and ``top_p`` of None filter nothing (transformers' generation config defaults top_k to 50).
    The decoder's programs are kept per model and reused by later calls."""
    torch = _torch()
    _check_sampling(do_sample, temperature, top_k, top_p, max_new_tokens)
    ids, mask = _prompt(input_ids, attention_mask)
    config = getattr(model, "generation_config", None)
    eos = _token_ids(eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None))
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    b, s = ids.shape
    need = -(-s // PROMPT_BUCKET) * PROMPT_BUCKET + max_new_tokens
    max_len = -(-need // LENGTH_BUCKET) * LENGTH_BUCKET
    held = _DECODERS.setdefault(model, {})
    key = (repr(device), max_len, b, tuple(sorted((k, repr(v)) for k, v in compile_options.items())))
    dec = held.get(key)
    if dec is None:
        dec = held[key] = Decoder(model, b, max_len, device, **compile_options)
    generator = None
    logits = dec.prefill(ids, mask)
    if do_sample and seed is not None:  # else torch's default generator of the logits' device draws
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(seed)
    eos_t = torch.tensor(eos, dtype=torch.int64, device=logits.device)
    done = torch.zeros(b, dtype=torch.bool, device=logits.device)
    new: list[Any] = []
    for t in range(max_new_tokens):
        token = _select(logits, do_sample, temperature, top_k, top_p, generator)
        if eos:
            token = torch.where(done, torch.full_like(token, pad), token)
            done = done | torch.isin(token, eos_t)
        new.append(token)
        if t == max_new_tokens - 1 or (eos and bool(done.all())):
            break
        logits = dec.decode(token)
    out = torch.stack(new, 1).to(input_ids.device, input_ids.dtype)
    return torch.cat([input_ids, out], 1)

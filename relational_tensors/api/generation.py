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
lengths are padded further on the left to a multiple of :data:`PROMPT_BUCKET` (fewer prefill programs):
masked keys, positions counted over real tokens, and sliding windows over differences of cache indices
make the extra padding change nothing.

:func:`generate` runs the loop: greedy (``argmax``) or sampled with temperature, top-k and top-p as
transformers' logits processors apply them, with torch on the logits' device (a seeded ``torch.Generator``:
the same seed gives the same tokens); finished sequences (``eos_token_id``) continue with ``pad_token_id``,
and the loop stops when all have finished.  It returns what ``model.generate`` returns: the prompts and the
new tokens, ``[batch, prompt + new]``.
"""

from __future__ import annotations

import io
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from relational_tensors.api.compile import compileGraph
from relational_tensors.api.device_io import output, stage
from relational_tensors.errors import ExecError, GraphError, PlanError
from relational_tensors.frontend.torch.convert import (
    _torch,
    _torch_dtype,
    graph_value,
    module_tensor,
    numpy_to_torch,
    torch_to_numpy,
)
from relational_tensors.frontend.torch.decoding import CacheShape, cache_name, cache_shape, decode_graph, prefill_graph
from relational_tensors.frontend.torch.torch_graph import TorchGraph
from relational_tensors.graph.graph import Graph
from relational_tensors.graph.models import CausalLM, lm_decode_graph, lm_prefill_graph
from relational_tensors.machine.devices import parse_devices, visible_gpus

__all__ = ["Decoder", "decoder", "generate", "PROMPT_BUCKET", "LENGTH_BUCKET"]

PROMPT_BUCKET = 16  # prompt lengths padded (on the left) to a multiple of this: one prefill program per bucket
LENGTH_BUCKET = 256  # rt.generate's cache length: prompt + new tokens rounded up to a multiple of this


class _Program:
    """One step compiled: its parameters loaded at the first run, then only what changes; the weights in
    ``bind`` are read in place from the decoder's one copy of them (``compileGraph``'s ``bind``)."""

    def __init__(self, graph: Graph, parameters: Mapping[str, Any], bind: Mapping[str, Any], device: Any,
                 options: dict[str, Any], label: str) -> None:
        self.graph = graph
        self.parameters = parameters
        self.compiled = compileGraph(graph, device=device, bind=bind, **{"label": label, **options})
        self.reads = frozenset(n.name for n in graph.inputs)  # (a step may not read every input it is given)
        self.loaded = False

    @property
    def cuda(self) -> bool:
        return bool(self.compiled.devices.kind == "cuda")

    def feed(self, x: Any) -> Any:
        return x.detach() if self.cuda else torch_to_numpy(x)

    def load(self, feeds: dict[str, Any]) -> None:
        values = {name: self.feed(x) for name, x in feeds.items()}
        if not self.loaded:
            self.compiled.load({**self.parameters, **values})
            self.loaded, self.parameters = True, {}  # (loaded: the program holds them now)
        elif not stage(self.compiled, values):
            self.compiled.load(values)

    def result(self, name: str) -> Any:
        if self.cuda and hasattr(self.compiled.executor, "offload_into"):
            return output(self.compiled, name)
        return numpy_to_torch(self.compiled.offload(name))

    def state(self, name: str) -> Any:
        """State ``name``'s current value as a torch tensor (a copy, on the plan's first GPU or the host)."""
        if self.cuda:  # (bfloat16 comes back as its bit pattern)
            t = _torch().from_dlpack(self.compiled.offload(name, like="cupy"))
            dtype = self.graph.node(name).type.dtype
            return t.view(_torch_dtype(dtype)) if dtype == "bfloat16" else t
        return numpy_to_torch(self.compiled.offload(name))

    def run(self, feeds: dict[str, Any], outputs: Sequence[str]) -> list[Any]:
        self.load(feeds)
        self.compiled.execute()
        return [self.result(name) for name in outputs]


class Decoder:
    """Prefill and decode programs of one model, over ``max_batch`` sequence slots (see the module docstring).

    ``prefill(ids, attention_mask)`` starts a batch in slots 0..b-1 and returns its next-token logits
    ``[b, vocab]``; ``decode(next_tokens)`` appends one token to each running sequence (in slot order) and
    returns the logits of the token after it.  Between steps sequences join (``join``: their prompts
    prefilled into free slots) and leave (``leave``), each with its own length and positions, without
    planning again.  ``max_len`` bounds a sequence (prompt and generated tokens); ``device`` and
    ``compile_options`` are those of ``rt.compileGraph`` (with ``catalog=PATH`` every program of the decoder
    is recorded in one catalog, labelled ``prefill BxS`` or ``decode BxL``).

    With ``block_size`` the cache is **paged**: each layer's keys and values are one pool of ``num_blocks``
    blocks of ``block_size`` positions that all slots share (block 0 is scratch: idle slots write there and
    nothing reads it), a sequence takes a block when it reaches one more ``block_size`` positions and gives
    its blocks back when it leaves, and the decode step reads each sequence's positions through a table of
    pool rows (an input, like the tokens).  ``num_blocks`` defaults to enough for every slot's whole
    ``max_len``; fewer makes sequences share the memory, and a step that finds no free block is refused.

    ``max_prefills`` bounds the prefill programs kept (one per batch size and prompt bucket, each holding its
    activations' memory on the devices): past it, the least recently used is dropped, and planned again if a
    join needs it."""

    def __init__(self, model: Any, max_batch: int, max_len: int, device: Any = None, block_size: int | None = None,
                 num_blocks: int | None = None, max_prefills: int = 4, **compile_options: Any) -> None:
        sizes = (("max_batch", max_batch), ("max_len", max_len), ("block_size", block_size), ("num_blocks", num_blocks),
                 ("max_prefills", max_prefills))
        for what, value in sizes:
            if value is None and what in ("block_size", "num_blocks"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraphError(f"decoder's {what} is a positive int; got {value!r}.")
        if block_size is None and num_blocks is not None:
            raise GraphError(f"num_blocks={num_blocks} sizes a paged cache; give block_size too (positions per "
                             "block), or leave both out for a cache of max_len positions per slot.")
        if block_size is not None and isinstance(model, CausalLM):
            raise GraphError("a paged cache (block_size) is built from a transformers model's attention; a graph-API "
                             "CausalLM's decode step keeps a cache per slot: leave block_size out.")
        if num_blocks is not None and num_blocks < 2:
            raise GraphError(f"a paged cache needs the scratch block and at least one more; got num_blocks="
                             f"{num_blocks}.")
        self._model: Any = lambda: model  # (rt.generate's own decoders hold it weakly: see _held_weakly)
        self.shape: CacheShape = _cache_shape(model)
        self.max_batch, self.max_len = max_batch, max_len
        self.device = device
        self.options = compile_options
        self._prefills: OrderedDict[tuple[int, int], _Program] = OrderedDict()  # least recently used first
        self.max_prefills = max_prefills
        self._decode: _Program | None = None
        # the weights every program reads in place: one copy, taken when the first program is made, in the
        # layout and dtype the graphs hold them (a Linear's weight transposed), on the plan's first GPU or
        # the host; keyed by (module tensor or graph input, transposed, dtype)
        self._weights: dict[tuple[str, bool, str], Any] = {}
        self._where = "cpu"  # the torch device the step's inputs are made on (the plan's first GPU, or the host)
        # per slot: the cache position it writes next (-1: free) and its next token's position
        self._at = [-1] * max_batch
        self._position = [0] * max_batch
        self._keys_ok: Any = None  # [max_batch, max_len] bool on the step's device: the positions each slot sees
        self._writes: list[tuple[int, int, dict[str, Any]]] = []  # (slot, length, layer caches) to write
        self.block_size = block_size
        per_slot = -(-max_len // block_size) if block_size else 0
        self.num_blocks = (num_blocks or max_batch * per_slot + 1) if block_size else None
        self._free = list(range(1, self.num_blocks)) if self.num_blocks else []  # blocks no slot holds
        self._blocks: list[list[int]] = [[] for _ in range(max_batch)]  # per slot: its blocks, in order
        self._rows: Any = None  # [max_batch, max_len] int64: the pool row of each slot's positions (0: scratch)
        # the running slots' step inputs on the step's device, advanced there each step without the host
        # (None after a join or a leave): (slots, their rows, cache positions written next, token positions)
        self._steps: tuple[tuple[int, ...], Any, Any, Any] | None = None
        self._arange: Any = None  # 0..max_len-1 on the step's device

    # --- programs ---------------------------------------------------------------------------------------
    def prefill_program(self, batch: int, length: int) -> _Program:
        """The prefill program of ``batch`` prompts of ``length`` tokens (planned at first use)."""
        key = (batch, length)
        if key not in self._prefills:
            graph, params = _graph(self.model, batch, length, None)
            bind, rest = self._shared(graph, params)
            self._prefills[key] = _Program(graph, rest, bind, self.device, self.options, f"prefill {batch}x{length}")
            while len(self._prefills) > self.max_prefills:
                _, dropped = self._prefills.popitem(last=False)  # its memory goes; the prompts it made are copies
                if dropped.loaded:  # (after its last kernels: the memory may be reused at once)
                    dropped.compiled.synchronize()
        self._prefills.move_to_end(key)
        return self._prefills[key]

    def decode_program(self) -> _Program:
        """The decode step over every slot and the ``max_len`` cache (planned at first use)."""
        if self._decode is None:
            graph, params = _graph(self.model, self.max_batch, 1, self.max_len, self.pool_rows)
            bind, rest = self._shared(graph, params)
            self._decode = _Program(graph, rest, bind, self.device, self.options,
                                    f"decode {self.max_batch}x{self.max_len}")
        return self._decode

    def _shared(self, graph: Graph, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``graph``'s weights split into those its program reads in place from the decoder's one copy (made
        here at first use from the module tensor, transposed and cast as the graph holds it; the step graphs
        are traced without host copies of them) and the rest, which it loads: constants folded at trace time,
        and every weight where the plan spans several GPUs (each GPU is then loaded its blocks alone, not
        given a whole copy) or runs elsewhere (``device="dist"``, a pipeline chosen among several, a plan
        for GPUs this machine does not have)."""
        torch = _torch()
        try:
            devices = parse_devices(self.device)
        except PlanError:  # "dist": each rank loads its blocks
            devices = None
        gpus = sorted(set(devices.physical)) if devices is not None and devices.kind == "cuda" else []
        binds = devices is not None and self.options.get("pipeline") != "auto" and (
            devices.kind == "cpu" or (len(gpus) == 1 and visible_gpus() > gpus[0]))
        where = f"cuda:{gpus[0]}" if binds and gpus else "cpu"
        if isinstance(self.model, CausalLM):  # the graph-API model's weights, by name
            sources = {name: (name, False, params[name]) for name in params}
        else:
            sources = {name: (origin, transposed, _module_tensor(self.model, origin))
                       for name, (origin, transposed) in getattr(graph, "origins", {}).items()}
        bind, rest = {}, dict(params)
        shared = _WEIGHTS.setdefault(self.model, {})
        for name, (origin, transposed, value) in sources.items():
            t = graph.node(name).type
            v = value.detach() if isinstance(value, torch.Tensor) else numpy_to_torch(value)
            v = v.t() if transposed else v
            if tuple(v.shape) != t.shape:
                raise GraphError(f"graph input {name!r} holds the model's {origin!r} of shape {tuple(v.shape)}, not "
                                 f"{t.shape}; this is a bug in generation, please report it.")
            if not binds:  # loaded as it is, from the tensor's own device (device to device on GPUs)
                rest[name] = graph_value(v, t.dtype, bool(gpus))
                continue
            key = (origin, transposed, t.dtype)
            at = (where, origin, transposed, t.dtype)
            if key not in self._weights:
                # another decoder's copy of the same module tensor, unchanged since (torch's version counter,
                # which an optimizer step or a load_state_dict advances), is this one's too
                held = shared.get(at)
                w = None
                if held is not None and isinstance(value, torch.Tensor) and held[0]() is value and \
                        held[1] == value._version:
                    w = held[2]()
                if w is None:
                    w = torch.empty(t.shape, dtype=_torch_dtype(t.dtype), device=where).copy_(v)
                    w = w if where != "cpu" else torch_to_numpy(w)
                    if isinstance(value, torch.Tensor):
                        shared[at] = (weakref.ref(value), value._version, weakref.ref(w))
                self._weights[key] = w
            bind[name] = self._weights[key]
            rest.pop(name, None)
        if isinstance(graph, TorchGraph):  # the folded constants alone: the program loads the rest once
            graph.parameters = {n: v for n, v in rest.items() if n not in sources}
        return bind, rest

    def explain(self, file: Any = None, width: int = 160) -> str:
        """The plans of the programs made so far: each prefill's and the decode step's."""
        out = io.StringIO()
        for (b, s), p in sorted(self._prefills.items()):
            out.write(f"== prefill: {b} prompts of {s} tokens ==\n")
            out.write(p.compiled.explain(file=io.StringIO(), width=width))
        if self._decode is not None:
            out.write(f"== decode step: {self.max_batch} slots, a cache of {self.max_len} positions ==\n")
            out.write(self._decode.compiled.explain(file=io.StringIO(), width=width))
        text = out.getvalue()
        if file is not None:
            print(text, file=file, end="")
        return text

    @property
    def model(self) -> Any:
        """The model whose programs these are."""
        model = self._model()
        if model is None:
            raise ExecError("this decoder's model was deleted; make a decoder of a model you hold.")
        return model

    def _held_weakly(self) -> Decoder:
        """Hold the model by a weak reference (``rt.generate``'s cache of decoders, keyed weakly by the model:
        a decoder holding its key would keep the model, its programs and its weight copies alive forever)."""
        self._model = weakref.ref(self.model)
        return self

    @property
    def pool_rows(self) -> int | None:
        """The rows of each layer's paged cache pool (None: the cache is not paged)."""
        return self.num_blocks * self.block_size if self.block_size and self.num_blocks else None

    @property
    def slots(self) -> list[int]:
        """The slots holding a sequence, in order: ``decode`` takes and returns one row per slot here."""
        return [r for r, at in enumerate(self._at) if at >= 0]

    # --- sequences joining and leaving ----------------------------------------------------------------------
    def _bucket(self, length: int) -> int:
        rounded = -(-length // PROMPT_BUCKET) * PROMPT_BUCKET
        return rounded if rounded < self.max_len else length

    def join(self, input_ids: Any, attention_mask: Any = None) -> tuple[list[int], Any]:
        """Add the sequences of ``input_ids [n, prompt]`` (padded on the left, ``attention_mask`` 1 on real
        tokens) in free slots; returns their slots and the logits of each one's next token ``[n, vocab]``."""
        torch = _torch()
        ids, mask = _prompt(input_ids, attention_mask)
        n, s = ids.shape
        free = [r for r, at in enumerate(self._at) if at < 0]
        if n > len(free):
            raise ExecError(f"{n} sequences join a decoder of max_batch={self.max_batch} slots with {len(free)} free; "
                            "let sequences leave first, or make the decoder with a larger max_batch.")
        if s >= self.max_len:
            raise ExecError(f"a prompt of {s} tokens leaves no room to generate in a cache of max_len="
                            f"{self.max_len} positions; make the decoder with a larger max_len.")
        length = self._bucket(s)
        if length > s:  # more padding on the left: masked, positions unchanged
            ids = torch.cat([torch.zeros((n, length - s), dtype=ids.dtype), ids], 1)
            mask = torch.cat([torch.zeros((n, length - s), dtype=mask.dtype), mask], 1)
        positions = (mask.to(torch.int64).cumsum(-1) - 1).clamp(min=0)
        if self.block_size:
            need = n * -(-length // self.block_size)
            self._check_blocks(need, f"{n} prompt(s) of {length} positions need {need} cache blocks of "
                                     f"{self.block_size}")
        program = self.prefill_program(n, length)
        if program.cuda:
            self._where = f"cuda:{program.compiled.devices.physical[0]}"
        names = [cache_name(i, w) for i in range(self.shape.layers) for w in "kv"]
        feeds = {"ids": ids, "keys_ok": mask, "positions": positions}
        logits, *kv = program.run({k: v.to(self._where) for k, v in feeds.items()}, ["logits", *names])
        if self._keys_ok is None:
            self._keys_ok = torch.zeros((self.max_batch, self.max_len), dtype=torch.bool, device=self._where)
        slots = free[:n]
        if self.block_size:
            self._take_blocks(slots, length)
        # (tensors a step has staged are replaced, never written: its copy may not have read them yet)
        self._keys_ok = self._keys_ok.clone()
        for i, r in enumerate(slots):
            self._writes = [w for w in self._writes if w[0] != r]
            self._writes.append((r, length, {name: t[i] for name, t in zip(names, kv)}))
            self._keys_ok[r] = False
            self._keys_ok[r, :length] = mask[i].to(self._where)
            self._at[r], self._position[r] = length, int(positions[i, -1]) + 1
        self._steps = None
        return slots, logits

    def leave(self, slots: int | Sequence[int]) -> None:
        """Free ``slots``: their sequences end, and a later ``join`` may take them."""
        leaving = [slots] if isinstance(slots, int) else list(slots)
        for r in leaving:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.max_batch or self._at[r] < 0:
                raise ExecError(f"leave takes slots holding a sequence ({self.slots}); got {r!r}.")
        self._steps = None
        self._keys_ok = self._keys_ok.clone()
        if self.block_size:
            self._rows = self._rows.clone()
        for r in leaving:
            self._at[r] = -1
            self._keys_ok[r] = False
            self._writes = [w for w in self._writes if w[0] != r]
            if self.block_size:
                self._free.extend(self._blocks[r])
                self._blocks[r] = []
                self._rows[r] = 0

    def prefill(self, input_ids: Any, attention_mask: Any = None) -> Any:
        """Start a batch: every running sequence leaves, and those of ``input_ids [batch, prompt]`` (padded on
        the left, ``attention_mask`` 1 on real tokens; default all real) join in slots 0..batch-1.  Returns
        the logits of each prompt's next token ``[batch, vocab]``."""
        if self.slots:
            self.leave(self.slots)
        return self.join(input_ids, attention_mask)[1]

    # --- paged cache ---------------------------------------------------------------------------------------
    def _take_blocks(self, slots: Sequence[int], length: int) -> None:
        """Give each of ``slots`` the blocks that hold ``length`` positions (it holds none yet; ``join`` checked
        that enough are free)."""
        torch = _torch()
        assert self.block_size is not None
        if self._rows is None:
            self._rows = torch.zeros((self.max_batch, self.max_len), dtype=torch.int64, device=self._where)
        for r in slots:
            for _ in range(-(-length // self.block_size)):
                self._grow(r)

    def _check_blocks(self, need: int, what: str) -> None:
        """Refuse a join or a step that needs more blocks than are free (``what``: who needs them, in words)."""
        if need > len(self._free):
            raise ExecError(f"{what}; {len(self._free)} of the decoder's num_blocks={self.num_blocks} are free. Let "
                            "sequences leave first, or make the decoder with more num_blocks.")

    def _grow(self, r: int) -> None:
        """One more block for slot ``r``: its next ``block_size`` positions map to the block's pool rows."""
        torch = _torch()
        bs = self.block_size
        assert bs is not None
        block = self._free.pop(0)
        start = len(self._blocks[r]) * bs
        stop = min(start + bs, self.max_len)
        self._blocks[r].append(block)
        self._rows = self._rows.clone()  # (a staged step may not have read the old table yet)
        self._rows[r, start:stop] = torch.arange(block * bs, block * bs + stop - start, device=self._where)

    # --- the decode step ------------------------------------------------------------------------------------
    def _write_caches(self, step: _Program) -> dict[str, Any]:
        """The cache states with the joined sequences' prompts written into their slots (the rest of each
        slot cleared): what to load before the step."""
        torch = _torch()
        if not self._writes:
            return {}
        out = {}
        for i in range(self.shape.layers):
            for w in "kv":
                name = cache_name(i, w)
                cache = step.state(name) if step.loaded else torch.zeros(
                    step.graph.node(name).type.shape, dtype=self.shape.dtype, device=self._where)
                # (unpaged: slot r's positions in order, as rows of a pool or along a [slots, positions] state)
                slots = None if self.block_size else cache.view(self.max_batch, self.max_len, *cache.shape[-2:])
                for r, length, kv in self._writes:
                    if slots is None:  # the prompt's positions into the slot's pool rows
                        cache[self._rows[r, :length]] = kv[name].to(cache.device)
                        continue
                    slots[r] = 0
                    slots[r, :length] = kv[name]
                out[name] = cache
        self._writes = []
        return out

    def decode(self, next_tokens: Any) -> Any:
        """Append ``next_tokens`` (one per running sequence, in the order of ``slots``) and return the logits of
        the token after each ``[len(slots), vocab]``."""
        torch = _torch()
        slots = self.slots
        if not slots:
            raise ExecError("decode continues sequences that prefill or join started; none is running.")
        tokens = torch.as_tensor(next_tokens).reshape(-1).to(self._where, torch.int64)
        if tokens.shape[0] != len(slots):
            raise ExecError(f"decode takes one token per running sequence ({len(slots)}, slots {slots}); got "
                            f"{tokens.shape[0]}.")
        full = [r for r in slots if self._at[r] >= self.max_len]
        if full:
            raise ExecError(f"the cache holds max_len={self.max_len} positions, all used by slot(s) {full}; let "
                            "them leave, or make the decoder with a larger max_len.")
        if self.block_size:  # a slot at the end of its last block takes another
            grow = [r for r in slots if self._at[r] >= len(self._blocks[r]) * self.block_size]
            self._check_blocks(len(grow), f"slot(s) {grow} each need a new cache block of {self.block_size} "
                                          "positions")
            for r in grow:
                self._grow(r)
        step = self.decode_program()
        if self._steps is None or self._steps[0] != tuple(slots):
            self._steps = (tuple(slots), torch.tensor(slots, device=self._where),
                           torch.tensor([self._at[r] for r in slots], device=self._where),
                           torch.tensor([self._position[r] for r in slots], device=self._where))
        _, rows, at, pos = self._steps
        # every input made on the step's device from tensors already there: the host never waits for the GPU,
        # and tensors a step staged are replaced, not written (its copy may still be pending)
        everyone = len(slots) == self.max_batch
        if everyone:
            ids, positions, at_row = tokens.reshape(-1, 1), pos.reshape(-1, 1), at
        else:
            ids = torch.zeros((self.max_batch, 1), dtype=torch.int64, device=self._where).index_put_(
                (rows, torch.zeros_like(rows)), tokens)
            positions = torch.zeros((self.max_batch, 1), dtype=torch.int64, device=self._where).index_put_(
                (rows, torch.zeros_like(rows)), pos)
            at_row = torch.full((self.max_batch,), -1, dtype=torch.int64, device=self._where).index_put_((rows,), at)
        write = self._cache_positions(at_row.device)[None, :] == at_row[:, None]
        self._keys_ok = self._keys_ok | write
        feeds = {"ids": ids, "keys_ok": self._keys_ok, "positions": positions, "write": write}
        if self.block_size:
            write_rows = torch.zeros(self.max_batch, dtype=torch.int64, device=self._where)  # idle: scratch row 0
            write_rows[rows] = self._rows[rows, at]
            feeds.update(rows=self._rows, write_rows=write_rows)
        feeds.update(self._write_caches(step))
        # (a step without sliding windows never reads ``write``)
        (logits,) = step.run({k: v for k, v in feeds.items() if k in step.reads}, ["logits"])
        self._steps = (tuple(slots), rows, at + 1, pos + 1)
        for r in slots:
            self._at[r] += 1
            self._position[r] += 1
        return logits if everyone else logits[rows]

    def _cache_positions(self, device: Any) -> Any:
        """0..max_len-1 on ``device`` (made once)."""
        if self._arange is None or self._arange.device != device:
            self._arange = _torch().arange(self.max_len, device=device)
        return self._arange

    def __repr__(self) -> str:
        return (f"Decoder({type(self.model).__name__}, max_batch={self.max_batch}, max_len={self.max_len}, "
                f"slots={self.slots}, prefills={sorted(self._prefills)})")


def _module_tensor(model: Any, origin: str) -> Any:
    """The tensor of ``model`` that a step graph's input holds, by the name its ``origins`` give it (the step
    modules hold the model as ``model``)."""
    found = module_tensor(model, origin.removeprefix("model."))
    if found is None:
        raise GraphError(f"a step graph reads the model's tensor {origin!r}, which is neither a parameter, a buffer "
                         "nor a tensor attribute of it; this is a bug in generation, please report it.")
    return found


def _cache_shape(model: Any) -> CacheShape:
    """The cache of a transformers model or of a graph-API :class:`CausalLM`."""
    if isinstance(model, CausalLM):
        return CacheShape(model.layers, model.n_kv_heads, model.head_dim, model.head_dim, _torch_dtype(model.dtype),
                          (None,) * model.layers, None)
    return cache_shape(model)


def _graph(model: Any, batch: int, length: int, max_len: int | None,
           pool_rows: int | None = None) -> tuple[Graph, Mapping[str, Any]]:
    """The prefill (``max_len`` None) or decode step's graph of ``model`` (``pool_rows``: over a paged cache)
    and its parameters' values."""
    if isinstance(model, CausalLM):
        feeds = model.feeds()
        if max_len is None:
            return lm_prefill_graph(model, batch, length), feeds
        return lm_decode_graph(model, batch, max_len), feeds
    g = prefill_graph(model, batch, length) if max_len is None else decode_graph(model, batch, max_len, pool_rows)
    return g, g.parameters


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

_DECODERS: weakref.WeakKeyDictionary[Any, OrderedDict[Any, Decoder]] = weakref.WeakKeyDictionary()
KEPT_DECODERS = 2  # rt.generate's decoders kept per model (batch size, cache length, device), least recent dropped

# per model, the weight copies its decoders read in place, by (device, module tensor, transposed, dtype):
# (the tensor and its version counter when copied, the copy), both weakly: a copy lives while a decoder binds it
_WEIGHTS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, bool, str], tuple[Any, int, Any]]] = \
    weakref.WeakKeyDictionary()


def decoder(model: Any, max_batch: int = 1, max_len: int = 2048, device: Any = None, block_size: int | None = None,
            num_blocks: int | None = None, max_prefills: int = 4, **compile_options: Any) -> Decoder:
    """A :class:`Decoder` for ``model`` (a transformers causal LM): prefill and decode programs planned for
    ``device`` (as ``rt.compileGraph``'s), the cache ``max_len`` positions long (``block_size``: paged, in
    ``num_blocks`` blocks that the slots share), at most ``max_prefills`` prefill programs kept."""
    return Decoder(model, max_batch, max_len, device, block_size, num_blocks, max_prefills, **compile_options)


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
    config = getattr(model, "generation_config", None)  # a graph-API CausalLM has none
    eos = _token_ids(eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None))
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    b, s = ids.shape
    need = -(-s // PROMPT_BUCKET) * PROMPT_BUCKET + max_new_tokens
    max_len = -(-need // LENGTH_BUCKET) * LENGTH_BUCKET
    held = _DECODERS.setdefault(model, OrderedDict())
    key = (repr(device), max_len, b, tuple(sorted((k, repr(v)) for k, v in compile_options.items())))
    dec = held.get(key)
    if dec is None:
        dec = held[key] = Decoder(model, b, max_len, device, **compile_options)._held_weakly()
        while len(held) > KEPT_DECODERS:  # each holds its programs and its cache on the devices
            held.popitem(last=False)
    held.move_to_end(key)
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

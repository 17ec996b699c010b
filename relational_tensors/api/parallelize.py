"""A PyTorch module, traced, planned over every device and called like the module: ``rt.parallelize``
returns a :class:`ParallelModule`, a ``torch.nn.Module`` that holds the module it was given.

* **A module as torch users hold one.**  The wrapped module is its submodule ``module``, so
  ``parameters()``, ``state_dict()`` (keys ``module.<name>``, as under ``DistributedDataParallel``),
  ``load_state_dict()``, ``train()``/``eval()`` and ``.to()`` work on it; a call after an optimizer step or
  a ``load_state_dict`` reads the new weights.  It fits in ``nn.Sequential``.
* **Positional and keyword inputs, any output structure.**  A call's ``*args, **kwargs`` are flattened
  (``torch.utils._pytree``): tensors are the program's inputs, other values (``return_dict=True``, a
  scale) are bound at trace time and are part of the signature.  The output has the module's structure:
  a tensor, tuples, dicts, a transformers ``ModelOutput``.
* **One program per signature.** A signature is the inputs' structure, shapes and dtypes, the other
  values, and the train/eval flags of every submodule. Each new signature is traced and planned once and
  kept (``recompile=True``, the default), least recently used dropped beyond ``cache_size`` (each program
  holds its own copy of the weights on the devices; ``cache_info()`` counts); ``recompile=False`` keeps
  the example's signature only (a train/eval switch aside) and refuses others. ``bucket=`` pads the
  sequence axis up to a bucket length so that lengths share a program
  (``relational_tensors.api.buckets``).
* **Pickling** (``torch.save(pm)``, ``copy.deepcopy``) keeps the wrapped module, the example inputs and
  the options, not the compiled programs: the copy plans again at its first call.

>>> import pytest; torch = pytest.importorskip("torch")
>>> from relational_tensors.api.parallelize import parallelize
>>> layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()
>>> x = torch.randn(8, 16)
>>> fast = parallelize(layer, (x,), device="cpu:4")
>>> bool(torch.allclose(fast(x), layer(x), atol=1e-5)), [n.kind for n in fast.graph.operators][:3]
(True, ['matmul', 'binary', 'unary'])
>>> isinstance(fast, torch.nn.Module), sorted(fast.state_dict())[:2]
(True, ['module.0.bias', 'module.0.weight'])
"""

from __future__ import annotations

import functools
import inspect
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from relational_tensors.api.buckets import Buckets, Unpad
from relational_tensors.api.program import Program, snapshot
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.frontend.torch.convert import _dtype_name, _torch
from relational_tensors.frontend.torch.torch_graph import TorchGraph
from relational_tensors.frontend.torch.translator import from_torch

if TYPE_CHECKING:  # to type checkers a ParallelModule is the torch.nn.Module it is at run time
    from torch.nn import Module as _TorchModule
else:
    _TorchModule = object

__all__ = ["parallelize", "ParallelModule", "CacheInfo"]


class CacheInfo(NamedTuple):
    """What ``ParallelModule.cache_info()`` returns (as ``functools.lru_cache``'s): calls that found their
    program, programs compiled, the most kept, and how many are kept now."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


# --- signatures --------------------------------------------------------------------------------------------------

def _split_example(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) from the example inputs: a tensor, a tuple of positional inputs, a dict of keyword
    inputs, or a pair (args tuple, kwargs dict)."""
    torch = _torch()
    e = example_inputs
    if isinstance(e, torch.Tensor):
        return (e,), {}
    if isinstance(e, dict):
        return (), dict(e)
    if isinstance(e, (tuple, list)):
        if len(e) == 2 and isinstance(e[0], (tuple, list)) and isinstance(e[1], dict):
            return tuple(e[0]), dict(e[1])
        return tuple(e), {}
    raise GraphError("example_inputs are a tensor, a tuple of positional inputs, a dict of keyword inputs or a "
                     f"pair (args, kwargs); got {type(e).__name__}.")


def _static(value: Any) -> Any:
    """A non-tensor input as part of a signature: itself where hashable, else its repr."""
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _signature(flat: Sequence[Any], spec: Any) -> tuple[Any, ...]:
    """What a trace depends on in a call's inputs: their structure, each tensor's shape and dtype, each
    other value.  The structure is the tree spec itself (hashed and compared by value, a third of what
    its text costs a call)."""
    torch = _torch()
    return (spec, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", _static(x))
                             for x in flat))


def _labels(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Per flattened input, how an error names it: ``0`` (by position), ``'attention_mask'``, ``0[1]``."""
    pytree = _torch().utils._pytree
    out = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head = path[1]
        first = str(head.idx) if path[0].idx == 0 else repr(head.key)
        out.append(first + "".join(str(k) for k in path[2:]))
    return out


def _input_names(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Per flattened input, the graph input's name: the forward's parameter name it binds to (a keyword's
    own name), with the place inside a nested input appended (``past_0_1``)."""
    pytree = _torch().utils._pytree
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in params if p.kind in kinds]
    var = next((p.name for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL), "args")
    names: list[str] = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head = path[1]
        if path[0].idx == 0:
            base = positional[head.idx] if head.idx < len(positional) else f"{var}_{head.idx - len(positional)}"
        else:
            base = str(head.key)
        name = re.sub(r"\W", "_", "_".join([base, *(re.sub(r"\W", "", str(k)) for k in path[2:])]))
        name = name if name and not name[0].isdigit() else f"input_{name}"
        unique, n = name, 1
        while unique in names:
            unique, n = f"{name}_{n}", n + 1
        names.append(unique)
    return names


def _bound(module: Any, spec: Any, flat: Sequence[Any], names: Sequence[str]) -> Any:
    """``module`` as a module that takes its tensor inputs by position (named ``names``) and calls the
    module's forward with them and the call's other values put back in their places (keywords included).

    It is the same module seen through a subclass: it shares the module's ``__dict__`` (parameters,
    buffers, submodules, hooks, flags), so its tensors have the module's own names, and a trace of it
    records the module's own submodule paths.  Its ``forward`` is a property, which wins over a forward
    set on the instance (accelerate's hooks set one); that one is what it calls."""
    torch = _torch()
    base = type(module)
    positions = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    statics = [None if isinstance(x, torch.Tensor) else x for x in flat]
    pytree = torch.utils._pytree

    def forward(self: Any, *tensors: Any) -> Any:
        values = list(statics)
        for k, t in zip(positions, tensors):
            values[k] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        own = self.__dict__.get("forward")
        return own(*args, **kwargs) if own is not None else base.forward(self, *args, **kwargs)

    only = inspect.Parameter.POSITIONAL_ONLY
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # torch.export names the inputs so
        [inspect.Parameter("self", only), *(inspect.Parameter(names[k], only) for k in positions)])
    view_class = type(base.__name__, (base,), {"forward": property(lambda self: forward.__get__(self)),
                                               "__module__": base.__module__, "__qualname__": base.__qualname__})
    view: Any = object.__new__(view_class)
    object.__setattr__(view, "__dict__", module.__dict__)
    return view


# --- the module ----------------------------------------------------------------------------------------------------

class ParallelModule(_TorchModule):
    """A module planned over every device: a ``torch.nn.Module`` whose ``forward`` runs the plan.

    Made by :func:`parallelize` (or ``ParallelModule(module, example_inputs, device=...)``, the same).
    The class is torch-free so that importing the package needs no torch; the instances are of a subclass
    of it and of ``torch.nn.Module`` made when torch is first needed, so ``isinstance`` holds for both.

    ``module`` is the wrapped module; ``graph``, ``compiled`` and ``explain()`` are those of the program
    the latest call ran (at first, the example's); ``programs`` maps each kept signature to its
    :class:`~relational_tensors.api.program.Program`.
    """

    module: Any  # the wrapped module (a registered submodule)

    def __new__(cls, *args: Any, **kwargs: Any) -> ParallelModule:
        if cls is ParallelModule:  # the torch.nn.Module subclass, made when torch is first needed
            cls = _module_class()
        return cast(ParallelModule, object.__new__(cls))

    def __init__(self, module: Any, example_inputs: Any, device: Any = None, *, recompile: bool = True,
                 cache_size: int = 8, bucket: Sequence[int] | Callable[[int], int] | None = None,
                 **compile_options: Any) -> None:
        torch = _torch()
        if not isinstance(module, torch.nn.Module):
            raise GraphError(f"parallelize takes a torch.nn.Module; got {type(module).__name__}.")
        if not isinstance(cache_size, int) or cache_size < 1:
            raise GraphError(f"cache_size is how many compiled signatures are kept, at least 1; got {cache_size!r}.")
        super().__init__()  # torch.nn.Module's
        self.module = module  # registered: its parameters are this module's
        args, kwargs = _split_example(example_inputs)
        self.example_inputs = (_detached(args), _detached(kwargs))
        self.device = device
        self.compile_options = dict(compile_options)
        self.bucket = bucket
        self.buckets = Buckets(bucket) if bucket is not None else None
        self.recompile = bool(recompile) or self.buckets is not None
        self.cache_size = cache_size
        self._hits = self._misses = 0
        self._reset()
        _ = self._program(*self.example_inputs)[0].compiled  # traced and planned now: what fails, fails here

    def _reset(self) -> None:
        """No compiled program kept (at construction, after unpickling, after ``.to()`` changed the weights'
        dtypes or devices)."""
        self.programs: OrderedDict[Any, Program] = OrderedDict()
        self._unpads: dict[Any, Unpad] = {}
        self._latest: Any = None
        pytree = _torch().utils._pytree
        self._example_signature = _signature(*pytree.tree_flatten(self.example_inputs))
        self._weights = self._weights_signature()

    def _weights_signature(self) -> tuple[Any, ...]:
        return tuple((t.dtype, t.device) for t in (*self.module.parameters(), *self.module.buffers()))

    # --- calls ------------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, run by the program planned for these inputs' signature."""
        program, tensors, unpad = self._program(args, kwargs)
        out = program.call(tuple(tensors), self._weights_key)
        return unpad(out) if unpad is not None else out

    def _program(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Program, list[Any], Callable[[Any], Any] | None]:
        """The program for a call (compiled if new), its tensor inputs, and what undoes bucket padding."""
        torch = _torch()
        pytree = torch.utils._pytree
        flat, spec = pytree.tree_flatten((args, kwargs))
        padded = self.buckets.pad(flat) if self.buckets is not None else None
        if padded is not None:
            flat = padded.flat
        signature = _signature(flat, spec)
        if not self.recompile and signature != self._example_signature:
            raise self._refusal(args, kwargs, flat, spec)
        modes, self._weights_key = snapshot(self.module)  # one walk: the modes here, the weights' versions for
        key = (signature, modes)  # the program's check
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = self._compile(flat, spec, key[1])
            self._misses += 1
            while len(self.programs) > self.cache_size:
                dropped, _ = self.programs.popitem(last=False)  # least recently used
                self._unpads.pop(dropped, None)
        else:
            self._hits += 1
            self.programs.move_to_end(key)
        self._latest = key
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        unpad = None
        if padded is not None and padded.padded:
            assert self.buckets is not None
            if key not in self._unpads:  # checked against torch once per program: the padding is masked
                self._unpads[key] = self.buckets.check(self.module, args, kwargs, pytree.tree_unflatten(flat, spec),
                                                       padded)
            unpad = functools.partial(self._unpads[key], length=padded.length)
        return program, tensors, unpad

    def _compile(self, flat: list[Any], spec: Any, modes: tuple[bool, ...]) -> Program:
        """Trace the module on these inputs (planned when first run)."""
        torch = _torch()
        pytree = torch.utils._pytree
        args, kwargs = pytree.tree_unflatten(flat, spec)
        tensors = tuple(x.detach() for x in flat if isinstance(x, torch.Tensor))
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            traced = self.module  # tensors by position: the module itself
        else:
            traced = _bound(self.module, spec, flat, _input_names(self.module, args, kwargs))
        # traced without copies of the module's tensors (planning reads shapes only); their values are read
        # from the tensors themselves, on the device where the plan is on GPUs (no host copy of the model)
        graph: TorchGraph = from_torch(traced, tensors, module_values=False)
        # the forward is planned when first run: a call with grad enabled runs the training program instead
        program = Program(graph, None, traced, tensors, self.device, self.compile_options, modes)
        values = program._read_origins(graph, set())
        if values is None:  # a module tensor the trace saw is no attribute of the module: as traced
            program.graph = graph = from_torch(traced, tensors)
        else:
            graph.parameters = values
        return program

    def _refusal(self, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], spec: Any) -> ExecError:
        """Why a call's inputs are not the example's, when shapes are static."""
        torch = _torch()
        pytree = torch.utils._pytree
        fix = (" This module was parallelized with recompile=False (one signature): parallelize it again with "
               "example inputs of the new shape, or leave recompile out to compile each new signature once.")
        ex_args, ex_kwargs = self.example_inputs
        ex_flat, ex_spec = pytree.tree_flatten(self.example_inputs)
        if str(ex_spec) != str(spec):
            if not kwargs and not ex_kwargs and len(args) != len(ex_args):
                return ExecError(f"this module was traced with {len(ex_args)} inputs; got {len(args)}.{fix}")
            return ExecError(f"this module was traced with inputs ({', '.join(_labels(ex_args, ex_kwargs))}); got "
                             f"({', '.join(_labels(args, kwargs))}).{fix}")
        for label, x, want in zip(_labels(args, kwargs), flat, ex_flat):
            if isinstance(want, torch.Tensor) and isinstance(x, torch.Tensor):
                if tuple(x.shape) != tuple(want.shape) or x.dtype != want.dtype:
                    return ExecError(f"input {label} must have the traced shape {tuple(want.shape)} and dtype "
                                     f"{_dtype_name(want.dtype) or want.dtype}; got {tuple(x.shape)} "
                                     f"{_dtype_name(x.dtype) or x.dtype}.{fix}")
            elif isinstance(want, torch.Tensor) or isinstance(x, torch.Tensor):
                return ExecError(f"input {label} was a {type(want).__name__} when traced; got {type(x).__name__}."
                                 f"{fix}")
            elif _static(x) != _static(want):
                return ExecError(f"input {label} was {want!r} when traced (it is bound into the program); got "
                                 f"{x!r}.{fix}")
        return ExecError(f"these inputs do not match the traced signature.{fix}")  # pragma: no cover

    # --- what the latest call ran -----------------------------------------------------------------------------
    def _current(self) -> Program:
        if self._latest not in self.programs:  # none yet (unpickled, or .to() changed the weights): the example's
            self._program(*self.example_inputs)
        return self.programs[self._latest]

    @property
    def graph(self) -> TorchGraph:
        """The traced graph of the program the latest call ran."""
        return self._current().graph

    @property
    def compiled(self) -> Any:
        """The ``CompiledGraph`` of the program the latest call ran (``plan``, ``catalog``, ``sql()``)."""
        return self._current().compiled

    def explain(self, file: Any = None, width: int = 160) -> str:
        """Print (and return) the plan table of the program the latest call ran."""
        return self._current().explain(file=file, width=width)

    def reload_weights(self) -> None:
        """Read the module's current parameters and buffers into every kept program (a call does it itself
        when they changed)."""
        for program in self.programs.values():
            program.reload_weights()

    def cache_info(self) -> CacheInfo:
        """Calls that found their program (hits), programs compiled (misses), ``cache_size``, programs kept."""
        return CacheInfo(self._hits, self._misses, self.cache_size, len(self.programs))

    def cache_clear(self) -> None:
        """Drop every compiled program (the next call plans again)."""
        self._reset()

    # --- torch.nn.Module ---------------------------------------------------------------------------------------
    def _apply(self, fn: Callable[[Any], Any], recurse: bool = True) -> Any:
        # .to(), .double(), .cuda(), ...: the example inputs follow the weights (a floating example becomes
        # float64 with them), and programs traced for the old dtypes or devices are dropped
        out = cast(Any, super())._apply(fn, recurse)
        if self._weights_signature() != self._weights:
            torch = _torch()
            self.example_inputs = torch.utils._pytree.tree_map(
                lambda x: fn(x) if isinstance(x, torch.Tensor) else x, self.example_inputs)
            self._reset()
        return out

    def extra_repr(self) -> str:
        if self._latest not in self.programs:
            return f"device={self.device!r}, not compiled"
        p = self.programs[self._latest]
        planned = (f" on {p._compiled.devices}, plan cost {p._compiled.plan.cost:,.0f}" if p._compiled is not None
                   else f" for device={self.device!r}")
        return f"{len(p.graph.operators)} operators{planned}, {len(self.programs)} of {self.cache_size} programs kept"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the compiled programs (DuckDB connections, device buffers) are not pickled: the copy plans again
        skip = {"programs", "_unpads", "_latest", "_hits", "_misses", "_weights_key"}
        return _unpickle, ({k: v for k, v in self.__dict__.items() if k not in skip},)


def _detached(value: Any) -> Any:
    torch = _torch()
    return torch.utils._pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


def _unpickle(state: dict[str, Any]) -> Any:
    """A pickled ParallelModule back, with no program compiled yet."""
    pm: Any = object.__new__(_module_class())
    pm.__dict__.update(state)
    pm._hits = pm._misses = 0
    pm._reset()
    return pm


@functools.cache
def _module_class() -> type:
    """The ``torch.nn.Module`` subclass of :class:`ParallelModule` its instances are (made once torch is there)."""
    torch = _torch()
    base: Any = torch.nn.Module
    return type("ParallelModule", (ParallelModule, base), {"__module__": __name__, "__doc__": ParallelModule.__doc__})


def parallelize(module: Any, example_inputs: Any, device: Any = None, *, recompile: bool = True,
                cache_size: int = 8, bucket: Sequence[int] | Callable[[int], int] | None = None,
                **compile_options: Any) -> ParallelModule:
    """Trace ``module`` on ``example_inputs``, plan it for ``device`` and return it as a ``ParallelModule``.

    ``example_inputs``: a tensor, a tuple of positional inputs, a dict of keyword inputs, or a pair
    ``(args, kwargs)``.  ``recompile``: compile each new input signature once (else a call whose inputs
    differ from the example's in structure, shape or dtype is refused); ``cache_size``: how many compiled
    signatures are kept (least recently used dropped); ``bucket``: sequence lengths (or a function of the
    length) to pad the sequence axis up to, see ``relational_tensors.api.buckets`` (implies ``recompile``).
    ``device`` and ``compile_options`` are those of ``rt.compileGraph`` (``"cpu:N"``, a GPU count or list,
    ``selector=``, ``cost_model=``, ``memory_per_device=``, ...).
    """
    return ParallelModule(module, example_inputs, device, recompile=recompile, cache_size=cache_size,
                          bucket=bucket, **compile_options)

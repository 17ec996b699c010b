"""One traced and compiled signature of a parallelized module: a :class:`Program` runs the plan for inputs
of one set of shapes and dtypes, in one train/eval mode, and is differentiable.

Called with grad enabled and parameters (or inputs) that require grad, a program is differentiable: its
outputs require grad, and ``loss.backward()`` fills each parameter's ``.grad`` and each input's that
requires one.  Both run one compiled program, the traced forward with its gradient graph appended
(``g.vjp``), in two phases: the call runs the forward phase, whose activations stay on the devices, and
the backward loads the output cotangents and runs the rest.  A backward whose forward is no longer the
program's latest (two calls before one backward) runs its forward phase again from the saved inputs.

``rt.parallelize`` (``relational_tensors.api.parallelize``) keeps one program per signature it is called
with; this module knows nothing of signatures, keywords or caching.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

from relational_tensors.api.device_io import output, stage
from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.errors import ExecError, PlanError
from relational_tensors.frontend.torch.convert import _torch, graph_value, module_tensor, numpy_to_torch, torch_to_numpy
from relational_tensors.frontend.torch.torch_graph import TorchGraph, _prune, draw_rng
from relational_tensors.frontend.torch.translator import from_torch
from relational_tensors.graph.autodiff import flows

__all__ = ["Program", "in_modes", "snapshot"]

FORWARD = "forward"  # the key of the forward program's weights in ``Program._stale``


def _on_gpus(device: Any) -> bool:
    """Whether ``device`` (``rt.compileGraph``'s) plans on GPUs of this process."""
    from relational_tensors.machine.devices import parse_devices

    try:
        return parse_devices(device).kind == "cuda"
    except PlanError:  # "dist" (parse_devices does not name it): its weights go through the host as before
        return False


WeightsKey = tuple[tuple[int, int, int], ...]


def snapshot(module: Any) -> tuple[tuple[bool, ...], WeightsKey]:
    """The train/eval flag of ``module`` and of each of its submodules (what a trace depends on besides the
    inputs: dropout, batch norm), and the identity, storage and in-place version of each parameter and buffer
    (``Program``'s weights key), in one walk of the modules (``module.modules()`` order, without the names
    ``named_modules`` builds): what every call checks, so its cost counts."""
    modes, key, seen, stack = [], [], set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        modes.append(m.training)
        for held in (m._parameters, m._buffers):
            for t in held.values():
                if t is not None:
                    key.append((id(t), t.data_ptr(), t._version))
        if m._modules:
            stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return tuple(modes), tuple(key)


@contextlib.contextmanager
def in_modes(module: Any, modes: tuple[bool, ...] | None) -> Iterator[None]:
    """``module`` (and its submodules) set to the flags ``modes`` for the block, and put back after it."""
    if modes is None:
        yield
        return
    subs = list(module.modules())
    now = tuple(m.training for m in subs)
    if len(subs) != len(modes) or now == modes:
        yield
        return
    try:
        for m, flag in zip(subs, modes):
            m.training = flag
        yield
    finally:
        for m, flag in zip(subs, now):
            m.training = flag


class Program:
    """A module compiled for one signature: ``__call__(*tensors)`` returns what the module's forward returns.

    ``module`` is what was traced (it takes the tensors by position), ``example_inputs`` the tensors it was
    traced on and ``modes`` the train/eval flags of its submodules then (``snapshot``): a trace done again
    (a fold to redo, the differentiated trace) is made in those modes.  Parameters are loaded onto the
    devices once, at the first call; each call then loads its inputs, executes the plan and offloads the
    outputs as torch tensors (sharing memory with the offloaded arrays: ``torch.from_numpy`` on CPU
    devices, DLPack on GPUs).  ``graph`` is the traced :class:`TorchGraph`, ``compiled`` the
    ``CompiledGraph`` (``plan``, ``catalog``, ``explain()``, ``sql()``).

    A call after the module's parameters or buffers changed (in place, as an optimizer step or
    ``load_state_dict`` does, or replaced) reads them again first (:meth:`reload_weights`).
    """

    def __init__(self, graph: TorchGraph, compiled: Any | None, module: Any, example_inputs: tuple[Any, ...],
                 device: Any = None, compile_options: dict[str, Any] | None = None,
                 modes: tuple[bool, ...] | None = None) -> None:
        self.graph = graph
        self._compiled = compiled
        self.module = module
        self.example_inputs = example_inputs
        self.device = device
        self.compile_options = dict(compile_options or {})
        self.modes = modes
        # training programs by (wrt, the outputs given a cotangent: None for every one a gradient reaches)
        self._backwards: dict[tuple[tuple[str, ...], tuple[str, ...] | None],
                              tuple[TorchGraph, Any, tuple[str, ...]]] = {}
        self._given: dict[tuple[str, ...], tuple[str, ...] | None] = {}  # wrt -> the outputs its last backward read
        # the module traced with its trainable parameters differentiated (made at the first call that needs it),
        # and the parameters of it that get a gradient
        self._differentiated: TorchGraph | None = None
        self._with_grad: frozenset[str] = frozenset()
        self._holders: tuple[Any, dict[str, list[tuple[str, bool]]]] = (None, {})  # _graph_inputs_of's index
        # per program (FORWARD, or a training program's key): the graph inputs read again since its last load,
        # to load before its next run; a program absent has none of its weights loaded (its first load, or a
        # trace done again) and loads them all
        self._stale: dict[Any, set[str]] = {}
        # weights read again stay on the GPU where the plan is on GPUs (loaded device to device)
        self._device_weights = _on_gpus(device)
        self._calls = 0  # differentiable calls so far
        # wrt -> (the call whose first phase is on the devices, the program's outputs), or None
        self._latest: dict[tuple[str, ...], tuple[int, tuple[str, ...] | None] | None] = {}
        self._partial_loads = True  # whether the executor keeps inputs that a load does not name
        self._state = self._module_state()
        self._key = self._state_key()

    def _module_state(self) -> dict[str, tuple[int, int, int]]:
        """Per parameter and buffer of the module: its identity, storage and in-place version counter."""
        tensors = [*self.module.named_parameters(), *self.module.named_buffers()]
        return {name: (id(t), t.data_ptr(), t._version) for name, t in tensors}

    def _state_key(self) -> WeightsKey:
        """The same facts of every parameter and buffer, in the modules' order, without their names: what a
        call checks (half the cost of naming them); only when it changes are the named states compared."""
        return snapshot(self.module)[1]

    @property
    def compiled(self) -> Any:
        """The forward's ``CompiledGraph``, planned at first use (a call with grad enabled runs the training
        program instead, planned by :meth:`_backward_program`)."""
        if self._compiled is None:
            from relational_tensors.api.compile import compileGraph

            self._compiled = compileGraph(self.graph, device=self.device, **self.compile_options)
        return self._compiled

    def _trace(self, differentiate: bool = False) -> TorchGraph:
        """The module traced again on the example inputs, in the modes it was first traced in (what tracing
        warns about was said the first time)."""
        with in_modes(self.module, self.modes), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return from_torch(self.module, self.example_inputs, differentiate=differentiate)

    def reload_weights(self) -> None:
        """Read the module's current parameters and buffers (after training steps or a load_state_dict);
        the next call loads them onto the devices."""
        now = self._module_state()
        changed = {n for n in set(now) | set(self._state) if now.get(n) != self._state.get(n)}
        values = self._read_origins(self.graph, changed)
        if values is None:  # the module's tensors changed shape or names, or a fold must be redone: trace again
            again = self._trace()
            if set(again.parameters) != set(self.graph.parameters):
                raise ExecError("the module no longer traces to the planned graph (its parameters differ); "
                                "parallelize it again.")
            values = again.parameters
            self._stale.pop(FORWARD, None)  # every weight loaded again
        self._mark_stale(FORWARD, self.graph.parameters, values)
        self.graph.parameters = values
        self._state = now
        self._key = self._state_key()
        if self._differentiated is not None:
            fresh = self._read_origins(self._differentiated, changed)
            if fresh is None:  # its folds are stale: traced again when next needed
                self._differentiated = None
            else:
                self._differentiated.parameters = fresh
        for key, (g, _, _) in list(self._backwards.items()):
            fresh = self._read_origins(g, changed)
            if fresh is None:
                del self._backwards[key]
                self._stale.pop(key, None)
            else:
                self._mark_stale(key, g.parameters, fresh)
                g.parameters = fresh

    def _mark_stale(self, key: Any, old: dict[str, Any], new: dict[str, Any]) -> None:
        """Note the weights of program ``key`` whose values were read again (a new value object)."""
        if key in self._stale:
            self._stale[key].update(n for n, v in new.items() if old.get(n) is not v)

    def _weights_to_load(self, key: Any, graph: TorchGraph) -> dict[str, Any] | None:
        """The weights program ``key`` must load before its next run: None for all of them (none loaded
        yet), else those read again since its last load (then none are pending)."""
        if key not in self._stale:
            return None
        stale, self._stale[key] = self._stale[key], set()
        return {n: graph.parameters[n] for n in stale if n in graph.parameters}

    def _read_origins(self, graph: TorchGraph, changed: set[str]) -> dict[str, Any] | None:
        """``graph``'s inputs' values read straight from the module's tensors they hold (transposed and cast
        as traced), or None where one no longer fits or a constant folded at trace time was computed from
        one of the ``changed`` tensors (the fold is redone by tracing again).  Only the inputs held by a
        ``changed`` tensor get a new value; on GPUs a CUDA tensor's stays a CUDA tensor (loaded device to
        device: no host copy of the model per optimizer step)."""
        if any(changed.intersection(deps) for deps in graph.derived.values()):
            return None
        values = dict(graph.parameters)
        for name, (origin, transposed) in graph.origins.items():
            t = module_tensor(self.module, origin)
            if t is None:
                return None
            if origin not in changed and name in values:
                continue
            v = t.t() if transposed else t
            node = graph.node(name)
            if tuple(v.shape) != node.type.shape:
                return None
            values[name] = graph_value(v, node.type.dtype, self._device_weights)
        return values

    def explain(self, file: Any = None, width: int = 160) -> str:
        """Print (and return) the plan table of the compiled graph."""
        return self.compiled.explain(file=file, width=width)

    def _check(self, inputs: tuple[Any, ...]) -> None:
        torch = _torch()
        want = self.graph.input_types
        if len(inputs) != len(want):
            raise ExecError(f"this module was traced with {len(want)} inputs; got {len(inputs)}.")
        for k, (x, (shape, dtype)) in enumerate(zip(inputs, want)):
            if not isinstance(x, torch.Tensor):
                raise ExecError(f"input {k} must be a torch tensor; got {type(x).__name__}.")
            if tuple(x.shape) != shape or str(x.dtype).removeprefix("torch.") != dtype:
                raise ExecError(
                    f"input {k} must have the traced shape {shape} and dtype {dtype}; got {tuple(x.shape)} "
                    f"{str(x.dtype).removeprefix('torch.')}. A program is planned for one signature: call the "
                    "module rt.parallelize returned, which plans each new one once."
                )

    def _feed(self, x: Any, compiled: Any = None) -> Any:
        # on GPUs the executor copies any __dlpack__ tensor device to device; on CPUs NumPy views it
        return x.detach() if (compiled or self.compiled).devices.kind == "cuda" else torch_to_numpy(x)

    def _load(self, inputs: tuple[Any, ...]) -> None:
        user = {name: self._feed(x) for name, x in zip(self.graph.input_names, inputs) if name is not None}
        if self.graph.rng_input is not None:  # train-mode dropout and other draws: a new state per call
            user[self.graph.rng_input] = draw_rng()
        weights = self._weights_to_load(FORWARD, self.graph) if self._partial_loads else None
        if weights is not None:
            try:
                if weights:  # read again after an optimizer step: device to device on GPUs
                    self.compiled.load(weights)
                if stage(self.compiled, user):  # CUDA tensors on GPUs: no host wait
                    return
                self.compiled.load(user)
                return
            except ExecError as e:
                if "missing a value" not in str(e):
                    raise
                # this executor wants every input on each load: feed the parameters again from now on
                self._partial_loads = False
        self.compiled.load({**self.graph.parameters, **user})
        self._stale[FORWARD] = set()

    def _offload(self, name: str, compiled: Any = None) -> Any:
        """Saved output ``name`` of ``compiled`` (default: the forward program) as a torch tensor."""
        compiled = compiled or self.compiled
        if compiled.devices.kind == "cuda" and hasattr(compiled.executor, "offload_into"):
            return output(compiled, name)  # a torch CUDA tensor, filled on the launch stream
        return numpy_to_torch(compiled.offload(name))

    def _run_forward(self, inputs: tuple[Any, ...]) -> dict[str, Any]:
        self._load(inputs)
        self.compiled.execute()
        self._update_buffers(self.graph, self.compiled)
        return {name: self._offload(name) for kind, name in self.graph.output_leaves if kind == "saved"}

    def _update_buffers(self, graph: TorchGraph, compiled: Any) -> None:
        """The module's buffers that its forward updates (batch norm's running statistics and counter in
        training mode) take their new values in place, as the module's own forward leaves them; the next call
        reads them again (their versions changed)."""
        if not graph.buffer_updates and not graph.buffer_increments:
            return
        torch = _torch()
        with torch.no_grad():
            for name, out in graph.buffer_updates.items():
                buf = self.module.get_buffer(name)
                buf.copy_(self._offload(out, compiled).to(buf.device, buf.dtype))
            for name, step in graph.buffer_increments.items():
                buf = self.module.get_buffer(name)
                buf.add_(step.to(buf.device, buf.dtype))

    def _differentiable(self) -> TorchGraph:
        """The module traced with every parameter that requires grad differentiated (held once, each use
        computed in the graph)."""
        if self._differentiated is None:
            g = self._trace(differentiate=True)
            outs = [g.tensor(g.outputs[n]) for kind, n in g.output_leaves if kind == "saved"
                    and g.nodes[g.outputs[n]].type.dtype in FLOAT_DTYPES]
            self._differentiated, self._with_grad = g, frozenset(g.trained(outs))
        return self._differentiated

    def _trainable(self) -> list[tuple[str, Any]]:
        """The module's parameters that require grad and that some floating output depends on through
        floating tensors (torch gives the others no gradient)."""
        wanted = [(k, t) for k, t in self.module.named_parameters() if t.requires_grad]
        if not wanted:
            return []
        self._differentiable()
        return [(k, t) for k, t in wanted if k in self._with_grad]

    def _graph_inputs_of(self, param: str) -> list[tuple[str, bool]]:
        """The graph inputs holding module parameter ``param``, and whether each holds it transposed (an
        index made once per differentiated trace: every differentiable call asks it of every parameter)."""
        g = self._differentiable()
        if self._holders[0] is not g:
            index: dict[str, list[tuple[str, bool]]] = {}
            for name, (origin, t) in g.origins.items():
                index.setdefault(origin, []).append((name, t))
            self._holders = (g, index)
        return self._holders[1].get(param, [])

    def __call__(self, *inputs: Any) -> Any:
        return self.call(inputs)

    def call(self, inputs: tuple[Any, ...], weights_key: WeightsKey | None = None) -> Any:
        """``self(*inputs)``, with the module's weights key (``snapshot``) when the caller walked it already."""
        torch = _torch()
        self._check(inputs)
        key = self._state_key() if weights_key is None else weights_key
        if key != self._key:  # an optimizer step or a load_state_dict: read what changed again
            if self._module_state() != self._state:
                self.reload_weights()
            self._key = key
        grad = torch.is_grad_enabled()
        params = self._trainable() if grad else []  # under no_grad no parameter is walked for a gradient
        floating = [x.is_floating_point() and x.requires_grad for x in inputs]
        if grad and (params or any(floating)):
            saved = _function().apply(self, len(inputs), tuple(k for k, _ in params), *inputs,
                                          *(t for _, t in params))
            values = dict(zip([n for kind, n in self.graph.output_leaves if kind == "saved"], saved))
        else:
            values = self._run_forward(inputs)
        leaves = [values[value] if kind == "saved" else value for kind, value in self.graph.output_leaves]
        return torch.utils._pytree.tree_unflatten(leaves, self.graph.out_spec)

    def _backward_program(self, wrt: tuple[str, ...], given: tuple[str, ...] | None = None
                          ) -> tuple[TorchGraph, Any, tuple[str, ...]]:
        """The traced forward with the gradient with respect to ``wrt`` (graph input names) of every floating
        output a gradient reaches (of those in ``given`` only, when given: torch's backward skips the outputs
        the loss does not read) appended, compiled like the forward in two phases: the cotangents, inputs
        ``cot.<output>``, are loaded for the second."""
        key = (wrt, given)
        if key not in self._backwards:
            from relational_tensors.api.compile import compileGraph

            g = _prune(self._differentiable())  # a copy to append the gradient to (nodes are shared)
            targets = [g.tensor(g.node(w).id) for w in wrt]
            # the floating outputs some of ``wrt`` reaches through floating tensors (a histogram of the
            # weights, or an output of the inputs alone, takes no cotangent: torch gives it no grad_fn)
            outs = [n for kind, n in g.output_leaves if kind == "saved"
                    and g.nodes[g.outputs[n]].type.dtype in FLOAT_DTYPES
                    and (given is None or n in given)
                    and any(flows(g, [g.tensor(g.outputs[n])], targets))]
            if not outs:
                raise ExecError("the module has no floating output to differentiate.")
            cots = [g.input(f"cot.{n}", g.nodes[g.outputs[n]].type.shape, g.nodes[g.outputs[n]].type.dtype)
                    for n in outs]
            grads = g.vjp([g.tensor(g.outputs[n]) for n in outs], cots, targets, allow_unused=True)
            for w, d in zip(wrt, grads):
                g.save(d, name=f"grad.{w}")
            compiled = compileGraph(g, device=self.device, second_phase_inputs=[c.name for c in cots],
                                    **self.compile_options)
            self._backwards[key] = (g, compiled, tuple(outs))
        return self._backwards[key]

    def _run_forward_phase(self, inputs: tuple[Any, ...], wrt: tuple[str, ...], rng: Any, call: int,
                           given: Any = "last", update_buffers: bool = False) -> dict[str, Any]:
        """The training program's first phase on ``inputs`` with random state ``rng`` (weights loaded when
        they changed); its activations stay on the devices for the backward of ``call``.  The program is the
        one for the outputs ``given`` a cotangent (by default those the last backward of ``wrt`` read).
        Returns the saved outputs."""
        given = self._given.get(wrt) if given == "last" else given
        g, compiled, _ = self._backward_program(wrt, given)
        feeds = {name: self._feed(x, compiled) for name, x in zip(g.input_names, inputs) if name is not None}
        if g.rng_input is not None:
            feeds[g.rng_input] = rng
        weights = self._weights_to_load((wrt, given), g)
        if weights is None:  # its first run: every weight with the inputs
            feeds = {**g.parameters, **feeds}
            self._stale[(wrt, given)] = set()
        elif weights:  # read again after an optimizer step: device to device on GPUs
            compiled.load(weights)
        if not stage(compiled, feeds):
            compiled.load(feeds)
        compiled.execute(phase=0)
        self._latest[wrt] = (call, given)
        if update_buffers:  # the call's own forward, not a backward's rerun of it
            self._update_buffers(g, compiled)
        return {name: self._offload(name, compiled) for kind, name in g.output_leaves if kind == "saved"}

    def _run_backward(self, inputs: tuple[Any, ...], cotangents: dict[str, Any], wrt: tuple[str, ...],
                      call: int, rng: Any) -> list[Any]:
        """The gradients with respect to ``wrt`` from the cotangents of the outputs the loss read (None for
        the others, which take no part, as in torch's backward)."""
        torch = _torch()
        every = self._backward_program(wrt, None)[2]
        read = tuple(n for n in every if cotangents.get(n) is not None)
        if not read:  # the loss reads no output a gradient reaches: zeros, as torch's materialized gradients
            g = self._backward_program(wrt, None)[0]
            return [torch.zeros(g.node(w).type.shape, dtype=getattr(torch, g.node(w).type.dtype)) for w in wrt]
        given = None if read == every else read
        self._given[wrt] = given
        g, compiled, outs = self._backward_program(wrt, given)
        if self._latest.get(wrt) != (call, given):  # another call's forward, or another program's, holds the
            self._run_forward_phase(inputs, wrt, rng, call, given)  # devices: this one's again, same draws
        feeds = {f"cot.{n}": self._feed(cotangents[n].detach().contiguous(), compiled) for n in outs}
        if not stage(compiled, feeds):
            compiled.load(feeds)
        compiled.execute(phase=1)
        # the second phase consumed what the first left on the devices: another backward of this call
        # (retain_graph=True) runs the forward phase again, with the same inputs and random draws
        self._latest[wrt] = None
        return [self._offload(f"grad.{w}", compiled) for w in wrt]

    def __repr__(self) -> str:
        ops = len(self.graph.operators)
        return f"Program({ops} operators on {self.compiled.devices}, plan cost {self.compiled.plan.cost:,.0f})"


@functools.cache
def _function() -> Any:
    """The torch.autograd.Function a differentiable call goes through (made when first needed, so importing
    needs no torch)."""
    torch = _torch()
    base: Any = torch.autograd.Function

    class Differentiable(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, pm: Program, n_inputs: int, params: tuple[str, ...], *args: Any) -> Any:
            inputs = args[:n_inputs]
            ctx.pm, ctx.n_inputs, ctx.params = pm, n_inputs, params
            ctx.save_for_backward(*(x.detach() for x in inputs))
            # every gradient the backward may be asked for: the parameters', and the inputs' that need one
            ctx.wrt = (*(name for p in params for name, _ in pm._graph_inputs_of(p)),
                       *(pm.graph.input_names[k] for k, x in enumerate(inputs)
                         if x.is_floating_point() and x.requires_grad and pm.graph.input_names[k] is not None))
            pm._calls += 1
            ctx.call = pm._calls
            ctx.rng = draw_rng()
            if ctx.wrt:
                ctx.set_materialize_grads(False)  # an output the loss does not read: None, not zeros
                values = pm._run_forward_phase(inputs, ctx.wrt, ctx.rng, ctx.call, update_buffers=True)
            else:
                values = pm._run_forward(inputs)
            saved = [values[n] for kind, n in pm.graph.output_leaves if kind == "saved"]
            ctx.names = [n for kind, n in pm.graph.output_leaves if kind == "saved"]
            ctx.mark_non_differentiable(*(v for v in saved if not v.is_floating_point()))
            return tuple(saved)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            pm, inputs = ctx.pm, ctx.saved_tensors
            wanted_inputs = [k for k in range(ctx.n_inputs) if ctx.needs_input_grad[3 + k]
                             and pm.graph.input_names[k] is not None and pm.graph.input_names[k] in ctx.wrt]
            holders = {p: pm._graph_inputs_of(p) for p in ctx.params}
            cots = dict(zip(ctx.names, grads))
            got = pm._run_backward(inputs, cots, ctx.wrt, ctx.call, ctx.rng) if ctx.wrt else []
            by_name = dict(zip(ctx.wrt, got))
            in_grads = [by_name[pm.graph.input_names[k]].to(inputs[k].device) if k in wanted_inputs else None
                        for k in range(ctx.n_inputs)]
            params = dict(pm.module.named_parameters())
            param_grads = []
            for p in ctx.params:  # a parameter read in several layouts gets the sum of their gradients
                total = None
                for name, transposed in holders[p]:
                    d = by_name[name].t() if transposed else by_name[name]
                    d = d.to(device=params[p].device, dtype=params[p].dtype)
                    total = d if total is None else total + d
                param_grads.append(total)
            if torch.is_grad_enabled():  # backward(create_graph=True): these gradients may be differentiated
                deps = (*(g for g in grads if g is not None and g.requires_grad),
                        *(params[p] for p in ctx.params if params[p].requires_grad))
                in_grads = [_once_differentiable().apply(g, *deps) if g is not None else None for g in in_grads]
                param_grads = [_once_differentiable().apply(g, *deps) if g is not None else None for g in param_grads]
            return (None, None, None, *in_grads, *param_grads)

    return Differentiable


@functools.cache
def _once_differentiable() -> Any:
    """An identity on a gradient whose own backward refuses: what a program's backward returns under
    ``create_graph=True``, so that differentiating its gradients again is a typed error, not a silent zero.

    Like torch's ``once_differentiable``, which raises a RuntimeError instead.  The program's backward runs on
    NumPy values, so its gradients carry no graph; ``deps`` (the incoming gradients and the parameters that
    require one) make the result part of the graph, so any path through it reaches the refusal."""
    torch = _torch()
    base: Any = torch.autograd.Function

    class SecondDerivative(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, grad: Any, *deps: Any) -> Any:
            return grad.clone()

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            raise ExecError(
                "rt.parallelize differentiates its module once: double backward (a second derivative, a "
                "gradient penalty, a Hessian-vector product) is not supported; got a backward through the "
                "gradients of a parallelized module, taken with create_graph=True. Take the second derivative "
                "with the torch module itself (torch.autograd.grad(..., create_graph=True) on the module, not "
                "on rt.parallelize's wrapper), or drop create_graph=True.")

    return SecondDerivative



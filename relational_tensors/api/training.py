"""One training step of a PyTorch module as one plan: its forward, backward and optimizer update.

``rt.train_step(module, loss_fn, example_batch, optimizer=..., device=...)`` traces ``loss_fn(module, *batch)``
(a scalar loss), makes the trainable parameters states (``g.state``), appends their gradients (``g.grad``)
and the optimizer's update (``rt.optim``), and compiles the whole step.  ``step(*batch)`` runs one step and
returns the loss; the parameters and the optimizer's moments persist on the devices between steps.

What a training user brings, and how it maps onto the graph:

- **The optimizer**: ``rt.optim.AdamW``/``SGD``, or a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` built on the
  module's parameters, read into the equivalent graph optimizer (``api/torch_optim.py``).  The parameters
  trained are those of the optimizer's groups that the loss depends on through floating tensors; a
  parameter that requires grad but is in no group stays as it is, as under torch.
- **Parameter groups**: each parameter's hyperparameters (weight decay, betas, eps, momentum, ...) are
  constants of the graph; each group's lr is a graph input of its own (``lr`` for group 0, ``lr.<i>`` for
  group i), so a schedule, one lr per group included, never recompiles.
- **Learning rate**: ``step.lrs`` (one per group) and ``step.lr`` (the optimizer's: setting it gives group i
  ``lr * ratio_i``, its lr over the optimizer's at construction).  ``lr_schedule`` is a callable
  ``optimizer step index -> lr`` (setting ``step.lr`` before each optimizer step) or a torch ``LRScheduler``
  on the torch optimizer passed in, stepped after each optimizer step, so the lr of step k is torch's.
  With a torch optimizer its ``param_groups`` hold the live lrs.
- **Accumulation** (``accumulate=k``): k calls make one optimizer step.  Each call's loss is scaled by 1/k
  before the backward (torch's ``(loss / k).backward()``: the step applies the *mean* of the k gradients)
  and summed into a gradient-accumulator state per parameter; the update, computed in every call, takes
  effect only in the k-th, where an input gate is 1 (``rt.optim.accumulate``).  The returned loss is the
  micro-batch's own, unscaled.
- **state_dict** in torch's layout: ``{"model": module.state_dict()-like, "optimizer": torch's optimizer
  state_dict, "params": trained parameters (the old layout's key), "steps": optimizer steps}``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from relational_tensors.api.compile import compileGraph
from relational_tensors.api.device_io import output, stage
from relational_tensors.api.torch_optim import (
    OptimizerSetup,
    check_rate,
    compiled_hyperparameters,
    param_groups_layout,
    resolve_optimizer,
    same_value,
    torch_scalar_dtype,
)
from relational_tensors.core.dtypes import FLOAT_DTYPES, numpy_dtype
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.frontend.torch.convert import _torch, _torch_dtype, numpy_to_torch, torch_to_numpy
from relational_tensors.frontend.torch.torch_graph import TorchGraph, draw_rng
from relational_tensors.frontend.torch.translator import from_torch
from relational_tensors.graph.optim import Optimizer

__all__ = ["train_step", "TrainStep"]

PREFIX = "module."  # the wrapper's attribute: graph inputs of the module's tensors are named module.<name>
APPLY = "accumulate.apply"  # the gate input of gradient accumulation: 1 in the call that steps the optimizer
_MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclasses.dataclass
class _Load:
    """What one ``load_state_dict`` takes, gathered while every part is checked and taken only at the end, so
    that a refused state changes nothing."""

    pending: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # values for the next step
    parameters: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # module tensors folded as inputs
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # module key -> loaded tensor (None: as held)
    lrs: list[float] | None = None  # each group's lr, where no torch optimizer holds them
    groups: list[dict[str, Any]] | None = None  # the torch optimizer's groups' values, its params excepted
    steps: int | None = None  # optimizer steps run


class TrainStep:
    """A compiled training step; see the module docstring."""

    def __init__(self, module: Any, graph: TorchGraph, compiled: Any, optimizer: Optimizer,
                 holders: dict[str, tuple[str, bool]], loss: str, setup: OptimizerSetup,
                 lr_inputs: Sequence[str | None], accumulate: int = 1) -> None:
        self.module = module
        self.graph = graph
        self.compiled = compiled
        self.optimizer = optimizer  # the states the optimizer added, with their initial values
        self.holders = holders  # module parameter -> (its state in the graph, whether held transposed)
        self.loss = loss
        self.setup = setup  # the graph optimizer, its groups (parameter names in torch's order), the lr drivers
        self.lr_inputs = list(lr_inputs)  # per group, its lr input (None: the group trains nothing here)
        self.accumulate = accumulate
        self.micro = 0  # micro-batches accumulated since the last optimizer step
        self.steps = 0  # optimizer steps run
        self._lrs = list(setup.lrs)  # the groups' lrs, where no torch optimizer holds them
        self._pending: dict[str, np.ndarray] = {}  # state values to load with the next step
        self._loaded_model: dict[str, Any] = {}  # module tensors not trained here that load_state_dict changed
        self._first = True
        # buffers the forward updates: module buffer -> its state (batch norm's running statistics), and
        # counters -> (value before the first step, increment per call); calls counts the forward passes
        self.buffers: dict[str, str] = {}
        self.counters: dict[str, tuple[Any, Any]] = {}
        self.calls = 0

    # --- learning rates -------------------------------------------------------------------------------
    @property
    def lrs(self) -> list[float]:
        """Each parameter group's learning rate for the next optimizer step."""
        opt = self.setup.torch_optimizer
        if opt is None:
            return list(self._lrs)
        # the torch optimizer's groups are the user's to change (by hand, or by a scheduler's lambda): checked
        # where they are read, so a step refuses a bad one before it runs
        return [check_rate(g.get("lr"), f" as the lr of param group {i} of the torch optimizer",
                           f" Set optimizer.param_groups[{i}]['lr'] (or fix the lr scheduler that set it).")
                for i, g in enumerate(opt.param_groups)]

    @lrs.setter
    def lrs(self, values: Sequence[float]) -> None:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ExecError(f"lrs takes one learning rate per parameter group; got {values!r}.")
        values = [check_rate(v) for v in values]
        if len(values) != len(self.setup.groups):
            raise ExecError(f"lrs takes one learning rate per parameter group ({len(self.setup.groups)}); got "
                            f"{len(values)}: {values}.")
        if self.setup.torch_optimizer is not None:
            for group, lr in zip(self.setup.torch_optimizer.param_groups, values):
                group["lr"] = lr
        else:
            self._lrs = values

    @property
    def lr(self) -> float:
        """The optimizer's learning rate: group i's is ``lr * ratio_i`` (its lr over the optimizer's, as built)."""
        ratio = self.setup.ratios[0]
        return self.lrs[0] / ratio if ratio else self.lrs[0]

    @lr.setter
    def lr(self, value: float) -> None:
        self.lrs = [check_rate(value) * r for r in self.setup.ratios]

    # --- one step -------------------------------------------------------------------------------------
    def __call__(self, *batch: Any) -> Any:
        """Run one step on ``batch`` (tensors like the example batch); returns the loss (of this micro-batch
        where gradients accumulate: the optimizer steps at every ``accumulate``-th call)."""
        self._check_call(batch)
        names = self.graph.input_names
        if len(batch) != len(names):
            raise ExecError(f"this step was traced with {len(names)} batch tensors; got {len(batch)}.")
        torch = _torch()
        for k, (x, n) in enumerate(zip(batch, names)):
            if n is None:
                continue
            want = self.graph.node(n).type
            if not isinstance(x, torch.Tensor):
                raise ExecError(f"batch tensor {k} must be a torch tensor of shape {want.shape} and dtype "
                                f"{want.dtype}, as in the example batch; got {type(x).__name__}.")
            if str(x.dtype).removeprefix("torch.") != want.dtype:
                raise ExecError(f"batch tensor {k} must have dtype {want.dtype}, as in the example batch; got "
                                f"{str(x.dtype).removeprefix('torch.')}. Convert it (x.to(torch.{want.dtype})).")
        cuda = self.compiled.devices.kind == "cuda"
        # on GPUs the executor copies a CUDA tensor (any __dlpack__ one) device to device: no host hop; a
        # CPU tensor goes as a NumPy view, as on CPU devices
        feeds: dict[str, Any] = {n: x.detach() if cuda and x.device.type == "cuda" else torch_to_numpy(x.detach())
                                 for n, x in zip(names, batch) if n is not None}
        if self.setup.schedule is not None:
            self.lr = float(self.setup.schedule(self.steps))
        for name, lr in zip(self.lr_inputs, self.lrs):
            if name is not None:
                feeds[name] = np.array([lr], dtype=numpy_dtype(self.graph.node(name).type.dtype))
        applies = self.micro + 1 == self.accumulate
        if self.accumulate > 1:
            feeds[APPLY] = np.array([1.0 if applies else 0.0], dtype=numpy_dtype(self.graph.node(APPLY).type.dtype))
        if self.graph.rng_input is not None:  # train-mode dropout: a new draw each step, from torch's generator
            feeds[self.graph.rng_input] = draw_rng()
        if self._first:
            feeds.update(self.graph.parameters)  # frozen parameters, buffers, and the states' first values
            feeds.update(self.optimizer.initial(self.graph.parameters))
        feeds.update(self._pending)
        # on GPUs, after the first step a step's feeds (the batch, the learning rates, the random state) go
        # in on the launch stream and the step returns without the host waiting
        if self._first or self._pending or not stage(self.compiled, feeds):
            self.compiled.load(feeds)
        self._first, self._pending = False, {}
        self.compiled.execute()
        self.calls += 1
        self.micro = 0 if applies else self.micro + 1
        if applies:
            self.steps += 1
            if self.setup.scheduler is not None:
                with warnings.catch_warnings():  # this step is the optimizer's step() the scheduler looks for
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
                    self.setup.scheduler.step()
        return self._loss_value()

    def _check_call(self, batch: tuple[Any, ...]) -> None:
        """What a step refuses before it changes anything, beyond the batch's count, types and dtypes: a batch
        tensor without data (torch's meta device), a group lr that is not a learning rate."""
        torch = _torch()
        for k, x in enumerate(batch):
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                raise ExecError(f"batch tensor {k} is on torch's meta device, which holds no values; got a meta tensor "
                                f"of shape {tuple(x.shape)}. Pass a tensor with data (on the CPU or a GPU).")
        _ = self.lrs  # reading them checks each group's lr

    def _loss_value(self) -> Any:
        if self.compiled.devices.kind != "cuda":
            return numpy_to_torch(self.compiled.offload(self.loss))
        return output(self.compiled, self.loss)  # a torch CUDA tensor, its copy queued after the step

    # --- the states, read and written -----------------------------------------------------------------
    def _current(self, name: str) -> np.ndarray:
        if name in self._pending:
            return self._pending[name]
        if self._first:
            return np.asarray({**self.graph.parameters, **self.optimizer.initial(self.graph.parameters)}[name])
        return np.asarray(self.compiled.offload(name))

    def _value(self, name: str, transposed: bool) -> Any:
        """State ``name`` as a torch tensor (a copy) in the module's layout."""
        v = self._current(name)
        return numpy_to_torch(np.array(v.T if transposed and v.ndim == 2 else v, order="C"))

    def _graph_value(self, name: str, value: Any, transposed: bool, what: str = "") -> np.ndarray:
        """``value`` (a tensor in the module's layout) as graph input or state ``name`` holds it (a copy);
        ``what`` says where the state holds it, for a refusal."""
        node = self.graph.node(name)
        t = _real_tensor(value, what or f"the value for {name!r}")
        if transposed and t.ndim == 2:
            t = t.t()
        if tuple(t.shape) != tuple(node.type.shape):
            raise ExecError(f"{name!r} holds shape {tuple(node.type.shape)}; the state gives {tuple(t.shape)}"
                            f"{' (transposed from the module layout)' if transposed else ''}"
                            f"{f' as {what}' if what else ''}. Load a state of this module.")
        return np.array(torch_to_numpy(t.to(device="cpu", dtype=_torch_dtype(node.type.dtype))), order="C")

    def _states_of(self) -> dict[str, dict[str, str]]:
        """Per trained parameter, its graph states by key: "" the parameter, then "exp_avg", "momentum_buffer",
        "sgd_first_step", "grad_accum", "master" and the master's "master.exp_avg", ..."""
        out: dict[str, dict[str, str]] = {p: {"": state} for p, (state, _) in self.holders.items()}
        for name in self.optimizer.states:
            owners = [p for p, (state, _) in self.holders.items() if name.startswith(state + ".")]
            if owners:
                owner = max(owners, key=lambda p: len(self.holders[p][0]))
                out[owner][name[len(self.holders[owner][0]) + 1:]] = name
        return out

    def _entries(self) -> list[tuple[str, str | None, str, bool]]:
        """Every state of the step: (graph name, module parameter or None, key under it, transposed), the
        parameters themselves under key "" (the layout of ``state_dict`` before it followed torch's)."""
        out: list[tuple[str, str | None, str, bool]] = []
        owned: set[str] = set()
        for p, keys in self._states_of().items():
            out += [(name, p, key, self.holders[p][1]) for key, name in keys.items()]
            owned.update(keys.values())
        return out + [(name, None, name, False) for name in self.optimizer.states if name not in owned]

    def _order(self) -> list[str]:
        """The parameters in torch's order: their index in the optimizer's state_dict."""
        return [name for names in self.setup.groups for name in names]

    def state_dict(self) -> dict[str, Any]:
        """``{"model": the module's state_dict with the trained values, "optimizer": the state_dict torch's
        optimizer would have after the same steps ({"state": {index: {"step", "exp_avg", "exp_avg_sq"} or
        {"momentum_buffer"}}, "param_groups": [...]}), "params": the trained parameters, "steps": optimizer
        steps}``; ``torch.save`` keeps tensors shared between "model" and "params" once."""
        if self.micro:
            raise ExecError(f"state_dict is taken between optimizer steps; got {self.micro} of {self.accumulate} "
                            "micro-batches accumulated. Take it after the call that steps the optimizer.")
        states = self._states_of()
        params = {p: self._value(keys[""], self.holders[p][1]) for p, keys in states.items()}
        optimizer = {"state": self._torch_state(states), "param_groups": param_groups_layout(self.setup, self.lrs)}
        return {"model": self._model_state(params), "optimizer": optimizer, "params": params, "steps": self.steps}

    def _model_state(self, params: dict[str, Any]) -> dict[str, Any]:
        torch = _torch()
        first = {id(t): name for name, t in self.module.named_parameters()}
        out: dict[str, Any] = {}
        updated = self._buffer_values()
        for key, t in self.module.state_dict(keep_vars=True).items():
            name = first.get(id(t))
            if name is not None and name in params:  # a tied parameter's other names get copies (safetensors)
                out[key] = params[name] if key == name else params[name].clone()
            elif key in updated:
                out[key] = updated[key]
            elif key in self._loaded_model:
                out[key] = self._loaded_model[key].clone()
            else:
                out[key] = t.detach().clone() if isinstance(t, torch.Tensor) else t
        return out

    def _torch_state(self, states: dict[str, dict[str, str]]) -> dict[int, dict[str, Any]]:
        torch = _torch()
        kind = self.optimizer.kind
        step = float(self._current("adamw.step")[0]) if kind == "adamw" else 0.0
        out: dict[int, dict[str, Any]] = {}
        for index, p in enumerate(self._order()):
            if p not in states or (kind == "adamw" and not step):  # torch has no state before a first step
                continue
            keys, transposed = states[p], self.holders[p][1]
            entry: dict[str, Any] = {}
            if kind == "adamw":
                entry["step"] = torch.tensor(step, dtype=torch_scalar_dtype())
            flag = keys.get("sgd_first_step", keys.get("master.sgd_first_step"))
            if kind == "adamw" or (flag is not None and self._current(flag)[0] == 0):
                for key in _MOMENTS[kind]:
                    entry[key] = self._value(keys.get(key, keys.get(f"master.{key}", "")), transposed)
            if "master" in keys:  # master_dtype's float32 copy: torch has none, and keeps the key when it loads
                entry["master"] = self._value(keys["master"], transposed)
            if entry:
                out[index] = entry
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, from torch's ``{"model": module.state_dict(), "optimizer":
        optimizer.state_dict()}`` (either part alone too), or from the layout before (``params`` and the
        optimizer's states per parameter name); the values are loaded with the next step.  Every key, shape,
        dtype, hyperparameter and step count is checked before any is taken: a refused state changes nothing."""
        if not isinstance(state, Mapping) or not {"model", "params", "optimizer"} & set(state):
            raise ExecError("load_state_dict takes {'model': ..., 'optimizer': ...} (this step's state_dict, or "
                            f"torch's module and optimizer state_dicts); got {type(state).__name__} with keys "
                            f"{sorted(state, key=repr) if isinstance(state, Mapping) else '-'}.")
        load = _Load()
        if "model" in state:
            self._load_model(state["model"], load)
        elif "params" in state:
            self._load_params(state["params"], load)
        if "optimizer" in state:
            optim = state["optimizer"]
            if isinstance(optim, Mapping) and "state" in optim and "param_groups" in optim:
                self._load_torch_optimizer(optim, load)
            elif isinstance(optim, Mapping):
                self._load_named_optimizer(optim, load)
            else:
                raise ExecError(f"the state's 'optimizer' is a dict (torch's optimizer.state_dict(), or this step's); "
                                f"got {_describe(optim)}. Load a state_dict of this step, or leave the key out.")
        if "steps" in state:
            load.steps = _count(state["steps"], "the state's 'steps' (optimizer steps run)")
        self._commit(load)

    def _commit(self, load: _Load) -> None:
        """Take a checked load: nothing before this point changed the step."""
        if load.groups is not None:  # as torch's load_state_dict: the groups take the saved values
            for live, saved in zip(self.setup.torch_optimizer.param_groups, load.groups):
                live.update(saved)
        if load.lrs is not None:
            self._lrs = load.lrs
        self.graph.parameters.update(load.parameters)
        for key, value in load.model.items():
            if value is None:
                self._loaded_model.pop(key, None)
            else:
                self._loaded_model[key] = value
        self._pending.update(load.pending)
        if load.steps is not None:
            self.steps = load.steps
        self.micro = 0  # a loaded state starts at an optimizer step: nothing accumulated
        for keys in self._states_of().values():
            if "grad_accum" in keys:
                self._pending[keys["grad_accum"]] = self._fill(keys["grad_accum"])

    def _load_params(self, params: Any, load: _Load, what: str = "the state's 'params'") -> None:
        if not isinstance(params, Mapping):
            raise ExecError(f"{what} maps parameter names to tensors; got {_describe(params)}. Load a state_dict of "
                            "this module.")
        unknown = sorted(set(params) - set(self.holders), key=repr)
        if unknown:
            raise ExecError(f"the state names parameters {unknown}, which this step does not train.")
        missing = sorted(set(self.holders) - set(params))
        if missing:
            raise ExecError(f"the state has no value for {missing}, which this step trains. Load a state of this "
                            "module.")
        for p, (name, transposed) in self.holders.items():
            load.pending[name] = self._graph_value(name, params[p], transposed, f"{what}[{p!r}]")

    def _load_model(self, model: Any, load: _Load) -> None:
        torch = _torch()
        if not isinstance(model, Mapping):
            raise ExecError(f"the state's 'model' is the module's state_dict (names to tensors); got "
                            f"{_describe(model)}. Load module.state_dict() or this step's state_dict().")
        own = self.module.state_dict(keep_vars=True)
        unknown = sorted(set(model) - set(own), key=repr)
        if unknown:
            raise ExecError(f"the model state has keys the module has not: {unknown[:6]}. Load a state_dict of this "
                            "module.")
        alias = {name: self._first_names().get(id(t), name) for name, t in own.items()}
        self._load_params({p: model[key] for key, p in alias.items() if key in model and p in self.holders}, load,
                          "the state's 'model'")
        deps = {d for ds in self.graph.derived.values() for d in ds}  # named as graph origins: module.<name>
        for key, value in model.items():
            name = alias[key]
            if name in self.holders or not isinstance(own[key], torch.Tensor):
                continue
            held = own[key].detach()
            what = f"the state's 'model'[{key!r}]"
            t = _real_tensor(value, what)
            if tuple(t.shape) != tuple(held.shape):  # torch's load_state_dict: "size mismatch"
                raise ExecError(f"{what} has shape {tuple(t.shape)}; the module's {key!r} has {tuple(held.shape)}. "
                                "Load a state_dict of this module.")
            t = t.to(device="cpu", dtype=held.dtype)  # torch copies a loaded value into the module's dtype
            changed = not torch.equal(t, held.cpu())
            if changed and PREFIX + name in deps:
                raise ExecError(f"{key!r} changes a value folded into the plan when it was traced; load it into the "
                                "module (module.load_state_dict) and build the step again.")
            for gname, (origin, transposed) in self.graph.origins.items():
                if origin == PREFIX + name and gname in self.graph.parameters:
                    new = self._graph_value(gname, t, transposed, what)
                    if not np.array_equal(new, self.graph.parameters[gname]):
                        load.parameters[gname] = load.pending[gname] = new
            load.model[key] = t.clone() if changed else None

    def _first_names(self) -> dict[int, str]:
        return {id(t): name for name, t in self.module.named_parameters()}

    def _load_torch_optimizer(self, optim: Mapping[str, Any], load: _Load) -> None:
        groups = optim["param_groups"]
        if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Sequence) or \
                not all(isinstance(g, Mapping) and "params" in g for g in groups):
            raise ExecError("the optimizer state's 'param_groups' is a list of dicts, each with 'params' (its "
                            f"parameters' indices), as torch's optimizer.state_dict() has it; got {_describe(groups)}.")
        for i, saved in enumerate(groups):
            params = saved["params"]
            if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) or \
                    not all(_is_index(p) for p in params):
                raise ExecError(f"param_groups[{i}]['params'] of the optimizer state lists parameter indices (ints); "
                                f"got {params!r}.")
        sizes, ours = [len(g["params"]) for g in groups], [len(names) for names in self.setup.groups]
        if sizes != ours:
            raise ExecError(f"the optimizer state has param groups of {sizes} parameters; this step's optimizer has "
                            f"{ours}. Build the step with the optimizer and groups the state was saved from.")
        kind = self.optimizer.kind
        theirs = {"momentum": "sgd", "betas": "adamw"}
        for saved in groups:
            other = next((theirs[k] for k in theirs if k in saved and theirs[k] != kind), None)
            if other is not None:
                raise ExecError(f"the optimizer state is {other}'s (its param groups have "
                                f"{'momentum' if other == 'sgd' else 'betas'}); this step runs {kind}. Load the state "
                                "of the same optimizer class.")
        for i, (saved, compiled) in enumerate(zip(groups, compiled_hyperparameters(self.setup))):
            for key, value in compiled.items():
                if key in saved and not same_value(saved[key], value):
                    raise ExecError(f"{key} is a constant of the compiled step: {value!r} in group {i}; the "
                                    f"optimizer state has {saved[key]!r}. Build the step with {key}={saved[key]!r}.")
        fix = " Load an optimizer state_dict whose learning rates torch would take."
        lrs = [check_rate(saved.get("lr"), f" as param_groups[{i}]['lr'] of the optimizer state", fix)
               for i, saved in enumerate(groups)]
        for i, saved in enumerate(groups):
            if "initial_lr" in saved:  # a torch scheduler's base lr, copied into the live groups
                check_rate(saved["initial_lr"], f" as param_groups[{i}]['initial_lr'] of the optimizer state", fix)
        if self.setup.torch_optimizer is not None:
            load.groups = [{k: v for k, v in saved.items() if k != "params"} for saved in groups]
        else:
            load.lrs = lrs
        by_index: dict[int, str] = {}
        for saved, names in zip(groups, self.setup.groups):
            for i, param in zip(saved["params"], names):
                if int(i) in by_index:
                    raise ExecError(f"the optimizer state's param_groups list parameter {int(i)} twice; each index "
                                    "names one parameter. Load an optimizer state_dict torch wrote.")
                by_index[int(i)] = param
        table = optim["state"]
        if not isinstance(table, Mapping):
            raise ExecError("the optimizer state's 'state' maps parameter indices to their states (dicts), as "
                            f"torch's optimizer.state_dict() has it; got {_describe(table)}.")
        for i, e in table.items():
            if not _is_index(i) or not isinstance(e, Mapping):
                raise ExecError("the optimizer state's 'state' maps parameter indices (ints) to dicts of tensors; got "
                                f"{i!r}: {_describe(e)}.")
        unknown = sorted(int(i) for i in table if int(i) not in by_index)
        if unknown:
            raise ExecError(f"the optimizer state has entries for parameters {unknown}, which its param_groups do "
                            "not list.")
        entries = {by_index[int(i)]: e for i, e in table.items()}
        index_of = {name: int(i) for i, name in by_index.items()}
        extra = sorted({k for e in entries.values() for k in e} - {"step", "master", *_MOMENTS[kind]}, key=repr)
        if extra:
            raise ExecError(f"this step runs {kind}, whose state is step and {list(_MOMENTS[kind])}; the optimizer "
                            f"state has {extra}. Load the state of the same optimizer class.")
        states = self._states_of()
        if kind == "adamw":
            self._load_adam_step(entries, index_of, load)
        for p, keys in states.items():
            entry, transposed = entries.get(p, {}), self.holders[p][1]
            flag = keys.get("sgd_first_step", keys.get("master.sgd_first_step"))
            for key in _MOMENTS[kind]:
                name = keys.get(key, keys.get(f"master.{key}"))
                if name is None:  # SGD without momentum keeps none
                    continue
                value = entry.get(key)
                what = f"the optimizer state's state[{index_of[p]}][{key!r}]"
                if value is None and key in entry and key != "momentum_buffer":  # torch's SGD may hold None
                    raise ExecError(f"{what} is None; torch's {kind} holds a tensor of the parameter's shape there "
                                    "once it has stepped. Load an optimizer state_dict torch wrote, or leave the "
                                    "entry out (a parameter that has not stepped).")
                load.pending[name] = (self._fill(name) if value is None
                                      else self._graph_value(name, value, transposed, what))
                if flag is not None:  # torch's buffer exists from the first step on
                    load.pending[flag] = np.full((1,), 1.0 if value is None else 0.0,
                                                 dtype=numpy_dtype(self.graph.node(flag).type.dtype))
            if "master" in keys:
                load.pending[keys["master"]] = (
                    self._graph_value(keys["master"], entry["master"], transposed,
                                      f"the optimizer state's state[{index_of[p]}]['master']")
                    if "master" in entry else self._master_from(keys, load))

    def _load_adam_step(self, entries: dict[str, dict[str, Any]], index_of: dict[str, int], load: _Load) -> None:
        have = [p for p in self.holders if "step" in entries.get(p, {})]
        steps = sorted({_step_count(entries[p]["step"], f"the optimizer state's state[{index_of[p]}]['step']")
                        for p in have})
        if (have and len(have) != len(self.holders)) or len(steps) > 1:
            raise ExecError(f"one AdamW step count is shared by the parameters here; the optimizer state has steps "
                            f"{steps} for {len(have)} of the {len(self.holders)} trained parameters. Load a state "
                            "where every trained parameter took the same steps.")
        step = steps[0] if steps else 0
        load.pending["adamw.step"] = np.full((1,), step, dtype=numpy_dtype(self.graph.node("adamw.step").type.dtype))
        load.steps = step

    def _fill(self, name: str) -> np.ndarray:
        """Optimizer state ``name`` at its start (zeros; torch's state before a first step)."""
        t, fill = self.optimizer.states[name]
        return np.full(t.shape, fill, dtype=numpy_dtype(t.dtype))

    def _master_from(self, keys: dict[str, str], load: _Load) -> np.ndarray:
        """Master weights as the parameter's value (torch keeps none: a loaded state starts them there)."""
        dtype = numpy_dtype(self.graph.node(keys["master"]).type.dtype)
        param = load.pending.get(keys[""])
        value = self._current(keys[""]) if param is None else param
        return np.asarray(value, dtype=np.float64).astype(dtype)

    def _load_named_optimizer(self, optim: Mapping[str, Any], load: _Load) -> None:
        """The layout before torch's: states per parameter name, "adamw.step" at the top."""
        for name, owner, key, transposed in self._entries():
            if not key or key == "grad_accum":
                continue
            mine = optim if owner is None else optim.get(owner, {})
            if not isinstance(mine, Mapping):
                raise ExecError(f"the optimizer state maps {owner!r} to its states by key ({key!r}, ...); got "
                                f"{_describe(mine)}. Load a state_dict of this step's optimizer.")
            value = mine.get(key)
            if value is None:
                raise ExecError(f"the optimizer state has no {key!r}{f' for {owner!r}' if owner else ''}; load a "
                                "state_dict of this step's optimizer.")
            what = f"the optimizer state's {owner + '/' if owner else ''}{key}"
            if name == "adamw.step":
                dtype = numpy_dtype(self.graph.node(name).type.dtype)
                load.pending[name] = np.full((1,), _step_count(value, what), dtype=dtype)
            else:
                load.pending[name] = self._graph_value(name, value, transposed, what)

    def load_into(self, module: Any = None) -> None:
        """Copy the trained parameters into ``module`` (default: the module the step was built from), and the
        buffers the forward updates (batch norm's running statistics and counters)."""
        torch = _torch()
        module = self.module if module is None else module
        params = dict(module.named_parameters())
        states = self._states_of()
        with torch.no_grad():
            for p, keys in states.items():
                value = self._value(keys[""], self.holders[p][1])
                params[p].copy_(value.to(params[p].dtype))
            for name, value in self._buffer_values().items():
                buf = module.get_buffer(name)
                buf.copy_(value.to(buf.device, buf.dtype))

    def _buffer_values(self) -> dict[str, Any]:
        """The current values of the buffers the forward updates, by module buffer name."""
        out = {name: self._value(state, False) for name, state in self.buffers.items()}
        for name, (first, step) in self.counters.items():
            out[name] = first + step * self.calls
        return out


def _describe(value: Any) -> str:
    """``value`` for an error message: arrays and tensors by type, dtype and shape, anything else by repr."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + '...' if len(text) > 80 else text}"


def _real_tensor(value: Any, what: str) -> Any:
    """``value`` of a loaded state as a torch tensor of real numbers (the tensor itself, detached, where it is
    one): what torch's ``load_state_dict`` copies, casting its dtype; anything else is refused."""
    torch = _torch()
    t: Any = None
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" and value.layout == torch.strided and not value.is_complex():
            t = value.detach()
    elif value is not None and not isinstance(value, (str, bytes)):
        try:
            a = np.asarray(value)
        except (TypeError, ValueError):  # a ragged list
            a = None
        if a is not None and a.dtype == numpy_dtype("bfloat16"):
            t = numpy_to_torch(a)
        elif a is not None and a.dtype.kind in "biuf":
            t = torch.as_tensor(a)
    if t is None:
        raise ExecError(f"{what} is a tensor of real numbers (torch's, or a NumPy array), as torch's state_dict "
                        f"holds; got {_describe(value)}. Load a state_dict of this module and optimizer.")
    return t


def _is_index(value: Any) -> bool:
    """A parameter index of a torch optimizer state_dict: an int >= 0 (or its decimal text, after JSON)."""
    if isinstance(value, str):
        return value.isdecimal()
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and bool(value >= 0)


def _count(value: Any, what: str) -> int:
    """A count of optimizer steps: an int >= 0 (a bool is not one here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ExecError(f"{what} is an int >= 0; got {_describe(value)}. Load a state_dict this step wrote, or "
                        "give the count of optimizer steps run.")
    return int(value)


def _step_count(value: Any, what: str) -> int:
    """A torch optimizer's ``state["step"]`` (a float tensor of one element, or a number): a whole number >= 0."""
    step = math.nan
    if not isinstance(value, (bool, str, bytes)) and value is not None and \
            getattr(getattr(value, "dtype", None), "is_complex", False) is not True:
        try:
            step = float(value)  # a tensor or array of one element too
        except (TypeError, ValueError, RuntimeError):
            pass
    if not (0 <= step < math.inf and step.is_integer()):
        raise ExecError(f"{what} is the count of steps the parameter took, a whole number >= 0; got "
                        f"{_describe(value) if hasattr(value, 'shape') else repr(value)}. Load an optimizer "
                        "state_dict torch wrote.")
    return int(step)


def train_step(module: Any, loss_fn: Any, example_batch: Any, optimizer: Any = None, device: Any = None, *,
               lr_schedule: Any = None, accumulate: int = 1, **compile_options: Any) -> TrainStep:
    """Compile one training step of ``module``: ``loss_fn(module, *batch)`` returns a scalar loss, and
    ``optimizer`` updates the parameters of its groups that get a gradient.  ``optimizer``:
    ``rt.optim.AdamW``/``SGD`` (torch's arguments, ``param_groups``), or a ``torch.optim.AdamW``, ``Adam`` or
    ``SGD`` on the module's parameters.  ``lr_schedule``: ``callable(step) -> lr`` or a torch ``LRScheduler``
    on that torch optimizer.  ``accumulate=k``: k calls per optimizer step, applying the mean of their
    gradients.  ``device`` and ``compile_options`` are those of ``rt.compileGraph``."""
    torch = _torch()
    setup = resolve_optimizer(module, optimizer, lr_schedule)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise GraphError(f"accumulate is the number of micro-batches per optimizer step, an int >= 1; got "
                         f"{accumulate!r}.")
    batch = tuple(example_batch) if isinstance(example_batch, (tuple, list)) else (example_batch,)

    base: Any = torch.nn.Module

    class Loss(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.module = module

        def forward(self, *xs: Any) -> Any:
            return loss_fn(self.module, *xs)

    g = from_torch(Loss(), batch, casts_in_graph=True, differentiate=True)
    saved = [name for kind, name in g.output_leaves if kind == "saved"]
    if len(g.output_leaves) != 1 or not saved or g.nodes[g.outputs[saved[0]]].type.volume != 1 or \
            g.nodes[g.outputs[saved[0]]].type.dtype not in FLOAT_DTYPES:
        raise GraphError("loss_fn(module, *batch) must return one floating scalar (the loss).")
    # every differentiated parameter is one graph input (tied ones included), named as named_parameters()
    # names it; those the loss depends on through floating tensors and that the optimizer holds are trained,
    # as torch's optimizers update exactly their parameters that get a gradient
    loss = g.tensor(g.outputs[saved[0]])
    reached = {origin[len(PREFIX):]: held for origin, held in g.trained([loss]).items()}
    group_of = {name: i for i, names in enumerate(setup.groups) for name in names}
    holders = {p: held for p, held in reached.items() if p in group_of}
    if not holders:
        trainable = [k for k, t in module.named_parameters() if t.requires_grad]
        read = sorted(origin[len(PREFIX):] for origin, _ in g.origins.values() if origin in g.differentiated)
        why = (f"the optimizer's groups hold none of {sorted(reached)}" if reached else
               f"it reads {read} only through integer or boolean values, which have no gradient" if read else
               "the loss reads none of them" if trainable else "none requires grad")
        raise GraphError(f"train_step trains the module's parameters that require grad, that the loss depends "
                         f"on and that the optimizer holds; {why}. Got {len(trainable)} parameters that require grad.")
    for graph_name, _ in holders.values():  # trained parameters persist across steps: states
        node = g.node(graph_name)
        g.nodes[node.id] = dataclasses.replace(node, role="state")
    buffers = {}  # buffers the forward updates (batch norm's running statistics): states assigned each step
    for name, out in g.buffer_updates.items():
        node = g.node(name)
        g.nodes[node.id] = dataclasses.replace(node, role="state")
        g.assign(g.tensor(node.id), g.tensor(g.outputs[out]))
        buffers[name[len(PREFIX):]] = name
    states = [g.tensor(g.node(graph_name).id) for graph_name, _ in holders.values()]
    # accumulation: torch's (loss / k).backward(), so the k gradients sum to their mean
    grads = g.grad(loss if accumulate == 1 else g.unary(loss, "scale", 1.0 / accumulate), states)
    groups = [group_of[p] for p in holders]
    lrs: list[Any] = [None] * len(setup.groups)
    lr_dtype = setup.spec.master_dtype or states[0].dtype  # the update's dtype: a bfloat16 lr would round
    for i in sorted(set(groups)):  # one lr input per group: a schedule of any group needs no recompile
        lrs[i] = g.input("lr" if i == 0 else f"lr.{i}", [1], lr_dtype)
    apply = g.input(APPLY, [1], states[0].dtype) if accumulate > 1 else None
    opt = setup.spec.build(g, states, grads, lrs, groups=groups, apply=apply)
    compiled = compileGraph(g, device=device, **compile_options)
    step = TrainStep(module, g, compiled, opt, holders, saved[0], setup,
                     [None if t is None else t.name for t in lrs], accumulate)
    step.buffers = buffers
    step.counters = {name[len(PREFIX):]: (module.get_buffer(name[len(PREFIX):]).detach().clone(), inc)
                     for name, inc in g.buffer_increments.items()}
    return step


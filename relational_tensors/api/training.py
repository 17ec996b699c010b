"""One training step of a PyTorch module as one plan: its forward, backward and optimizer update.

``rt.train_step(module, loss_fn, example_batch, optimizer=rt.optim.AdamW(...), device=...)`` traces
``loss_fn(module, *batch)`` (a scalar loss), makes the module's trainable parameters states
(``g.state``), appends their gradients (``g.grad``) and the optimizer's update (``rt.optim``), and
compiles the whole step.  ``step(*batch)`` runs one step and returns the loss; the parameters and the
optimizer's moments persist on the devices between steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from relational_tensors.api.compile import compileGraph
from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.frontend.torch.convert import _torch, numpy_to_torch, torch_to_numpy
from relational_tensors.frontend.torch.translator import TorchGraph, draw_rng, from_torch
from relational_tensors.graph.optim import SGD, AdamW, Optimizer

__all__ = ["train_step", "TrainStep"]

PREFIX = "module."  # the wrapper's attribute: graph inputs of the module's tensors are named module.<name>


class TrainStep:
    """A compiled training step; see the module docstring."""

    def __init__(self, module: Any, graph: TorchGraph, compiled: Any, optimizer: Optimizer,
                 holders: dict[str, tuple[str, bool]], loss: str) -> None:
        self.module = module
        self.graph = graph
        self.compiled = compiled
        self.optimizer = optimizer  # the states the optimizer added, with their initial values
        self.holders = holders  # module parameter -> (its state in the graph, whether held transposed)
        self.loss = loss
        self.lr = 0.0  # the learning rate of the next step (an input: changing it needs no recompile)
        self.steps = 0
        self._pending: dict[str, np.ndarray] = {}  # state values to load with the next step
        self._first = True

    def __call__(self, *batch: Any) -> Any:
        """Run one step on ``batch`` (tensors like the example batch); returns the loss."""
        names = self.graph.input_names
        if len(batch) != len(names):
            raise ExecError(f"this step was traced with {len(names)} batch tensors; got {len(batch)}.")
        feeds: dict[str, Any] = {n: torch_to_numpy(x.detach()) for n, x in zip(names, batch) if n is not None}
        dtype = self.graph.node("lr").type.dtype
        feeds["lr"] = np.array([self.lr], dtype=dtype)
        if self.graph.rng_input is not None:  # train-mode dropout: a new draw each step, from torch's generator
            feeds[self.graph.rng_input] = draw_rng()
        if self._first:
            feeds.update(self.graph.parameters)  # frozen parameters, buffers, and the states' first values
            feeds.update(self.optimizer.initial(self.graph.parameters))
        feeds.update(self._pending)
        self.compiled.load(feeds)
        self._first, self._pending = False, {}
        self.compiled.execute()
        self.steps += 1
        return numpy_to_torch(self.compiled.offload(self.loss))

    def _current(self, name: str) -> np.ndarray:
        if name in self._pending:
            return self._pending[name]
        if self._first:
            return np.asarray({**self.graph.parameters, **self.optimizer.initial(self.graph.parameters)}[name])
        return np.asarray(self.compiled.offload(name))

    def _entries(self) -> list[tuple[str, str | None, str, bool]]:
        """Every state of the step: (graph name, module parameter or None, key under it, transposed), the
        parameters themselves under key "" and their optimizer states under "exp_avg", "master", ..."""
        out: list[tuple[str, str | None, str, bool]] = [
            (state, p, "", transposed) for p, (state, transposed) in self.holders.items()]
        for name in self.optimizer.states:
            owner = next((p for p, (state, _) in self.holders.items() if name.startswith(state + ".")), None)
            key = name[len(self.holders[owner][0]) + 1:] if owner is not None else name
            out.append((name, owner, key, owner is not None and self.holders[owner][1]))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The parameters under the module's names (in its layout), the optimizer's states per parameter,
        and the number of steps run."""
        params: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for name, owner, key, transposed in self._entries():
            value = self._current(name)
            value = numpy_to_torch(np.ascontiguousarray(value.T if transposed and value.ndim == 2 else value))
            if not key:
                params[str(owner)] = value
            elif owner is None:
                optim[key] = value
            else:
                optim.setdefault(owner, {})[key] = value
        return {"params": params, "optimizer": optim, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the values are loaded with the next step."""
        unknown = sorted(set(state["params"]) - set(self.holders))
        if unknown:
            raise ExecError(f"the state names parameters {unknown}, which this step does not train.")
        for name, owner, key, transposed in self._entries():
            value = state["params"][owner] if not key else \
                state["optimizer"][key] if owner is None else state["optimizer"][owner][key]
            a = torch_to_numpy(value.detach())
            self._pending[name] = np.ascontiguousarray(a.T if transposed and a.ndim == 2 else a)
        self.steps = int(state.get("steps", 0))

    def load_into(self, module: Any = None) -> None:
        """Copy the trained parameters into ``module`` (default: the module the step was built from)."""
        torch = _torch()
        module = self.module if module is None else module
        params = dict(module.named_parameters())
        with torch.no_grad():
            for p, value in self.state_dict()["params"].items():
                params[p].copy_(value.to(params[p].dtype))


def train_step(module: Any, loss_fn: Any, example_batch: Any, optimizer: AdamW | SGD | None = None,
               device: Any = None, **compile_options: Any) -> TrainStep:
    """Compile one training step of ``module``: ``loss_fn(module, *batch)`` returns a scalar loss, and
    ``optimizer`` (``rt.optim.AdamW`` or ``rt.optim.SGD``, torch's arguments) updates every parameter
    that requires grad.  ``device`` and ``compile_options`` are those of ``rt.compileGraph``."""
    torch = _torch()
    if optimizer is None:
        optimizer = AdamW()
    if not isinstance(optimizer, (AdamW, SGD)):
        raise GraphError(f"optimizer must be rt.optim.AdamW(...) or rt.optim.SGD(...); got {optimizer!r}.")
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
    # names it; those the loss depends on through floating tensors are trained, as torch's optimizers
    # update exactly the parameters that get a gradient
    loss = g.tensor(g.outputs[saved[0]])
    holders = {origin[len(PREFIX):]: held for origin, held in g.trained([loss]).items()}
    if not holders:
        trainable = [k for k, t in module.named_parameters() if t.requires_grad]
        read = sorted(origin[len(PREFIX):] for origin, _ in g.origins.values() if origin in g.differentiated)
        why = (f"it reads {read} only through integer or boolean values, which have no gradient" if read else
               "the loss reads none of them" if trainable else "none requires grad")
        raise GraphError(f"train_step trains the module's parameters that require grad and that the loss depends "
                         f"on; {why}. Got {len(trainable)} parameters that require grad.")
    for graph_name, _ in holders.values():  # trainable parameters persist across steps: states
        node = g.node(graph_name)
        g.nodes[node.id] = dataclasses.replace(node, role="state")
    states = [g.tensor(g.node(graph_name).id) for graph_name, _ in holders.values()]
    grads = g.grad(loss, states)
    lr = g.input("lr", [1], states[0].dtype)
    opt = optimizer.build(g, states, grads, lr)
    compiled = compileGraph(g, device=device, **compile_options)
    step = TrainStep(module, g, compiled, opt, holders, saved[0])
    step.lr = optimizer.lr
    return step

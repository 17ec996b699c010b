"""The graph a PyTorch module becomes: :class:`TorchGraph` (an ``rt.Graph`` with what is needed to feed
and read it), the random state a call draws (``draw_rng``), and pruning what no output reads (``_prune``).
The translator (``translator.py``) builds it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relational_tensors.errors import GraphError
from relational_tensors.frontend.torch.convert import _is_torch_tensor, _torch, torch_to_numpy
from relational_tensors.graph.autodiff import flows
from relational_tensors.graph.graph import Graph, Tensor

__all__ = ["TorchGraph", "draw_rng"]


# --- the graph a module becomes ---------------------------------------------------------------------

class TorchGraph(Graph):
    """An ``rt.Graph`` traced from a PyTorch module, with what is needed to feed and read it.

    ``parameters``  graph input name -> NumPy value, for every input that is not a user input
                    (weights in graph layout, e.g. Linear weights as ``[in, out]``);
    ``folded``      the names among ``parameters`` computed at trace time (not module state);
    ``derived``     folded name -> the module parameters and buffers it was computed from (a fold to redo
                    when they change);
    ``origins``     graph input name -> (the module parameter or buffer it holds, whether transposed);
                    a parameter is named as ``named_parameters()`` names it (a tied one by its first name);
    ``differentiated`` the module parameters that are live: held once each, every use computed in the graph;
    ``rng_input``   the graph input of the random state (int64 [2]: seed, offset) that train-mode dropout and
                    the other random operations draw from, or None where the module draws nothing; a caller
                    feeds it with :func:`draw_rng` (torch's generator: ``torch.manual_seed`` makes it repeat);
    ``input_names`` per positional user input, its graph input name (None if the module ignores it);
    ``output_names`` the saved outputs, in the order of the module's flattened outputs;
    ``source``      node name -> the source line of the module it was translated from;
    ``buffer_updates`` module buffer name -> the saved output holding its next value (batch norm's running
                    statistics in training mode); ``buffer_increments`` buffer name -> the integer increment
                    a counter gets every call (batch norm's ``num_batches_tracked``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.parameters: dict[str, np.ndarray] = {}
        self.folded: tuple[str, ...] = ()
        self.derived: dict[str, tuple[str, ...]] = {}
        self.origins: dict[str, tuple[str, bool]] = {}
        self.differentiated: tuple[str, ...] = ()
        self.rng_input: str | None = None
        self.input_names: tuple[str | None, ...] = ()
        self.output_names: tuple[str, ...] = ()
        self.source: dict[str, str] = {}
        # leaf i of the module's flattened output: a saved name, or a value that needs no computation
        self.output_leaves: tuple[tuple[str, Any], ...] = ()
        self.out_spec: Any = None
        self.input_types: tuple[tuple[tuple[int, ...], str], ...] = ()
        # buffers the forward updates: module buffer name -> the saved output of its next value, or the
        # increment a counter gets every call
        self.buffer_updates: dict[str, str] = {}
        self.buffer_increments: dict[str, Any] = {}

    def feeds(self, *inputs: Any) -> dict[str, Any]:
        """Every graph input's value: the parameters, and ``inputs`` (torch tensors or arrays) by position."""
        if len(inputs) != len(self.input_names):
            raise GraphError(f"this graph was traced with {len(self.input_names)} inputs; got {len(inputs)}.")
        out: dict[str, Any] = dict(self.parameters)
        for name, value in zip(self.input_names, inputs):
            if name is not None:
                out[name] = torch_to_numpy(value) if _is_torch_tensor(value) else np.asarray(value)
        if self.rng_input is not None:
            out[self.rng_input] = draw_rng()
        return out

    def trained(self, outputs: list[Tensor]) -> dict[str, tuple[str, bool]]:
        """Differentiated module parameter -> (its graph input, whether held transposed), for those some of
        ``outputs`` depends on through floating tensors: the parameters torch gives a gradient (its
        optimizers skip the others)."""
        read = {origin: (name, transposed) for name, (origin, transposed) in self.origins.items()
                if origin in self.differentiated}
        if not read or not outputs:
            return {}
        ok = flows(self, outputs, [self.tensor(self.node(name).id) for name, _ in read.values()])
        return {param: held for (param, held), y in zip(read.items(), ok) if y}


def draw_rng() -> np.ndarray:
    """A random state for one call, drawn from torch's default generator: [seed, 0] (int64)."""
    torch = _torch()
    return np.array([int(torch.randint(0, 2**62, ())), 0], dtype=np.int64)


# --- pruning ----------------------------------------------------------------------------------------------------

def _prune(g: TorchGraph) -> TorchGraph:
    """A copy of ``g`` without the nodes no saved output depends on (peepholes leave some behind)."""
    live: set[int] = set(g.outputs.values())
    for n in reversed(g.nodes):
        if n.id in live:
            live.update(n.inputs)
    out = TorchGraph()
    new: dict[int, Tensor] = {}
    for n in g.nodes:
        if n.id not in live:
            continue
        if n.op is None:
            leaf = out.parameter if n.role == "parameter" else out.input
            new[n.id] = leaf(n.name, n.type.shape, n.type.dtype, dims=n.type.names)
        else:
            # operators are immutable and typed by their inputs, which are unchanged: re-append as is
            new[n.id] = out._op(n.op, [new[i] for i in n.inputs], n.name)
    for name, i in g.outputs.items():
        out.save(new[i], name=name)
    kept = {n.name for n in out.nodes}
    out.parameters = {k: v for k, v in g.parameters.items() if k in kept}
    out.folded = tuple(k for k in g.folded if k in kept)
    out.derived = {k: v for k, v in g.derived.items() if k in kept}
    out.differentiated = g.differentiated
    out.rng_input = g.rng_input if g.rng_input in kept else None
    out.origins = {k: v for k, v in g.origins.items() if k in kept}
    out.input_names = tuple(k if k in kept else None for k in g.input_names)
    out.input_types = g.input_types
    out.output_names = g.output_names
    out.output_leaves = g.output_leaves
    out.buffer_updates = dict(g.buffer_updates)
    out.buffer_increments = dict(g.buffer_increments)
    out.out_spec = g.out_spec
    out.source = {k: v for k, v in g.source.items() if k in kept}
    return out

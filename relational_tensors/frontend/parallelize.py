"""A PyTorch module, traced, planned over every device and called like the module.

>>> import pytest; torch = pytest.importorskip("torch")
>>> from relational_tensors.frontend.parallelize import parallelize
>>> layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()
>>> x = torch.randn(8, 16)
>>> fast = parallelize(layer, (x,), device="cpu:4")
>>> bool(torch.allclose(fast(x), layer(x), atol=1e-5)), [n.kind for n in fast.graph.operators][:3]
(True, ['matmul', 'binary', 'unary'])
"""

from __future__ import annotations

from typing import Any

from relational_tensors.errors import ExecError
from relational_tensors.frontend.torch.convert import _torch, numpy_to_torch, torch_to_numpy
from relational_tensors.frontend.torch.translator import TorchGraph, from_torch

__all__ = ["parallelize", "ParallelModule"]


class ParallelModule:
    """The compiled form of a module: ``__call__(*tensors)`` returns what the module's forward returns.

    Parameters are loaded onto the devices once, at the first call; each call then
    loads its inputs, executes the plan and offloads the outputs as torch tensors
    (sharing memory with the offloaded arrays: ``torch.from_numpy`` on CPU devices,
    DLPack on GPUs).  ``graph`` is the traced :class:`TorchGraph`, ``compiled`` the
    ``CompiledGraph`` (``plan``, ``catalog``, ``explain()``, ``sql()``).

    The weights are the module's as traced.  A call after the module's parameters or buffers
    changed (in place, or replaced) is refused rather than run on the old values;
    :meth:`reload_weights` reads the current ones.
    """

    def __init__(self, graph: TorchGraph, compiled: Any, module: Any = None, example_inputs: Any = None) -> None:
        self.graph = graph
        self.compiled = compiled
        self.module = module
        self.example_inputs = example_inputs
        self._parameters_loaded = False
        self._partial_loads = True  # whether the executor keeps inputs that a load does not name
        self._state = self._module_state()

    def _module_state(self) -> dict[str, tuple[int, int, int]]:
        """Per parameter and buffer of the module: its identity, storage and in-place version counter."""
        if self.module is None:
            return {}
        tensors = [*self.module.named_parameters(), *self.module.named_buffers()]
        return {name: (id(t), t.data_ptr(), t._version) for name, t in tensors}

    def _check_weights(self) -> None:
        if self.module is None:
            return
        now = self._module_state()
        if now != self._state:
            changed = sorted(n for n in set(now) | set(self._state) if now.get(n) != self._state.get(n))
            raise ExecError(f"the module's weights changed since they were read ({', '.join(changed[:4])}"
                            f"{' ...' if len(changed) > 4 else ''}); the plan would run on the old values. "
                            "Call reload_weights() to read the current ones.")

    def reload_weights(self) -> None:
        """Read the module's current parameters and buffers (after training steps or a load_state_dict);
        the next call loads them onto the devices."""
        if self.module is None:
            raise ExecError("this ParallelModule was built from a traced graph, not a module: there are no "
                            "weights to read again. Use rt.parallelize(module, example_inputs).")
        again = from_torch(self.module, self.example_inputs)
        if set(again.parameters) != set(self.graph.parameters):
            raise ExecError("the module no longer traces to the planned graph (its parameters differ); "
                            "parallelize it again.")
        self.graph.parameters = again.parameters
        self._parameters_loaded = False
        self._state = self._module_state()

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
                    f"{str(x.dtype).removeprefix('torch.')}. Shapes are static: parallelize the module again with "
                    "example inputs of the new shape."
                )

    def _feed(self, x: Any) -> Any:
        # on GPUs the executor copies any __dlpack__ tensor device to device; on CPUs NumPy views it
        return x.detach() if self.compiled.devices.kind == "cuda" else torch_to_numpy(x)

    def _load(self, inputs: tuple[Any, ...]) -> None:
        user = {name: self._feed(x) for name, x in zip(self.graph.input_names, inputs) if name is not None}
        if self._parameters_loaded and self._partial_loads:
            try:
                self.compiled.load(user)
                return
            except ExecError as e:
                if "missing a value" not in str(e):
                    raise
                # this executor wants every input on each load: feed the parameters again from now on
                self._partial_loads = False
        self.compiled.load({**self.graph.parameters, **user})
        self._parameters_loaded = True

    def _offload(self, name: str) -> Any:
        if self.compiled.devices.kind == "cuda":
            out = numpy_to_torch(self.compiled.offload(name, like="cupy"))  # DLPack: stays on the GPU
            node = self.graph.nodes[self.graph.outputs[name]]
            if node.type.dtype == "bfloat16" and out.dtype != _torch().bfloat16:  # CuPy holds bfloat16 as bits
                out = out.view(_torch().bfloat16)
            return out
        return numpy_to_torch(self.compiled.offload(name))

    def __call__(self, *inputs: Any) -> Any:
        torch = _torch()
        self._check(inputs)
        self._check_weights()
        self._load(inputs)
        self.compiled.execute()
        leaves = []
        for kind, value in self.graph.output_leaves:
            leaves.append(self._offload(value) if kind == "saved" else value)
        return torch.utils._pytree.tree_unflatten(leaves, self.graph.out_spec)

    forward = __call__

    def __repr__(self) -> str:
        ops = len(self.graph.operators)
        return f"ParallelModule({ops} operators on {self.compiled.devices}, plan cost {self.compiled.plan.cost:,.0f})"


def parallelize(module: Any, example_inputs: Any, device: Any = None, **compile_options: Any) -> ParallelModule:
    """Trace ``module`` on ``example_inputs``, plan it for ``device`` and return a callable like the module.

    ``device`` and ``compile_options`` are those of ``rt.compileGraph`` (``"cpu:N"``,
    a GPU count or list, ``selector=``, ``cost_model=``, ``memory_per_device=``, ...).
    """
    from relational_tensors.compiler import compileGraph

    graph = from_torch(module, example_inputs)
    return ParallelModule(graph, compileGraph(graph, device=device, **compile_options), module, example_inputs)

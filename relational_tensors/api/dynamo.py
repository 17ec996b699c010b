"""A ``torch.compile`` backend: ``torch.compile(model, backend="relational_tensors", options={"device": ...})``.

TorchDynamo captures the user's code as FX graphs (one per region between graph breaks) and hands each,
with example inputs, to the backend; each becomes a :func:`~relational_tensors.api.parallelize.parallelize`
program.  Dynamo passes a module's parameters to the captured graph as inputs: the backend holds those
inputs (the user's own ``Parameter`` objects) in a small module, so they are traced as parameters and the
planned backward fills their ``.grad``.  Training therefore needs no AOTAutograd: a captured graph's
forward and backward are one two-phase program, as ``rt.parallelize`` plans them, and the user keeps
their optimizer, loop, data loader and autocast around it.  A new input shape is a new capture under
Dynamo's guards, planned once.

The backend is registered under torch's ``torch_dynamo_backends`` entry point (``pyproject.toml``), so the
name works after ``pip install``; ``options`` holds ``device`` and any ``rt.compileGraph`` option.

>>> import torch, relational_tensors as rt
>>> m = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 3))
>>> x = torch.randn(5, 6)
>>> cm = torch.compile(m, backend=rt.dynamo_backend, options={"device": "cpu:3"}, dynamic=False)
>>> torch.testing.assert_close(cm(x), m(x), rtol=1e-4, atol=1e-5)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from relational_tensors.api.parallelize import parallelize
from relational_tensors.errors import GraphError
from relational_tensors.frontend.torch.convert import _torch

__all__ = ["dynamo_backend"]


def _lifted(gm: Any, example_inputs: Sequence[Any], params: Sequence[int]) -> Any:
    """A module whose parameters are the captured graph's parameter inputs (the very objects), called with
    the other inputs in their order."""
    torch = _torch()
    positions = tuple(params)

    class Lifted(torch.nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.captured = gm
            self.params = torch.nn.ParameterList([example_inputs[k] for k in positions])

        def forward(self, *rest: Any) -> Any:
            args: list[Any] = list(rest)
            for k, p in zip(positions, self.params):
                args.insert(k, p)
            return self.captured(*args)

    return Lifted()


def dynamo_backend(gm: Any, example_inputs: Sequence[Any], options: dict[str, Any] | None = None) -> Callable:
    """Compile one captured FX graph for the devices ``options["device"]`` (any ``rt.compileGraph``
    option besides); returns the callable Dynamo runs in its place."""
    torch = _torch()
    opts = dict(options or {})
    device = opts.pop("device", None)
    for k, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"the relational_tensors backend plans tensors of static shapes; input {k} of the "
                             f"captured graph is a {type(x).__name__} ({x!r}). Compile with dynamic=False.")
        if any(not isinstance(n, int) for n in x.shape):
            raise GraphError(f"the relational_tensors backend plans static shapes; input {k} of the captured "
                             f"graph has the symbolic shape {tuple(x.shape)}. Compile with "
                             "torch.compile(..., dynamic=False): each new shape is then planned once.")
    params = [k for k, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter)]
    taken = set(params)
    rest = tuple(x for k, x in enumerate(example_inputs) if k not in taken)
    program = parallelize(_lifted(gm, example_inputs, params), rest, device=device, **opts)

    def run(*args: Any) -> Any:
        out = program(*(x for k, x in enumerate(args) if k not in taken))
        return out if isinstance(out, (tuple, list)) else (out,)

    return run

"""Model files: the Python files the command line plans and runs.

A model file defines ``build()`` returning an ``rt.Graph`` or a ``(torch.nn.Module, example inputs)``
pair, or a module-level ``graph``; it may define ``feeds(graph)`` returning the value of every graph
input (``relational-tensors run`` otherwise draws them: float inputs standard normal, weights scaled by
1/sqrt(fan-in), norms near 1; a torch module's own parameters and example inputs).
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from relational_tensors.errors import CommandError, RelationalTensorsError
from relational_tensors.graph.graph import Graph

__all__ = ["load_graph", "load_model"]


def _run(path: str) -> tuple[Any, str, dict[str, Any]]:
    """What a model file makes (``build()``'s result or its ``graph``), where it came from, and the file's
    namespace."""
    file = Path(path)
    if not file.is_file():
        raise CommandError(f"no such file {path!r}; give a Python file that defines build() returning an "
                           "rt.Graph, or a module-level graph.")
    sys.path.insert(0, str(file.resolve().parent))  # so the file can import its neighbours
    try:
        try:
            ns = runpy.run_path(str(file), run_name="__relational_tensors_model__")
        except RelationalTensorsError:
            raise
        except SystemExit as e:
            raise CommandError(f"running {path} called sys.exit({e.code!r}); a model file defines build() "
                               "and returns from it (an rt.Graph, or a torch module and example inputs).") from e
        except Exception as e:
            raise CommandError(f"running {path} failed with {type(e).__name__}: {e}") from e
        build = ns.get("build")
        if callable(build):
            try:
                made, source = build(), "build()"
            except RelationalTensorsError:
                raise
            except SystemExit as e:
                raise CommandError(f"{path}: build() called sys.exit({e.code!r}); it must return an rt.Graph "
                                   "(or a torch module and example inputs).") from e
            except Exception as e:
                raise CommandError(f"{path}: build() failed with {type(e).__name__}: {e}") from e
        elif "graph" in ns:
            made, source = ns["graph"], "graph"
        else:
            raise CommandError(f"{path} defines neither build() nor a module-level graph; define build() "
                               "returning an rt.Graph (or a (torch module, example inputs) pair).")
    finally:
        sys.path.remove(str(file.resolve().parent))
    return made, source, ns


def _is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")  # a file that made a torch module has imported torch
    return torch is not None and isinstance(x, torch.nn.Module)


def load_model(path: str) -> tuple[Graph, Callable[[], dict[str, Any]]]:
    """The graph a model file defines, and a function giving the value of every graph input."""
    made, source, ns = _run(path)
    if isinstance(made, Graph):
        graph: Graph = made
        given = ns.get("feeds")

        def feeds() -> dict[str, Any]:
            if callable(given):
                values = given(graph)
                if not isinstance(values, dict):
                    raise CommandError(f"{path}: feeds(graph) must return a dict of input name -> array; got "
                                       f"{type(values).__name__}.")
                return values
            return _drawn(graph, path)

        return graph, feeds
    if isinstance(made, (tuple, list)) and len(made) == 2 and _is_torch_module(made[0]):
        from relational_tensors.frontend.torch import from_torch

        module, example = made
        traced = from_torch(module, example)
        inputs = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        return traced, lambda: traced.feeds(*inputs)
    raise CommandError(f"{path}: {source} must be an rt.Graph or a (torch.nn.Module, example inputs) pair; "
                       f"got {type(made).__name__}.")


def load_graph(path: str) -> Graph:
    """The graph a model file defines: ``build()`` (a Graph, or a torch module and example inputs) or ``graph``."""
    return load_model(path)[0]


def _drawn(graph: Graph, path: str) -> dict[str, Any]:
    """Random values for every input of ``graph`` (the same on every rank: fixed seeds)."""
    from relational_tensors.graph.models import llama_feeds

    ints = [n.name for n in graph.inputs if not np.issubdtype(np.dtype(n.type.dtype if n.type.dtype != "bfloat16"
                                                                        else "float32"), np.floating)]
    if ints:
        raise CommandError(f"{path}: inputs {ints} are not floating point, so their values cannot be drawn at "
                           "random; define feeds(graph) in the model file returning every input's value.")
    return llama_feeds(graph)

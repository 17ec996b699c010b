"""What the translator, its rules and its patterns share: the operations that read only their
argument's shape (``_SHAPE_ONLY``), the exact dtype widenings (``_EXACT_WIDENINGS``), trace-time
constants (``_Const``), the ``_Unsupported`` error a rule raises (``_fail``), the name of the
operation an fx node calls (``_op_name``, ``_packet``), its source line and module path, graph-name
cleaning, and the small argument helpers the rules use (output shape and dtype of a node, axis
normalization, scalars, slice bounds).
"""

from __future__ import annotations

import operator
import re
from typing import Any

from relational_tensors.frontend.torch.convert import _dtype_name, _torch, host

# operations whose result depends only on the (static) shape and dtype of their tensor argument
_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"})

# prims whose arguments are those of the aten operation of the same name (``self``, ``other``)
_PRIMS_AS_ATEN = frozenset({"abs", "add", "cos", "div", "erf", "exp", "expm1", "log", "log1p", "mul", "neg", "rsqrt",
                            "sin", "sqrt", "sub", "tanh"})

# (narrow, wide): every value of the narrow dtype is exact in the wide one, so narrow -> wide -> narrow is the identity
_EXACT_WIDENINGS = frozenset({("float16", "float32"), ("float16", "float64"), ("bfloat16", "float32"),
                              ("bfloat16", "float64"), ("float32", "float64"), ("int32", "int64")})


class _Const:
    """A value known at trace time: a parameter, buffer or constant (``name`` is its module path),
    or something computed from those (``name`` is None; ``origin`` names the node).

    ``live``: a parameter that is differentiated (its value is an input of the program, and everything
    computed from it is translated into the graph, never folded); ``deps``: the module tensors a
    folded value was computed from (a fold must be redone when they change)."""

    __slots__ = ("_value", "tensor", "name", "origin", "live", "deps")

    def __init__(self, value: Any, name: str | None, origin: str, live: bool = False,
                 deps: frozenset[str] = frozenset(), tensor: Any = None) -> None:
        # ``tensor``: a module tensor as the module holds it (on its device); its host copy, ``value``, is
        # made when a rule first reads it (a GPU model's weights are read for their shapes only)
        self._value = value
        self.tensor = tensor if tensor is not None else value
        self.name, self.origin, self.live, self.deps = name, origin, live, deps

    @property
    def value(self) -> Any:
        """The constant's value on the host (a GPU module's tensor copied there at first read)."""
        if self._value is None:
            self._value = host(self.tensor)
        return self._value


class _Unsupported(Exception):
    """Raised inside a rule; the translator adds the operation, source line and supported set."""


def _fail(reason: str) -> _Unsupported:
    return _Unsupported(reason)


def _op_name(node: Any) -> str:
    """``aten.add.Tensor``: the operation a node calls, as torch prints it."""
    if node.target is operator.getitem:
        return "getitem"
    torch = _torch()
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    name = getattr(node.target, "name", None)
    if callable(name):
        try:
            return str(name()).replace("::", ".")
        except Exception:  # noqa: BLE001 - a higher-order op's name() may take arguments
            pass
    return getattr(node.target, "__name__", str(node.target))


def _packet(node: Any) -> str | None:
    """``add`` for aten.add.Tensor (and for the prims that torch's decompositions produce and that take the
    arguments of their aten namesakes, e.g. prims.log1p.default); None for anything else."""
    if node.target is operator.getitem:
        return "getitem"
    full = _op_name(node)
    if full.startswith("prims.") and full.split(".")[1] in _PRIMS_AS_ATEN:
        return full.split(".")[1]
    if full.startswith("relational_tensors."):  # this package's custom ops (frontend/torch/moe.py): rt_<name>
        return "rt_" + full.split(".")[1]
    if not full.startswith("aten."):
        return None
    return full.split(".")[1]


def _source(node: Any) -> str:
    """Where in the module's source this node came from: ``file:line in fn: code (module path)``."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    where = "an unknown source line (torch recorded no stack trace)"
    if frames:
        file, line, fn, code = frames[-1]
        where = f"{file}:{line} in {fn}: `{code.strip()}`"
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = list(stack.values())[-1]
        kind = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
        where += f" (module '{path}' of type {kind})" if path else f" (top-level module {kind})"
    return where


def _module_path(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _clean(name: str) -> str:
    """A name the exchange-program text accepts: letters, digits and ``_ . : -``."""
    name = re.sub(r"[^A-Za-z0-9_.:\-]", "_", name)
    return name if name and not name.lstrip("-").isdigit() else f"t{name}"


def _out_shape(node: Any) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _out_dtype(node: Any) -> str | None:
    return _dtype_name(node.meta["val"].dtype)


def _axis(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _axis_last(axis: int, rank: int) -> tuple[list[int], list[int]]:
    """(the permutation that moves ``axis`` last, the one that moves it back): a selection along any axis
    made along the last one."""
    order = [d for d in range(rank) if d != axis] + [axis]
    return order, [order.index(d) for d in range(rank)]


def _axis_first(axis: int, rank: int) -> tuple[list[int], list[int]]:
    """(the permutation that moves ``axis`` first, the one that moves it back): rows along any axis made
    along the first one."""
    order = [axis] + [d for d in range(rank) if d != axis]
    return order, [order.index(d) for d in range(rank)]


def _scalar(v: Any) -> float | None:
    """A Python number, or a one-element constant tensor, as a float."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, _Const) and not v.live and v.value.numel() == 1 and not v.value.is_complex():
        return float(v.value.reshape(()).item())
    return None


def _bounds(start: Any, stop: Any, size: int) -> tuple[int, int]:
    start = 0 if start is None else int(start)
    stop = size if stop is None else int(stop)
    start = max(0, min(size, start + size if start < 0 else start))
    stop = max(0, min(size, stop + size if stop < 0 else stop))
    return start, stop


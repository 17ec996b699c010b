"""PyTorch modules as graphs: trace with ``torch.export``, then translate the ATen graph rule by rule.

``from_torch(module, example_inputs)`` exports the module (static shapes, the
functional ATen graph ``torch.export`` produces before any decomposition, so
``linear``, ``layer_norm``, ``rms_norm`` and ``scaled_dot_product_attention``
arrive whole) and returns a :class:`TorchGraph`: an ``rt.Graph`` that also
carries the values of its parameters.

* Parameters, buffers and tensor constants become graph inputs of role
  ``parameter``, named by their module path (``layer.self_attn.q_proj.weight``).
  A ``Linear`` weight is stored transposed, ``[in, out]``, as ``matmul`` reads it.
* Whatever does not depend on a user input (rotary cos/sin tables, masks,
  ``arange``) is computed once with torch at trace time and enters the graph as
  one more parameter, named after the module and node that produced it.
* Recognized patterns, each replaced by one operator (and declined, so lowered
  op by op, when a check fails): hand-written RMSNorm
  (``x * rsqrt(mean(x**2, -1, keepdim=True) + eps) * w``) -> ``rmsnorm``;
  ``silu(a) * b`` -> ``swiglu``; GPT-2's tanh GELU written out -> ``gelu_tanh``;
  rotary embedding ``x * cos + rotate_half(x) * sin`` -> ``rope`` when the
  tables are the standard ones for positions 0..s-1 (the base is read from
  them), else slices, ``neg``, ``concat`` and products with the tables; k/v
  heads repeated by ``repeat_interleave`` or ``unsqueeze/expand/reshape`` before
  attention -> grouped-query ``attention``; a constant causal or block-diagonal
  attention mask -> ``causal``/``seq_ends``.
* Every translated node is checked against the shape torch recorded for it; a
  dtype that differs is cast to torch's.

An operation without a rule raises ``rt.GraphError`` naming the operation, the
source line of the module that called it and the supported set.

>>> import pytest; torch = pytest.importorskip("torch")
>>> from relational_tensors.frontend.torch_fx import from_torch
>>> g = from_torch(torch.nn.Linear(8, 4), (torch.randn(2, 8),))
>>> [n.name for n in g.nodes]
['input', 'weight', 'linear:matmul', 'bias', 'linear:add']
>>> g.node("weight").role, g.parameters["weight"].shape, g.output_names
('parameter', (8, 4), ('output',))
"""

from __future__ import annotations

import math
import operator
import re
import string
import warnings
from typing import Any, Callable, Sequence

import numpy as np

# Graph, Tensor and GraphError are taken from the package root, the objects rt.compileGraph checks against
# even where a test runner re-executes relational_tensors.frontend.graph (doctest collection does).
from relational_tensors import Graph, GraphError, Tensor
from relational_tensors.core.dtypes import numpy_dtype

__all__ = ["from_torch", "TorchGraph", "SUPPORTED_OPS", "torch_to_numpy", "numpy_to_torch"]


# --- the graph a module becomes ---------------------------------------------------------------------

class TorchGraph(Graph):
    """An ``rt.Graph`` traced from a PyTorch module, with what is needed to feed and read it.

    ``parameters``  graph input name -> NumPy value, for every input that is not a user input
                    (weights in graph layout, e.g. Linear weights as ``[in, out]``);
    ``folded``      the names among ``parameters`` computed at trace time (not module state);
    ``input_names`` per positional user input, its graph input name (None if the module ignores it);
    ``output_names`` the saved outputs, in the order of the module's flattened outputs;
    ``source``      node name -> the source line of the module it was translated from.
    """

    def __init__(self) -> None:
        super().__init__()
        self.parameters: dict[str, np.ndarray] = {}
        self.folded: tuple[str, ...] = ()
        self.input_names: tuple[str | None, ...] = ()
        self.output_names: tuple[str, ...] = ()
        self.source: dict[str, str] = {}
        # leaf i of the module's flattened output: a saved name, or a value that needs no computation
        self.output_leaves: tuple[tuple[str, Any], ...] = ()
        self.out_spec: Any = None
        self.input_types: tuple[tuple[tuple[int, ...], str], ...] = ()

    def feeds(self, *inputs: Any) -> dict[str, Any]:
        """Every graph input's value: the parameters, and ``inputs`` (torch tensors or arrays) by position."""
        if len(inputs) != len(self.input_names):
            raise GraphError(f"this graph was traced with {len(self.input_names)} inputs; got {len(inputs)}.")
        out: dict[str, Any] = dict(self.parameters)
        for name, value in zip(self.input_names, inputs):
            if name is not None:
                out[name] = torch_to_numpy(value) if _is_torch_tensor(value) else np.asarray(value)
        return out


# --- conversions --------------------------------------------------------------------------------------

def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only without torch
        raise GraphError("from_torch and parallelize need PyTorch; install it with pip install "
                         "'relational_tensors[torch]'.") from e
    return torch


def _is_torch_tensor(x: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, torch.Tensor)


def _dtype_name(dtype: Any) -> str | None:
    torch = _torch()
    return {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
            torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32"}.get(dtype)


def _torch_dtype(name: str) -> Any:
    torch = _torch()
    return {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
            "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}[name]


def torch_to_numpy(t: Any) -> np.ndarray:
    """A CPU torch tensor as a NumPy array without a copy where the layout allows (bfloat16 via ml_dtypes)."""
    torch = _torch()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def numpy_to_torch(a: Any) -> Any:
    """An array (NumPy, or anything with ``__dlpack__`` such as a CuPy array) as a torch tensor, sharing memory."""
    torch = _torch()
    if isinstance(a, np.ndarray):
        if a.dtype == numpy_dtype("bfloat16"):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))
    return torch.from_dlpack(a)


# --- what the translator works with ---------------------------------------------------------------------

# operations whose result depends only on the (static) shape and dtype of their tensor argument
_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"})

# (narrow, wide): every value of the narrow dtype is exact in the wide one, so narrow -> wide -> narrow is the identity
_EXACT_WIDENINGS = frozenset({("float16", "float32"), ("float16", "float64"), ("bfloat16", "float32"),
                              ("bfloat16", "float64"), ("float32", "float64"), ("int32", "int64")})


class _Const:
    """A value known at trace time: a parameter, buffer or constant (``name`` is its module path),
    or something computed from those (``name`` is None; ``origin`` names the node)."""

    __slots__ = ("value", "name", "origin")

    def __init__(self, value: Any, name: str | None, origin: str) -> None:
        self.value, self.name, self.origin = value, name, origin


_Rule = Callable[["_Translator", Any, dict[str, Any]], Any]
_RULES: dict[str, _Rule] = {}


def _rule(*names: str) -> Callable[[_Rule], _Rule]:
    """Register a translation rule for the ATen operations ``names`` (overload packets)."""
    def deco(fn: _Rule) -> _Rule:
        for n in names:
            _RULES[n] = fn
        return fn
    return deco


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
    """``add`` for aten.add.Tensor; None for anything outside the aten namespace."""
    if node.target is operator.getitem:
        return "getitem"
    full = _op_name(node)
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


# --- the translator -----------------------------------------------------------------------------------------

class _Translator:
    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.fx = ep.graph
        self.g = TorchGraph()
        self.env: dict[Any, Any] = {}
        self.values: dict[str, np.ndarray] = {}
        self.folded: list[str] = []
        self.used: set[str] = set()
        self.prefix = ""
        self.current: Any = None
        self._materialized: dict[tuple[int, str, str], Tensor] = {}
        self._keep: list[_Const] = []
        self.rewrites: dict[Any, tuple[str, dict[str, Any]]] = {}
        self.symbolic: set[Any] = set()

    # --- names ------------------------------------------------------------------
    def unique(self, base: str) -> str:
        base = _clean(base)
        name, n = base, 1
        while name in self.used:
            name = f"{base}-{n}"
            n += 1
        self.used.add(name)
        return name

    def name(self, kind: str) -> str:
        name = self.unique(f"{self.prefix}:{kind}" if self.prefix else kind)
        if self.current is not None:
            self.g.source[name] = _source(self.current)
        return name

    # --- constants as graph inputs ---------------------------------------------------
    def materialize(self, c: _Const, dtype: str | None = None, transpose: bool = False) -> Tensor:
        """The graph input holding constant ``c`` (cast to ``dtype``, transposed for a Linear weight)."""
        value = c.value
        want = dtype or _dtype_name(value.dtype)
        if want is None:
            raise _fail(f"a constant of dtype {value.dtype} ({c.name or c.origin}, shape {tuple(value.shape)}) "
                        "would enter the graph; only float16/bfloat16/float32/float64/int32/int64 tensors can")
        key = (id(c), want, "T" if transpose else "")
        if key in self._materialized:
            return self._materialized[key]
        self._keep.append(c)
        v = value.detach()
        if transpose:
            v = v.t()
        if _dtype_name(v.dtype) != want:
            v = v.to(_torch_dtype(want))
        base = c.name if c.name is not None else c.origin
        if base in self.used:  # the same constant in another layout or dtype
            base = f"{base}.T" if transpose else f"{base}.{want}"
        name = self.unique(base)
        t = self.g.parameter(name, tuple(v.shape), want)
        self.values[name] = torch_to_numpy(v)
        if c.name is None:
            self.folded.append(name)
        self._materialized[key] = t
        return t

    def sym(self, v: Any, dtype: str | None = None) -> Tensor:
        """``v`` as a graph tensor of ``dtype`` (constants become parameters)."""
        if isinstance(v, _Const):
            return self.materialize(v, dtype)
        if isinstance(v, Tensor):
            return self.cast(v, dtype) if dtype is not None else v
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            torch = _torch()
            c = _Const(torch.tensor([v], dtype=_torch_dtype(dtype or "float32")), None, f"{self.prefix}.scalar")
            return self.materialize(c, dtype)
        raise _fail(f"expected a tensor operand; got {type(v).__name__} {v!r}")

    # --- emitting, with the peepholes that keep layout chains short -----------------------------
    def cast(self, x: Tensor, dtype: str | None) -> Tensor:
        if dtype is None or x.dtype == dtype:
            return x
        op = x.node.op
        if op is not None and op.kind == "unary" and getattr(op, "op", None) == "cast":
            source = Tensor(self.g, x.node.inputs[0])
            if source.dtype == dtype and (dtype, x.dtype) in _EXACT_WIDENINGS:  # a round trip through a wider type
                return source
        return self.g.cast(x, dtype, name=self.name("cast"))

    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        shape = tuple(int(s) for s in shape)
        if x.shape == shape:
            return x
        if x.node.op is not None and x.node.op.kind == "reshape":
            x = Tensor(self.g, x.node.inputs[0])
            if x.shape == shape:
                return x
        return self.g.reshape(x, shape, name=self.name("reshape"))

    def permute(self, x: Tensor, perm: Sequence[int]) -> Tensor:
        perm = tuple(int(p) % x.rank for p in perm) if x.rank else tuple(perm)
        if perm == tuple(range(x.rank)):
            return x
        op = x.node.op
        if op is not None and op.kind == "permute":
            inner: tuple[int, ...] = getattr(op, "perm")
            perm = tuple(inner[p] for p in perm)
            x = Tensor(self.g, x.node.inputs[0])
            if perm == tuple(range(x.rank)):
                return x
        return self.g.permute(x, perm, name=self.name("permute"))

    def unary(self, x: Tensor, op: str, arg: float = 0.0) -> Tensor:
        return self.g.unary(x, op, arg, name=self.name(op))

    def binary(self, x: Tensor, y: Tensor, op: str) -> Tensor:
        return self.g.binary(x, y, op, name=self.name(op))

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """torch.matmul on operands of rank >= 2, batch dimensions broadcast."""
        if b.rank == 2 or a.shape[:-2] == b.shape[:-2]:
            return self.g.matmul(a, b, name=self.name("matmul"))
        ba, bb = a.shape[:-2], b.shape[:-2]
        n = max(len(ba), len(bb))
        batch = []
        for d in range(n):
            sizes = {s[d - n + len(s)] for s in (ba, bb) if d - n + len(s) >= 0} - {1}
            if len(sizes) > 1:
                raise _fail(f"matmul batch dimensions do not broadcast: {a.shape} @ {b.shape}")
            batch.append(sizes.pop() if sizes else 1)
        letters = [c for c in string.ascii_letters if c not in "ijk"][:n]
        subs, ops = [], []
        for t, bs in ((a, ba), (b, bb)):
            off = n - len(bs)
            keep = [d for d in range(len(bs)) if not (bs[d] == 1 and batch[off + d] != 1)]
            if len(keep) != len(bs):
                t = self.reshape(t, [bs[d] for d in keep] + list(t.shape[-2:]))
            subs.append("".join(letters[off + d] for d in keep))
            ops.append(t)
        spec = f"{subs[0]}ij,{subs[1]}jk->{''.join(letters)}ik"
        return self.g.einsum(spec, *ops, name=self.name("einsum"))

    def slice(self, x: Tensor, axis: int, start: int, stop: int) -> Tensor:
        if start == 0 and stop == x.shape[axis]:
            return x
        return self.g.slice(x, axis, start, stop, name=self.name("slice"))

    def concat(self, xs: Sequence[Tensor], axis: int) -> Tensor:
        xs = [x for x in xs if x.shape[axis] > 0]
        if len(xs) == 1:
            return xs[0]
        return self.g.concat(xs, axis, name=self.name("concat"))

    def repeat(self, x: Tensor, axis: int, times: int) -> Tensor:
        """``times`` copies of x along ``axis`` (expand of a size-1 axis, tile)."""
        return x if times == 1 else self.concat([x] * times, axis)

    def const_ones(self, n: int, dtype: str, what: str) -> Tensor:
        torch = _torch()
        return self.materialize(_Const(torch.ones(n, dtype=_torch_dtype(dtype)), None, f"{self.prefix}.{what}"))

    # --- the passes ----------------------------------------------------------------------------------
    def run(self) -> TorchGraph:
        self._find_symbolic()
        self._find_patterns()
        needed = self._needed()
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs}
        user_inputs: list[str | None] = []
        input_types: list[tuple[tuple[int, ...], str]] = []
        for node in self.fx.nodes:
            self.current = node
            if node.op == "placeholder":
                self._placeholder(node, specs[node.name], user_inputs, input_types)
            elif node.op == "call_function":
                if node in needed:
                    self._call(node)
            elif node.op == "get_attr":  # a subgraph or tensor held by the exported module
                value = getattr(self.ep.graph_module, node.target)
                self.env[node] = _Const(value, None, node.name) if _is_torch_tensor(value) else value
            elif node.op == "output":
                self._output(node)
        self.current = None
        self.g.input_names = tuple(user_inputs)
        self.g.input_types = tuple(input_types)
        return self.g

    def _find_symbolic(self) -> None:
        """Nodes whose value depends on a user input; every other node is folded with torch."""
        from torch.export.graph_signature import InputKind

        users = {s.arg.name for s in self.ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
        for node in self.fx.nodes:
            if node.op == "placeholder":
                if node.name in users:
                    self.symbolic.add(node)
            elif node.op == "call_function" and _packet(node) in _SHAPE_ONLY:
                continue  # reads only the shape and dtype of its tensor argument, which are static
            elif any(i in self.symbolic for i in node.all_input_nodes):
                self.symbolic.add(node)

    def _find_patterns(self) -> None:
        for node in self.fx.nodes:
            if node.op != "call_function" or node not in self.symbolic:
                continue
            name = _op_name(node)
            if name in ("aten.mul.Tensor", "aten.div.Tensor"):
                m = _match_rmsnorm(node, self.symbolic)
                if m is not None:
                    self.rewrites[node] = ("rmsnorm", m)
                    continue
            if name == "aten.mul.Tensor":
                m = _match_swiglu(node, self.symbolic) or _match_gelu_tanh(node, self.symbolic)
                if m is not None:
                    self.rewrites[node] = ("swiglu" if "b" in m else "gelu_tanh", m)
            if name == "aten.add.Tensor":
                m = _match_rope(node, self.symbolic)
                if m is not None:
                    self.rewrites[node] = ("rope", m)
            if name == "aten.scaled_dot_product_attention.default":
                m = _match_repeated_kv(node)
                if m is not None:
                    self.rewrites[node] = ("gqa", m)

    def _needed(self) -> set[Any]:
        """Nodes the outputs depend on, given the patterns (a recognized pattern needs only its inputs)."""
        needed: set[Any] = set()
        for node in reversed(list(self.fx.nodes)):
            if node.op == "output":
                needed.update(node.all_input_nodes)
            elif node in needed and _packet(node) not in _SHAPE_ONLY:
                if node in self.rewrites:
                    needed.update(v for v in self.rewrites[node][1].values() if hasattr(v, "op"))
                else:
                    needed.update(node.all_input_nodes)
        return needed

    def _placeholder(self, node: Any, spec: Any, user_inputs: list[str | None],
                     input_types: list[tuple[tuple[int, ...], str]]) -> None:
        from torch.export.graph_signature import InputKind

        val = node.meta.get("val")
        if spec.kind == InputKind.USER_INPUT:
            if not _is_torch_tensor(val):
                raise GraphError(f"from_torch takes tensor inputs only; input {node.name!r} is {val!r}. Bind "
                                 "non-tensor arguments in the module (e.g. functools.partial or a wrapper).")
            dtype = _dtype_name(val.dtype)
            if dtype is None:
                raise GraphError(f"input {node.name!r} has dtype {val.dtype}; graph inputs are float16, bfloat16, "
                                 "float32, float64, int32 or int64.")
            self.env[node] = self.g.input(self.unique(node.name), tuple(val.shape), dtype)
            user_inputs.append(self.env[node].name)
            input_types.append((tuple(val.shape), dtype))
            return
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            value = self.ep.state_dict.get(spec.target)
            if value is None:
                value = self.ep.constants[spec.target]
            self.env[node] = _Const(value, spec.target, spec.target)
            return
        raise GraphError(f"from_torch cannot take the export input {node.name!r} of kind {spec.kind.name}; "
                         "only tensors, parameters, buffers and tensor constants are supported.")

    def _call(self, node: Any) -> None:
        saved = self.prefix, self.current
        path = _module_path(node)
        self.prefix = f"{path}.{node.name}" if path else node.name
        self.current = node
        packet = _packet(node)
        try:
            if node not in self.symbolic:
                self.env[node] = self._fold(node)
                return
            result = None
            if node in self.rewrites:
                kind, match = self.rewrites[node]
                result = _PATTERNS[kind](self, node, match)  # None: the pattern declines; translate as written
            if result is None:
                rule = _RULES.get(packet) if packet is not None else None
                if rule is None:
                    raise _fail("no translation rule for this operation")
                result = rule(self, node, self._bind(node) if packet != "getitem" else {})
            self.env[node] = self._check(node, result)
        except _Unsupported as e:
            called = node.meta.get("torch_fn")
            what = f"{_op_name(node)} (from `{called[1].rsplit('.', 1)[-1]}`)" if called else _op_name(node)
            err = GraphError(
                f"from_torch cannot translate {what} at {_source(node)}: {e}. "
                f"Supported operations: {', '.join(SUPPORTED_OPS)}. Rewrite that line with supported operations, "
                "or compute it outside the module and pass the result as an input."
            )
            err.located = True  # type: ignore[attr-defined]
            raise err from None
        except GraphError as e:
            if getattr(e, "located", False):
                raise
            err = GraphError(f"while translating {_op_name(node)} at {_source(node)}: {e}")
            err.located = True  # type: ignore[attr-defined]
            raise err from e
        finally:
            self.prefix, self.current = saved

    def _arg(self, v: Any) -> Any:
        if hasattr(v, "op") and hasattr(v, "meta"):  # an fx.Node
            if v not in self.env:  # skipped for a pattern that then declined: translate it now
                self._call(v)
            return self.env[v]
        if isinstance(v, (list, tuple)):
            return type(v)(self._arg(x) for x in v)
        return v

    def _bind(self, node: Any) -> dict[str, Any]:
        """The node's arguments by schema name, defaults filled in, nodes replaced by their values."""
        out: dict[str, Any] = {}
        for i, arg in enumerate(node.target._schema.arguments):
            if i < len(node.args) and not arg.kwarg_only:
                v = node.args[i]
            elif arg.name in node.kwargs:
                v = node.kwargs[arg.name]
            elif arg.has_default_value():
                v = arg.default_value
            else:
                v = None
            out[arg.name] = self._arg(v)
        return out

    def _fold(self, node: Any) -> Any:
        """Run a node that depends on no user input with torch, once, at trace time."""
        torch = _torch()
        shape_only = _packet(node) in _SHAPE_ONLY

        def unwrap(v: Any) -> Any:
            if hasattr(v, "op") and hasattr(v, "meta"):  # an fx.Node
                if shape_only and v in self.symbolic:  # only its static shape and dtype are read
                    return torch.zeros(v.meta["val"].shape, dtype=v.meta["val"].dtype)
                v = self._arg(v)
            if isinstance(v, _Const):
                return v.value
            if isinstance(v, (list, tuple)):
                return type(v)(unwrap(x) for x in v)
            return v

        args = unwrap(node.args)
        kwargs = {k: unwrap(v) for k, v in node.kwargs.items()}
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            a = self._bind(node)
            if not (a.get("train") is False or a.get("p") == 0 or a.get("dropout_p") == 0):
                raise _fail("it draws random numbers, and a graph computes the same values on every call; "
                            "call module.eval(), or pass random tensors as inputs")
        if node.target is operator.getitem:
            value = args[0][args[1]]
        else:
            try:
                with torch.no_grad():
                    value = node.target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reported with the node's source line
                raise _fail(f"it depends on no input, and computing it once at trace time failed: "
                            f"{type(e).__name__}: {e}") from e
        return self._wrap(value, self.prefix)

    def _wrap(self, value: Any, origin: str) -> Any:
        if _is_torch_tensor(value):
            return _Const(value, None, origin)
        if isinstance(value, (list, tuple)):
            return type(value)(self._wrap(v, f"{origin}.{k}") for k, v in enumerate(value))
        return value

    def _check(self, node: Any, result: Any) -> Any:
        """Hold a translated value against the shape and dtype torch recorded for the node."""
        val = node.meta.get("val")
        if isinstance(result, Tensor):
            if not _is_torch_tensor(val):
                return result
            if tuple(result.shape) != tuple(val.shape):
                raise GraphError(f"the rule for {_op_name(node)} produced shape {result.shape}, but torch records "
                                 f"{tuple(val.shape)}; this is a bug in from_torch, please report it.")
            want = _dtype_name(val.dtype)
            if want is None:
                raise _fail(f"it produces a {val.dtype} tensor; tensors in a graph are float16, bfloat16, float32, "
                            "float64, int32 or int64")
            return self.cast(result, want)
        if isinstance(result, (list, tuple)) and isinstance(val, (list, tuple)):
            return type(result)(self._check_item(node, r, v) for r, v in zip(result, val))
        return result

    def _check_item(self, node: Any, r: Any, v: Any) -> Any:
        if isinstance(r, Tensor) and tuple(r.shape) != tuple(v.shape):
            raise GraphError(f"the rule for {_op_name(node)} produced shape {r.shape}, but torch records "
                             f"{tuple(v.shape)}; this is a bug in from_torch, please report it.")
        return r

    def _output(self, node: Any) -> None:
        from torch.export.graph_signature import OutputKind

        specs = self.ep.graph_signature.output_specs
        bad = [s for s in specs if s.kind != OutputKind.USER_OUTPUT]
        if bad:
            what = ", ".join(f"{s.kind.name.lower()} of {s.target!r}" for s in bad)
            raise GraphError(f"from_torch translates pure functions; this module's forward has side effects "
                             f"({what}). Move state updates (running statistics, counters, caches) out of forward, "
                             "or call module.eval().")
        values = node.args[0]
        leaves: list[tuple[str, Any]] = []
        names: list[str] = []
        single = len(values) == 1
        for k, v in enumerate(values):
            value = self._arg(v)
            if isinstance(value, Tensor):
                name = "output" if single else f"output_{k}"
                self.g.save(value, name=name)
                names.append(name)
                leaves.append(("saved", name))
            elif isinstance(value, _Const):
                leaves.append(("value", value.value))
            else:
                leaves.append(("value", value))
        self.g.output_names = tuple(names)
        self.g.output_leaves = tuple(leaves)


# --- pattern matching on the fx graph -------------------------------------------------------------------------

def _is(node: Any, *names: str) -> bool:
    return getattr(node, "op", None) == "call_function" and _op_name(node) in names


def _shape(node: Any) -> tuple[int, ...] | None:
    val: Any = getattr(node, "meta", {}).get("val")
    return tuple(val.shape) if _is_torch_tensor(val) else None


_CASTS = ("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.clone.default",
          "aten.contiguous.default", "aten.alias.default")


def _strip(node: Any) -> Any:
    while _is(node, *_CASTS) and _shape(node) == _shape(node.args[0]):
        node = node.args[0]
    return node


def _match_mean_square(node: Any) -> tuple[Any, float] | None:
    """``add(mean(pow(h, 2) or h*h, [-1], keepdim=True), eps)`` -> (h, eps)."""
    if not _is(node, "aten.add.Tensor", "aten.add.Scalar") or len(node.args) < 2:
        return None
    mean, eps = node.args[0], node.args[1]
    if not isinstance(eps, (int, float)) or node.kwargs.get("alpha", 1) != 1:
        return None
    if not _is(mean, "aten.mean.dim") or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    square = _strip(mean.args[0])
    rank = len(_shape(square) or ())
    if list(mean.args[1] or []) not in ([-1], [rank - 1]):
        return None
    if _is(square, "aten.pow.Tensor_Scalar") and square.args[1] == 2:
        h = square.args[0]
    elif _is(square, "aten.mul.Tensor") and square.args[0] is square.args[1]:
        h = square.args[0]
    else:
        return None
    return h, float(eps)


def _match_unweighted(node: Any) -> tuple[Any, float] | None:
    """``h * rsqrt(ms + eps)`` or ``h / sqrt(ms + eps)`` with ms the mean square of h."""
    if _is(node, "aten.mul.Tensor"):
        for h, r in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if _is(r, "aten.rsqrt.default"):
                m = _match_mean_square(r.args[0])
                if m is not None and m[0] is h:
                    return m
    if _is(node, "aten.div.Tensor") and _is(node.args[1], "aten.sqrt.default"):
        m = _match_mean_square(node.args[1].args[0])
        if m is not None and m[0] is node.args[0]:
            return m
    return None


def _match_rmsnorm(node: Any, symbolic: set[Any]) -> dict[str, Any] | None:
    m = _match_unweighted(node)
    if m is not None and m[0] in symbolic:
        return {"x": m[0], "w": None, "eps": m[1]}
    if not _is(node, "aten.mul.Tensor"):
        return None
    for u, w in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        m = _match_unweighted(_strip(u))
        if m is not None and m[0] in symbolic and hasattr(w, "op"):
            d = (_shape(m[0]) or (None,))[-1]
            if _shape(w) == (d,) and _shape(node) == _shape(m[0]):
                return {"x": m[0], "w": w, "eps": m[1]}
    return None


def _match_swiglu(node: Any, symbolic: set[Any]) -> dict[str, Any] | None:
    for s, b in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if _is(s, "aten.silu.default") and hasattr(b, "op") and b in symbolic and s.args[0] in symbolic:
            if _shape(s) == _shape(b) == _shape(node):
                return {"a": s.args[0], "b": b}
    return None


def _number_operand(node: Any, *names: str) -> tuple[Any, float] | None:
    """(tensor, number) for ``tensor op number`` in either order."""
    if not _is(node, *names) or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if isinstance(b, (int, float)) and not isinstance(b, bool) and hasattr(a, "op"):
        return a, float(b)
    if isinstance(a, (int, float)) and not isinstance(a, bool) and hasattr(b, "op"):
        return b, float(a)
    return None


def _match_gelu_tanh(node: Any, symbolic: set[Any]) -> dict[str, Any] | None:
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` (GPT-2's gelu_new) -> gelu_tanh(x)."""
    for half, one_plus in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        h = _number_operand(half, "aten.mul.Tensor")
        o = _number_operand(one_plus, "aten.add.Tensor")
        if h is None or o is None or h[1] != 0.5 or o[1] != 1.0 or not _is(o[0], "aten.tanh.default"):
            continue
        x = h[0]
        inner = _number_operand(o[0].args[0], "aten.mul.Tensor")
        if inner is None or not math.isclose(inner[1], math.sqrt(2 / math.pi), rel_tol=1e-6):
            continue
        total = inner[0]
        if not _is(total, "aten.add.Tensor") or x not in total.args or len(total.args) != 2:
            continue
        cube = _number_operand(total.args[1] if total.args[0] is x else total.args[0], "aten.mul.Tensor")
        if cube is None or not math.isclose(cube[1], 0.044715, rel_tol=1e-6):
            continue
        if _is(cube[0], "aten.pow.Tensor_Scalar") and cube[0].args[0] is x and cube[0].args[1] == 3 and x in symbolic:
            return {"x": x}
    return None


def _repeat_source(node: Any) -> tuple[Any, int] | None:
    """k or v whose heads were repeated for grouped-query attention -> (unrepeated, repeats)."""
    shape = _shape(node)
    if shape is None or len(shape) != 4:
        return None
    if _is(node, "aten.repeat_interleave.self_int"):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim in (1, -3) and isinstance(node.args[1], int):
            return node.args[0], node.args[1]
        return None
    if _is(node, "aten.reshape.default", "aten.view.default", "aten._unsafe_view.default"):
        e = node.args[0]
        if _is(e, "aten.expand.default") and _is(e.args[0], "aten.unsqueeze.default"):
            u = e.args[0]
            src = u.args[0]
            s, es = _shape(src), _shape(e)
            if u.args[1] in (2, -3) and s is not None and len(s) == 4 and es is not None and len(es) == 5:
                b, h, n, sq, d = es
                if (b, h, sq, d) == s and shape == (b, h * n, sq, d):
                    return src, n
    return None


def _match_repeated_kv(node: Any) -> dict[str, Any] | None:
    k, v = node.args[1], node.args[2]
    rk, rv = _repeat_source(k), _repeat_source(v)
    if rk is None or rv is None or rk[1] != rv[1]:
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return {"q": node.args[0], "k": rk[0], "v": rv[0], "mask": mask}


# --- recognized patterns ----------------------------------------------------------------------------------------

def _emit_rmsnorm(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor:
    x = tr.sym(tr.env[m["x"]])
    if m["w"] is None:
        w = tr.const_ones(x.shape[-1], x.dtype, "rmsnorm_weight")
    else:
        w = tr.sym(tr.env[m["w"]], x.dtype)
    return tr.g.rmsnorm(x, w, m["eps"], name=tr.name("rmsnorm"))


def _emit_swiglu(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor:
    dtype = _dtype_name(node.meta["val"].dtype)
    a, b = tr.sym(tr.env[m["a"]], dtype), tr.sym(tr.env[m["b"]], dtype)
    return tr.g.swiglu(a, b, name=tr.name("swiglu"))


def _emit_gelu_tanh(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor:
    return tr.unary(tr.sym(tr.env[m["x"]], _out_dtype(node)), "gelu_tanh")


def _emit_gqa(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor:
    args = {"key": m["k"], "value": m["v"]}
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in args:
            bound[arg.name] = tr.env[args[arg.name]]
        elif i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = tr._arg(node.args[i])
        elif arg.name in node.kwargs:
            bound[arg.name] = tr._arg(node.kwargs[arg.name])
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    bound["enable_gqa"] = True
    return _sdpa(tr, node, bound)


def _match_rope(node: Any, symbolic: set[Any]) -> dict[str, Any] | None:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = cat(-x[..., h:], x[..., :h]) and constant tables."""
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    for m1, m2 in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (_is(m1, "aten.mul.Tensor") and _is(m2, "aten.mul.Tensor")):
            continue
        for x, cos in ((m1.args[0], m1.args[1]), (m1.args[1], m1.args[0])):
            if x not in symbolic or not hasattr(cos, "op") or cos in symbolic:
                continue
            for rot, sin in ((m2.args[0], m2.args[1]), (m2.args[1], m2.args[0])):
                if hasattr(sin, "op") and sin not in symbolic and _is_rotate_half(rot, x):
                    return {"x": x, "cos": cos, "sin": sin}
    return None


def _is_rotate_half(node: Any, x: Any) -> bool:
    shape = _shape(x)
    if shape is None or not shape or shape[-1] % 2 or not _is(node, "aten.cat.default"):
        return False
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank, half = len(shape), shape[-1] // 2
    if len(parts) != 2 or dim not in (-1, rank - 1) or not _is(parts[0], "aten.neg.default"):
        return False

    def is_half(s: Any, start: int, stop: int) -> bool:
        if not _is(s, "aten.slice.Tensor") or s.args[0] is not x:
            return False
        args = list(s.args) + [None] * (5 - len(s.args))
        lo, hi = _bounds(args[2], args[3], shape[-1])
        return args[1] in (-1, rank - 1) and (args[4] in (None, 1)) and (lo, hi) == (start, stop)

    return is_half(parts[0].args[0], half, shape[-1]) and is_half(parts[1], 0, half)


def _rope_tables(cos: np.ndarray, sin: np.ndarray, d: int) -> tuple[float, tuple[int, ...] | None] | None:
    """(base, seq_ends) when ``cos``/``sin`` [s, d] are the standard rotate-half tables of positions 0..s-1,
    or of positions that restart at 0 at each packed sequence (rows equal to position 0's start one)."""
    from relational_tensors.sql_specs.rope import rope_tables

    s, half = cos.shape[0], d // 2
    tol = 4 * float(np.finfo(np.float32).eps) * max(s, 8) if cos.dtype.itemsize >= 4 else 2e-2
    starts = [r for r in range(s) if np.allclose(cos[r], 1, atol=tol) and np.allclose(sin[r], 0, atol=tol)]
    if not starts or starts[0] != 0:
        return None
    positions = np.arange(s) - np.array(starts)[np.searchsorted(starts, np.arange(s), side="right") - 1]
    base = 10000.0  # irrelevant when every position is 0 or d = 2
    ones = np.flatnonzero(positions == 1)
    if half > 1 and ones.size:
        step = math.atan2(float(sin[ones[0], 1]), float(cos[ones[0], 1]))  # position 1, frequency base^(-2/d)
        if not 0 < step < 1:
            return None
        base = step ** (-d / 2)
    want_cos, want_sin = rope_tables(positions, d, base, np.dtype(np.float64))
    for got, want in ((cos, want_cos), (sin, want_sin)):
        full = np.concatenate([want, want], axis=1)
        if not np.allclose(got.astype(np.float64), full, rtol=0, atol=tol):
            return None
    return base, (tuple(starts[1:]) + (s,) if len(starts) > 1 else None)


def _emit_rope(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor | None:
    """Use the rope operator when the tables are the standard ones for positions 0..s-1; else decline."""
    x, cos, sin = tr.env[m["x"]], tr.env[m["cos"]], tr.env[m["sin"]]
    if not isinstance(x, Tensor) or not isinstance(cos, _Const) or not isinstance(sin, _Const) or x.rank != 4:
        return None
    if _out_shape(node) != x.shape:
        return None
    for seq_axis, head_axis in ((2, 1), (1, 2)):
        perm = (0, seq_axis, head_axis, 3)
        try:
            c = cos.value.broadcast_to(x.shape).permute(perm)
            s = sin.value.broadcast_to(x.shape).permute(perm)
        except RuntimeError:
            return None
        tc, ts = c[0, :, 0, :], s[0, :, 0, :]
        if not (bool((c == tc[None, :, None, :]).all()) and bool((s == ts[None, :, None, :]).all())):
            continue
        found = _rope_tables(torch_to_numpy(tc.float()), torch_to_numpy(ts.float()), x.shape[3])
        if found is None:
            continue
        xs = tr.cast(tr.permute(x, perm), _out_dtype(node))  # tables of a wider dtype promote x, as in torch
        y = tr.g.rope(xs, found[0], seq_ends=found[1], name=tr.name("rope"))
        return tr.permute(y, perm)
    return None


_PATTERNS: dict[str, Callable[[_Translator, Any, dict[str, Any]], Any]] = {
    "rmsnorm": _emit_rmsnorm,
    "swiglu": _emit_swiglu,
    "gqa": _emit_gqa,
    "rope": _emit_rope,
    "gelu_tanh": _emit_gelu_tanh,
}


# --- translation rules -------------------------------------------------------------------------------------------

def _out_shape(node: Any) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _out_dtype(node: Any) -> str | None:
    return _dtype_name(node.meta["val"].dtype)


def _axis(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _scalar(v: Any) -> float | None:
    """A Python number, or a one-element constant tensor, as a float."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, _Const) and v.value.numel() == 1 and not v.value.is_complex():
        return float(v.value.reshape(()).item())
    return None


@_rule("linear")
def _linear(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["input"])
    w = a["weight"]
    wt = tr.materialize(w, x.dtype, transpose=True) if isinstance(w, _Const) else tr.permute(tr.sym(w, x.dtype), (1, 0))
    lead = x.shape[:-1]
    x2 = tr.reshape(x, (1, x.shape[0])) if x.rank == 1 else x
    y = tr.matmul(x2, wt)
    y = tr.reshape(y, (*lead, wt.shape[1]))
    if a["bias"] is not None:
        y = tr.binary(y, tr.sym(a["bias"], y.dtype), "add")
    return y


@_rule("matmul", "mm", "bmm")
def _matmul(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    other = a.get("other", a.get("mat2"))
    x, y = tr.sym(a["self"]), tr.sym(other)
    dtype = _out_dtype(node)
    x, y = tr.cast(x, dtype), tr.cast(y, dtype)
    if x.rank == 1:
        x = tr.reshape(x, (1, x.shape[0]))
    if y.rank == 1:
        y = tr.reshape(y, (y.shape[0], 1))
    return tr.reshape(tr.matmul(x, y), _out_shape(node))


@_rule("addmm")
def _addmm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    y = tr.matmul(tr.sym(a["mat1"], dtype), tr.sym(a["mat2"], dtype))
    if a["alpha"] != 1:
        y = tr.unary(y, "scale", float(a["alpha"]))
    if a["beta"] == 0:
        return y
    bias = tr.sym(a["self"], dtype)
    if a["beta"] != 1:
        bias = tr.unary(bias, "scale", float(a["beta"]))
    return tr.binary(y, bias, "add")


@_rule("einsum")
def _einsum(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if "..." in a["equation"]:
        raise _fail(f"einsum with an ellipsis ({a['equation']!r}); write every index out")
    dtype = _out_dtype(node)
    return tr.g.einsum(a["equation"], *(tr.sym(t, dtype) for t in a["tensors"]), name=tr.name("einsum"))


# elementwise functions of one tensor: aten name -> (our unary op, its argument)
_UNARY = {"relu": ("relu", 0.0), "silu": ("silu", 0.0), "sigmoid": ("sigmoid", 0.0), "tanh": ("tanh", 0.0),
          "exp": ("exp", 0.0), "log": ("log", 0.0), "neg": ("neg", 0.0), "abs": ("abs", 0.0),
          "sqrt": ("sqrt", 0.0), "rsqrt": ("rsqrt", 0.0), "square": ("square", 0.0),
          "reciprocal": ("pow", -1.0)}


@_rule(*_UNARY)
def _unary(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    op, arg = _UNARY[_packet(node)]  # type: ignore[index]
    return tr.unary(tr.sym(a["self"], _out_dtype(node)), op, arg)


@_rule("gelu")
def _gelu(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    approx = a.get("approximate", "none")
    if approx not in ("none", "tanh"):
        raise _fail(f"gelu with approximate={approx!r}; supported: 'none' (erf) and 'tanh'")
    return tr.unary(tr.sym(a["self"]), "gelu" if approx == "none" else "gelu_tanh")


@_rule("pow")
def _pow(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if "exponent" not in a or not isinstance(a["self"], Tensor):
        raise _fail("pow with a tensor exponent; supported: tensor ** number")
    e = _scalar(a["exponent"])
    if e is None:
        raise _fail("pow with a tensor exponent; supported: tensor ** number")
    x = tr.sym(a["self"], _out_dtype(node))
    special = {1.0: None, 2.0: "square", 0.5: "sqrt", -0.5: "rsqrt"}
    if e in special:
        return x if special[e] is None else tr.unary(x, special[e])  # type: ignore[arg-type]
    return tr.unary(x, "pow", e)


@_rule("to", "_to_copy", "type_as", "clone", "contiguous", "alias", "detach", "lift_fresh_copy")
def _identity(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """Copies, layout hints and casts: the dtype torch records for the node is applied by the check."""
    return tr.sym(a["self"])


@_rule("dropout", "native_dropout")
def _dropout(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if a["train"] is not False and a["p"] > 0:
        raise _fail(f"dropout in training mode (p={a['p']}) draws random numbers; call module.eval() first")
    if _packet(node) == "native_dropout":
        raise _fail("native_dropout returns a random mask; call module.eval() first")
    return tr.sym(a["input"])


@_rule("_assert_tensor_metadata")
def _assert_metadata(tr: _Translator, node: Any, a: dict[str, Any]) -> None:
    return None


def _broadcast_binary(tr: _Translator, node: Any, x: Any, y: Any, op: str) -> Tensor:
    """x op y with torch broadcasting; a number (or one-element constant) becomes a unary op."""
    dtype = _out_dtype(node)
    shape = _out_shape(node)
    sx, sy = _scalar(x), _scalar(y)
    if isinstance(x, Tensor) and sy is not None and x.shape == shape:
        x = tr.sym(x, dtype)
        if op == "add":
            return tr.unary(x, "add_scalar", sy)
        if op == "sub":
            return tr.unary(x, "add_scalar", -sy)
        if op == "mul":
            return tr.unary(x, "scale", sy)
        if op == "div":
            return tr.unary(x, "scale", 1.0 / sy) if sy != 0 else tr.unary(x, "scale", math.copysign(math.inf, sy))
    if isinstance(y, Tensor) and sx is not None and y.shape == shape:
        y = tr.sym(y, dtype)
        if op == "add":
            return tr.unary(y, "add_scalar", sx)
        if op == "sub":
            return tr.unary(tr.unary(y, "neg"), "add_scalar", sx)
        if op == "mul":
            return tr.unary(y, "scale", sx)
        if op == "div":
            return tr.unary(tr.unary(y, "pow", -1.0), "scale", sx)
    return tr.binary(tr.sym(x, dtype), tr.sym(y, dtype), op)


def _alpha(tr: _Translator, node: Any, y: Any, alpha: Any) -> Any:
    if alpha in (1, None):
        return y
    s = _scalar(y)
    if s is not None:
        return s * float(alpha)
    return tr.unary(tr.sym(y, _out_dtype(node)), "scale", float(alpha))


@_rule("add", "sub")
def _add_sub(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    other = _alpha(tr, node, a["other"], a.get("alpha"))
    return _broadcast_binary(tr, node, a["self"], other, "add" if _packet(node) == "add" else "sub")


@_rule("rsub")
def _rsub(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _broadcast_binary(tr, node, a["other"], _alpha(tr, node, a["self"], a.get("alpha")), "sub")


@_rule("mul")
def _mul(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _broadcast_binary(tr, node, a["self"], a["other"], "mul")


@_rule("div")
def _div(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if a.get("rounding_mode") is not None:
        raise _fail(f"div with rounding_mode={a['rounding_mode']!r}; supported: true division")
    return _broadcast_binary(tr, node, a["self"], a["other"], "div")


@_rule("maximum", "minimum")
def _max_min(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    return tr.binary(tr.sym(a["self"], dtype), tr.sym(a["other"], dtype), _packet(node))  # type: ignore[arg-type]


@_rule("masked_fill")
def _masked_fill(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    mask, value = a["mask"], _scalar(a["value"])
    if not isinstance(mask, _Const) or value is None:
        raise _fail("masked_fill with a mask computed from the inputs or a tensor fill value; supported: a "
                    "constant mask (e.g. from torch.triu/tril of constants) and a number")
    x = tr.sym(a["self"], _out_dtype(node))
    torch = _torch()
    m = mask.value.to(torch.bool)
    if value == -math.inf:  # x + (0 or -inf): exact for finite x
        bias = torch.zeros(m.shape, dtype=_torch_dtype(x.dtype)).masked_fill(m, -math.inf)
        return tr.binary(x, tr.materialize(_Const(bias, None, f"{tr.prefix}.mask_bias")), "add")
    keep = (~m).to(_torch_dtype(x.dtype))
    fill = m.to(_torch_dtype(x.dtype)) * value
    y = tr.binary(x, tr.materialize(_Const(keep, None, f"{tr.prefix}.mask_keep")), "mul")
    return tr.binary(y, tr.materialize(_Const(fill, None, f"{tr.prefix}.mask_fill")), "add")


def _dims(dim: Any, rank: int) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return tuple(sorted({_axis(d, rank) for d in dims}))


@_rule("sum", "mean", "amax", "amin")
def _reduce(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    axes = _dims(a.get("dim"), x.rank)
    op = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min"}[_packet(node)]  # type: ignore[index]
    y = getattr(tr.g, op)(x, axes, bool(a.get("keepdim", False)), name=tr.name(op))
    return tr.reshape(y, _out_shape(node))


@_rule("var")
def _var(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    axes = _dims(a.get("dim"), x.rank)
    n = math.prod(x.shape[d] for d in axes)
    if "correction" in a:
        correction = 1.0 if a["correction"] is None else float(a["correction"])
    else:
        correction = 1.0 if a.get("unbiased", True) else 0.0
    if n - correction <= 0:
        raise _fail(f"variance over {n} elements with correction {correction}")
    mu = tr.g.mean(x, axes, True, name=tr.name("mean"))
    d = tr.binary(x, mu, "sub")
    v = tr.g.mean(tr.unary(d, "square"), axes, bool(a.get("keepdim", False)), name=tr.name("mean"))
    if correction:
        v = tr.unary(v, "scale", n / (n - correction))
    return tr.reshape(v, _out_shape(node))


@_rule("softmax", "_softmax")
def _softmax(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    return tr.g.softmax(x, _axis(a["dim"], x.rank), name=tr.name("softmax"))


@_rule("log_softmax")
def _log_softmax(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    axis = _axis(a["dim"], x.rank)
    z = tr.binary(x, tr.g.max(x, axis, True, name=tr.name("max")), "sub")
    total = tr.g.sum(tr.unary(z, "exp"), axis, True, name=tr.name("sum"))
    return tr.binary(z, tr.unary(total, "log"), "sub")


def _norm_operands(tr: _Translator, node: Any, a: dict[str, Any], names: Sequence[str]) -> tuple[Tensor, list[Tensor]]:
    """x flattened over the normalized dimensions, and its weight vectors (ones/zeros when absent)."""
    x = tr.sym(a["input"])
    k = len(a["normalized_shape"])
    if tuple(a["normalized_shape"]) != x.shape[x.rank - k:]:
        raise _fail(f"normalized_shape {tuple(a['normalized_shape'])} is not the trailing shape of {x.shape}")
    d = math.prod(x.shape[x.rank - k:])
    if k != 1:
        x = tr.reshape(x, (*x.shape[: x.rank - k], d))
    torch = _torch()
    ws = []
    for what in names:
        w = a[what]
        if w is None:
            fill = torch.ones if what == "weight" else torch.zeros
            ws.append(tr.materialize(_Const(fill(d, dtype=_torch_dtype(x.dtype)), None, f"{tr.prefix}.{what}")))
        elif isinstance(w, _Const):
            ws.append(tr.materialize(_Const(w.value.reshape(d), w.name, w.origin) if k != 1 else w, x.dtype))
        else:
            ws.append(tr.reshape(tr.sym(w, x.dtype), (d,)))
    return x, ws


@_rule("layer_norm")
def _layer_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x, (w, b) = _norm_operands(tr, node, a, ("weight", "bias"))
    y = tr.g.layernorm(x, w, b, float(a["eps"]), name=tr.name("layernorm"))
    return tr.reshape(y, _out_shape(node))


@_rule("rms_norm")
def _rms_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x, (w,) = _norm_operands(tr, node, a, ("weight",))
    eps = a["eps"]
    if eps is None:  # torch's default: the machine epsilon of the dtype it computes in (float32 for 16-bit)
        eps = float(_torch().finfo(_torch_dtype("float32" if x.dtype in ("float16", "bfloat16") else x.dtype)).eps)
    y = tr.g.rmsnorm(x, w, float(eps), name=tr.name("rmsnorm"))
    return tr.reshape(y, _out_shape(node))


def _mask_structure(mask: Any, sq: int, skv: int) -> tuple[bool, tuple[int, ...] | None] | None:
    """A constant attention mask as (causal, seq_ends), or None when it is neither causal, block-diagonal
    (packed sequences, causal or not) nor empty."""
    torch = _torch()
    m = mask
    if m.dtype == torch.bool:
        allowed = m
    elif m.is_floating_point():
        allowed = m == 0
        blocked = torch.isneginf(m) | (m <= torch.finfo(m.dtype).min / 2)
        if not bool((allowed | blocked).all()):
            return None
    else:
        return None
    if allowed.dim() < 2:
        allowed = allowed.reshape((1,) * (2 - allowed.dim()) + tuple(allowed.shape))
    try:
        allowed = allowed.broadcast_to((*allowed.shape[:-2], sq, skv)).reshape(-1, sq, skv)
    except RuntimeError:
        return None
    first = allowed[0]
    if not bool((allowed == first).all()):
        return None
    if bool(first.all()):
        return (False, None)
    if sq != skv or not bool(first.any(dim=1).all()):
        return None
    starts = first.int().argmax(dim=1)  # first visible key of each row
    ends = sorted({int(s) for s in starts.tolist()} - {0}) + [sq]
    seg = torch.zeros(sq, dtype=torch.int64)
    for e in ends[:-1]:
        seg[e:] += 1
    same = seg[:, None] == seg[None, :]
    causal = same & (torch.arange(sq)[None, :] <= torch.arange(sq)[:, None])
    for is_causal, want in ((True, causal), (False, same)):
        if bool((first == want).all()):
            return (is_causal, tuple(ends) if len(ends) > 1 else None)
    return None


@_rule("scaled_dot_product_attention")
def _sdpa_rule(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _sdpa(tr, node, a)


def _sdpa(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    q, k, v = (tr.sym(a[n], dtype) for n in ("query", "key", "value"))
    if a["dropout_p"]:
        raise _fail(f"attention dropout (dropout_p={a['dropout_p']}) draws random numbers; pass dropout_p=0.0 "
                    "(the default in eval mode)")
    if not (q.rank == k.rank == v.rank) or q.rank not in (3, 4):
        raise _fail(f"attention on q {q.shape}, k {k.shape}, v {v.shape}; supported: [batch, heads, seq, d] "
                    "or [batch, seq, d] for all three")
    causal, ends = bool(a["is_causal"]), None
    mask = a["attn_mask"]
    sq, skv = q.shape[-2], k.shape[-2]
    if isinstance(mask, Tensor):
        raise _fail("an attention mask computed from the inputs; supported: no mask, is_causal=True, or a "
                    "constant causal or block-diagonal (packed sequences) mask")
    if isinstance(mask, _Const):
        structure = _mask_structure(mask.value, sq, skv)
        if structure is None:
            raise _fail(f"a constant attention mask of shape {tuple(mask.value.shape)} that is neither causal, "
                        "block-diagonal (packed sequences) nor empty; supported: those three")
        causal, ends = causal or structure[0], structure[1]
    if q.rank == 3:  # one head: [b, s, d] -> [b, s, 1, d]
        q, k, v = (tr.reshape(t, (t.shape[0], t.shape[1], 1, t.shape[2])) for t in (q, k, v))
    else:
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv and not a["enable_gqa"]:
            raise _fail(f"{hq} query heads and {hkv} key/value heads without enable_gqa=True")
        q, k, v = (tr.permute(t, (0, 2, 1, 3)) for t in (q, k, v))
    out = tr.g.attention(q, k, v, causal=causal, seq_ends=ends, scale=a["scale"], name=tr.name("attention"))
    if len(_out_shape(node)) == 3:
        return tr.reshape(out, _out_shape(node))
    return tr.permute(out, (0, 2, 1, 3))


@_rule("view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze")
def _reshape(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if _packet(node) == "view" and "dtype" in a:
        raise _fail("view as another dtype (a bit cast)")
    return tr.reshape(tr.sym(a["self"]), _out_shape(node))


@_rule("transpose", "permute", "t", "numpy_T")
def _permute(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    packet = _packet(node)
    if packet == "permute":
        perm = list(a["dims"])
    elif packet == "transpose":
        perm = list(range(x.rank))
        i, j = _axis(a["dim0"], x.rank), _axis(a["dim1"], x.rank)
        perm[i], perm[j] = perm[j], perm[i]
    else:
        perm = list(reversed(range(x.rank)))
    return tr.permute(x, perm)


@_rule("expand", "expand_as")
def _expand(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    shape = _out_shape(node)
    x = tr.reshape(x, (1,) * (len(shape) - x.rank) + x.shape)
    for d, (have, want) in enumerate(zip(x.shape, shape)):
        if have != want:
            x = tr.repeat(x, d, want)
    return x


@_rule("repeat")
def _tile(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    reps = list(a["repeats"])
    x = tr.reshape(x, (1,) * (len(reps) - x.rank) + x.shape)
    for d, r in enumerate(reps):
        x = tr.repeat(x, d, int(r))
    return x


@_rule("repeat_interleave")
def _repeat_interleave(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    reps = a.get("repeats")
    if not isinstance(reps, int):
        raise _fail("repeat_interleave with per-element repeats; supported: one integer count")
    x = tr.sym(a["self"])
    if a.get("dim") is None:
        x = tr.reshape(x, (math.prod(x.shape),))
        d = 0
    else:
        d = _axis(a["dim"], x.rank)
    y = tr.reshape(x, (*x.shape[: d + 1], 1, *x.shape[d + 1:]))
    y = tr.repeat(y, d + 1, reps)
    return tr.reshape(y, _out_shape(node))


def _bounds(start: Any, stop: Any, size: int) -> tuple[int, int]:
    start = 0 if start is None else int(start)
    stop = size if stop is None else int(stop)
    start = max(0, min(size, start + size if start < 0 else start))
    stop = max(0, min(size, stop + size if stop < 0 else stop))
    return start, stop


@_rule("slice")
def _slice(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    axis = _axis(a["dim"], x.rank)
    if a["step"] != 1:
        raise _fail(f"a slice with step {a['step']}; supported: step 1")
    start, stop = _bounds(a["start"], a["end"], x.shape[axis])
    if stop <= start:
        raise _fail(f"an empty slice [{start}:{stop}] of axis {axis} of shape {x.shape}")
    return tr.slice(x, axis, start, stop)


@_rule("select")
def _select(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    axis = _axis(a["dim"], x.rank)
    i = int(a["index"]) % x.shape[axis]
    return tr.reshape(tr.slice(x, axis, i, i + 1), _out_shape(node))


@_rule("narrow")
def _narrow(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    axis = _axis(a["dim"], x.rank)
    start = int(a["start"]) % x.shape[axis] if int(a["start"]) < 0 else int(a["start"])
    return tr.slice(x, axis, start, start + int(a["length"]))


@_rule("split", "split_with_sizes", "chunk", "unbind")
def _split(tr: _Translator, node: Any, a: dict[str, Any]) -> list[Tensor]:
    x = tr.sym(a["self"])
    axis = _axis(a.get("dim", 0), x.rank)
    parts, start = [], 0
    for val in node.meta["val"]:
        size = 1 if _packet(node) == "unbind" else int(val.shape[axis])
        if size == 0:
            raise _fail(f"a split into an empty part along axis {axis} of shape {x.shape}")
        part = tr.slice(x, axis, start, start + size)
        parts.append(tr.reshape(part, tuple(val.shape)))
        start += size
    return parts


@_rule("getitem")
def _getitem(tr: _Translator, node: Any, a: dict[str, Any]) -> Any:
    return tr._arg(node.args[0])[node.args[1]]


@_rule("cat", "concat")
def _cat(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    rank = len(_out_shape(node))
    xs = [tr.sym(t, dtype) for t in a["tensors"] if not (isinstance(t, _Const) and t.value.numel() == 0)]
    return tr.concat(xs, _axis(a["dim"], rank))


@_rule("stack")
def _stack(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    shape = _out_shape(node)
    axis = _axis(a["dim"], len(shape))
    xs = [tr.sym(t, dtype) for t in a["tensors"]]
    xs = [tr.reshape(x, (*x.shape[:axis], 1, *x.shape[axis:])) for x in xs]
    return tr.concat(xs, axis)


@_rule("embedding")
def _embedding(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    table = tr.sym(a["weight"], _out_dtype(node))
    ids = a["indices"]
    ids = tr.materialize(ids, "int64") if isinstance(ids, _Const) else tr.sym(ids)
    return tr.g.embedding(table, ids, name=tr.name("embedding"))


SUPPORTED_OPS: tuple[str, ...] = tuple(sorted(n for n in _RULES if n not in ("getitem", "_assert_tensor_metadata")))


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
    out.input_names = tuple(k if k in kept else None for k in g.input_names)
    out.input_types = g.input_types
    out.output_names = g.output_names
    out.output_leaves = g.output_leaves
    out.out_spec = g.out_spec
    out.source = {k: v for k, v in g.source.items() if k in kept}
    return out


# --- entry point ---------------------------------------------------------------------------------------------------

def from_torch(module: Any, example_inputs: Any) -> TorchGraph:
    """Trace ``module`` on ``example_inputs`` (a tensor or a tuple of tensors) into an ``rt.Graph``.

    The result is a :class:`TorchGraph`: parameters, buffers and trace-time constants
    are graph inputs of role ``parameter`` whose values are in ``.parameters``;
    user inputs are graph inputs named after the forward arguments; outputs are
    saved as ``output`` (or ``output_0``, ``output_1``, ... for several).  Shapes
    are static: the graph is for inputs of the example's shapes and dtypes.
    """
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise GraphError(f"from_torch takes a torch.nn.Module; got {type(module).__name__}.")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    for k, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"from_torch takes tensor example inputs; input {k} is {type(x).__name__}. Bind "
                             "other arguments in the module (a small wrapper module, or functools.partial).")
    with warnings.catch_warnings():  # torch.export's own deprecation chatter, not the user's
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            ep = torch.export.export(module, args, strict=False)
            ep = ep.run_decompositions({})  # functionalize (in-place ops become pure) without decomposing
        except Exception as e:  # noqa: BLE001 - any tracing failure is reported the same way
            raise GraphError(f"torch.export could not trace {type(module).__name__}: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. from_torch needs a forward "
                             "without data-dependent control flow; see the torch.export documentation.") from e
    tr = _Translator(ep)
    g = tr.run()
    if not g.outputs:
        raise GraphError(f"{type(module).__name__} returns nothing that depends on its inputs; there is no graph "
                         "to build.")
    g.parameters = tr.values
    g.folded = tuple(tr.folded)
    g.out_spec = ep.call_spec.out_spec
    return _prune(g)

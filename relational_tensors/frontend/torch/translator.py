"""The translator: ``from_torch`` exports a module with ``torch.export`` and walks the ATen graph,
folding what depends on no user input, applying recognized patterns and otherwise the rule
registered for each operation; ``TorchGraph`` is the ``Graph`` it returns, with the values of its
parameters.  ``SUPPORTED_OPS`` lists the operations with a rule.
"""

from __future__ import annotations

import itertools
import math
import operator
import string
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

import relational_tensors.frontend.torch.rules_conv as rules_conv
import relational_tensors.frontend.torch.rules_elementwise as rules_elementwise
import relational_tensors.frontend.torch.rules_linalg as rules_linalg
import relational_tensors.frontend.torch.rules_nn as rules_nn
import relational_tensors.frontend.torch.rules_random as rules_random
import relational_tensors.frontend.torch.rules_reduce as rules_reduce
import relational_tensors.frontend.torch.rules_shape as rules_shape
from relational_tensors.errors import GraphError
from relational_tensors.frontend.torch.common import (
    _EXACT_WIDENINGS,
    _SHAPE_ONLY,
    _clean,
    _Const,
    _fail,
    _module_path,
    _op_name,
    _packet,
    _source,
    _Unsupported,
)
from relational_tensors.frontend.torch.convert import (
    _dtype_name,
    _is_torch_tensor,
    _torch,
    _torch_dtype,
    host,
    torch_to_numpy,
)
from relational_tensors.frontend.torch.moe import experts_modules, traceable_experts
from relational_tensors.frontend.torch.patterns import (
    _PATTERNS,
    _match_eager_attention,
    _match_gelu_tanh,
    _match_repeated_kv,
    _match_rmsnorm,
    _match_rope,
    _match_swiglu,
)
from relational_tensors.frontend.torch.registry import _RULES, REFUSED
from relational_tensors.frontend.torch.torch_graph import TorchGraph, _prune
from relational_tensors.graph.graph import Tensor

__all__ = ["from_torch", "SUPPORTED_OPS"]

# the modules that register the translation rules when imported (SUPPORTED_OPS below lists them)
_RULE_MODULES = (rules_conv, rules_elementwise, rules_linalg, rules_nn, rules_random, rules_reduce, rules_shape)


# --- the translator -----------------------------------------------------------------------------------------

class _Translator:
    def __init__(self, ep: Any, casts_in_graph: bool = False, names: dict[str, str] | None = None,
                 live: frozenset[str] = frozenset(), stacked: frozenset[str] = frozenset(),
                 module_values: bool = True) -> None:
        self.ep = ep
        # whether a module tensor's graph input gets its value in ``values`` (a host copy); without, only its
        # origin is recorded, and whoever loads the graph reads the tensor itself
        self.module_values = module_values
        self.fx = ep.graph
        self.g = TorchGraph()
        # a module tensor needed in another dtype becomes a cast in the graph, not a converted copy (a
        # training step updates the tensor itself)
        self.casts_in_graph = casts_in_graph
        # export target -> the module's own name for that tensor (tied parameters: the first name)
        self.names = dict(names or {})
        # parameters that are differentiated: symbolic, so no value computed from them is folded
        self.live = live
        # the stacked weights of mixture-of-experts layers: their first dimension is named ``experts``
        self.stacked = stacked
        self.env: dict[Any, Any] = {}
        self.values: dict[str, np.ndarray] = {}
        self.folded: list[str] = []
        self.derived: dict[str, tuple[str, ...]] = {}
        self.origins: dict[str, tuple[str, bool]] = {}
        # module tensor -> its one graph input and whether that holds it transposed (training: one copy)
        self._leaves: dict[str, tuple[Tensor, bool]] = {}
        self._leaf_of: dict[int, tuple[_Const, bool]] = {}  # graph node id -> the constant a leaf holds
        self._rng: Tensor | None = None
        self._streams = 0
        self.used: set[str] = set()
        self.prefix = ""
        self.current: Any = None
        self._materialized: dict[tuple[int | str, str, str], Tensor] = {}
        self._keep: list[_Const] = []
        self.rewrites: dict[Any, tuple[str, dict[str, Any]]] = {}
        self.symbolic: set[Any] = set()
        # (table node, dtype) -> the table as rope_table reads it
        self.rope_tables: dict[tuple[int, str | None], Tensor] = {}

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
        value = c.tensor  # (its shape and dtype: no host copy)
        want = dtype or _dtype_name(value.dtype)
        if want is None:
            raise _fail(f"a constant of dtype {value.dtype} ({c.name or c.origin}, shape {tuple(value.shape)}) "
                        "would enter the graph; only float16/bfloat16/float32/float64/int32/int64/bool tensors can")
        key = (c.name if c.name is not None else id(c), want, "T" if transpose else "")
        if key in self._materialized:
            return self._materialized[key]
        have = _dtype_name(value.dtype)
        if c.name is not None and have is not None and (self.casts_in_graph or c.live):
            # one graph input per module tensor, in its own dtype and the layout first asked for; other
            # layouts and dtypes are computed from it in the graph, so its gradient is their sum
            if c.name not in self._leaves:
                self._leaves[c.name] = (self._leaf(c, have, transpose), transpose)
            t, held = self._leaves[c.name]
            if held != transpose:
                t = self.g.permute(t, (1, 0), name=self.unique(f"{c.name}.T"))
            if want != have:
                t = self.g.cast(t, want, name=self.unique(f"{c.name}.{want}"))
            self._materialized[key] = t
            return t
        t = self._leaf(c, want, transpose)
        self._materialized[key] = t
        return t

    def _leaf(self, c: _Const, want: str, transpose: bool) -> Tensor:
        """A new graph input holding ``c`` in dtype ``want`` (transposed: a Linear weight as ``[in, out]``)."""
        self._keep.append(c)
        v = c.tensor.detach()  # (on the module's device: torch_to_numpy below copies it to the host if wanted)
        if transpose:
            v = v.t()
        if _dtype_name(v.dtype) != want and (c.name is None or self.module_values):
            v = v.to(_torch_dtype(want))
        base = c.name if c.name is not None else c.origin
        if base in self.used:  # the same constant in another layout or dtype
            base = f"{base}.T" if transpose else f"{base}.{want}"
        name = self.unique(base)
        dims = ("experts", *(f"d{i}" for i in range(1, v.dim()))) if c.name in self.stacked and not transpose \
            and v.dim() >= 2 else None
        t = self.g.parameter(name, tuple(v.shape), want, dims)
        if c.name is None or self.module_values:
            self.values[name] = torch_to_numpy(v)
        if c.name is None:
            self.folded.append(name)
            if c.deps:
                self.derived[name] = tuple(sorted(c.deps))
        else:
            self.origins[name] = (c.name, transpose)
        self._leaf_of[t.node.id] = (c, transpose)
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

    # --- random numbers ------------------------------------------------------------------------
    def rng(self) -> Tensor:
        """The graph input holding the random state every random operation draws from (made at first use)."""
        if self._rng is None:
            self._rng = self.g.input(self.unique("rng"), (2,), "int64")
            self.g.rng_input = self._rng.name
        return self._rng

    def stream(self) -> int:
        """A new stream number: each random operation of the module draws from its own."""
        self._streams += 1
        return self._streams

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
        held = self._leaf_of.get(x.node.id)
        if held is not None and perm == (1, 0):  # a transposed constant (``x @ w.T``): held in that layout
            return self.materialize(held[0], x.dtype, transpose=not held[1])
        op = x.node.op
        if op is not None and op.kind == "permute":
            inner: tuple[int, ...] = getattr(op, "perm")  # noqa: B009 - Operator has no perm; the kind check narrows
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
                self.env[node] = _Const(host(value), None, node.name) if _is_torch_tensor(value) else value
            elif node.op == "output":
                self._output(node)
        self.current = None
        self.g.input_names = tuple(user_inputs)
        self.g.input_types = tuple(input_types)
        return self.g

    def _find_symbolic(self) -> None:
        """Nodes whose value depends on a user input; every other node is folded with torch."""
        from torch.export.graph_signature import InputKind

        users = {s.arg.name for s in self.ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT or
                 (s.kind == InputKind.PARAMETER and self.names.get(s.target, s.target) in self.live)}
        for node in self.fx.nodes:
            if node.op == "placeholder":
                if node.name in users:
                    self.symbolic.add(node)
            elif node.op == "call_function" and _draws(node):
                self.symbolic.add(node)  # a random draw is made in the graph on every call, never folded
            elif node.op == "call_function" and _packet(node) in _SHAPE_ONLY:
                continue  # reads only the shape and dtype of its tensor argument, which are static
            elif any(i in self.symbolic for i in node.all_input_nodes):
                self.symbolic.add(node)

    def unruled(self) -> list[Any]:
        """The nodes computed from the inputs whose operation has no translation rule."""
        self._find_symbolic()
        return [node for node in self.fx.nodes
                if node.op == "call_function" and node in self.symbolic and _packet(node) not in _RULES]

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
            if name == "aten.matmul.default":
                m = _match_eager_attention(node, self.symbolic)
                if m is not None:
                    self.rewrites[node] = ("eager_attention", m)
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
                                 "float32, float64, int32, int64 or bool.")
            self.env[node] = self.g.input(self.unique(node.name), tuple(val.shape), dtype)
            user_inputs.append(self.env[node].name)
            input_types.append((tuple(val.shape), dtype))
            return
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            value = self.ep.state_dict.get(spec.target)
            if value is None:
                value = self.ep.constants[spec.target]
            name = self.names.get(spec.target, spec.target)
            live = spec.kind == InputKind.PARAMETER and name in self.live
            # a GPU module's tensor: read on the host only where a rule needs its values (``_Const.value``)
            self.env[node] = _Const(None, name, spec.target, live=live, deps=frozenset({name}), tensor=value)
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
            val = node.meta.get("val")
            static = _is_torch_tensor(val) and all(isinstance(n, int) for n in val.shape)
            if static and 0 in tuple(val.shape):  # an empty tensor (a rotary slice of nothing): a constant,
                torch = _torch()  # which concatenation drops and every consumer sees as empty
                self.env[node] = _Const(torch.zeros(tuple(val.shape), dtype=val.dtype), None, self.prefix)
                return
            result = None
            if node in self.rewrites:
                kind, match = self.rewrites[node]
                result = _PATTERNS[kind](self, node, match)  # None: the pattern declines; translate as written
            if result is None:
                rule = _RULES.get(packet) if packet is not None else None
                if rule is None:
                    raise _fail(REFUSED.get(packet or "", "no translation rule for this operation"))
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

        deps: set[str] = set()

        def unwrap(v: Any) -> Any:
            if hasattr(v, "op") and hasattr(v, "meta"):  # an fx.Node
                if shape_only and v in self.symbolic:  # only its static shape and dtype are read
                    return torch.zeros(v.meta["val"].shape, dtype=v.meta["val"].dtype)
                v = self._arg(v)
            if isinstance(v, _Const):
                deps.update(v.deps)
                return v.value
            if isinstance(v, (list, tuple)):
                return type(v)(unwrap(x) for x in v)
            return v

        args = unwrap(node.args)
        kwargs = {k: unwrap(v) for k, v in node.kwargs.items()}
        if node.target is operator.getitem:
            value = args[0][args[1]]
        else:
            try:
                with torch.no_grad():
                    value = node.target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reported with the node's source line
                raise _fail(f"it depends on no input, and computing it once at trace time failed: "
                            f"{type(e).__name__}: {e}") from e
        return self._wrap(value, self.prefix, frozenset(deps))

    def _wrap(self, value: Any, origin: str, deps: frozenset[str]) -> Any:
        if _is_torch_tensor(value):  # a fold on a GPU module (device= arguments) is brought to the host
            return _Const(host(value), None, origin, deps=deps)
        if isinstance(value, (list, tuple)):
            return type(value)(self._wrap(v, f"{origin}.{k}", deps) for k, v in enumerate(value))
        return value

    def _check(self, node: Any, result: Any) -> Any:
        """Hold a translated value against the shape and dtype torch recorded for the node."""
        val = node.meta.get("val")
        if isinstance(result, Tensor):
            if not _is_torch_tensor(val):
                return result
            result = self._one_element(result, tuple(val.shape))
            if tuple(result.shape) != tuple(val.shape):
                raise GraphError(f"the rule for {_op_name(node)} produced shape {result.shape}, but torch records "
                                 f"{tuple(val.shape)}; this is a bug in from_torch, please report it.")
            want = _dtype_name(val.dtype)
            if want is None:
                raise _fail(f"it produces a {val.dtype} tensor; tensors in a graph are float16, bfloat16, float32, "
                            "float64, int32, int64 or bool")
            return self.cast(result, want)
        if isinstance(result, (list, tuple)) and isinstance(val, (list, tuple)):
            return type(result)(self._check_item(node, r, v) for r, v in zip(result, val))
        return result

    def _buffer_update(self, target: str, value: Any) -> None:
        """A buffer the forward updates (batch norm's running statistics, its batch counter): a value computed in
        the graph is saved as ``buffer.<name>``; one that depends on no input (a counter's increment) is the
        same change every call, kept as that increment."""
        name = self.names.get(target, target)
        if isinstance(value, Tensor):
            out = f"buffer.{name}"
            self.g.save(value, name=out)
            self.g.buffer_updates[name] = out
            return
        old = self.ep.state_dict.get(target, self.ep.constants.get(target))
        new = value.value if isinstance(value, _Const) else value
        torch = _torch()
        if old is None or not isinstance(new, torch.Tensor) or new.dtype.is_floating_point:
            raise GraphError(f"the forward updates buffer {name!r} by a value computed from no input that is not an "
                             "integer counter; from_torch keeps buffer updates computed in the graph (batch norm's "
                             "running statistics) and counters' increments. Move the update out of forward.")
        self.g.buffer_increments[name] = (host(new) - host(old)).clone()

    def _one_element(self, result: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A one-element result in torch's one-element shape: a Python number is a one-element tensor [1]
        here, so with a 0-d tensor a rule makes [1] where torch makes ()."""
        if tuple(result.shape) != shape and math.prod(result.shape) == 1 == math.prod(shape):
            return self.reshape(result, shape)
        return result

    def _check_item(self, node: Any, r: Any, v: Any) -> Any:
        if isinstance(r, Tensor) and _is_torch_tensor(v):
            r = self._one_element(r, tuple(v.shape))
        if isinstance(r, Tensor) and tuple(r.shape) != tuple(v.shape):
            raise GraphError(f"the rule for {_op_name(node)} produced shape {r.shape}, but torch records "
                             f"{tuple(v.shape)}; this is a bug in from_torch, please report it.")
        return r

    def _output(self, node: Any) -> None:
        from torch.export.graph_signature import OutputKind

        specs = self.ep.graph_signature.output_specs
        bad = [s for s in specs if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)]
        if bad:
            what = ", ".join(f"{s.kind.name.lower()} of {s.target!r}" for s in bad)
            raise GraphError(f"from_torch translates pure functions; this module's forward has side effects "
                             f"({what}). Move state updates (running statistics, counters, caches) out of forward, "
                             "or call module.eval().")
        values = []
        for spec, v in zip(specs, node.args[0]):
            if spec.kind == OutputKind.USER_OUTPUT:
                values.append(v)
            else:
                self._buffer_update(spec.target, self._arg(v))
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


# the ATen operations a user's module may call (this package's own custom ops, ``rt_*``, are left out)
SUPPORTED_OPS: tuple[str, ...] = tuple(sorted(n for n in _RULES if n not in ("getitem", "_assert_tensor_metadata")
                                              and not n.startswith("rt_")))


def _draws(node: Any) -> bool:
    """Whether a node draws random numbers (dropout in training, rand, bernoulli, ...)."""
    torch = _torch()
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if _packet(node) in ("dropout", "native_dropout"):  # (input, p, train): eval mode or p = 0 draws nothing
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else None)
        return train is not False and p != 0
    return True


# --- entry point ---------------------------------------------------------------------------------------------------

def _decompose(ep: Any, unruled: Any) -> Any:
    """``ep`` with the operations that have no translation rule lowered by torch's decompositions (the core
    ATen set first, then the rest of its table), where that leads to operations that have one; an operation
    whose decomposition does not (``lgamma`` into ``prims.lgamma``) is left as written, so that a refusal
    names what the module calls."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    core = core_aten_decompositions()
    banned: set[str] = set()  # by name: the operation a node's meta records is a copy, equal to none
    for _ in range(4):
        out, used = ep, set[str]()
        for _ in range(4):  # a decomposition may produce operations that need decomposing again
            table = {n.target: core.get(n.target) or decomposition_table.get(n.target) for n in unruled(out)}
            table = {k: f for k, f in table.items() if f is not None and str(k) not in banned}
            if not table:
                break
            used.update(str(k) for k in table)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                out = out.run_decompositions(table)
        failed = {str(n.meta.get("original_aten")) for n in unruled(out)} & used
        if not failed:
            return out
        banned |= failed
    return ep


def _module_names(module: Any, ep: Any) -> dict[str, str]:
    """Export target -> the module's own name for that tensor: the first name ``named_parameters()`` (or
    ``named_buffers()``) gives it, so a tied parameter, which torch.export may list under another of its
    names, is known by one name."""
    first: dict[int, str] = {}
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        first.setdefault(id(t), name)
    out: dict[str, str] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.target is None:
            continue
        try:
            t = module.get_parameter(spec.target)
        except AttributeError:
            try:
                t = module.get_buffer(spec.target)
            except AttributeError:
                continue
        out[spec.target] = first.get(id(t), spec.target)
    return out


def from_torch(module: Any, example_inputs: Any, casts_in_graph: bool = False,
               differentiate: bool = False, module_values: bool = True) -> TorchGraph:
    """Trace ``module`` on ``example_inputs`` (a tensor or a tuple of tensors) into an ``rt.Graph``.

    The result is a :class:`TorchGraph`: parameters, buffers and trace-time constants
    are graph inputs of role ``parameter`` whose values are in ``.parameters``;
    user inputs are graph inputs named after the forward arguments; outputs are
    saved as ``output`` (or ``output_0``, ``output_1``, ... for several).  Shapes
    are static: the graph is for inputs of the example's shapes and dtypes.  With ``casts_in_graph`` a
    module tensor read in another dtype is a graph input in its own dtype and a cast (for training).
    With ``differentiate`` every parameter that requires grad is one graph input (under the name
    ``named_parameters()`` gives it), and everything computed from it is computed in the graph, never
    folded at trace time, so its gradient can be taken (``.differentiated`` lists them).  With
    ``module_values=False`` the module's own parameters and buffers are left out of ``.parameters`` (no host
    copy of the model is made; ``.origins`` says which module tensor each graph input holds, for the caller
    to load from the tensor itself); constants folded at trace time keep their values.
    """
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise GraphError(f"from_torch takes a torch.nn.Module; got {type(module).__name__}.")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    for k, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"from_torch takes tensor example inputs; input {k} is {type(x).__name__}. Bind "
                             "other arguments in the module (a small wrapper module, or functools.partial).")
    # tracing reads shapes and dtypes only: example inputs go to the module's device (a module on the host
    # traced with a CUDA batch, as rt.train_step is given one, or the reverse)
    home = next((t.device for t in itertools.chain(module.parameters(), module.buffers())), None) \
        if isinstance(module, torch.nn.Module) else None
    if home is not None:
        args = tuple(x.to(home) if x.device != home else x for x in args)
    config: Any = getattr(module, "config", None)
    cached = bool(getattr(config, "use_cache", False))
    if cached:  # an HF model's key/value cache is no tensor output: traced without it, and said so
        warnings.warn(f"{type(module).__name__} has use_cache=True: its key/value cache is left out of the graph "
                      "(traced with use_cache=False, the outputs are the rest). Set model.config.use_cache = False "
                      "to silence this.", stacklevel=2)
        config.use_cache = False
    try:
        with warnings.catch_warnings():  # torch.export's own deprecation chatter, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                with traceable_experts(module):
                    ep = torch.export.export(module, args, strict=False)
                ep = ep.run_decompositions({})  # functionalize (in-place ops become pure) without decomposing
            except Exception as e:  # noqa: BLE001 - any tracing failure is reported the same way
                raise GraphError(f"torch.export could not trace {type(module).__name__}: {type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. from_torch needs a "
                                 "forward without data-dependent control flow; see the torch.export documentation."
                                 ) from e
    finally:
        if cached:
            config.use_cache = True
    names = _module_names(module, ep)
    live = frozenset(names.get(k, k) for k, t in module.named_parameters() if t.requires_grad) \
        if differentiate else frozenset()
    stacked = frozenset(f"{path}.{k}" if path else k for path, sub in experts_modules(module)
                        for k, t in sub.named_parameters(recurse=False) if t.dim() >= 2)
    ep = _decompose(ep, lambda e: _Translator(e, casts_in_graph, names, live, stacked, module_values).unruled())
    tr = _Translator(ep, casts_in_graph, names, live, stacked, module_values)
    g = tr.run()
    if not g.outputs:
        raise GraphError(f"{type(module).__name__} returns nothing that depends on its inputs; there is no graph "
                         "to build.")
    g.parameters = tr.values
    g.folded = tuple(tr.folded)
    g.derived = dict(tr.derived)
    g.origins = dict(tr.origins)
    g.differentiated = tuple(sorted(live))
    g.out_spec = ep.call_spec.out_spec
    return _prune(g)

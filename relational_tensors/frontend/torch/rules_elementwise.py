"""Translation rules for elementwise operations: unary functions (``relu``, ``silu``, ``exp``, ...,
``gelu``, ``pow`` by a number), copies and casts (``to``, ``clone``, ``contiguous``, ...), binary
arithmetic with torch broadcasting (``add``, ``sub``, ``rsub``, ``mul``, ``div``, ``maximum``,
``minimum``; a number operand becomes a unary op), ``masked_fill``, and the boolean operations masks
are built with: comparisons, ``&``/``|``/``^``/``~`` of booleans, ``where``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.frontend.torch.common import _Const, _fail, _out_dtype, _out_shape, _packet, _scalar
from relational_tensors.frontend.torch.convert import _dtype_name, _torch, _torch_dtype
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


# elementwise functions of one tensor: aten name -> (our unary op, its argument)
_UNARY = {"relu": ("relu", 0.0), "silu": ("silu", 0.0), "sigmoid": ("sigmoid", 0.0), "tanh": ("tanh", 0.0),
          "exp": ("exp", 0.0), "log": ("log", 0.0), "neg": ("neg", 0.0), "abs": ("abs", 0.0),
          "sqrt": ("sqrt", 0.0), "rsqrt": ("rsqrt", 0.0), "square": ("square", 0.0),
          "reciprocal": ("pow", -1.0), "log1p": ("log1p", 0.0), "expm1": ("expm1", 0.0), "erf": ("erf", 0.0),
          "sin": ("sin", 0.0), "cos": ("cos", 0.0)}


@register_torch_op(*_UNARY)
def _unary(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    op, arg = _UNARY[_packet(node)]  # type: ignore[index]
    return tr.unary(tr.sym(a["self"], _out_dtype(node)), op, arg)


@register_torch_op("gelu")
def _gelu(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    approx = a.get("approximate", "none")
    if approx not in ("none", "tanh"):
        raise _fail(f"gelu with approximate={approx!r}; supported: 'none' (erf) and 'tanh'")
    return tr.unary(tr.sym(a["self"]), "gelu" if approx == "none" else "gelu_tanh")


@register_torch_op("pow")
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


@register_torch_op("detach")
def _detach(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """The value, with no gradient flowing back through it (a parameter read detached is not trained there)."""
    x = tr.sym(a["self"])
    return tr.unary(x, "detach") if x.dtype in ("float16", "bfloat16", "float32", "float64") else x


@register_torch_op("to", "_to_copy", "type_as", "clone", "contiguous", "alias", "lift_fresh_copy")
def _identity(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """Copies, layout hints and casts: the dtype torch records for the node is applied by the check."""
    return tr.sym(a["self"])


@register_torch_op("_assert_tensor_metadata")
def _assert_metadata(tr: _Translator, node: Any, a: dict[str, Any]) -> None:
    return None


def _broadcast_binary(tr: _Translator, node: Any, x: Any, y: Any, op: str) -> Tensor:
    """x op y with torch broadcasting; a number (or one-element constant) becomes a unary op (on floating
    tensors: integer arithmetic is a binary op with the number as a one-element tensor)."""
    dtype = _out_dtype(node)
    shape = _out_shape(node)
    sx, sy = (_scalar(x), _scalar(y)) if dtype in FLOAT_DTYPES else (None, None)
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


@register_torch_op("add", "sub")
def _add_sub(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    other = _alpha(tr, node, a["other"], a.get("alpha"))
    return _broadcast_binary(tr, node, a["self"], other, "add" if _packet(node) == "add" else "sub")


@register_torch_op("rsub")
def _rsub(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _broadcast_binary(tr, node, a["other"], _alpha(tr, node, a["self"], a.get("alpha")), "sub")


@register_torch_op("mul")
def _mul(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _broadcast_binary(tr, node, a["self"], a["other"], "mul")


@register_torch_op("div")
def _div(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if a.get("rounding_mode") is not None:
        raise _fail(f"div with rounding_mode={a['rounding_mode']!r}; supported: true division")
    return _broadcast_binary(tr, node, a["self"], a["other"], "div")


@register_torch_op("maximum", "minimum")
def _max_min(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    return tr.binary(tr.sym(a["self"], dtype), tr.sym(a["other"], dtype), _packet(node))  # type: ignore[arg-type]


@register_torch_op("masked_fill")
def _masked_fill(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    mask, value = a["mask"], _scalar(a["value"])
    if value is None and not (isinstance(a["value"], Tensor) and a["value"].shape in ((), (1,))):
        raise _fail("masked_fill with a fill value that is not one number; supported: a number or a "
                    "one-element tensor")
    x = tr.sym(a["self"], _out_dtype(node))
    if not isinstance(mask, _Const):  # a mask computed from the inputs: where(mask, value, x)
        fill = tr.sym(value, x.dtype) if value is not None else tr.sym(a["value"], x.dtype)
        return tr.g.where(tr.sym(mask, "bool"), fill, x, name=tr.name("masked_fill"))
    torch = _torch()
    m = mask.value.to(torch.bool)
    if value == -math.inf:  # x + (0 or -inf): exact for finite x
        bias = torch.zeros(m.shape, dtype=_torch_dtype(x.dtype)).masked_fill(m, -math.inf)
        return tr.binary(x, tr.materialize(_Const(bias, None, f"{tr.prefix}.mask_bias")), "add")
    keep = (~m).to(_torch_dtype(x.dtype))
    fill = m.to(_torch_dtype(x.dtype)) * value
    y = tr.binary(x, tr.materialize(_Const(keep, None, f"{tr.prefix}.mask_keep")), "mul")
    return tr.binary(y, tr.materialize(_Const(fill, None, f"{tr.prefix}.mask_fill")), "add")



# --- booleans: comparisons, logic, where (the masks models build from their inputs) -----------------------

_COMPARE = {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater",
            "ge": "greater_equal"}
_LOGIC = {"__and__": "logical_and", "bitwise_and": "logical_and", "logical_and": "logical_and",
          "__or__": "logical_or", "bitwise_or": "logical_or", "logical_or": "logical_or",
          "__xor__": "logical_xor", "bitwise_xor": "logical_xor", "logical_xor": "logical_xor"}


def _meta(v: Any) -> Any:
    """What torch's type promotion reads of an operand: its recorded value, or the number."""
    return v.meta["val"] if hasattr(v, "meta") else v


def _promoted(node: Any, *names: str) -> str:
    """The dtype torch compares (or selects) the named operands in."""
    torch = _torch()
    args = dict(zip((arg.name for arg in node.target._schema.arguments), node.args)) | dict(node.kwargs)
    vals = [_meta(args[n]) for n in names]
    name = _dtype_name(torch.result_type(*vals))
    if name is None:
        raise _fail(f"operands of dtype {torch.result_type(*vals)}; supported: float, int and bool tensors")
    return name


@register_torch_op(*_COMPARE)
def _compare(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _promoted(node, "self", "other")
    return tr.binary(tr.sym(a["self"], dtype), tr.sym(a["other"], dtype), _COMPARE[_packet(node)])  # type: ignore[index]


@register_torch_op(*_LOGIC)
def _logic(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if _out_dtype(node) != "bool":
        raise _fail(f"bitwise logic on {_out_dtype(node)} tensors; supported: boolean masks")
    return tr.binary(tr.sym(a["self"], "bool"), tr.sym(a["other"], "bool"), _LOGIC[_packet(node)])  # type: ignore[index]


@register_torch_op("logical_not", "bitwise_not")
def _logical_not(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if _out_dtype(node) != "bool":
        raise _fail(f"bitwise not of a {_out_dtype(node)} tensor; supported: boolean masks")
    return tr.unary(tr.sym(a["self"], "bool"), "logical_not")


@register_torch_op("where")
def _where(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if a.get("self") is None or a.get("other") is None:
        raise _fail("where(condition) with one argument gives data-dependent indices; supported: "
                    "where(condition, x, y)")
    dtype = _out_dtype(node)
    return tr.g.where(tr.sym(a["condition"], "bool"), tr.sym(a["self"], dtype), tr.sym(a["other"], dtype),
                      name=tr.name("where"))


@register_torch_op("clamp", "clamp_min", "clamp_max")
def _clamp(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``clamp(x, min, max)`` (bounds numbers or tensors): the bound where x passes it, else x, so the
    gradient reaches x where ``min <= x <= max`` and each bound where it was taken, as torch's; NaN stays."""
    dtype = _out_dtype(node)
    if dtype not in FLOAT_DTYPES:
        raise _fail(f"clamp of a {dtype} tensor; supported: floating tensors")
    x = tr.sym(a["self"], dtype)
    packet = _packet(node)
    lo = None if packet == "clamp_max" else a.get("min")
    hi = None if packet == "clamp_min" else a.get("max")
    for bound, past in ((lo, "less"), (hi, "greater")):
        if bound is not None:
            b = tr.sym(bound, dtype)
            x = tr.g.where(tr.binary(x, b, past), b, x, name=tr.name("clamp"))
    return x

"""Translation rules for matrix products: ``linear`` (a constant weight enters the graph transposed,
``[in, out]``), ``matmul``/``mm``/``bmm``, ``addmm`` and ``einsum``; and the sparse experts' custom ops
(``relational_tensors::route_index`` and ``grouped_mm``, see ``frontend/torch/moe.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relational_tensors.frontend.torch.common import _Const, _fail, _out_dtype, _out_shape
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.graph.graph import Tensor
from relational_tensors.sql_specs.experts import GroupedMatmulOp, RouteIndexOp

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


@register_torch_op("linear")
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


@register_torch_op("matmul", "mm", "bmm")
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


@register_torch_op("addmm")
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


@register_torch_op("einsum")
def _einsum(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if "..." in a["equation"]:
        raise _fail(f"einsum with an ellipsis ({a['equation']!r}); write every index out")
    dtype = _out_dtype(node)
    return tr.g.einsum(a["equation"], *(tr.sym(t, dtype) for t in a["tensors"]), name=tr.name("einsum"))


@register_torch_op("rt_route_index")
def _route_index(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``relational_tensors::route_index`` (the experts' sorted layout, ``frontend/torch/moe.py``)."""
    ids = tr.cast(tr.sym(a["ids"]), "int64")
    op = RouteIndexOp((ids.type,), int(a["experts"]), str(a["what"]))
    return tr.g.apply(op, ids, name=tr.name(f"route_{a['what']}"))


@register_torch_op("rt_grouped_mm")
def _grouped_mm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``relational_tensors::grouped_mm``: each sorted row times its expert's weights."""
    xs = tr.sym(a["xs"])
    w, group = tr.sym(a["w"], xs.dtype), tr.sym(a["group"])
    op = GroupedMatmulOp((xs.type, w.type, group.type), bool(a["trans_w"]))
    return tr.g.apply(op, xs, w, group, name=tr.name("grouped_mm"))

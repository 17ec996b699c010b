"""Translation rules for reductions over axes: ``sum``, ``mean``, ``amax``, ``amin``, ``var`` (with
its correction), ``softmax``, ``log_softmax``, ``cumsum`` (a product with a triangle of ones) and
``topk``, ``argmax`` and ``argmin`` (selections: positions by ``topk``, values read back by ``take_along``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.frontend.torch.common import _axis, _axis_last, _Const, _fail, _out_dtype, _out_shape, _packet
from relational_tensors.frontend.torch.convert import _torch, _torch_dtype
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


def _dims(dim: Any, rank: int) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return tuple(sorted({_axis(d, rank) for d in dims}))


@register_torch_op("sum", "mean", "amax", "amin")
def _reduce(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    if x.rank == 0:  # a 0-d tensor (a loss that is already a scalar; torch takes dim 0 or -1 of it too):
        return tr.reshape(x, _out_shape(node))  # each of these reductions is the tensor
    axes = _dims(a.get("dim"), x.rank)
    op = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min"}[_packet(node)]  # type: ignore[index]
    if x.dtype not in FLOAT_DTYPES:  # counts of a mask, sums of integers: in float64, exact below 2**53
        y = getattr(tr.g, op)(tr.cast(x, "float64"), axes, bool(a.get("keepdim", False)), name=tr.name(op))
        return tr.reshape(tr.cast(y, x.dtype), _out_shape(node))
    y = getattr(tr.g, op)(x, axes, bool(a.get("keepdim", False)), name=tr.name(op))
    return tr.reshape(y, _out_shape(node))


@register_torch_op("var")
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


@register_torch_op("softmax", "_softmax")
def _softmax(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    return tr.g.softmax(x, _axis(a["dim"], x.rank), name=tr.name("softmax"))


@register_torch_op("log_softmax")
def _log_softmax(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"], _out_dtype(node))
    axis = _axis(a["dim"], x.rank)
    z = tr.binary(x, tr.g.max(x, axis, True, name=tr.name("max")), "sub")
    total = tr.g.sum(tr.unary(z, "exp"), axis, True, name=tr.name("sum"))
    return tr.binary(z, tr.unary(total, "log"), "sub")


@register_torch_op("cumsum")
def _cumsum(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """Running sums along an axis: a contraction with the triangle ``T[j, i] = 1 for j <= i``.  Integers are
    summed in float64, exact while the sums stay below 2**53 (position ids from a mask, counts)."""
    out = _out_dtype(node) or "float32"
    work = out if out in FLOAT_DTYPES else "float64"
    x = tr.sym(a["self"], work)
    axis = _axis(a["dim"], x.rank)
    n = x.shape[axis]
    torch = _torch()
    tri = _Const(torch.ones(n, n, dtype=_torch_dtype(work)).triu(), None, f"{tr.prefix}.triangle")
    letters = "abcdefghijklmnopqrstuvwxy"[: x.rank]
    if len(letters) < x.rank:
        raise _fail(f"cumsum of a tensor of rank {x.rank}; supported: rank up to 25")
    spec = f"{letters},{letters[axis]}z->{letters.replace(letters[axis], 'z')}"
    return tr.g.einsum(spec, x, tr.materialize(tri, work), name=tr.name("cumsum"))


@register_torch_op("topk")
def _topk(tr: _Translator, node: Any, a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """``torch.topk``: the values and positions of the k largest (or smallest) along ``dim``, best first
    (``sorted=False`` gets them sorted too: torch leaves that order unspecified).  Equal values come lower
    position first, which torch does not promise either."""
    x = tr.sym(a["self"])
    if x.dtype not in FLOAT_DTYPES:
        raise _fail(f"topk of a {x.dtype} tensor; supported: floating tensors (cast first)")
    k = a["k"]
    if not isinstance(k, int):
        raise _fail(f"topk with k={k!r} computed at run time; supported: a k known when tracing")
    order, back = _axis_last(_axis(a["dim"], x.rank), x.rank)
    values, ids = tr.g.topk(tr.permute(x, order), k, bool(a["largest"]), name=tr.name("topk"))
    return tr.permute(values, back), tr.permute(ids, back)


def _first_best(tr: _Translator, x: Tensor, axis: int, largest: bool, what: str) -> tuple[Tensor, Tensor]:
    """The first position of the largest (smallest) value along ``axis``, and that value, as torch's
    ``max``/``min``/``argmax``/``argmin`` give them: NaN wins either way (the smallest is the first best of
    -x, where NaN still ranks first)."""
    moved = tr.permute(x, _axis_last(axis, x.rank)[0])
    ranked = moved if largest else tr.unary(moved, "neg")
    _, ids = tr.g.topk(ranked, 1, True, name=tr.name(what))
    return tr.g.take_along(moved, ids, name=tr.name(f"{what}_value")), ids


@register_torch_op("argmax", "argmin")
def _argmax(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``argmax``/``argmin``: the position of the first largest (smallest) value along ``dim`` (over the
    flattened tensor without one), a top-1 selection; a NaN is the answer wherever there is one, as in torch."""
    x = tr.sym(a["self"])
    if x.dtype not in FLOAT_DTYPES:
        raise _fail(f"{_packet(node)} of a {x.dtype} tensor; supported: floating tensors (cast first)")
    if a["dim"] is None:
        x, axis = tr.reshape(x, (max(1, math.prod(x.shape)),)), 0
    else:
        axis = _axis(a["dim"], x.rank)
    _, ids = _first_best(tr, x, axis, _packet(node) == "argmax", _packet(node) or "argmax")
    return tr.reshape(ids, _out_shape(node))


@register_torch_op("max", "min")
def _max_min(tr: _Translator, node: Any, a: dict[str, Any]) -> Any:
    """``torch.max(x, dim)`` / ``torch.min(x, dim)``: the values and the first position holding them (a top-1
    selection, NaN winning as in torch); ``torch.max(x)``: the reduction (``amax``'s rule: the gradient split
    among ties, as torch splits it); ``torch.max(a, b)``: the elementwise ``maximum``."""
    packet = _packet(node) or "max"
    if "other" in a:
        dtype = _out_dtype(node)
        return tr.binary(tr.sym(a["self"], dtype), tr.sym(a["other"], dtype), "maximum" if packet == "max"
                         else "minimum")
    x = tr.sym(a["self"])
    if x.dtype not in FLOAT_DTYPES:
        raise _fail(f"{packet} of a {x.dtype} tensor; supported: floating tensors (cast first)")
    largest = packet == "max"
    if "dim" not in a:
        whole = (tr.g.max if largest else tr.g.min)(x, list(range(x.rank)), name=tr.name(packet)) if x.rank else x
        return tr.reshape(whole, _out_shape(node))
    axis = _axis(a["dim"], x.rank)
    values, ids = _first_best(tr, x, axis, largest, packet)
    shape = tuple(s for d, s in enumerate(x.shape) if d != axis)
    if a.get("keepdim"):
        shape = tuple(1 if d == axis else s for d, s in enumerate(x.shape))
    return tr.reshape(values, shape), tr.reshape(ids, shape)


@register_torch_op("histc")
def _histc(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``torch.histc(x, bins, min, max)``: the count of elements in each of ``bins`` equal bins of
    [min, max] (max itself in the last; elements outside, and NaN, in none), a sum of one-hot rows.  The
    range must be given (min < max): the data's own range would be a value the graph does not know."""
    dtype = _out_dtype(node) or "float32"
    bins, lo, hi = int(a["bins"]), float(a["min"]), float(a["max"])
    if not lo < hi:
        raise _fail(f"histc over [{lo}, {hi}]; supported: an explicit range with min < max")
    x = tr.sym(a["self"])
    x = tr.cast(x, "float64" if x.dtype in ("int32", "int64", "float64") else "float32")
    # torch's (x - min) · bins / (max - min), in that order: values on a bin's edge fall where torch's do
    scaled = tr.unary(tr.unary(x, "add_scalar", -lo), "scale", float(bins))
    at = tr.unary(tr.binary(scaled, tr.sym(hi - lo, x.dtype), "div"), "floor")
    top = tr.sym(float(hi), x.dtype)
    at = tr.g.where(tr.binary(x, top, "equal"), tr.sym(float(bins - 1), x.dtype), at, name=tr.name("histc_top"))
    inside = tr.binary(tr.binary(x, tr.sym(float(lo), x.dtype), "greater_equal"), tr.binary(x, top, "less_equal"),
                       "logical_and")
    at = tr.g.where(inside, at, tr.sym(-1.0, x.dtype), name=tr.name("histc_bin"))
    hot = tr.g.one_hot(tr.cast(at, "int64"), bins, dtype if dtype in FLOAT_DTYPES else "float32",
                       name=tr.name("histc"))
    counts = tr.g.sum(hot, list(range(hot.rank - 1)), name=tr.name("histc_counts")) if hot.rank > 1 else hot
    return tr.cast(counts, dtype)

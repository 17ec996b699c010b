"""Translation rules for layout and shape operations: ``view``/``reshape`` and their kin,
``transpose``/``permute``, ``expand``, ``repeat``, ``repeat_interleave``, ``slice``, ``select``,
``narrow``, ``split``/``chunk``/``unbind`` (with ``getitem`` on their results), ``cat``, ``stack``
and ``index`` by constant aranges (a broadcast).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.frontend.torch.common import (
    _axis,
    _axis_first,
    _axis_last,
    _bounds,
    _Const,
    _fail,
    _out_dtype,
    _out_shape,
    _packet,
)
from relational_tensors.frontend.torch.convert import _torch, _torch_dtype
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


@register_torch_op("view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze")
def _reshape(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if _packet(node) == "view" and "dtype" in a:
        raise _fail("view as another dtype (a bit cast)")
    return tr.reshape(tr.sym(a["self"]), _out_shape(node))


@register_torch_op("transpose", "permute", "t", "numpy_T")
def _permute(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    rank = len(_out_shape(node))
    packet = _packet(node)
    if packet == "permute":
        perm = [_axis(d, rank) for d in a["dims"]]
    elif packet == "transpose":
        perm = list(range(rank))
        i, j = _axis(a["dim0"], rank), _axis(a["dim1"], rank)
        perm[i], perm[j] = perm[j], perm[i]
    else:
        perm = list(reversed(range(rank)))
    if isinstance(a["self"], _Const) and perm == [1, 0]:  # a transposed weight (``x @ w.T``): held transposed
        return tr.materialize(a["self"], transpose=True)
    return tr.permute(tr.sym(a["self"]), perm)


def _broadcast_to(tr: _Translator, x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``x`` broadcast to ``shape`` (leading unit dimensions added, size-1 dimensions repeated)."""
    x = tr.reshape(x, (1,) * (len(shape) - x.rank) + x.shape)
    for d, (have, want) in enumerate(zip(x.shape, shape)):
        if have != want:
            x = tr.repeat(x, d, want)
    return x


@register_torch_op("expand", "expand_as")
def _expand(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _broadcast_to(tr, tr.sym(a["self"]), _out_shape(node))


@register_torch_op("copy")
def _copy(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``dst.copy_(src)`` made pure: src in dst's dtype, broadcast to dst's shape (dst's values are gone)."""
    return _broadcast_to(tr, tr.sym(a["src"], _out_dtype(node)), _out_shape(node))


@register_torch_op("repeat")
def _tile(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    reps = list(a["repeats"])
    x = tr.reshape(x, (1,) * (len(reps) - x.rank) + x.shape)
    for d, r in enumerate(reps):
        x = tr.repeat(x, d, int(r))
    return x


@register_torch_op("repeat_interleave")
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


@register_torch_op("slice")
def _slice(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    axis = _axis(a["dim"], x.rank)
    start, stop = _bounds(a["start"], a["end"], x.shape[axis])
    step = int(a["step"])
    if step == 1:
        return tr.slice(x, axis, start, stop)  # an empty slice never gets here: it is an empty constant
    return _strided(tr, x, axis, start, stop, step)


def _strided(tr: _Translator, x: Tensor, axis: int, start: int, stop: int, step: int) -> Tensor:
    """``x[..., start:stop:step, ...]``: the whole steps as a reshape [count, step] and the first of each step
    (rotate-every-two rotary reads the even and odd features so); a last partial step is sliced on its own."""
    count = -(-(stop - start) // step)
    whole = min(count, (x.shape[axis] - start) // step)
    parts = []
    if whole:
        y = tr.slice(x, axis, start, start + whole * step)
        y = tr.reshape(y, (*x.shape[:axis], whole, step, *x.shape[axis + 1:]))
        y = tr.slice(y, axis + 1, 0, 1)
        parts.append(tr.reshape(y, (*x.shape[:axis], whole, *x.shape[axis + 1:])))
    if count > whole:
        first = start + whole * step
        parts.append(tr.slice(x, axis, first, first + 1))
    return tr.concat(parts, axis)


@register_torch_op("gather")
def _gather(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along ``dim``.  Along the last axis with one
    row of ids per row of x, a ``take_along``; otherwise a lookup of the flat positions
    ``index · stride(dim) + (the offsets of the other axes)`` in x viewed as a one-column table (an embedding,
    whose gradient adds back into x).  Integer x is looked up in float64 (exact below 2**53)."""
    torch = _torch()
    out_dtype = _out_dtype(node) or "float32"
    work = out_dtype if out_dtype in FLOAT_DTYPES else "float64"
    x, index = a["self"], a["index"]
    shape = tuple(index.value.shape) if isinstance(index, _Const) else index.shape
    xs = tuple(x.value.shape) if isinstance(x, _Const) else x.shape
    axis = _axis(a["dim"], len(xs))
    if axis == len(xs) - 1 and out_dtype in FLOAT_DTYPES and len(shape) == len(xs) and shape[:-1] == xs[:-1]:
        # along the last axis, one row of ids per row of x (top-k's values): a take_along, split by rows
        return tr.g.take_along(tr.sym(x, out_dtype), tr.cast(tr.sym(index), "int64"), name=tr.name("gather"))
    strides = [math.prod(xs[k + 1:]) for k in range(len(xs))]
    base = torch.zeros(shape, dtype=torch.int64)
    for k, n in enumerate(shape):
        if k != axis:
            base = base + (torch.arange(n) * strides[k]).reshape([-1 if j == k else 1 for j in range(len(shape))])
    if isinstance(index, _Const):
        ids = tr.materialize(_Const(index.value.to(torch.int64) * strides[axis] + base, None,
                                    f"{tr.prefix}.flat_index", deps=index.deps), "int64")
    else:
        ids = tr.cast(index, "int64")
        if strides[axis] != 1:
            ids = tr.binary(ids, tr.sym(strides[axis], "int64"), "mul")
        ids = tr.binary(ids, tr.materialize(_Const(base, None, f"{tr.prefix}.offsets"), "int64"), "add")
    table = tr.reshape(tr.sym(x, work), (math.prod(xs), 1))
    return tr.reshape(tr.g.embedding(table, ids, name=tr.name("gather")), shape)


@register_torch_op("select")
def _select(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    axis = _axis(a["dim"], x.rank)
    i = int(a["index"]) % x.shape[axis]
    return tr.reshape(tr.slice(x, axis, i, i + 1), _out_shape(node))


@register_torch_op("narrow")
def _narrow(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    axis = _axis(a["dim"], x.rank)
    start = int(a["start"]) % x.shape[axis] if int(a["start"]) < 0 else int(a["start"])
    return tr.slice(x, axis, start, start + int(a["length"]))


@register_torch_op("split", "split_with_sizes", "chunk", "unbind")
def _split(tr: _Translator, node: Any, a: dict[str, Any]) -> list[Any]:
    x = tr.sym(a["self"])
    axis = _axis(a.get("dim", 0), x.rank)
    parts: list[Any] = []
    start = 0
    for val in node.meta["val"]:
        size = 1 if _packet(node) == "unbind" else int(val.shape[axis])
        if size == 0:  # an empty part: a constant, as every empty tensor
            parts.append(_Const(_torch().zeros(tuple(val.shape), dtype=val.dtype), None, tr.prefix))
            continue
        part = tr.slice(x, axis, start, start + size)
        parts.append(tr.reshape(part, tuple(val.shape)))
        start += size
    return parts


@register_torch_op("getitem")
def _getitem(tr: _Translator, node: Any, a: dict[str, Any]) -> Any:
    return tr._arg(node.args[0])[node.args[1]]


@register_torch_op("cat", "concat")
def _cat(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    rank = len(_out_shape(node))
    xs = [tr.sym(t, dtype) for t in a["tensors"] if not (isinstance(t, _Const) and t.value.numel() == 0)]
    return tr.concat(xs, _axis(a["dim"], rank))


@register_torch_op("stack")
def _stack(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    shape = _out_shape(node)
    axis = _axis(a["dim"], len(shape))
    xs = [tr.sym(t, dtype) for t in a["tensors"]]
    xs = [tr.reshape(x, (*x.shape[:axis], 1, *x.shape[axis:])) for x in xs]
    return tr.concat(xs, axis)



@register_torch_op("index")
def _index(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``x[i0, i1, ...]`` where each index is a constant ``arange`` over its whole dimension, laid along
    its own axis of the broadcast index shape, in order: the values of x, with unit axes inserted (how
    HF broadcasts ``attention_mask[batch, key]`` to [batch, 1, 1, key]).  Other gathers are refused."""
    x = tr.sym(a["self"])
    indices = list(a["indices"])
    out = _out_shape(node)
    if len(indices) == 1 and indices[0] is not None and not isinstance(indices[0], _Const):
        return _take_rows(tr, x, tr.sym(indices[0]))
    if len(indices) > x.rank or any(not isinstance(i, _Const) for i in indices):
        raise _fail("indexing with indices computed from the inputs other than x[ids] (rows of the first "
                    "dimension); supported: x[ids], and constant aranges that broadcast dimensions")
    rank = len(out) - (x.rank - len(indices))
    placed: list[int] = []
    for d, idx in enumerate(indices):
        v = idx.value
        lead = rank - v.dim()
        along = [k for k, n in enumerate(v.shape) if n != 1]
        size = x.shape[d]
        if v.dtype.is_floating_point or len(along) > 1 or (size > 1 and not along):
            raise _fail(f"indexing dimension {d} with a constant index of shape {tuple(v.shape)} that is not an "
                        "arange along one axis; supported: x[arange(n)[:, None, ...], ...] that broadcasts")
        axis = lead + along[0] if along else (placed[-1] + 1 if placed else 0)
        flat = v.reshape(-1)
        if flat.numel() != size or bool((flat != _torch().arange(size, dtype=flat.dtype)).any()):
            raise _fail(f"indexing dimension {d} with constant indices other than arange({size}); supported: "
                        "aranges over whole dimensions")
        if placed and axis <= placed[-1]:
            raise _fail("indexing with aranges that reorder dimensions; supported: aranges in dimension order")
        placed.append(axis)
    shape = [1] * rank
    for d, axis in enumerate(placed):
        shape[axis] = x.shape[d]
    if tuple(shape) != tuple(out[:rank]):
        raise _fail(f"indexing that gives shape {out} from broadcast aranges; supported: aranges that only "
                    "insert unit axes")
    return tr.reshape(x, (*shape, *x.shape[len(indices):]))


def _rows_index(what: str, x: Tensor, ids: Tensor) -> Tensor:
    if ids.dtype not in ("int32", "int64"):
        raise _fail(f"{what} with {ids.dtype} indices; supported: integer row ids (a boolean mask selects a "
                    "data-dependent number of rows)")
    if x.rank < 1:
        raise _fail(f"{what} into a 0-d tensor; supported: rows of a tensor of rank 1 or more")
    return ids


def _take_rows(tr: _Translator, x: Tensor, ids: Tensor) -> Tensor:
    """``x[ids]`` with ids computed from the inputs: the rows of x's first dimension at ids, ``[*ids, *rest]``,
    an embedding lookup of x viewed as a ``[rows, rest]`` table (non-floating x looked up in float64, exact
    below 2**53).  An id outside the rows is refused by the host executor; torch raises on it too."""
    ids = _rows_index("indexing x[ids]", x, ids)
    work = x.dtype if x.dtype in FLOAT_DTYPES else "float64"
    rest = x.shape[1:]
    table = tr.reshape(tr.cast(x, work), (x.shape[0], math.prod(rest)))
    rows = tr.g.embedding(table, tr.cast(ids, "int64"), name=tr.name("index"))
    return tr.cast(tr.reshape(rows, (*ids.shape, *rest)), x.dtype)


@register_torch_op("index_select")
def _index_select(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``x.index_select(dim, ids)``: the entries at ids along dim (``_take_rows`` with dim moved first)."""
    x = tr.sym(a["self"])
    order, back = _axis_first(_axis(a["dim"], max(x.rank, 1)), x.rank)
    ids = tr.sym(a["index"])
    rows = _take_rows(tr, tr.permute(x, order), tr.reshape(ids, (math.prod(ids.shape),)))
    return tr.permute(rows, back)


def _write_rows(tr: _Translator, x: Tensor, ids: Any, values: Any, accumulate: bool, what: str) -> Tensor:
    """x with the rows of its first dimension at ids replaced by values (``accumulate``: added to); see
    ``_index_put``."""
    if x.dtype not in FLOAT_DTYPES:
        raise _fail(f"{what} into a {x.dtype} tensor; supported: floating tensors")
    ids = tr.cast(_rows_index(what, x, tr.sym(ids)), "int64")
    rest, n = x.shape[1:], x.shape[0]
    width, count = math.prod(rest), math.prod(ids.shape)
    values = _broadcast_to(tr, tr.sym(values, x.dtype), (*ids.shape, *rest))
    flat = tr.reshape(ids, (count,))
    if not accumulate:  # the rows replaced (in place where x is a state's kept block: a cache)
        return tr.g.put_rows(x, flat, tr.reshape(values, (count, *rest)), name=tr.name("index_put"))
    written = tr.g.embedding_grad(flat, tr.reshape(values, (count, width)), n, name=tr.name("index_put_rows"))
    return tr.reshape(tr.binary(tr.reshape(x, (n, width)), written, "add"), x.shape)


@register_torch_op("index_copy", "index_add")
def _index_copy(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``x.index_copy(dim, ids, source)`` and ``x.index_add(dim, ids, source, alpha)``: the entries at ids along
    dim replaced by source's, or source times alpha added to them (``_write_rows`` with dim moved first)."""
    x = tr.sym(a["self"])
    order, back = _axis_first(_axis(a["dim"], max(x.rank, 1)), x.rank)
    src = tr.permute(tr.sym(a["source"], x.dtype), order)
    what = "index_add" if _packet(node) == "index_add" else "index_copy"
    if what == "index_add" and a.get("alpha", 1) != 1:
        src = tr.binary(src, tr.sym(float(a["alpha"]), x.dtype), "mul")
    out = _write_rows(tr, tr.permute(x, order), a["index"], src, what == "index_add", what)
    return tr.permute(out, back)


@register_torch_op("index_put")
def _index_put(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``x.index_put((ids,), values, accumulate)`` (``x[ids] = values``, ``x.index_put_``): the rows of x's first
    dimension at ids replaced by values (``put_rows``; ``accumulate=True``: added to, scattered with the
    embedding's gradient), values broadcast to ``[*ids, *rest]``.  A row written twice without
    ``accumulate`` gets its last values (torch leaves which one it keeps unspecified)."""
    x = tr.sym(a["self"])
    indices = list(a["indices"])
    if len(indices) != 1 or indices[0] is None:
        raise _fail(f"index_put with {len(indices)} index tensors; supported: one, on the first dimension "
                    "(x[ids] = values)")
    return _write_rows(tr, x, indices[0], a["values"], bool(a.get("accumulate", False)), "index_put")


@register_torch_op("scatter", "scatter_add")
def _scatter(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``x.scatter(dim, index, value or src)`` and ``scatter_add`` with one row of positions per row of x
    (index of x's shape but along ``dim``, as routing masks write: ``scores.scatter(-1, top, -inf)``): a
    selection over one-hot positions.  ``scatter`` with a position written twice keeps the sum of the values
    written there (torch leaves which one unspecified); ``scatter_add`` adds them, as torch's; ``reduce=``
    is refused."""
    dtype = _out_dtype(node)
    if dtype not in FLOAT_DTYPES:
        raise _fail(f"scatter into a {dtype} tensor; supported: floating tensors")
    if a.get("reduce") is not None:
        raise _fail(f"scatter with reduce={a['reduce']!r}; supported: scatter without reduce, and scatter_add")
    x = tr.sym(a["self"], dtype)
    index = a["index"]
    ids = tr.materialize(index, "int64") if isinstance(index, _Const) else tr.cast(tr.sym(index), "int64")
    axis = _axis(a["dim"], x.rank)
    lead = tuple(s for d, s in enumerate(x.shape) if d != axis)
    if ids.rank != x.rank or tuple(s for d, s in enumerate(ids.shape) if d != axis) != lead:
        raise _fail(f"scatter with an index of shape {ids.shape} into {x.shape} along dim {axis}; supported: an "
                    "index with x's shape except along dim")
    order, back = _axis_last(axis, x.rank)
    xm, im = tr.permute(x, order), tr.permute(ids, order)
    n = x.shape[axis]
    hot = tr.g.one_hot(im, n, "bool", name=tr.name("scatter_hot"))  # [..., k, n]
    hit = tr.binary(tr.g.sum(tr.cast(hot, dtype), [x.rank - 1], name=tr.name("scatter_hits")),
                    tr.sym(0.0, dtype), "greater")
    src = a.get("src")
    if src is None:  # scatter.value: a number
        out = tr.g.where(hit, tr.sym(a.get("value"), dtype), xm, name=tr.name("scatter"))
        return tr.permute(out, back)
    sm = tr.permute(tr.sym(src, dtype), order)
    if sm.shape != im.shape:
        raise _fail(f"scatter with src of shape {sm.shape} for an index of shape {im.shape}; supported: equal "
                    "shapes")
    # each src value picked where its position is set, summed over k (a product with the one-hot would
    # turn an infinite value into NaN across its row)
    column = tr.reshape(sm, (*sm.shape, 1))
    picked = tr.g.where(hot, column, tr.unary(column, "fill", 0.0), name=tr.name("scatter_pick"))
    placed = tr.g.sum(picked, [x.rank - 1], name=tr.name("scatter_src"))
    if _packet(node) == "scatter_add":
        return tr.permute(tr.binary(xm, placed, "add"), back)
    return tr.permute(tr.g.where(hit, placed, xm, name=tr.name("scatter")), back)


@register_torch_op("pad", "constant_pad_nd")
def _pad(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``F.pad(x, pad, value=v)`` in constant mode: blocks of ``v`` concatenated before and after each padded
    dimension (the last first, as ``pad`` lists them); a negative amount crops.  Other modes are refused."""
    mode = a.get("mode", "constant")
    if mode != "constant":
        raise _fail(f"pad in mode {mode!r}; supported: mode='constant'")
    torch = _torch()
    dtype = _out_dtype(node)
    if dtype is None:
        raise _fail(f"pad of a {node.meta['val'].dtype} tensor; supported: float, int and bool tensors")
    x = tr.sym(a["self"], dtype)
    amounts = [int(v) for v in a["pad"]]
    value = a.get("value")
    value = 0 if value is None else value
    for k in range(len(amounts) // 2):
        axis = x.rank - 1 - k
        before, after = amounts[2 * k], amounts[2 * k + 1]
        if before < 0:
            x = tr.slice(x, axis, -before, x.shape[axis])
        if after < 0:
            x = tr.slice(x, axis, 0, x.shape[axis] + after)
        parts = []
        for n in (max(before, 0), max(after, 0)):
            shape = [*x.shape[:axis], n, *x.shape[axis + 1:]]
            parts.append(tr.materialize(_Const(torch.full(shape, value, dtype=_torch_dtype(dtype)), None,
                                               f"{tr.prefix}.pad"), dtype) if n else None)
        pieces = [p for p in (parts[0], x, parts[1]) if p is not None]
        x = tr.concat(pieces, axis)
    return x


@register_torch_op("slice_scatter")
def _slice_scatter(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``x[..., start:end] = src`` made pure (an in-place write into a slice of a new tensor, as DeepSeek's
    attention builds its keys): the slices of x before and after, and src between, concatenated; a step
    other than 1 is refused."""
    dtype = _out_dtype(node)
    x = tr.sym(a["self"], dtype)
    src = tr.sym(a["src"], dtype)
    axis = _axis(a["dim"], x.rank)
    n = x.shape[axis]
    start = 0 if a.get("start") is None else int(a["start"])
    end = n if a.get("end") is None else int(a["end"])
    start, end = (min(max(v + n if v < 0 else v, 0), n) for v in (start, end))
    if int(a.get("step") or 1) != 1:
        raise _fail(f"slice_scatter with step {a['step']}; supported: step 1")
    if src.shape[axis] != max(0, end - start):
        raise _fail(f"slice_scatter of {src.shape[axis]} rows into [{start}, {end}); supported: the slice's size")
    parts = [*([tr.slice(x, axis, 0, start)] if start > 0 else []), src,
             *([tr.slice(x, axis, end, n)] if end < n else [])]
    return tr.concat(parts, axis)

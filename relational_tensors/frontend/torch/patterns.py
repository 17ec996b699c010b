"""Pattern matching on the fx graph: multi-op idioms recognized before translation, each replaced
by one operator (or declined, so translated op by op, when a check fails).

The matchers are keyed by the ATen operation of the node that ends the idiom (the translator's
``_find_patterns`` picks them by that operation): ``aten.mul``/``aten.div`` -> hand-written RMSNorm
(``rmsnorm``); ``aten.mul`` -> ``silu(a) * b`` (``swiglu``) or GPT-2's written-out tanh GELU
(``gelu_tanh``); ``aten.add`` -> rotary embedding ``x * cos + rotate_half(x) * sin`` (``rope_table`` when
the tables are computed at run time; ``rope``, when
the tables are the standard ones); ``aten.scaled_dot_product_attention`` with k/v heads repeated
before it (``gqa``: grouped-query attention); ``aten.matmul`` -> attention written out as transformers'
eager attention writes it, ``softmax(q·kᵀ · scale [soft-capped] [+ mask]) · v`` (``eager_attention``: one
attention operator, its scores never materialized).  ``_PATTERNS`` maps each kind to the function that
emits its operator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from relational_tensors.frontend.torch.common import _bounds, _Const, _op_name, _out_dtype, _out_shape
from relational_tensors.frontend.torch.convert import _dtype_name, _is_torch_tensor, torch_to_numpy
from relational_tensors.frontend.torch.rules_nn import _sdpa
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


# --- pattern matching on the fx graph -------------------------------------------------------------------------

def _is(node: Any, *names: str) -> bool:
    return getattr(node, "op", None) == "call_function" and _op_name(node) in names


def _shape(node: Any) -> tuple[int, ...] | None:
    val: Any = getattr(node, "meta", {}).get("val")
    return tuple(val.shape) if _is_torch_tensor(val) else None


_CASTS = ("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.clone.default",
          "aten.contiguous.default", "aten.alias.default")


def _dtype(node: Any) -> Any:
    val: Any = getattr(node, "meta", {}).get("val")
    return val.dtype if _is_torch_tensor(val) else None


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
                x = _strip(m[0])  # x.float() normalized, then cast back: the operator in x's own dtype
                return {"x": x if _dtype(x) == _dtype(node) else m[0], "w": w, "eps": m[1]}
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
        if _is(e, "aten.clone.default"):  # expand, then a contiguous copy
            e = e.args[0]
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


_SOFTMAX = ("aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default")


def _scaled(node: Any) -> tuple[Any, float] | None:
    """(tensor, factor) for ``tensor * number`` (either order) or ``tensor / number``; None otherwise."""
    if _is(node, "aten.div.Tensor"):
        by = _number_operand(node, "aten.div.Tensor")
        return (by[0], 1.0 / by[1]) if by is not None and by[0] is node.args[0] and by[1] != 0 else None
    return _number_operand(node, "aten.mul.Tensor")


def _scores(node: Any) -> dict[str, Any] | None:
    """``q @ kᵀ`` times numbers (or divided by them), then optionally soft-capped (``c · tanh(s / c)``):
    q [b, h, sq, d], k [b, h, skv, d] (repeated heads traced back to the kv heads) and the scale."""
    softcap = None
    outer = _scaled(node)
    if outer is not None and _is(outer[0], "aten.tanh.default"):
        inner = _scaled(outer[0].args[0])
        if inner is None or not outer[1] > 0 or not math.isclose(inner[1] * outer[1], 1.0, rel_tol=1e-12):
            return None
        softcap, node = outer[1], inner[0]
    scale = 1.0
    while (by := _scaled(node)) is not None:  # ``scores * number`` or ``scores / number``, as often as written
        scale *= by[1]
        node = by[0]
    if not _is(node, "aten.matmul.default"):
        return None
    q, kt = node.args
    if not (_is(kt, "aten.transpose.int") and {d % 4 for d in kt.args[1:3]} == {2, 3}):
        return None
    k = kt.args[0]
    qs, ks = _shape(q), _shape(k)
    if qs is None or ks is None or len(qs) != 4 or len(ks) != 4 or qs[:2] != ks[:2] or qs[3] != ks[3]:
        return None
    return {"q": q, "k": k, "scale": scale, "softcap": softcap}


def _match_eager_attention(node: Any, symbolic: set[Any]) -> dict[str, Any] | None:
    """``softmax(scores [+ mask], -1) [cast] [dropout that drops nothing] @ v`` with ``_scores``'s scores:
    transformers' eager attention (Gemma 2's soft-capped logits, T5's position bias as the mask) ->
    one attention operator.  Dropout that drops in training stays written out (the kernels drop nothing)."""
    probs, v = node.args[0], node.args[1]
    while True:
        if _is(probs, "aten.dropout.default"):
            if probs.args[1] != 0 and (probs.args[2] if len(probs.args) > 2 else probs.kwargs.get("train")):
                return None
            probs = probs.args[0]
        elif _is(probs, *_CASTS):
            probs = probs.args[0]
        else:
            break
    if not _is(probs, *_SOFTMAX) or probs.args[1] not in (-1, 3):
        return None
    x, mask = probs.args[0], None
    found = _scores(x)
    if found is None and _is(x, "aten.add.Tensor") and len(x.args) == 2 and x.kwargs.get("alpha", 1) == 1:
        for s, m in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            found = _scores(s) if hasattr(m, "op") else None
            if found is not None:
                mask = m
                break
    if found is None:
        return None
    q, k = found["q"], found["k"]
    rk, rv = _repeat_source(k) or (k, 1), _repeat_source(v) or (v, 1)
    vs, ps, ks = _shape(v), _shape(probs), _shape(k)
    if rk[1] != rv[1] or vs is None or ps is None or ks is None or len(vs) != 4 or vs[:3] != (*ks[:2], ps[3]):
        return None
    if not (q in symbolic or k in symbolic or v in symbolic) or _shape(node) != (*ps[:3], vs[3]):
        return None
    ms = _shape(mask) if mask is not None else None
    if mask is not None and (ms is None or len(ms) > 4 or _dtype(mask) is None or not _dtype(mask).is_floating_point):
        return None
    return {"q": q, "k": rk[0], "v": rv[0], "mask": mask, "scale": found["scale"], "softcap": found["softcap"]}


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


def _emit_eager_attention(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor:
    a = {"query": tr.env[m["q"]], "key": tr.env[m["k"]], "value": tr.env[m["v"]],
         "attn_mask": tr.env[m["mask"]] if m["mask"] is not None else None, "dropout_p": 0.0, "is_causal": False,
         "scale": m["scale"], "enable_gqa": True}
    return _sdpa(tr, node, a, softcap=m["softcap"], mask_node=m["mask"])


def _match_rope(node: Any, symbolic: set[Any]) -> dict[str, Any] | None:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = cat(-x[..., h:], x[..., :h]): constant tables
    (``rope`` when they are the standard ones) or tables computed at run time (``rope_table``)."""
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    for m1, m2 in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (_is(m1, "aten.mul.Tensor") and _is(m2, "aten.mul.Tensor")):
            continue
        for x, cos in ((m1.args[0], m1.args[1]), (m1.args[1], m1.args[0])):
            if x not in symbolic or not hasattr(cos, "op"):
                continue
            for rot, sin in ((m2.args[0], m2.args[1]), (m2.args[1], m2.args[0])):
                if hasattr(sin, "op") and (sin in symbolic) == (cos in symbolic) and _is_rotate_half(rot, x):
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


_COMMON_BASES = (10000.0, 500000.0, 1000000.0, 100000.0, 50000.0, 5000000.0)  # tried when a 16-bit fit is loose


def _rope_tables(cos: np.ndarray, sin: np.ndarray, d: int, table_dtype: str
                 ) -> tuple[float, tuple[int, ...] | None, str | None] | None:
    """(base, seq_ends, freq_dtype) when ``cos``/``sin`` [s, d] (held in ``table_dtype``, given here as
    float32 or float64) are the standard rotate-half tables of positions 0..s-1, or of positions that
    restart at 0 at each packed sequence (rows equal to position 0's start one).  Tables of a module
    whose frequency buffer is 16-bit have frequencies rounded to that dtype: ``freq_dtype``."""
    from relational_tensors.sql_specs.rope import rope_tables

    s, half = cos.shape[0], d // 2
    sixteen = table_dtype in ("float16", "bfloat16")
    tol = 2e-2 if sixteen else 4 * float(np.finfo(np.float32).eps) * max(s, 8)
    starts = [r for r in range(s) if np.allclose(cos[r], 1, atol=tol) and np.allclose(sin[r], 0, atol=tol)]
    if not starts or starts[0] != 0:
        return None
    positions = np.arange(s) - np.array(starts)[np.searchsorted(starts, np.arange(s), side="right") - 1]
    bases = [10000.0]  # irrelevant when every position is 0 or d = 2
    ones = np.flatnonzero(positions == 1)
    if half > 1 and ones.size:
        step = math.atan2(float(sin[ones[0], 1]), float(cos[ones[0], 1]))  # position 1, frequency base^(-2/d)
        if not 0 < step < 1:
            return None
        base = step ** (-d / 2)
        # bases are whole numbers (10000, 500000): the tables' rounding moves the fitted one off it
        near = float(round(base))
        bases = [near if near > 0 and abs(base - near) <= 1e-4 * near else base]
        if sixteen:  # a loose fit: the whole-number bases models use come first, the fit itself last
            bases = [b for b in _COMMON_BASES if b != bases[0]] + bases
    best: tuple[float, float, str | None] | None = None
    for base in bases:
        for freq in (None, table_dtype) if sixteen else (None,):
            want_cos, want_sin = rope_tables(positions, d, base, np.dtype(np.float64), freq)
            err = max(float(np.max(np.abs(got.astype(np.float64) - np.concatenate([want, want], axis=1))))
                      for got, want in ((cos, want_cos), (sin, want_sin)))
            if err <= tol and (best is None or err < best[0]):
                best = (err, base, freq)
        if best is not None and base in _COMMON_BASES:
            break  # the first whole-number base that fits
    if best is None:
        return None
    return best[1], (tuple(starts[1:]) + (s,) if len(starts) > 1 else None), best[2]


def _emit_rope(tr: _Translator, node: Any, m: dict[str, Any]) -> Tensor | None:
    """The rope operator when the tables are the standard ones for positions 0..s-1; ``rope_table`` for other
    tables, constant or computed in the graph; else decline."""
    x, cos, sin = tr.env[m["x"]], tr.env[m["cos"]], tr.env[m["sin"]]
    if not isinstance(x, Tensor) or x.rank != 4 or _out_shape(node) != x.shape:
        return None
    if isinstance(cos, Tensor) and isinstance(sin, Tensor):
        return _emit_rope_table(tr, node, x, cos, sin)
    if not isinstance(cos, _Const) or not isinstance(sin, _Const):
        return None
    for seq_axis, head_axis in ((2, 1), (1, 2)):
        perm = (0, seq_axis, head_axis, 3)
        try:
            c = cos.value.broadcast_to(x.shape).permute(perm)
            s = sin.value.broadcast_to(x.shape).permute(perm)
        except RuntimeError:
            break
        tc, ts = c[0, :, 0, :], s[0, :, 0, :]
        if not (bool((c == tc[None, :, None, :]).all()) and bool((s == ts[None, :, None, :]).all())):
            continue
        wide = str(tc.dtype) == "torch.float64"  # the tables as precise as they come (16-bit ones as float32)
        found = _rope_tables(torch_to_numpy(tc if wide else tc.float()), torch_to_numpy(ts if wide else ts.float()),
                             x.shape[3], _dtype_name(tc.dtype) or "float32")
        if found is None:
            continue
        xs = tr.cast(tr.permute(x, perm), _out_dtype(node))  # tables of a wider dtype promote x, as in torch
        y = tr.g.rope(xs, found[0], seq_ends=found[1], name=tr.name("rope"), freq_dtype=found[2])
        return tr.permute(y, perm)
    # other constant tables (scaled frequencies, as Llama 3's rope scaling makes them): read as parameters
    return _emit_rope_table(tr, node, x, tr.sym(cos), tr.sym(sin))


def _emit_rope_table(tr: _Translator, node: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """``rope_table`` for x [b, h, s, d] or [b, s, h, d] and tables that broadcast to it over heads (and over the
    batch, or not): transformers' ``cos[:, None]`` of position ids; else decline."""
    dtype = _out_dtype(node)
    b = x.shape[0]
    for seq_axis, head_axis in ((2, 1), (1, 2)):
        s, d = x.shape[seq_axis], x.shape[3]
        tables = []
        for t in (cos, sin):
            shape = (1,) * (4 - t.rank) + t.shape
            if t.rank > 4 or shape[head_axis] != 1 or shape[seq_axis] != s or shape[3] != d or shape[0] not in (1, b):
                break
            # the heads axis has size 1: dropping it is a reshape; q's and k's rotations share the result
            key = (t.node.id, dtype)
            if key not in tr.rope_tables:
                tr.rope_tables[key] = tr.cast(tr.reshape(t, (shape[0], s, d)), dtype)
            tables.append(tr.rope_tables[key])
        else:
            perm = (0, seq_axis, head_axis, 3)
            y = tr.g.rope_table(tr.cast(tr.permute(x, perm), dtype), tables[0], tables[1], name=tr.name("rope"))
            return tr.permute(y, perm)
    return None


_PATTERNS: dict[str, Callable[[_Translator, Any, dict[str, Any]], Any]] = {
    "rmsnorm": _emit_rmsnorm,
    "swiglu": _emit_swiglu,
    "gqa": _emit_gqa,
    "rope": _emit_rope,
    "gelu_tanh": _emit_gelu_tanh,
    "eager_attention": _emit_eager_attention,
}


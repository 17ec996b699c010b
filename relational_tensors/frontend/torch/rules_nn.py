"""Translation rules for neural-network layers: ``dropout`` (in eval mode only), ``layer_norm``,
``rms_norm``, ``scaled_dot_product_attention`` (no mask, causal, or a constant causal or
block-diagonal mask; grouped-query heads) and ``embedding``.  ``_sdpa`` is shared with the
grouped-query attention pattern.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relational_tensors.frontend.graph import Tensor
from relational_tensors.frontend.torch.common import _Const, _fail, _out_dtype, _out_shape, _packet
from relational_tensors.frontend.torch.convert import _torch, _torch_dtype
from relational_tensors.frontend.torch.registry import register_torch_op

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


@register_torch_op("dropout", "native_dropout")
def _dropout(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if a["train"] is not False and a["p"] > 0:
        raise _fail(f"dropout in training mode (p={a['p']}) draws random numbers; call module.eval() first")
    if _packet(node) == "native_dropout":
        raise _fail("native_dropout returns a random mask; call module.eval() first")
    return tr.sym(a["input"])


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


@register_torch_op("layer_norm")
def _layer_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x, (w, b) = _norm_operands(tr, node, a, ("weight", "bias"))
    y = tr.g.layernorm(x, w, b, float(a["eps"]), name=tr.name("layernorm"))
    return tr.reshape(y, _out_shape(node))


@register_torch_op("rms_norm")
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


@register_torch_op("scaled_dot_product_attention")
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


@register_torch_op("embedding")
def _embedding(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    table = tr.sym(a["weight"], _out_dtype(node))
    ids = a["indices"]
    ids = tr.materialize(ids, "int64") if isinstance(ids, _Const) else tr.sym(ids)
    return tr.g.embedding(table, ids, name=tr.name("embedding"))



@register_torch_op("cross_entropy_loss")
def _cross_entropy(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``F.cross_entropy`` on class indices: logits [N, C] or [N, C, d...] (classes on dimension 1)."""
    if a.get("weight") is not None:
        raise _fail("cross_entropy with class weights has no translation; drop weight=")
    if a.get("label_smoothing", 0.0):
        raise _fail(f"cross_entropy with label_smoothing={a['label_smoothing']} has no translation")
    logits, targets = tr.sym(a["self"]), a["target"]
    targets = tr.materialize(targets, "int64") if isinstance(targets, _Const) else tr.sym(targets)
    if not targets.dtype.startswith("int"):
        raise _fail("cross_entropy with class probabilities as targets has no translation; pass class indices")
    if logits.rank < 2:
        raise _fail(f"cross_entropy of unbatched logits {logits.shape} has no translation; add a batch dimension")
    if logits.rank > 2:  # classes last, as g.cross_entropy takes them
        logits = tr.g.permute(logits, (0, *range(2, logits.rank), 1), name=tr.name("permute"))
    reduction = {0: "none", 1: "mean", 2: "sum"}[int(a["reduction"])]
    out = tr.g.cross_entropy(logits, targets, ignore_index=int(a["ignore_index"]), reduction=reduction,
                             name=tr.name("cross_entropy"))
    return tr.reshape(out, _out_shape(node))


@register_torch_op("mse_loss")
def _mse_loss(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    reduction = {0: "none", 1: "mean", 2: "sum"}[int(a["reduction"])]
    x, y = tr.sym(a["self"]), tr.sym(a["target"])
    if reduction == "none":
        return tr.g.unary(tr.g.sub(x, y), "square", name=tr.name("mse"))
    return tr.reshape(tr.g.mse(x, y, reduction=reduction, name=tr.name("mse")), _out_shape(node))


@register_torch_op("broadcast_tensors")
def _broadcast_tensors(tr: _Translator, node: Any, a: dict[str, Any]) -> list[Tensor]:
    """Tensors already of one shape pass through (``F.mse_loss`` broadcasts its operands first); others
    would need repeating, which the elementwise operators do themselves."""
    xs = [tr.sym(x) for x in a["tensors"]]
    shapes = {tuple(v.shape) for v in node.meta["val"]}
    if any(x.shape not in shapes for x in xs) or len(shapes) != 1:
        raise _fail(f"broadcast_tensors of shapes {[x.shape for x in xs]} has no translation; broadcast in the "
                    "elementwise operation instead")
    return xs

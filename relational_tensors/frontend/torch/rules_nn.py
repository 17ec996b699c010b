"""Translation rules for neural-network layers: ``layer_norm``,
``rms_norm``, ``scaled_dot_product_attention`` (grouped-query heads; its mask read by ``masks``
as causal alignment, packed sequences, window, key padding, mask and bias) and ``embedding``.
``_sdpa`` is shared with the grouped-query attention pattern.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relational_tensors.frontend.torch.common import _Const, _fail, _out_dtype, _out_shape
from relational_tensors.frontend.torch.convert import _torch, _torch_dtype
from relational_tensors.frontend.torch.masks import attention_form, visible
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.frontend.torch.rules_random import dropout as _dropout
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


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
        else:
            ws.append(tr.reshape(tr.sym(w, x.dtype), (d,)))
    return x, ws


@register_torch_op("layer_norm")
def _layer_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x, (w, b) = _norm_operands(tr, node, a, ("weight", "bias"))
    y = tr.g.layernorm(x, w, b, float(a["eps"]), name=tr.name("layernorm"))
    return tr.reshape(y, _out_shape(node))


@register_torch_op("_weight_norm")
def _weight_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """``v · g / ‖v‖``, the norm over every axis but ``dim`` (torch.nn.utils.parametrizations.weight_norm)."""
    dtype = _out_dtype(node)
    v, g = tr.sym(a["v"], dtype), tr.sym(a["g"], dtype)
    dim = int(a["dim"])
    axes = tuple(k for k in range(v.rank) if dim == -1 or k != dim % v.rank)
    norm = tr.unary(tr.g.sum(tr.unary(v, "square"), axes, True, name=tr.name("sum")), "sqrt")
    return tr.binary(v, tr.binary(g, norm, "div"), "mul")


@register_torch_op("group_norm")
def _group_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """x [N, C, *spatial] normalized over each group of C / G channels and the spatial positions (a layer norm
    of [N, G, C / G · spatial]), then scaled and shifted per channel."""
    x = tr.sym(a["input"], _out_dtype(node))
    groups = int(a["num_groups"])
    n, c = x.shape[0], x.shape[1]
    if x.rank < 2 or c % groups:
        raise _fail(f"group norm of {groups} groups over {x.shape}; the channels (axis 1) must divide into them")
    d = math.prod(x.shape[1:]) // groups
    torch = _torch()
    ones = tr.materialize(_Const(torch.ones(d, dtype=_torch_dtype(x.dtype)), None, f"{tr.prefix}.ones"))
    zeros = tr.materialize(_Const(torch.zeros(d, dtype=_torch_dtype(x.dtype)), None, f"{tr.prefix}.zeros"))
    y = tr.g.layernorm(tr.reshape(x, (n, groups, d)), ones, zeros, float(a["eps"]), name=tr.name("group_norm"))
    y = tr.reshape(y, x.shape)
    per_channel = (c, *([1] * (x.rank - 2)))
    if a["weight"] is not None:
        y = tr.binary(y, tr.reshape(tr.sym(a["weight"], x.dtype), per_channel), "mul")
    if a["bias"] is not None:
        y = tr.binary(y, tr.reshape(tr.sym(a["bias"], x.dtype), per_channel), "add")
    return y


@register_torch_op("rms_norm")
def _rms_norm(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x, (w,) = _norm_operands(tr, node, a, ("weight",))
    eps = a["eps"]
    if eps is None:  # torch's default: the machine epsilon of the dtype it computes in (float32 for 16-bit)
        eps = float(_torch().finfo(_torch_dtype("float32" if x.dtype in ("float16", "bfloat16") else x.dtype)).eps)
    y = tr.g.rmsnorm(x, w, float(eps), name=tr.name("rmsnorm"))
    return tr.reshape(y, _out_shape(node))


def _argument_node(node: Any, name: str) -> Any:
    """The fx node passed as argument ``name`` of ``node``, or None (a number, None, or absent)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            v = node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(name)
            return v if hasattr(v, "meta") else None
    return None


@register_torch_op("scaled_dot_product_attention")
def _sdpa_rule(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return _sdpa(tr, node, a)


def _sdpa(tr: _Translator, node: Any, a: dict[str, Any], softcap: float | None = None,
          mask_node: Any = None) -> Tensor:
    """SDPA's arguments ``a`` as one attention operator; ``softcap`` and the mask's fx node (``mask_node``,
    else ``node``'s ``attn_mask``) for the written-out attention the patterns recognize."""
    dtype = _out_dtype(node)
    q, k, v = (tr.sym(a[n], dtype) for n in ("query", "key", "value"))
    if not (q.rank == k.rank == v.rank) or q.rank not in (3, 4):
        raise _fail(f"attention on q {q.shape}, k {k.shape}, v {v.shape}; supported: [batch, heads, seq, d] "
                    "or [batch, seq, d] for all three")
    sq, skv = q.shape[-2], k.shape[-2]
    heads = q.shape[1] if q.rank == 4 else 1
    mask_node = mask_node if mask_node is not None else _argument_node(node, "attn_mask")
    form = attention_form(tr, a["attn_mask"], mask_node, q.shape[0], heads, sq, skv, q.dtype, q.rank)
    if a["is_causal"]:
        if form.causal is not False or form.extra:
            raise _fail("is_causal=True together with an attn_mask (SDPA refuses that too); pass one of them")
        form.causal = True if sq == skv else "top_left"  # SDPA aligns is_causal top-left
    if q.rank == 3:  # one head: [b, s, d] -> [b, s, 1, d]
        q, k, v = (tr.reshape(t, (t.shape[0], t.shape[1], 1, t.shape[2])) for t in (q, k, v))
    else:
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv and not a["enable_gqa"]:
            raise _fail(f"{hq} query heads and {hkv} key/value heads without enable_gqa=True")
        q, k, v = (tr.permute(t, (0, 2, 1, 3)) for t in (q, k, v))
    if a["dropout_p"]:
        out = _attention_with_dropout(tr, q, k, v, form, a["scale"], float(a["dropout_p"]))
    else:
        out = tr.g.attention(q, k, v, scale=a["scale"], name=tr.name("attention"), softcap=softcap, **form.kwargs())
    if len(_out_shape(node)) == 3:
        return tr.reshape(out, _out_shape(node))
    return tr.permute(out, (0, 2, 1, 3))


def _attention_with_dropout(tr: _Translator, q: Tensor, k: Tensor, v: Tensor, form: Any, scale: float | None,
                            p: float) -> Tensor:
    """Attention whose probabilities are dropped out (SDPA's ``dropout_p`` in training), written out: the
    scores [b, hkv, group, sq, skv], the masks as the lowest finite value (as transformers' float masks
    are), softmax, dropout, and the product with v.  The scores are materialized: no attention kernel
    drops probabilities inside."""
    torch = _torch()
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    q5 = tr.reshape(q, (b, sq, hkv, group, d))
    s = tr.g.einsum("bqhgd,bkhd->bhgqk", q5, k, name=tr.name("scores"))
    s = tr.unary(s, "scale", float(scale) if scale is not None else 1.0 / math.sqrt(d))
    lowest = float(torch.finfo(_torch_dtype(s.dtype)).min)
    allowed = torch.from_numpy(visible(sq, skv, form.causal, form.seq_ends, form.window))
    if not bool(allowed.all()):
        bias = torch.zeros(sq, skv, dtype=_torch_dtype(s.dtype)).masked_fill(~allowed, lowest)
        s = tr.binary(s, tr.materialize(_Const(bias.reshape(1, 1, 1, sq, skv), None, f"{tr.prefix}.structure"),
                                        s.dtype), "add")

    def per_group(t: Tensor) -> Tensor:  # [b|1, hq|1, sq, skv] -> [b|1, hkv|1, group|1, sq, skv]
        return tr.reshape(t, (t.shape[0], *((hkv, group) if t.shape[1] > 1 else (1, 1)), sq, skv))

    if "bias" in form.extra:
        s = tr.binary(s, per_group(tr.cast(form.extra["bias"], s.dtype)), "add")
    low = tr.unary(s, "fill", lowest)
    if "mask" in form.extra:
        s = tr.g.where(per_group(form.extra["mask"]), s, low, name=tr.name("mask"))
    if "key_padding" in form.extra:
        kp = tr.reshape(form.extra["key_padding"], (b, 1, 1, 1, skv))
        s = tr.g.where(kp, s, low, name=tr.name("key_padding"))
    probs = _dropout(tr, tr.g.softmax(s, -1, name=tr.name("softmax")), p)
    out = tr.g.einsum("bhgqk,bkhd->bqhgd", probs, v, name=tr.name("attention"))
    return tr.reshape(out, (b, sq, hq, d))


@register_torch_op("embedding")
def _embedding(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    """A lookup; with ``padding_idx`` (``nn.Embedding(..., padding_idx=p)``) the row ``p`` gets no gradient,
    as torch's: the rows read at padding positions are the same values, detached."""
    weight = a["weight"]
    table = tr.sym(weight, _out_dtype(node))
    ids = a["indices"]
    ids = tr.materialize(ids, "int64") if isinstance(ids, _Const) else tr.sym(ids)
    out = tr.g.embedding(table, ids, name=tr.name("embedding"))
    pad = a.get("padding_idx")
    trained = not isinstance(weight, _Const) or weight.live
    if trained and a.get("scale_grad_by_freq"):
        raise _fail("an embedding with scale_grad_by_freq=True (its gradient divided by each id's count in the "
                    "batch); supported: scale_grad_by_freq=False")
    if trained and isinstance(pad, int) and pad >= 0:
        at_pad = tr.reshape(tr.binary(ids, tr.sym(pad, "int64"), "equal"), (*ids.shape, 1))
        out = tr.g.where(at_pad, tr.unary(out, "detach"), out, name=tr.name("padding_idx"))
    return out



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

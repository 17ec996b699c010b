"""Translation rules for random draws in training: ``dropout`` and ``native_dropout`` (in eval mode the value
itself), ``rand``/``rand_like`` (stochastic depth draws these), ``uniform`` over ``[from, to)`` (``x.uniform_(a, b)``:
PhiMoE's router jitter in training), ``bernoulli`` with a probability, and
``floor`` (stochastic depth's ``floor(keep + rand)``).

Every draw is an operator of the graph reading the translator's random-state input (``tr.rng()``, int64
[2]: seed, offset) with a stream of its own, so each element's value depends on the seed, the stream and its
index in the whole tensor only: every plan, device count and executor draws the same numbers, and a caller
that feeds the state from torch's generator repeats them after ``torch.manual_seed``.  They are not the
numbers torch draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relational_tensors.frontend.torch.common import _fail, _out_dtype, _out_shape, _packet
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


def dropout(tr: _Translator, x: Tensor, p: float) -> Tensor:
    """``x`` with each element zeroed with probability ``p`` and the others scaled by ``1 / (1 - p)``."""
    if not 0.0 <= p <= 1.0:
        raise _fail(f"dropout probability {p}; it must lie in [0, 1]")
    if p == 0.0:
        return x
    if p == 1.0:  # torch: every element dropped
        return tr.unary(x, "scale", 0.0)
    return tr.g.dropout(x, tr.rng(), p, tr.stream(), name=tr.name("dropout"))


@register_torch_op("dropout", "native_dropout")
def _dropout(tr: _Translator, node: Any, a: dict[str, Any]) -> Any:
    x = tr.sym(a["input"])
    p = float(a["p"]) if a["train"] is not False else 0.0
    if _packet(node) == "dropout" or p in (0.0, 1.0):
        y = dropout(tr, x, p)
        if _packet(node) == "dropout":
            return y
        return [y, tr.binary(tr.unary(x, "fill", 1.0 - p), tr.unary(x, "fill", 0.0), "not_equal")]
    # native_dropout also returns where it kept: the same draw (the same stream) applied to ones
    stream = tr.stream()
    y = tr.g.dropout(x, tr.rng(), p, stream, name=tr.name("dropout"))
    kept = tr.g.dropout(tr.unary(x, "fill", 1.0), tr.rng(), p, stream, name=tr.name("dropout_mask"))
    return [y, tr.binary(kept, tr.unary(x, "fill", 0.0), "not_equal")]


@register_torch_op("rand", "rand_like")
def _rand(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return tr.g.random(tr.rng(), _out_shape(node), _out_dtype(node) or "float32", tr.stream(), "uniform",
                       name=tr.name("rand"))


@register_torch_op("uniform")
def _uniform(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    low, high = a.get("from", 0.0), a.get("to", 1.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or not low <= high:
        raise _fail(f"uniform over [{low}, {high}); supported: numbers from <= to")
    u = tr.g.random(tr.rng(), _out_shape(node), _out_dtype(node) or "float32", tr.stream(), "uniform",
                    name=tr.name("uniform"))
    if (low, high) == (0.0, 1.0):
        return u
    return tr.unary(tr.unary(u, "scale", float(high) - float(low)), "add_scalar", float(low))


@register_torch_op("bernoulli")
def _bernoulli(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    p = a.get("p")
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise _fail("bernoulli with a tensor of probabilities; supported: x.bernoulli(p) with a number p "
                    "(or x.bernoulli_(p), as stochastic depth draws it)")
    if not 0.0 <= float(p) <= 1.0:
        raise _fail(f"bernoulli probability {p}; it must lie in [0, 1]")
    return tr.g.random(tr.rng(), _out_shape(node), _out_dtype(node) or "float32", tr.stream(), "bernoulli",
                       float(p), name=tr.name("bernoulli"))


@register_torch_op("floor")
def _floor(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    return tr.unary(tr.sym(a["self"], _out_dtype(node)), "floor")

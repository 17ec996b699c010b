"""The table of translation rules, keyed by ATen operation, and ``register_torch_op``, which fills it.

A rule is called as ``rule(tr, node, a)``: ``tr`` the translator (it emits graph operators:
``tr.sym``, ``tr.unary``, ``tr.binary``, ``tr.reshape``, ``tr.g``, ...), ``node`` the fx node, ``a``
the node's arguments by schema name with defaults filled in and nodes replaced by their values
(graph tensors, or ``_Const`` for values known at trace time).  It returns the node's value (a
tensor, or a list of them) or raises the error of ``common._fail`` when it cannot translate it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator

__all__ = ["register_torch_op", "unsupported", "REFUSED"]

_Rule = Callable[["_Translator", Any, dict[str, Any]], Any]
_RULES: dict[str, _Rule] = {}

# operations refused by rule (not merely unknown): why, as the error message says it
_DATA_DEPENDENT = "it selects by values computed from the inputs, which gives data-dependent indices or shapes"
REFUSED: dict[str, str] = {
    "sort": _DATA_DEPENDENT, "argsort": _DATA_DEPENDENT,
    "nonzero": _DATA_DEPENDENT, "masked_select": _DATA_DEPENDENT, "unique": _DATA_DEPENDENT,
    "randn": "normal draws are not supported; rand, rand_like, uniform, bernoulli and dropout are",
    "randn_like": "normal draws are not supported; rand, rand_like, uniform, bernoulli and dropout are",
    "normal": "normal draws are not supported; rand, rand_like, uniform, bernoulli and dropout are",
    "multinomial": "sampling from a distribution over categories is not supported; rand, rand_like, uniform, bernoulli "
                   "and dropout are",
    "_native_batch_norm_legit": "batch norm in training mode updates running statistics; call module.eval()",
    "max_pool2d_with_indices": "max pooling that returns its indices (return_indices=True) is not supported",
}


def unsupported(reason: str) -> Exception:
    """The error a rule raises for a case it cannot translate (``raise unsupported("softplus with beta != 1")``):
    the translator turns it into a ``GraphError`` naming the operation, its source line and ``reason``."""
    from relational_tensors.frontend.torch.common import _fail

    return _fail(reason)


def _definition(fn: Any) -> tuple[Any, ...]:
    """Where ``fn`` is defined; the same place means the same function (a module executed again)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return (id(fn),)
    return (getattr(fn, "__qualname__", None), code.co_filename, code.co_firstlineno)


def register_torch_op(aten_op: str, *aten_ops: str) -> Callable[[_Rule], _Rule]:
    """Register a translation rule for the ATen operations ``aten_op, *aten_ops`` (overload packets).

    An operation is named by its overload packet, the part after ``aten.``: ``"add"`` for both
    ``aten.add.Tensor`` and ``aten.add.Scalar``.  The decorated function is called as
    ``rule(tr, node, a)`` (see this module's docstring) and returned unchanged.  An operation can
    have one rule: registering it again from a different function raises ``ValueError`` (the same
    function registered again, as when its module is executed again, replaces itself).
    ``SUPPORTED_OPS`` (the list in the translator's error messages) is computed when the frontend
    is imported, from the built-in rules.

    Example (``aten.hardtanh`` written as ``min(max(x, lo), hi)``)::

        from relational_tensors.frontend import register_torch_op

        @register_torch_op("hardtanh")
        def _hardtanh(tr, node, a):
            x = tr.sym(a["self"])
            lo, hi = (tr.sym(float(a[k]), x.dtype) for k in ("min_val", "max_val"))
            return tr.binary(tr.binary(x, lo, "maximum"), hi, "minimum")

    >>> from relational_tensors.frontend import register_torch_op
    >>> register_torch_op("add")(lambda tr, node, a: None)
    Traceback (most recent call last):
    ...
    ValueError: the ATen operation 'add' already has a translation rule, ...
    """
    names = (aten_op, *aten_ops)

    def deco(fn: _Rule) -> _Rule:
        for n in names:
            old = _RULES.get(n)
            if old is not None and _definition(old) != _definition(fn):
                raise ValueError(
                    f"the ATen operation {n!r} already has a translation rule, "
                    f"{getattr(old, '__module__', '?')}.{getattr(old, '__qualname__', old)!s}; "
                    f"register_torch_op cannot also give it {getattr(fn, '__module__', '?')}."
                    f"{getattr(fn, '__qualname__', fn)!s}."
                )
        for n in names:
            _RULES[n] = fn
        return fn
    return deco

"""Cross-entropy over a vocabulary that may be split: ``cross_entropy``, ``cross_entropy_grad`` and
``token_count``.

``g.cross_entropy(logits, targets)`` builds the log-sum-exp of each row (a ``reduce`` whose vocabulary
split is merged by ⊕ = logsumexp), then ``cross_entropy``: per token ``lse - logits[target]`` (zero at an
ignored target).  Its vocabulary splits with ⊕ = sum: the block that holds vocabulary entry 0 adds the
log-sum-exp, and the block that holds the target subtracts its logit; the tokens split anywhere.  So
neither the forward nor the gradient, ``(softmax - onehot(target)) · dloss``, which splits both ways
without aggregation, needs a whole row of the vocabulary on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, canonical_dtype, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.grad import SECOND_ORDER, build

__all__ = ["CrossEntropyOp", "CrossEntropyGradOp", "TokenCountOp", "check_targets"]


def check_targets(targets: np.ndarray, vocab: int, ignore_index: int | None) -> np.ndarray:
    """The mask of the targets that count; a target outside [0, vocab) that is not ``ignore_index`` is refused."""
    valid = np.ones(targets.shape, dtype=bool) if ignore_index is None else targets != ignore_index
    bad = valid & ((targets < 0) | (targets >= vocab))
    if bad.any():
        got = targets[bad]
        hint = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ExecError(f"cross_entropy targets must lie in [0, {vocab}){hint}; got values from {int(got.min())} "
                        f"to {int(got.max())}.")
    return valid


def _check_ignore(ignore_index: object) -> None:
    if ignore_index is not None and (not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool)):
        raise GraphError(f"cross_entropy ignore_index must be an integer or None; got {ignore_index!r}.")


def _tokens(rank: int) -> tuple[str, ...]:
    return tuple(f"t{n}" for n in range(rank))


def _check_logits(kind: str, logits: TensorType, targets: TensorType) -> None:
    if logits.rank < 2 or logits.dtype not in FLOAT_DTYPES:
        raise GraphError(f"{kind} takes floating logits [..., vocab] of rank >= 2; got {logits}.")
    if targets.dtype not in ("int32", "int64") or targets.shape != logits.shape[:-1]:
        raise GraphError(f"{kind} takes int32/int64 targets of shape logits.shape[:-1] = {logits.shape[:-1]}; "
                         f"got {targets}.")


@register
@dataclass(frozen=True, eq=True)
class CrossEntropyOp(IndexedOp):
    """Per-token loss ``lse - logits[target]`` from logits [..., vocab], their row log-sum-exp [...] and the
    targets [...]; zero where the target is ``ignore_index``.  ``lse`` must be ``logsumexp(logits, -1)``
    (``g.cross_entropy`` builds it): the gradient of the logits goes through it.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = CrossEntropyOp((T.zero((6, 50)), T.zero((6,)), T.zero((6,), "int64")))
    >>> op.signature(), str(op.aggregation)
    ('t0 vocab, t0, t0 -> t0', 'sum')
    """

    kind = "cross_entropy"
    ignore_index: int | None = None

    def infer(self) -> TensorType:
        if len(self.input_types) != 3:
            raise GraphError(f"cross_entropy takes logits, lse and targets; got {len(self.input_types)} tensors.")
        logits, lse, targets = self.input_types
        _check_logits(self.kind, logits, targets)
        _check_ignore(self.ignore_index)
        if lse.shape != logits.shape[:-1] or lse.dtype != logits.dtype:
            raise GraphError(f"cross_entropy needs lse of shape {logits.shape[:-1]} and dtype {logits.dtype}; "
                             f"got {lse}.")
        return TensorType.zero(logits.shape[:-1], logits.dtype, logits.names[:-1])

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        tokens = _tokens(self.input_types[2].rank)
        return ((*tokens, "vocab"), tokens, tokens)

    def dims_out(self) -> tuple[str | None, ...]:
        return _tokens(self.input_types[2].rank)

    def params(self) -> dict[str, object]:
        return {"ignore_index": self.ignore_index}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 2.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        logits, lse, targets = blocks
        vocab = self.input_types[0].shape[-1]
        valid = check_targets(targets, vocab, self.ignore_index)
        v0, v1 = f.inputs[0].lower[-1], f.inputs[0].upper[-1]
        logits = self._compute(logits)
        mine = valid & (targets >= v0) & (targets < v1)
        picked = np.take_along_axis(logits, np.clip(targets - v0, 0, max(v1 - v0 - 1, 0))[..., None], -1)[..., 0]
        out = np.where(mine, -picked, 0.0)
        if v0 == 0:
            out = out + np.where(valid, self._compute(lse), 0.0)
        return self._result(out)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        logits, lse, targets = inputs
        op, operands = b.producer(lse)
        if not (op is not None and op.kind == "reduce" and op.params() == {"op": "logsumexp", "axes": (logits.type.rank
                - 1,), "keepdims": False} and operands[0].id == logits.id):
            raise GraphError("cross_entropy's gradient needs its lse input to be g.logsumexp(logits, axis=-1) of the "
                             "same logits (g.cross_entropy builds it so); got another tensor.")
        grad = build(b, "cross_entropy_grad", (logits, lse, targets, cotangent), ignore_index=self.ignore_index)
        return (grad if wanted[0] else None, None, None)


@register
@dataclass(frozen=True, eq=True)
class CrossEntropyGradOp(IndexedOp):
    """``(exp(logits - lse) - onehot(target)) · dloss`` per token, zero at ignored targets: the gradient of the
    logits of ``cross_entropy``.  Tokens and vocabulary split anywhere; nothing is aggregated.

    >>> from relational_tensors.core.types import TensorType as T
    >>> CrossEntropyGradOp((T.zero((6, 50)), T.zero((6,)), T.zero((6,), "int64"), T.zero((6,)))).signature()
    't0 vocab, t0, t0, t0 -> t0 vocab'
    """

    kind = "cross_entropy_grad"
    gradient = SECOND_ORDER
    ignore_index: int | None = None

    def infer(self) -> TensorType:
        logits, lse, targets, dloss = self.input_types
        _check_logits(self.kind, logits, targets)
        _check_ignore(self.ignore_index)
        if lse.shape != targets.shape or dloss.shape != targets.shape:
            raise GraphError(f"cross_entropy_grad needs lse and dloss of shape {targets.shape}; got {lse.shape}, "
                             f"{dloss.shape}.")
        return logits

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        tokens = _tokens(self.input_types[2].rank)
        return ((*tokens, "vocab"), tokens, tokens, tokens)

    def dims_out(self) -> tuple[str | None, ...]:
        return (*_tokens(self.input_types[2].rank), "vocab")

    def params(self) -> dict[str, object]:
        return {"ignore_index": self.ignore_index}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 4.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        logits, lse, targets, dloss = blocks
        valid = check_targets(targets, self.input_types[0].shape[-1], self.ignore_index)
        v0 = f.inputs[0].lower[-1]
        logits = self._compute(logits)
        grad = np.exp(logits - self._compute(lse)[..., None])
        cols = np.arange(v0, v0 + logits.shape[-1])
        grad = grad - (cols == targets[..., None])
        return self._result(grad * np.where(valid, self._compute(dloss), 0.0)[..., None])


@register
@dataclass(frozen=True, eq=True)
class TokenCountOp(IndexedOp):
    """The number of targets that are not ``ignore_index``, as a [1] tensor of ``dtype`` (the divisor of a
    mean cross-entropy); tokens split with ⊕ = sum.

    >>> from relational_tensors.core.types import TensorType as T
    >>> TokenCountOp((T.zero((4, 6), "int64"),), None, "float32").output_type.shape
    (1,)
    """

    kind = "token_count"
    gradient = "its value does not depend on any floating input"
    ignore_index: int | None = None
    dtype: str = "float32"

    def infer(self) -> TensorType:
        (targets,) = self.input_types
        if targets.dtype not in ("int32", "int64"):
            raise GraphError(f"token_count takes int32/int64 targets; got {targets}.")
        _check_ignore(self.ignore_index)
        dtype = canonical_dtype(self.dtype)
        if dtype not in FLOAT_DTYPES:
            raise GraphError(f"token_count counts in a floating dtype; got {self.dtype!r}.")
        return TensorType.zero((1,), dtype, ("d0",))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return (_tokens(self.input_types[0].rank),)

    def dims_out(self) -> tuple[str | None, ...]:
        return (None,)

    def params(self) -> dict[str, object]:
        return {"ignore_index": self.ignore_index, "dtype": self.dtype}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        (targets,) = blocks
        count = targets.size if self.ignore_index is None else int(np.count_nonzero(targets != self.ignore_index))
        return self._result(np.full((1,), count, dtype=numpy_dtype(self.output_type.dtype)))

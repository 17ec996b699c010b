"""Contractions: ``einsum`` and ``matmul`` (2-D and batched).

Every index may be split anywhere; indices absent from the output are
contracted, and their partial products are combined by ⊕ = sum.  The 2-D
matmul names its indices i, j, k as in the paper: ``i j, j k -> i k``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import names_or_default, same_dtype
from relational_tensors.sql_specs.grad import einsum_grads, index_letters

__all__ = ["EinsumOp", "MatmulOp", "parse_einsum", "einsum_letters"]


def parse_einsum(subscripts: str, ranks: Sequence[int]) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """Split ``"ij,jk->ik"`` into per-operand indices; the output defaults to the indices used once, sorted.
    Indices are letters, or names separated by spaces (``"experts tokens hidden, experts hidden ff -> experts
    tokens ff"``), the names the plan and ``explain()`` show.  A spec is read as letters (spaces ignored, as
    torch reads it) where that gives every operand its rank, else as names where it has spaces.

    >>> parse_einsum("ij,jk->ik", [2, 2])
    ((('i', 'j'), ('j', 'k')), ('i', 'k'))
    >>> parse_einsum("experts t h, experts h f -> experts t f", [3, 3])[1]
    ('experts', 't', 'f')
    """
    return _parse_einsum(subscripts, tuple(ranks))


def einsum_letters(ins: Sequence[Sequence[str]], out: Sequence[str]) -> str:
    """The one-letter spec of parsed indices, for ``numpy.einsum`` and its kin: letters as they are, names
    given letters in order of appearance (``grad.index_letters``)."""
    parts = [*ins, out]
    letter = index_letters(parts) if any(len(n) > 1 for part in parts for n in part) else {
        n: n for part in parts for n in part}
    return ",".join("".join(letter[n] for n in part) for part in ins) + "->" + "".join(letter[n] for n in out)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _indices(part: str, named: bool, subscripts: str) -> tuple[str, ...]:
    if not named:
        return tuple(part.replace(" ", ""))
    names = tuple(part.split())
    bad = [n for n in names if not _NAME.fullmatch(n)]
    if bad:
        raise GraphError(f"einsum index names are identifiers; got {bad} in {subscripts!r}.")
    return names


@functools.lru_cache(maxsize=1024)  # the planner asks for an operator's letters once per function spec
def _parse_einsum(subscripts: str, ranks: tuple[int, ...]) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    if "." in subscripts:
        raise GraphError(f"einsum ellipses are not supported; got {subscripts!r}. Write every index out.")
    spec = subscripts.strip()
    lhs, _, rhs = spec.partition("->")
    parts = lhs.split(",")
    # letters, spaces ignored (torch's reading), where they give every operand its rank; else names, where
    # the spec has spaces and some operand lists several words or every operand one word per dimension
    fits = len(parts) == len(ranks) and all(len(part.replace(" ", "")) == rank for part, rank in zip(parts, ranks))
    named = not fits and " " in spec and (
        any(len(part.split()) > 1 for part in (*parts, rhs)) or all(len(part.split()) == rank
                                                                    for part, rank in zip(parts, ranks)))
    return _read_einsum(subscripts, spec, ranks, named)


def _read_einsum(subscripts: str, spec: str, ranks: tuple[int, ...],
                 named: bool) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """``spec`` read as letters or, ``named``, as names separated by spaces."""
    if not named and not re.fullmatch(r"[A-Za-z]*(,[A-Za-z]*)*(->[A-Za-z]*)?", spec.replace(" ", "")):
        raise GraphError(f"an einsum spec is letters, commas and one '->'; got {subscripts!r}.")
    lhs, arrow, rhs = spec.partition("->")
    if "->" in rhs:
        raise GraphError(f"an einsum spec has one '->'; got {subscripts!r}.")
    ins = tuple(_indices(part, named, subscripts) for part in lhs.split(","))
    if len(ins) != len(ranks):
        raise GraphError(f"einsum {subscripts!r} names {len(ins)} operands; got {len(ranks)} tensors.")
    for k, (letters, rank) in enumerate(zip(ins, ranks)):
        if len(letters) != rank:
            raise GraphError(f"einsum {subscripts!r}: operand {k} has {len(letters)} indices but rank {rank}.")
    if arrow:
        out = _indices(rhs, named, subscripts)
    else:
        counts: dict[str, int] = {}
        for letters in ins:
            for c in letters:
                counts[c] = counts.get(c, 0) + 1
        out = tuple(sorted(c for c, n in counts.items() if n == 1))
    if len(set(out)) != len(out):
        shown = " ".join(out) if named else "".join(out)
        raise GraphError(f"einsum output indices must be distinct; got {shown!r} in {subscripts!r}.")
    used = {c for letters in ins for c in letters}
    missing = [c for c in out if c not in used]
    if missing:
        raise GraphError(f"einsum output index {missing} appears in no input of {subscripts!r}.")
    return ins, out


@register
@dataclass(frozen=True, eq=True)
class EinsumOp(IndexedOp):
    """A general contraction given by an einsum string.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = EinsumOp((T.zero((4, 6)), T.zero((6, 2))), "ij,jk->ik")
    >>> op.signature(), op.output_type.shape
    ('i j, j k -> i k', (4, 2))
    """

    kind = "einsum"
    contraction = True
    cost_family = "matmul"
    subscripts: str = ""

    def _parsed(self) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
        return parse_einsum(self.subscripts, [t.rank for t in self.input_types])

    def infer(self) -> TensorType:
        ins, out = self._parsed()
        dtype = same_dtype(self.kind, self.input_types)
        sizes: dict[str, int] = {}
        for k, (letters, t) in enumerate(zip(ins, self.input_types)):
            for c, n in zip(letters, t.shape):
                if sizes.setdefault(c, n) != n:
                    raise GraphError(
                        f"einsum {self.subscripts!r}: index {c!r} has size {sizes[c]} in one operand and {n} "
                        f"in operand {k}; got shapes {[t.shape for t in self.input_types]}."
                    )
        return TensorType.zero(tuple(sizes[c] for c in out), dtype, names_or_default(out))

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return self._parsed()[0]

    def dims_out(self) -> tuple[str | None, ...]:
        return self._parsed()[1]

    def params(self) -> dict[str, object]:
        return {"subscripts": self.subscripts}

    def contracted(self) -> tuple[str, ...]:
        out = set(self.dims_out())
        return tuple(n for n in self.index_order() if n not in out)

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        factor = 2.0 if self.contracted() or len(self.input_types) > 1 else 1.0
        return factor * self.iteration_volume(inputs, output)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        ins, out = self._parsed()
        operands = (self._compute(b) for b in blocks)
        return self._result(np.einsum(einsum_letters(ins, out), *operands, optimize=len(blocks) > 2))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        """Operand k's gradient is the einsum of the output's gradient with the other operands onto k's
        indices: for ``C = A @ B``, ``dA = dC @ Bᵀ`` and ``dB = Aᵀ @ dC`` (summed over the batch)."""
        ins, out = self._parsed()
        # an einsum written with names: its gradients name their indices too (a matmul's b0 i j k take letters)
        named = self.kind == "einsum" and any(len(n) > 1 for part in (*ins, out) for n in part)
        return einsum_grads(self.kind, b, ins, out, inputs, cotangent, wanted, named=named)


@functools.lru_cache(maxsize=256)
@functools.lru_cache(maxsize=64)
def _matmul_letters(a_rank: int, b_rank: int) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    batch = tuple(f"b{n}" for n in range(a_rank - 2))
    b_batch = batch if b_rank > 2 else ()
    return ((*batch, "i", "j"), (*b_batch, "j", "k")), (*batch, "i", "k")


@register
@dataclass(frozen=True, eq=True)
class MatmulOp(EinsumOp):
    """``A[..., i, j] @ B[j, k]`` or batched ``A[..., i, j] @ B[..., j, k]``.

    >>> from relational_tensors.core.types import TensorType as T
    >>> MatmulOp((T.zero((3, 8, 4)), T.zero((4, 5)))).signature()
    'b0 i j, j k -> b0 i k'
    """

    kind = "matmul"

    def _parsed(self) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
        a, b = self.input_types
        return _matmul_letters(a.rank, b.rank)

    def infer(self) -> TensorType:
        if len(self.input_types) != 2:
            raise GraphError(f"matmul takes two tensors; got {len(self.input_types)}.")
        a, b = self.input_types
        if a.rank < 2 or b.rank < 2:
            raise GraphError(f"matmul needs operands of rank >= 2; got shapes {a.shape} @ {b.shape}. "
                             "Reshape a vector to [1, n] or [n, 1] first.")
        if b.rank > 2 and b.shape[:-2] != a.shape[:-2]:
            raise GraphError(
                f"batched matmul needs equal batch dimensions; got {a.shape} @ {b.shape} "
                f"(batch {a.shape[:-2]} vs {b.shape[:-2]}). Give B the batch shape of A, or make B 2-D."
            )
        if a.shape[-1] != b.shape[-2]:
            raise GraphError(
                f"matmul needs A's last dimension to equal B's second to last (index j); "
                f"got {a.shape} @ {b.shape}: j = {a.shape[-1]} vs {b.shape[-2]}."
            )
        dtype = same_dtype(self.kind, self.input_types)
        shape = (*a.shape[:-1], b.shape[-1])
        names = names_or_default((*a.names[:-1], b.names[-1]))
        return TensorType.zero(shape, dtype, names)

    def params(self) -> dict[str, object]:
        return {}

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        a, b = (self._compute(x) for x in blocks)
        return self._result(np.matmul(a, b))

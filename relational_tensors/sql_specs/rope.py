"""Rotary position embedding on x[batch, seq, heads, d_head], rotate-half convention.

out = cat(x1·cos − x2·sin, x2·cos + x1·sin), x1/x2 the halves of d_head and
angle = position · base^(−2i/d_head) (with ``freq_dtype``, the frequencies rounded to that dtype and the
angles computed in float32, as a module whose frequency buffer was cast to 16 bits computes them).
Positions come from the block's own
offset in the sequence (restarting at each packed-sequence start), so the
sequence index splits anywhere; d_head does not split.  The gradient is the
inverse rotation of the output's gradient (``inverse=True``: the angles negated).

``rope_table`` rotates by tables the graph computes: out = x·cos + rotate_half(x)·sin with cos and sin of
shape [batch, seq, d_head] (or [1, seq, d_head], shared by the batch), as transformers' rotary modules
produce them from position ids at run time (a decode step's positions, left-padded prompts, scaled
frequencies).  Its gradient is the transposed rotation (``inverse=True``) of the output's gradient; the
tables' gradients, where wanted, are sums over heads built from elementwise operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, numpy_dtype
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, SameIndicesOp, register
from relational_tensors.sql_specs.common import finite_number
from relational_tensors.sql_specs.grad import build, reduce_to
from relational_tensors.sql_specs.packing import check_seq_ends, sequence_bounds

__all__ = ["RopeOp", "RopeTableOp", "rope_tables", "rounded_frequencies"]


def rope_tables(positions: np.ndarray, d_head: int, base: float, dtype: np.dtype,
                freq_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [len(positions), d_head // 2]."""
    ang: np.ndarray
    if freq_dtype is None:
        inv = base ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)
        ang = positions.astype(np.float64)[:, None] * inv[None, :]
    else:
        ang = positions.astype(np.float32)[:, None] * rounded_frequencies(d_head, base, freq_dtype)[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rounded_frequencies(d_head: int, base: float, freq_dtype: str) -> np.ndarray:
    """The d_head // 2 frequencies of a module's ``inv_freq`` buffer held in ``freq_dtype``: computed in
    float32, cast to the buffer's dtype (as ``module.to(dtype)`` does), read back as float32."""
    inv = base ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)
    return inv.astype(np.float32).astype(numpy_dtype(freq_dtype)).astype(np.float32)


@register
@dataclass(frozen=True, eq=True)
class RopeOp(SameIndicesOp):
    """Rotary embedding; positions restart at each packed-sequence start when ``seq_ends`` is given.

    >>> from relational_tensors.core.types import TensorType as T
    >>> [s.name for s in RopeOp((T.zero((1, 8, 2, 4)),)).shardable()]
    ['d0', 'd1', 'd2']
    """

    kind = "rope"
    base: float = 10000.0
    seq_ends: tuple[int, ...] | None = None
    inverse: bool = False  # rotate by the negated angles (the gradient of a rotation)
    freq_dtype: str | None = None  # the frequencies rounded to this dtype (a module's 16-bit buffer)

    def infer(self) -> TensorType:
        (x,) = self.input_types
        if x.rank != 4:
            raise GraphError(f"rope takes x of shape [batch, seq, heads, d_head]; got rank {x.rank} shape {x.shape}.")
        if x.shape[3] % 2:
            raise GraphError(f"rope needs an even d_head to rotate its halves; got d_head={x.shape[3]} in {x.shape}.")
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"rope needs a floating tensor; got dtype {x.dtype}.")
        finite_number("rope base", self.base, above=0)
        if self.freq_dtype is not None and self.freq_dtype not in FLOAT_DTYPES:
            raise GraphError(f"rope freq_dtype must be a float dtype or None; got {self.freq_dtype!r}.")
        check_seq_ends(self.kind, self.seq_ends, x.shape[1])
        return x

    def unshardable(self) -> frozenset[str]:
        return frozenset({self.input_types[0].names[3]})

    def params(self) -> dict[str, object]:
        out: dict[str, object] = {"base": self.base, "seq_ends": self.seq_ends, "inverse": self.inverse}
        if self.freq_dtype is not None:
            out["freq_dtype"] = self.freq_dtype
        return out

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 3.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x = self._compute(blocks[0])
        box = f.inputs[0]
        length = self.input_types[0].shape[1]
        pos = np.arange(box.lower[1], box.upper[1])
        start, _ = sequence_bounds(pos, self.seq_ends, length)
        cos, sin = rope_tables(pos - start, x.shape[3], self.base, x.dtype, self.freq_dtype)
        cos, sin = cos[None, :, None, :], (-sin if self.inverse else sin)[None, :, None, :]
        half = x.shape[3] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self._result(np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        return (build(b, "rope", (cotangent,), base=self.base, seq_ends=self.seq_ends, inverse=not self.inverse,
                      freq_dtype=self.freq_dtype),)


@register
@dataclass(frozen=True, eq=True)
class RopeTableOp(IndexedOp):
    """Rotate-half rotary embedding of x[batch, seq, heads, d_head] by given tables cos and sin
    [batch or 1, seq, d_head]: ``x·cos + rotate_half(x)·sin``, rotate_half(x) = cat(−x₂, x₁); with
    ``inverse``, its transpose ``x·cos + cat(x₂·sin₂, −x₁·sin₁)`` (the gradient of the rotation).  Every
    index but d_head splits; the tables are read whole along heads.

    >>> from relational_tensors.core.types import TensorType as T
    >>> RopeTableOp((T.zero((2, 8, 3, 4)), T.zero((1, 8, 4)), T.zero((1, 8, 4)))).signature()
    'd0 d1 d2 d3, 1 d1 d3, 1 d1 d3 -> d0 d1 d2 d3'
    """

    kind = "rope_table"
    inverse: bool = False

    def infer(self) -> TensorType:
        x, cos, sin = self.input_types
        if x.rank != 4:
            raise GraphError(f"rope_table takes x of shape [batch, seq, heads, d_head]; got rank {x.rank} shape "
                             f"{x.shape}.")
        if x.shape[3] % 2:
            raise GraphError(f"rope_table needs an even d_head to rotate its halves; got d_head={x.shape[3]} in "
                             f"{x.shape}.")
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"rope_table needs a floating tensor; got dtype {x.dtype}.")
        b, s, _, d = x.shape
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape not in ((b, s, d), (1, s, d)):
                raise GraphError(f"rope_table's {name} table has the shape [batch or 1, seq, d_head] of x "
                                 f"{x.shape}: {(b, s, d)} or {(1, s, d)}; got {t.shape}.  Move its heads axis "
                                 f"out first (a table broadcast over heads).")
            if t.dtype != x.dtype:
                raise GraphError(f"rope_table's {name} table has x's dtype {x.dtype}; got {t.dtype}.  Cast one "
                                 f"of them first.")
        return x

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        x, cos, sin = self.input_types
        names = x.names
        table = lambda t: (names[0] if t.shape[0] == x.shape[0] else None, names[1], names[3])  # noqa: E731
        return (names, table(cos), table(sin))

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names

    def unshardable(self) -> frozenset[str]:
        return frozenset({self.input_types[0].names[3]})

    def params(self) -> dict[str, object]:
        return {"inverse": self.inverse}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 3.0 * output.volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, cos, sin = (self._compute(a) for a in blocks)
        half = x.shape[3] // 2
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
        if self.inverse:
            y = (x1 * c1 + x2 * s2, x2 * c2 - x1 * s1)
        else:
            y = (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)
        return self._result(np.concatenate(y, axis=-1))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x, cos, sin = inputs
        dx = build(b, "rope_table", (cotangent, cos, sin), inverse=not self.inverse) if wanted[0] else None

        def over_heads(prod: Any, table: Any) -> Any:  # Σ over heads, summed back to the table's shape
            total = build(b, "reduce", (prod,), op="sum", axes=(2,))
            return reduce_to(b, total, table.type)

        def rotate_half(t: Any) -> Any:  # cat(−t₂, t₁)
            d = t.type.shape[3]
            lo = build(b, "slice", (t,), axis=3, start=0, stop=d // 2)
            hi = build(b, "slice", (t,), axis=3, start=d // 2, stop=d)
            return build(b, "concat", (build(b, "unary", (hi,), op="neg"), lo), axis=3)

        dcos = over_heads(build(b, "binary", (cotangent, x), op="mul"), cos) if wanted[1] else None
        dsin = None
        if wanted[2]:  # forward: Σ dy·rotate_half(x); inverse: Σ rotate_half(dy)·x
            prod = (build(b, "binary", (rotate_half(cotangent), x), op="mul") if self.inverse
                    else build(b, "binary", (cotangent, rotate_half(x)), op="mul"))
            dsin = over_heads(prod, sin)
        return dx, dcos, dsin

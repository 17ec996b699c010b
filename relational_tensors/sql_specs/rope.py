"""Rotary position embedding on x[batch, seq, heads, d_head], rotate-half convention.

out = cat(x1·cos − x2·sin, x2·cos + x1·sin), x1/x2 the halves of d_head and
angle = position · base^(−2i/d_head) (with ``freq_dtype``, the frequencies rounded to that dtype and the
angles computed in float32, as a module whose frequency buffer was cast to 16 bits computes them).
Positions come from the block's own
offset in the sequence (restarting at each packed-sequence start), so the
sequence index splits anywhere; d_head does not split.  The gradient is the
inverse rotation of the output's gradient (``inverse=True``: the angles negated).
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
from relational_tensors.sql_specs.base import Builder, Grads, SameIndicesOp, register
from relational_tensors.sql_specs.common import finite_number
from relational_tensors.sql_specs.grad import build
from relational_tensors.sql_specs.packing import check_seq_ends, sequence_bounds

__all__ = ["RopeOp", "rope_tables", "rounded_frequencies"]


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

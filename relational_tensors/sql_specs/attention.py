"""Scaled dot-product attention with grouped-query heads, causal masks and packed sequences.

q [batch, seq_q, heads_q, d_head], k [batch, seq_kv, heads_kv, d_head],
v [batch, seq_kv, heads_kv, d_v] -> out [batch, seq_q, heads_q, d_v].

Shardable indices, in declared order:

* ``batch``    anywhere;
* ``heads_kv`` anywhere; ``heads_q`` inherits it (kv head m owns query heads
  [m·g, (m+1)·g), g = heads_q / heads_kv);
* ``seq_q``    anywhere, or only at ``seq_ends`` for packed sequences.  A query
  block reads only the keys it can see: a causal block [r0, r1) needs keys
  [start(r0), r1); offered in equal lengths and, when causal, in equal work;
* ``seq_kv``   anywhere; partial outputs over disjoint key blocks carry their
  log-sum-exp and are combined by the ⊕ ``lse``.

The gradient is the FlashAttention backward, built from the operators of
``attention_grad``: the forward's log-sum-exp, Δ = rowsum(dO·O), dq, and dk with dv.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.aggregation import LSE
from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import ANY, FunctionSpec, ShardableIndex
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Choice, Grads, Operator, register
from relational_tensors.sql_specs.common import finite_number, same_dtype
from relational_tensors.sql_specs.grad import build
from relational_tensors.sql_specs.packing import check_seq_ends, sequence_bounds

__all__ = ["AttentionOp", "KV_GRADIENTS"]

# how the gradients of k and v are built: one "dkv" operator whose output holds dk and dv side by side (one
# pass over the scores, then two slices), or "separate" dk and dv operators (bench/attention_grad.py compares)
KV_GRADIENTS = {"mode": "packed"}

_ROW_CHUNK = 512  # query rows per NumPy step, to bound the score matrix


@register
@dataclass(frozen=True, eq=True)
class AttentionOp(Operator):
    """FlashAttention semantics with GQA, causal masking and packed sequences.

    >>> from relational_tensors.core.types import TensorType as T
    >>> q, kv = T.zero((1, 16, 8, 4)), T.zero((1, 16, 2, 4))
    >>> op = AttentionOp((q, kv, kv), causal=True)
    >>> [s.name for s in op.requestable()], op.spec({"heads_kv": op.shardable()[1].near_equal(2)}).p
    (['batch', 'heads_kv', 'seq_q', 'seq_kv'], 2)
    """

    kind = "attention"
    cost_family = "attention"
    aggregation = LSE
    causal: bool = False
    seq_ends: tuple[int, ...] | None = None
    scale: float | None = None

    # --- shape rules -------------------------------------------------------
    def infer(self) -> TensorType:
        if len(self.input_types) != 3:
            raise GraphError(f"attention takes q, k and v; got {len(self.input_types)} tensors.")
        q, k, v = self.input_types
        shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
        if not q.rank == k.rank == v.rank == 4:
            raise GraphError(f"attention takes rank-4 q, k, v as [batch, seq, heads, d_head]; got {shapes}.")
        if not (q.shape[0] == k.shape[0] == v.shape[0]):
            raise GraphError(f"attention needs one batch size for q, k and v; got {shapes}.")
        if k.shape[:3] != v.shape[:3]:
            raise GraphError(f"attention needs k and v with the same [batch, seq_kv, heads_kv]; got {shapes}.")
        if q.shape[3] != k.shape[3]:
            raise GraphError(f"attention needs q and k with the same d_head; got {shapes}.")
        hq, hkv = q.shape[2], k.shape[2]
        if hq % hkv:
            raise GraphError(
                f"attention needs heads_q to be a multiple of heads_kv (grouped-query attention); "
                f"got heads_q={hq}, heads_kv={hkv} ({shapes})."
            )
        if (self.causal or self.seq_ends is not None) and q.shape[1] != k.shape[1]:
            raise GraphError(
                f"causal or packed attention needs seq_q == seq_kv (self-attention); got {q.shape[1]} and {k.shape[1]}."
            )
        dtype = same_dtype(self.kind, self.input_types)
        if dtype not in FLOAT_DTYPES:
            raise GraphError(f"attention needs floating tensors; got dtype {dtype}.")
        check_seq_ends(self.kind, self.seq_ends, q.shape[1])
        if self.scale is not None:
            finite_number("attention scale", self.scale)
        return TensorType.zero((*q.shape[:3], v.shape[3]), dtype, q.names)

    @property
    def group(self) -> int:
        return self.input_types[0].shape[2] // self.input_types[1].shape[2]

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.input_types[0].shape[3])

    def signature(self) -> str:
        return ("batch seq_q heads_q d_head, batch seq_kv heads_kv d_head, batch seq_kv heads_kv d_v "
                "-> batch seq_q heads_q d_v")

    def params(self) -> dict[str, object]:
        return {"causal": self.causal, "seq_ends": self.seq_ends, "scale": self.softmax_scale}

    def shardable(self) -> tuple[ShardableIndex, ...]:
        q, k = self.input_types[:2]
        ends = self.seq_ends
        q_positions = ANY if ends is None else tuple(e for e in ends if e < q.shape[1])
        return (
            ShardableIndex("batch", q.shape[0]),
            ShardableIndex("heads_kv", k.shape[2]),
            ShardableIndex("heads_q", q.shape[2], inherits="heads_kv"),
            ShardableIndex("seq_q", q.shape[1], q_positions),
            ShardableIndex("seq_kv", k.shape[1]),
        )

    # --- which keys a query block sees ---------------------------------------
    def _key_limits(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per query row, the half-open range of keys it may attend to."""
        length = self.input_types[1].shape[1]
        lo, hi = sequence_bounds(rows, self.seq_ends, length)
        if self.causal:
            hi = np.minimum(hi, rows + 1)
        return lo, hi

    def key_range(self, rows: Interval) -> Interval:
        lo, hi = self._key_limits(np.array([rows.lo, rows.hi - 1]))
        return Interval(int(lo[0]), int(hi[1]))

    def _segments(self, rows: Interval) -> list[tuple[int, int, int, int]]:
        """The rows split by packed sequence: (r0, r1, seq_start, seq_end) per piece."""
        length = self.input_types[1].shape[1]
        if self.seq_ends is None:
            return [(rows.lo, rows.hi, 0, length)]
        out, start = [], 0
        for end in self.seq_ends:
            lo, hi = max(rows.lo, start), min(rows.hi, end)
            if lo < hi:
                out.append((lo, hi, start, end))
            start = end
        return out

    def row_work(self, rows: Interval, keys: Interval) -> int:
        """Visible (query, key) pairs between a query block and a key block, in closed form."""
        total = 0
        for r0, r1, a, b in self._segments(rows):
            lo = max(a, keys.lo)
            if not self.causal:
                total += (r1 - r0) * max(0, min(b, keys.hi) - lo)
                continue
            # row r sees keys [lo, min(r + 1, keys.hi)): none, then r + 1 - lo, then keys.hi - lo
            c1 = min(keys.hi, b)
            if c1 <= lo:
                continue
            ramp_lo, ramp_hi = max(r0, lo), min(r1, c1)
            if ramp_lo < ramp_hi:
                n = ramp_hi - ramp_lo
                total += n * (ramp_lo + 1 - lo) + n * (n - 1) // 2
            flat_lo = max(r0, c1)
            if flat_lo < r1:
                total += (r1 - flat_lo) * (c1 - lo)
        return total

    def interval_candidates(self, index: ShardableIndex, n: int) -> list[tuple[Interval, ...]]:
        cands = super().interval_candidates(index, n)
        if index.name != "seq_q" or not self.causal or not cands:
            return cands
        # equal causal work: cut where the running count of visible keys reaches k/n of the total
        length = index.extent
        keys = Interval(0, length)
        legal = np.array(list(index.legal_cuts()), dtype=np.int64)
        if self.seq_ends is None:
            cum = legal * (legal + 1) // 2  # work of rows [0, cut)
            total = length * (length + 1) // 2
        else:  # legal cuts are the few sequence ends
            cum = np.array([self.row_work(Interval(0, int(c)), keys) for c in legal], dtype=np.int64)
            total = self.row_work(Interval(0, length), keys)
        cuts, start = [0], 0
        for k in range(1, n):
            stop = len(legal) - (n - 1 - k)
            best = start + int(np.argmin(np.abs(cum[start:stop] - total * k / n)))
            cuts.append(int(legal[best]))
            start = best + 1
        cuts.append(length)
        work = tuple(Interval(a, b) for a, b in zip(cuts, cuts[1:]))
        return cands if work == cands[0] else [*cands, work]

    # --- boxes ------------------------------------------------------------------
    def _chosen(self, choice: Choice) -> tuple[Interval, Interval, Interval, Interval, Interval]:
        """The batch, kv heads, their query heads, query rows and keys of a choice, as requested."""
        q, k = self.input_types[:2]
        b = choice.get("batch", Interval(0, q.shape[0]))
        h = choice.get("heads_kv", Interval(0, k.shape[2]))
        g = self.group
        return (b, h, Interval(h.lo * g, h.hi * g), choice.get("seq_q", Interval(0, q.shape[1])),
                choice.get("seq_kv", Interval(0, k.shape[1])))

    def _parts(self, choice: Choice) -> tuple[Interval, Interval, Interval, Interval, Interval]:
        """``_chosen``, with the keys cut to those the query rows can see."""
        b, h, hq, rows, keys = self._chosen(choice)
        return b, h, hq, rows, keys.intersect(self.key_range(rows))

    def input_box(self, k: int, choice: Choice) -> Box:
        b, h, hq, rows, keys = self._parts(choice)
        t = self.input_types[k]
        if k == 0:
            return Box.from_intervals((b, rows, hq, Interval(0, t.shape[3])))
        return Box.from_intervals((b, keys, h, Interval(0, t.shape[3])))

    def output_box(self, choice: Choice) -> Box:
        b, _, hq, rows, _ = self._parts(choice)
        return Box.from_intervals((b, rows, hq, Interval(0, self.output_type.shape[3])))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        qb, kb, _ = inputs
        pairs = self.row_work(qb.interval(1), kb.interval(1))
        d, dv = self.input_types[0].shape[3], self.input_types[2].shape[3]
        return 2.0 * (d + dv) * pairs * qb.shape[0] * qb.shape[2]

    # --- concrete kernel --------------------------------------------------------
    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> tuple[np.ndarray, np.ndarray]:
        q, k, v = (self._compute(b) for b in blocks)
        qbox, kbox, _ = f.inputs
        nb, sq, hq, d = q.shape
        hkv, dv = k.shape[2], v.shape[3]
        g = hq // hkv if hkv else self.group
        out = np.zeros((nb, sq, hq, dv), dtype=q.dtype)
        lse = np.full((nb, sq, hq), -np.inf, dtype=q.dtype)
        if k.shape[1] == 0 or sq == 0:
            return out, lse
        cols = np.arange(kbox.lower[1], kbox.upper[1])
        qg = q.reshape(nb, sq, hkv, g, d)
        for r0 in range(0, sq, _ROW_CHUNK):
            r1 = min(sq, r0 + _ROW_CHUNK)
            rows = np.arange(qbox.lower[1] + r0, qbox.lower[1] + r1)
            lo, hi = self._key_limits(rows)
            visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])  # [rows, keys]
            s = np.einsum("bqhgd,bkhd->bhgqk", qg[:, r0:r1], k) * self.softmax_scale
            s = np.where(visible, s, -np.inf)
            top = s.max(axis=-1, keepdims=True)
            top = np.where(np.isfinite(top), top, 0.0)
            p = np.exp(s - top)
            total = p.sum(axis=-1, keepdims=True)
            o = np.einsum("bhgqk,bkhd->bqhgd", p / np.where(total > 0, total, 1.0), v)
            out[:, r0:r1] = o.reshape(nb, r1 - r0, hq, dv)
            seen = total[..., 0] > 0
            rows = np.where(seen, top[..., 0] + np.log(np.where(seen, total[..., 0], 1.0)), -np.inf)
            lse[:, r0:r1] = np.moveaxis(rows, 3, 1).reshape(nb, r1 - r0, hq)
        return out, lse

    # --- gradient -----------------------------------------------------------------
    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        q, k, v = inputs
        common = dict(causal=self.causal, seq_ends=self.seq_ends, scale=self.scale)
        lse = build(b, "attention_lse", (q, k), **common)
        delta = build(b, "attention_delta", (output, cotangent))
        operands = (q, k, v, cotangent, lse, delta)
        dq = build(b, "attention_grad", operands, part="dq", **common) if wanted[0] else None
        dk = dv = None
        if (wanted[1] and wanted[2]) and KV_GRADIENTS["mode"] == "packed":
            dkv = build(b, "attention_grad", operands, part="dkv", **common)
            d = k.type.shape[3]
            dk = build(b, "slice", (dkv,), axis=3, start=0, stop=d)
            dv = build(b, "slice", (dkv,), axis=3, start=d, stop=d + v.type.shape[3])
        else:
            dk = build(b, "attention_grad", operands, part="dk", **common) if wanted[1] else None
            dv = build(b, "attention_grad", operands, part="dv", **common) if wanted[2] else None
        return dq, dk, dv

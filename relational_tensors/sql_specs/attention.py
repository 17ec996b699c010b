"""Scaled dot-product attention with grouped-query heads, causal masks, sliding windows, packed
sequences, key padding, boolean masks and additive biases, for self- and cross-attention.

q [batch, seq_q, heads_q, d_head], k [batch, seq_kv, heads_kv, d_head],
v [batch, seq_kv, heads_kv, d_v] -> out [batch, seq_q, heads_q, d_v]; then, named by ``extras`` in
the order ``EXTRAS``, the optional inputs ``key_padding`` (bool [batch, seq_kv], True for a real key),
``mask`` (bool [batch or 1, heads_q or 1, seq_q, seq_kv], True where a query may see a key) and
``bias`` (float, the same broadcastable shape, added to the scaled scores: T5's relative bias, ALiBi).
With ``softcap`` c the scaled scores are first squashed to c · tanh(s / c) (Gemma 2's logit soft-capping);
a bias and the masks apply after it.

Which keys a query row r sees, before the masks: its position is r + offset, the offset being
seq_kv - seq_q when ``causal="bottom_right"`` (a query block after a key cache) and 0 otherwise
(``"top_left"``, PyTorch SDPA's alignment; ``True`` is the equal-length case).  A causal row sees the
keys up to its position; a ``window`` w keeps keys at distance < w (with causal: the w keys ending at
the position); packed ``seq_ends`` keep a row inside its sequence; ``key_lengths`` (static, per batch
row) and the masks cut further.  A row that sees no key gives 0 (as SDPA does) and log-sum-exp -inf.

Shardable indices, in declared order:

* ``batch``    anywhere;
* ``heads_kv`` anywhere; ``heads_q`` inherits it (kv head m owns query heads
  [m·g, (m+1)·g), g = heads_q / heads_kv);
* ``seq_q``    anywhere, or only at ``seq_ends`` for packed sequences.  A query
  block reads only the keys its rows' ranges can reach (a causal prefix, a window);
  offered in equal lengths and, when causal or windowed, in equal work;
* ``seq_kv``   anywhere; partial outputs over disjoint key blocks carry their
  log-sum-exp and are combined by the ⊕ ``lse``.

A mask or bias block is the projection of the query and key blocks (and of batch and query heads where
it is not broadcast); a key-padding block follows batch and keys.

The gradient is the FlashAttention backward, built from the operators of
``attention_grad``: the forward's log-sum-exp, Δ = rowsum(dO·O), dq, dk with dv, and the bias's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
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

__all__ = ["AttentionOp", "KV_GRADIENTS", "EXTRAS", "CAUSAL_MODES"]

# how the gradients of k and v are built: one "dkv" operator whose output holds dk and dv side by side (one
# pass over the scores, then two slices), or "separate" dk and dv operators (bench/attention_grad.py compares)
KV_GRADIENTS = {"mode": "packed"}

EXTRAS = ("key_padding", "mask", "bias")  # the optional inputs after q, k, v, in this order
CAUSAL_MODES = (False, True, "top_left", "bottom_right")

_ROW_CHUNK = 512  # query rows per NumPy step, to bound the score matrix


@lru_cache(maxsize=64)
def _all_limits(op: AttentionOp) -> tuple[np.ndarray, np.ndarray]:
    """Every query row's key range (an operator is hashable: its type and parameters)."""
    lo, hi = op._key_limits(np.arange(op.input_types[0].shape[1]))
    lo.setflags(write=False)
    hi.setflags(write=False)
    return lo, hi


@register
@dataclass(frozen=True, eq=True)
class AttentionOp(Operator):
    """FlashAttention semantics with GQA, causal masks, windows, packed sequences, key padding, masks and biases.

    >>> from relational_tensors.core.types import TensorType as T
    >>> q, kv = T.zero((1, 16, 8, 4)), T.zero((1, 16, 2, 4))
    >>> op = AttentionOp((q, kv, kv), causal=True)
    >>> [s.name for s in op.requestable()], op.spec({"heads_kv": op.shardable()[1].near_equal(2)}).p
    (['batch', 'heads_kv', 'seq_q', 'seq_kv'], 2)
    >>> AttentionOp((q, kv, kv), causal=True, window=4).key_range(Interval(8, 12))
    Interval(lo=5, hi=12)
    """

    kind = "attention"
    cost_family = "attention"
    aggregation = LSE
    accepts_bool = True  # its key padding and mask
    causal: bool | str = False
    seq_ends: tuple[int, ...] | None = None
    scale: float | None = None
    window: int | None = None
    key_lengths: tuple[int, ...] | None = None
    extras: tuple[str, ...] = ()
    softcap: float | None = None

    _MAIN = 3  # q, k, v come first; the extras follow

    # --- shape rules -------------------------------------------------------
    def infer(self) -> TensorType:
        if len(self.input_types) != 3 + len(self.extras):
            raise GraphError(f"attention takes q, k and v{self._extras_words()}; got {len(self.input_types)} "
                             "tensors.")
        q, k, v = self.input_types[:3]
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
        dtype = same_dtype(self.kind, self.input_types[:3])
        if dtype not in FLOAT_DTYPES:
            raise GraphError(f"attention needs floating tensors; got dtype {dtype}.")
        self._check_options(q.shape[0], q.shape[1], k.shape[1])
        if self.scale is not None:
            finite_number("attention scale", self.scale)
        if self.softcap is not None:
            finite_number("attention softcap (scores become softcap · tanh(scores / softcap))", self.softcap,
                          above=0)
        self._check_extras(self.input_types[self._MAIN:], q.shape[0], hq, q.shape[1], k.shape[1])
        return TensorType.zero((*q.shape[:3], v.shape[3]), dtype, q.names)

    def _extras_words(self) -> str:
        return "".join(f", {e}" for e in self.extras)

    def _check_options(self, batch: int, sq: int, skv: int) -> None:
        if not (self.causal is False or self.causal is True or self.causal in CAUSAL_MODES[2:]):
            raise GraphError(f"attention causal must be one of False, True, 'top_left' or 'bottom_right'; got "
                             f"{self.causal!r}.")
        if self.causal is True and sq != skv:
            raise GraphError(
                f"causal=True is the equal-length case; got seq_q={sq} and seq_kv={skv}. For cross-attention "
                "say where the queries sit: causal='top_left' (query i sees keys up to i, PyTorch SDPA's "
                "alignment) or causal='bottom_right' (the queries are the last seq_q positions, as when "
                "decoding after a key cache)."
            )
        if self.seq_ends is not None and sq != skv:
            raise GraphError(f"packed attention (seq_ends) needs seq_q == seq_kv (self-attention); got {sq} and "
                             f"{skv}.")
        check_seq_ends(self.kind, self.seq_ends, sq)
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise GraphError(f"attention window must be a positive integer (keys at distance >= window are "
                             f"masked); got {self.window!r}.")
        if self.key_lengths is not None:
            lens = self.key_lengths
            if (len(lens) != batch or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= skv
                                          for n in lens)):
                raise GraphError(f"attention key_lengths must give one length in [0, {skv}] per batch row "
                                 f"({batch} rows); got {list(lens)}.")
        bad = [e for e in self.extras if e not in EXTRAS]
        if bad or len(set(self.extras)) != len(self.extras) or \
                list(self.extras) != [e for e in EXTRAS if e in self.extras]:
            raise GraphError(f"attention extras must name distinct inputs among {EXTRAS}, in that order; got "
                             f"{self.extras!r}.")
        if "key_padding" in self.extras and self.key_lengths is not None:
            raise GraphError("attention takes key padding as a boolean tensor or as key_lengths, not both.")

    def _check_extras(self, types: Sequence[TensorType], batch: int, hq: int, sq: int, skv: int) -> None:
        for name, t in zip(self.extras, types):
            if name == "key_padding":
                if t.dtype != "bool" or t.shape != (batch, skv):
                    raise GraphError(f"attention key_padding must be a boolean [batch, seq_kv] = [{batch}, {skv}] "
                                     f"tensor (True marks a real key, as HF's attention_mask); got {t.dtype} "
                                     f"{t.shape}. Compare an integer mask first: g.binary(m, one, 'equal').")
                continue
            want = "boolean" if name == "mask" else "floating"
            ok_dtype = t.dtype == "bool" if name == "mask" else t.dtype in FLOAT_DTYPES
            if (not ok_dtype or t.rank != 4 or t.shape[0] not in (1, batch) or t.shape[1] not in (1, hq)
                    or t.shape[2:] != (sq, skv)):
                raise GraphError(
                    f"attention {name} must be a {want} tensor of shape [batch or 1, heads_q or 1, seq_q, seq_kv] "
                    f"= [{batch} or 1, {hq} or 1, {sq}, {skv}] (heads are query heads); got {t.dtype} {t.shape}. "
                    "Reshape or expand it to that rank-4 form."
                )

    @property
    def is_causal(self) -> bool:
        return self.causal is not False

    @property
    def offset(self) -> int:
        """Where query row 0 sits among the keys: seq_kv - seq_q when aligned bottom-right, else 0."""
        if self.causal != "bottom_right":
            return 0
        return self.input_types[1].shape[1] - self.input_types[0].shape[1]

    @property
    def ranged(self) -> bool:
        """Whether a row's keys are its sequence's, cut at most by a top-left causal prefix (closed forms)."""
        return self.offset == 0 and self.window is None

    @property
    def group(self) -> int:
        return self.input_types[0].shape[2] // self.input_types[1].shape[2]

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.input_types[0].shape[3])

    def signature(self) -> str:
        extra = {"key_padding": ", batch seq_kv", "mask": ", batch heads_q seq_q seq_kv",
                 "bias": ", batch heads_q seq_q seq_kv"}
        return ("batch seq_q heads_q d_head, batch seq_kv heads_kv d_head, batch seq_kv heads_kv d_v"
                + "".join(extra[e] for e in self.extras) + " -> batch seq_q heads_q d_v")

    def params(self) -> dict[str, object]:
        out: dict[str, object] = {"causal": self.causal, "seq_ends": self.seq_ends, "scale": self.softmax_scale}
        for name in ("window", "key_lengths", "softcap"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.extras:
            out["extras"] = self.extras
        return out

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
        """Per query row, the half-open range of keys it may attend to (before key padding and masks);
        both ends are non-decreasing in the row, and lo <= hi."""
        length = self.input_types[1].shape[1]
        if self.seq_ends is None:
            lo, hi = np.zeros_like(rows), np.full_like(rows, length)
        else:
            lo, hi = sequence_bounds(rows, self.seq_ends, length)
        pos = rows + self.offset
        if self.is_causal:
            hi = np.minimum(hi, pos + 1)
        if self.window is not None:
            lo = np.maximum(lo, pos - self.window + 1)
            if not self.is_causal:
                hi = np.minimum(hi, pos + self.window)
        lo = np.clip(lo, 0, length)
        return lo, np.clip(hi, lo, length)

    def key_range(self, rows: Interval) -> Interval:
        if rows.size == 0:
            return Interval(0, 0)
        lo, hi = _all_limits(self)  # every row's range, once per operator
        first = int(lo[rows.lo])
        return Interval(first, max(int(hi[rows.hi - 1]), first))

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
        """Visible (query, key) pairs between a query block and a key block (before key padding and masks)."""
        if not self.ranged:
            starts, ends = _all_limits(self)
            starts, ends = starts[rows.lo:rows.hi], ends[rows.lo:rows.hi]
            return int(np.maximum(0, np.minimum(ends, keys.hi) - np.maximum(starts, keys.lo)).sum())
        total = 0  # in closed form
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
        if index.name != "seq_q" or not (self.is_causal or self.window is not None) or not cands:
            return cands
        # equal work: cut where the running count of visible keys reaches k/n of the total
        length = index.extent
        keys = Interval(0, self.input_types[1].shape[1])
        legal = np.array(list(index.legal_cuts()), dtype=np.int64)
        if self.seq_ends is None and self.ranged and length == keys.hi:
            cum = legal * (legal + 1) // 2  # work of rows [0, cut)
            total = length * (length + 1) // 2
        elif self.seq_ends is not None and self.ranged:  # legal cuts are the few sequence ends
            cum = np.array([self.row_work(Interval(0, int(c)), keys) for c in legal], dtype=np.int64)
            total = self.row_work(Interval(0, length), keys)
        else:
            lo, hi = _all_limits(self)
            run = np.concatenate(([0], np.cumsum(hi - lo)))
            cum, total = run[legal], int(run[-1])
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

    def _extra_box(self, name: str, t: TensorType, b: Interval, hq: Interval, rows: Interval,
                   keys: Interval) -> Box:
        """The block of a key padding, mask or bias that a function spec reads (a broadcast dimension whole)."""
        if name == "key_padding":
            return Box.from_intervals((b, keys))
        one = Interval(0, 1)
        return Box.from_intervals((b if t.shape[0] > 1 else one, hq if t.shape[1] > 1 else one, rows, keys))

    def _box_of(self, k: int, parts: tuple[Interval, ...]) -> Box:
        b, h, hq, rows, keys = parts
        t = self.input_types[k]
        if k >= self._MAIN:
            return self._extra_box(self.extras[k - self._MAIN], t, b, hq, rows, keys)
        if k == 0:
            return Box.from_intervals((b, rows, hq, Interval(0, t.shape[3])))
        return Box.from_intervals((b, keys, h, Interval(0, t.shape[3])))

    def input_box(self, k: int, choice: Choice) -> Box:
        return self._box_of(k, self._parts(choice))

    def _output_of(self, parts: tuple[Interval, ...]) -> Box:
        b, _, hq, rows, _ = parts
        return Box.from_intervals((b, rows, hq, Interval(0, self.output_type.shape[3])))

    def output_box(self, choice: Choice) -> Box:
        return self._output_of(self._parts(choice))

    def box_maker(self) -> Callable[[Choice], tuple[tuple[Box, ...], Box]]:
        if type(self).input_box is not AttentionOp.input_box or type(self).output_box is not AttentionOp.output_box:
            return super().box_maker()  # the lse and gradient operators have blocks of their own
        n = len(self.input_types)

        def boxes(choice: Choice) -> tuple[tuple[Box, ...], Box]:
            parts = self._parts(choice)  # once for every block of the choice
            return tuple(self._box_of(k, parts) for k in range(n)), self._output_of(parts)
        return boxes

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        qb, kb = inputs[0], inputs[1]
        pairs = self.row_work(qb.interval(1), kb.interval(1))
        d, dv = self.input_types[0].shape[3], self.input_types[2].shape[3]
        return 2.0 * (d + dv) * pairs * qb.shape[0] * qb.shape[2]

    # --- concrete kernel --------------------------------------------------------
    def _extra_blocks(self, blocks: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.extras, blocks[self._MAIN:]))

    def chunk_scores(self, qg: np.ndarray, k: np.ndarray, extra: dict[str, np.ndarray], qbox: Box, kbox: Box,
                     r0: int, r1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The scaled (and soft-capped) scores plus bias [b, hkv, g, rows, keys] of the block's rows [r0, r1)
        (qg as [b, rows, hkv, g, d]), where each is visible (broadcastable to the scores), and with a
        softcap the derivative of the capped scores in the scaled ones, 1 - tanh², for the gradient (else
        None)."""
        rows = np.arange(qbox.lower[1] + r0, qbox.lower[1] + r1)
        cols = np.arange(kbox.lower[1], kbox.upper[1])
        lo, hi = self._key_limits(rows)
        ranges = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        if self.key_lengths is not None:
            lengths = np.asarray(self.key_lengths)[qbox.lower[0]:qbox.upper[0]]
            ranges = ranges[None] & (cols[None, :] < lengths[:, None])[:, None, :]
        else:
            ranges = ranges[None]
        visible = ranges[:, None, None]  # [b|1, 1, 1, rows, keys]
        if "key_padding" in extra:
            visible = visible & extra["key_padding"].astype(bool)[:, None, None, None, :]
        if "mask" in extra:
            visible = visible & self._grouped(extra["mask"][:, :, r0:r1].astype(bool))
        s = np.einsum("bqhgd,bkhd->bhgqk", qg, k) * self.softmax_scale
        slope = None
        if self.softcap is not None:
            t = np.tanh(s / self.softcap)
            s, slope = self.softcap * t, 1.0 - t * t
        if "bias" in extra:
            s = s + self._grouped(extra["bias"][:, :, r0:r1].astype(s.dtype))
        return s, visible, slope

    def _grouped(self, m: np.ndarray) -> np.ndarray:
        """A mask or bias block [b|1, heads_q|1, rows, keys] as [b|1, hkv|1, g|1, rows, keys]."""
        if m.shape[1] == 1:
            return m[:, :, None]
        g = self.group
        return m.reshape(m.shape[0], m.shape[1] // g, g, *m.shape[2:])

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> tuple[np.ndarray, np.ndarray]:
        """(out, lse) of a function spec from its blocks, the scores of a chunk of rows at a time (one chunk
        of scores in memory), q, k and v in the compute dtype."""
        q, k, v = (self._compute(b) for b in blocks[:3])
        extra = {name: np.asarray(b) for name, b in self._extra_blocks(blocks).items()}
        qbox, kbox = f.inputs[0], f.inputs[1]
        nb, sq, hq, d = q.shape
        hkv, dv = k.shape[2], v.shape[3]
        g = hq // hkv if hkv else self.group
        out = np.zeros((nb, sq, hq, dv), dtype=q.dtype)
        lse = np.full((nb, sq, hq), -np.inf, dtype=q.dtype)
        if k.shape[1] == 0 or sq == 0:
            return out, lse
        qg = q.reshape(nb, sq, hkv, g, d)
        for r0 in range(0, sq, _ROW_CHUNK):
            r1 = min(sq, r0 + _ROW_CHUNK)
            s, visible, _ = self.chunk_scores(qg[:, r0:r1], k, extra, qbox, kbox, r0, r1)
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
    def options(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this attention's key visibility in its gradient operators."""
        return dict(causal=self.causal, seq_ends=self.seq_ends, scale=self.scale, window=self.window,
                    key_lengths=self.key_lengths, extras=self.extras, softcap=self.softcap)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        q, k, v = inputs[:3]
        extra = tuple(inputs[3:])
        common = self.options()
        lse = build(b, "attention_lse", (q, k, *extra), **common)
        delta = build(b, "attention_delta", (output, cotangent))
        operands = (q, k, v, cotangent, lse, delta, *extra)
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
        rest: list[Any] = []
        for name, w in zip(self.extras, wanted[3:]):  # key padding and masks are boolean: no gradient
            rest.append(build(b, "attention_grad", operands, part="dbias", **common) if w and name == "bias"
                        else None)
        return (dq, dk, dv, *rest)

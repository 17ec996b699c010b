"""The FlashAttention backward as join-agg operators: the log-sum-exp of the forward, the row dot
products Δ = rowsum(dO·O), and the gradients dq, dk, dv.

Each is an operator of its own with one output that shares its inputs with the others (the paper's
multi-output operator is not needed): ``attention_lse`` (q, k), ``attention_delta`` (o, dO) and
``attention_grad`` (q, k, v, dO, lse, Δ) with ``part`` one of ``dq``, ``dk``, ``dv``, ``dkv`` (dk and dv
side by side on the last axis, one pass over the scores, then sliced apart) or ``dbias`` (the score
gradient summed over the bias's broadcast dimensions).  The forward's key padding, mask and bias
follow each of them as extra inputs, split as the forward splits them.

* ``attention_lse`` splits like the forward: batch, kv heads (query heads inherit), query blocks
  (a causal block reads its key prefix), and keys, whose partial log-sum-exps are merged by ⊕ =
  logsumexp.  It is kept in float32 for 16-bit inputs, as FlashAttention keeps it.
* ``dq`` splits like the forward; its partials over key blocks are ⊕-summed.
* ``dk``/``dv``/``dkv`` split over batch, kv heads and key blocks (a key block reads only the queries
  that can see it: under a causal mask the rows from its first key on); their partials over query
  blocks are ⊕-summed, and dk, dv of a kv head sum over the query heads of its group (GQA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.aggregation import LOGSUMEXP, SUM
from relational_tensors.core.dtypes import FLOAT_DTYPES, compute_dtype
from relational_tensors.core.spec import FunctionSpec, ShardableIndex
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.attention import AttentionOp, _all_limits
from relational_tensors.sql_specs.base import Builder, Choice, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import same_dtype
from relational_tensors.sql_specs.grad import SECOND_ORDER
from relational_tensors.sql_specs.packing import sequence_bounds

__all__ = ["AttentionLseOp", "AttentionDeltaOp", "AttentionGradOp", "GRAD_PARTS"]

_ROW_CHUNK = 256  # query rows per NumPy step, to bound the score matrix
GRAD_PARTS = ("dq", "dk", "dv", "dkv", "dbias")


def _stat_dtype(dtype: str) -> str:
    """The dtype of a row statistic (log-sum-exp, Δ) of ``dtype`` attention: float32 for 16-bit floats, as
    FlashAttention keeps them (their range is the scores', not a sum's), the dtype itself otherwise."""
    return str(compute_dtype(dtype)) if dtype in FLOAT_DTYPES else dtype


def _check_qk(kind: str, q: TensorType, k: TensorType) -> None:
    if not (q.rank == k.rank == 4 and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]):
        raise GraphError(f"{kind} takes q [batch, seq_q, heads_q, d] and k [batch, seq_kv, heads_kv, d]; got "
                         f"q {q.shape}, k {k.shape}.")
    if q.shape[2] % k.shape[2]:
        raise GraphError(f"{kind} needs heads_q to be a multiple of heads_kv; got q {q.shape}, k {k.shape}.")
    if q.dtype not in FLOAT_DTYPES:
        raise GraphError(f"{kind} needs floating tensors; got dtype {q.dtype}.")


@register
@dataclass(frozen=True, eq=True)
class AttentionLseOp(AttentionOp):
    """``lse[b, r, h] = log Σ_visible exp(scale · q·k)``, the log-sum-exp of attention's scores.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = AttentionLseOp((T.zero((1, 16, 8, 4)), T.zero((1, 16, 2, 4))), causal=True)
    >>> op.output_type.shape, str(op.aggregation)
    ((1, 16, 8), 'logsumexp')
    """

    kind = "attention_lse"
    aggregation = LOGSUMEXP
    gradient = "an auxiliary of the attention gradient"
    _MAIN = 2

    def infer(self) -> TensorType:
        if len(self.input_types) != 2 + len(self.extras):
            raise GraphError(f"attention_lse takes q and k{self._extras_words()}; got {len(self.input_types)} "
                             "tensors.")
        q, k = self.input_types[:2]
        _check_qk(self.kind, q, k)
        self._check_options(q.shape[0], q.shape[1], k.shape[1])
        self._check_extras(self.input_types[2:], q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        return TensorType.zero(q.shape[:3], _stat_dtype(q.dtype), q.names[:3])

    def signature(self) -> str:
        return "batch seq_q heads_q d_head, batch seq_kv heads_kv d_head -> batch seq_q heads_q"

    def output_box(self, choice: Choice) -> Box:
        b, _, hq, rows, _ = self._parts(choice)
        return Box.from_intervals((b, rows, hq))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        qb, kb = inputs[0], inputs[1]
        return 2.0 * self.input_types[0].shape[3] * self.row_work(qb.interval(1), kb.interval(1)) * qb.shape[0] \
            * qb.shape[2]

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> Any:
        q, k = (np.asarray(b).astype(np.float64 if self.output_type.dtype == "float64" else np.float32)
                for b in blocks[:2])
        extra = {name: np.asarray(b) for name, b in self._extra_blocks(blocks).items()}
        qbox, kbox = f.inputs[0], f.inputs[1]
        nb, sq, hq, d = q.shape
        hkv = k.shape[2]
        g = self.group
        lse = np.full((nb, sq, hq), -np.inf, dtype=q.dtype)
        if k.shape[1] and sq:
            qg = q.reshape(nb, sq, hkv, g, d)
            for r0 in range(0, sq, _ROW_CHUNK):
                r1 = min(sq, r0 + _ROW_CHUNK)
                s, visible, _ = self.chunk_scores(qg[:, r0:r1], k, extra, qbox, kbox, r0, r1)
                s = np.where(visible, s, -np.inf)
                top = s.max(axis=-1, keepdims=True)
                safe = np.where(np.isfinite(top), top, 0.0)
                total = np.exp(s - safe).sum(axis=-1, keepdims=True)
                rows = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)[..., 0]
                lse[:, r0:r1] = np.moveaxis(rows, 3, 1).reshape(nb, r1 - r0, hq)
        return self._result(lse)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        return super(AttentionOp, self).vjp(b, inputs, output, cotangent, wanted)


@register
@dataclass(frozen=True, eq=True)
class AttentionDeltaOp(IndexedOp):
    """``Δ[b, r, h] = Σ_d dO·O``, the row dot products of the attention backward (float32 for 16-bit inputs).

    >>> from relational_tensors.core.types import TensorType as T
    >>> AttentionDeltaOp((T.zero((1, 16, 8, 4)),) * 2).signature()
    'd0 d1 d2 d3, d0 d1 d2 d3 -> d0 d1 d2'
    """

    kind = "attention_delta"
    gradient = "an auxiliary of the attention gradient"

    def infer(self) -> TensorType:
        o, do = self.input_types
        if o.rank != 4 or o.shape != do.shape:
            raise GraphError(f"attention_delta takes o and dO of one shape [batch, seq, heads, d_v]; got {o.shape}, "
                             f"{do.shape}.")
        dtype = same_dtype(self.kind, self.input_types)
        return TensorType.zero(o.shape[:3], _stat_dtype(dtype), o.names[:3])

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        names = self.input_types[0].names
        return (names, names)

    def dims_out(self) -> tuple[str | None, ...]:
        return self.input_types[0].names[:3]

    def unshardable(self) -> frozenset[str]:
        # Δ of 16-bit attention is a row's one sum, as in the reference: dS = P∘(dP − Δ) cancels exactly where
        # dP and Δ are equal, so Δ's float32 partials added in another order (one ulp at 2**35 is 4096)
        # would turn the reference's 0 into thousands in dq and dk
        return frozenset(self.input_types[0].names[3:]) if self._sixteen_bit() else frozenset()

    def _sixteen_bit(self) -> bool:
        return self.input_types[0].dtype in ("float16", "bfloat16")

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 2.0 * inputs[0].volume

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        # float64, rounded once: the products of 16-bit values are exact, so a row's Δ is the same
        # float32 whatever order a kernel (or a block's shape) adds them in
        o, do = (np.asarray(b).astype(np.float64 if self.output_type.dtype == "float64" or self._sixteen_bit()
                                      else np.float32) for b in blocks)
        return self._result(np.einsum("bshd,bshd->bsh", o, do))


@register
@dataclass(frozen=True, eq=True)
class AttentionGradOp(AttentionOp):
    """dq, dk, dv (or dk and dv side by side) of attention from q, k, v, dO, lse and Δ.

    >>> from relational_tensors.core.types import TensorType as T
    >>> q, kv, st = T.zero((1, 16, 8, 4)), T.zero((1, 16, 2, 4)), T.zero((1, 16, 8))
    >>> op = AttentionGradOp((q, kv, kv, q, st, st), causal=True, part="dkv")
    >>> op.output_type.shape, [s.name for s in op.requestable()]
    ((1, 16, 2, 8), ['batch', 'heads_kv', 'seq_kv', 'seq_q'])
    """

    kind = "attention_grad"
    aggregation = SUM
    gradient = SECOND_ORDER
    part: str = "dq"
    _MAIN = 6

    def infer(self) -> TensorType:
        if len(self.input_types) != 6 + len(self.extras):
            raise GraphError(f"attention_grad takes q, k, v, dO, lse and delta{self._extras_words()}; got "
                             f"{len(self.input_types)} tensors.")
        if self.part not in GRAD_PARTS:
            raise GraphError(f"attention_grad part must be one of {GRAD_PARTS}; got {self.part!r}.")
        q, k, v, do, lse, delta = self.input_types[:6]
        _check_qk(self.kind, q, k)
        self._check_options(q.shape[0], q.shape[1], k.shape[1])
        self._check_extras(self.input_types[6:], q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        same_dtype(self.kind, (q, k, v, do))
        if v.shape[:3] != k.shape[:3] or do.shape != (*q.shape[:3], v.shape[3]):
            raise GraphError(f"attention_grad needs v [batch, seq_kv, heads_kv, d_v] and dO [batch, seq_q, heads_q, "
                             f"d_v]; got q {q.shape}, k {k.shape}, v {v.shape}, dO {do.shape}.")
        if lse.shape != q.shape[:3] or delta.shape != q.shape[:3]:
            raise GraphError(f"attention_grad needs lse and delta of shape {q.shape[:3]}; got {lse.shape}, "
                             f"{delta.shape}.")
        if self.part == "dq":
            return q
        if self.part == "dbias":
            if "bias" not in self.extras:
                raise GraphError("attention_grad part 'dbias' needs the forward's bias among its inputs.")
            return self.input_types[6 + self.extras.index("bias")]
        width = {"dk": k.shape[3], "dv": v.shape[3], "dkv": k.shape[3] + v.shape[3]}[self.part]
        return TensorType.zero((*k.shape[:3], width), q.dtype, k.names)

    def signature(self) -> str:
        ins = "q, k, v, dO, lse, delta"
        return f"{ins} -> d{'q' if self.part == 'dq' else self.part[1:]}"

    def params(self) -> dict[str, object]:
        return {**super().params(), "part": self.part}

    @property
    def _by_keys(self) -> bool:
        return self.part not in ("dq", "dbias")

    def shardable(self) -> tuple[ShardableIndex, ...]:
        found = super().shardable()
        if not self._by_keys:
            return found
        batch, heads_kv, heads_q, seq_q, seq_kv = found  # dk, dv: blocks of keys, partial sums over query blocks
        return batch, heads_kv, heads_q, ShardableIndex("seq_kv", seq_kv.extent, seq_q.positions), \
            ShardableIndex("seq_q", seq_q.extent, seq_q.positions)

    def query_range(self, keys: Interval) -> Interval:
        """The query rows that can see some key of ``keys``."""
        length = self.input_types[0].shape[1]
        if keys.size == 0:
            return Interval(0, 0)
        if not self.ranged or length != self.input_types[1].shape[1]:
            # the rows whose ranges (non-decreasing at both ends) meet the keys
            lo, hi = _all_limits(self)
            first = int(np.searchsorted(hi, keys.lo, side="right"))
            return Interval(first, max(first, int(np.searchsorted(lo, keys.hi, side="left"))))
        start, end = sequence_bounds(np.array([keys.lo, keys.hi - 1]), self.seq_ends, length)
        return Interval(min(keys.lo, length) if self.causal else int(start[0]), int(end[1]))

    def _parts(self, choice: Choice) -> tuple[Interval, Interval, Interval, Interval, Interval]:
        if self.part == "dbias":  # every score of the block, visible or not, is written
            return self._chosen(choice)
        if not self._by_keys:
            return super()._parts(choice)
        b, h, hq, rows, keys = self._chosen(choice)  # blocks of keys: the query rows cut to those that see them
        return b, h, hq, rows.intersect(self.query_range(keys)), keys

    def input_box(self, k: int, choice: Choice) -> Box:
        b, h, hq, rows, keys = self._parts(choice)
        t = self.input_types[k]
        if k >= self._MAIN:
            return self._extra_box(self.extras[k - self._MAIN], t, b, hq, rows, keys)
        if k in (1, 2):
            return Box.from_intervals((b, keys, h, Interval(0, t.shape[3])))
        if k in (0, 3):
            return Box.from_intervals((b, rows, hq, Interval(0, t.shape[3])))
        return Box.from_intervals((b, rows, hq))

    def output_box(self, choice: Choice) -> Box:
        width = Interval(0, self.output_type.shape[3])
        b, h, hq, rows, keys = self._parts(choice)
        if self.part == "dbias":
            return self._extra_box("bias", self.output_type, b, hq, rows, keys)
        if self._by_keys:
            return Box.from_intervals((b, keys, h, width))
        return Box.from_intervals((b, rows, hq, width))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        qb, kb = inputs[0], inputs[1]
        pairs = self.row_work(qb.interval(1), kb.interval(1)) * qb.shape[0] * qb.shape[2]
        d, dv = self.input_types[0].shape[3], self.input_types[2].shape[3]
        # scores, dP = dO·vᵀ, then dq = dS·k; dk = dSᵀ·q; dv = Pᵀ·dO
        per = {"dq": 2 * d + dv, "dk": 2 * d + dv, "dv": d + dv, "dkv": 2 * d + 2 * dv,
               "dbias": d + dv}[self.part]
        return 2.0 * per * pairs

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> Any:
        work = np.float64 if self.output_type.dtype == "float64" else np.float32
        q, k, v, do, lse, delta = (np.asarray(x).astype(work) for x in blocks[:6])
        extra = {name: np.asarray(b) for name, b in self._extra_blocks(blocks).items()}
        qbox, kbox = f.inputs[0], f.inputs[1]
        nb, sq, hq, d = q.shape
        hkv, dv_width = k.shape[2], v.shape[3]
        g = self.group
        dq = np.zeros(q.shape, dtype=work)
        dk = np.zeros(k.shape, dtype=work)
        dv = np.zeros(v.shape, dtype=work)
        dbias = np.zeros(f.output.shape if self.part == "dbias" else (0,), dtype=work)
        if k.shape[1] and sq:
            qg, dog = q.reshape(nb, sq, hkv, g, d), do.reshape(nb, sq, hkv, g, dv_width)
            lse_g = np.moveaxis(lse.reshape(nb, sq, hkv, g), 1, 3)  # [b, h, g, q]
            delta_g = np.moveaxis(delta.reshape(nb, sq, hkv, g), 1, 3)
            for r0 in range(0, sq, _ROW_CHUNK):
                r1 = min(sq, r0 + _ROW_CHUNK)
                s, visible, slope = self.chunk_scores(qg[:, r0:r1], k, extra, qbox, kbox, r0, r1)
                top = lse_g[..., r0:r1, None]
                live = visible & np.isfinite(top)  # exponents of masked scores never computed: no overflow
                p = np.exp(np.where(live, s - np.where(np.isfinite(top), top, 0.0), -np.inf))
                if self.part in ("dv", "dkv"):
                    dv += np.einsum("bhgqk,bqhgd->bkhd", p, dog[:, r0:r1])
                if self.part == "dv":
                    continue
                dp = np.einsum("bqhgd,bkhd->bhgqk", dog[:, r0:r1], v)
                ds = p * (dp - delta_g[..., r0:r1, None])  # the gradient of the (scaled, biased) scores
                if self.part == "dbias":
                    dbias[:, :, r0:r1] += self._ungrouped(ds, dbias.shape)
                    continue
                ds = ds * self.softmax_scale if slope is None else ds * slope * self.softmax_scale
                if self.part == "dq":
                    dq[:, r0:r1] = np.einsum("bhgqk,bkhd->bqhgd", ds, k).reshape(nb, r1 - r0, hq, d)
                else:
                    dk += np.einsum("bhgqk,bqhgd->bkhd", ds, qg[:, r0:r1])
        out = {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias}.get(self.part)
        return self._result(np.concatenate((dk, dv), axis=-1) if out is None else out)

    @staticmethod
    def _ungrouped(ds: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Score gradients [b, hkv, g, rows, keys] summed to a bias block [b|1, heads_q|1, rows, keys]."""
        nb, hkv, g, rows, keys = ds.shape
        full = ds.reshape(nb, hkv * g, rows, keys)
        return full.sum(axis=tuple(d for d in (0, 1) if shape[d] == 1 and full.shape[d] != 1), keepdims=True)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        return super(AttentionOp, self).vjp(b, inputs, output, cotangent, wanted)

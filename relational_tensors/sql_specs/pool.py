"""Max and average pooling over windows of x [batch, channels, *spatial] (1 to 3 spatial dimensions),
PyTorch's arithmetic (kernel, stride, zero padding; an average counts the padding unless
``count_include_pad=False``; max pooling pads with -inf).  ``ceil_mode`` rounds the output length up, as
PyTorch does: a last window may run past the padding (never starting in the right padding), and an
average counting the padding divides by the part of its window inside the padded input.

Every index splits anywhere: ``batch``, ``channels``, and each output spatial dimension ``o0..``, whose
block reads the input rows its windows cover (halos, as a convolution's).  Nothing is aggregated.

The gradient is ``pool_grad``: for max, each window's gradient goes to its first largest input
(torch's choice among ties), recomputed from x; for average, spread evenly over the window.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import FunctionSpec, ShardableIndex
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Choice, Grads, Operator, register
from relational_tensors.sql_specs.conv import _lead2, input_window, output_range
from relational_tensors.sql_specs.grad import SECOND_ORDER, build

__all__ = ["PoolOp", "PoolGradOp", "POOLS"]

POOLS = ("max", "avg")


@dataclass(frozen=True, eq=True)
class _Windows(Operator):
    op: str = "max"
    kernel_size: tuple[int, ...] = (2,)
    stride: tuple[int, ...] = (2,)
    padding: tuple[int, ...] = (0,)
    count_include_pad: bool = True
    ceil_mode: bool = False

    def _x(self) -> tuple[int, ...]:
        return self.input_types[0].shape

    @property
    def rank(self) -> int:
        return len(self._x()) - 2

    def _out_sizes(self) -> tuple[int, ...]:
        x = self._x()
        out = []
        for i in range(self.rank):
            size, k, s, p = x[2 + i], self.kernel_size[i], self.stride[i], self.padding[i]
            n = (size + 2 * p - k + (s - 1 if self.ceil_mode else 0)) // s + 1
            if self.ceil_mode and (n - 1) * s >= size + p:  # the last window would start in the right padding
                n -= 1
            out.append(n)
        return tuple(out)

    def _check(self, x: TensorType) -> None:
        if self.op not in POOLS:
            raise GraphError(f"pool op must be one of {POOLS}; got {self.op!r}.")
        if x.rank not in (3, 4, 5):
            raise GraphError(f"pool takes x [batch, channels, *spatial] with 1 to 3 spatial dimensions; got {x.shape}.")
        if x.dtype not in FLOAT_DTYPES:
            raise GraphError(f"pool needs a floating tensor; got dtype {x.dtype}.")
        r = x.rank - 2
        for name, vals, least in (("kernel_size", self.kernel_size, 1), ("stride", self.stride, 1),
                                  ("padding", self.padding, 0)):
            if len(vals) != r or any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in vals):
                raise GraphError(f"pool {name} must give one integer >= {least} per spatial dimension ({r}); got "
                                 f"{vals!r}.")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise GraphError(f"pool padding must be at most half the kernel (PyTorch's rule); got padding "
                             f"{self.padding} for kernel {self.kernel_size}.")
        if any(o < 1 for o in self._out_sizes()):
            raise GraphError(f"pool of x {x.shape} with kernel {self.kernel_size} has no output position.")

    def params(self) -> dict[str, object]:
        return {"op": self.op, "kernel_size": self.kernel_size, "stride": self.stride, "padding": self.padding,
                "count_include_pad": self.count_include_pad, "ceil_mode": self.ceil_mode}

    def _windows(self, outs: Sequence[Interval]) -> list[Interval]:
        x = self._x()
        return [input_window(o, self.kernel_size[i], self.stride[i], self.padding[i], 1, x[2 + i])
                for i, o in enumerate(outs)]

    def _offsets(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(k) for k in self.kernel_size)))

    def _taps(self, kk: tuple[int, ...], n_out: Sequence[int]) -> tuple[slice, ...]:
        return _lead2(slice(k, k + (n - 1) * s + 1, s) for k, s, n in zip(kk, self.stride, n_out))

    def _padded(self, x: np.ndarray, box: Box, outs: Sequence[Interval], fill: float) -> tuple[np.ndarray, list]:
        """x's block padded to the rows its outputs read, and the (before, after) widths per dimension."""
        widths = [(0, 0), (0, 0)]
        for i, o in enumerate(outs):
            k, s, p = self.kernel_size[i], self.stride[i], self.padding[i]
            need_lo, need_hi = o.lo * s - p, (o.hi - 1) * s - p + k
            lo, hi = box.lower[2 + i], box.upper[2 + i]
            widths.append((lo - need_lo, need_hi - hi))
        return np.pad(x, widths, constant_values=fill), widths

    def _counts(self, outs: Sequence[Interval]) -> np.ndarray:
        """Per output position, how many inputs its window averages: its part inside the padded input
        (counting the padding: the whole window but for ``ceil_mode``'s last ones), or inside the input."""
        x = self._x()
        per = []
        for i, o in enumerate(outs):
            k, s, p = self.kernel_size[i], self.stride[i], self.padding[i]
            start = np.arange(o.lo, o.hi) * s - p
            if self.count_include_pad:
                per.append(np.minimum(start + k, x[2 + i] + p) - start)
            else:
                per.append(np.minimum(start + k, x[2 + i]) - np.maximum(start, 0))
        return np.prod(np.stack(np.meshgrid(*per, indexing="ij")), axis=0).astype(np.float64)


@register
@dataclass(frozen=True, eq=True)
class PoolOp(_Windows):
    """``pool(x)``: max or average over windows.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = PoolOp((T.zero((2, 3, 9, 9)),), "max", (3, 3), (2, 2), (1, 1))
    >>> op.output_type.shape, [s.name for s in op.requestable()]
    ((2, 3, 5, 5), ['batch', 'channels', 'o0', 'o1'])
    """

    kind = "pool"

    def infer(self) -> TensorType:
        if len(self.input_types) != 1:
            raise GraphError(f"pool takes one tensor; got {len(self.input_types)}.")
        (x,) = self.input_types
        self._check(x)
        return TensorType.zero((*x.shape[:2], *self._out_sizes()), x.dtype)

    def shardable(self) -> tuple[ShardableIndex, ...]:
        x, o = self._x(), self._out_sizes()
        return (ShardableIndex("batch", x[0]), ShardableIndex("channels", x[1]),
                *(ShardableIndex(f"o{i}", n) for i, n in enumerate(o)))

    def _outs(self, choice: Choice) -> list[Interval]:
        return [choice.get(f"o{i}", Interval(0, n)) for i, n in enumerate(self._out_sizes())]

    def input_box(self, k: int, choice: Choice) -> Box:
        x = self._x()
        return Box.from_intervals((choice.get("batch", Interval(0, x[0])), choice.get("channels", Interval(0, x[1])),
                                   *self._windows(self._outs(choice))))

    def output_box(self, choice: Choice) -> Box:
        x = self._x()
        return Box.from_intervals((choice.get("batch", Interval(0, x[0])), choice.get("channels", Interval(0, x[1])),
                                   *self._outs(choice)))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(output.volume * math.prod(self.kernel_size))

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x = self._compute(blocks[0])
        outs = [f.output.interval(2 + i) for i in range(self.rank)]
        n_out = [o.size for o in outs]
        xpad, _ = self._padded(x, f.inputs[0], outs, -np.inf if self.op == "max" else 0.0)
        acc = None
        for kk in self._offsets():
            tap = xpad[self._taps(kk, n_out)]
            acc = tap.copy() if acc is None else (np.maximum(acc, tap) if self.op == "max" else acc + tap)
        assert acc is not None
        return self._result(acc if self.op == "max" else acc / self._counts(outs))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        (x,) = inputs
        return (build(b, "pool_grad", (x, cotangent), op=self.op, kernel_size=self.kernel_size, stride=self.stride,
                      padding=self.padding, count_include_pad=self.count_include_pad, ceil_mode=self.ceil_mode),)


@register
@dataclass(frozen=True, eq=True)
class PoolGradOp(_Windows):
    """dx of ``pool`` from (x, dy): splits batch, channels and each input spatial dimension ``s0..``; a block
    reads the dy of the windows that meet it and, for max, the inputs of those windows (to find each
    window's winner).

    >>> from relational_tensors.core.types import TensorType as T
    >>> PoolGradOp((T.zero((2, 3, 9, 9)), T.zero((2, 3, 5, 5))), "max", (3, 3), (2, 2), (1, 1)).output_type.shape
    (2, 3, 9, 9)
    """

    kind = "pool_grad"
    gradient = SECOND_ORDER

    def infer(self) -> TensorType:
        x, dy = self.input_types
        self._check(x)
        if dy.shape != (*x.shape[:2], *self._out_sizes()) or dy.dtype != x.dtype:
            raise GraphError(f"pool_grad needs dy of the pool's output type; got {dy} for x {x}.")
        return x

    def shardable(self) -> tuple[ShardableIndex, ...]:
        x = self._x()
        return (ShardableIndex("batch", x[0]), ShardableIndex("channels", x[1]),
                *(ShardableIndex(f"s{i}", x[2 + i]) for i in range(self.rank)))

    def _rows(self, choice: Choice) -> list[Interval]:
        x = self._x()
        return [choice.get(f"s{i}", Interval(0, x[2 + i])) for i in range(self.rank)]

    def _outs(self, choice: Choice) -> list[Interval]:
        o = self._out_sizes()
        return [output_range(r, self.kernel_size[i], self.stride[i], self.padding[i], 1, o[i])
                for i, r in enumerate(self._rows(choice))]

    def input_box(self, k: int, choice: Choice) -> Box:
        x = self._x()
        bc = (choice.get("batch", Interval(0, x[0])), choice.get("channels", Interval(0, x[1])))
        outs = self._outs(choice)
        if k == 1:
            return Box.from_intervals(bc + tuple(outs))
        if self.op == "avg":  # the average's gradient needs no input value: one row of it, for the shape
            return Box.from_intervals(bc + tuple(Interval(r.lo, min(r.lo + 1, r.hi)) for r in self._rows(choice)))
        return Box.from_intervals(bc + tuple(self._windows(outs)))

    def output_box(self, choice: Choice) -> Box:
        x = self._x()
        return Box.from_intervals((choice.get("batch", Interval(0, x[0])), choice.get("channels", Interval(0, x[1])),
                                   *self._rows(choice)))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return float(2 * inputs[1].volume * math.prod(self.kernel_size))

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, dy = (self._compute(b) for b in blocks)
        outs = [f.inputs[1].interval(2 + i) for i in range(self.rank)]
        rows = [f.output.interval(2 + i) for i in range(self.rank)]
        n_out = [o.size for o in outs]
        span = [(o.lo * s - p, (o.hi - 1) * s - p + k) if o.size else (r.lo, r.lo)
                for o, s, p, k, r in zip(outs, self.stride, self.padding, self.kernel_size, rows)]
        buf = np.zeros((*dy.shape[:2], *(hi - lo for lo, hi in span)), dtype=dy.dtype)
        if 0 not in n_out:
            if self.op == "max":
                xpad, _ = self._padded(x, f.inputs[0], outs, -np.inf)
                taps = [xpad[self._taps(kk, n_out)] for kk in self._offsets()]
                best, win = taps[0].copy(), np.zeros(taps[0].shape, dtype=np.int64)
                for n, tap in enumerate(taps[1:], 1):  # the first largest input of each window wins
                    more = tap > best
                    best, win = np.where(more, tap, best), np.where(more, n, win)
                for n, kk in enumerate(self._offsets()):
                    buf[self._taps(kk, n_out)] += np.where(win == n, dy, 0.0)
            else:
                share = dy / self._counts(outs)
                for kk in self._offsets():
                    buf[self._taps(kk, n_out)] += share
        out = np.zeros(f.output.shape, dtype=dy.dtype)
        src, dst = [], []
        for r, (lo, hi) in zip(rows, span):
            a, b = max(r.lo, lo), min(r.hi, hi)
            b = max(a, b)
            src.append(slice(a - lo, b - lo))
            dst.append(slice(a - r.lo, b - r.lo))
        out[_lead2(dst)] = buf[_lead2(src)]
        return self._result(out)

"""Convolution as a join: x [batch, in_channels, *spatial] with w [out_channels, in_channels/groups,
*kernel] -> out [batch, out_channels, *out_spatial], for 1, 2 and 3 spatial dimensions, PyTorch's
channels-first layout and arithmetic (stride, zero padding, dilation, groups).

An output position o of spatial dimension i reads the inputs o·s - p + k·d for k in [0, K): the join
of input windows with filters, followed by a ⊕-sum over input channels and kernel positions.

Shardable indices, in declared order:

* ``batch``         anywhere;
* ``out_channels``  anywhere (with groups: at group boundaries, a block reading its groups' inputs);
* ``in_channels``   anywhere when groups == 1: partial outputs, ⊕ = sum;
* ``o0``, ``o1``, ``o2``  each output spatial dimension, anywhere: a block reads the input rows its
  windows cover, so neighbouring blocks' inputs overlap by the receptive field minus the stride (the
  halo); padding exists only at the tensor's edges, so a block pads only where its window passes one.

The gradients are ``conv_grad`` operators of their own (``dx``: the transposed convolution of dy,
``dw``: the correlation of x with dy), with the same halos.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.aggregation import SUM
from relational_tensors.core.dtypes import FLOAT_DTYPES
from relational_tensors.core.spec import ANY, FunctionSpec, ShardableIndex
from relational_tensors.core.types import Box, Interval, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Choice, Grads, Operator, register
from relational_tensors.sql_specs.common import same_dtype
from relational_tensors.sql_specs.grad import build

__all__ = ["ConvOp", "ConvGradOp", "conv_output_size", "input_window", "output_range"]


def _lead2(rest: Any) -> tuple[Any, ...]:
    """An index that keeps the first two dimensions (batch and channels) whole."""
    return (slice(None), slice(None), *rest)


def conv_output_size(size: int, k: int, s: int, p: int, d: int) -> int:
    """PyTorch's output length: floor((size + 2p - d(k-1) - 1) / s) + 1."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def input_window(out: Interval, k: int, s: int, p: int, d: int, size: int) -> Interval:
    """The input rows the outputs ``out`` read, clipped to the tensor (padding lies outside it)."""
    if out.size == 0:
        return Interval(0, 0)
    lo = max(0, out.lo * s - p)
    hi = min(size, (out.hi - 1) * s - p + d * (k - 1) + 1)
    return Interval(min(lo, size), max(min(lo, size), hi))


def output_range(rows: Interval, k: int, s: int, p: int, d: int, n_out: int) -> Interval:
    """The outputs whose windows meet the input rows ``rows``."""
    if rows.size == 0:
        return Interval(0, 0)
    lo = max(0, -(-(rows.lo + p - d * (k - 1)) // s))
    hi = min(n_out, (rows.hi - 1 + p) // s + 1)
    return Interval(min(lo, n_out), max(min(lo, n_out), hi))


def _tuple(name: str, value: int | Sequence[int], rank: int, least: int) -> tuple[int, ...]:
    vals = (value,) * rank if isinstance(value, int) and not isinstance(value, bool) else tuple(value)  # type: ignore[arg-type]
    if len(vals) != rank or any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in vals):
        raise GraphError(f"conv {name} must be an integer >= {least} or one per spatial dimension ({rank}); got "
                         f"{value!r}.")
    return vals


@dataclass(frozen=True, eq=True)
class _Geometry(Operator):
    """What a convolution and its gradients share: the sizes, the windows and the padded views."""

    stride: tuple[int, ...] = (1,)
    padding: tuple[int, ...] = (0,)
    dilation: tuple[int, ...] = (1,)
    groups: int = 1

    cost_family = "matmul"

    # the shapes of the forward: x [n, c, *s], w [f, c/g, *k], y [n, f, *o]
    def _shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    @property
    def rank(self) -> int:
        return len(self._shapes()[0]) - 2

    @property
    def kernel_size(self) -> tuple[int, ...]:
        return self._shapes()[1][2:]

    def _check_geometry(self, x: TensorType, w: TensorType) -> tuple[int, ...]:
        if x.rank not in (3, 4, 5) or w.rank != x.rank:
            raise GraphError(f"conv takes x [batch, in_channels, *spatial] and w [out_channels, in_channels/groups, "
                             f"*kernel] with 1 to 3 spatial dimensions; got x {x.shape}, w {w.shape}.")
        r = x.rank - 2
        for name, vals, least in (("stride", self.stride, 1), ("padding", self.padding, 0),
                                  ("dilation", self.dilation, 1)):
            _tuple(name, vals, r, least)
        g = self.groups
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or x.shape[1] % g or w.shape[0] % g:
            raise GraphError(f"conv groups must divide in_channels ({x.shape[1]}) and out_channels ({w.shape[0]}); "
                             f"got groups={g!r}.")
        if w.shape[1] * g != x.shape[1]:
            raise GraphError(f"conv needs w's in_channels/groups = {x.shape[1]}/{g} = {x.shape[1] // g}; got w "
                             f"{w.shape} for x {x.shape}.")
        out = tuple(conv_output_size(x.shape[2 + i], w.shape[2 + i], self.stride[i], self.padding[i],
                                     self.dilation[i]) for i in range(r))
        if any(o < 1 for o in out):
            raise GraphError(f"conv of x {x.shape} with kernel {w.shape[2:]}, stride {self.stride}, padding "
                             f"{self.padding}, dilation {self.dilation} has no output position (sizes {out}); "
                             "pad more or use a smaller kernel.")
        return out

    def params(self) -> dict[str, object]:
        return {"stride": self.stride, "padding": self.padding, "dilation": self.dilation, "groups": self.groups}

    def _channel_positions(self) -> str | tuple[int, ...]:
        """Legal cuts of out_channels: anywhere, or at group boundaries."""
        f = self._shapes()[1][0]
        per = f // self.groups
        return ANY if self.groups == 1 or per == 1 else tuple(range(per, f, per))

    def _shardable(self, spatial: str) -> tuple[ShardableIndex, ...]:
        x, w, y = self._shapes()
        found = [ShardableIndex("batch", x[0]), ShardableIndex("out_channels", w[0], self._channel_positions())]
        if self.groups == 1:
            found.append(ShardableIndex("in_channels", x[1]))
        elif w[0] // self.groups == 1:  # one output channel per group: cut anywhere
            found[1] = ShardableIndex("out_channels", w[0])
        sizes = y[2:] if spatial == "o" else x[2:]
        found += [ShardableIndex(f"{spatial}{i}", n) for i, n in enumerate(sizes)]
        return tuple(found)

    def _in_channels(self, choice: Choice) -> tuple[Interval, Interval]:
        """(x's channel block, w's input-channel block) of a choice."""
        x, w, _ = self._shapes()
        if self.groups == 1:
            c = choice.get("in_channels", Interval(0, x[1]))
            return c, c
        f = choice.get("out_channels", Interval(0, w[0]))
        per_out, per_in = w[0] // self.groups, w[1]
        g0, g1 = f.lo // per_out, -(-f.hi // per_out)
        return Interval(g0 * per_in, g1 * per_in), Interval(0, per_in)

    def _blocks(self, choice: Choice) -> tuple[Interval, Interval, Interval, Interval]:
        """(batch, out channels, x's channels, w's input channels) of a choice."""
        x, w, _ = self._shapes()
        cx, cw = self._in_channels(choice)
        return choice.get("batch", Interval(0, x[0])), choice.get("out_channels", Interval(0, w[0])), cx, cw

    def _windows(self, outs: Sequence[Interval]) -> list[Interval]:
        x, w, _ = self._shapes()
        return [input_window(o, w[2 + i], self.stride[i], self.padding[i], self.dilation[i], x[2 + i])
                for i, o in enumerate(outs)]

    def _outs_of(self, rows: Sequence[Interval]) -> list[Interval]:
        _, w, y = self._shapes()
        return [output_range(r, w[2 + i], self.stride[i], self.padding[i], self.dilation[i], y[2 + i])
                for i, r in enumerate(rows)]

    # --- kernels: one einsum per kernel position, over every output position at once -----------------------
    def _offsets(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(k) for k in self.kernel_size)))

    def _taps(self, kk: tuple[int, ...], n_out: Sequence[int]) -> tuple[slice, ...]:
        """The strided slice of a padded input block that kernel position ``kk`` reads for ``n_out`` outputs."""
        return tuple(slice(k * d, k * d + (n - 1) * s + 1, s)
                     for k, d, s, n in zip(kk, self.dilation, self.stride, n_out))

    def _padded(self, x: np.ndarray, box: Box, outs: Sequence[Interval], xp: Any = np) -> np.ndarray:
        """The input block zero-padded to exactly the rows its outputs ``outs`` read (tensor edges only)."""
        widths = [(0, 0), (0, 0)]
        for i, o in enumerate(outs):
            k, s, p, d = self.kernel_size[i], self.stride[i], self.padding[i], self.dilation[i]
            need_lo, need_hi = o.lo * s - p, (o.hi - 1) * s - p + d * (k - 1) + 1
            lo, hi = box.lower[2 + i], box.upper[2 + i]
            if hi <= lo:  # no input row inside the tensor: all padding
                widths.append((need_hi - need_lo, 0))
            else:
                widths.append((lo - need_lo, need_hi - hi))
        if not any(a or b for a, b in widths):
            return x
        return xp.pad(x, widths)

    @staticmethod
    def _grouped(a: np.ndarray, groups: int) -> np.ndarray:
        """[n, c, ...] as [n, groups, c / groups, ...]."""
        return a.reshape(a.shape[0], groups, a.shape[1] // groups, *a.shape[2:])


@register
@dataclass(frozen=True, eq=True)
class ConvOp(_Geometry):
    """``conv(x, w)``: PyTorch's ``convolution`` (cross-correlation), no bias (the graph adds one).

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = ConvOp((T.zero((2, 3, 9, 9)), T.zero((4, 3, 3, 3))), (2, 2), (1, 1), (1, 1))
    >>> op.output_type.shape, [s.name for s in op.requestable()]
    ((2, 4, 5, 5), ['batch', 'out_channels', 'in_channels', 'o0', 'o1'])
    """

    kind = "conv"
    contraction = True
    aggregation = SUM

    def _shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        x, w = self.input_types
        return x.shape, w.shape, self.output_type.shape

    def infer(self) -> TensorType:
        if len(self.input_types) != 2:
            raise GraphError(f"conv takes x and w; got {len(self.input_types)} tensors (a bias is added after).")
        x, w = self.input_types
        dtype = same_dtype(self.kind, self.input_types)
        if dtype not in FLOAT_DTYPES:
            raise GraphError(f"conv needs floating tensors; got dtype {dtype}.")
        out = self._check_geometry(x, w)
        return TensorType.zero((x.shape[0], w.shape[0], *out), dtype)

    def signature(self) -> str:
        sp = " ".join(f"s{i}" for i in range(self.rank))
        k = " ".join(f"k{i}" for i in range(self.rank))
        o = " ".join(f"o{i}" for i in range(self.rank))
        return f"batch in_channels {sp}, out_channels in_channels/groups {k} -> batch out_channels {o}"

    def shardable(self) -> tuple[ShardableIndex, ...]:
        return self._shardable("o")

    def _outs(self, choice: Choice) -> list[Interval]:
        y = self.output_type.shape
        return [choice.get(f"o{i}", Interval(0, y[2 + i])) for i in range(self.rank)]

    def input_box(self, k: int, choice: Choice) -> Box:
        w = self._shapes()[1]
        b, f, cx, cw = self._blocks(choice)
        if k == 0:
            return Box.from_intervals((b, cx, *self._windows(self._outs(choice))))
        return Box.from_intervals((f, cw, *(Interval(0, n) for n in w[2:])))

    def output_box(self, choice: Choice) -> Box:
        x, w, _ = self._shapes()
        b, f = choice.get("batch", Interval(0, x[0])), choice.get("out_channels", Interval(0, w[0]))
        return Box.from_intervals((b, f, *self._outs(choice)))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        wb = inputs[1]
        return 2.0 * output.volume * wb.shape[1] * math.prod(self.kernel_size)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        x, w = (self._compute(b) for b in blocks)
        return self._result(self.dense(x, w, f, np))

    def dense(self, x: Any, w: Any, f: FunctionSpec, xp: Any) -> Any:
        """The output block from x's and w's blocks, one contraction per kernel position (``xp``: NumPy or
        CuPy)."""
        outs = [f.output.interval(2 + i) for i in range(self.rank)]
        n_out = [o.size for o in outs]
        xpad = self._padded(x, f.inputs[0], outs, xp)
        groups = 1 if self.groups == 1 else x.shape[1] // w.shape[1]
        out = xp.zeros((x.shape[0], w.shape[0], *n_out), dtype=x.dtype)
        if x.shape[1] == 0 or 0 in n_out:
            return out
        for kk in self._offsets():
            xs = xpad[_lead2(self._taps(kk, n_out))]
            wk = w[_lead2(kk)]
            if groups == 1:
                out += xp.einsum("nc...,fc->nf...", xs, wk)
            else:
                part = xp.einsum("ngc...,gfc->ngf...", self._grouped(xs, groups),
                                 wk.reshape(groups, w.shape[0] // groups, w.shape[1]))
                out += part.reshape(out.shape)
        return out

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        x, w = inputs
        common = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        dx = build(b, "conv_grad", (cotangent, w), part="dx", size=x.type.shape[2:], **common) if wanted[0] else None
        dw = build(b, "conv_grad", (x, cotangent), part="dw", size=w.type.shape[2:], **common) if wanted[1] else None
        return dx, dw


@register
@dataclass(frozen=True, eq=True)
class ConvGradOp(_Geometry):
    """The gradients of ``conv``: ``part="dx"`` from (dy, w) -> x's shape (``size``: x's spatial sizes),
    splitting batch, in_channels, every input spatial dimension (a block reads the dy rows whose windows
    meet it) and out_channels (⊕ = sum, groups == 1); ``part="dw"`` from (x, dy) -> w's shape (``size``:
    the kernel), splitting out_channels and in_channels, with batch and the output positions ⊕-summed.

    >>> from relational_tensors.core.types import TensorType as T
    >>> op = ConvGradOp((T.zero((2, 4, 5, 5)), T.zero((4, 3, 3, 3))), (2, 2), (1, 1), (1, 1), part="dx",
    ...                 size=(9, 9))
    >>> op.output_type.shape, [s.name for s in op.requestable()]
    ((2, 3, 9, 9), ['batch', 'out_channels', 'in_channels', 's0', 's1'])
    """

    kind = "conv_grad"
    contraction = True
    aggregation = SUM
    gradient = "yes for part dx (the transposed convolution); dw is a gradient operator (no second derivatives)"
    part: str = "dx"
    size: tuple[int, ...] = ()

    def _shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        a, b = self.input_types
        if self.part == "dx":  # (dy, w) -> x
            dy, w = a.shape, b.shape
            return (dy[0], w[1] * self.groups, *self.size), w, dy
        x, dy = a.shape, b.shape  # (x, dy) -> w
        return x, (dy[1], x[1] // self.groups, *self.size), dy

    def infer(self) -> TensorType:
        if self.part not in ("dx", "dw") or len(self.input_types) != 2:
            raise GraphError(f"conv_grad takes part 'dx' (dy, w) or 'dw' (x, dy); got part={self.part!r} with "
                             f"{len(self.input_types)} tensors.")
        same_dtype(self.kind, self.input_types)
        x, w, y = self._shapes()
        out = self._check_geometry(TensorType.zero(x), TensorType.zero(w))
        if tuple(out) != tuple(y[2:]) or y[:2] != (x[0], w[0]):
            raise GraphError(f"conv_grad's dy must have the forward's output shape {(x[0], w[0], *out)}; got {y}.")
        shape = x if self.part == "dx" else w
        return TensorType.zero(shape, self.input_types[0].dtype)

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        """``part="dx"`` is the transposed convolution of its ``dy`` by ``w``: its gradient with respect to ``dy``
        is the forward convolution of the cotangent by ``w``, and with respect to ``w`` the weight gradient of
        that convolution (input: the cotangent; output gradient: ``dy``)."""
        if self.part != "dx":
            raise GraphError(f"conv_grad part {self.part!r} has no gradient: second derivatives are not built.")
        dy, w = inputs
        common = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        ddy = build(b, "conv", (cotangent, w), **common) if wanted[0] else None
        dw = build(b, "conv_grad", (cotangent, dy), part="dw", size=w.type.shape[2:], **common) if wanted[1] else None
        return ddy, dw

    def params(self) -> dict[str, object]:
        return {**super().params(), "part": self.part, "size": self.size}

    def shardable(self) -> tuple[ShardableIndex, ...]:
        if self.part == "dx":
            return self._shardable("s")
        found = self._shardable("o")  # dw: out and in channels split the output; batch and positions ⊕
        return found

    def _rows(self, choice: Choice) -> list[Interval]:
        x = self._shapes()[0]
        return [choice.get(f"s{i}", Interval(0, x[2 + i])) for i in range(self.rank)]

    def _outs(self, choice: Choice) -> list[Interval]:
        y = self._shapes()[2]
        if self.part == "dx":
            return self._outs_of(self._rows(choice))
        return [choice.get(f"o{i}", Interval(0, y[2 + i])) for i in range(self.rank)]

    def input_box(self, k: int, choice: Choice) -> Box:
        w = self._shapes()[1]
        b, f, cx, cw = self._blocks(choice)
        outs = self._outs(choice)
        if (self.part == "dx" and k == 0) or (self.part == "dw" and k == 1):  # dy
            return Box.from_intervals((b, f, *outs))
        if self.part == "dx":  # w
            return Box.from_intervals((f, cw, *(Interval(0, n) for n in w[2:])))
        return Box.from_intervals((b, cx, *self._windows(outs)))  # x

    def output_box(self, choice: Choice) -> Box:
        x, w, _ = self._shapes()
        cx, cw = self._in_channels(choice)
        if self.part == "dx":
            return Box.from_intervals((choice.get("batch", Interval(0, x[0])), cx, *self._rows(choice)))
        return Box.from_intervals((choice.get("out_channels", Interval(0, w[0])), cw,
                                   *(Interval(0, n) for n in w[2:])))

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        dy = inputs[0] if self.part == "dx" else inputs[1]
        per = self._shapes()[1][1] if self.part == "dx" else output.shape[1]
        return 2.0 * dy.volume * per * math.prod(self.kernel_size)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        a, b = (self._compute(x) for x in blocks)
        return self._result(self._dx(a, b, f) if self.part == "dx" else self._dw(a, b, f))

    def span(self, f: FunctionSpec) -> list[tuple[int, int]]:
        """A dx block's padded input rows [lo, hi) per spatial dimension: those its dy positions' windows
        cover (the block's own start, empty, where it has no dy position)."""
        out = []
        for i in range(self.rank):
            o, r = f.inputs[0].interval(2 + i), f.output.interval(2 + i)
            s, p, d, k = self.stride[i], self.padding[i], self.dilation[i], self.kernel_size[i]
            out.append((o.lo * s - p, (o.hi - 1) * s - p + d * (k - 1) + 1) if o.size else (r.lo, r.lo))
        return out

    def _dx(self, dy: np.ndarray, w: np.ndarray, f: FunctionSpec) -> np.ndarray:
        """Scatter each kernel position's contribution into the padded rows the dy block's windows cover,
        then cut out the block's own rows."""
        outs = [f.inputs[0].interval(2 + i) for i in range(self.rank)]
        rows = [f.output.interval(2 + i) for i in range(self.rank)]
        n_out = [o.size for o in outs]
        span = self.span(f)
        groups = 1 if self.groups == 1 else f.output.shape[1] // w.shape[1]
        buf = np.zeros((dy.shape[0], f.output.shape[1], *(hi - lo for lo, hi in span)), dtype=dy.dtype)
        if 0 not in n_out and dy.shape[1]:
            for kk in self._offsets():
                wk = w[_lead2(kk)]
                if groups == 1:
                    part = np.einsum("nf...,fc->nc...", dy, wk)
                else:
                    part = np.einsum("ngf...,gfc->ngc...", self._grouped(dy, groups),
                                     wk.reshape(groups, w.shape[0] // groups, w.shape[1])).reshape(
                                         dy.shape[0], -1, *n_out)
                buf[_lead2(self._taps(kk, n_out))] += part
        out = np.zeros(f.output.shape, dtype=dy.dtype)
        src, dst = [], []
        for r, (lo, hi) in zip(rows, span):  # the block's rows that some window reaches
            a = max(r.lo, lo)
            b = max(a, min(r.hi, hi))
            src.append(slice(a - lo, b - lo))
            dst.append(slice(a - r.lo, b - r.lo))
        out[_lead2(dst)] = buf[_lead2(src)]
        return out

    def _dw(self, x: np.ndarray, dy: np.ndarray, f: FunctionSpec) -> np.ndarray:
        outs = [f.inputs[1].interval(2 + i) for i in range(self.rank)]
        n_out = [o.size for o in outs]
        xpad = self._padded(x, f.inputs[0], outs)
        groups = 1 if self.groups == 1 else dy.shape[1] // (self._shapes()[1][0] // self.groups)
        out = np.zeros(f.output.shape, dtype=x.dtype)
        if 0 in n_out or dy.shape[0] == 0:
            return out
        for kk in self._offsets():
            xs = xpad[_lead2(self._taps(kk, n_out))]
            flat_x, flat_dy = xs.reshape(*xs.shape[:2], -1), dy.reshape(*dy.shape[:2], -1)  # positions summed
            if groups == 1:
                out[_lead2(kk)] = np.einsum("ncp,nfp->fc", flat_x, flat_dy)
            else:
                part = np.einsum("ngcp,ngfp->gfc", self._grouped(flat_x, groups), self._grouped(flat_dy, groups))
                out[_lead2(kk)] = part.reshape(dy.shape[1], -1)
        return out

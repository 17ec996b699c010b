"""Convolution and pooling as a graph builds them: PyTorch's argument rules (an integer or one per spatial
dimension, ``"same"`` and ``"valid"`` padding, output padding), a patch embedding (stride = kernel) as the
matmul it is, and a transposed convolution as the convolution's data gradient, cropped and padded to the
size asked for.  ``Graph.conv``, ``conv_transpose``, ``max_pool`` and ``avg_pool`` call these."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relational_tensors.errors import GraphError
from relational_tensors.sql_specs import ConvGradOp, ConvOp, PadOp, PoolOp, ReshapeOp

if TYPE_CHECKING:
    from relational_tensors.graph.graph import Graph, Tensor

__all__ = ["conv", "conv_transpose", "patchify", "pool", "per_dim"]


def conv(g: Graph, x: Tensor, w: Tensor, bias: Tensor | None = None, stride: int | Sequence[int] = 1,
         padding: int | str | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
         name: str | None = None) -> Tensor:
    """Convolution of x [batch, in_channels, *spatial] (1 to 3 spatial dimensions) with w [out_channels,
    in_channels/groups, *kernel], PyTorch's ``conv1d/2d/3d``: ``padding`` an integer, one per
    dimension, ``"valid"`` or ``"same"`` (stride 1, symmetric); ``bias`` [out_channels] is added."""
    xt, wt = g._t(x), g._t(w)
    rank = max(xt.rank - 2, 1)
    stride_t, dilation_t = per_dim("stride", stride, rank), per_dim("dilation", dilation, rank)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        extra = [d * (k - 1) for d, k in zip(dilation_t, wt.shape[2:])]
        if any(s != 1 for s in stride_t) or any(e % 2 for e in extra):
            raise GraphError(f"conv padding='same' is supported for stride 1 and an even dilation·(kernel-1) "
                             f"(symmetric padding); got stride {stride_t}, kernel {wt.shape[2:]}, dilation "
                             f"{dilation_t}. Pass explicit padding.")
        padding = tuple(e // 2 for e in extra)
    elif isinstance(padding, str):
        raise GraphError(f"conv padding must be an integer, one per dimension, 'valid' or 'same'; got {padding!r}.")
    padding_t = per_dim("padding", padding, rank, 0)
    # non-overlapping windows as a matmul; a 1×1 convolution stays one (its kernel reads NCHW blocks as
    # they lie, where the matmul form permutes them twice)
    if (groups == 1 and stride_t == tuple(wt.shape[2:]) and not any(padding_t) and set(dilation_t) == {1}
            and any(k > 1 for k in wt.shape[2:])
            and xt.rank == rank + 2 and wt.rank == rank + 2 and wt.shape[1] == xt.shape[1]
            and all(s >= k for s, k in zip(xt.shape[2:], wt.shape[2:]))):
        y = patchify(g, x, w, name if bias is None else None)
    else:
        op = ConvOp((xt, wt), stride_t, padding_t, dilation_t, groups)
        y = g._op(op, (x, w), name if bias is None else None)
    if bias is None:
        return y
    bt = g._t(bias)
    if bt.shape != (wt.shape[0],):
        raise GraphError(f"conv bias must have shape [out_channels] = [{wt.shape[0]}]; got {bt.shape}.")
    b = g.reshape(bias, [wt.shape[0], *([1] * rank)])
    return g.add(y, b, name=name)

def conv_transpose(g: Graph, x: Tensor, w: Tensor, bias: Tensor | None = None, stride: int | Sequence[int] = 1,
                   padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                   dilation: int | Sequence[int] = 1, groups: int = 1, name: str | None = None) -> Tensor:
    """Transposed convolution of x [batch, in_channels, *spatial] with w [in_channels, out_channels/groups,
    *kernel], PyTorch's ``conv_transpose1d/2d/3d``: the gradient of ``conv`` with respect to its input (the
    ``conv_grad`` operator, part dx), each output size ``(in - 1)·stride - 2·padding + dilation·(kernel -
    1) + output_padding + 1``; ``bias`` [out_channels] is added."""
    xt, wt = g._t(x), g._t(w)
    rank = max(xt.rank - 2, 1)
    if xt.rank != rank + 2 or wt.rank != rank + 2:
        raise GraphError(f"conv_transpose takes x [batch, channels, *spatial] and w [in_channels, "
                         f"out_channels/groups, *kernel] of one rank; got {xt.shape} and {wt.shape}.")
    stride_t, dilation_t = per_dim("stride", stride, rank), per_dim("dilation", dilation, rank)
    padding_t = per_dim("padding", padding, rank, 0)
    extra = per_dim("output_padding", output_padding, rank, 0)
    if any(e >= max(s, d) for e, s, d in zip(extra, stride_t, dilation_t)):
        raise GraphError(f"conv_transpose's output_padding must be smaller than the stride or the dilation "
                         f"(PyTorch's rule); got output_padding {extra}, stride {stride_t}, dilation {dilation_t}.")
    size = tuple((n - 1) * s - 2 * p + d * (k - 1) + e + 1 for n, s, p, d, k, e in
                 zip(xt.shape[2:], stride_t, padding_t, dilation_t, wt.shape[2:], extra))
    if any(n < 1 for n in size):
        raise GraphError(f"conv_transpose's output would have sizes {size}; the padding is too large for input "
                         f"{xt.shape[2:]} and kernel {wt.shape[2:]}.")
    # an output the forward convolution maps back onto x (output padding below the stride) is one
    # conv_grad; otherwise (output padding from a dilation) the whole unpadded output, cropped by the
    # padding and extended with zeros by the output padding
    if all((n + 2 * p - d * (k - 1) - 1) // s + 1 == m for n, p, d, k, s, m in
           zip(size, padding_t, dilation_t, wt.shape[2:], stride_t, xt.shape[2:])):
        op = ConvGradOp((xt, wt), stride_t, padding_t, dilation_t, groups, part="dx", size=size)
        y = g._op(op, (x, w), name if bias is None else None)
    else:
        full = tuple((m - 1) * s + d * (k - 1) + 1 for m, s, d, k in
                     zip(xt.shape[2:], stride_t, dilation_t, wt.shape[2:]))
        y = g._op(ConvGradOp((xt, wt), stride_t, (0,) * rank, dilation_t, groups, part="dx", size=full),
                     (x, w), None)
        for axis, (p, n, whole) in enumerate(zip(padding_t, size, full)):
            if p + n > whole:  # zeros after the whole output, then the padding's crop
                y = g._op(PadOp((g._t(y),), axis + 2, 0, p + n), (y,), None)
                whole = p + n
            if (p, p + n) != (0, whole):
                y = g.slice(y, axis + 2, p, p + n)
        if bias is None:
            return g._op(ReshapeOp((g._t(y),), g._t(y).shape), (y,), name) if name else y
    if bias is None:
        return y
    out_channels = wt.shape[1] * groups
    if g._t(bias).shape != (out_channels,):
        raise GraphError(f"conv_transpose bias must have shape [out_channels] = [{out_channels}]; got "
                         f"{g._t(bias).shape}.")
    return g.add(y, g.reshape(bias, [out_channels, *([1] * rank)]), name=name)

def patchify(g: Graph, x: Tensor, w: Tensor, name: str | None) -> Tensor:
    """A convolution whose stride is its kernel (ViT's patch embedding) as the matmul it is: the windows do
    not overlap, so im2col is a permutation; patches [n·positions, c·kernel] @ w [c·kernel, f]."""
    n, c, *sizes = x.shape
    f, _, *kernel = w.shape
    r = len(kernel)
    outs = [s // k for s, k in zip(sizes, kernel)]
    for d, (o, k) in enumerate(zip(outs, kernel)):
        if o * k != sizes[d]:  # the rows no window reaches
            x = g.slice(x, 2 + d, 0, o * k)
    split = [n, c] + [v for o, k in zip(outs, kernel) for v in (o, k)]
    x = g.reshape(x, split)
    x = g.permute(x, [0, *(2 + 2 * d for d in range(r)), 1, *(3 + 2 * d for d in range(r))])
    patches = g.reshape(x, [n * math.prod(outs), c * math.prod(kernel)])
    wt = g.transpose(g.reshape(w, [f, c * math.prod(kernel)]), 0, 1)
    y = g.reshape(g.matmul(patches, wt), [n, *outs, f])
    return g.permute(y, [0, r + 1, *range(1, r + 1)], name=name)

def pool(g: Graph, op: str, x: Tensor, kernel_size: Any, stride: Any, padding: Any, count_include_pad: bool,
         name: str | None, ceil_mode: bool) -> Tensor:
    """Max (``op="max"``, padding with -inf) or average pooling of x [batch, channels, *spatial]; the stride
    defaults to the kernel."""
    rank = max(g._t(x).rank - 2, 1)
    k = per_dim("kernel_size", kernel_size, rank)
    s = k if stride is None else per_dim("stride", stride, rank)
    pool = PoolOp((g._t(x),), op, k, s, per_dim("padding", padding, rank, 0), count_include_pad,
                  bool(ceil_mode))
    return g._op(pool, (x,), name)


def per_dim(what: str, value: Any, rank: int, least: int = 1) -> tuple[int, ...]:
    """An integer or one per spatial dimension, as a tuple of ``rank`` integers >= ``least``."""
    vals = (value,) * rank if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        vals = tuple(operator.index(v) for v in vals)
    except TypeError:
        vals = None
    if vals is None or len(vals) != rank or any(v < least for v in vals):
        raise GraphError(f"{what} must be an integer >= {least} or one per spatial dimension ({rank}); got {value!r}.")
    return vals

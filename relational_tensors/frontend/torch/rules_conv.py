"""Translation rules for convolutions and pooling: ``conv1d/2d/3d``, ``conv_transpose1d/2d/3d`` and
``convolution`` (transposed or not; a transposed one is ``g.conv_transpose``, conv_grad's dx part),
``max_pool1d/2d/3d`` and ``avg_pool1d/2d/3d`` (``ceil_mode`` either way), ``adaptive_avg_pool1d/2d/3d``
(a global average is a mean; an output size that divides the input is an average pool; others, whose
windows differ in size, one product per spatial dimension with a constant averaging matrix) and
``adaptive_max_pool1d/2d/3d`` (output sizes that divide the input: a max pool), batch norm in eval mode
(``_native_batch_norm_legit_no_training``: an elementwise affine from the running statistics, folded at
trace time, or with trained affine parameters computed in the graph) and in training mode
(``_native_batch_norm_legit_functional``: batch statistics as reductions, and the running statistics'
next values as outputs that update the module's buffers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relational_tensors.frontend.torch.common import _Const, _fail, _out_dtype
from relational_tensors.frontend.torch.convert import _torch
from relational_tensors.frontend.torch.registry import register_torch_op
from relational_tensors.graph.graph import Tensor

if TYPE_CHECKING:
    from relational_tensors.frontend.torch.translator import _Translator


def _bias(tr: _Translator, b: Any, dtype: str | None) -> Tensor | None:
    return None if b is None else tr.sym(b, dtype)


@register_torch_op("conv1d", "conv2d", "conv3d")
def _conv(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    x, w = tr.sym(a["input"], dtype), tr.sym(a["weight"], dtype)
    padding = a["padding"]
    padding = padding if isinstance(padding, str) else list(padding)
    return tr.g.conv(x, w, _bias(tr, a.get("bias"), dtype), stride=list(a["stride"]), padding=padding,
                     dilation=list(a["dilation"]), groups=int(a["groups"]), name=tr.name("conv"))


@register_torch_op("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
def _conv_transpose(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    dtype = _out_dtype(node)
    x, w = tr.sym(a["input"], dtype), tr.sym(a["weight"], dtype)
    return tr.g.conv_transpose(x, w, _bias(tr, a.get("bias"), dtype), stride=list(a["stride"]),
                               padding=list(a["padding"]), output_padding=list(a["output_padding"]),
                               dilation=list(a["dilation"]), groups=int(a["groups"]), name=tr.name("conv_transpose"))


@register_torch_op("convolution")
def _convolution(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    if a["transposed"]:
        dtype = _out_dtype(node)
        x, w = tr.sym(a["input"], dtype), tr.sym(a["weight"], dtype)
        return tr.g.conv_transpose(x, w, _bias(tr, a.get("bias"), dtype), stride=list(a["stride"]),
                                   padding=list(a["padding"]), output_padding=list(a["output_padding"]),
                                   dilation=list(a["dilation"]), groups=int(a["groups"]),
                                   name=tr.name("conv_transpose"))
    if any(int(p) for p in a["output_padding"]):
        raise _fail(f"output_padding {list(a['output_padding'])} of a convolution; supported: 0")
    dtype = _out_dtype(node)
    x, w = tr.sym(a["input"], dtype), tr.sym(a["weight"], dtype)
    return tr.g.conv(x, w, _bias(tr, a.get("bias"), dtype), stride=list(a["stride"]), padding=list(a["padding"]),
                     dilation=list(a["dilation"]), groups=int(a["groups"]), name=tr.name("conv"))


def _pool_args(a: dict[str, Any]) -> tuple[list[int], list[int] | None, list[int]]:
    if any(int(d) != 1 for d in (a.get("dilation") or [1])):
        raise _fail(f"pooling with dilation {list(a['dilation'])}; supported: 1")
    stride = list(a["stride"]) if a.get("stride") else None
    return list(a["kernel_size"]), stride, list(a["padding"])


@register_torch_op("max_pool1d", "max_pool2d", "max_pool3d")
def _max_pool(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    k, s, p = _pool_args(a)
    return tr.g.max_pool(tr.sym(a["self"]), k, s, p, name=tr.name("max_pool"), ceil_mode=bool(a.get("ceil_mode")))


@register_torch_op("avg_pool1d", "avg_pool2d", "avg_pool3d")
def _avg_pool(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    k, s, p = _pool_args(a)
    if a.get("divisor_override") is not None:
        raise _fail("avg_pool with divisor_override; supported: the window's count")
    return tr.g.avg_pool(tr.sym(a["self"]), k, s, p, count_include_pad=bool(a.get("count_include_pad", True)),
                         name=tr.name("avg_pool"), ceil_mode=bool(a.get("ceil_mode")))


@register_torch_op("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d")
def _adaptive_avg_pool(tr: _Translator, node: Any, a: dict[str, Any]) -> Tensor:
    x = tr.sym(a["self"])
    sizes = [int(o) for o in a["output_size"]]
    spatial = x.shape[x.rank - len(sizes):]
    if all(o == 1 for o in sizes):  # a global average
        axes = tuple(range(x.rank - len(sizes), x.rank))
        return tr.g.mean(x, axis=axes, keepdims=True, name=tr.name("global_avg_pool"))
    if x.rank != len(sizes) + 2:
        raise _fail(f"adaptive average pooling of x {tuple(x.shape)} to {tuple(sizes)}; supported: x [batch, channels, "
                    "*spatial] with one output size per spatial dimension")
    if any(n % o for n, o in zip(spatial, sizes)):
        return _uneven_average(tr, x, spatial, sizes)
    k = [n // o for n, o in zip(spatial, sizes)]
    return tr.g.avg_pool(x, k, k, 0, name=tr.name("adaptive_avg_pool"))


def _uneven_average(tr: _Translator, x: Tensor, spatial: Any, sizes: list[int]) -> Tensor:
    """Adaptive average pooling whose windows differ in size (output ``j`` of a dimension of ``n`` averages
    rows ``floor(j·n/o)`` to ``ceil((j+1)·n/o)``, torch's windows): the mean over a product of windows is
    separable, so one product per spatial dimension with a constant ``[o, n]`` matrix of ``1/size`` on
    each window, in float32 for 16-bit inputs (torch also accumulates them in float32)."""
    torch = _torch()
    dtype = x.dtype
    work = "float64" if dtype == "float64" else "float32"
    y = tr.g.cast(x, work) if dtype != work else x
    letters = "abcde"[:x.rank]
    for i, (n, o) in enumerate(zip(spatial, sizes)):
        if n == o:
            continue
        weights = torch.zeros(o, n, dtype=torch.float64)
        for j in range(o):
            lo, hi = (j * n) // o, -(-((j + 1) * n) // o)
            weights[j, lo:hi] = 1.0 / (hi - lo)
        w = tr.materialize(_Const(weights, None, f"{tr.prefix}.adaptive_avg_{i}"), work)
        axis = letters[2 + i]
        y = tr.g.einsum(f"{letters},z{axis}->{letters.replace(axis, 'z')}", y, w, name=tr.name("adaptive_avg_pool"))
    return tr.g.cast(y, dtype) if dtype != work else y


@register_torch_op("adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")
def _adaptive_max_pool(tr: _Translator, node: Any, a: dict[str, Any]) -> list[Any]:
    """Adaptive max pooling to output sizes that divide the input: a max pool whose window and stride are the
    quotients (a global max where every size is 1); the indices torch also returns are refused if read."""
    if any(u.args[1] != 0 for u in node.users):
        raise _fail("adaptive max pooling that returns its indices (return_indices=True); supported: the values")
    x = tr.sym(a["self"])
    sizes = [int(o) for o in a["output_size"]]
    spatial = x.shape[x.rank - len(sizes):]
    if any(n % o for n, o in zip(spatial, sizes)) or x.rank != len(sizes) + 2:
        raise _fail(f"adaptive max pooling of spatial size {tuple(spatial)} to {tuple(sizes)}, which does not "
                    "divide it (windows of different sizes); supported: output sizes that divide the input")
    k = [n // o for n, o in zip(spatial, sizes)]
    return [tr.g.max_pool(x, k, k, 0, name=tr.name("adaptive_max_pool")), None]


@register_torch_op("_native_batch_norm_legit_functional")
def _batch_norm_train(tr: _Translator, node: Any, a: dict[str, Any]) -> list[Any]:
    """Batch norm in training mode: each channel normalized by its batch statistics (mean and biased variance
    over batch and space, in float32 for 16-bit inputs: reductions whose batch and spatial splits aggregate
    partial sums, the synchronized batch norm of data parallelism), then the affine; the running statistics'
    next values ``(1 - momentum)·running + momentum·batch`` (the variance unbiased) are outputs, which the
    traced module's buffer updates read (``TorchGraph.buffer_updates``)."""
    if not a.get("training", True):
        raise _fail("_native_batch_norm_legit_functional with training=False; supported: training=True")
    x = tr.sym(a["input"])
    dtype = x.dtype
    wide = "float32" if dtype in ("float16", "bfloat16") else dtype
    xf = tr.g.cast(x, wide) if wide != dtype else x
    channels = x.shape[1]
    axes = [0, *range(2, x.rank)]
    count = x.type.volume // channels
    shape = [channels, *([1] * (x.rank - 2))]
    mean = tr.g.mean(xf, axes, keepdims=True, name=tr.name("batch_mean"))
    diff = tr.g.sub(xf, mean)
    var = tr.g.mean(tr.g.mul(diff, diff), axes, keepdims=True, name=tr.name("batch_var"))
    invstd = tr.unary(tr.unary(var, "add_scalar", float(a["eps"])), "rsqrt")
    y = tr.g.mul(diff, invstd)
    if a.get("weight") is not None:
        y = tr.g.mul(y, tr.g.reshape(tr.sym(a["weight"], wide), shape))
    if a.get("bias") is not None:
        y = tr.g.add(y, tr.g.reshape(tr.sym(a["bias"], wide), shape))
    y = tr.g.cast(y, dtype) if wide != dtype else y
    momentum = float(a["momentum"])
    out: list[Any] = [y, tr.g.reshape(mean, [channels]), tr.g.reshape(invstd, [channels])]
    for key, batch in (("running_mean", mean), ("running_var", var)):
        running = a.get(key)
        if running is None:
            out.append(None)
            continue
        stat = tr.g.reshape(batch, [channels])
        if key == "running_var":  # the running variance is the unbiased one
            stat = tr.unary(stat, "scale", count / max(count - 1, 1))
        have = tr.sym(running)
        wide_running = tr.g.cast(have, wide) if have.dtype != wide else have
        new = tr.g.add(tr.unary(wide_running, "scale", 1.0 - momentum), tr.unary(stat, "scale", momentum),
                       name=tr.name(f"next_{key}"))
        out.append(tr.g.cast(new, have.dtype) if have.dtype != wide else new)
    return out


@register_torch_op("_native_batch_norm_legit_no_training")
def _batch_norm_eval(tr: _Translator, node: Any, a: dict[str, Any]) -> list[Any]:
    """y = (x - mean) / sqrt(var + eps) * weight + bias = x * scale + shift, per channel (axis 1)."""
    torch = _torch()
    x = tr.sym(a["input"])
    stats = {k: a[k] for k in ("weight", "bias", "running_mean", "running_var")}
    if any(v is not None and not isinstance(v, _Const) for v in stats.values()):
        raise _fail("batch norm with statistics or affine parameters computed from the inputs; supported: "
                    "module buffers and parameters (eval mode)")
    mean, var = stats["running_mean"].value.double(), stats["running_var"].value.double()
    shape = (x.shape[1], *([1] * (x.rank - 2)))
    inv_std = 1.0 / torch.sqrt(var + float(a["eps"]))
    deps = frozenset().union(*(v.deps for v in stats.values() if v is not None))

    def const(value: Any, what: str) -> Tensor:
        return tr.materialize(_Const(value.reshape(shape), None, f"{tr.prefix}.{what}", deps=deps), x.dtype)

    w, b = stats["weight"], stats["bias"]
    if any(v is not None and v.live for v in (w, b)):  # trained affine parameters: scale and shift in the graph
        scale = const(inv_std, "bn_inv_std")
        if w is not None:
            scale = tr.binary(tr.reshape(tr.sym(w, x.dtype), shape), scale, "mul")
        shift = tr.unary(tr.binary(scale, const(mean, "bn_mean"), "mul"), "neg")
        if b is not None:
            shift = tr.binary(tr.reshape(tr.sym(b, x.dtype), shape), shift, "add")
        return [tr.binary(tr.binary(x, scale, "mul"), shift, "add"), *_bn_unused(tr)]
    weight = w.value.double() if w is not None else torch.ones_like(mean)
    bias = b.value.double() if b is not None else torch.zeros_like(mean)
    scale = weight * inv_std
    shift = bias - mean * scale
    y = tr.binary(x, const(scale, "bn_scale"), "mul")
    y = tr.binary(y, const(shift, "bn_shift"), "add")
    return [y, *_bn_unused(tr)]


def _bn_unused(tr: _Translator) -> list[Any]:
    """The saved statistics that eval-mode batch norm also returns (empty; nothing reads them)."""
    torch = _torch()
    empty = _Const(torch.zeros(0), None, f"{tr.prefix}.bn_unused")
    return [empty, empty]


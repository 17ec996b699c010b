"""A graph evaluated with PyTorch operators, to check gradients against torch autograd.

Each forward operator kind maps to the torch expression of its semantics; the gradients come from
``torch.autograd.grad``, independent of the operators' own vector-Jacobian products.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

import relational_tensors as rt
from relational_tensors.sql_specs.packing import sequence_bounds
from relational_tensors.sql_specs.random import UNIFORM_BITS, philox_uniform


def _rope(x: torch.Tensor, op) -> torch.Tensor:
    length, d = x.shape[1], x.shape[3]
    pos = np.arange(length)
    start, _ = sequence_bounds(pos, op.seq_ends, length)
    inv = op.base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.tensor(pos - start, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[None, :, None, :], ang.sin().to(x.dtype)[None, :, None, :]
    if op.inverse:
        sin = -sin
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def attention_mask(op, extra: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where each query may see each key, [b|1, hq|1, sq, skv], from the operator's options by first principles
    (positions, sequence ids, distances; not the operator's own key ranges)."""
    q, k = op.input_types[:2]
    sq, skv = q.shape[1], k.shape[1]
    pos = torch.arange(sq) + (skv - sq if op.causal == "bottom_right" else 0)
    cols = torch.arange(skv)
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    if op.seq_ends is not None:
        ends = torch.tensor(op.seq_ends)
        allowed &= torch.searchsorted(ends, pos, right=True)[:, None] == torch.searchsorted(ends, cols, right=True)
    if op.causal is not False:
        allowed &= cols[None, :] <= pos[:, None]
    if op.window is not None:
        allowed &= (pos[:, None] - cols[None, :]).abs() < op.window
    allowed = allowed[None, None]
    if op.key_lengths is not None:
        allowed = allowed & (cols[None, :] < torch.tensor(op.key_lengths)[:, None])[:, None, None, :]
    if "key_padding" in extra:
        allowed = allowed & extra["key_padding"][:, None, None, :]
    if "mask" in extra:
        allowed = allowed & extra["mask"]
    return allowed


def _attention(q, k, v, *rest, op=None) -> torch.Tensor:
    extra = dict(zip(op.extras, rest))
    allowed = attention_mask(op, extra)
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * op.softmax_scale
    if op.softcap is not None:  # Gemma 2's logit soft-capping, before the bias and masks
        s = op.softcap * torch.tanh(s / op.softcap)
    if "bias" in extra:
        s = s + extra["bias"]
    p = torch.softmax(s.masked_fill(~allowed, -1e30), -1) * allowed.any(-1, keepdim=True)  # unseen rows: 0
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def _node(op, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    kind = op.kind
    if kind in ("matmul", "einsum"):
        ins, out = op._parsed()
        letters = {n: c for n, c in zip(dict.fromkeys([*(n for d in ins for n in d), *out]), "abcdefghijklmnop")}
        sub = ",".join("".join(letters[n] for n in d) for d in ins) + "->" + "".join(letters[n] for n in out)
        return torch.einsum(sub, *xs)
    if kind == "sql":
        p = op.parsed()
        names = dict.fromkeys([*(n for d in p.dims for n in d), *p.out])
        letters = dict(zip(names, "abcdefghijklmnop"))
        sub = ",".join("".join(letters[n] for n in d) for d in p.dims) + "->" + "".join(letters[n] for n in p.out)
        return torch.einsum(sub, *xs)
    if kind == "full":
        return torch.full(op.output_type.shape, op.value, dtype=getattr(torch, op.output_type.dtype))
    if kind == "unary":
        x, a = xs[0], op.arg
        table = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
                 "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "neg": torch.neg,
                 "abs": torch.abs, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "square": torch.square,
                 "scale": lambda t: t * a, "add_scalar": lambda t: t + a, "pow": lambda t: t ** a,
                 "cast": lambda t: t.to(getattr(torch, a)), "fill": lambda t: torch.full_like(t, a),
                 "logical_not": torch.logical_not}
        return table[op.op](x)
    if kind == "binary":
        x, y = xs
        return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
                "minimum": torch.minimum, "eq": lambda a, b: (a == b).to(a.dtype), "equal": torch.eq,
                "not_equal": torch.ne, "less": torch.lt, "less_equal": torch.le, "greater": torch.gt,
                "greater_equal": torch.ge, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
                "logical_xor": torch.logical_xor}[op.op](x, y)
    if kind == "swiglu":
        return F.silu(xs[0]) * xs[1]
    if kind == "reduce":
        x, axes = xs[0], op._axes()
        if op.op in ("max", "min"):
            out = torch.amax(x, axes, keepdim=op.keepdims) if op.op == "max" else torch.amin(x, axes, op.keepdims)
        else:
            fn = {"sum": torch.sum, "mean": torch.mean, "logsumexp": torch.logsumexp}[op.op]
            out = fn(x, axes, keepdim=op.keepdims)
        return out.reshape(op.output_type.shape)
    if kind == "softmax":
        return torch.softmax(xs[0], op.axis)
    if kind == "rmsnorm":
        x, w = xs
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + op.eps) * w
    if kind == "layernorm":
        return F.layer_norm(xs[0], (xs[0].shape[-1],), xs[1], xs[2], op.eps)
    if kind == "rope":
        return _rope(xs[0], op)
    if kind == "put_rows":  # x[ids] = values (distinct ids: torch keeps an unspecified one of repeats)
        out = xs[0].clone()
        out[xs[1].long()] = xs[2]
        return out
    if kind == "rope_table":  # x·cos + rotate_half(x)·sin, or its transpose
        x, cos, sin = xs[0], xs[1][:, :, None, :], xs[2][:, :, None, :]
        h = x.shape[-1] // 2
        rot = torch.cat((x[..., h:], -x[..., :h]), -1) * torch.cat((sin[..., h:], sin[..., :h]), -1) \
            if op.inverse else torch.cat((-x[..., h:], x[..., :h]), -1) * sin
        return x * cos + rot
    if kind == "reshape":
        return xs[0].reshape(op.output_type.shape)
    if kind == "permute":
        return xs[0].permute(op.perm)
    if kind == "slice":
        return xs[0].narrow(op.axis % xs[0].ndim, op.start, op.stop - op.start)
    if kind == "concat":
        return torch.cat(list(xs), op.axis)
    if kind == "embedding":
        return F.embedding(xs[1], xs[0])
    if kind == "embedding_grad":  # each row the sum of the rows whose id it is
        ids, rows = xs
        out = torch.zeros((op.vocab, rows.shape[-1]), dtype=rows.dtype)
        return out.index_add(0, ids.reshape(-1).long(), rows.reshape(-1, rows.shape[-1]))
    if kind == "topk":
        return torch.topk(xs[0], op.k, largest=op.largest).indices
    if kind == "take_along":
        return torch.gather(xs[0], -1, xs[1])
    if kind == "one_hot":  # an id outside the classes gives zeros (torch refuses it)
        ids = xs[0]
        inside = (ids >= 0) & (ids < op.classes)
        hot = F.one_hot(torch.where(inside, ids, 0), op.classes) * inside[..., None]
        return hot.to(getattr(torch, op.output_type.dtype))
    if kind == "route_index":  # a stable sort of the pairs by expert (ids outside the experts last)
        ids = xs[0].reshape(-1)
        key = torch.where((ids >= 0) & (ids < op.experts), ids, op.experts)
        order = torch.sort(key, stable=True).indices
        if op.what == "token":
            return order // xs[0].shape[1]
        if op.what == "group":
            return key[order]
        return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())).reshape(xs[0].shape)
    if kind == "capacity_route":  # each group's pairs, per expert in order, kept up to the capacity
        ids = xs[0].reshape(xs[0].shape[0], -1)
        slot = torch.full(ids.shape, -1, dtype=torch.int64)
        pair = torch.full((ids.shape[0], op.experts * op.capacity), -1, dtype=torch.int64)
        for g in range(ids.shape[0]):
            taken = [0] * op.experts
            for p, e in enumerate(ids[g].tolist()):
                if 0 <= e < op.experts and taken[e] < op.capacity:
                    slot[g, p] = e * op.capacity + taken[e]
                    pair[g, slot[g, p]] = p
                    taken[e] += 1
        return slot if op.what == "slot" else pair
    if kind == "routed_gather":  # rows by the index (-1: zeros); the inverse map is the gradient's
        x, index = xs[0], xs[1].long()
        per = xs[2].shape[1] // x.shape[1]
        rows = torch.where(index >= 0, index // per, 0)
        got = torch.gather(x, 1, rows[..., None].expand(-1, -1, x.shape[2]))
        return got * (index >= 0)[..., None].to(x.dtype)
    if kind == "grouped_matmul":  # each row times its group's weights (zeros outside the experts)
        rows, w, group = xs
        w = w.transpose(1, 2) if op.trans_w else w
        inside = (group >= 0) & (group < w.shape[0])
        picked = w[torch.where(inside, group, 0).long()] * inside[:, None, None].to(w.dtype)
        return torch.einsum("ph,phf->pf", rows, picked)
    if kind == "grouped_weight_grad":
        rows, dy, group = xs
        hot = F.one_hot(torch.where((group >= 0) & (group < op.experts), group, op.experts).long(),
                        op.experts + 1)[:, :op.experts].to(rows.dtype)
        return torch.einsum("pe,ph,pf->ehf", hot, rows, dy)
    if kind == "attention":
        return _attention(*xs, op=op)
    if kind == "where":
        return torch.where(*xs)
    if kind == "conv":
        fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[xs[0].dim() - 2]
        return fn(xs[0], xs[1], None, op.stride, op.padding, op.dilation, op.groups)
    if kind == "pool":
        r = xs[0].dim() - 2
        if op.op == "max":
            return {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[r](xs[0], op.kernel_size, op.stride, op.padding,
                                                                           ceil_mode=op.ceil_mode)
        return {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[r](xs[0], op.kernel_size, op.stride, op.padding,
                                                                       count_include_pad=op.count_include_pad,
                                                                       ceil_mode=op.ceil_mode)
    if kind == "cross_entropy":  # per token; the graph sums and divides around it
        logits, _, targets = xs
        ignore = -100 if op.ignore_index is None else op.ignore_index
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore,
                               reduction="none").reshape(targets.shape)
    if kind in ("dropout", "random"):  # the mask or values from the generator (its own tests check it)
        seed, offset = (int(v) for v in xs[-1])
        where = np.arange(op.output_type.volume).reshape(op.output_type.shape)
        u = torch.tensor(philox_uniform(seed, offset, op.stream, where).astype(np.float64))
        if kind == "random":
            if op.distribution == "uniform":  # truncated to the bits the dtype holds below 1
                bits = UNIFORM_BITS[op.output_type.dtype]
                u = torch.tensor(philox_uniform(seed, offset, op.stream, where, bits).astype(np.float64))
            return (u < op.p if op.distribution == "bernoulli" else u).to(getattr(torch, op.output_type.dtype))
        return xs[0] * (u >= op.p).to(xs[0].dtype) / (1 - op.p)
    if kind == "token_count":
        t = xs[0]
        n = t.numel() if op.ignore_index is None else int((t != op.ignore_index).sum())
        return torch.full((1,), float(n), dtype=getattr(torch, op.output_type.dtype))
    raise NotImplementedError(kind)


def torch_gradients(g: rt.Graph, out_name: str, cot: np.ndarray, feeds: dict[str, np.ndarray],
                    wrt: Sequence[str]) -> dict[str, np.ndarray]:
    """The gradients of ``<out, cot>`` with respect to the inputs ``wrt``, by torch autograd over the
    forward nodes of ``g`` (those before the first gradient node)."""
    values: dict[int, torch.Tensor] = {}
    leaves = {}
    target = g.outputs[out_name]
    for n in g.nodes[: target + 1]:
        if n.op is None:
            t = torch.tensor(np.asarray(feeds[n.name]))
            if n.name in wrt:
                t.requires_grad_(True)
                leaves[n.name] = t
            values[n.id] = t
        else:
            values[n.id] = _node(n.op, [values[i] for i in n.inputs])
    total = (values[target] * torch.tensor(cot)).sum()
    grads = torch.autograd.grad(total, [leaves[w] for w in wrt], allow_unused=True)
    return {w: (np.zeros(leaves[w].shape) if gr is None else gr.detach().numpy()) for w, gr in zip(wrt, grads)}



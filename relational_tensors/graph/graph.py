"""The graph users write against, in the paper's spelling and a Pythonic one.

>>> import relational_tensors as rt
>>> g = rt.Graph()
>>> x = g.input("x", [4, 8]); w = g.parameter("w", [8, 2])
>>> y = g.save(g.unary(g.matmul(x, w), "relu"), name="y")
>>> [n.kind for n in g.nodes]
['input', 'parameter', 'matmul', 'unary']
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import FLOAT_DTYPES, canonical_dtype
from relational_tensors.core.types import TensorType
from relational_tensors.errors import GraphError
from relational_tensors.graph import spatial
from relational_tensors.graph.autodiff import grad as _grad
from relational_tensors.graph.autodiff import vjp as _vjp
from relational_tensors.sql_specs import (
    AttentionOp,
    BinaryOp,
    ConcatOp,
    CrossEntropyOp,
    DropoutOp,
    EinsumOp,
    EmbeddingGradOp,
    EmbeddingOp,
    LayernormOp,
    MatmulOp,
    OneHotOp,
    Operator,
    PermuteOp,
    PutRowsOp,
    RandomOp,
    ReduceOp,
    ReshapeOp,
    RmsnormOp,
    RopeOp,
    RopeTableOp,
    SliceOp,
    SoftmaxOp,
    SqlJoinOp,
    SwigluOp,
    TakeAlongOp,
    TokenCountOp,
    TopkOp,
    UnaryOp,
    WhereOp,
)
from relational_tensors.sql_specs.common import normalize_axis

__all__ = ["Graph", "Node", "Tensor", "createGraph"]


@dataclass(frozen=True, slots=True)
class Node:
    """One vertex: a graph input (``op`` is None) or an abstract operator applied to earlier nodes."""

    id: int
    name: str
    type: TensorType
    op: Operator | None = None
    inputs: tuple[int, ...] = ()
    role: str = "op"  # "input", "parameter", "state" or "op"

    @property
    def kind(self) -> str:
        return self.op.kind if self.op is not None else self.role


class Tensor:
    """A handle on a node's output; arithmetic operators add nodes to its graph."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: Graph, node_id: int) -> None:
        self.graph = graph
        self.id = node_id

    @property
    def node(self) -> Node:
        return self.graph.nodes[self.id]

    @property
    def type(self) -> TensorType:
        return self.node.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def rank(self) -> int:
        return self.type.rank

    @property
    def name(self) -> str:
        return self.node.name

    def __add__(self, other: Tensor) -> Tensor:
        return self.graph.add(self, other)

    def __sub__(self, other: Tensor) -> Tensor:
        return self.graph.sub(self, other)

    def __mul__(self, other: Tensor) -> Tensor:
        return self.graph.mul(self, other)

    def __truediv__(self, other: Tensor) -> Tensor:
        return self.graph.div(self, other)

    def __matmul__(self, other: Tensor) -> Tensor:
        return self.graph.matmul(self, other)

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.type})"


class Graph:
    """A DAG of abstract operators over zero-bounded tensors; see the module docstring."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.outputs: dict[str, int] = {}
        self.assignments: dict[int, int] = {}  # state node -> the node whose value it takes after a run
        self.optimizer_states: set[int] = set()  # states an optimizer added (moments, steps, master weights)
        self._names: set[str] = set()
        self.name_scope = ""  # a prefix of the names of nodes made without one (autodiff: "grad.<node>.")
        self.recomputed: dict[int, int] = {}  # operator made in a g.recompute() region -> the region
        self._recomputing = 0  # the region being built (0: none)

    # --- inputs and outputs ------------------------------------------------
    def input(self, name: str, shape: Sequence[int], dtype: object = "float32",
              dims: Sequence[str] | None = None) -> Tensor:
        """A graph input (activations, ids) named ``name``."""
        return self._leaf(name, TensorType.zero(shape, dtype, dims), "input")

    def parameter(self, name: str, shape: Sequence[int], dtype: object = "float32",
                  dims: Sequence[str] | None = None) -> Tensor:
        """A graph input that holds weights; planned like an input, labelled as a parameter."""
        return self._leaf(name, TensorType.zero(shape, dtype, dims), "parameter")

    def state(self, name: str, shape: Sequence[int], dtype: object = "float32",
              dims: Sequence[str] | None = None) -> Tensor:
        """A tensor that persists across executions: loaded once (``cg.load``), read back with
        ``cg.offload(name)``, and given a new value for the next execution by ``g.assign``."""
        return self._leaf(name, TensorType.zero(shape, dtype, dims), "state")

    def assign(self, state: Tensor, value: Tensor) -> Tensor:
        """After each execution ``state`` takes the value of ``value`` (computed in this graph, of the
        state's shape and dtype), also saved as ``<state>.next``.  Returns ``value``.

        The plan keeps the state on the devices between executions (``CompiledGraph.state_layouts``)
        and writes the value into the state's blocks at the end of each execution."""
        sid, vid = self._own_id(state), self._own_id(value)
        node = self.nodes[sid]
        if node.role != "state":
            raise GraphError(f"assign needs a tensor made by g.state; {node.name!r} is of role {node.role!r}.")
        if sid in self.assignments:
            raise GraphError(f"state {node.name!r} is assigned twice; assign it once per step.")
        if self.nodes[vid].op is None:
            raise GraphError(f"assign takes a computed tensor; {self.nodes[vid].name!r} is a graph "
                             f"{self.nodes[vid].role}.")
        if value.type.shape != node.type.shape or value.type.dtype != node.type.dtype:
            raise GraphError(f"a state keeps its shape and dtype: {node.name!r} is {node.type}, the assigned value "
                             f"{self.nodes[vid].name!r} is {value.type}.")
        self.save(value, name=f"{node.name}.next")
        self.assignments[sid] = vid
        return value

    def insertTensor(self, desc: TensorType, name: str | None = None) -> Tensor:
        """The paper's spelling of ``input``: ``g.insertTensor(rt.tensorDesc(shape, dtype))``."""
        if not isinstance(desc, TensorType):
            raise GraphError(f"insertTensor takes an rt.tensorDesc(shape, dtype); got {type(desc).__name__}.")
        return self._leaf(name or f"input_{len(self.nodes)}", desc, "input")

    def save(self, t: Tensor, name: str | None = None) -> Tensor:
        """Mark ``t`` as an output that stays available after execution."""
        self._own(t)
        name = name or t.name
        if name in self.outputs and self.outputs[name] != t.id:
            raise GraphError(f"output names must be unique; {name!r} is already saved.")
        self.outputs[name] = t.id
        return t

    # --- contractions --------------------------------------------------------
    def matmul(self, a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
        """``a[..., i, j] @ b[j, k]`` or batched ``a[..., i, j] @ b[..., j, k]``."""
        return self._op(MatmulOp((self._t(a), self._t(b))), (a, b), name)

    def einsum(self, spec: str, *xs: Tensor, name: str | None = None) -> Tensor:
        """A contraction given by an einsum string, e.g. ``g.einsum("bij,jk->bik", x, w)``."""
        return self._op(EinsumOp(tuple(self._t(x) for x in xs), spec), xs, name)

    def sql(self, query: str, name: str | None = None, **tensors: Tensor | tuple[Tensor, Sequence[str]]) -> Tensor:
        """An operator defined by a SQL join-aggregate over tensor relations.

        Each tensor is a relation with one column per dimension (named by the
        tensor's dimension names, or by the names given as ``A=(t, ("i", "j"))``)
        and a value column ``v``.
        """
        handles, types, columns = [], [], []
        for rel, value in tensors.items():
            t, cols = (value if isinstance(value, tuple) else (value, None))
            handles.append(t)
            types.append(self._t(t))
            columns.append((rel, tuple(cols) if cols is not None else t.type.names))
        return self._op(SqlJoinOp(tuple(types), query, tuple(columns)), handles, name)

    # --- elementwise ---------------------------------------------------------
    def unary(self, x: Tensor, op: str, arg: float | str = 0.0, name: str | None = None) -> Tensor:
        """Elementwise ``op`` (relu, gelu, silu, exp, neg, scale by ``arg``, cast to ``arg``, ...)."""
        return self._op(UnaryOp((self._t(x),), op, arg), (x,), name)

    def cast(self, x: Tensor, dtype: str, name: str | None = None) -> Tensor:
        return self.unary(x, "cast", dtype, name)

    def binary(self, x: Tensor, y: Tensor, op: str, name: str | None = None) -> Tensor:
        """Elementwise ``x op y`` with broadcasting: add, sub, mul, div, maximum, minimum; the comparisons
        equal, not_equal, less, less_equal, greater, greater_equal (a boolean result); logical_and,
        logical_or, logical_xor of booleans."""
        return self._op(BinaryOp((self._t(x), self._t(y)), op), (x, y), name)

    def add(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.binary(x, y, "add", name)

    def sub(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.binary(x, y, "sub", name)

    def mul(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.binary(x, y, "mul", name)

    def div(self, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        return self.binary(x, y, "div", name)

    def where(self, cond: Tensor, x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
        """``x`` where the boolean ``cond`` holds, else ``y`` (all three broadcast like NumPy)."""
        return self._op(WhereOp((self._t(cond), self._t(x), self._t(y))), (cond, x, y), name)

    def swiglu(self, a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
        """``silu(a) * b``."""
        return self._op(SwigluOp((self._t(a), self._t(b))), (a, b), name)

    # --- reductions and row-wise ops ------------------------------------------
    def _reduce(self, op: str, x: Tensor, axis: int | Sequence[int], keepdims: bool, name: str | None) -> Tensor:
        if isinstance(axis, Iterable) and not isinstance(axis, (str, bytes)):
            axes = tuple(axis)
        elif isinstance(axis, int) and not isinstance(axis, bool):
            axes = (axis,)
        else:
            raise GraphError(f"{op} takes an axis or a sequence of axes (integers); got axis={axis!r}.")
        return self._op(ReduceOp((self._t(x),), op, axes, keepdims), (x,), name)

    def sum(self, x: Tensor, axis: int | Sequence[int] = -1, keepdims: bool = False, name: str | None = None) -> Tensor:
        return self._reduce("sum", x, axis, keepdims, name)

    def max(self, x: Tensor, axis: int | Sequence[int] = -1, keepdims: bool = False, name: str | None = None) -> Tensor:
        return self._reduce("max", x, axis, keepdims, name)

    def min(self, x: Tensor, axis: int | Sequence[int] = -1, keepdims: bool = False, name: str | None = None) -> Tensor:
        return self._reduce("min", x, axis, keepdims, name)

    def mean(self, x: Tensor, axis: int | Sequence[int] = -1, keepdims: bool = False,
             name: str | None = None) -> Tensor:
        return self._reduce("mean", x, axis, keepdims, name)

    def logsumexp(self, x: Tensor, axis: int | Sequence[int] = -1, keepdims: bool = False,
                  name: str | None = None) -> Tensor:
        """log Σ exp(x) over ``axis``; a split of the axis is merged by ⊕ = logsumexp."""
        return self._reduce("logsumexp", x, axis, keepdims, name)

    def softmax(self, x: Tensor, axis: int = -1, name: str | None = None) -> Tensor:
        return self._op(SoftmaxOp((self._t(x),), axis), (x,), name)

    def rmsnorm(self, x: Tensor, w: Tensor, eps: float = 1e-6, name: str | None = None) -> Tensor:
        return self._op(RmsnormOp((self._t(x), self._t(w)), eps), (x, w), name)

    def layernorm(self, x: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5, name: str | None = None) -> Tensor:
        return self._op(LayernormOp((self._t(x), self._t(w), self._t(b)), eps), (x, w, b), name)

    def rope(self, x: Tensor, base: float = 10000.0, seq_ends: Sequence[int] | None = None,
             name: str | None = None, freq_dtype: str | None = None) -> Tensor:
        """Rotary embedding of x[batch, seq, heads, d_head] (rotate-half convention); ``freq_dtype``
        rounds the frequencies to that dtype (as a module whose frequency buffer is 16-bit computes them)."""
        ends = _ends(seq_ends)
        return self._op(RopeOp((self._t(x),), base, ends, freq_dtype=freq_dtype), (x,), name)

    def rope_table(self, x: Tensor, cos: Tensor, sin: Tensor, name: str | None = None) -> Tensor:
        """Rotary embedding of x[batch, seq, heads, d_head] by tables the graph computes,
        ``x·cos + rotate_half(x)·sin``: cos and sin [batch or 1, seq, d_head] in x's dtype (as a model's
        rotary module makes them from position ids at run time)."""
        return self._op(RopeTableOp((self._t(x), self._t(cos), self._t(sin))), (x, cos, sin), name)

    # --- layout ---------------------------------------------------------------
    def reshape(self, x: Tensor, shape: Sequence[int], name: str | None = None,
                dims: Sequence[str] | None = None) -> Tensor:
        """Row-major reshape; one dimension may be -1."""
        shape = list(shape)
        if shape.count(-1) > 1:
            raise GraphError(f"reshape takes at most one -1; got {tuple(shape)}.")
        if -1 in shape:
            known = 1
            for s in shape:
                known *= s if s != -1 else 1
            if known <= 0 or self._t(x).volume % known:
                raise GraphError(
                    f"reshape must preserve the number of elements; got {x.shape} ({self._t(x).volume} elements) "
                    f"-> {tuple(shape)}."
                )
            shape[shape.index(-1)] = self._t(x).volume // known
        return self._op(ReshapeOp((self._t(x),), tuple(shape), tuple(dims) if dims else None), (x,), name)

    def permute(self, x: Tensor, perm: Sequence[int], name: str | None = None) -> Tensor:
        perm = tuple(int(p) % x.rank if isinstance(p, int) and -x.rank <= p < x.rank else p for p in perm)
        return self._op(PermuteOp((self._t(x),), perm), (x,), name)  # type: ignore[arg-type]

    def transpose(self, x: Tensor, a: int = -2, b: int = -1, name: str | None = None) -> Tensor:
        a, b = normalize_axis("transpose", a, self._t(x)), normalize_axis("transpose", b, self._t(x))
        perm = list(range(x.rank))
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(x, perm, name)

    def slice(self, x: Tensor, axis: int, start: int, stop: int, name: str | None = None) -> Tensor:
        return self._op(SliceOp((self._t(x),), axis, start, stop), (x,), name)

    def concat(self, xs: Sequence[Tensor], axis: int = 0, name: str | None = None) -> Tensor:
        if not xs:
            raise GraphError("concat needs at least one tensor; got none.")
        return self._op(ConcatOp(tuple(self._t(x) for x in xs), axis), tuple(xs), name)

    def embedding(self, table: Tensor, ids: Tensor, name: str | None = None) -> Tensor:
        return self._op(EmbeddingOp((self._t(table), self._t(ids))), (table, ids), name)

    def embedding_grad(self, ids: Tensor, rows: Tensor, vocab: int, name: str | None = None) -> Tensor:
        """``[vocab, embed]``: row v the sum of the ``rows [..., embed]`` whose id is v (zeros for none)."""
        return self._op(EmbeddingGradOp((self._t(ids), self._t(rows)), vocab), (ids, rows), name)

    def put_rows(self, x: Tensor, ids: Tensor, values: Tensor, name: str | None = None) -> Tensor:
        """x with the rows of its first axis at ``ids`` (an int vector) replaced by ``values`` [len(ids),
        *x.shape[1:]] (torch's ``x[ids] = values``; the last of repeated ids wins)."""
        return self._op(PutRowsOp((self._t(x), self._t(ids), self._t(values))), (x, ids, values), name)

    # --- routing ----------------------------------------------------------------
    def topk(self, x: Tensor, k: int, largest: bool = True, name: str | None = None) -> tuple[Tensor, Tensor]:
        """``(values, indices)`` of the ``k`` largest (``largest=False``: smallest) entries along x's last
        axis, best first, NaN ranked above every number as ``torch.topk`` ranks it, equal values lower
        position first (torch promises no order there); the gradient flows to x through the values."""
        ids = self._op(TopkOp((self._t(x),), k, largest), (x,), f"{name}.indices" if name else None)
        return self.take_along(x, ids, name=name), ids

    def take_along(self, x: Tensor, ids: Tensor, name: str | None = None) -> Tensor:
        """``out[..., j] = x[..., ids[..., j]]`` (torch's ``gather`` along the last axis)."""
        return self._op(TakeAlongOp((self._t(x), self._t(ids))), (x, ids), name)

    def one_hot(self, ids: Tensor, classes: int, dtype: str = "float32", name: str | None = None) -> Tensor:
        """``[..., classes]`` rows of ``dtype`` (floating or bool): 1 at each id, 0 elsewhere (an id outside the
        classes: zeros)."""
        return self._op(OneHotOp((self._t(ids),), classes, canonical_dtype(dtype)), (ids,), name)

    # --- attention --------------------------------------------------------------
    def attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool | str = False,
                  seq_ends: Sequence[int] | None = None, scale: float | None = None,
                  key_padding: Tensor | Sequence[int] | None = None, mask: Tensor | None = None,
                  bias: Tensor | None = None, window: int | None = None, name: str | None = None,
                  softcap: float | None = None) -> Tensor:
        """Attention over q[b, s_q, hq, d], k/v[b, s_kv, hkv, d] (GQA; self- or cross-attention).

        ``causal``: False, True (seq_q == seq_kv), ``"top_left"`` (query i sees keys up to i, PyTorch
        SDPA's alignment) or ``"bottom_right"`` (the queries are the last seq_q positions: decoding after
        a key cache).  ``seq_ends``: packed sequences.  ``key_padding``: a boolean [b, s_kv] tensor, True
        for a real key (HF's ``attention_mask``), or one key length per batch row.  ``mask``: a boolean
        [b or 1, hq or 1, s_q, s_kv] tensor, True where a query may see a key.  ``bias``: a float tensor of
        that shape added to the scaled scores.  ``window``: keys at distance >= window are masked.
        ``softcap`` c: scaled scores squashed to c · tanh(s / c) before the bias (Gemma 2).  A query that
        sees no key gives 0."""
        extras: list[str] = []
        operands: list[Tensor] = [q, k, v]
        lengths = None
        if key_padding is not None:
            if isinstance(key_padding, Tensor):
                extras.append("key_padding")
                operands.append(key_padding)
            else:
                lengths = _lengths(key_padding)
        for label, t in (("mask", mask), ("bias", bias)):
            if t is not None:
                if not isinstance(t, Tensor):
                    raise GraphError(f"attention {label} must be a tensor of this graph; got {type(t).__name__}.")
                extras.append(label)
                operands.append(t)
        if isinstance(causal, (bool, np.bool_)):
            causal = bool(causal)
        op = AttentionOp(tuple(self._t(x) for x in operands), causal, _ends(seq_ends), scale, window,
                         lengths, tuple(extras), softcap)
        return self._op(op, tuple(operands), name)

    # --- convolution and pooling --------------------------------------------------------
    def conv(self, x: Tensor, w: Tensor, bias: Tensor | None = None, stride: int | Sequence[int] = 1,
             padding: int | str | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
             name: str | None = None) -> Tensor:
        """Convolution of x [batch, in_channels, *spatial] (1 to 3 spatial dimensions) with w [out_channels,
        in_channels/groups, *kernel], PyTorch's ``conv1d/2d/3d``: ``padding`` an integer, one per
        dimension, ``"valid"`` or ``"same"`` (stride 1, symmetric); ``bias`` [out_channels] is added."""
        return spatial.conv(self, x, w, bias, stride, padding, dilation, groups, name)

    def conv_transpose(self, x: Tensor, w: Tensor, bias: Tensor | None = None, stride: int | Sequence[int] = 1,
                       padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                       dilation: int | Sequence[int] = 1, groups: int = 1, name: str | None = None) -> Tensor:
        """Transposed convolution of x [batch, in_channels, *spatial] with w [in_channels, out_channels/groups,
        *kernel], PyTorch's ``conv_transpose1d/2d/3d``: the gradient of ``conv`` with respect to its input (the
        ``conv_grad`` operator, part dx), each output size ``(in - 1)·stride - 2·padding + dilation·(kernel -
        1) + output_padding + 1``; ``bias`` [out_channels] is added."""
        return spatial.conv_transpose(self, x, w, bias, stride, padding, output_padding, dilation, groups, name)

    def max_pool(self, x: Tensor, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
                 padding: int | Sequence[int] = 0, name: str | None = None, ceil_mode: bool = False) -> Tensor:
        """Max pooling of x [batch, channels, *spatial], PyTorch's ``max_pool1d/2d/3d`` (stride defaults to
        the kernel; padding pads with -inf)."""
        return spatial.pool(self, "max", x, kernel_size, stride, padding, True, name, ceil_mode)

    def avg_pool(self, x: Tensor, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
                 padding: int | Sequence[int] = 0, count_include_pad: bool = True, name: str | None = None,
                 ceil_mode: bool = False) -> Tensor:
        """Average pooling of x [batch, channels, *spatial], PyTorch's ``avg_pool1d/2d/3d``."""
        return spatial.pool(self, "avg", x, kernel_size, stride, padding, bool(count_include_pad), name, ceil_mode)

    # --- losses -------------------------------------------------------------------
    def cross_entropy(self, logits: Tensor, targets: Tensor, ignore_index: int | None = None,
                      reduction: str = "mean", name: str | None = None) -> Tensor:
        """Cross-entropy of ``logits[..., vocab]`` against integer ``targets[...]``, torch's
        ``F.cross_entropy``: per token ``logsumexp(logits) - logits[target]``, targets equal to
        ``ignore_index`` excluded; ``reduction`` is ``mean`` (over the counted tokens: NaN when none
        counts, as in torch), ``sum`` or ``none`` (per token).  The vocabulary may be split over devices
        in the forward and the gradient alike (see ``sql_specs.losses``)."""
        if reduction not in ("mean", "sum", "none"):
            raise GraphError(f"cross_entropy reduction must be 'mean', 'sum' or 'none'; got {reduction!r}.")
        lt, tt = self._t(logits), self._t(targets)
        lse = self.logsumexp(logits, axis=-1)
        tok = self._op(CrossEntropyOp((lt, lse.type, tt), ignore_index), (logits, lse, targets),
                       name if reduction == "none" else None)
        if reduction == "none":
            return tok
        every = tuple(range(tok.rank))
        if reduction == "sum":
            return self.sum(tok, axis=every, name=name)
        # each token's loss over the number counted, then summed: the mean, split over tokens like the sum
        count = self._op(TokenCountOp((tt,), ignore_index, lt.dtype), (targets,), None)
        return self.sum(self.div(tok, count), axis=every, name=name)

    def mse(self, a: Tensor, b: Tensor, reduction: str = "mean", name: str | None = None) -> Tensor:
        """Mean (or ``sum``) squared error of two tensors of one shape, torch's ``F.mse_loss``."""
        if reduction not in ("mean", "sum"):
            raise GraphError(f"mse reduction must be 'mean' or 'sum'; got {reduction!r}.")
        if self._t(a).shape != self._t(b).shape:
            raise GraphError(f"mse needs a and b of one shape; got {a.shape} and {b.shape}.")
        sq = self.unary(self.sub(a, b), "square")
        return self._reduce(reduction, sq, tuple(range(sq.rank)), False, name)

    # --- random -------------------------------------------------------------------
    def dropout(self, x: Tensor, rng: Tensor, p: float, stream: int, name: str | None = None) -> Tensor:
        """Train-mode dropout, ``x · keep / (1 - p)`` with keep drawn per element of x's full shape by the
        counter-based generator of ``sql_specs.random`` from ``rng`` (an int64 [2] tensor: seed, offset) and
        ``stream`` (one per dropout site): every plan and executor draws the same mask."""
        return self._op(DropoutOp((self._t(x), self._t(rng)), p, stream), (x, rng), name)

    def random(self, rng: Tensor, shape: Sequence[int], dtype: object = "float32", stream: int = 0,
               distribution: str = "uniform", p: float = 0.5, name: str | None = None) -> Tensor:
        """A tensor of ``shape`` drawn from ``rng`` (int64 [2]: seed, offset) and ``stream``: ``uniform``
        values in [0, 1), or ``bernoulli`` 1.0 with probability ``p`` and 0.0 otherwise."""
        if isinstance(shape, Iterable) and not isinstance(shape, (str, bytes)):
            shape = tuple(shape)
        op = RandomOp((self._t(rng),), shape, canonical_dtype(dtype), stream, distribution, p)  # type: ignore[arg-type]
        return self._op(op, (rng,), name)

    # --- gradients -------------------------------------------------------------------
    def grad(self, loss: Tensor, wrt: Sequence[Tensor] | Tensor, allow_unused: bool = False) -> list[Tensor]:
        """The gradients of the scalar ``loss`` with respect to each tensor of ``wrt``, appended to this
        graph as operators (save them with ``g.save``).  A tensor no output depends on is refused, or gets
        zeros with ``allow_unused=True``; see ``graph.autodiff``."""
        return _grad(self, loss, wrt, allow_unused)

    def vjp(self, outputs: Sequence[Tensor] | Tensor, cotangents: Sequence[Tensor] | Tensor,
            wrt: Sequence[Tensor] | Tensor, allow_unused: bool = False) -> list[Tensor]:
        """The gradients with respect to ``wrt`` of ``Σ_i <outputs[i], cotangents[i]>`` (a vector-Jacobian
        product: the cotangents are tensors of the outputs' shapes, graph inputs or computed)."""
        return _vjp(self, outputs, cotangents, wrt, allow_unused)

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Operators made inside ``with g.recompute():`` are computed again in the backward
        (``g.grad``) from the region's inputs, instead of holding their outputs from the forward until the
        backward reads them: activation checkpointing, memory for compute.  The region's outputs (tensors
        read after it) are kept: they are the checkpoints the next region recomputes from."""
        was, self._recomputing = self._recomputing, max(self.recomputed.values(), default=0) + 1
        try:
            yield
        finally:
            self._recomputing = was

    def apply(self, op: Operator, *operands: Tensor, name: str | None = None) -> Tensor:
        """Append the abstract operator ``op`` applied to ``operands`` (whose types it was built from)."""
        if not isinstance(op, Operator):
            raise GraphError(f"apply takes an Operator; got {type(op).__name__}.")
        if len(operands) != len(op.input_types) or any(self._t(t) != ty for t, ty in zip(operands, op.input_types)):
            raise GraphError(f"{op.kind} was built for inputs {[str(t) for t in op.input_types]}; got "
                             f"{[str(t.type) if isinstance(t, Tensor) else repr(t) for t in operands]}.")
        return self._op(op, operands, name)

    def tensor(self, node_id: int) -> Tensor:
        """The handle of node ``node_id``."""
        if not isinstance(node_id, int) or not 0 <= node_id < len(self.nodes):
            raise GraphError(f"no node {node_id!r}; the graph has nodes 0..{len(self.nodes) - 1}.")
        return Tensor(self, node_id)

    def producer(self, t: Tensor) -> tuple[Operator | None, tuple[Tensor, ...]]:
        """The operator that makes ``t`` (None for a graph input) and the tensors it reads."""
        node = self.nodes[self._own_id(t)]
        return node.op, tuple(Tensor(self, i) for i in node.inputs)

    def source_op(self, tensor_id: int) -> int | None:
        """The operator whose output a reader of ``tensor_id`` reads: its producer, or for an assigned
        state, the operator that computed its value in the previous execution (a *carried* edge,
        priced like any other edge from that operator); None for inputs, parameters and states
        never assigned."""
        node = self.nodes[tensor_id]
        if node.op is not None:
            return tensor_id
        return self.assignments.get(tensor_id)

    def fingerprint(self) -> str:
        """A sha256 of the whole graph, names included: every node (name, role, operator with its
        parameters, type, inputs), the saved outputs, the assignments and the recompute regions.  Equal
        graphs, equal fingerprint, in any process."""
        h = hashlib.sha256()
        shown: dict[object, str] = {}  # equal operators (identical layers) are written out once
        for n in self.nodes:
            op = shown.get(n.op) if n.op is not None else "-"
            if op is None:
                op = shown[n.op] = repr(n.op)
            h.update(f"{n.name}\0{n.role}\0{op}\0{n.type!r}\0{n.inputs}\n".encode())
        h.update(repr((sorted(self.outputs.items()), sorted(self.assignments.items()),
                       sorted(self.recomputed.items()))).encode())
        return h.hexdigest()

    def next_names(self) -> dict[str, int]:
        """The saved name ``<state>.next`` of each assigned state -> the state's node id."""
        return {f"{self.nodes[s].name}.next": s for s in self.assignments}

    def trainable(self) -> list[Tensor]:
        """The floating parameters and states, in declaration order (what ``grad`` usually takes)."""
        return [Tensor(self, n.id) for n in self.nodes
                if n.role in ("parameter", "state") and n.type.dtype in FLOAT_DTYPES]

    def memory_categories(self) -> list[str]:
        """What each tensor is, by node id, for memory reports: ``parameters``, ``optimizer state`` (a
        state's next value counts as the state), ``inputs``, ``gradients`` (made by autodiff), ``optimizer
        update`` (its temporaries), ``activations for the backward`` (forward tensors a gradient operator
        reads), or ``other``."""
        readers = self.consumers()
        out = []
        for n in self.nodes:
            if n.op is None:
                out.append("optimizer state" if n.id in self.optimizer_states
                           else "inputs" if n.role == "input" else "parameters")
            elif n.name.startswith("grad."):
                out.append("gradients")
            elif n.name.startswith("optim."):
                out.append("optimizer update")
            elif any(self.nodes[c].name.startswith("grad.") for c in readers[n.id]):
                out.append("activations for the backward")
            else:
                out.append("other")
        for state, value in self.assignments.items():  # a state's next value is the state's
            out[value] = out[state]
        return out

    # --- inspection ---------------------------------------------------------------
    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op is None]

    @property
    def operators(self) -> list[Node]:
        return [n for n in self.nodes if n.op is not None]

    def consumers(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def node(self, name: str) -> Node:
        """The node named ``name``, through an index of names rebuilt when it misses (nodes added or renamed)."""
        index: dict[str, int] = self.__dict__.setdefault("_by_name", {})
        i = index.get(name)
        if i is None or i >= len(self.nodes) or self.nodes[i].name != name:
            index.clear()
            for k, n in enumerate(self.nodes):
                index.setdefault(n.name, k)  # (the first of a name, as a scan finds it)
            i = index.get(name)
        if i is None:
            raise GraphError(f"no node named {name!r}; nodes are {[n.name for n in self.nodes]}.")
        return self.nodes[i]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        lines = []
        for n in self.nodes:
            args = ", ".join(self.nodes[i].name for i in n.inputs)
            saved = [k for k, v in self.outputs.items() if v == n.id]
            tail = f"  -> saved as {', '.join(saved)}" if saved else ""
            lines.append(f"{n.name:<16} = {n.kind}({args}) : {n.type}{tail}")
        return "\n".join(lines)

    # --- internals ----------------------------------------------------------------
    def _t(self, t: object) -> TensorType:
        self._own(t)
        assert isinstance(t, Tensor)  # _own refuses anything else
        return t.type

    def _own_id(self, t: object) -> int:
        self._own(t)
        assert isinstance(t, Tensor)
        return t.id

    def _own(self, t: object) -> None:
        if not isinstance(t, Tensor) or t.graph is not self:
            raise GraphError(f"operands must be tensors of this graph; got {t!r}.")

    def _fresh(self, name: str | None, kind: str) -> str:
        if name is None:
            n = len(self.nodes)
            kind = self.name_scope + kind
            name = f"{kind}_{n}"
            while name in self._names:
                n += 1
                name = f"{kind}_{n}"
        elif name in self._names:
            raise GraphError(f"node names must be unique; {name!r} is already used.")
        self._names.add(name)
        return name

    def _leaf(self, name: str, t: TensorType, role: str) -> Tensor:
        if not isinstance(name, str) or not name:
            raise GraphError(f"inputs need a non-empty name; got {name!r}.")
        node = Node(len(self.nodes), self._fresh(name, role), t, None, (), role)
        self.nodes.append(node)
        return Tensor(self, node.id)

    def _op(self, op: Operator, operands: Sequence[Tensor], name: str | None) -> Tensor:
        for t in operands:
            self._own(t)
        node = Node(len(self.nodes), self._fresh(name, op.kind), op.output_type, op, tuple(t.id for t in operands))
        self.nodes.append(node)
        if self._recomputing:
            self.recomputed[node.id] = self._recomputing
        return Tensor(self, node.id)


def createGraph() -> Graph:
    """The paper's spelling of ``Graph()``."""
    return Graph()


def _lengths(values: Sequence[int]) -> tuple[int, ...]:
    """Key lengths per batch row, as a tuple of integers."""
    try:
        return tuple(operator.index(n) for n in values)
    except TypeError:
        raise GraphError(f"attention key_padding takes a boolean [batch, seq_kv] tensor or one integer key "
                         f"length per batch row; got {values!r}.") from None


def _ends(seq_ends: object) -> Any:
    """``seq_ends`` as a tuple when it is a sequence (the operator checks it; anything else it refuses)."""
    if isinstance(seq_ends, Iterable) and not isinstance(seq_ends, (str, bytes)):
        return tuple(seq_ends)
    return seq_ends

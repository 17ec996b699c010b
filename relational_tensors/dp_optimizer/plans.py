"""Hand-written parallel plans as named constraint sets, to compare with the optimizer's plan in SQL.

Each function reads the structure of a graph (which tensors are data, which are weights, which index of
each operator carries which dimension of its inputs) and returns the constraints
(``compileGraph(graph, constraints=...)``) that express a well-known strategy on ``p`` devices; names
are never looked at, so the plans apply to any graph of the same shape of computation:

* :func:`data_parallel`: every operator that has a batch index splits it (the rest of the plan, such
  as the weight updates, is the optimizer's), weights read whole;
* :func:`megatron_tp`: Megatron-LM tensor parallelism. A weight matmul whose activation arrives
  unsplit is column-parallel (its weight's output features split), one whose activation arrives split
  on the contracted features is row-parallel (a partial sum, combined once); the operators between
  them (rope, attention over heads, SwiGLU) keep the features split, and in a training graph the
  gradients follow the same rule, which is Megatron's backward;
* :func:`sequence_parallel`: Megatron tensor parallelism plus the operators it leaves unsplit
  (norms, residual adds) split over the sequence, as Megatron-LM's sequence parallelism does;
* :func:`ddp`, :func:`fsdp` (alias :func:`zero3`): data parallelism of a training step with every state
  replicated (``R``) or sharded on its first dimension (``S(0)``, gathered for each reader);
* :func:`megatron_dp`, :func:`fsdp_tp`: two dimensions, tensor parallelism inside groups of ``tp`` devices
  (a node) and data parallelism across them, the states replicated across the groups or sharded over all;
* :func:`expert_parallel`: a mixture of experts split over its experts (the first dimension of the
  stacked expert weights, rank 3, and everything computed from them);
* :func:`expert_tensor_parallel`: Megatron tensor parallelism inside every expert, the experts whole.

The batch dimension is the first dimension of the graph's data inputs (role ``input``, rank 2 or
more), the sequence dimension their second.  A count that an operator cannot split exactly (fewer kv
heads than devices) takes the largest divisor of ``p`` it allows and leaves the remaining factor to the
optimizer.

>>> import relational_tensors as rt
>>> from relational_tensors.graph.models import llama_block
>>> g = llama_block(1, 64, 64, 8, 8, 128)
>>> plan = megatron_tp(g, 8)
>>> plan["q_proj"], plan["attention"], plan["o_proj"], plan["down_proj"]
('k=8', 'heads_kv=8', 'j=8', 'j=8')
"""

from __future__ import annotations

from collections.abc import Sequence

from relational_tensors.dp_optimizer.candidates import specs_for
from relational_tensors.errors import GraphError
from relational_tensors.graph.graph import Graph, Node
from relational_tensors.sql_specs.base import Operator

__all__ = ["batch_indices", "batch_sums", "data_parallel", "megatron_tp", "sequence_parallel", "ddp", "fsdp", "zero3",
           "megatron_dp", "fsdp_tp", "expert_parallel", "expert_tensor_parallel", "PLANS"]

_MATMULS = ("matmul", "einsum", "grouped_matmul")


def _index_dims(op: Operator) -> dict[str, tuple[list[tuple[int, ...]], tuple[int, ...]]]:
    """Per requestable index of an operator: the dimensions of each input, and of the output, it splits
    (found by splitting it in two: the structure of the operator's own join-agg spec)."""
    out: dict[str, tuple[list[tuple[int, ...]], tuple[int, ...]]] = {}
    whole = op.spec({}).functions[0]  # the blocks read unsplit (a slice reads part of its input even so)
    for index in op.requestable():
        ivs = index.near_equal(2)
        if ivs is None:
            continue
        f = op.spec({index.name: ivs}).functions[0]
        ins = [tuple(d for d, (a, b) in enumerate(zip(f.inputs[k].shape, whole.inputs[k].shape)) if a < b)
               for k in range(len(op.input_types))]
        out[index.name] = (ins, tuple(d for d, (a, b) in enumerate(zip(f.output.shape, whole.output.shape))
                                      if a < b))
    return out


class _Graph:
    """The structure the plans read: index maps, weights and data inputs, and the splits each operator
    offers on ``p`` devices."""

    def __init__(self, graph: Graph, p: int) -> None:
        if not isinstance(graph, Graph):
            raise GraphError(f"a hand plan is built from an rt.Graph; got {type(graph).__name__}.")
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise GraphError(f"a hand plan is built for p >= 1 devices; got p={p!r}.")
        self.graph, self.p = graph, p
        self.dims: dict[int, dict[str, tuple[list[tuple[int, ...]], tuple[int, ...]]]] = {}
        found: dict[Operator, dict[str, tuple[list[tuple[int, ...]], tuple[int, ...]]]] = {}  # equal layers' ops
        for n in graph.operators:
            assert n.op is not None
            dims = found.get(n.op)
            if dims is None:
                dims = found[n.op] = _index_dims(n.op)
            self.dims[n.id] = dims
        weight = {n.id for n in graph.inputs if n.role in ("parameter", "state")}
        for n in graph.operators:  # a weight, or computed from weights only (a cast of one)
            if n.inputs and all(i in weight for i in n.inputs):
                weight.add(n.id)
        self.weight = weight
        self.data = [n for n in graph.inputs if n.role == "input" and n.type.rank >= 2]

    def count(self, node: Node, index: str) -> int | None:
        """The largest divisor of p (above 1) that ``node`` offers a spec for with ``index`` split so."""
        offered = {dict(s.split).get(index, 1) for _, s in specs_for(node.op, self.p)}  # type: ignore[arg-type]
        return max((n for n in offered if n > 1 and self.p % n == 0), default=None)

    def experts(self) -> dict[int, set[int]]:
        """The stacked expert weights (weights, or tensors computed from weights only such as their casts, of
        rank 3 or more that a matrix product reads): their first dimension, the experts."""
        read = {i for n in self.graph.operators if n.op is not None and n.op.kind in _MATMULS for i in n.inputs}
        return {n.id: {0} for n in self.graph.nodes if n.id in self.weight and n.type.rank >= 3 and n.id in read}

    def carried(self, dim: int, seeds: dict[int, set[int]] | None = None) -> dict[int, set[int]]:
        """Per tensor, its dimensions that carry dimension ``dim`` of the data inputs (or the dimensions
        ``seeds`` marks, per tensor)."""
        marked: dict[int, set[int]] = dict(seeds) if seeds is not None else \
            {n.id: {dim} for n in self.data if dim < n.type.rank}
        for n in self.graph.operators:
            hits = self._indices(n, marked)
            outs = {d for x in hits for d in self.dims[n.id][x][1]}
            if outs:
                marked[n.id] = outs
        return marked

    def _indices(self, n: Node, marked: dict[int, set[int]]) -> list[str]:
        """The indices of operator ``n`` that split a marked dimension of one of its inputs."""
        return [x for x, (ins, _) in self.dims[n.id].items()
                if any(set(ins[k]) & marked.get(i, set()) for k, i in enumerate(n.inputs))]

    def along(self, dim: int, only: Sequence[Node] | None = None,
              seeds: dict[int, set[int]] | None = None) -> dict[str, str]:
        """Each operator (of ``only``) split along the indices carrying data dimension ``dim`` (or the
        dimensions ``seeds`` marks): the widest."""
        marked = self.carried(dim, seeds)
        out: dict[str, str] = {}
        for n in self.graph.operators if only is None else only:
            best = None
            for x in self._indices(n, marked):
                c = self.count(n, x)
                if c is not None and (best is None or c > best[1]):
                    best = (x, c)
            if best is not None:
                out[n.name] = f"{best[0]}={best[1]}"
        return out


def batch_indices(graph: Graph) -> dict[int, str]:
    """Per operator that carries the batch (the first dimension of the data inputs, through every tensor
    computed from them), the index that cuts it: one that splits exactly the batch dimension of every input
    that carries it.  An operator that mixes the batch has none."""
    return _batch_indices(_Graph(graph, 1))


def _batch_indices(g: _Graph) -> dict[int, str]:
    graph = g.graph
    marked = g.carried(0)
    out: dict[int, str] = {}
    for n in graph.operators:
        for x in g._indices(n, marked):
            ins, _ = g.dims[n.id][x]
            if all(set(ins[k]) == marked[i] for k, i in enumerate(n.inputs) if marked.get(i)):
                out[n.id] = x
                break
    return out


def batch_sums(graph: Graph) -> set[int]:
    """The operators that sum over the batch: their batch index (``batch_indices``) splits inputs but not
    the output (a weight's gradient, a loss summed over tokens).  Under micro-batches each makes one partial
    sum per micro-batch, which its device holds until the last one is added.

    >>> from relational_tensors.graph.graph import Graph
    >>> g = Graph()
    >>> x, w = g.input("x", (8, 4)), g.parameter("w", (4, 3))
    >>> y = g.save(g.matmul(x, w, name="y"))
    >>> dw = g.save(g.einsum("bi,bj->ij", x, y, name="dw"))
    >>> sorted(g.nodes[n].name for n in batch_sums(g))
    ['dw']
    """
    g = _Graph(graph, 1)
    return {op for op, x in _batch_indices(g).items() if not g.dims[op][x][1]}


def data_parallel(graph: Graph, p: int) -> dict[str, str]:
    """Every operator with a batch index split along it (the largest count up to ``p`` it offers)."""
    return _Graph(graph, p).along(0)


def megatron_tp(graph: Graph, p: int) -> dict[str, str]:
    """Megatron-LM tensor parallelism: column-parallel then row-parallel weight matmuls, the features
    split in between (see the module's docstring)."""
    return _megatron(_Graph(graph, p))[0]


def _megatron(s: _Graph, keep: dict[int, set[int]] | None = None) -> tuple[dict[str, str], list[Node]]:
    """The tensor-parallel constraints, and the operators they leave to the optimizer; no index that
    splits a dimension ``keep`` marks (per tensor) is chosen."""
    keep = keep or {}

    def allowed(n: Node, x: str) -> bool:
        ins = s.dims[n.id][x][0]
        return not any(set(ins[k]) & keep.get(i, set()) for k, i in enumerate(n.inputs))

    split: dict[int, int] = {}  # tensor -> its dimension split over the devices
    out: dict[str, str] = {}
    free: list[Node] = []
    for n in s.graph.operators:
        dims = s.dims[n.id]
        acts = [k for k, i in enumerate(n.inputs) if i not in s.weight]
        weights = [k for k, i in enumerate(n.inputs) if i in s.weight]
        choice = None
        sharded = [(k, split[n.inputs[k]]) for k in acts if n.inputs[k] in split]
        if sharded:  # keep the features split (row-parallel where the index is contracted)
            for k, d in sharded:
                for x, (ins, _) in dims.items():
                    if d in ins[k] and s.count(n, x) and allowed(n, x):
                        choice = x
                        break
                if choice:
                    break
        elif n.op is not None and n.op.kind in _MATMULS and acts and weights:  # column-parallel
            k = acts[0]
            for x, (ins, o) in dims.items():
                if o and not ins[k] and any(ins[w] for w in weights) and s.count(n, x) and allowed(n, x):
                    choice = x
                    break
        if choice is None:
            free.append(n)
            continue
        out[n.name] = f"{choice}={s.count(n, choice)}"
        if dims[choice][1]:
            split[n.id] = dims[choice][1][0]
    return out, free


def sequence_parallel(graph: Graph, p: int) -> dict[str, str]:
    """Megatron tensor parallelism, and the operators it leaves unsplit split over the sequence."""
    s = _Graph(graph, p)
    tp, free = _megatron(s)
    return {**s.along(1, free), **tp}


def stacked_weights(graph: Graph) -> bool:
    """Whether a matrix product reads a weight of rank 3 or more (or a cast of one): a cheap test, made before
    the index maps a hand plan reads, that the graph may hold a mixture of experts."""
    stacked = {n.id for n in graph.inputs if n.role in ("parameter", "state") and n.type.rank >= 3}
    for n in graph.operators:
        if n.op is not None and n.op.kind == "unary" and n.inputs[0] in stacked:
            stacked.add(n.id)
        elif n.op is not None and n.op.kind in _MATMULS and stacked.intersection(n.inputs):
            return True
    return False


def expert_parallel(graph: Graph, p: int) -> dict[str, str]:
    """Expert parallelism of a mixture of experts: every operator that carries the experts (the first
    dimension of the stacked expert weights, and what is computed from them) split along it, as many ways
    as the experts allow up to ``p``; the rest, and the factor of ``p`` the experts leave, the optimizer's.
    The gathers into and out of experts' buffers (``routed_gather``) are left to the optimizer too: the
    buffers reach the experts' devices by a repartition (the all-to-all), not by splitting a gather over
    the experts' rows, which would sum every row over the devices."""
    if not stacked_weights(graph):
        return {}
    s = _Graph(graph, p)
    kinds = {n.name: n.op.kind for n in graph.operators if n.op is not None}
    return {name: split for name, split in s.along(0, seeds=s.experts()).items() if kinds.get(name) != "routed_gather"}


def expert_tensor_parallel(graph: Graph, p: int) -> dict[str, str]:
    """Megatron tensor parallelism inside each expert: every expert's intermediate features split (column-
    then row-parallel), the experts never; the router and the rest as Megatron's rule leaves them."""
    s = _Graph(graph, p)
    return _megatron(s, keep=s.experts())[0]


def _states(graph: Graph, layout: str) -> dict[str, str]:
    return {n.name: layout for n in graph.inputs if n.role == "state"}


def ddp(graph: Graph, p: int) -> dict[str, str]:
    """Data parallelism of a training step, every state (parameters, master weights, moments) replicated."""
    return {**_states(graph, "R"), **data_parallel(graph, p)}


def fsdp(graph: Graph, p: int) -> dict[str, str]:
    """Data parallelism of a training step, every state sharded on its first dimension and gathered for
    each reader (FSDP's full sharding, ZeRO stage 3)."""
    return {**_states(graph, "S(0)"), **data_parallel(graph, p)}


zero3 = fsdp


def megatron_dp(graph: Graph, p: int, tp: int = 8) -> dict[str, str]:
    """Megatron-LM's two-dimensional layout: tensor parallelism over groups of ``tp`` devices (one NVLink
    node of eight by default) and data parallelism over the ``p // tp`` groups; each weight split as its
    group reads it and replicated across the groups (as Megatron's data-parallel replicas hold it).  An
    operator tensor parallelism leaves unsplit takes the data split alone, and the rest of ``p``, the
    optimizer's."""
    tp_plan, dp_plan = _two_dimensional(graph, p, tp)
    return _joined(tp_plan, dp_plan)


def fsdp_tp(graph: Graph, p: int, tp: int = 8) -> dict[str, str]:
    """:func:`megatron_dp` with every state sharded on its first dimension over all ``p`` devices and
    gathered for its readers (FSDP across the groups, tensor parallelism inside them: torchtitan's 2-D)."""
    return {**_states(graph, "S(0)"), **megatron_dp(graph, p, tp)}


def _two_dimensional(graph: Graph, p: int, tp: int) -> tuple[dict[str, str], dict[str, str]]:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or not isinstance(p, int) or p % tp:
        raise GraphError(f"a two-dimensional plan needs tp dividing p (tensor-parallel groups of tp devices); "
                         f"got tp={tp!r}, p={p!r}.")
    return megatron_tp(graph, tp), data_parallel(graph, p // tp)


def _joined(*plans: dict[str, str]) -> dict[str, str]:
    """Per operator, the splits of every plan together (counts of one index multiplied)."""
    out: dict[str, dict[str, int]] = {}
    for plan in plans:
        for name, text in plan.items():
            splits = out.setdefault(name, {})
            for part in text.split(","):
                index, _, count = part.partition("=")
                splits[index] = splits.get(index, 1) * int(count)
    return {name: ",".join(f"{k}={v}" for k, v in splits.items()) for name, splits in out.items()}

# the hand plans by name (bench/hand_plans.py, the CLI's --plan)
PLANS = {"data_parallel": data_parallel, "megatron_tp": megatron_tp, "sequence_parallel": sequence_parallel,
         "ddp": ddp, "fsdp": fsdp, "zero3": zero3, "megatron_dp": megatron_dp, "fsdp_tp": fsdp_tp,
         "expert_parallel": expert_parallel, "expert_tensor_parallel": expert_tensor_parallel}

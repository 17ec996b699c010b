"""Operators defined by a SQL join-aggregate over tensor relations.

Each tensor is a relation with one column per dimension and a value column
``v``.  The query is parsed with sqlglot into the operator's indices: join
keys become shared indices, GROUP BY keys the output indices, the other
dimension columns contracted indices; the aggregate (SUM, MAX, MIN) is ⊕ and its
argument the per-tuple expression.  Every index splits anywhere.

    SELECT A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from relational_tensors.core.aggregation import AGGREGATIONS, SUM, Aggregation
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.core.types import Box, TensorType
from relational_tensors.errors import GraphError
from relational_tensors.sql_specs.base import Builder, Grads, IndexedOp, register
from relational_tensors.sql_specs.common import same_dtype
from relational_tensors.sql_specs.grad import einsum_grads, not_differentiable

__all__ = ["SqlJoinOp", "parse_join_query", "ParsedQuery"]

_FUNCS: dict[str, Callable[..., np.ndarray]] = {
    "exp": np.exp, "ln": np.log, "log": np.log, "sqrt": np.sqrt, "abs": np.abs,
    "greatest": np.maximum, "least": np.minimum, "pow": np.power, "power": np.power,
}
_BINOPS: dict[type, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    exp.Add: np.add, exp.Sub: np.subtract, exp.Mul: np.multiply, exp.Div: np.divide,
}


@dataclass(frozen=True)
class ParsedQuery:
    """What a join-aggregate query means as an operator."""

    dims: tuple[tuple[str, ...], ...]  # per relation, the index of each dimension
    out: tuple[str, ...]               # output indices (GROUP BY keys) in SELECT order
    out_names: tuple[str, ...]         # output dimension names (aliases)
    agg: str | None                    # sum / max / min, or None for a pure join
    expr: exp.Expression               # the per-tuple value expression
    relations: tuple[str, ...]         # relation names, operand order


def _unsupported(what: str, query: str) -> GraphError:
    return GraphError(
        f"SQL operators support SELECT <keys>, SUM|MAX|MIN(<expr>) FROM A JOIN B ON A.x = B.y ... GROUP BY <keys>; "
        f"got an unsupported {what} in {query!r}."
    )


@functools.lru_cache(maxsize=256)
def parse_join_query(query: str, columns: tuple[tuple[str, tuple[str, ...]], ...],
                     shapes: tuple[tuple[int, ...], ...]) -> ParsedQuery:
    """Parse ``query`` over relations ``columns`` (name, dimension column names) of the given shapes."""
    try:
        tree = sqlglot.parse_one(query, dialect="duckdb")
    except ParseError as e:
        raise GraphError(f"the SQL operator's query does not parse: {str(e).splitlines()[0]}; got {query!r}.") from None
    if not isinstance(tree, exp.Select):
        raise _unsupported(f"statement {type(tree).__name__.upper()}", query)
    for key in ("where", "having", "order", "limit", "distinct", "qualify", "with", "offset"):
        if tree.args.get(key):
            raise _unsupported(key.upper() + " clause", query)

    rel_cols = {name: cols for name, cols in columns}
    alias_to_rel: dict[str, str] = {}

    def add_table(t: exp.Expression) -> None:
        if not isinstance(t, exp.Table):
            raise _unsupported(f"FROM item {t.sql()}", query)
        name = t.name
        if name not in rel_cols:
            raise GraphError(f"the query reads relation {name!r}, but the tensors given are {sorted(rel_cols)}.")
        alias = t.alias or name
        if name in alias_to_rel.values():
            raise GraphError(f"relation {name!r} appears twice; pass the tensor twice under two names for a self-join.")
        alias_to_rel[alias] = name

    frm = tree.args.get("from_") or tree.args.get("from")
    if frm is None:
        raise _unsupported("query without FROM", query)
    add_table(frm.this)
    equalities: list[tuple[exp.Column, exp.Column]] = []
    for j in tree.args.get("joins") or []:
        if j.args.get("side") or (j.args.get("kind") or "").upper() not in ("", "INNER", "CROSS"):
            raise _unsupported(f"{j.args.get('side') or j.args.get('kind')} JOIN", query)
        if j.args.get("using"):
            raise _unsupported("JOIN ... USING", query)
        add_table(j.this)
        on = j.args.get("on")
        conds = list(on.flatten()) if isinstance(on, exp.And) else ([on] if on is not None else [])
        for c in conds:
            if not (isinstance(c, exp.EQ) and isinstance(c.this, exp.Column) and isinstance(c.expression, exp.Column)):
                raise _unsupported(f"join condition {c.sql()}", query)
            equalities.append((c.this, c.expression))
    unused = sorted(set(rel_cols) - set(alias_to_rel.values()))
    if unused:
        raise GraphError(f"every tensor passed to sql must appear in FROM/JOIN; {unused} do not in {query!r}.")

    def resolve(col: exp.Column) -> tuple[str, str]:
        table = col.table
        if not table:
            owners = [a for a, r in alias_to_rel.items() if col.name in (*rel_cols[r], "v")]
            if len(owners) != 1:
                raise GraphError(f"column {col.name!r} must be qualified by its relation (A.{col.name}) in {query!r}.")
            table = owners[0]
        if table not in alias_to_rel:
            raise GraphError(f"unknown relation {table!r} in column {col.sql()}; relations: {sorted(alias_to_rel)}.")
        rel = alias_to_rel[table]
        if col.name != "v" and col.name not in rel_cols[rel]:
            raise GraphError(
                f"relation {rel} has columns {[*rel_cols[rel], 'v']}; got {col.sql()}. Name tensor dimensions "
                f"with dims=... or pass {rel}=(tensor, (names...))."
            )
        return rel, col.name

    # union-find over dimension columns
    parent: dict[tuple[str, str], tuple[str, str]] = {}
    order = [r for r, _ in columns]
    shape_of = {r: dict(zip(cols, shp)) for (r, cols), shp in zip(columns, shapes)}

    def find(x: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for rel in order:
        for c in rel_cols[rel]:
            find((rel, c))
    for a, b in equalities:
        ra, rb = resolve(a), resolve(b)
        if "v" in (ra[1], rb[1]):
            raise _unsupported(f"join on the value column ({a.sql()} = {b.sql()})", query)
        if shape_of[ra[0]][ra[1]] != shape_of[rb[0]][rb[1]]:
            raise GraphError(
                f"joined dimensions must have equal sizes; got {a.sql()} of size {shape_of[ra[0]][ra[1]]} "
                f"= {b.sql()} of size {shape_of[rb[0]][rb[1]]}."
            )
        parent[find(ra)] = find(rb)

    # SELECT list: keys and one value expression
    keys: list[tuple[str, str]] = []
    value: exp.Expression | None = None
    agg: str | None = None
    for item in tree.expressions:
        inner = item.unalias()
        alias = item.alias_or_name
        if isinstance(inner, exp.Column) and inner.name != "v":
            keys.append((alias, resolve(inner)[0] + "." + inner.name))
            continue
        if value is not None:
            raise _unsupported("second value expression in SELECT", query)
        if isinstance(inner, exp.AggFunc):
            name = inner.key.lower()
            if name not in ("sum", "max", "min"):
                raise _unsupported(f"aggregate {name.upper()} (use SUM, MAX or MIN)", query)
            agg, value = name, inner.this
        else:
            value = inner
    if value is None:
        raise _unsupported("query without a value expression (SELECT ..., SUM(A.v * B.v) AS v)", query)

    classes: dict[tuple[str, str], str] = {}
    used: set[str] = set()

    def class_name(root: tuple[str, str], preferred: str) -> str:
        if root not in classes:
            name, n = preferred, 1
            while name in used:
                n += 1
                name = f"{preferred}{n}"
            classes[root] = name
            used.add(name)
        return classes[root]

    out, out_names = [], []
    for alias, ref in keys:
        rel, col = ref.split(".", 1)
        root = find((rel, col))
        if root in classes:
            raise GraphError(f"an output index appears twice in SELECT ({ref}) of {query!r}.")
        out.append(class_name(root, alias))
        out_names.append(alias)
    group = tree.args.get("group")
    if agg is not None:
        grouped = {find(resolve(c)) for c in (group.expressions if group else []) if isinstance(c, exp.Column)}
        selected = {find(tuple(ref.split(".", 1))) for _, ref in keys}  # type: ignore[arg-type]
        if grouped != selected:
            raise GraphError(f"GROUP BY must list exactly the selected keys in {query!r}.")
    elif group:
        raise _unsupported("GROUP BY without an aggregate", query)
    for rel in order:
        for c in rel_cols[rel]:
            class_name(find((rel, c)), c)
    dims = tuple(tuple(classes[find((rel, c))] for c in rel_cols[rel]) for rel in order)
    if agg is None:
        missing = [n for n in classes.values() if n not in out]
        if missing:
            raise GraphError(
                f"without an aggregate every dimension must be selected; indices {missing} are not in {query!r}. "
                "Add SUM(...) and GROUP BY to contract them."
            )

    for node in value.walk():
        if isinstance(node, exp.Column):
            if resolve(node)[1] != "v":
                raise _unsupported(f"value expression on a key column ({node.sql()})", query)
        elif isinstance(node, exp.Literal):
            if node.is_string or not _finite_literal(node):
                raise _unsupported(f"literal {node.sql()} (a value expression takes finite numbers only)", query)
        elif isinstance(node, (exp.Paren, exp.Neg, *_BINOPS)):
            continue
        elif isinstance(node, exp.Func) and _func_name(node) in _FUNCS:
            continue
        elif isinstance(node, (exp.Identifier,)):
            continue
        else:
            raise _unsupported(f"expression {node.sql()}", query)
    # rewrite aliases to relation names so evaluation can find each value column
    value = value.copy()
    for node in value.find_all(exp.Column):
        node.set("table", exp.to_identifier(resolve(node)[0]))
    return ParsedQuery(dims, tuple(out), tuple(out_names), agg, value, tuple(order))


def _finite_literal(node: exp.Literal) -> bool:
    try:
        return math.isfinite(float(node.this))
    except ValueError:
        return False


def _func_name(node: exp.Func) -> str:
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    return node.key.lower()


def _evaluate(node: exp.Expression, values: dict[str, np.ndarray]) -> np.ndarray | float:
    if isinstance(node, exp.Column):
        return values[node.table]
    if isinstance(node, exp.Literal):
        return float(node.this)
    if isinstance(node, exp.Paren):
        return _evaluate(node.this, values)
    if isinstance(node, exp.Neg):
        return -_evaluate(node.this, values)  # type: ignore[operator]
    for cls, fn in _BINOPS.items():
        if isinstance(node, cls):
            return fn(_evaluate(node.this, values), _evaluate(node.expression, values))  # type: ignore[arg-type]
    args = [a for a in (node.this, node.args.get("expression"), *node.args.get("expressions", [])) if a is not None]
    return _FUNCS[_func_name(node)](*(_evaluate(a, values) for a in args))  # type: ignore[arg-type]


def _product_of_values(node: exp.Expression) -> list[str] | None:
    """The relations whose value columns multiply to ``node``, when it is such a product."""
    if isinstance(node, exp.Paren):
        return _product_of_values(node.this)
    if isinstance(node, exp.Column):
        return [node.table]
    if isinstance(node, exp.Mul):
        a, b = _product_of_values(node.this), _product_of_values(node.expression)
        return a + b if a is not None and b is not None else None
    return None


@register
@dataclass(frozen=True, eq=True)
class SqlJoinOp(IndexedOp):
    """An operator given by a SQL join-aggregate query; see the module docstring.

    >>> from relational_tensors.core.types import TensorType as T
    >>> q = "SELECT A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"
    >>> op = SqlJoinOp((T.zero((4, 6)), T.zero((6, 2))), q, (("A", ("i", "j")), ("B", ("j", "k"))))
    >>> op.signature(), str(op.aggregation)
    ('i j, j k -> i k', 'sum')
    """

    kind = "sql"
    contraction = True
    cost_family = "matmul"
    query: str = ""
    columns: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def parsed(self) -> ParsedQuery:
        for (rel, cols), t in zip(self.columns, self.input_types):
            if len(cols) != t.rank:
                raise GraphError(f"relation {rel} needs one column name per dimension of {t.shape}; got {cols}.")
        return parse_join_query(self.query, self.columns, tuple(t.shape for t in self.input_types))

    @property
    def aggregation(self) -> Aggregation:  # type: ignore[override]
        agg = self.parsed().agg
        return AGGREGATIONS[agg] if agg else SUM

    def infer(self) -> TensorType:
        if len(self.columns) != len(self.input_types) or not self.input_types:
            raise GraphError(f"sql needs one or more tensors, each with its column names; got {len(self.input_types)}.")
        p = self.parsed()
        dtype = same_dtype(self.kind, self.input_types)
        ext = self.extents()
        return TensorType.zero(tuple(ext[n] for n in p.out), dtype, p.out_names)

    def dims_in(self) -> tuple[tuple[str | None, ...], ...]:
        return self.parsed().dims

    def dims_out(self) -> tuple[str | None, ...]:
        return self.parsed().out

    def extents(self) -> dict[str, int]:
        ext: dict[str, int] = {}
        for dims, t in zip(self.parsed().dims, self.input_types):
            for name, size in zip(dims, t.shape):
                ext.setdefault(name, size)
        return ext

    def params(self) -> dict[str, object]:
        return {"query": self.query}

    def flops(self, inputs: tuple[Box, ...], output: Box) -> float:
        return 2.0 * self.iteration_volume(inputs, output)

    def kernel(self, blocks: Sequence[np.ndarray], f: FunctionSpec) -> np.ndarray:
        p = self.parsed()
        order = self.index_order()
        letters = dict(zip(order, string.ascii_letters))
        subs = ["".join(letters[n] for n in dims) for dims in p.dims]
        out_sub = "".join(letters[n] for n in p.out)
        arrays = [self._compute(b) for b in blocks]
        product = _product_of_values(p.expr)
        # the einsum shortcut counts each join tuple once, so it needs every relation in the product
        if p.agg in ("sum", None) and product is not None and sorted(product) == sorted(p.relations):
            pos = {rel: n for n, rel in enumerate(p.relations)}
            sub = ",".join(subs[pos[r]] for r in product) + "->" + out_sub
            return self._result(np.einsum(sub, *(arrays[pos[r]] for r in product)))
        full = "".join(letters[n] for n in order)
        sizes = self.index_sizes(f.inputs, f.output)
        values = {}
        for rel, sub, a in zip(p.relations, subs, arrays):
            uniq = "".join(dict.fromkeys(sub))
            diag = np.einsum(f"{sub}->{uniq}", a)
            shape = [sizes[n] if letters[n] in uniq else 1 for n in order]
            values[rel] = np.einsum(f"{uniq}->{''.join(c for c in full if c in uniq)}", diag).reshape(shape)
        res = np.broadcast_to(np.asarray(_evaluate(p.expr, values)), [sizes[n] for n in order])
        contracted = tuple(k for k, n in enumerate(order) if n not in p.out)
        if contracted:
            reducers: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "max": np.max, "min": np.min}
            res = reducers[p.agg or "sum"](res, axis=contracted)
        kept = "".join(letters[n] for n in order if n in p.out)
        return self._result(np.einsum(f"{kept}->{out_sub}", res))

    def vjp(self, b: Builder, inputs: tuple[Any, ...], output: Any, cotangent: Any,
            wanted: tuple[bool, ...]) -> Grads:
        """A SUM (or a pure join) of the product of every relation's value column is a contraction: each
        relation's gradient joins the output's gradient with the other relations.  Other queries are refused."""
        p = self.parsed()
        if p.agg in ("max", "min"):
            raise not_differentiable(self.kind, f"its aggregate is {p.agg.upper()}, and only SUM joins are "
                                     f"differentiated (query {self.query!r})")
        product = _product_of_values(p.expr)
        if product is None or sorted(product) != sorted(p.relations):
            raise not_differentiable(
                self.kind, f"its value expression {p.expr.sql()} is not the product of each relation's value "
                f"column taken once, the form whose gradient is a join (query {self.query!r}); write it as "
                "SUM(A.v * B.v ...) with graph operators around it")
        return einsum_grads(self.kind, b, p.dims, p.out, inputs, cotangent, wanted)

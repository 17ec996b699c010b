"""Every user error is raised as one of the project's errors, with a message that names the
rule and the offending shapes, sizes and names."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors import errors

Iv = rt.Interval
MATMUL_SQL = "SELECT A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"


def esc(text: str) -> str:
    return re.escape(text)


# --- the error family ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_class_is_a_relational_tensors_error(name: str) -> None:
    cls = getattr(rt, name)
    assert cls is getattr(errors, name)
    assert issubclass(cls, rt.RelationalTensorsError) and issubclass(cls, Exception)


def test_error_hierarchy() -> None:
    assert issubclass(rt.OutOfMemoryPlanError, rt.PlanError)
    assert issubclass(rt.GraphError, ValueError) and issubclass(rt.SpecError, ValueError)
    public = {n for n in dir(rt) if isinstance(getattr(rt, n), type) and issubclass(getattr(rt, n), Exception)}
    assert public == set(errors.__all__)


# --- graph construction: shapes -------------------------------------------------------------------

@pytest.fixture
def g() -> rt.Graph:
    return rt.Graph()


def test_matmul_shape_mismatch(g) -> None:
    a, b = g.input("a", [4, 5]), g.input("b", [6, 7])
    with pytest.raises(rt.GraphError, match=esc("got (4, 5) @ (6, 7): j = 5 vs 6")):
        g.matmul(a, b)


def test_matmul_rank_one(g) -> None:
    with pytest.raises(rt.GraphError, match=r"rank >= 2; got shapes \(5,\) @ \(5, 3\)"):
        g.matmul(g.input("a", [5]), g.input("b", [5, 3]))


def test_batched_matmul_batch_mismatch(g) -> None:
    a, b = g.input("a", [2, 4, 5]), g.input("b", [3, 5, 7])
    with pytest.raises(rt.GraphError, match=esc("batched matmul needs equal batch dimensions; "
                                                "got (2, 4, 5) @ (3, 5, 7)")
                       + ".*" + esc("batch (2,) vs (3,)")):
        g.matmul(a, b)


def test_attention_heads_not_a_multiple(g) -> None:
    q, k = g.input("q", [1, 8, 6, 4]), g.input("k", [1, 8, 4, 4])
    with pytest.raises(rt.GraphError, match="heads_q to be a multiple of heads_kv.*heads_q=6, heads_kv=4"):
        g.attention(q, k, k)


def test_attention_other_shape_rules(g) -> None:
    q, _k, v = g.input("q", [1, 8, 4, 4]), g.input("k", [1, 8, 2, 4]), g.input("v", [1, 8, 2, 4])
    with pytest.raises(rt.GraphError, match=r"rank-4 q, k, v.*q \(1, 8, 4, 4\), k \(8, 4\)"):
        g.attention(q, g.input("k2", [8, 4]), v)
    with pytest.raises(rt.GraphError, match="one batch size"):
        g.attention(q, g.input("k3", [2, 8, 2, 4]), g.input("v3", [2, 8, 2, 4]))
    with pytest.raises(rt.GraphError, match="same d_head"):
        g.attention(q, g.input("k4", [1, 8, 2, 3]), v)
    with pytest.raises(rt.GraphError, match="causal=True is the equal-length case; got seq_q=8 and seq_kv=9"):
        g.attention(q, g.input("k5", [1, 9, 2, 4]), g.input("v5", [1, 9, 2, 4]), causal=True)
    with pytest.raises(rt.GraphError, match="seq_q == seq_kv.*got 8 and 9"):
        g.attention(q, g.input("k6", [1, 9, 2, 4]), g.input("v6", [1, 9, 2, 4]), causal="top_left",
                    seq_ends=[8])


@pytest.mark.parametrize("kind", ["attention", "rope"])
@pytest.mark.parametrize("ends, message", [
    ([3, 3, 8], esc("must be positive and strictly increasing") + ".*" + esc("got [3, 3, 8]")),
    ([5, 2, 8], "must be .*strictly increasing.*" + esc("got [5, 2, 8]")),
    ([0, 8], "must be positive.*" + esc("got [0, 8]")),
    ([], "must be positive.*" + esc("got []")),
    ([3, 9], esc("must not run past the sequence of length 8; got last end 9 in [3, 9]")),
    ([3, 7], esc("must end exactly at the sequence length 8") + ".*" + esc("got last end 7. Append 8")),
], ids=["repeated", "decreasing", "zero", "empty", "past_the_end", "short_of_the_end"])
def test_bad_seq_ends(g, kind: str, ends, message: str) -> None:
    q, k = g.input("q", [1, 8, 4, 4]), g.input("k", [1, 8, 2, 4])
    with pytest.raises(rt.GraphError, match=f"^{kind} seq_ends " + message):
        if kind == "attention":
            g.attention(q, k, k, causal=True, seq_ends=ends)
        else:
            g.rope(q, seq_ends=ends)


def test_unknown_unary_op(g) -> None:
    with pytest.raises(rt.GraphError, match=r"unknown unary op 'softplus'; supported: \[.*'gelu'.*'relu'"):
        g.unary(g.input("x", [3]), "softplus")


def test_unary_on_integers_and_bad_arg(g) -> None:
    with pytest.raises(rt.GraphError, match="unary 'exp' needs a floating tensor; got dtype int64"):
        g.unary(g.input("ids", [3], "int64"), "exp")
    with pytest.raises(rt.GraphError, match="unary 'scale' takes a number as arg; got 'two'"):
        g.unary(g.input("x", [3]), "scale", "two")
    with pytest.raises(rt.GraphError, match="dtype must be one of.*got 'int8'"):
        g.cast(g.input("y", [3]), "int8")


def test_binary_dtype_mixing(g) -> None:
    a, h = g.input("a", [4, 5]), g.input("h", [4, 5], "float16")
    with pytest.raises(rt.GraphError, match=esc("add needs inputs of one dtype; got ['float32', 'float16'] "
                                                "for shapes [(4, 5), (4, 5)]") + ".*cast"):
        g.add(a, h)


def test_matmul_dtype_mixing(g) -> None:
    a, w = g.input("a", [4, 5]), g.input("w", [5, 3], "bfloat16")
    with pytest.raises(rt.GraphError, match=esc("matmul needs inputs of one dtype; got ['float32', 'bfloat16']")):
        g.matmul(a, w)


def test_other_dtype_mixing(g) -> None:
    a, h = g.input("a", [4, 5]), g.input("h", [5], "float16")
    with pytest.raises(rt.GraphError, match="rmsnorm needs inputs of one dtype"):
        g.rmsnorm(a, h)
    with pytest.raises(rt.GraphError, match="einsum needs inputs of one dtype"):
        g.einsum("ij,j->i", a, h)
    with pytest.raises(rt.GraphError, match="concat needs inputs of one dtype"):
        g.concat([a, g.input("h2", [4, 5], "float64")], 0)


def test_binary_broadcast_mismatch(g) -> None:
    with pytest.raises(rt.GraphError, match=esc("got shapes [(4, 5), (3, 5)] (dimension -2 has sizes [3, 4])")):
        g.mul(g.input("x", [4, 5]), g.input("y", [3, 5]))


def test_unknown_binary_op(g) -> None:
    a = g.input("a", [4, 5])
    with pytest.raises(rt.GraphError, match=esc("unknown binary op 'pow'; supported: ['add', 'div',")):
        g.binary(a, a, "pow")


def test_reshape_that_does_not_preserve_size(g) -> None:
    a = g.input("a", [4, 5])
    with pytest.raises(rt.GraphError, match=esc("got (4, 5) (20 elements) -> (3, 7) (21 elements)")):
        g.reshape(a, [3, 7])
    with pytest.raises(rt.GraphError, match=esc("reshape must preserve the number of elements; "
                                                "got (4, 5) (20 elements) -> (3, -1)")):
        g.reshape(a, [3, -1])
    with pytest.raises(rt.GraphError, match=esc("at most one -1; got (-1, -1)")):
        g.reshape(a, [-1, -1])
    with pytest.raises(rt.GraphError, match=esc("-> (0, -1)")):
        g.reshape(a, [0, -1])


@pytest.mark.parametrize("call, message", [
    (lambda g, a: g.softmax(a, axis=2), esc("softmax axis must lie in [-2, 2); got axis=2 for shape (4, 5)")),
    (lambda g, a: g.sum(a, axis=-3), esc("sum axis must lie in [-2, 2); got axis=-3 for shape (4, 5)")),
    (lambda g, a: g.max(a, axis=(0, 5)), esc("max axis must lie in [-2, 2); got axis=5 for shape (4, 5)")),
    (lambda g, a: g.slice(a, 2, 0, 1), esc("slice axis must lie in [-2, 2); got axis=2")),
    (lambda g, a: g.concat([a, a], 3), esc("concat axis must lie in [-2, 2); got axis=3")),
    (lambda g, a: g.transpose(a, 0, 2), esc("transpose axis must lie in [-2, 2); got axis=2")),
    (lambda g, a: g.permute(a, [0, 0]), esc("permute needs a permutation of 0..1; got (0, 0) for shape (4, 5)")),
    (lambda g, a: g.mean(a, axis=()), esc("mean needs at least one axis; got axes=()")),
])
def test_bad_axis(g, call, message: str) -> None:
    with pytest.raises(rt.GraphError, match=message):
        call(g, g.input("a", [4, 5]))


@pytest.mark.parametrize("start, stop", [(3, 9), (3, 3), (-1, 2), (4, 2)])
def test_slice_bounds(g, start: int, stop: int) -> None:
    with pytest.raises(rt.GraphError, match=esc(f"slice needs 0 <= start < stop <= 5 on axis 1 of shape (4, 5); "
                                                f"got start={start}, stop={stop}")):
        g.slice(g.input("a", [4, 5]), 1, start, stop)


def test_concat_shape_mismatch(g) -> None:
    a, b = g.input("a", [4, 5]), g.input("b", [6, 7])
    with pytest.raises(rt.GraphError, match=esc("concat along axis 0 needs equal shapes off that axis; "
                                                "got [(4, 5), (6, 7)]")):
        g.concat([a, b], 0)
    with pytest.raises(rt.GraphError, match="concat needs at least one tensor"):
        g.concat([], 0)


def test_rope_odd_d_head(g) -> None:
    with pytest.raises(rt.GraphError, match=esc("rope needs an even d_head to rotate its halves; got d_head=7 "
                                                "in (1, 4, 2, 7)")):
        g.rope(g.input("x", [1, 4, 2, 7]))
    with pytest.raises(rt.GraphError, match=esc("rope takes x of shape [batch, seq, heads, d_head]; got rank 3")):
        g.rope(g.input("y", [4, 2, 8]))


def test_norm_weight_shape(g) -> None:
    with pytest.raises(rt.GraphError, match=esc("rmsnorm weights must have shape [d] = (8,) for x of shape (3, 8); "
                                                "got (4,)")):
        g.rmsnorm(g.input("x", [3, 8]), g.input("w", [4]))


def test_embedding_non_integer_ids(g) -> None:
    with pytest.raises(rt.GraphError, match=esc("embedding ids must be int32 or int64; got dtype float32 "
                                                "for shape (3,)")):
        g.embedding(g.input("table", [10, 4]), g.input("ids", [3]))
    with pytest.raises(rt.GraphError, match=esc("table of shape [vocab, embed]; got (10,)")):
        g.embedding(g.input("flat", [10]), g.input("ids2", [3], "int64"))


def test_einsum_ellipsis(g) -> None:
    a, w = g.input("a", [4, 5]), g.input("w", [5, 3])
    with pytest.raises(rt.GraphError, match=esc("einsum ellipses are not supported; got '...ij,jk->...ik'")):
        g.einsum("...ij,jk->...ik", a, w)


def test_einsum_size_mismatch(g) -> None:
    a, w = g.input("a", [4, 5]), g.input("w", [6, 3])
    with pytest.raises(rt.GraphError, match=esc("index 'j' has size 5 in one operand and 6 in operand 1; "
                                                "got shapes [(4, 5), (6, 3)]")):
        g.einsum("ij,jk->ik", a, w)


@pytest.mark.parametrize("subscripts, n, message", [
    ("ij,jk", 2, None),  # valid: the implicit output
    ("ij->ii", 1, "einsum output indices must be distinct; got 'ii' in 'ij->ii'"),
    ("ij,jk->iz", 2, "einsum output index ['z'] appears in no input of 'ij,jk->iz'"),
    ("ijk,jk->ik", 2, "einsum 'ijk,jk->ik': operand 0 has 3 indices but rank 2"),
    ("ij->i,j", 1, "an einsum spec is letters, commas and one '->'; got 'ij->i,j'"),
    ("ij", 2, "einsum 'ij' names 1 operands; got 2 tensors"),
])
def test_einsum_spec_rules(g, subscripts: str, n: int, message: str | None) -> None:
    operands = [g.input("a", [4, 5]), g.input("w", [5, 3])][:n]
    if message is None:
        assert g.einsum(subscripts, *operands).shape == (4, 3)
        return
    with pytest.raises(rt.GraphError, match=esc(message)):
        g.einsum(subscripts, *operands)


# --- SQL operators ------------------------------------------------------------------------------

@pytest.fixture
def rel(g):
    """A[i, j] (4 x 5) and B[j, k] (5 x 3) as relations."""
    return {"A": (g.input("a", [4, 5]), ("i", "j")), "B": (g.input("b", [5, 3]), ("j", "k"))}


@pytest.mark.parametrize("query, message", [
    ("SELEC A.i FROM", "the SQL operator's query does not parse: .*got 'SELEC A.i FROM'"),
    (MATMUL_SQL.replace("GROUP BY", "WHERE A.v > 0 GROUP BY"), "got an unsupported WHERE clause in 'SELECT"),
    (MATMUL_SQL + " HAVING SUM(A.v * B.v) > 0", "unsupported HAVING clause"),
    (MATMUL_SQL + " ORDER BY A.i", "unsupported ORDER clause"),
    (MATMUL_SQL + " LIMIT 3", "unsupported LIMIT clause"),
    (MATMUL_SQL.replace("FROM A JOIN", "FROM A LEFT JOIN"), "got an unsupported LEFT JOIN in"),
    (MATMUL_SQL.replace("FROM A JOIN", "FROM A FULL OUTER JOIN"), "unsupported FULL JOIN"),
    (MATMUL_SQL.replace("SUM(", "AVG("), esc("got an unsupported aggregate AVG (use SUM, MAX or MIN)")),
    (MATMUL_SQL.replace("SUM(", "COUNT("), esc("unsupported aggregate COUNT")),
    (MATMUL_SQL.replace("ON A.j = B.j", "ON A.j > B.j"), esc("unsupported join condition A.j > B.j")),
    (MATMUL_SQL.replace("ON A.j = B.j", "USING (j)"), "unsupported JOIN ... USING"),
    (MATMUL_SQL.replace("ON A.j = B.j", "ON A.v = B.j"), esc("join on the value column (A.v = B.j)")),
    (MATMUL_SQL.replace("SUM(A.v * B.v)", "SUM(A.v * B.k)"), esc("value expression on a key column (B.k)")),
    (MATMUL_SQL.replace("SUM(A.v * B.v)", "SUM(sin(A.v))"), esc("unsupported expression SIN(A.v)")),
    (MATMUL_SQL.replace("AS v", "AS v, A.v + 1 AS w"), "second value expression in SELECT"),
    ("SELECT A.i, B.k FROM A JOIN B ON A.j = B.j", "query without a value expression"),
    ("INSERT INTO A VALUES (1)", "unsupported statement INSERT"),
    ("SELECT A.i, B.k, SUM(A.v * C.v) AS v FROM A JOIN C ON A.j = C.j GROUP BY A.i, C.k",
     esc("the query reads relation 'C', but the tensors given are ['A', 'B']")),
    ("SELECT A.i, SUM(A.v) AS v FROM A GROUP BY A.i",
     esc("every tensor passed to sql must appear in FROM/JOIN; ['B']")),
    (MATMUL_SQL.replace("A.i, B.k, SUM", "A.i, X.k, SUM"),
     esc("unknown relation 'X' in column X.k; relations: ['A', 'B']")),
    (MATMUL_SQL.replace("B.k", "B.z"), esc("relation B has columns ['j', 'k', 'v']; got B.z")),
    (MATMUL_SQL.replace("GROUP BY A.i, B.k", "GROUP BY A.i"), esc("GROUP BY must list exactly the selected keys in")),
    (MATMUL_SQL.replace("GROUP BY A.i, B.k", "GROUP BY A.i, A.j"), "GROUP BY must list exactly the selected keys"),
    (MATMUL_SQL.replace("GROUP BY A.i, B.k", ""), "GROUP BY must list exactly the selected keys"),
    ("SELECT A.i, B.k, A.v * B.v AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k", "GROUP BY without an aggregate"),
    ("SELECT A.i, B.k, A.v * B.v AS v FROM A JOIN B ON A.j = B.j",
     esc("without an aggregate every dimension must be selected; indices ['j'] are not in")),
    (MATMUL_SQL.replace("ON A.j = B.j", "ON A.i = B.j"),
     esc("joined dimensions must have equal sizes; got A.i of size 4 = B.j of size 5")),
    ("SELECT A.i, A.i AS i2, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k",
     "an output index appears twice in SELECT"),
    (MATMUL_SQL.replace("SELECT A.i", "SELECT j"), esc("column 'j' must be qualified by its relation (A.j)")),
])
def test_sql_errors(g, rel, query: str, message: str) -> None:
    with pytest.raises(rt.GraphError, match=message):
        g.sql(query, **rel)


def test_sql_self_join_needs_two_names(g, rel) -> None:
    a = rel["A"]
    with pytest.raises(rt.GraphError, match="relation 'A' appears twice"):
        g.sql("SELECT x.i, y.j, SUM(x.v * y.v) AS v FROM A AS x JOIN A AS y ON x.j = y.i GROUP BY x.i, y.j",
              A=a, B=rel["B"])


def test_sql_column_names_per_dimension(g) -> None:
    a = g.input("a", [4, 5])
    with pytest.raises(rt.GraphError, match=esc("relation A needs one column name per dimension of (4, 5); "
                                                "got ('i',)")):
        g.sql("SELECT A.i, SUM(A.v) AS v FROM A GROUP BY A.i", A=(a, ("i",)))


def test_sql_dtype_mixing(g) -> None:
    a, b = g.input("a", [4, 5]), g.input("b", [5, 3], "float64")
    with pytest.raises(rt.GraphError, match=esc("sql needs inputs of one dtype; got ['float32', 'float64']")):
        g.sql(MATMUL_SQL, A=(a, ("i", "j")), B=(b, ("j", "k")))


# --- graph bookkeeping --------------------------------------------------------------------------

def test_operands_from_another_graph(g) -> None:
    a = g.input("a", [4, 5])
    other = rt.Graph()
    x = other.input("x", [5, 3])
    with pytest.raises(rt.GraphError, match=r"operands must be tensors of this graph; "
                                            r"got Tensor\('x', float32\[d0=5, d1=3\]\)"):
        g.matmul(a, x)
    with pytest.raises(rt.GraphError, match="operands must be tensors of this graph"):
        g.save(x, name="y")
    with pytest.raises(rt.GraphError, match="operands must be tensors of this graph; got array"):
        g.unary(np.ones(3), "relu")  # type: ignore[arg-type]
    assert len(g) == 1  # nothing was added by the failed calls


def test_duplicate_node_names(g) -> None:
    a = g.input("a", [4, 5])
    with pytest.raises(rt.GraphError, match="node names must be unique; 'a' is already used"):
        g.input("a", [3])
    with pytest.raises(rt.GraphError, match="node names must be unique; 'a' is already used"):
        g.unary(a, "relu", name="a")
    r = g.unary(a, "relu", name="r")
    with pytest.raises(rt.GraphError, match="node names must be unique; 'r' is already used"):
        g.parameter("r", [3])
    g.save(a, name="out")
    g.save(a, name="out")  # saving the same tensor again under its name is fine
    with pytest.raises(rt.GraphError, match="output names must be unique; 'out' is already saved"):
        g.save(r, name="out")
    with pytest.raises(rt.GraphError, match="no node named 'zz'"):
        g.node("zz")


def test_bad_tensor_types(g) -> None:
    with pytest.raises(rt.GraphError, match=esc("tensor dimensions must be positive integers; got shape (3, 0)")):
        g.input("x", [3, 0])
    with pytest.raises(rt.GraphError, match=esc("dtype must be one of ['bfloat16', 'bool', 'float16', 'float32', "
                                                "'float64', 'int32', 'int64']; got 'int8'")):
        g.input("y", [3], "int8")
    with pytest.raises(rt.GraphError, match=esc("give one name per dimension; got shape (3, 2) and names ('a',)")):
        g.input("z", [3, 2], dims=("a",))
    with pytest.raises(rt.GraphError, match=esc("dimension names of a tensor must be distinct; got ('a', 'a')")):
        g.input("w", [3, 2], dims=("a", "a"))
    with pytest.raises(rt.GraphError, match="insertTensor takes an rt.tensorDesc"):
        g.insertTensor([3, 2])  # type: ignore[arg-type]
    with pytest.raises(rt.GraphError, match="inputs need a non-empty name"):
        g.input("", [3])


# --- join-agg specs and interval requests --------------------------------------------------------

@pytest.fixture
def matmul_op(g):
    return g.matmul(g.input("a", [4, 5]), g.input("b", [5, 7])).node.op


@pytest.mark.parametrize("intervals, shown", [
    ([Iv(0, 2), Iv(3, 4)], "['[0,2)', '[3,4)']"),   # gap
    ([Iv(0, 2), Iv(1, 4)], "['[0,2)', '[1,4)']"),   # overlap
    ([Iv(0, 2), Iv(2, 3)], "['[0,2)', '[2,3)']"),   # short of the extent
    ([Iv(2, 4), Iv(0, 2)], "['[2,4)', '[0,2)']"),   # out of order
    ([Iv(0, 0), Iv(0, 4)], "['[0,0)', '[0,4)']"),   # empty interval
    ([Iv(1, 4)], "['[1,4)']"),                      # does not start at 0
    ([Iv(0, 5)], "['[0,5)']"),                      # past the extent
    ([], "[]"),
])
def test_intervals_that_do_not_tile_the_index(matmul_op, intervals, shown: str) -> None:
    with pytest.raises(rt.SpecError, match=esc(f"intervals of index 'i' must be non-empty, in order and tile [0, 4); "
                                               f"got {shown}")):
        matmul_op.spec({"i": intervals})


def test_request_for_an_unknown_index(matmul_op) -> None:
    with pytest.raises(rt.SpecError, match=esc("matmul can be split only on ['i', 'j', 'k']; got a request for ['z']")):
        matmul_op.spec({"z": [Iv(0, 4)]})


def test_packed_attention_seq_q_cut_at_illegal_position(g) -> None:
    q, k = g.input("q", [1, 10, 4, 4]), g.input("k", [1, 10, 2, 4])
    op = g.attention(q, k, k, causal=True, seq_ends=[3, 7, 10]).node.op
    with pytest.raises(rt.SpecError, match=esc("index 'seq_q' may be cut only at [3, 7]; got cuts at [5]")):
        op.spec({"seq_q": [Iv(0, 5), Iv(5, 10)]})
    with pytest.raises(rt.SpecError, match=esc("got cuts at [2, 8]")):
        op.spec({"seq_q": [Iv(0, 2), Iv(2, 3), Iv(3, 8), Iv(8, 10)]})
    # the inherited index is never requested
    with pytest.raises(rt.SpecError,
                       match=esc("attention can be split only on ['batch', 'heads_kv', 'seq_kv', 'seq_q']; "
                                 "got a request for ['heads_q']")):
        op.spec({"heads_q": [Iv(0, 2), Iv(2, 4)]})
    # the key sequence may be cut anywhere
    assert op.spec({"seq_kv": [Iv(0, 5), Iv(5, 10)]}).p == 2


def test_malformed_core_values() -> None:
    with pytest.raises(rt.SpecError, match=esc("an interval needs lo <= hi; got [3, 2)")):
        Iv(3, 2)
    with pytest.raises(rt.SpecError, match=esc("a box needs lower <= upper per dimension; got (0, 5) .. (1, 2)")):
        rt.Box((0, 5), (1, 2))
    with pytest.raises(rt.SpecError, match=esc("tiling breakpoints must increase strictly with at least two per "
                                               "dimension; got (0, 2, 2)")):
        rt.Tiling(((0, 2, 2), (0, 3)))
    with pytest.raises(rt.SpecError, match=esc("only tilings of the same space overlay; "
                                               "got [0,2)x[0,3) and [0,3)x[0,3)")):
        rt.Tiling(((0, 2), (0, 3))).overlay(rt.Tiling(((0, 3), (0, 3))))
    with pytest.raises(rt.SpecError, match=esc("legal positions of index 's' must increase strictly inside (0, 10); "
                                               "got (5, 3)")):
        rt.ShardableIndex("s", 10, positions=(5, 3))
    with pytest.raises(rt.SpecError, match=esc("got (0, 10)")):
        rt.ShardableIndex("s", 10, positions=(0, 10))


# --- the reference evaluator --------------------------------------------------------------------

@pytest.fixture
def mm_graph() -> rt.Graph:
    g = rt.Graph()
    g.save(g.matmul(g.input("a", [4, 5]), g.input("b", [5, 7])), name="y")
    return g


def test_missing_feed(mm_graph) -> None:
    with pytest.raises(rt.ExecError, match=esc("missing a value for input 'b' of shape (5, 7) (float32)")):
        rt.reference(mm_graph, {"a": np.ones((4, 5))})


def test_wrong_feed_shape(mm_graph) -> None:
    with pytest.raises(rt.ExecError, match=esc("input 'b' must have shape (5, 7); got (5, 6)")):
        rt.reference(mm_graph, {"a": np.ones((4, 5)), "b": np.ones((5, 6))})


def test_unknown_feed_name(mm_graph) -> None:
    with pytest.raises(rt.ExecError, match=esc("feeds name no graph input: ['zz']; inputs are ['a', 'b']")):
        rt.reference(mm_graph, {"a": np.ones((4, 5)), "b": np.ones((5, 7)), "zz": 1.0})


def test_wrong_feed_kind(mm_graph) -> None:
    with pytest.raises(rt.ExecError, match="input 'a' must be float32; got an array of dtype int64. Convert it first"):
        rt.reference(mm_graph, {"a": np.ones((4, 5), dtype=np.int64), "b": np.ones((5, 7))})
    with pytest.raises(rt.ExecError, match="input 'a' must be float32; got an array of dtype bool"):
        rt.reference(mm_graph, {"a": np.ones((4, 5), dtype=bool), "b": np.ones((5, 7))})
    with pytest.raises(rt.ExecError, match="input 'a' must be float32; got an array of dtype complex128"):
        rt.reference(mm_graph, {"a": np.ones((4, 5), dtype=complex), "b": np.ones((5, 7))})


def test_no_saved_output() -> None:
    g = rt.Graph()
    g.input("a", [3])
    with pytest.raises(rt.ExecError, match="the graph saves no output; call g.save"):
        rt.reference(g, {"a": np.ones(3)})


@pytest.fixture
def emb_graph() -> rt.Graph:
    g = rt.Graph()
    g.save(g.embedding(g.input("table", [5, 3]), g.input("ids", [4], "int64")), name="e")
    return g


@pytest.mark.parametrize("ids, shown", [([0, 1, 5, 2], "from 0 to 5"), ([0, -1, 3, 2], "from -1 to 3")])
def test_embedding_id_out_of_range(emb_graph, ids, shown: str) -> None:
    with pytest.raises(rt.ExecError, match=esc(f"embedding ids must lie in [0, 5); got values {shown}")):
        rt.reference(emb_graph, {"table": np.ones((5, 3)), "ids": np.array(ids)})


def test_embedding_float_ids_feed(emb_graph) -> None:
    with pytest.raises(rt.ExecError, match="input 'ids' must be int64; got an array of dtype float64"):
        rt.reference(emb_graph, {"table": np.ones((5, 3)), "ids": np.array([0.0, 1.0, 3.0, 2.0])})
    with pytest.raises(rt.ExecError, match="input 'ids' must be int64; got an array of dtype bfloat16"):
        rt.reference(emb_graph, {"table": np.ones((5, 3)), "ids": np.zeros(4, dtype=ml_dtypes.bfloat16)})


def test_embedding_id_out_of_range_under_a_vocabulary_split(emb_graph) -> None:
    op = emb_graph.node("embedding_2").op
    spec = op.spec({"vocab": [Iv(0, 2), Iv(2, 5)]})
    with pytest.raises(rt.ExecError, match=esc("embedding ids must lie in [0, 5); got values from 0 to 7")):
        rt.execute_spec(op, spec, [np.ones((5, 3), dtype=np.float32), np.array([0, 7, 1, 1])])


def test_seq_ends_must_be_integers() -> None:
    g = rt.Graph()
    x = g.input("x", [1, 8, 2, 4])
    with pytest.raises(rt.GraphError, match=r"seq_ends must be a list of integers; got \(2\.5, 8\)"):
        g.rope(x, seq_ends=[2.5, 8])
    with pytest.raises(rt.GraphError, match="seq_ends must be a list of integers"):
        g.attention(x, x, x, causal=True, seq_ends=[4.0, 8])

"""Small graphs, one per operator case, with sizes that do not divide device counts evenly."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import relational_tensors as rt
from relational_tensors.catalog import Catalog
from relational_tensors.sql_specs.elementwise import FullOp
from relational_tensors.sql_specs.experts import (
    CapacityRouteOp,
    GroupedMatmulOp,
    GroupedWeightGradOp,
    RoutedGatherOp,
    RouteIndexOp,
)

Case = Callable[[str], tuple[rt.Graph, str]]  # dtype -> (graph, name of the node under test)

MATMUL_SQL = "SELECT A.i, B.k, SUM(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"
MAXPLUS_SQL = "SELECT A.i, B.k, MAX(A.v + B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"
PACKED_ENDS = (5, 9, 20, 22, 31, 40, 47)  # 7 packed sequences of uneven lengths


def _one(build: Callable[[rt.Graph, str], rt.Tensor]) -> Case:
    def make(dtype: str) -> tuple[rt.Graph, str]:
        g = rt.Graph()
        out = build(g, dtype)
        g.save(out, name="out")
        return g, out.name
    return make


CASES: dict[str, Case] = {
    "matmul_1000_tokens": _one(lambda g, d: g.matmul(g.input("x", [1000, 12], d), g.input("w", [12, 10], d))),
    "matmul_dff_11008": _one(lambda g, d: g.matmul(g.input("x", [5, 8], d), g.input("w", [8, 11008], d))),
    "matmul_batched_weight": _one(lambda g, d: g.matmul(g.input("x", [3, 9, 7], d), g.input("w", [7, 5], d))),
    "matmul_batched_both": _one(lambda g, d: g.matmul(g.input("a", [2, 9, 7], d), g.input("b", [2, 7, 5], d))),
    "einsum_bij_jk": _one(lambda g, d: g.einsum("bij,jk->bik", g.input("x", [3, 10, 6], d), g.input("w", [6, 9], d))),
    "einsum_three": _one(lambda g, d: g.einsum("ij,jk,kl->il", g.input("a", [5, 6], d), g.input("b", [6, 7], d),
                                               g.input("c", [7, 9], d))),
    "einsum_summed_operand_index": _one(lambda g, d: g.einsum("ij,jk->i", g.input("a", [9, 5], d),
                                                              g.input("b", [5, 7], d))),
    "einsum_rowdot": _one(lambda g, d: g.einsum("ij,ij->i", g.input("a", [11, 6], d), g.input("b", [11, 6], d))),
    "sql_matmul": _one(lambda g, d: g.sql(MATMUL_SQL, A=(g.input("a", [10, 7], d), ("i", "j")),
                                          B=(g.input("b", [7, 9], d), ("j", "k")))),
    "sql_maxplus": _one(lambda g, d: g.sql(MAXPLUS_SQL, A=(g.input("a", [10, 7], d), ("i", "j")),
                                           B=(g.input("b", [7, 9], d), ("j", "k")))),
    "full": _one(lambda g, d: g.binary(g.input("x", [10, 7], d), g.apply(FullOp((), (10, 7), 0.75, d)), "mul")),
    "unary_gelu": _one(lambda g, d: g.unary(g.input("x", [10, 7], d), "gelu")),
    "unary_scale": _one(lambda g, d: g.unary(g.input("x", [10, 7], d), "scale", 0.25)),
    "unary_cast": _one(lambda g, d: g.unary(g.unary(g.input("x", [10, 7], d), "cast", "float32"), "exp")),
    "binary_add_broadcast": _one(lambda g, d: g.add(g.input("x", [9, 1, 5], d), g.input("y", [7, 5], d))),
    "binary_div": _one(lambda g, d: g.div(g.input("x", [9, 7], d),
                                          g.unary(g.input("y", [9, 1], d), "add_scalar", 3.0))),
    "swiglu": _one(lambda g, d: g.swiglu(g.input("a", [10, 13], d), g.input("b", [10, 13], d))),
    "reduce_sum": _one(lambda g, d: g.sum(g.input("x", [10, 7, 5], d), axis=1)),
    "reduce_max_two_axes": _one(lambda g, d: g.max(g.input("x", [10, 7, 5], d), axis=(0, 2))),
    "reduce_min_keepdims": _one(lambda g, d: g.min(g.input("x", [10, 7], d), axis=0, keepdims=True)),
    "reduce_mean": _one(lambda g, d: g.mean(g.input("x", [10, 7, 5], d), axis=-1)),
    "softmax_last": _one(lambda g, d: g.softmax(g.input("x", [10, 7, 5], d))),
    "softmax_axis0": _one(lambda g, d: g.softmax(g.input("x", [7, 12], d), axis=0)),
    "rmsnorm": _one(lambda g, d: g.rmsnorm(g.input("x", [3, 10, 16], d), g.input("w", [16], d), 1e-5)),
    "layernorm": _one(lambda g, d: g.layernorm(g.input("x", [10, 16], d), g.input("w", [16], d),
                                               g.input("b", [16], d))),
    "rope": _one(lambda g, d: g.rope(g.input("x", [2, 19, 3, 8], d))),
    "rope_packed": _one(lambda g, d: g.rope(g.input("x", [1, 47, 2, 8], d), 500.0, PACKED_ENDS)),
    "rope_table": _one(lambda g, d: g.rope_table(g.input("x", [3, 19, 3, 8], d), g.input("cos", [3, 19, 8], d),
                                                 g.input("sin", [3, 19, 8], d))),
    "rope_table_shared": _one(lambda g, d: g.rope_table(g.input("x", [2, 19, 3, 8], d), g.input("cos", [1, 19, 8], d),
                                                        g.input("sin", [1, 19, 8], d))),
    "reshape_split_heads": _one(lambda g, d: g.reshape(g.input("x", [2, 10, 12], d), [2, 10, 3, 4])),
    "reshape_merge_heads": _one(lambda g, d: g.reshape(g.input("x", [2, 10, 3, 4], d), [2, 10, 12])),
    "reshape_many_to_many": _one(lambda g, d: g.reshape(g.input("x", [6, 4, 5], d), [4, 6, 5])),
    "permute": _one(lambda g, d: g.permute(g.input("x", [3, 10, 7], d), [2, 0, 1])),
    "slice": _one(lambda g, d: g.slice(g.input("x", [10, 17], d), 1, 3, 14)),
    "concat": _one(lambda g, d: g.concat([g.input("a", [5, 3], d), g.input("b", [5, 7], d),
                                          g.input("c", [5, 2], d)], 1)),
    "embedding": _one(lambda g, d: g.embedding(g.input("table", [23, 6], d), g.input("ids", [3, 7], "int64"))),
    # x[ids] = v: rows of a cache replaced (distinct ids here; repeats in tests/test_put_rows.py)
    "put_rows": _one(lambda g, d: g.put_rows(g.input("x", [13, 3, 4], d), g.input("ids", [5], "int64"),
                                             g.input("values", [5, 3, 4], d))),
    "put_rows_table": _one(lambda g, d: g.put_rows(g.input("x", [9, 6], d), g.input("ids", [4], "int32"),
                                                   g.input("values", [4, 6], d))),
    # the rows' scatter (an embedding's gradient, and what x[ids] = v writes with): ids repeat in 21 over 13 rows
    "embedding_grad": _one(lambda g, d: g.embedding_grad(g.input("ids", [3, 7], "int64"), g.input("rows", [3, 7, 5], d),
                                                         13)),
    "attention_plain": _one(lambda g, d: g.attention(g.input("q", [2, 11, 4, 8], d), g.input("k", [2, 13, 2, 8], d),
                                                     g.input("v", [2, 13, 2, 8], d))),
    "attention_causal_gqa_8kv": _one(lambda g, d: g.attention(g.input("q", [1, 12, 16, 4], d),
                                                              g.input("k", [1, 12, 8, 4], d),
                                                              g.input("v", [1, 12, 8, 4], d), causal=True)),
    "attention_packed_7": _one(lambda g, d: g.attention(g.input("q", [1, 47, 4, 4], d), g.input("k", [1, 47, 2, 4], d),
                                                        g.input("v", [1, 47, 2, 4], d), causal=True,
                                                        seq_ends=PACKED_ENDS)),
    # long enough that whole key tiles run the kernels' unmasked path
    "attention_causal_300": _one(lambda g, d: g.attention(g.input("q", [1, 300, 4, 32], d),
                                                          g.input("k", [1, 300, 2, 32], d),
                                                          g.input("v", [1, 300, 2, 32], d), causal=True)),
    "attention_negative_scale": _one(lambda g, d: g.attention(g.input("q", [1, 70, 2, 16], d),
                                                              g.input("k", [1, 150, 1, 16], d),
                                                              g.input("v", [1, 150, 1, 16], d), scale=-0.3)),
    # cross-attention, both causal alignments (bottom-right with fewer keys than queries: rows that see none)
    "attention_cross_top_left": _one(lambda g, d: g.attention(g.input("q", [2, 9, 4, 8], d),
                                                              g.input("k", [2, 14, 2, 8], d),
                                                              g.input("v", [2, 14, 2, 8], d), causal="top_left")),
    "attention_cross_bottom_right": _one(lambda g, d: g.attention(g.input("q", [2, 5, 4, 8], d),
                                                                  g.input("k", [2, 14, 2, 8], d),
                                                                  g.input("v", [2, 14, 2, 8], d),
                                                                  causal="bottom_right")),
    "attention_bottom_right_unseen_rows": _one(lambda g, d: g.attention(g.input("q", [1, 12, 2, 4], d),
                                                                        g.input("k", [1, 7, 1, 4], d),
                                                                        g.input("v", [1, 7, 1, 4], d),
                                                                        causal="bottom_right")),
    "attention_window_causal": _one(lambda g, d: g.attention(g.input("q", [1, 37, 4, 8], d),
                                                             g.input("k", [1, 37, 2, 8], d),
                                                             g.input("v", [1, 37, 2, 8], d), causal=True, window=6)),
    "attention_window_both_sides": _one(lambda g, d: g.attention(g.input("q", [1, 29, 2, 4], d),
                                                                 g.input("k", [1, 29, 2, 4], d),
                                                                 g.input("v", [1, 29, 2, 4], d), window=5)),
    "attention_packed_window": _one(lambda g, d: g.attention(g.input("q", [1, 47, 4, 4], d),
                                                             g.input("k", [1, 47, 2, 4], d),
                                                             g.input("v", [1, 47, 2, 4], d), causal=True,
                                                             seq_ends=PACKED_ENDS, window=3)),
    "attention_key_padding": _one(lambda g, d: g.attention(g.input("q", [3, 11, 4, 8], d),
                                                           g.input("k", [3, 11, 2, 8], d),
                                                           g.input("v", [3, 11, 2, 8], d), causal=True,
                                                           key_padding=g.input("pad", [3, 11], "bool"))),
    "attention_key_lengths": _one(lambda g, d: g.attention(g.input("q", [3, 10, 4, 8], d),
                                                           g.input("k", [3, 13, 2, 8], d),
                                                           g.input("v", [3, 13, 2, 8], d), key_padding=[13, 4, 0])),
    "attention_mask_per_head": _one(lambda g, d: g.attention(g.input("q", [2, 10, 4, 8], d),
                                                             g.input("k", [2, 13, 2, 8], d),
                                                             g.input("v", [2, 13, 2, 8], d),
                                                             mask=g.input("m", [1, 4, 10, 13], "bool"))),
    "attention_mask_per_batch": _one(lambda g, d: g.attention(g.input("q", [2, 10, 4, 8], d),
                                                              g.input("k", [2, 13, 2, 8], d),
                                                              g.input("v", [2, 13, 2, 8], d),
                                                              mask=g.input("m", [2, 1, 10, 13], "bool"))),
    "attention_bias": _one(lambda g, d: g.attention(g.input("q", [2, 10, 4, 8], d), g.input("k", [2, 13, 4, 8], d),
                                                    g.input("v", [2, 13, 4, 8], d),
                                                    bias=g.input("bias", [1, 4, 10, 13], d))),
    "attention_softcap": _one(lambda g, d: g.attention(g.input("q", [2, 10, 4, 8], d), g.input("k", [2, 10, 2, 8], d),
                                                       g.input("v", [2, 10, 2, 8], d), causal=True, window=6,
                                                       softcap=0.7, bias=g.input("bias", [2, 1, 10, 10], d))),
    "attention_everything": _one(lambda g, d: g.attention(g.input("q", [2, 12, 8, 4], d),
                                                          g.input("k", [2, 12, 2, 4], d),
                                                          g.input("v", [2, 12, 2, 4], d), causal=True, window=5,
                                                          key_padding=g.input("pad", [2, 12], "bool"),
                                                          mask=g.input("m", [2, 8, 12, 12], "bool"),
                                                          bias=g.input("bias", [2, 1, 12, 12], d))),
    "where_broadcast": _one(lambda g, d: g.where(g.input("c", [9, 1, 5], "bool"), g.input("x", [9, 7, 5], d),
                                                 g.input("y", [5], d))),
    "compare_and_logic": _one(lambda g, d: g.binary(
        g.binary(g.input("a", [9, 1, 5], d), g.input("b", [7, 5], d), "less_equal"),
        g.unary(g.input("c", [9, 7, 1], "bool"), "logical_not"), "logical_xor")),
    # convolution and pooling: strides, dilations, padding at the edges, groups, 1-D to 3-D, uneven sizes
    "conv1d_strided": _one(lambda g, d: g.conv(g.input("x", [2, 3, 23], d), g.input("w", [5, 3, 4], d), stride=3,
                                               padding=2)),
    "conv2d_3x3_bias": _one(lambda g, d: g.conv(g.input("x", [2, 3, 11, 9], d), g.input("w", [6, 3, 3, 3], d),
                                                g.input("b", [6], d), padding=1)),
    "conv2d_strided_dilated": _one(lambda g, d: g.conv(g.input("x", [1, 4, 13, 12], d), g.input("w", [4, 4, 3, 2], d),
                                                       stride=(2, 3), padding=(2, 1), dilation=(2, 1))),
    "conv2d_groups": _one(lambda g, d: g.conv(g.input("x", [2, 6, 9, 9], d), g.input("w", [9, 2, 3, 3], d),
                                              padding=1, groups=3)),
    "conv2d_depthwise": _one(lambda g, d: g.conv(g.input("x", [1, 5, 10, 10], d), g.input("w", [5, 1, 3, 3], d),
                                                 stride=2, padding=1, groups=5)),
    "conv2d_patchify": _one(lambda g, d: g.conv(g.input("x", [2, 3, 16, 16], d), g.input("w", [8, 3, 4, 4], d),
                                                stride=4)),
    "conv3d": _one(lambda g, d: g.conv(g.input("x", [1, 2, 6, 7, 5], d), g.input("w", [3, 2, 3, 2, 2], d),
                                       stride=(1, 2, 1), padding=(1, 0, 1))),
    "max_pool2d": _one(lambda g, d: g.max_pool(g.input("x", [2, 3, 11, 10], d), 3, 2, 1)),
    "avg_pool2d_real_count": _one(lambda g, d: g.avg_pool(g.input("x", [2, 3, 9, 9], d), 3, 2, 1,
                                                          count_include_pad=False)),
    "avg_pool1d": _one(lambda g, d: g.avg_pool(g.input("x", [2, 4, 17], d), 4, 3)),
    "max_pool3d": _one(lambda g, d: g.max_pool(g.input("x", [1, 2, 6, 7, 6], d), 2)),
    # ceil_mode: last windows past the padding (ResNet's and Inception's stems)
    "max_pool2d_ceil": _one(lambda g, d: g.max_pool(g.input("x", [2, 3, 10, 11], d), 3, 2, 1, ceil_mode=True)),
    "avg_pool2d_ceil": _one(lambda g, d: g.avg_pool(g.input("x", [2, 3, 10, 8], d), 3, 2, 1, ceil_mode=True)),
    "logsumexp_vocab": _one(lambda g, d: g.logsumexp(g.input("x", [9, 53], d), axis=-1)),
    "cross_entropy_tokens_ignore": _one(lambda g, d: g.cross_entropy(g.input("logits", [2, 19, 53], d),
                                                                     g.input("t", [2, 19], "int64"), ignore_index=3,
                                                                     reduction="none")),
    "cross_entropy_mean": _one(lambda g, d: g.cross_entropy(g.input("logits", [23, 29], d),
                                                            g.input("t", [23], "int64"), ignore_index=0)),
    "cross_entropy_sum": _one(lambda g, d: g.cross_entropy(g.input("logits", [37, 41], d), g.input("t", [37], "int64"),
                                                           reduction="sum")),
    "mse": _one(lambda g, d: g.mse(g.input("a", [10, 7], d), g.input("b", [10, 7], d))),
    # counter-based random draws: every block draws what the whole tensor has at its flat indices
    "dropout": _one(lambda g, d: g.dropout(g.input("x", [9, 7, 5], d), g.input("rng", [2], "int64"), 0.3, stream=1)),
    "random_uniform": _one(lambda g, d: g.random(g.input("rng", [2], "int64"), [10, 7], d, stream=2)),
    # routing: each of 2 x 9 tokens' 3 best of 11 experts (topk, then take_along reads their values)
    "topk_routing": _one(lambda g, d: g.topk(g.input("scores", [2, 9, 11], d), 3)[0]),
    "take_along_ids": _one(lambda g, d: g.take_along(g.input("x", [4, 6, 9], d),
                                                     g.input("ids", [4, 6, 5], "int64"))),
    "one_hot_ids": _one(lambda g, d: g.mul(g.one_hot(g.input("ids", [3, 7], "int64"), 11, d),
                                           g.input("w", [3, 7, 11], d))),
    # sparse experts: 7 tokens' 2 choices of 4 experts sorted by expert (ids outside [0, 4): no expert)
    "embedding_routed_dispatch": _one(lambda g, d: g.embedding(g.input("x", [7, 6], d), _route(g, [7, 2], 4, "token"))),
    "grouped_matmul_routed": _one(lambda g, d: _grouped(g, d, False)),
    "grouped_matmul_trans_w": _one(lambda g, d: _grouped(g, d, True)),
    "grouped_weight_grad_routed": _one(lambda g, d: _weight_grad(g, d)),
    # experts with a capacity: 3 groups of 7 tokens' 2 choices of 4 experts in buffers of 3 rows each
    "routed_gather_dispatch": _one(lambda g, d: _capacity(g, d, "dispatch")),
    "routed_gather_combine": _one(lambda g, d: _capacity(g, d, "combine")),
}

# forward cases whose operator has no gradient, with the construct the refusal names
NOT_DIFFERENTIABLE = {"sql_maxplus": "MAX", "compare_and_logic": "its output.s shape and dtype; output .* is bool",
                      "random_uniform": "only floating tensors have gradients; 'rng' is",
                      "grouped_weight_grad_routed": "only floating tensors have gradients; 'ids' is"}


def _route(g: rt.Graph, shape: list[int], experts: int, what: str) -> rt.Tensor:
    ids = g.input("ids", shape, "int64")
    return g.apply(RouteIndexOp((ids.type,), experts, what), ids)


def _weight_grad(g: rt.Graph, d: str) -> rt.Tensor:
    xs, dy, group = g.input("xs", [14, 6], d), g.input("dy", [14, 5], d), _route(g, [7, 2], 4, "group")
    return g.apply(GroupedWeightGradOp((xs.type, dy.type, group.type), 4), xs, dy, group)


def _capacity(g: rt.Graph, d: str, direction: str) -> rt.Tensor:
    ids = g.input("ids", [3, 7, 2], "int64")
    slot, pair = (g.apply(CapacityRouteOp((ids.type,), 4, 3, what), ids) for what in ("slot", "pair"))
    x = g.input("x", [3, 7, 6] if direction == "dispatch" else [3, 12, 6], d)
    index, inverse = (pair, slot) if direction == "dispatch" else (slot, pair)
    return g.apply(RoutedGatherOp((x.type, index.type, inverse.type)), x, index, inverse)


def _grouped(g: rt.Graph, d: str, trans: bool) -> rt.Tensor:
    xs, group = g.input("xs", [14, 6], d), _route(g, [7, 2], 4, "group")
    w = g.input("w", [4, 5, 6] if trans else [4, 6, 5], d)
    return g.apply(GroupedMatmulOp((xs.type, w.type, group.type), trans), xs, w, group)


def with_vjp(make: Case) -> Case:
    """The case's graph with the gradient of ``<out, cot>`` with respect to every floating input appended and
    saved as ``d_<input>`` (``cot`` a new input of the output's shape)."""
    def build(dtype: str) -> tuple[rt.Graph, str]:
        g, name = make(dtype)
        out = g.tensor(g.outputs["out"])
        wrt = [g.tensor(n.id) for n in g.inputs if n.type.dtype in rt.core.dtypes.FLOAT_DTYPES]
        cot = g.input("cot", out.shape, out.dtype)
        for t, d in zip(wrt, g.vjp(out, cot, wrt)):
            g.save(d, name=f"d_{t.name}")
        return g, name
    return build


GRAD_CASES: dict[str, Case] = {name: with_vjp(make) for name, make in CASES.items() if name not in NOT_DIFFERENTIABLE}


TOL = dict(rtol=1e-4, atol=1e-5)  # float32 plans against the float32 reference
# 16-bit plans against the 16-bit reference, as a share of the largest output magnitude: both compute in
# float32 and round each operator's output once, so they differ by the order of float32 additions and
# by where a value one ulp from a rounding boundary lands: two units in the last place of the dtype
SIXTEEN_BIT_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def assert_agrees(got: np.ndarray, want: np.ndarray, dtype: str, what: str, magnitude: float = 0.0) -> None:
    """``got`` equals the reference ``want`` at the tolerance of ``dtype`` (NaN where it has NaN).
    ``magnitude`` is the size of the terms an output was summed from, where they cancel: rounding
    errors scale with it, not with the (small) result."""
    if dtype not in SIXTEEN_BIT_TOL:
        np.testing.assert_allclose(got, want, rtol=TOL["rtol"], atol=max(TOL["atol"], 1e-6 * magnitude),
                                   err_msg=what)
        return
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN where the reference has none"
    finite = np.isfinite(want)
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), magnitude, 1e-30)
    err = float(np.max(np.abs(np.where(finite, got - want, 0.0)), initial=0.0)) / scale
    assert err <= SIXTEEN_BIT_TOL[dtype], f"{what}: error {err:.2e} of the largest magnitude, {dtype}"
CATALOG = Catalog()  # one in-memory catalog for the compilations of the test session


def check_plan(g: rt.Graph, feeds: dict, p: int, reruns: tuple[dict, ...] = (),
               magnitudes: dict[str, float] | None = None, **options) -> rt.CompiledGraph:
    """Compile ``g`` for ``cpu:p`` with ``options``, run it on ``feeds``, and check every output
    against ``rt.reference`` (at its dtype's tolerance) and each device's measured peak memory against
    the liveness pass's.  Each of ``reruns`` runs the same program again on new inputs, then once more
    after loading only its first input anew (the others stay loaded), each checked the same way.
    ``magnitudes`` gives, per output that sums cancelling terms, the size of those terms."""
    cg = rt.compileGraph(g, device=f"cpu:{p}", catalog=CATALOG, **options)

    def compare(got: dict, inputs: dict, what: str) -> None:
        expected = rt.reference(g, inputs)
        for name in g.outputs:
            dtype = g.nodes[g.outputs[name]].type.dtype
            assert_agrees(got[name], expected[name], dtype, f"p={p} {options} output {name} {what}",
                          (magnitudes or {}).get(name, 0.0))

    compare(cg.run(feeds), feeds, "first run")
    assert cg.executor.peak == [cg.memory()[d] for d in range(p)]
    for k, again in enumerate(reruns):
        compare(cg.run(again), again, f"re-run {k}")
        first = next(iter(again))
        changed = {**again, first: np.asarray(feeds[first])}
        cg.load({first: changed[first]})
        cg.execute()
        compare({name: cg.offload(name) for name in g.outputs}, changed, f"re-run {k} after loading {first}")
    return cg


def request_for(draw: Callable, op: object) -> dict:
    """A hypothesis draw (wrap with ``st.composite``) of an interval request for ``op``: each requestable
    index left whole or cut at up to 4 of its legal cuts."""
    from hypothesis import strategies as st

    request = {}
    for index in op.requestable():  # type: ignore[attr-defined]
        cuts = list(index.legal_cuts())
        if cuts and draw(st.booleans()):
            chosen = sorted(draw(st.sets(st.sampled_from(cuts), min_size=1, max_size=min(4, len(cuts)))))
            bounds = [0, *chosen, index.extent]
            request[index.name] = tuple(rt.Interval(a, b) for a, b in zip(bounds, bounds[1:]))
    return request


def feeds_for(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for n in g.inputs:
        if n.type.dtype == "bool":  # masks: most positions on, some rows off
            feeds[n.name] = rng.random(n.type.shape) < 0.75
        elif n.type.dtype.startswith("int"):  # ids of the table an embedding reads, or a cross-entropy's classes
            reader = next(c for c in g.operators if n.id in c.inputs and c.kind in (
                "embedding", "embedding_grad", "cross_entropy", "dropout", "random", "take_along", "one_hot",
                "route_index", "capacity_route", "put_rows"))
            if reader.kind in ("dropout", "random"):  # a generator state (seed, offset): every bit may be set
                feeds[n.name] = rng.integers(-2**63, 2**63 - 1, size=2, dtype=np.int64, endpoint=True)
                continue
            if reader.kind in ("route_index", "capacity_route"):  # the router's choices, some outside every expert
                experts = reader.op.experts  # type: ignore[attr-defined]
                feeds[n.name] = rng.integers(-1, experts + 1, size=n.type.shape)
                continue
            if reader.kind == "one_hot":  # ids of the classes, and one out of range (a row of zeros)
                classes = reader.op.classes  # type: ignore[attr-defined]
                feeds[n.name] = rng.integers(-1, classes + 1, size=n.type.shape)
                continue
            if reader.kind == "put_rows":  # distinct rows to replace (a repeated row's gradient is torch's choice)
                rows = g.nodes[reader.inputs[0]].type.shape[0]
                feeds[n.name] = rng.permutation(rows)[:n.type.shape[0]].astype(rt.core.dtypes.numpy_dtype(n.type.dtype))
                continue
            if reader.kind == "embedding_grad":  # ids of the rows it scatters into
                feeds[n.name] = rng.integers(0, reader.op.vocab, size=n.type.shape)  # type: ignore[attr-defined]
                continue
            table = g.nodes[reader.inputs[0]].type.shape
            feeds[n.name] = rng.integers(0, table[0] if reader.kind == "embedding" else table[-1], size=n.type.shape)
        else:
            feeds[n.name] = rng.standard_normal(n.type.shape).astype(rt.core.dtypes.numpy_dtype(n.type.dtype))
    return feeds


def operand_values(g: rt.Graph, node_name: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The values of the inputs of ``node_name``, computed by the reference."""
    node = g.node(node_name)
    probe = rt.Graph()
    probe.nodes, probe._names = list(g.nodes), set(g._names)
    probe.outputs = {f"in{k}": i for k, i in enumerate(node.inputs)}
    vals = rt.reference(probe, feeds)
    return [vals[f"in{k}"] for k in range(len(node.inputs))]

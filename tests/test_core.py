"""Core types: intervals, boxes, tilings, shardable indices, join-agg specs, the ⊕ of
attention (log-sum-exp), and the facts the attention operator's specs must state."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels import naive_softmax

import relational_tensors as rt
from relational_tensors.core.tiling import check_tiles
from relational_tensors.dp_optimizer import interval_requests

Iv = rt.Interval
B = rt.Box
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- intervals and boxes ------------------------------------------------------------------------

def test_interval() -> None:
    assert Iv(2, 5).size == 3 and Iv(4, 4).size == 0
    assert Iv(2, 5).intersect(Iv(4, 9)) == Iv(4, 5)
    assert Iv(2, 5).intersect(Iv(7, 9)).size == 0
    assert Iv(2, 5).shift(3) == Iv(5, 8) and str(Iv(2, 5)) == "[2,5)"
    assert sorted([Iv(3, 4), Iv(0, 9), Iv(0, 2)]) == [Iv(0, 2), Iv(0, 9), Iv(3, 4)]
    assert len({Iv(0, 2), Iv(0, 2), Iv(1, 2)}) == 2  # frozen and hashable


def test_box() -> None:
    b = B((0, 4), (2, 8))
    assert b.shape == (2, 4) and b.volume == 8 and b.rank == 2 and not b.is_empty
    assert b.intervals() == (Iv(0, 2), Iv(4, 8)) and B.from_intervals(b.intervals()) == b
    assert B.of_shape((3, 5)) == B((0, 0), (3, 5))
    assert b.contains(B((1, 5), (2, 6))) and not b.contains(B((1, 3), (2, 6)))
    assert b.intersect(B((1, 6), (5, 9))) == B((1, 6), (2, 8))
    assert b.overlaps(B((1, 7), (3, 9))) and not b.overlaps(B((2, 4), (3, 8)))  # touching is not overlapping
    assert B((0, 3), (2, 3)).is_empty
    assert b.slices() == (slice(0, 2), slice(4, 8))
    assert b.slices(within=B((0, 4), (4, 10))) == (slice(0, 2), slice(0, 4))
    assert str(b) == "[0,2)x[4,8)"


# --- tilings -------------------------------------------------------------------------------------

def test_overlay_and_refines() -> None:
    a = rt.Tiling(((0, 2, 4), (0, 6)))
    b = rt.Tiling(((0, 1, 4), (0, 3, 6)))
    both = a.overlay(b)
    assert both == rt.Tiling(((0, 1, 2, 4), (0, 3, 6))) == b.overlay(a)
    assert both.counts == (3, 2) and both.num_blocks == 6 and both.shape_str() == "3x2"
    assert both.refines(a) and both.refines(b) and both.refines(both)
    assert not a.refines(b) and not b.refines(a) and not a.refines(both)
    whole = rt.Tiling.whole(B((0, 0), (4, 6)))
    assert a.refines(whole) and not whole.refines(a)
    assert a.overlay(a) == a and a.overlay(whole) == a
    assert a.space == B((0, 0), (4, 6))
    assert a.intervals(0) == (Iv(0, 2), Iv(2, 4))


def test_boxes_are_row_major() -> None:
    t = rt.Tiling(((0, 2, 4), (0, 3, 6)))
    assert [str(b) for b in t.boxes()] == ["[0,2)x[0,3)", "[0,2)x[3,6)", "[2,4)x[0,3)", "[2,4)x[3,6)"]
    t3 = rt.Tiling(((0, 1, 2), (0, 5), (0, 1, 3)))
    assert [b.lower for b in t3.boxes()] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]


@st.composite
def breakpoints(draw, extent: int) -> tuple[int, ...]:
    inner = draw(st.sets(st.integers(1, extent - 1), max_size=4)) if extent > 1 else set()
    return (0, *sorted(inner), extent)


@st.composite
def two_tilings(draw):
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    t1 = rt.Tiling(tuple(draw(breakpoints(s)) for s in shape))
    t2 = rt.Tiling(tuple(draw(breakpoints(s)) for s in shape))
    return t1, t2


@SETTINGS
@given(pair=two_tilings(), seed=st.integers(0, 2**32 - 1))
def test_tiling_properties(pair, seed: int) -> None:
    a, b = pair
    over = a.overlay(b)
    assert over.refines(a) and over.refines(b) and over == b.overlay(a)
    # the overlay is the coarsest common refinement: each of its cuts comes from a or b
    for d in range(a.rank):
        assert set(over.breaks[d]) == set(a.breaks[d]) | set(b.breaks[d])
    assert a.refines(b) == (over == a)
    # the blocks tile the space, and from_boxes recovers the grid in any order
    boxes = list(a.boxes())
    assert len(boxes) == a.num_blocks
    check_tiles(boxes, a.space)
    np.random.default_rng(seed).shuffle(boxes)
    assert rt.Tiling.from_boxes(boxes + boxes[:1], a.space) == a  # repeated blocks are one block
    # every atom of the overlay lies inside exactly one block of a
    for atom in over.boxes():
        assert sum(blk.contains(atom) for blk in a.boxes()) == 1


@pytest.mark.parametrize("boxes, message", [
    ([B((0, 0), (2, 4)), B((1, 0), (4, 4))], "must be disjoint; got [0,2)x[0,4) and [1,4)x[0,4), which overlap"),
    ([B((0, 0), (2, 4)), B((3, 0), (4, 4))], "must cover the tensor; got 12 of 16 elements"),
    ([B((0, 0), (2, 4)), B((2, 0), (5, 4))], "must lie inside the tensor; got [2,5)x[0,4) outside [0,4)x[0,4)"),
    ([B((0, 0), (2, 2)), B((0, 2), (1, 4)), B((1, 2), (2, 4)), B((2, 0), (4, 4))],
     "tile the tensor but do not form a grid; got 4 blocks against a 3x2 grid"),
    ([B((0, 0), (1, 3)), B((1, 0), (4, 1)), B((1, 1), (4, 4)), B((0, 3), (1, 4))],
     "do not form a grid"),
    ([B((0, 0, 0), (2, 4, 1)), B((2, 0, 0), (4, 4, 1))], "must lie inside the tensor; got [0,2)x[0,4)x[0,1) outside"),
    ([B((0,), (2,)), B((2,), (4,))], "must lie inside the tensor; got [0,2) outside [0,4)x[0,4)"),
])
def test_from_boxes_rejects(boxes, message: str) -> None:
    with pytest.raises(rt.SpecError, match=re.escape(message)):
        rt.Tiling.from_boxes(boxes, B((0, 0), (4, 4)))


def test_from_boxes_accepts_a_grid_in_any_order() -> None:
    space = B((0, 0), (4, 4))
    boxes = [B((2, 1), (4, 4)), B((0, 0), (2, 1)), B((0, 1), (2, 4)), B((2, 0), (4, 1))]
    assert rt.Tiling.from_boxes(boxes, space) == rt.Tiling(((0, 2, 4), (0, 1, 4)))
    assert rt.Tiling.from_boxes([space], space) == rt.Tiling.whole(space)


# --- join-agg specs ------------------------------------------------------------------------------

def _spec(outputs, inputs=None, agg=rt.SUM):
    x = rt.TensorType.zero((4, 6))
    y = rt.TensorType.zero((4,))
    inputs = inputs or [B((0, 0), (4, 6))] * len(outputs)
    fs = tuple(rt.FunctionSpec((i,), o) for i, o in zip(inputs, outputs))
    return rt.JoinAggSpec((x,), y, fs, agg)


def test_join_agg_spec_checks_its_output_tiling() -> None:
    spec = _spec([B((0,), (2,)), B((2,), (4,)), B((0,), (2,))])  # a block produced twice is aggregated
    assert spec.p == 3 and str(spec.output_tiling) == "[0,2,4]"
    assert spec.output_multiplicity() == {B((0,), (2,)): 2, B((2,), (4,)): 1}
    with pytest.raises(rt.SpecError, match="must be disjoint"):
        _spec([B((0,), (3,)), B((2,), (4,))])
    with pytest.raises(rt.SpecError, match="must cover the tensor; got 2 of 4 elements"):
        _spec([B((0,), (2,))])
    with pytest.raises(rt.SpecError, match=r"output block \[2,2\) must be a non-empty projection"):
        _spec([B((0,), (2,)), B((2,), (2,)), B((2,), (4,))])
    with pytest.raises(rt.SpecError, match=r"output block \[2,5\) must be a non-empty projection of \[0,4\)"):
        _spec([B((0,), (2,)), B((2,), (5,))])
    with pytest.raises(rt.SpecError, match=r"input 0 block \[0,4\)x\[0,7\) is not a projection of \[0,4\)x\[0,6\)"):
        _spec([B((0,), (4,))], inputs=[B((0, 0), (4, 7))])
    with pytest.raises(rt.SpecError, match="needs at least one function specification"):
        _spec([])


def test_operator_specs_state_blocks_and_flops() -> None:
    g = rt.Graph()
    op = g.matmul(g.input("a", [10, 6]), g.input("b", [6, 4])).node.op
    spec = op.spec({"i": [Iv(0, 5), Iv(5, 10)], "j": [Iv(0, 2), Iv(2, 6)]})
    assert spec.split_text == "i=2,j=2,k=1" and spec.p == 4 and spec.aggregation is rt.SUM
    assert [str(f) for f in spec.functions] == [
        "[0,5)x[0,2) x [0,2)x[0,4) -> [0,5)x[0,4)", "[0,5)x[2,6) x [2,6)x[0,4) -> [0,5)x[0,4)",
        "[5,10)x[0,2) x [0,2)x[0,4) -> [5,10)x[0,4)", "[5,10)x[2,6) x [2,6)x[0,4) -> [5,10)x[0,4)",
    ]
    assert [f.flops for f in spec.functions] == [2 * 5 * 2 * 4, 2 * 5 * 4 * 4] * 2
    assert spec.total_flops == 2 * 10 * 6 * 4
    assert spec.input_blocks(1) == (B((0, 0), (2, 4)), B((2, 0), (6, 4)))
    assert spec.imbalance == pytest.approx(1.0) and not spec.balanced


# --- shardable indices ----------------------------------------------------------------------------

@SETTINGS
@given(extent=st.integers(1, 300), data=st.data())
def test_near_equal_follows_array_split(extent: int, data) -> None:
    n = data.draw(st.integers(1, min(extent, 40)))
    ivs = rt.ShardableIndex("i", extent).near_equal(n)
    assert ivs is not None
    assert [iv.size for iv in ivs] == [len(part) for part in np.array_split(np.arange(extent), n)]
    assert ivs[0].lo == 0 and ivs[-1].hi == extent and all(a.hi == b.lo for a, b in zip(ivs, ivs[1:]))


@pytest.mark.parametrize("extent, n, sizes", [(1000, 8, [125] * 8), (11008, 6, [1835, 1835, 1835, 1835, 1834, 1834]),
                                              (8, 3, [3, 3, 2]), (7, 7, [1] * 7), (10, 1, [10])])
def test_near_equal_examples(extent: int, n: int, sizes) -> None:
    assert [iv.size for iv in rt.ShardableIndex("i", extent).near_equal(n)] == sizes


def test_near_equal_impossible() -> None:
    assert rt.ShardableIndex("i", 5).near_equal(6) is None
    assert rt.ShardableIndex("i", 5).near_equal(0) is None
    assert rt.ShardableIndex("s", 10, positions=(3, 7)).near_equal(4) is None
    assert rt.ShardableIndex("s", 10, positions=()).near_equal(2) is None
    assert rt.ShardableIndex("s", 10, positions=()).near_equal(1) == (Iv(0, 10),)


@pytest.mark.parametrize("positions, extent, n, cuts", [
    ((2, 9), 10, 2, [2]),                                  # |2 - 5| < |9 - 5|
    ((4, 6), 10, 2, [4]),                                  # a tie goes to the earlier position
    ((5, 9, 20, 22, 31, 40), 47, 2, [22]),                 # ideal 23.5
    ((5, 9, 20, 22, 31, 40), 47, 3, [20, 31]),             # ideals 15.7, 31.3
    ((5, 9, 20, 22, 31, 40), 47, 4, [9, 22, 31]),          # ideals 11.75, 23.5, 35.25 -> 9 (2.75) beats 20 (8.25)
    ((5, 9, 20, 22, 31, 40), 47, 7, [5, 9, 20, 22, 31, 40]),
    ((1, 2, 3), 100, 3, [2, 3]),                           # crowded: the nearest cuts that leave room
    ((97, 98, 99), 100, 3, [97, 98]),
])
def test_near_equal_explicit_positions(positions, extent, n, cuts) -> None:
    ivs = rt.ShardableIndex("s", extent, positions=positions).near_equal(n)
    assert [iv.lo for iv in ivs[1:]] == cuts
    assert ivs[0].lo == 0 and ivs[-1].hi == extent


@SETTINGS
@given(extent=st.integers(2, 200), data=st.data())
def test_near_equal_explicit_positions_property(extent: int, data) -> None:
    positions = tuple(sorted(data.draw(st.sets(st.integers(1, extent - 1), min_size=1, max_size=12))))
    n = data.draw(st.integers(1, len(positions) + 1))
    index = rt.ShardableIndex("s", extent, positions=positions)
    ivs = index.near_equal(n)
    assert ivs is not None and len(ivs) == n
    assert index.check(ivs) == ivs  # legal, in order, tiling [0, extent)
    # when the legal position nearest each ideal cut k * extent / n (earlier on ties) is distinct
    # for every k, those are exactly the cuts chosen
    nearest = [min(positions, key=lambda x: (abs(x - k * extent / n), x)) for k in range(1, n)]
    if all(a < b for a, b in zip(nearest, nearest[1:])):
        assert [iv.lo for iv in ivs[1:]] == nearest
    assert index.near_equal(len(positions) + 2) is None


def test_check() -> None:
    any_index = rt.ShardableIndex("i", 10)
    assert any_index.check([Iv(0, 3), Iv(3, 10)]) == (Iv(0, 3), Iv(3, 10))
    assert any_index.check((Iv(0, 10),)) == (Iv(0, 10),)
    for bad in ([Iv(0, 3), Iv(4, 10)], [Iv(0, 3), Iv(2, 10)], [Iv(0, 3), Iv(3, 9)], [Iv(3, 10), Iv(0, 3)],
                [Iv(0, 0), Iv(0, 10)], [Iv(1, 10)], []):
        with pytest.raises(rt.SpecError, match="must be non-empty, in order and tile"):
            any_index.check(bad)
    packed = rt.ShardableIndex("seq", 10, positions=(3, 7))
    assert packed.check([Iv(0, 3), Iv(3, 10)]) == (Iv(0, 3), Iv(3, 10))
    with pytest.raises(rt.SpecError, match=r"may be cut only at \[3, 7\]; got cuts at \[5\]"):
        packed.check([Iv(0, 3), Iv(3, 5), Iv(5, 10)])
    assert packed.max_intervals() == 3 and list(packed.legal_cuts()) == [3, 7]
    assert any_index.max_intervals() == 10 and list(any_index.legal_cuts()) == list(range(1, 10))
    assert any_index.requestable and not rt.ShardableIndex("heads_q", 8, inherits="heads_kv").requestable


# --- ⊕ = log-sum-exp --------------------------------------------------------------------------------

def block_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, scale: float):
    """Attention of q[rows, d] over one key block, normalised within the block, with its log-sum-exp."""
    s = np.where(visible, q @ k.T * scale, -np.inf)  # [rows, keys]
    out = np.zeros((q.shape[0], v.shape[1]))
    lse = np.full(q.shape[0], -np.inf)
    for r in range(q.shape[0]):
        if visible[r].any():
            m = s[r][visible[r]].max()
            w = np.exp(s[r] - m)
            lse[r] = m + math.log(w.sum())
            out[r] = (w / w.sum()) @ v
    return out, lse


@SETTINGS
@given(rows=st.integers(1, 9), keys=st.integers(1, 30), d=st.integers(1, 6), causal=st.booleans(),
       data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_lse_merge_of_key_blocks_equals_whole_attention(rows, keys, d, causal, data, seed) -> None:
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((rows, d)) * 2, rng.standard_normal((keys, d)), rng.standard_normal((keys, d + 1))
    scale = 1 / math.sqrt(d)
    cuts = sorted(data.draw(st.sets(st.integers(1, keys - 1), max_size=6))) if keys > 1 else []
    bounds = [0, *cuts, keys]
    # causal: query row r sits at position keys - rows + r (the last query sees every key; none sees nothing)
    q_pos = np.maximum(np.arange(rows) + keys - rows, 0)
    visible = (np.arange(keys)[None, :] <= q_pos[:, None]) if causal else np.ones((rows, keys), dtype=bool)
    partials = [block_partial(q, k[a:b], v[a:b], visible[:, a:b], scale) for a, b in zip(bounds, bounds[1:])]
    order = data.draw(st.permutations(range(len(partials))))  # ⊕ is associative and commutative
    merged = rt.LSE.combine([partials[i] for i in order])
    out, lse = merged
    s = np.where(visible, q @ k.T * scale, -np.inf)
    whole_out = naive_softmax(s, -1) @ v  # every row sees at least one key
    np.testing.assert_allclose(rt.LSE.finalize(merged), whole_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out, whole_out, rtol=1e-10, atol=1e-12)
    top = s.max(axis=1)
    np.testing.assert_allclose(lse, top + np.log(np.exp(s - top[:, None]).sum(axis=1)), rtol=1e-10)


def test_lse_merge_with_empty_partials() -> None:
    full = (np.array([[1.0, 2.0]]), np.array([0.5]))
    empty = (np.zeros((1, 2)), np.array([-np.inf]))
    for parts in ([full, empty], [empty, full], [empty, full, empty]):
        out, lse = rt.LSE.combine(parts)
        np.testing.assert_array_equal(out, full[0])
        np.testing.assert_array_equal(lse, full[1])
    out, lse = rt.LSE.combine([empty, empty])
    np.testing.assert_array_equal(out, 0.0)
    assert np.isneginf(lse).all()


def test_other_aggregations() -> None:
    a, b = np.array([1.0, 5.0]), np.array([3.0, 2.0])
    assert rt.SUM.combine([a, b]).tolist() == [4.0, 7.0]
    assert rt.MAX.combine([a, b]).tolist() == [3.0, 5.0]
    assert rt.MIN.combine([a, b]).tolist() == [1.0, 2.0]
    assert rt.SUM.finalize(a) is a
    assert set(rt.AGGREGATIONS) == {"sum", "max", "min", "lse", "logsumexp"}
    np.testing.assert_allclose(rt.AGGREGATIONS["logsumexp"].combine([a, b]), np.logaddexp(a, b))
    assert np.isneginf(rt.AGGREGATIONS["logsumexp"].combine([np.array([-np.inf])] * 2)).all()
    with pytest.raises(ValueError):
        rt.SUM.combine([])


# --- attention spec facts -------------------------------------------------------------------------

def attention_op(b=1, s=16, hq=8, hkv=2, d=4, causal=False, seq_ends=None, s_kv=None):
    g = rt.Graph()
    q = g.input("q", [b, s, hq, d])
    k = g.input("k", [b, s_kv or s, hkv, d])
    return g.attention(q, k, k, causal=causal, seq_ends=seq_ends).node.op


def index_of(op, name: str) -> rt.ShardableIndex:
    return next(s for s in op.shardable() if s.name == name)


@pytest.mark.parametrize("hq, hkv, n", [(8, 2, 2), (16, 8, 3), (6, 6, 4), (12, 3, 3), (5, 1, 1)])
def test_gqa_boxes(hq: int, hkv: int, n: int) -> None:
    op = attention_op(hq=hq, hkv=hkv)
    g = hq // hkv
    assert index_of(op, "heads_q").inherits == "heads_kv" and "heads_q" not in {s.name for s in op.requestable()}
    spec = op.spec({"heads_kv": index_of(op, "heads_kv").near_equal(n)})
    assert spec.p == n
    for f in spec.functions:
        kv = f.inputs[1].interval(2)
        assert f.inputs[2].interval(2) == kv
        assert f.inputs[0].interval(2) == Iv(kv.lo * g, kv.hi * g) == f.output.interval(2)
        for m in range(kv.lo, kv.hi):  # kv head m serves query heads [m*g, (m+1)*g)
            assert f.inputs[0].interval(2).lo <= m * g and (m + 1) * g <= f.inputs[0].interval(2).hi
    assert sorted(f.inputs[1].interval(2).size for f in spec.functions) == sorted(
        len(p) for p in np.array_split(np.arange(hkv), n))


@SETTINGS
@given(s=st.integers(2, 40), data=st.data())
def test_causal_query_block_reads_the_key_prefix(s: int, data) -> None:
    op = attention_op(s=s, causal=True)
    cuts = sorted(data.draw(st.sets(st.integers(1, s - 1), max_size=5)))
    bounds = [0, *cuts, s]
    rows = [Iv(a, b) for a, b in zip(bounds, bounds[1:])]
    spec = op.spec({"seq_q": rows})
    for f, r in zip(spec.functions, rows):
        assert f.inputs[0].interval(1) == r == f.output.interval(1)
        assert f.inputs[1].interval(1) == Iv(0, r.hi) == f.inputs[2].interval(1)
    # not causal: every query block reads every key
    full = attention_op(s=s, causal=False).spec({"seq_q": rows})
    assert all(f.inputs[1].interval(1) == Iv(0, s) for f in full.functions)


def test_causal_key_split_reads_only_visible_keys() -> None:
    op = attention_op(s=12, causal=True)
    spec = op.spec({"seq_q": [Iv(0, 4), Iv(4, 12)], "seq_kv": [Iv(0, 6), Iv(6, 12)]})
    assert spec.aggregation is rt.LSE
    keys = {(f.inputs[0].interval(1), f.inputs[1].interval(1)) for f in spec.functions}
    assert keys == {(Iv(0, 4), Iv(0, 4)), (Iv(0, 4), Iv(6, 6)), (Iv(4, 12), Iv(0, 6)), (Iv(4, 12), Iv(6, 12))}
    work = {f.inputs[0].interval(1): [] for f in spec.functions}
    for f in spec.functions:
        work[f.inputs[0].interval(1)].append(f.flops)
    assert work[Iv(0, 4)][1] == 0  # a key block after the query block is empty work


PACKED = (5, 9, 20, 22, 31, 40, 47)


def test_packed_seq_q_only_cut_at_seq_ends() -> None:
    op = attention_op(s=47, hq=4, causal=True, seq_ends=PACKED)
    seq_q, seq_kv = index_of(op, "seq_q"), index_of(op, "seq_kv")
    assert seq_q.positions == PACKED[:-1] and seq_q.max_intervals() == 7
    assert seq_kv.positions == rt.ANY
    for p in range(1, 9):
        for request in interval_requests(op, p):
            for iv in request.get("seq_q", ()):
                assert iv.lo in (0, *PACKED)
                assert iv.hi in PACKED
    assert 8 not in {len(r.get("seq_q", ())) for r in interval_requests(op, 8)}
    # a packed causal query block reads keys from the start of its first sequence
    spec = op.spec({"seq_q": [Iv(0, 9), Iv(9, 22), Iv(22, 47)]})
    assert [f.inputs[1].interval(1) for f in spec.functions] == [Iv(0, 9), Iv(9, 22), Iv(22, 47)]
    # not causal but packed: the same, since sequences see nothing outside themselves
    op_nc = attention_op(s=47, hq=4, causal=False, seq_ends=PACKED)
    spec = op_nc.spec({"seq_q": [Iv(0, 20), Iv(20, 47)]})
    assert [f.inputs[1].interval(1) for f in spec.functions] == [Iv(0, 20), Iv(20, 47)]


def test_equal_length_causal_split_is_unbalanced_and_equal_work_is_balanced() -> None:
    op = attention_op(s=1024, hq=4, causal=True)
    seq_q = index_of(op, "seq_q")
    cands = op.interval_candidates(seq_q, 4)
    assert len(cands) == 2
    equal, work = cands
    assert [iv.size for iv in equal] == [256] * 4
    assert not op.spec({"seq_q": equal}).balanced and op.spec({"seq_q": equal}).imbalance > 5
    spec = op.spec({"seq_q": work})
    assert spec.balanced and spec.imbalance <= 0.10
    # independent count of the visible (query, key) pairs per block: row r sees r + 1 keys
    pairs = [sum(r + 1 for r in range(iv.lo, iv.hi)) for iv in work]
    assert max(pairs) / min(pairs) - 1 <= 0.10
    flops = [f.flops for f in spec.functions]
    assert np.allclose(np.array(flops) / np.array(pairs), flops[0] / pairs[0])
    # both are offered to the optimizer
    offered = [r["seq_q"] for r in interval_requests(op, 4) if "seq_q" in r]
    assert equal in offered and work in offered
    # not causal: equal lengths are equal work, and only they are offered
    plain = attention_op(s=1024, hq=4, causal=False)
    assert plain.interval_candidates(index_of(plain, "seq_q"), 4) == [equal]
    assert plain.spec({"seq_q": equal}).balanced


# --- every request for p devices: p function specs whose outputs tile the output -------------------

@st.composite
def random_operator(draw):
    g = rt.Graph()
    kind = draw(st.sampled_from(["matmul", "batched_matmul", "attention", "reduce", "softmax", "rope", "reshape",
                                 "einsum", "embedding", "concat", "sql_maxplus"]))
    dim = st.integers(1, 12)
    if kind == "matmul":
        t = g.matmul(g.input("a", [draw(dim), draw(dim)]), g.input("b", [g.nodes[0].type.shape[1], draw(dim)]))
    elif kind == "batched_matmul":
        bt, i, j, k = draw(dim), draw(dim), draw(dim), draw(dim)
        t = g.matmul(g.input("a", [bt, i, j]), g.input("b", [bt, j, k] if draw(st.booleans()) else [j, k]))
    elif kind == "attention":
        hkv, grp, s = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 24))
        causal = draw(st.booleans())
        ends = None
        if draw(st.booleans()):
            ends = (*sorted(draw(st.sets(st.integers(1, s - 1), max_size=5))), s) if s > 1 else (s,)
        s_kv = s if causal or ends else draw(st.integers(1, 24))
        q = g.input("q", [draw(st.integers(1, 3)), s, hkv * grp, 2])
        k = g.input("k", [q.shape[0], s_kv, hkv, 2])
        t = g.attention(q, k, k, causal=causal, seq_ends=ends)
    elif kind == "reduce":
        x = g.input("x", [draw(dim), draw(dim), draw(dim)])
        axes = draw(st.sets(st.integers(0, 2), min_size=1))
        t = g.sum(x, axis=tuple(axes), keepdims=draw(st.booleans()))
    elif kind == "softmax":
        t = g.softmax(g.input("x", [draw(dim), draw(dim)]), axis=draw(st.integers(-2, 1)))
    elif kind == "rope":
        t = g.rope(g.input("x", [draw(dim), draw(dim), draw(dim), 4]))
    elif kind == "reshape":
        b, h, d = draw(dim), draw(st.integers(1, 6)), draw(st.integers(1, 6))
        x = g.input("x", [b, h * d])
        t = g.reshape(x, [b, h, d]) if draw(st.booleans()) else g.reshape(g.reshape(x, [b, h, d]), [b * h * d])
    elif kind == "einsum":
        i, j, k = draw(dim), draw(dim), draw(dim)
        t = g.einsum("ij,jk,ik->k", g.input("a", [i, j]), g.input("b", [j, k]), g.input("c", [i, k]))
    elif kind == "embedding":
        t = g.embedding(g.input("table", [draw(dim), draw(dim)]), g.input("ids", [draw(dim), draw(dim)], "int64"))
    elif kind == "concat":
        r = draw(dim)
        t = g.concat([g.input(f"x{n}", [r, draw(dim)]) for n in range(draw(st.integers(1, 3)))], 1)
    else:
        i, j, k = draw(dim), draw(dim), draw(dim)
        t = g.sql("SELECT A.i, B.k, MAX(A.v + B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k",
                  A=(g.input("a", [i, j]), ("i", "j")), B=(g.input("b", [j, k]), ("j", "k")))
    return t.node.op


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=random_operator(), p=st.integers(1, 16))
def test_every_request_gives_p_function_specs_that_tile_the_output(op, p: int) -> None:
    requests = list(itertools.islice(interval_requests(op, p), 60))
    for request in requests:
        spec = op.spec(request)
        assert spec.p == p
        assert math.prod(n for _, n in spec.split) == p
        tiling = spec.output_tiling
        assert tiling.space == op.output_type.box
        outputs = {f.output for f in spec.functions}
        assert outputs == set(tiling.boxes())
        check_tiles(sorted(outputs, key=lambda b: b.lower), op.output_type.box)
        assert sum(b.volume for b in outputs) == op.output_type.volume
        for f in spec.functions:
            for box, t in zip(f.inputs, op.input_types):
                assert t.box.contains(box)
    # a request exists exactly when the requestable indices can make p intervals between them
    reachable = {1}
    for index in op.requestable():
        reachable = {r * n for r in reachable for n in range(1, index.max_intervals() + 1) if r * n <= p}
    assert bool(requests) == (p in reachable)

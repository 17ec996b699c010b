"""Which attention blocks the library FlashAttention kernels take (``attention="flash"``), checked
without a GPU: whenever ``flash.segments`` accepts a function spec, the mask its varlen segments
imply (bottom-right causal per segment) is exactly the operator's mask on that block."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from relational_tensors.core.types import TensorType
from relational_tensors.kernels import flash
from relational_tensors.sql_specs.attention import AttentionOp


def implied_limits(f, segs, causal):
    """Per query row of the block, the absolute keys [lo, hi) the segments let it see."""
    r0, k0 = f.inputs[0].lower[1], f.inputs[1].lower[1]
    lo, hi = [], []
    cq = ck = 0
    for nq, nk in segs:
        for i in range(nq):
            lo.append(k0 + ck)
            hi.append(k0 + ck + (i + nk - nq + 1 if causal else nk))
        cq, ck = cq + nq, ck + nk
    return r0, np.array(lo), np.array(hi)


def check_spec(op, spec):
    taken = 0
    for f in spec.functions:
        segs = flash.segments(op, f, "float16", lse=False)
        if segs is None:
            continue
        taken += 1
        r0, lo, hi = implied_limits(f, segs, op.causal)
        rows = np.arange(r0, f.inputs[0].upper[1])
        want_lo, want_hi = op._key_limits(rows)
        assert len(lo) == len(rows)
        np.testing.assert_array_equal(lo, want_lo)
        np.testing.assert_array_equal(hi, want_hi)
        assert f.inputs[1].lower[1] == lo.min() and f.inputs[1].upper[1] == hi.max()
    return taken


@settings(max_examples=60, deadline=None)
@given(seq=st.integers(4, 96), causal=st.booleans(), packed=st.booleans(), split=st.integers(1, 5),
       index=st.sampled_from(["seq_q", "heads_kv", "batch", "seq_kv"]), data=st.data())
def test_accepted_blocks_compute_the_operators_mask(seq, causal, packed, split, index, data):
    ends = None
    if packed and seq > 2:
        cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), max_size=4)))
        ends = tuple(cuts) + (seq,)
    q, kv = TensorType.zero((2, seq, 4, 8)), TensorType.zero((2, seq, 2, 8))
    op = AttentionOp((q, kv, kv), causal=causal, seq_ends=ends)
    idx = {s.name: s for s in op.shardable()}[index]
    intervals = idx.near_equal(min(split, idx.extent))
    assume(intervals is not None)  # a split this index does not offer (packed positions)
    spec = op.spec({index: intervals})
    taken = check_spec(op, spec)
    if index != "seq_kv":  # without a key split every block is one the library computes
        assert taken == len(spec.functions)


def test_refusals() -> None:
    q, kv = TensorType.zero((1, 32, 4, 8)), TensorType.zero((1, 32, 2, 8))
    op = AttentionOp((q, kv, kv), causal=True)
    f = op.spec({}).functions[0]
    assert flash.segments(op, f, "float16", lse=False) == ((32, 32),)
    assert flash.segments(op, f, "bfloat16", lse=False) == ((32, 32),)
    assert flash.segments(op, f, "float32", lse=False) is None      # the library kernels are 16-bit
    assert flash.segments(op, f, "float16", lse=True) is None       # a key split's partial needs its lse
    odd = AttentionOp((TensorType.zero((1, 32, 4, 12)), *[TensorType.zero((1, 32, 2, 12))] * 2), causal=True)
    assert flash.segments(odd, odd.spec({}).functions[0], "float16", lse=False) is None  # head dim 12


def test_unknown_attention_kernel_is_refused() -> None:
    import pytest

    import relational_tensors as rt

    g = rt.Graph()
    g.save(g.unary(g.input("x", [4, 4], "float32"), "relu"), name="y")
    with pytest.raises(rt.PlanError, match=r"unknown attention kernel 'cudnn'; choose one of \('triton', 'flash'\)"):
        rt.compileGraph(g, device="cpu:2", attention="cudnn")

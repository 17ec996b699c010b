"""The LLaMA-style block of ``relational_tensors.graph.models``: the reference equals a plain NumPy
block written here, and every operator of the block, under every interval request for
1..8 devices, executes its join-agg spec to the reference value of its node."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from test_kernels import naive_attention, naive_rmsnorm, naive_rope, naive_silu

import relational_tensors as rt
from relational_tensors.dp_optimizer import interval_requests
from relational_tensors.graph.models import llama_block, llama_feeds

PACKED_ENDS = (5, 9, 20, 22, 31, 40, 47)  # 7 packed sequences of uneven lengths
MODEL_ROPE_BASE = 500000.0  # llama_block's default, as in LLaMA 3
MODEL_EPS = 1e-5


def numpy_block(f: dict[str, np.ndarray], n_heads: int, n_kv_heads: int, seq_ends: Sequence[int] | None = None,
                rope_base: float = MODEL_ROPE_BASE, eps: float = MODEL_EPS) -> np.ndarray:
    """One pre-norm LLaMA block, written out in plain NumPy."""
    x = f["x"]
    b, s, d = x.shape
    dh = d // n_heads
    h = naive_rmsnorm(x, f["attn_norm"], eps)
    q = (h @ f["wq"]).reshape(b, s, n_heads, dh)
    k = (h @ f["wk"]).reshape(b, s, n_kv_heads, dh)
    v = (h @ f["wv"]).reshape(b, s, n_kv_heads, dh)
    q, k = naive_rope(q, rope_base, seq_ends), naive_rope(k, rope_base, seq_ends)
    a = naive_attention(q, k, v, causal=True, seq_ends=seq_ends, scale=1.0 / math.sqrt(dh))
    x2 = x + a.reshape(b, s, n_heads * dh) @ f["wo"]
    h2 = naive_rmsnorm(x2, f["ffn_norm"], eps)
    ffn = (naive_silu(h2 @ f["w1"]) * (h2 @ f["w3"])) @ f["w2"]
    return x2 + ffn


BLOCKS = {
    # name: (batch, seq, d_model, n_heads, n_kv_heads, d_ff, seq_ends)
    "single_sequence": (1, 24, 32, 4, 2, 40, None),
    "batch_2": (2, 17, 48, 6, 3, 72, None),
    "packed_7": (1, 47, 32, 8, 2, 88, PACKED_ENDS),
    "batch_2_packed": (2, 47, 16, 4, 1, 24, PACKED_ENDS),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_matches_numpy(name: str) -> None:
    batch, seq, d, nh, nkv, dff, ends = BLOCKS[name]
    g = llama_block(batch, seq, d, nh, nkv, dff, dtype="float64", seq_ends=ends)
    feeds = llama_feeds(g, seed=7)
    assert {n.name for n in g.inputs} == {"x", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"}
    for rope in ("q_rope", "k_rope"):
        assert g.node(rope).op.base == MODEL_ROPE_BASE and g.node(rope).op.seq_ends == ends
    got = rt.reference(g, feeds)["y"]
    want = numpy_block(feeds, nh, nkv, ends)
    assert got.shape == (batch, seq, d) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_packed_sequences_do_not_see_each_other() -> None:
    """Changing one packed sequence leaves the block's output on every other sequence unchanged."""
    g = llama_block(1, 47, 32, 8, 2, 88, dtype="float64", seq_ends=PACKED_ENDS)
    feeds = llama_feeds(g, seed=3)
    base = rt.reference(g, feeds)["y"]
    feeds["x"] = feeds["x"].copy()
    feeds["x"][0, 9:20] += 1.0  # the third sequence
    moved = rt.reference(g, feeds)["y"]
    np.testing.assert_array_equal(moved[0, :9], base[0, :9])
    np.testing.assert_array_equal(moved[0, 20:], base[0, 20:])
    assert not np.allclose(moved[0, 9:20], base[0, 9:20])


def test_packed_block_equals_each_sequence_alone() -> None:
    g = llama_block(1, 47, 32, 8, 2, 88, dtype="float64", seq_ends=PACKED_ENDS)
    feeds = llama_feeds(g, seed=5)
    packed = rt.reference(g, feeds)["y"]
    start = 0
    for end in PACKED_ENDS:
        alone = dict(feeds, x=feeds["x"][:, start:end])
        np.testing.assert_allclose(packed[:, start:end], numpy_block(alone, 8, 2), rtol=1e-10, atol=1e-10)
        start = end


def test_block_with_another_rope_base_and_two_layers() -> None:
    g = llama_block(1, 12, 16, 4, 2, 24, dtype="float64", layers=2, rope_base=10000.0, eps=1e-6)
    feeds = llama_feeds(g, seed=11)
    x = feeds["x"]
    for layer in ("l0.", "l1."):
        f = {k[len(layer):]: v for k, v in feeds.items() if k.startswith(layer)}
        x = numpy_block(dict(f, x=x), 4, 2, rope_base=10000.0, eps=1e-6)
    np.testing.assert_allclose(rt.reference(g, feeds)["y"], x, rtol=1e-10, atol=1e-10)


def test_float32_block_is_close_to_float64() -> None:
    g64 = llama_block(2, 17, 48, 6, 3, 72, dtype="float64")
    g32 = llama_block(2, 17, 48, 6, 3, 72, dtype="float32")
    feeds = llama_feeds(g64, seed=2)
    got = rt.reference(g32, {k: v.astype(np.float32) for k, v in feeds.items()})["y"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, numpy_block(feeds, 6, 3), rtol=1e-4, atol=1e-4)


# --- every operator under every interval request ------------------------------------------------

SPEC_BLOCKS = {
    # a small block: seq 40, d_model 32, 8 heads, 2 kv heads, d_ff 88
    "plain": dict(batch=1, seq=40, d_model=32, n_heads=8, n_kv_heads=2, d_ff=88, seq_ends=None),
    "packed": dict(batch=1, seq=40, d_model=32, n_heads=8, n_kv_heads=2, d_ff=88, seq_ends=(5, 9, 20, 22, 31, 37, 40)),
    "batch_3": dict(batch=3, seq=40, d_model=32, n_heads=8, n_kv_heads=2, d_ff=88, seq_ends=None),
}
MAX_REQUESTS = 25


def node_values(g: rt.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference value of every node of ``g``."""
    for n in g.nodes:
        if n.name not in g.outputs:
            g.save(rt.Tensor(g, n.id), name=n.name)
    return rt.reference(g, feeds)


@pytest.mark.parametrize("block", sorted(SPEC_BLOCKS))
def test_every_operator_under_every_request(block: str) -> None:
    g = llama_block(dtype="float64", **SPEC_BLOCKS[block])
    values = node_values(g, llama_feeds(g, seed=1))
    rng = np.random.default_rng(0)
    kinds_checked = set()
    for node in g.operators:
        op = node.op
        inputs = [values[g.nodes[i].name] for i in node.inputs]
        for p in range(1, 9):
            requests = list(interval_requests(op, p))
            assert requests, f"{node.name} offers no request for p={p}"
            if len(requests) > MAX_REQUESTS:
                requests = [requests[i] for i in sorted(rng.choice(len(requests), MAX_REQUESTS, replace=False))]
            for request in requests:
                spec = op.spec(request)
                assert spec.p == p
                got = rt.execute_spec(op, spec, inputs)
                np.testing.assert_allclose(got, values[node.name], rtol=1e-10, atol=1e-10,
                                           err_msg=f"{node.name} p={p} {spec.split_text}")
        kinds_checked.add(node.kind)
    assert kinds_checked == {"rmsnorm", "matmul", "reshape", "rope", "attention", "binary", "swiglu"}


def test_standard_normal_depends_on_the_seed_and_chunk_only(monkeypatch) -> None:
    from relational_tensors.graph import models

    seed = np.random.SeedSequence(7)
    threaded = models.standard_normal(seed, (301, 17), chunk=1000)
    assert np.array_equal(threaded, models.standard_normal(seed, (301, 17), chunk=1000))  # seed not consumed
    monkeypatch.setattr(models.os, "cpu_count", lambda: 1)
    one_thread = models.standard_normal(np.random.SeedSequence(7), (301, 17), chunk=1000)
    assert threaded.dtype == np.float32 and threaded.shape == (301, 17)
    assert np.array_equal(threaded, one_thread)
    assert not np.array_equal(threaded, models.standard_normal(np.random.SeedSequence(8), (301, 17), chunk=1000))
    # chunks are independent draws, not copies of one another
    flat = threaded.ravel()
    assert not np.array_equal(flat[:1000], flat[1000:2000])
    assert abs(float(flat.mean())) < 0.05 and abs(float(flat.std()) - 1) < 0.05

"""Whole programs on random shapes: LLaMA-style blocks (GQA, packed sequences, one or two layers)
and matrix chains of random dimensions and order, compiled for a random number of virtual devices
with a random selector, cost model and exchange schedule, run, and compared with the single-device
NumPy reference.  Sizes are drawn freely, so most of them do not divide the device count.

RT_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz_end_to_end.py fuzzes longer (30 examples each
by default)."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.catalog import Catalog
from relational_tensors.models import chain_feeds, llama_block, llama_feeds

TOL = dict(rtol=2e-4, atol=2e-5)
CATALOG = Catalog()
FUZZ = settings(max_examples=int(os.environ.get("RT_FUZZ_EXAMPLES", "30")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

options = st.fixed_dictionaries({
    "selector": st.sampled_from(["dp", "dp", "greedy", "random"]),
    "seed": st.integers(0, 3),
    "cost_model": st.sampled_from(["paper", "calibrated"]),
    "schedule_mode": st.sampled_from(["search", "naive"]),
})


def _run_and_compare(g: rt.Graph, feeds: dict, p: int, opts: dict) -> None:
    try:
        cg = rt.compileGraph(g, device=f"cpu:{p}", catalog=CATALOG, **opts)
    except rt.PlanError as e:
        # a tensor smaller than the device count has no decomposition into exactly p pieces: the
        # compiler says so (tests/test_optimizer.py checks the message); draw another example
        assume("no decomposition into exactly" not in str(e))
        raise
    got = cg.run(feeds)
    want = rt.reference(g, feeds)
    for name in g.outputs:
        np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=f"p={p} {opts} output {name}")
    assert cg._exec().peak == [cg.memory()[d] for d in range(p)]


@st.composite
def blocks(draw: st.DrawFn) -> dict:
    """llama_block arguments: GQA heads, an even head size (RoPE rotates pairs), packed sequences or
    not, one or two layers."""
    seq = draw(st.integers(1, 40))
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    ends = None
    if seq > 1 and draw(st.booleans()):
        ends = sorted(draw(st.lists(st.integers(1, seq - 1), max_size=4, unique=True))) + [seq]
    return dict(batch=draw(st.integers(1, 3)), seq=seq, d_model=heads * draw(st.sampled_from([2, 4, 6])),
                n_heads=heads, n_kv_heads=kv, d_ff=draw(st.integers(1, 40)), seq_ends=ends,
                layers=draw(st.integers(1, 2)))


@FUZZ
@given(blocks(), st.integers(1, 9), options, st.integers(0, 2**16))
def test_random_llama_blocks_equal_the_reference(block: dict, p: int, opts: dict, seed: int) -> None:
    g = llama_block(**block, dtype="float32")
    _run_and_compare(g, llama_feeds(g, seed=seed), p, opts)


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Matrix dimensions, and the order of products: each step multiplies neighbours i and i + 1."""
    dims = draw(st.lists(st.integers(1, 48), min_size=3, max_size=7))
    return dims, [draw(st.integers(0, len(dims) - 3 - k)) for k in range(len(dims) - 2)]


def chain_graph(dims: list[int], order: list[int]) -> rt.Graph:
    g = rt.Graph()
    mats = [g.input(f"M{i}", [dims[i], dims[i + 1]], "float32") for i in range(len(dims) - 1)]
    for i in order:
        mats[i:i + 2] = [g.matmul(mats[i], mats[i + 1])]
    g.save(mats[0], name="y")
    return g


@FUZZ
@given(chains(), st.integers(1, 9), options, st.integers(0, 2**16))
def test_random_matrix_chains_equal_the_reference(chain: tuple, p: int, opts: dict, seed: int) -> None:
    g = chain_graph(*chain)
    _run_and_compare(g, chain_feeds(g, seed=seed), p, opts)

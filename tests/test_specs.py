"""Every operator, every device count, every legal interval request: executing the
join-agg spec (join -> aggregate -> recompose) equals the single-device reference."""

from __future__ import annotations

import numpy as np
import pytest
from cases import CASES, feeds_for, operand_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.dp_optimizer import interval_requests
from relational_tensors.graph.reference import execute_spec

P_VALUES = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=1e-4, atol=1e-5)}
MAX_REQUESTS = 40  # above this many requests for one p, a seeded sample is checked


def _setup(case: str, dtype: str):
    g, name = CASES[case](dtype)
    feeds = feeds_for(g)
    return g.node(name).op, operand_values(g, name, feeds), rt.reference(g, feeds)["out"]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_request_matches_reference(case: str, dtype: str) -> None:
    op, inputs, expected = _setup(case, dtype)
    rng = np.random.default_rng(0)
    checked = 0
    for p in P_VALUES:
        requests = list(interval_requests(op, p))
        if len(requests) > MAX_REQUESTS:
            requests = [requests[i] for i in rng.choice(len(requests), MAX_REQUESTS, replace=False)]
        for request in requests:
            spec = op.spec(request)
            assert spec.p == p, (request, spec.p)
            got = execute_spec(op, spec, inputs)
            np.testing.assert_allclose(got, expected, **TOL[dtype], err_msg=f"{case} p={p} {spec.split_text}")
            checked += 1
    assert checked > len(P_VALUES) // 2


@st.composite
def arbitrary_request(draw, op):
    """Any intervals (not only near-equal) at legal positions, for a random subset of indices."""
    request = {}
    for index in op.requestable():
        cuts = list(index.legal_cuts())
        if not cuts or not draw(st.booleans()):
            continue
        chosen = sorted(draw(st.sets(st.sampled_from(cuts), min_size=1, max_size=min(4, len(cuts)))))
        bounds = [0, *chosen, index.extent]
        request[index.name] = tuple(rt.Interval(a, b) for a, b in zip(bounds, bounds[1:]))
    return request


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=st.sampled_from(sorted(CASES)))
def test_arbitrary_intervals_match_reference(data, case: str) -> None:
    op, inputs, expected = _setup(case, "float64")
    request = data.draw(arbitrary_request(op))
    spec = op.spec(request)
    expected_p = 1
    for ivs in request.values():
        expected_p *= len(ivs)
    assert spec.p == expected_p
    np.testing.assert_allclose(execute_spec(op, spec, inputs), expected, **TOL["float64"])


def test_uneven_sizes_are_offered() -> None:
    """The sizes of the brief that do not divide still decompose near-equally."""
    g, name = CASES["matmul_1000_tokens"]("float32")
    i = next(s for s in g.node(name).op.requestable() if s.name == "i")
    assert [iv.size for iv in i.near_equal(8)] == [125] * 8
    g, name = CASES["attention_causal_gqa_8kv"]("float32")
    heads = next(s for s in g.node(name).op.requestable() if s.name == "heads_kv")
    assert [iv.size for iv in heads.near_equal(3)] == [3, 3, 2]
    g, name = CASES["matmul_dff_11008"]("float32")
    k = next(s for s in g.node(name).op.requestable() if s.name == "k")
    assert sum(iv.size for iv in k.near_equal(6)) == 11008 and {iv.size for iv in k.near_equal(6)} <= {1834, 1835}

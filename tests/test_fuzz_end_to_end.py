"""Whole programs on random shapes: LLaMA-style blocks (GQA, packed sequences, one or two layers),
matrix chains of random dimensions and order, and random sequences of operators, compiled for a random
number of virtual devices with a random selector, cost model and exchange schedule, run, and compared
with the single-device NumPy reference.  Sizes are drawn freely, so most of them do not divide the
device count.

RT_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz_end_to_end.py fuzzes longer (30 examples each
by default)."""

from __future__ import annotations

import os

import numpy as np
from cases import check_plan, feeds_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.graph.models import chain_feeds, llama_block, llama_feeds

FUZZ = settings(max_examples=int(os.environ.get("RT_FUZZ_EXAMPLES", "30")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

options = st.fixed_dictionaries({
    "selector": st.sampled_from(["dp", "dp", "greedy", "random"]),
    "seed": st.integers(0, 3),
    "cost_model": st.sampled_from(["paper", "calibrated"]),
    "schedule_mode": st.sampled_from(["search", "naive"]),
})


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


DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])


@FUZZ
@given(blocks(), st.integers(1, 9), options, st.integers(0, 2**16), DTYPES)
def test_random_llama_blocks_equal_the_reference(block: dict, p: int, opts: dict, seed: int, dtype: str) -> None:
    g = llama_block(**block, dtype=dtype)
    check_plan(g, llama_feeds(g, seed=seed), p, reruns=(llama_feeds(g, seed=seed + 1),), **opts)


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Matrix dimensions, and the order of products: each step multiplies neighbours i and i + 1."""
    dims = draw(st.lists(st.integers(1, 48), min_size=3, max_size=7))
    return dims, [draw(st.integers(0, len(dims) - 3 - k)) for k in range(len(dims) - 2)]


def chain_graph(dims: list[int], order: list[int], dtype: str = "float32") -> rt.Graph:
    g = rt.Graph()
    mats = [g.input(f"M{i}", [dims[i], dims[i + 1]], dtype) for i in range(len(dims) - 1)]
    for i in order:
        mats[i:i + 2] = [g.matmul(mats[i], mats[i + 1])]
    g.save(mats[0], name="y")
    return g


@FUZZ
@given(chains(), st.integers(1, 9), options, st.integers(0, 2**16), DTYPES)
def test_random_matrix_chains_equal_the_reference(chain: tuple, p: int, opts: dict, seed: int, dtype: str) -> None:
    g = chain_graph(*chain, dtype=dtype)
    check_plan(g, chain_feeds(g, seed=seed), p, reruns=(chain_feeds(g, seed=seed + 1),), **opts)


@st.composite
def op_soups(draw: st.DrawFn) -> list[tuple]:
    """A 3-D input of random shape and 2-6 random operators applied in turn, as a recipe that
    :func:`soup_graph` builds: elementwise, broadcast binaries, matmuls, softmax, reductions, norms,
    permutes, reshapes, slices and concatenations, each on a random axis where it takes one."""
    shape = [draw(st.integers(1, 9)) for _ in range(3)]
    steps: list[tuple] = [("input", tuple(shape))]
    for _ in range(draw(st.integers(2, 6))):
        r = len(shape)
        kind = draw(st.sampled_from(["unary", "bias", "matmul", "softmax", "reduce", "rmsnorm", "layernorm",
                                     "permute", "reshape", "slice", "concat"]))
        axis = draw(st.integers(0, r - 1))
        if kind == "unary":
            steps.append((kind, draw(st.sampled_from(["relu", "gelu", "silu", "tanh", "neg", "sigmoid"]))))
        elif kind == "bias":  # x op b with b broadcast over all but the axes it keeps
            keep = draw(st.lists(st.booleans(), min_size=r, max_size=r))
            steps.append((kind, draw(st.sampled_from(["add", "mul", "sub"])),
                          tuple(n if k else 1 for n, k in zip(shape, keep))))
        elif kind == "matmul" and r >= 2:  # matmul takes matrices (or batches of them)
            n = draw(st.integers(1, 12))
            steps.append((kind, shape[-1], n))
            shape[-1] = n
        elif kind in ("softmax", "matmul"):
            steps.append(("softmax", axis))
        elif kind == "reduce":
            keepdims = r == 1 or draw(st.booleans())
            steps.append((kind, draw(st.sampled_from(["sum", "max", "mean"])), axis, keepdims))
            if keepdims:
                shape[axis] = 1
            else:
                del shape[axis]
        elif kind in ("rmsnorm", "layernorm"):
            steps.append((kind, shape[-1]))
        elif kind == "permute":
            perm = draw(st.permutations(range(r)))
            steps.append((kind, tuple(perm)))
            shape = [shape[p] for p in perm]
        elif kind == "reshape":
            if r >= 2 and draw(st.booleans()):  # merge two neighbours
                i = draw(st.integers(0, r - 2))
                shape[i:i + 2] = [shape[i] * shape[i + 1]]
            else:  # split a dimension by one of its factors
                n = shape[axis]
                f = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
                shape[axis:axis + 1] = [f, n // f]
            steps.append((kind, tuple(shape)))
        elif kind == "slice":
            n = shape[axis]
            start = draw(st.integers(0, n - 1))
            stop = draw(st.integers(start + 1, n))
            steps.append((kind, axis, start, stop))
            shape[axis] = stop - start
        else:  # concat with a transformed copy of itself
            steps.append((kind, axis))
            shape[axis] *= 2
    return steps


def soup_graph(steps: list[tuple]) -> rt.Graph:
    g = rt.Graph()
    x = g.input("x", list(steps[0][1]), "float32")
    for k, step in enumerate(steps[1:]):
        kind = step[0]
        if kind == "unary":
            x = g.unary(x, step[1])
        elif kind == "bias":
            x = g.binary(x, g.input(f"b{k}", list(step[2]), "float32"), step[1])
        elif kind == "matmul":
            x = g.matmul(x, g.input(f"w{k}", [step[1], step[2]], "float32"))
        elif kind == "softmax":
            x = g.softmax(x, step[1])
        elif kind == "reduce":
            x = {"sum": g.sum, "max": g.max, "mean": g.mean}[step[1]](x, step[2], keepdims=step[3])
        elif kind == "rmsnorm":
            x = g.rmsnorm(x, g.input(f"g{k}", [step[1]], "float32"))
        elif kind == "layernorm":
            x = g.layernorm(x, g.input(f"g{k}", [step[1]], "float32"), g.input(f"c{k}", [step[1]], "float32"))
        elif kind == "permute":
            x = g.permute(x, step[1])
        elif kind == "reshape":
            x = g.reshape(x, step[1])
        elif kind == "slice":
            x = g.slice(x, *step[1:])
        else:
            x = g.concat([x, g.unary(x, "tanh")], step[1])
    g.save(x, name="y")
    return g


@FUZZ
@given(op_soups(), st.integers(1, 9), options, st.integers(0, 2**16))
def test_random_operator_sequences_equal_the_reference(steps: list, p: int, opts: dict, seed: int) -> None:
    g = soup_graph(steps)
    check_plan(g, feeds_for(g, seed), p, reruns=(feeds_for(g, seed + 1),), **opts)


@st.composite
def adversarial(draw: st.DrawFn) -> tuple[rt.Graph, dict]:
    """Softmax and attention over scores near 1e4, and sums whose terms cancel, in 32 and 16 bits."""
    dtype = draw(DTYPES)
    rows, cols = draw(st.integers(1, 9)), draw(st.integers(2, 24))
    big = 1e4
    g = rt.Graph()
    x = g.input("x", [rows, cols], dtype)
    g.save(g.softmax(x), name="soft")
    g.save(g.sum(g.concat([x, g.unary(x, "scale", -1.0)], 1), 1), name="cancel")
    q = g.input("q", [1, cols, 2, 4], dtype)
    g.save(g.attention(q, q, q, causal=draw(st.booleans())), name="attn")
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    feeds = {"x": (rng.standard_normal((rows, cols)) * big).astype(numpy_dtype(dtype)),
             "q": (rng.standard_normal((1, cols, 2, 4)) * 30).astype(numpy_dtype(dtype))}
    return g, feeds


@FUZZ
@given(adversarial(), st.integers(1, 9), options)
def test_adversarial_magnitudes_equal_the_reference(case: tuple, p: int, opts: dict) -> None:
    g, feeds = case
    terms = float(np.max(np.sum(np.abs(np.asarray(feeds["x"], np.float64)), axis=1))) * 2
    check_plan(g, feeds, p, magnitudes={"cancel": terms}, **opts)

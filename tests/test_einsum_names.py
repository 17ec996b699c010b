"""Einsums written with index names (``"experts tokens hidden, experts hidden ff -> experts tokens ff"``):
parsed as names, computed as the same einsum in letters (values and gradients, on every device count), and
named so in plans: a mixture-of-experts layer's plan reads ``experts=8``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.sql_specs.einsum import einsum_letters, parse_einsum


def test_names_and_letters_parse() -> None:
    assert parse_einsum("experts t h, experts h f -> experts t f", [3, 3]) == \
        ((("experts", "t", "h"), ("experts", "h", "f")), ("experts", "t", "f"))
    assert parse_einsum("ij, jk -> ik", [2, 2]) == ((("i", "j"), ("j", "k")), ("i", "k"))  # letters, spaced
    assert parse_einsum("tokens, tokens -> ", [1, 1]) == ((("tokens",), ("tokens",)), ())  # one name per operand
    assert parse_einsum("ab, b", [2, 1]) == ((("a", "b"), ("b",)), ("a",))  # no arrow: the indices used once
    assert parse_einsum("ij, j k -> ik", [2, 2]) == parse_einsum("ij,jk->ik", [2, 2])  # torch ignores spaces
    assert parse_einsum("bij,bjk->b ik", [3, 3]) == parse_einsum("bij,bjk->bik", [3, 3])
    assert einsum_letters((("experts", "t"), ("t",)), ("experts",)) == "ab,b->a"
    assert einsum_letters((("i", "j"), ("j", "k")), ("i", "k")) == "ij,jk->ik"


@pytest.mark.parametrize("spec, ranks, message", [
    ("experts t, t-x -> experts", [2, 1], "einsum index names are identifiers; got ['t-x']"),
    ("rows cols -> rows rows", [2], "einsum output indices must be distinct; got 'rows rows'"),
    ("rows cols -> depth", [2], "einsum output index ['depth'] appears in no input"),
    ("rows cols, cols -> rows", [2, 2], "operand 1 has 1 indices but rank 2"),
    ("rows cols -> rows -> cols", [2], "an einsum spec has one '->'"),
    ("ij,ij->ij", [1, 1], "einsum 'ij,ij->ij': operand 0 has 2 indices but rank 1"),  # letters, not names
    ("ijk, jk -> ik", [2, 2], "operand 0 has 3 indices but rank 2"),
    ("ij, jk -> iz", [2, 2], "einsum output index ['z'] appears in no input"),
])
def test_bad_named_specs_are_refused(spec: str, ranks: list[int], message: str) -> None:
    with pytest.raises(rt.GraphError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_einsum(spec, ranks)


@settings(max_examples=12, deadline=None)
@given(e=st.integers(1, 5), t=st.integers(1, 9), h=st.integers(1, 7), f=st.integers(1, 6), p=st.integers(1, 4))
def test_a_named_einsum_and_its_gradients_equal_the_lettered_one(e: int, t: int, h: int, f: int, p: int) -> None:
    rng = np.random.default_rng(e * 100 + t)
    feeds = {"x": rng.standard_normal((e, t, h)).astype(np.float32),
             "w": rng.standard_normal((e, h, f)).astype(np.float32)}
    out = {}
    for spec in ("experts tokens hidden, experts hidden ff -> experts tokens ff", "eth,ehf->etf"):
        g = rt.Graph()
        x, w = g.input("x", [e, t, h]), g.input("w", [e, h, f])
        y = g.einsum(spec, x, w, name="y")
        loss = g.sum(g.mul(y, y), [0, 1, 2])
        dx, dw = g.grad(g.reshape(loss, []), [x, w])
        g.save(y, name="y")
        g.save(dx, name="dx")
        g.save(dw, name="dw")
        out[spec] = rt.compileGraph(g, device=f"cpu:{p}").run(feeds)
    named, lettered = out.values()
    for k in ("y", "dx", "dw"):
        np.testing.assert_allclose(named[k], lettered[k], rtol=1e-5, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(lettered["dx"], 2 * np.einsum("etf,ehf->eth", lettered["y"], feeds["w"]),
                               rtol=1e-4, atol=1e-4)


def test_a_moe_plan_reads_experts() -> None:
    """The experts' products of the dense and the capacity forms (and their gradients) name the expert
    index ``experts``, so the plan's splits read ``experts=8``."""
    from relational_tensors.graph.moe import moe_layer_graph

    for kwargs in (dict(), dict(experts_compute="grouped", capacity_factor=1.25)):
        g = moe_layer_graph(64, 32, 8, 2, 48, dtype="float32", training=True, master_dtype=None,
                            **kwargs)  # type: ignore[arg-type]
        cg = rt.compileGraph(g, device="cpu:8", constraints=rt.plans.expert_parallel(g, 8))
        assert dict(cg.plan.spec("expert_gate").split)["experts"] == 8
        assert "experts=8" in cg.explain()
        lettered = [n.name for n in g.operators if n.op is not None and n.op.kind == "einsum"
                    and "e" in n.op.dims_out()]
        assert not lettered, lettered


def test_matmul_gradients_keep_letters() -> None:
    """A matrix product's indices are named ``b0 i j k``; its gradients stay lettered einsums."""
    g = rt.Graph()
    x, w = g.input("x", [2, 3, 4]), g.input("w", [4, 5])
    loss = g.sum(g.matmul(x, w), [0, 1, 2])
    g.grad(g.reshape(loss, []), [x, w])
    specs = [n.op.params()["subscripts"] for n in g.operators if n.op is not None and n.op.kind == "einsum"]
    assert specs and all(" " not in s for s in specs), specs


def test_a_torch_einsum_spaced_as_torch_allows_traces() -> None:
    torch = pytest.importorskip("torch")

    class Spaced(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.einsum("ij, j k -> ik", a, b)

    a, b = torch.randn(5, 4), torch.randn(4, 3)
    got = rt.parallelize(Spaced(), (a, b), device="cpu:2")(a, b)
    torch.testing.assert_close(got, a @ b)

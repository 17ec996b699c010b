"""Attention with masks, biases, windows, key padding and cross-attention: the operator's semantics
against PyTorch (SDPA where it has the form, an independent masked softmax otherwise), and its join-agg
specs against the reference over random shapes, options, device counts and interval requests."""

from __future__ import annotations

import numpy as np
import pytest
from cases import CASES, feeds_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relational_tensors as rt
from relational_tensors.dp_optimizer import interval_requests
from relational_tensors.graph.reference import execute_spec

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch_reference import attention_mask, torch_gradients  # noqa: E402 - needs torch

ATTENTION_CASES = sorted(c for c in CASES if c.startswith("attention_"))


def _torch_inputs(g: rt.Graph, name: str, feeds: dict) -> tuple:
    node = g.node(name)
    return node.op, [torch.tensor(np.asarray(feeds[g.nodes[i].name])) for i in node.inputs]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_semantics_match_torch(case: str) -> None:
    g, name = CASES[case]("float64")
    feeds = feeds_for(g)
    got = rt.reference(g, feeds)["out"]
    op, xs = _torch_inputs(g, name, feeds)
    q, k, v = xs[:3]
    extra = dict(zip(op.extras, xs[3:]))
    allowed = attention_mask(op, extra)
    if op.softcap is not None:  # SDPA has no softcap: the masked softmax written out
        from torch_reference import _attention
        np.testing.assert_allclose(got, _attention(*xs, op=op).numpy(), rtol=1e-9, atol=1e-12)
        return
    bias = extra.get("bias")
    # SDPA takes one float mask: the bias with -inf where not allowed (rows that see nothing are left out:
    # SDPA's math kernel gives NaN there, its fused kernels 0, which is what the operator gives)
    float_mask = torch.where(allowed, bias if bias is not None else torch.zeros((), dtype=q.dtype),
                             float("-inf")).to(q.dtype)  # SDPA misreads a mask of another dtype
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    want = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=float_mask, scale=op.softmax_scale,
                                          enable_gqa=True).transpose(1, 2).numpy()
    seen = np.broadcast_to(allowed.any(-1).numpy(), (q.shape[0], q.shape[2], q.shape[1])).transpose(0, 2, 1)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-9, atol=1e-12)
    assert np.all(got[~seen] == 0.0), "a query that sees no key gives 0"


def test_causal_alignments_are_sdpas() -> None:
    """top_left is SDPA's is_causal for seq_q != seq_kv; bottom_right is torch's causal_lower_right."""
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(3)
    for sq, skv in ((5, 11), (11, 5), (7, 7)):
        q, k, v = (torch.tensor(rng.standard_normal(s)) for s in ((2, 3, sq, 8), (2, 3, skv, 8), (2, 3, skv, 8)))
        for mode in ("top_left", "bottom_right"):
            g = rt.Graph()
            x = [g.input(n, [2, s, 3, 8], "float64") for n, s in (("q", sq), ("k", skv), ("v", skv))]
            g.save(g.attention(*x, causal=mode), name="out")
            got = rt.reference(g, {n: t.transpose(1, 2).numpy() for n, t in zip("qkv", (q, k, v))})["out"]
            if mode == "top_left":
                want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, skv))
            want = torch.nan_to_num(want, nan=0.0).transpose(1, 2).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=f"{mode} {sq}x{skv}")


def test_causal_true_needs_equal_lengths() -> None:
    g = rt.Graph()
    q, k = g.input("q", [1, 4, 2, 8]), g.input("k", [1, 6, 2, 8])
    with pytest.raises(rt.GraphError, match="causal='top_left'.*causal='bottom_right'"):
        g.attention(q, k, k, causal=True)


@pytest.mark.parametrize("bad, rule", [
    (dict(window=0), "window must be a positive integer"),
    (dict(causal="upper"), "causal must be one of"),
    (dict(key_padding=[4, 9]), r"key_lengths must give one length in \[0, 6\]"),
    (dict(key_padding="pad_f"), "key_padding must be a boolean"),
    (dict(mask="m_f"), "mask must be a boolean tensor"),
    (dict(mask="m_wrong"), r"shape \[batch or 1, heads_q or 1, seq_q, seq_kv\]"),
    (dict(bias="m_b"), "bias must be a floating tensor"),
    (dict(softcap=0.0), r"softcap .* must be a finite number > 0"),
    (dict(softcap=float("inf")), r"softcap .* must be a finite number > 0"),
])
def test_malformed_options_are_refused_with_the_rule(bad: dict, rule: str) -> None:
    g = rt.Graph()
    q, k = g.input("q", [2, 4, 2, 8]), g.input("k", [2, 6, 2, 8])
    named = {"pad_f": g.input("pad_f", [2, 6]), "m_f": g.input("m_f", [2, 2, 4, 6]),
             "m_wrong": g.input("m_wrong", [2, 3, 4, 6], "bool"), "m_b": g.input("m_b", [1, 1, 4, 6], "bool")}
    kwargs = {key: named.get(val, val) if isinstance(val, str) and key != "causal" else val
              for key, val in bad.items()}
    with pytest.raises(rt.GraphError, match=rule):
        g.attention(q, k, k, **kwargs)


# --- random forms: specs and plans against the reference -------------------------------------------------

@st.composite
def attention_form(draw):
    batch = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    sq = draw(st.integers(1, 19))
    cross = draw(st.booleans())
    skv = draw(st.integers(1, 19)) if cross else sq
    causal = draw(st.sampled_from([False, "top_left", "bottom_right"] + ([True] if sq == skv else [])))
    window = draw(st.one_of(st.none(), st.integers(1, 8)))
    padding = draw(st.sampled_from([None, "tensor", "lengths"]))
    lengths = draw(st.lists(st.integers(0, skv), min_size=batch, max_size=batch)) if padding == "lengths" else None
    mask = draw(st.one_of(st.none(), st.tuples(st.sampled_from([1, batch]), st.sampled_from([1, hq]))))
    bias = draw(st.one_of(st.none(), st.tuples(st.sampled_from([1, batch]), st.sampled_from([1, hq]))))
    return dict(batch=batch, hkv=hkv, hq=hq, sq=sq, skv=skv, causal=causal, window=window, padding=padding,
                lengths=lengths, mask=mask, bias=bias, d=draw(st.sampled_from([2, 4])),
                softcap=draw(st.sampled_from([None, None, 0.5, 4.0])))


def _form_graph(form: dict, dtype: str = "float64") -> tuple[rt.Graph, str]:
    g = rt.Graph()
    b, sq, skv, d = form["batch"], form["sq"], form["skv"], form["d"]
    q = g.input("q", [b, sq, form["hq"], d], dtype)
    k, v = (g.input(n, [b, skv, form["hkv"], d], dtype) for n in "kv")
    kw: dict = dict(causal=form["causal"], window=form["window"], softcap=form["softcap"])
    if form["padding"] == "tensor":
        kw["key_padding"] = g.input("pad", [b, skv], "bool")
    elif form["padding"] == "lengths":
        kw["key_padding"] = form["lengths"]
    if form["mask"] is not None:
        kw["mask"] = g.input("m", [*form["mask"], sq, skv], "bool")
    if form["bias"] is not None:
        kw["bias"] = g.input("bias", [*form["bias"], sq, skv], dtype)
    out = g.attention(q, k, v, **kw)
    g.save(out, name="out")
    return g, out.name


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(form=attention_form(), p=st.integers(1, 8), data=st.data())
def test_random_forms_decompose_exactly(form: dict, p: int, data) -> None:
    g, name = _form_graph(form)
    feeds = feeds_for(g, seed=p)
    op = g.node(name).op
    want = rt.reference(g, feeds)["out"]
    inputs = [feeds[g.nodes[i].name] for i in g.node(name).inputs]
    requests = list(interval_requests(op, p))
    if not requests:
        return
    request = requests[data.draw(st.integers(0, len(requests) - 1))]
    np.testing.assert_allclose(execute_spec(op, op.spec(request), inputs), want, rtol=1e-10, atol=1e-12,
                               err_msg=f"{form} p={p} {request}")
    # against torch, independently of the operator's own key ranges
    _, xs = _torch_inputs(g, name, feeds)
    from torch_reference import _attention
    np.testing.assert_allclose(want, _attention(*xs, op=op).numpy(), rtol=1e-9, atol=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(form=attention_form(), p=st.integers(2, 8))
def test_random_forms_plan_and_differentiate(form: dict, p: int) -> None:
    """Planned over p devices with its gradient (bias included), against the reference and torch autograd."""
    g, name = _form_graph(form, "float32")
    out = g.tensor(g.outputs["out"])
    wrt = [g.tensor(n.id) for n in g.inputs if n.type.dtype == "float32"]
    cot = g.input("cot", out.shape)
    for t, dt in zip(wrt, g.vjp(out, cot, wrt)):
        g.save(dt, name=f"d_{t.name}")
    feeds = feeds_for(g, seed=p)
    want = rt.reference(g, feeds)
    got = rt.compileGraph(g, device=f"cpu:{p}").run(feeds)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=2e-5, err_msg=f"{key} {form} p={p}")
    autograd = torch_gradients(g, "out", feeds["cot"], feeds, [t.name for t in wrt])
    for t in wrt:
        np.testing.assert_allclose(want[f"d_{t.name}"], autograd[t.name], rtol=2e-3, atol=2e-4,
                                   err_msg=f"d_{t.name} {form}")

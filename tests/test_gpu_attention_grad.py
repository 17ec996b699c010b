"""Attention's backward through the CuPy executor on a GPU: the log-sum-exp, Δ, dq and dk|dv operators on
their Triton kernels, split over query blocks, key blocks and kv heads across logical devices of one GPU,
against the NumPy reference at 16-bit tolerance; then a training step's gradients.  Marked ``gpu``;
skipped where no GPU is visible."""

from __future__ import annotations

import numpy as np
import pytest

import relational_tensors as rt
from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.graph.models import llama_training_feeds, llama_training_graph
from relational_tensors.kernels import launchers
from relational_tensors.machine.devices import visible_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(visible_gpus() == 0, reason="no CUDA GPU visible (or CuPy not installed)")]

# 16-bit inputs: P and dS rounded to the input type before their products, float32 accumulation, and every
# operator's output rounded to 16 bits on both sides (the reference rounds at the same boundaries)
TOL = {"bfloat16": 3e-2, "float16": 6e-3}
GRAD_KINDS = ("attention_lse", "attention_delta", "attention_grad")


def _relative(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= tol, f"{what}: error {err:.2e} of the largest magnitude"


def _attention_vjp(dtype: str, d: int, causal: bool | str, seq_ends: tuple[int, ...] | None,
                   sq: int = 300, skv: int = 300) -> rt.Graph:
    g = rt.Graph()
    q = g.input("q", [2, sq, 8, d], dtype)
    k = g.input("k", [2, skv, 2, d], dtype)
    v = g.input("v", [2, skv, 2, d], dtype)
    o = g.attention(q, k, v, causal=causal, seq_ends=seq_ends, name="attn")
    g.save(o, name="o")
    for name, t in zip(("dq", "dk", "dv"), g.vjp(o, g.input("do", [2, sq, 8, d], dtype), [q, k, v])):
        g.save(t, name=name)
    return g


def _feeds(g: rt.Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n.name: rng.standard_normal(n.type.shape).astype(numpy_dtype(n.type.dtype)) for n in g.inputs}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("device,split", [("cuda:0", None), ("cuda:0,0,0,0", None),
                                          ("cuda:0,0,0,0", "seq_q=2,seq_kv=2"),
                                          ("cuda:0,0,0,0", "heads_kv=2,seq_kv=2")])
@pytest.mark.parametrize("form", ["causal_packed_64", "causal_128", "cross_72"])
def test_attention_gradients_on_the_triton_kernels(form: str, device: str, split: str | None, dtype: str) -> None:
    d, causal, ends, skv = {"causal_packed_64": (64, True, (70, 190, 300), 300), "causal_128": (128, True, None, 300),
                            "cross_72": (72, "bottom_right", None, 333)}[form]
    g = _attention_vjp(dtype, d, causal, ends, skv=skv)
    grad_ops = [n for n in g.nodes if n.kind in ("attention_lse", "attention_grad")]
    constraints = {n.name: split for n in grad_ops} if split else None
    feeds = _feeds(g)
    want = rt.reference(g, feeds)
    cg = rt.compileGraph(g, device=device, constraints=constraints)
    assert all(launchers.launcher_for(kind).launch is not launchers.base._host for kind in GRAD_KINDS)
    assert cg.executor.capturable  # no operator of this program runs on host copies
    for run in range(3):  # eager (choosing the kernels' configurations), captured, then replayed
        got = cg.run(feeds)
        for name in ("dq", "dk", "dv"):
            _relative(got[name], want[name], TOL[dtype], f"{form} {device} {split} {dtype} {name} (run {run})")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_training_step_gradients_with_the_triton_attention_backward(dtype: str, device: str) -> None:
    g = llama_training_graph(1, 96, 64, 8, 2, 128, 97, dtype=dtype, seq_ends=(30, 71, 96))
    feeds = llama_training_feeds(g)
    want = rt.reference(g, feeds)
    got = rt.compileGraph(g, device=device).run(feeds)
    for name in g.outputs:
        _relative(got[name], want[name], 3e-2 if dtype == "bfloat16" else 1e-2, f"{dtype} {device} {name}")


@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0,0"])
def test_the_backward_reads_the_lse_the_forward_wrote(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward attention kernel writes the log-sum-exp rows the backward reads (the attention_lse
    tasks do nothing): the gradients equal the reference, and those of the same plan with the lse
    recomputed (RELATIONAL_TENSORS_SIBLINGS=0) within 16-bit rounding (the two kernels sum the row's
    exponentials in different orders)."""
    g = llama_training_graph(1, 96, 64, 8, 2, 128, 97, dtype="bfloat16", seq_ends=(30, 71, 96))
    feeds = llama_training_feeds(g)
    want = rt.reference(g, feeds)
    cg = rt.compileGraph(g, device=device)
    paired = cg.run(feeds)
    assert cg.executor.plan.done_by
    monkeypatch.setenv("RELATIONAL_TENSORS_SIBLINGS", "0")
    cg_plain = rt.compileGraph(g, device=device)
    plain = cg_plain.run(feeds)
    assert not cg_plain.executor.plan.done_by
    for name in g.outputs:
        _relative(paired[name], want[name], 3e-2, f"{device} {name}")
        _relative(paired[name], plain[name], 2e-2, f"{device} {name} against the recomputed lse")


@pytest.mark.parametrize("form", ["key lengths", "key padding", "mask", "bias", "mask, bias and padding",
                                  "bias and softcap"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0"])
def test_padded_masked_and_biased_forms_run_in_the_kernels(form: str, device: str) -> None:
    """Key lengths, key padding, a boolean mask, an additive bias (with its gradient) and a softcap run in the
    Triton kernels, forward and backward, captured in a CUDA graph: they agree with the reference on one and two
    logical devices."""
    g = rt.Graph()
    q = g.input("q", [2, 40, 4, 32], "float32")
    k = g.input("k", [2, 40, 2, 32], "float32")
    v = g.input("v", [2, 40, 2, 32], "float32")
    wrt = [q, k, v]
    extra: dict = {}
    if form == "key lengths":
        extra["key_padding"] = [33, 40]
    if "padding" in form:
        extra["key_padding"] = g.input("kp", [2, 40], "bool")
    if "mask" in form:
        extra["mask"] = g.input("m", [2, 1, 40, 40], "bool")
    if "bias" in form:
        extra["bias"] = g.input("bias", [1, 4, 40, 40], "float32")
        wrt.append(extra["bias"])
    if "softcap" in form:
        extra["softcap"] = 0.5
    o = g.attention(q, k, v, causal=True, **extra)
    names = ("dq", "dk", "dv", "dbias")
    for name, t in zip(names, g.vjp(o, g.input("do", [2, 40, 4, 32], "float32"), wrt)):
        g.save(t, name=name)
    g.save(o, name="o")
    assert not any(launchers.allocates(n.op) for n in g.nodes
                   if n.kind in ("attention", "attention_lse", "attention_grad"))
    feeds = _feeds(g, 1)
    if "padding" in form:
        kp = np.ones((2, 40), dtype=bool)
        kp[0, 31:] = False
        kp[1, :6] = False
        kp[1, 20:23] = False
        feeds["kp"] = kp
    if "mask" in form:
        feeds["m"] = np.random.default_rng(5).random((2, 1, 40, 40)) < 0.7
    want = rt.reference(g, feeds)
    cg = rt.compileGraph(g, device=device)
    for _ in range(3):  # eager, captured, replayed
        got = cg.run(feeds)
    for name in ("o", *names[:len(wrt)]):
        _relative(got[name], want[name], 1e-4, f"{form} {name}")

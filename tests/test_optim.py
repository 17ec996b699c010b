"""Training steps as graphs: states that persist across executions, and SGD and AdamW with torch's
exact update rules, run on cpu:p and compared step by step with torch's own optimizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import relational_tensors as rt
from relational_tensors.errors import GraphError


def _mlp_step(dtype: str, optimizer: str, clip: float | None = None, **hyper):
    """x -> rmsnorm -> matmul -> gelu -> matmul -> cross-entropy; parameters are states."""
    g = rt.Graph()
    x, t = g.input("x", [13, 6], dtype), g.input("t", [13], "int64")
    lr = g.input("lr", [1], dtype)
    w1, w2, nw = g.state("w1", [6, 9], dtype), g.state("w2", [9, 7], dtype), g.state("nw", [6], dtype)
    logits = g.matmul(g.unary(g.matmul(g.rmsnorm(x, nw, 1e-5), w1), "gelu"), w2)
    loss = g.save(g.cross_entropy(logits, t, ignore_index=3), name="loss")
    params = [w1, w2, nw]
    grads = g.grad(loss, params)
    if clip is not None:
        grads = rt.optim.clip_grad_norm(g, grads, clip)
    opt = (rt.optim.adamw if optimizer == "adamw" else rt.optim.sgd)(g, params, grads, lr, **hyper)
    return g, opt


def _torch_run(init: dict, batches: list, lrs: list, optimizer: str, clip: float | None, dtype=None, **hyper):
    def tensor(v):
        return torch.tensor(v) if dtype is None else torch.tensor(np.asarray(v, np.float32)).to(dtype)

    ps = {k: tensor(v).requires_grad_() for k, v in init.items()}
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = cls([ps["w1"], ps["w2"], ps["nw"]], lr=lrs[0], **hyper)
    losses = []
    for (x, t), lr in zip(batches, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        x = tensor(x)
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * ps["nw"]
        loss = F.cross_entropy(F.gelu(h @ ps["w1"]) @ ps["w2"], torch.tensor(t), ignore_index=3)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([ps["w1"], ps["w2"], ps["nw"]], clip)
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().double().numpy() for k, v in ps.items()}
    for name, p in (("w1", ps["w1"]), ("w2", ps["w2"]), ("nw", ps["nw"])):
        for key, value in opt.state[p].items():
            if key != "step":
                state[f"{name}.{key}"] = value.detach().double().numpy()
    return losses, state


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)


CONFIGS = {
    "adamw_decay_clip": ("adamw", 0.05, dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)),
    "adamw_default": ("adamw", None, dict()),
    "sgd_momentum_decay": ("sgd", None, dict(momentum=0.9, weight_decay=0.01)),
    "sgd_dampening_nesterov_off": ("sgd", 0.5, dict(momentum=0.8, dampening=0.3)),
    "sgd_nesterov": ("sgd", None, dict(momentum=0.9, nesterov=True)),
    "sgd_plain": ("sgd", None, dict()),
}


@pytest.mark.parametrize("p", [1, 3, 4])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_five_steps_equal_torch_in_float64(config: str, p: int) -> None:
    optimizer, clip, hyper = CONFIGS[config]
    g, opt = _mlp_step("float64", optimizer, clip, **hyper)
    rng = np.random.default_rng(0)
    init = {"w1": rng.standard_normal((6, 9)) / 3, "w2": rng.standard_normal((9, 7)) / 3,
            "nw": 1 + 0.1 * rng.standard_normal(6)}
    batches = [(rng.standard_normal((13, 6)), rng.integers(0, 7, 13)) for _ in range(5)]
    lrs = [0.05, 0.04, 0.03, 0.02, 0.01]  # a schedule: lr is an input, the plan stays
    cg = rt.compileGraph(g, device=f"cpu:{p}")
    losses = []
    for k, ((x, t), lr) in enumerate(zip(batches, lrs)):
        first = {**init, **opt.initial()} if k == 0 else {}  # states are loaded once
        cg.load({**first, "x": x, "t": t, "lr": np.array([lr])})
        cg.execute()
        losses.append(float(cg.offload("loss")[0]))
    want_losses, want = _torch_run(init, batches, lrs, optimizer, clip, **hyper)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-9)
    for name, value in want.items():
        assert _rel(cg.offload(name), value) <= 1e-9, name


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_sixteen_bit_parameters_without_master_weights_follow_torchs_adamw(dtype: str) -> None:
    """AdamW on bfloat16 parameters with no master copy, as torch.optim.AdamW on bfloat16 tensors does it:
    the step count and the bias corrections are float32 (in bfloat16 1 - 0.999 ** 1 rounds to 0, so every
    untouched entry became 0 / 0, and the count stops at 256), the moments and parameters bfloat16.  (float16
    without master weights is left out: eps = 1e-8 is 0 in float16, and torch's own update gives NaN there
    as ours does.)"""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    g, opt = _mlp_step(dtype, "adamw", None, weight_decay=0.01)
    assert {n.name: n.type.dtype for n in g.inputs}["adamw.step"] == "float32"
    rng = np.random.default_rng(2)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    init = {"w1": rng.standard_normal((6, 9)) / 3, "w2": rng.standard_normal((9, 7)) / 3,
            "nw": 1 + 0.1 * rng.standard_normal(6)}
    init = {k: v.astype(np_dtype) for k, v in init.items()}
    batches = [(rng.standard_normal((13, 6)).astype(np_dtype), rng.integers(0, 7, 13)) for _ in range(5)]
    cg = rt.compileGraph(g, device="cpu:3")
    losses = []
    for k, (x, t) in enumerate(batches):
        cg.load({**(({**init, **opt.initial()}) if k == 0 else {}), "x": x, "t": t, "lr": np.array([1e-2], np_dtype)})
        cg.execute()
        losses.append(float(cg.offload("loss")[0]))
    want_losses, want = _torch_run(init, batches, [1e-2] * 5, "adamw", None, dtype=getattr(torch, dtype),
                                   weight_decay=0.01)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-2)  # 16-bit activations, rounded differently
    for name in ("w1", "w2", "nw"):
        got = np.asarray(cg.offload(name), np.float64)
        assert np.isfinite(got).all(), name
        # torch's moves: lr 1e-2 a step; ours differ by roundings of the 16-bit updates, not by a step
        assert np.max(np.abs(got - want[name])) <= 2e-2, name
        assert np.max(np.abs(got - np.asarray(init[name], np.float64))) > 2e-2, name  # trained
    assert cg.offload("adamw.step")[0] == 5
    cg.load({"adamw.step": np.array([256.0], np.float32), "x": batches[0][0], "t": batches[0][1]})
    cg.execute()
    assert cg.offload("adamw.step")[0] == 257  # a 16-bit count stops at 256


def test_resuming_from_the_states_after_two_steps_gives_the_same_parameters_after_five() -> None:
    g, opt = _mlp_step("float64", "adamw", 1.0, weight_decay=0.05)
    rng = np.random.default_rng(1)
    init = {"w1": rng.standard_normal((6, 9)) / 3, "w2": rng.standard_normal((9, 7)) / 3,
            "nw": 1 + 0.1 * rng.standard_normal(6)}
    batches = [{"x": rng.standard_normal((13, 6)), "t": rng.integers(0, 7, 13), "lr": np.array([0.01])}
               for _ in range(5)]
    states = [n.name for n in g.inputs if n.role == "state"]
    straight = rt.compileGraph(g, device="cpu:3")
    straight.load({**init, **opt.initial(), **batches[0]})
    for b in batches:
        straight.load(b)
        straight.execute()
    first = rt.compileGraph(g, device="cpu:2")
    first.load({**init, **opt.initial(), **batches[0]})
    for b in batches[:2]:
        first.load(b)
        first.execute()
    saved = {s: first.offload(s) for s in states}
    resumed = rt.compileGraph(g, device="cpu:4")
    resumed.load({**saved, **batches[2]})
    for b in batches[2:]:
        resumed.load(b)
        resumed.execute()
    for s in states:
        assert _rel(resumed.offload(s), straight.offload(s)) <= 1e-12, s


def test_state_and_assign_refusals() -> None:
    g = rt.Graph()
    x, w = g.input("x", [4, 3]), g.state("w", [3, 2])
    p = g.parameter("p", [3, 2])
    y = g.matmul(x, w)
    with pytest.raises(GraphError, match="made by g.state"):
        g.assign(p, g.unary(p, "relu"))
    with pytest.raises(GraphError, match="computed tensor"):
        g.assign(w, w)
    with pytest.raises(GraphError, match="keeps its shape"):
        g.assign(w, y)
    g.assign(w, g.unary(w, "scale", 0.5))
    with pytest.raises(GraphError, match="assigned twice"):
        g.assign(w, g.unary(w, "scale", 0.5))
    with pytest.raises(GraphError, match="updates states"):
        rt.optim.sgd(g, [p], [p], 0.1)
    with pytest.raises(GraphError, match="one gradient per parameter"):
        rt.optim.adamw(g, [w], [], 0.1)
    with pytest.raises(GraphError, match="betas"):
        rt.optim.adamw(g, [w], [w], 0.1, betas=(0.9, 1.0))
    with pytest.raises(GraphError, match="lr"):
        rt.optim.sgd(g, [w], [w], -1.0)
    with pytest.raises(GraphError, match="Nesterov"):
        rt.optim.sgd(g, [w], [w], 0.1, nesterov=True)


def test_a_state_persists_and_reads_back_before_and_after_steps() -> None:
    g = rt.Graph()
    c = g.state("counter", [5])
    g.save(g.unary(c, "square"), name="sq")
    g.assign(c, g.unary(c, "add_scalar", 1.0))
    cg = rt.compileGraph(g, device="cpu:3")
    cg.load({"counter": np.arange(5, dtype=np.float32)})
    assert cg.offload("counter").tolist() == [0, 1, 2, 3, 4]
    for step in range(3):
        cg.execute()
        assert cg.offload("sq").tolist() == [(k + step) ** 2 for k in range(5)]
    assert cg.offload("counter").tolist() == [3, 4, 5, 6, 7]


def test_sgd_momentum_with_gradient_accumulation_over_three_micro_batches_equals_torch() -> None:
    """One step reads three micro-batches: the loss is the mean of theirs, so the gradients of the shared
    parameters are the sums autodiff makes of each micro-batch's (torch: loss / 3, backward each)."""
    g = rt.Graph()
    w1, w2 = g.state("w1", [6, 9], "float64"), g.state("w2", [9, 7], "float64")
    losses = []
    for k in range(3):
        x, t = g.input(f"x{k}", [5, 6], "float64"), g.input(f"t{k}", [5], "int64")
        losses.append(g.cross_entropy(g.matmul(g.unary(g.matmul(x, w1), "tanh"), w2), t))
    loss = g.unary(g.add(g.add(losses[0], losses[1]), losses[2]), "scale", 1 / 3)
    g.save(loss, name="loss")
    opt = rt.optim.sgd(g, [w1, w2], g.grad(loss, [w1, w2]), 0.1, momentum=0.9, weight_decay=0.01)
    rng = np.random.default_rng(2)
    init = {"w1": rng.standard_normal((6, 9)) / 3, "w2": rng.standard_normal((9, 7)) / 3}
    steps = [[(rng.standard_normal((5, 6)), rng.integers(0, 7, 5)) for _ in range(3)] for _ in range(4)]
    cg = rt.compileGraph(g, device="cpu:3")
    for n, micro in enumerate(steps):
        feeds = {f"{a}{k}": v for k, (x, t) in enumerate(micro) for a, v in (("x", x), ("t", t))}
        cg.load({**(init | opt.initial() if n == 0 else {}), **feeds})
        cg.execute()
    tw1, tw2 = (torch.tensor(init[k], requires_grad=True) for k in ("w1", "w2"))
    topt = torch.optim.SGD([tw1, tw2], lr=0.1, momentum=0.9, weight_decay=0.01)
    for micro in steps:
        topt.zero_grad()
        for x, t in micro:
            (F.cross_entropy(torch.tanh(torch.tensor(x) @ tw1) @ tw2, torch.tensor(t)) / 3).backward()
        topt.step()
    assert _rel(cg.offload("w1"), tw1.detach().numpy()) <= 1e-9
    assert _rel(cg.offload("w2"), tw2.detach().numpy()) <= 1e-9
    assert _rel(cg.offload("w1.momentum_buffer"), topt.state[tw1]["momentum_buffer"].numpy()) <= 1e-9


def test_llama_training_step_with_adamw_equals_the_reference_stepped_on_cpu_devices() -> None:
    """Two steps of the LLaMA-style training graph with AdamW on cpu:5 equal the single-device reference
    fed back its own assigned values."""
    from relational_tensors.graph.models import llama_training_feeds, llama_training_graph

    g = llama_training_graph(1, 20, 32, 4, 2, 40, 37, optimizer="adamw", seq_ends=(7, 20))
    feeds = llama_training_feeds(g, lr=1e-2)
    assert not feeds["embed.exp_avg_sq"].any() and feeds["adamw.step"].tolist() == [0.0]
    cg = rt.compileGraph(g, device="cpu:5")
    ref_feeds = dict(feeds)
    for step in range(2):
        cg.load(feeds if step == 0 else {"lr": feeds["lr"]})
        cg.execute()
        want = rt.reference(g, ref_feeds)
        np.testing.assert_allclose(cg.offload("loss"), want["loss"], rtol=1e-5)
        for s in g.assignments:
            ref_feeds[g.nodes[s].name] = want[f"{g.nodes[s].name}.next"]
    for s in g.assignments:
        name = g.nodes[s].name
        assert _rel(cg.offload(name), ref_feeds[name]) <= 1e-4, name


def test_mixed_precision_keeps_float32_master_weights_and_rounds_the_bfloat16_parameters_from_them() -> None:
    """bfloat16 parameters and activations, float32 master weights and moments: after each step the
    parameters are the masters rounded, and the masters follow the float32 run of the same step closely."""
    import ml_dtypes

    def build(dtype: str, master: str | None):
        g = rt.Graph()
        x, t = g.input("x", [16, 8], dtype), g.input("t", [16], "int64")
        w1, w2 = g.state("w1", [8, 12], dtype), g.state("w2", [12, 5], dtype)
        loss = g.save(g.cross_entropy(g.matmul(g.unary(g.matmul(x, w1), "silu"), w2), t), name="loss")
        grads = rt.optim.clip_grad_norm(g, [g.cast(d, "float32") for d in g.grad(loss, [w1, w2])], 1.0) \
            if master else rt.optim.clip_grad_norm(g, g.grad(loss, [w1, w2]), 1.0)
        return g, rt.optim.adamw(g, [w1, w2], grads, 1e-2, master_dtype=master)

    rng = np.random.default_rng(4)
    init = {"w1": rng.standard_normal((8, 12)) / 3, "w2": rng.standard_normal((12, 5)) / 3}
    batches = [(rng.standard_normal((16, 8)), rng.integers(0, 5, 16)) for _ in range(4)]
    results = {}
    for dtype, master in (("bfloat16", "float32"), ("float32", None)):
        g, opt = build(dtype, master)
        assert {t.dtype for t, _ in opt.states.values()} == {"float32"}
        start = {k: v.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32) for k, v in init.items()}
        cg = rt.compileGraph(g, device="cpu:3")
        for k, (x, t) in enumerate(batches):
            first = {**start, **opt.initial(init)} if k == 0 else {}
            cg.load({**first, "x": x.astype(start["w1"].dtype), "t": t})
            cg.execute()
        results[dtype] = cg
    mixed, full = results["bfloat16"], results["float32"]
    for w in ("w1", "w2"):
        master = mixed.offload(f"{w}.master")
        assert np.array_equal(mixed.offload(w), master.astype(ml_dtypes.bfloat16))  # the parameter, rounded
        assert _rel(master, full.offload(w)) <= 5e-2  # bfloat16 activations, float32 updates
        assert _rel(master, init[w]) > 1e-3  # trained
    with pytest.raises(GraphError, match="copy of"):
        build("bfloat16", "float32")[1].initial()


def test_memory_by_category_adds_up_to_the_peak_and_a_refusal_names_the_largest() -> None:
    from relational_tensors.graph.models import llama_training_graph

    g = llama_training_graph(1, 64, 64, 4, 2, 96, 101, optimizer="adamw")
    cg = rt.compileGraph(g, device="cpu:4")
    cats = cg.memory_by_category()
    for d, peak in cg.memory().items():
        assert sum(cats[d].values()) == peak
        assert cats[d]["parameters"] > 0 and cats[d]["optimizer state"] > 0
    names = set(g.memory_categories())
    assert {"parameters", "optimizer state", "inputs", "gradients", "activations for the backward",
            "optimizer update"} <= names
    # (the refused plan keeps its states sharded: gradients, moments and parameters are what is left)
    with pytest.raises(rt.OutOfMemoryPlanError,
                       match=r"largest: (gradients|optimizer state|parameters) [\d,]+, [a-z ]+ [\d,]+"):
        rt.compileGraph(g, device="cpu:4", memory_per_device=200_000)

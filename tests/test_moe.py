"""transformers' mixture-of-experts models through ``rt.parallelize`` and ``rt.train_step``: tiny configs of
Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE, OLMoE and DeepSeek-V3 (group-limited routing,
MLA attention) (and GPT-OSS and PhiMoE, whose routers clamp and scatter, forward), with padded batches,
against the module's own eager run.

The experts trace in their dense form (``frontend/torch/moe.py``: every token through every expert, weighted
by its routing weight for it); routing is ``topk`` and ``take_along``.  Forward: 1e-5 of the largest logit
(float32).  Training: three AdamW steps of ``rt.train_step`` against torch's own loop on a twin; the losses
agree to float32 rounding, the parameters to 2e-4 after three updates of lr 1e-2 (Adam divides each
gradient by its running magnitude, so a gradient near zero moves a parameter by the learning rate whatever
its rounding), and every parameter trained."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

import relational_tensors as rt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the MoE model tests need pip install transformers")
nn = torch.nn

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", use_cache=False)


def _model(name: str) -> Any:
    torch.manual_seed(0)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                                          num_experts_per_tok=2))
    if name == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=40))
    if name == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8))
    if name == "olmoe":  # its embedding has a padding row (pad_token_id=1), which never trains
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2))
    if name == "gpt_oss":  # biased, transposed, interleaved experts with a clamped gate; attention sinks
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **{**COMMON, "attn_implementation": "eager"}, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    if name == "phimoe":  # sparsemixer routing: max, clamp, scatter of -inf
        return transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**COMMON, num_local_experts=4,
                                                                        num_experts_per_tok=2))
    if name == "deepseek_v3":  # group-limited sigmoid routing, a shared expert, MLA attention (slice writes)
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
        with torch.no_grad():  # its router starts at zeros: every expert tied, and ties are ordered apart
            model.model.layers[1].mlp.gate.weight.normal_(std=0.1)
        return model
    raise AssertionError(name)


def _batch() -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0  # the first sequence padded on the right
    return ids, mask, torch.randint(0, 64, (2, 12), generator=g)


class Logits(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Any, mask: Any) -> Any:
        return self.model(input_ids=ids, attention_mask=mask).logits


def _lean(names: list[str], default: tuple[str, ...]) -> list[object]:
    """``names`` as parameters, those outside ``default`` marked slow (the default run keeps CI lean; the
    three AdamW steps of the same models cover them there)."""
    return [n if n in default else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _lean(["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "phimoe",
                                        "deepseek_v3"], ("olmoe", "deepseek_v3")))  # Mixtral: the form test
def test_a_moe_model_on_a_padded_batch_equals_its_eager_forward(name: str) -> None:
    model = _model(name).eval()
    ids, mask, _ = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = rt.parallelize(Logits(model), (ids, mask), device="cpu:3")
    with torch.no_grad():
        want = Logits(model)(ids, mask)
    got = fast(ids, mask)
    real = mask.bool()  # padded positions' logits are whatever each computes there
    assert (got - want)[real].abs().max().item() <= 1e-5 * want[real].abs().max().item()


@pytest.mark.parametrize("impl", ["eager", pytest.param("grouped_mm", marks=pytest.mark.slow), "batched_mm"])
def test_the_experts_form_follows_the_model_s_setting(impl: str) -> None:
    """transformers' own knob picks the traced form: its sparse implementations ("eager", the default, and
    "grouped_mm") trace as rows sorted by expert through grouped products, "batched_mm" as every token
    through every expert; both give the eager forward."""
    model = _model("mixtral").eval()
    model.config._experts_implementation = impl
    ids, mask, _ = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = rt.parallelize(Logits(model), (ids, mask), device="cpu:2")
    kinds = {n.kind for n in fast.graph.operators}
    if impl == "batched_mm":
        assert "grouped_matmul" not in kinds and "route_index" not in kinds
    else:
        assert {"grouped_matmul", "route_index"} <= kinds
    with torch.no_grad():
        want = Logits(model)(ids, mask)
    got = fast(ids, mask)
    real = mask.bool()
    assert (got - want)[real].abs().max().item() <= 1e-5 * want[real].abs().max().item()


def test_the_custom_ops_compute_in_eager_torch() -> None:
    """``relational_tensors::route_index`` and ``grouped_mm`` called outside a trace: the sorted layout and
    the grouped product, as the operators' NumPy kernels compute them."""
    import numpy as np

    from relational_tensors.frontend.torch.moe import custom_ops
    from relational_tensors.sql_specs.experts import route_maps

    ops = custom_ops()
    ids = torch.tensor([[3, 0], [0, 2], [3, 1], [9, 0]])
    for what, want in zip(("token", "dest", "group"), route_maps(ids.numpy(), 4)):
        assert np.array_equal(ops.route_index(ids, 4, what).numpy(), want), what
    xs, w, group = torch.randn(8, 3), torch.randn(4, 5, 3), ops.route_index(ids, 4, "group")
    got = ops.grouped_mm(xs, w, group, True)
    for p in range(8):
        want_row = xs[p] @ w[group[p]].T if group[p] < 4 else torch.zeros(5)
        torch.testing.assert_close(got[p], want_row)


def _loss(m: Any, ids: Any, mask: Any, labels: Any) -> Any:
    logits = m(input_ids=ids, attention_mask=mask).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.masked_fill(mask == 0, -100).flatten())


@pytest.mark.parametrize("name", _lean(["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"],
                                       ("mixtral", "qwen2_moe", "qwen3_moe")))
def test_three_adamw_steps_of_a_moe_model_equal_torchs_loop(name: str) -> None:
    model = _model(name)
    twin = copy.deepcopy(model)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = rt.train_step(model, _loss, batch, optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:2")
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(3):
        ours = float(step(*batch))
        opt.zero_grad()
        theirs = _loss(twin, *batch)
        theirs.backward()
        opt.step()
        assert ours == pytest.approx(theirs.item(), rel=1e-5)
    step.load_into(model)
    pad = getattr(model.model.embed_tokens, "padding_idx", None)
    for (k, a), b in zip(model.named_parameters(), twin.parameters()):
        assert (a - b).abs().max().item() <= 2e-4, k
        moved = (a - start[k]).abs()
        if k.endswith("embed_tokens.weight"):  # the rows of tokens in the batch (not the padding row)
            moved = moved[[i for i in batch[0].unique().tolist() if i != pad]]
        assert moved.max().item() > 1e-3, k  # every parameter trained: routers, experts, shared experts


def test_stacked_expert_weights_name_their_first_dimension_experts() -> None:
    from relational_tensors.frontend.torch import from_torch

    model = _model("qwen2_moe").eval()
    ids, mask, _ = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = from_torch(Logits(model), (ids, mask))
    stacked = [n for n in g.inputs if ".experts." in n.name]
    assert len(stacked) == 4 and all(n.type.names[0] == "experts" and n.type.shape[0] == 4 for n in stacked)
    assert all(n.type.names[0] != "experts" for n in g.inputs if ".experts." not in n.name)


def test_phimoe_trains_with_its_random_routing_repeatably() -> None:
    """PhiMoE's sparsemixer routing draws random numbers in training (``rand_like(...).uniform_()``), so its
    steps cannot equal torch's; they lower the loss and repeat after ``torch.manual_seed``."""
    def run() -> list[float]:
        model = _model("phimoe")
        batch = _batch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = rt.train_step(model, _loss, batch, optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:2")
        torch.manual_seed(7)
        return [float(step(*batch)) for _ in range(3)]
    first = run()
    assert first == run()
    assert first[2] < first[0]


@pytest.mark.parametrize("name", _lean(["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"],
                                       ("qwen2_moe", "deepseek_v3")))
def test_moe_gradients_through_parallelize_equal_torch(name: str) -> None:
    """loss.backward() through rt.parallelize on 3 devices gives every parameter torch's gradient: the router
    through the routing weights it picked, each expert through the tokens routed to it.  DeepSeek-V3's
    router with a nonzero correction bias (which picks experts but does not weight them)."""
    model = _model(name)
    if name == "deepseek_v3":
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(std=0.1)
    twin = copy.deepcopy(model)
    ids, mask, labels = _batch()

    class Loss(nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: Any, mask: Any, labels: Any) -> Any:
            return _loss(self.m, ids, mask, labels)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = rt.parallelize(Loss(model), (ids, mask, labels), device="cpu:3")
    fast(ids, mask, labels).backward()
    _loss(twin, ids, mask, labels).backward()
    for (k, a), b in zip(model.named_parameters(), twin.parameters()):
        scale = max(b.grad.abs().max().item(), 1e-6)
        assert (a.grad - b.grad).abs().max().item() <= 1e-4 * scale, k


class Routed(nn.Module):
    """Routing written by hand: softmax scores, top-k, renormalized weights, gather, scatter, max, argmax,
    clamp, and an in-place copy into a buffer made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(12, 7)

    def forward(self, x: Any) -> Any:
        scores = torch.softmax(self.gate(x), -1)
        top, idx = torch.topk(scores, 3, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        masked = scores.scatter(-1, idx, float("-inf"))
        best, at = masked.max(-1)
        spread = torch.zeros_like(scores).scatter_add(-1, idx, weights)
        out = torch.empty_like(spread)
        out.copy_(spread.clamp(0.1, 0.6))
        return weights, idx, best, at, torch.gather(scores, -1, idx), out, scores.argmax(0)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_hand_written_routing_translates_with_gradients(p: int) -> None:
    torch.manual_seed(p)
    m = Routed()
    x = torch.randn(9, 12, requires_grad=True)
    fast = rt.parallelize(m, (x.detach(),), device=f"cpu:{p}")
    got, want = fast(x), m(x)
    for a, b in zip(got, want):
        if b.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)
    cot = [torch.randn_like(w) if w.dtype.is_floating_point else None for w in want]

    def total(outs: Any) -> Any:
        return sum((o * c).sum() for o, c in zip(outs, cot) if c is not None)

    total(got).backward()
    ours = x.grad.clone(), m.gate.weight.grad.clone()
    x.grad = None
    m.zero_grad()
    total(want).backward()
    torch.testing.assert_close(ours[0], x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], m.gate.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0"])
def test_a_moe_model_trains_on_the_gpu_captured_as_torch_does(device: str) -> None:
    """Mixtral on CUDA tensors: the forward equals eager's, and three AdamW steps of rt.train_step equal
    torch's loop; every operator of the step has a device kernel (routing included), so after two steps
    each step is one CUDA-graph launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("cupy")
    from relational_tensors.kernels.launchers import allocates

    model = _model("mixtral").cuda()
    twin = copy.deepcopy(model)
    batch = tuple(t.cuda() for t in _batch())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = rt.parallelize(Logits(model), batch[:2], device=device)
        with torch.no_grad():
            want = Logits(model)(*batch[:2])
        real = batch[1].bool()
        assert (fast(*batch[:2]) - want)[real].abs().max().item() <= 1e-4 * want[real].abs().max().item()
        step = rt.train_step(model, _loss, batch, optimizer=rt.optim.AdamW(lr=1e-2), device=device)
    assert not [n.kind for n in step.graph.operators if allocates(n.op)]
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(3):
        ours = step(*batch)
        opt.zero_grad()
        theirs = _loss(twin, *batch)
        theirs.backward()
        opt.step()
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-4)
    assert step.compiled.executor.graph_exec is not None


# --- the graph API's MoE layer and the expert-parallel hand plans ---------------------------------------

def _layer_feeds(g: Any) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {n.name: (rng.standard_normal(n.type.shape) / 4).astype(np.float32) for n in g.inputs
            if n.name != "lr"} | ({"lr": np.array([1e-2], np.float32)} if "lr" in {n.name for n in g.inputs}
                                  else {})


def test_the_graph_moe_layer_is_the_routed_sum_of_its_experts() -> None:
    """moe.moe_layer_graph against a per-token loop over the two experts each token is routed to."""
    import numpy as np

    from relational_tensors.graph.moe import moe_layer_graph

    g = moe_layer_graph(37, 16, experts=4, top_k=2, d_ff=24, dtype="float32")
    feeds = _layer_feeds(g)
    want = rt.reference(g, feeds)["y"]
    x, nw = torch.tensor(feeds["x"]), torch.tensor(feeds["ffn_norm"])
    h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * nw
    top, ids = torch.topk(torch.softmax(h @ torch.tensor(feeds["router"]), -1), 2)
    top = top / top.sum(-1, keepdim=True)
    w1, w3, w2 = (torch.tensor(feeds[k]) for k in ("w1", "w3", "w2"))
    out = x.clone()
    for t in range(37):
        for j in range(2):
            e = ids[t, j]
            out[t] += top[t, j] * ((nn.functional.silu(h[t] @ w1[e]) * (h[t] @ w3[e])) @ w2[e])
    np.testing.assert_allclose(want, out.numpy(), rtol=1e-5, atol=1e-6)
    assert g.nodes[g.inputs[3].id].type.names[0] == "experts"  # w1 [experts, hidden, ff]


@pytest.mark.parametrize("plan", ["optimizer", "expert_parallel", "expert_tensor_parallel"])
@pytest.mark.parametrize("p", [3, 4])
def test_moe_plans_give_the_reference_step(plan: str, p: int) -> None:
    """A MoE layer's training step (loss, gradients, AdamW) on cpu:p under the optimizer's plan and the hand
    plans: the reference's loss and updated weights; expert parallelism splits every expert product over the
    experts, tensor parallelism inside the experts never does."""
    import numpy as np

    from relational_tensors.graph.moe import moe_layer_graph

    g = moe_layer_graph(24, 16, experts=4, top_k=2, d_ff=12, dtype="float32", training=True, master_dtype=None)
    constraints = None if plan == "optimizer" else rt.plans.PLANS[plan](g, p)
    cg = rt.compileGraph(g, device=f"cpu:{p}", constraints=constraints)
    feeds = _layer_feeds(g)
    feeds.update({n.name: np.zeros(n.type.shape, np.float32) for n in g.inputs if "exp_avg" in n.name
                  or n.name == "adamw.step"})
    want = rt.reference(g, feeds)
    cg.run(feeds)
    for name in ("w1", "w2", "w3", "router", "ffn_norm"):
        np.testing.assert_allclose(cg.offload(name), want[f"{name}.next"],
                                   rtol=1e-4, atol=1e-6)
    experts = [n for n in ("expert_gate", "expert_up", "expert_down", "combine")]
    splits = {n: dict(cg.plan.spec(n).split) for n in experts}
    if plan == "expert_parallel":
        assert all(s.get("experts", 1) > 1 for s in splits.values()), splits
    if plan == "expert_tensor_parallel":
        assert all(s.get("experts", 1) == 1 for s in splits.values()) and splits["expert_gate"].get("ff", 1) > 1, splits


def test_the_optimizer_finds_expert_parallelism_for_a_moe_training_step() -> None:
    """A MoE layer's training step planned for 8 simulated H200s: the default selector's plan splits the
    experts (it descends from expert parallelism as well as from Algorithm 1's plan, which splits the experts'
    features) and costs within 1% of the exact optimum; the hand EP plan costs no less."""
    pytest.importorskip("scipy")
    from relational_tensors.graph.moe import moe_layer_graph

    g = moe_layer_graph(2048, 512, experts=8, top_k=2, d_ff=1024, dtype="bfloat16", training=True)
    plans = {sel: rt.compileGraph(g, device=8, topology="hgx-h200", cost_model="calibrated", selector=sel)
             for sel in ("dp", "exact")}
    dp, exact = plans["dp"].plan, plans["exact"].plan
    assert dict(dp.spec("expert_gate").split).get("experts") == 8
    assert dp.cost <= 1.01 * exact.cost
    hand = rt.compileGraph(g, device=8, topology="hgx-h200", cost_model="calibrated",
                           constraints=rt.plans.expert_parallel(g, 8))
    assert dp.cost <= hand.plan.cost * (1 + 1e-9)


def test_mixtral_with_its_load_balancing_loss_and_labels_trains_as_torch() -> None:
    """model(input_ids, labels=...).loss with output_router_logits: transformers' own shifted loss (F.pad of
    the labels) plus the router's load-balancing loss (torch.histc of the picked experts), three AdamW steps
    against torch's loop."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                     router_aux_loss_coef=0.02)
    model = transformers.MixtralForCausalLM(cfg)
    twin = copy.deepcopy(model)
    ids = _batch()[0]

    def loss_fn(m: Any, ids: Any) -> Any:
        return m(input_ids=ids, labels=ids).loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = rt.train_step(model, loss_fn, (ids,), optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:2")
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(3):
        ours = step(ids).item()
        opt.zero_grad()
        theirs = loss_fn(twin, ids)
        theirs.backward()
        opt.step()
        assert ours == pytest.approx(theirs.item(), rel=1e-5)


class Selections(nn.Module):
    """torch's selections at their edges: NaN, infinities, ties, bin edges, the elementwise max/min."""

    def forward(self, x: Any, y: Any, src: Any) -> Any:
        i = torch.tensor([[0, 2, 3], [1, 3, 0]])
        edges = torch.cat([torch.arange(11.0) * 0.3, torch.tensor([0.9, 2.1, 1.5])]) + 0 * x.sum()
        return (torch.max(x, y), torch.min(x, y), torch.argmin(x, 1), torch.argmax(x, 0), *x.min(1), *x.max(1),
                x.min(), x.max(), torch.histc(edges, 10, 0, 3), torch.zeros(2, 4).scatter(-1, i, src),
                x.scatter_add(-1, i, src), torch.gather(x, -1, i))


def test_selections_keep_torchs_nan_inf_tie_and_edge_rules() -> None:
    x = torch.tensor([[1.0, float("nan"), 0.0, 0.0], [3.0, 2.0, 2.0, 3.0]], requires_grad=True)
    y = torch.tensor([[5.0, 0.0, 1.0, -1.0], [0.0, 7.0, 2.0, 3.0]])
    src = torch.tensor([[-float("inf"), 1.0, 2.0], [2.0, float("inf"), 3.0]])
    fast = rt.parallelize(Selections(), (x.detach(), y, src), device="cpu:2")
    got, want = fast(x, y, src), Selections()(x, y, src)
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b) or torch.allclose(a, b, equal_nan=True), (k, a, b)
    # an infinite gradient stays in its place; the outputs the loss does not read take no part (the max over
    # the row holding NaN would make every gradient NaN)
    cot = torch.tensor([[float("inf"), 1.0, 0.5], [2.0, 0.0, 1.0]])
    ours = torch.autograd.grad((got[-1] * cot).sum(), x)[0]
    theirs = torch.autograd.grad((want[-1] * cot).sum(), x)[0]
    assert torch.equal(ours, theirs)
    ties = torch.tensor([2.0, 2.0, 1.0], requires_grad=True)  # max(): the gradient split among ties, as torch's
    whole = rt.parallelize(_Max(), (ties.detach(),), device="cpu:1")
    assert torch.equal(torch.autograd.grad(whole(ties), ties)[0], torch.tensor([0.5, 0.5, 0.0]))


class _Max(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.max()


class _ScatterReduce(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.scatter(-1, torch.tensor([[0, 1]]), torch.ones(1, 2), reduce="multiply")


def test_scatter_with_reduce_is_refused() -> None:
    with pytest.raises(rt.GraphError, match="reduce='multiply'"):
        rt.parallelize(_ScatterReduce(), (torch.ones(1, 3),), device="cpu:1")

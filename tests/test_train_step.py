"""rt.train_step: a module's forward, backward and optimizer as one plan, against torch's own loop."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch")
from test_torch_frontend import LlamaWithRotary, llama_config, transformers_or_skip  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import relational_tensors as rt  # noqa: E402


def _rel(a: Any, b: Any, scale: float = 0.0) -> float:
    """max |a - b| relative to max |b|, or to ``scale`` where that is larger (a moment whose gradient is
    zero in exact arithmetic holds rounding noise, to be measured against the moments of the others)."""
    a, b = np.asarray(a.detach(), np.float64), np.asarray(b.detach(), np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), scale, 1e-300)


def torch_steps(module: nn.Module, loss_fn: Any, batches: list, optimizer: Any, clip: float | None) -> list[float]:
    cls = torch.optim.AdamW if isinstance(optimizer, rt.optim.AdamW) else torch.optim.SGD
    args = {k: v for k, v in vars(optimizer).items()
            if k not in ("max_grad_norm", "master_dtype", "param_groups", "decoupled_weight_decay")}
    opt = cls(module.parameters(), **args)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(module, *batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, opt


def compare(module: nn.Module, loss_fn: Any, batches: list, optimizer: Any, device: str = "cpu:4",
            tol: float = 1e-9) -> rt.TrainStep:
    twin = pickle_copy(module)
    step = rt.train_step(module, loss_fn, batches[0], optimizer=optimizer, device=device)
    ours = [float(step(*b)) for b in batches]
    theirs, opt = torch_steps(twin, loss_fn, batches, optimizer, optimizer.max_grad_norm)
    np.testing.assert_allclose(ours, theirs, rtol=tol)
    state = step.state_dict()
    scale: dict[str, float] = {}  # per moment, a millionth of its largest magnitude over the parameters
    for p in twin.parameters():
        for key, value in opt.state[p].items():
            if key != "step" and value is not None:
                scale[key] = max(scale.get(key, 0.0), 1e-6 * float(value.abs().max()))
    index = {id(p): i for i, p in enumerate(twin.parameters())}  # torch's optimizer state_dict layout
    for k, p in twin.named_parameters():
        assert _rel(state["params"][k], p) <= tol and _rel(state["model"][k], p) <= tol, k
        for key, value in opt.state[p].items():
            ours_value = state["optimizer"]["state"][index[id(p)]][key]
            if key == "step":
                assert float(ours_value) == float(value), (k, key)
            elif value is not None:
                assert _rel(ours_value, value, scale[key]) <= tol, (k, key)
    return step


def pickle_copy(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 24), nn.Linear(24, 5)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: Any) -> Any:
        return self.down(F.gelu(self.up(self.norm(x))))


def ce(m: nn.Module, x: Any, t: Any) -> Any:
    return F.cross_entropy(m(x), t)


def _mlp_batches(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(11, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (11,), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("optimizer", [rt.optim.AdamW(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
                                       rt.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01)],
                         ids=["adamw_clip", "sgd_momentum"])
def test_five_steps_of_an_mlp_equal_torch_in_float64(optimizer: Any) -> None:
    torch.manual_seed(0)
    compare(MLP().double(), ce, _mlp_batches(5), optimizer)


def test_resuming_from_state_dict_after_two_steps_equals_five_straight() -> None:
    torch.manual_seed(1)
    model = MLP().double()
    opt = rt.optim.AdamW(lr=1e-2, weight_decay=0.05, max_grad_norm=1.0)
    batches = _mlp_batches(5, seed=3)
    straight = rt.train_step(pickle_copy(model), ce, batches[0], optimizer=opt, device="cpu:3")
    for b in batches:
        straight(*b)
    first = rt.train_step(pickle_copy(model), ce, batches[0], optimizer=opt, device="cpu:2")
    for b in batches[:2]:
        first(*b)
    resumed = rt.train_step(pickle_copy(model), ce, batches[0], optimizer=opt, device="cpu:4")
    resumed.load_state_dict(first.state_dict())
    for b in batches[2:]:
        resumed(*b)
    a, b = resumed.state_dict(), straight.state_dict()
    assert a["steps"] == b["steps"] == 5
    for k in a["params"]:
        assert _rel(a["params"][k], b["params"][k]) <= 1e-12, k
    target = MLP().double()
    resumed.load_into(target)
    for k, p in target.named_parameters():
        assert _rel(p, b["params"][k]) <= 1e-12, k


# transformers computes parts of a float64 LLaMA in float32 whatever the module's dtype: LlamaRMSNorm
# upcasts to float32 (hidden_states.to(torch.float32)), and LlamaRotaryEmbedding keeps inv_freq as
# computed in float32 and builds its cos/sin tables in float32.  The traced graph keeps the norm's casts,
# and its rope computes exact tables; both sides round those float32 parts in different orders, so they
# agree to float32 rounding (gradients to 1e-7; LLAMA_FLOAT32_TOL, checked unpatched below with SGD).
# ``float64_llama`` makes those parts compute in the module's dtype, as the rest of the module does:
# then the steps hold 1e-9.
LLAMA_FLOAT32_TOL = 1e-5
ADAMW = rt.optim.AdamW(lr=1e-3, weight_decay=0.01, max_grad_norm=0.5)


@pytest.fixture
def float64_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    def norm(self: Any, hidden_states: Any) -> Any:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self: Any, x: Any, position_ids: Any) -> Any:
        d = 2 * self.inv_freq.shape[0]
        inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
        freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].to(x.dtype)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", norm)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary)


def _hidden_batches(n: int, shape: tuple[int, ...], seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64),) for _ in range(n)]


def test_llama_decoder_layer_adamw_steps_equal_torch_in_float64(float64_llama: None) -> None:
    torch.manual_seed(2)
    layer = LlamaWithRotary(llama_config()).double()
    compare(layer, lambda m, x: m(x).square().mean(), _hidden_batches(5, (1, 32, 64), 5), ADAMW)


def _causal_lm_loss(m: Any, ids: Any, targets: Any) -> Any:
    return F.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), targets.flatten())


def _token_batches(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 97, (1, 24), generator=g), torch.randint(0, 97, (1, 24), generator=g))
            for _ in range(n)]


def test_llama_for_causal_lm_with_cross_entropy_steps_equal_torch_in_float64(float64_llama: None) -> None:
    transformers = transformers_or_skip()
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=2, vocab_size=97)).double()
    compare(model, _causal_lm_loss, _token_batches(5, 6), ADAMW)


def test_unpatched_llama_agrees_to_float32_rounding() -> None:
    """transformers' own float32 norm and rotary tables inside a float64 model (see above), under SGD, whose
    update is linear in the gradient (Adam's m/sqrt(v) gives an element with a near-zero gradient a full
    step whose sign is that rounding)."""
    transformers = transformers_or_skip()
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=2, vocab_size=97)).double()
    compare(model, _causal_lm_loss, _token_batches(3, 6), rt.optim.SGD(lr=0.5), tol=LLAMA_FLOAT32_TOL)


def test_gpt2_block_adamw_steps_equal_torch_in_float64() -> None:
    transformers = transformers_or_skip()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(4)
    config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=512, attn_implementation="sdpa",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    compare(GPT2Block(config, layer_idx=0).double(), lambda m, x: m(x)[0].square().mean(),
            _hidden_batches(5, (2, 20, 64), 7), ADAMW)


def test_bert_layer_adamw_steps_equal_torch_in_float64() -> None:
    transformers = transformers_or_skip()
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(5)
    config = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")
    probe = torch.randn(18, 64, dtype=torch.float64)  # a layer-normalized output: mean(y²) is constant
    compare(BertLayer(config).double(), lambda m, x: (m(x)[0] * probe).sum(), _hidden_batches(5, (2, 18, 64), 8),
            ADAMW)


def test_train_step_refusals() -> None:
    model = MLP()
    with pytest.raises(rt.GraphError, match="one floating scalar"):
        rt.train_step(model, lambda m, x: m(x), (torch.randn(3, 8),), device="cpu:2")
    with pytest.raises(rt.GraphError, match="AdamW"):
        rt.train_step(model, lambda m, x: m(x).sum(), (torch.randn(3, 8),), optimizer="adam", device="cpu:2")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(rt.GraphError, match="requires grad"):
        rt.train_step(model, lambda m, x: m(x).sum(), (torch.randn(3, 8),), device="cpu:2")


def _torch_adamw_loop(module: nn.Module, forward: Any, loss_fn: Any, batches: list) -> Any:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    for batch in batches:
        opt.zero_grad()
        loss_fn(forward(*batch)).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        opt.step()
    return opt


@pytest.mark.parametrize("model", ["llama_layer", "gpt2_block"])
def test_parallelize_backward_under_torch_adamw_five_float64_steps_equal_torch(model: str, float64_llama: None) -> None:
    """The user's own loop and optimizer around a parallelized module: its backward fills the parameters'
    .grad, torch's AdamW updates them, and the module re-reads them at the next call."""
    torch.manual_seed(6)
    if model == "llama_layer":
        module, pick = LlamaWithRotary(llama_config()).double(), (lambda y: y)
    else:
        transformers = transformers_or_skip()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=512,
                                         attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        module, pick = GPT2Block(config, layer_idx=0).double(), (lambda y: y[0])
    twin = pickle_copy(module)
    batches = _hidden_batches(5, (1, 24, 64), 9)
    pm = rt.parallelize(module, batches[0], device="cpu:4")
    ours = _torch_adamw_loop(module, lambda x: pick(pm(x)), lambda y: y.square().mean(), batches)
    theirs = _torch_adamw_loop(twin, lambda x: pick(twin(x)), lambda y: y.square().mean(), batches)
    for (k, p), q in zip(module.named_parameters(), twin.parameters()):
        assert _rel(p, q) <= 1e-9, k
        for key in ("exp_avg", "exp_avg_sq"):
            assert _rel(ours.state[p][key], theirs.state[q][key], 1e-15) <= 1e-9, (k, key)

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


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a.detach(), np.float64), np.asarray(b.detach(), np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)


def torch_steps(module: nn.Module, loss_fn: Any, batches: list, optimizer: Any, clip: float | None) -> list[float]:
    cls = torch.optim.AdamW if isinstance(optimizer, rt.optim.AdamW) else torch.optim.SGD
    args = {k: v for k, v in vars(optimizer).items() if k not in ("max_grad_norm", "master_dtype")}
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
    for k, p in twin.named_parameters():
        assert _rel(state["params"][k], p) <= tol, k
        for key, value in opt.state[p].items():
            if key != "step" and value is not None:
                assert _rel(state["optimizer"][k][key], value) <= tol, (k, key)
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


# transformers computes parts of a float64 LLaMA in float32: LlamaRMSNorm upcasts to float32
# (hidden_states.to(torch.float32)) and LlamaRotaryEmbedding builds its cos/sin tables in float32.  The
# traced graph keeps the norm's casts but computes RoPE's angles in float64, and both sides round in
# different orders, so they agree to float32 rounding (gradients to 1e-7), which Adam's normalized updates
# carry to ~1e-6 of the parameters after three steps.  The norm is patched to compute in its input's dtype
# (what remains is RoPE's tables); the MLP tests above, with no float32 inside, hold 1e-9.
LLAMA_TOL = 1e-5


@pytest.fixture
def float64_rmsnorm(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    def forward(self: Any, hidden_states: Any) -> Any:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def test_llama_decoder_layer_adamw_steps_equal_torch_in_float64(float64_rmsnorm: None) -> None:
    torch.manual_seed(2)
    layer = LlamaWithRotary(llama_config()).double()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(1, 32, 64, generator=g, dtype=torch.float64),) for _ in range(3)]
    compare(layer, lambda m, x: m(x).square().mean(), batches,
            rt.optim.AdamW(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0), tol=LLAMA_TOL)


def test_llama_for_causal_lm_with_cross_entropy_steps_equal_torch_in_float64(float64_rmsnorm: None) -> None:
    transformers = transformers_or_skip()
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=2, vocab_size=97)).double()
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randint(0, 97, (1, 24), generator=g), torch.randint(0, 97, (1, 24), generator=g))
               for _ in range(3)]

    def loss_fn(m: Any, ids: Any, targets: Any) -> Any:
        return F.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), targets.flatten())

    compare(model, loss_fn, batches, rt.optim.AdamW(lr=1e-3, weight_decay=0.01), tol=LLAMA_TOL)


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

"""rt.parallelize is differentiable: loss.backward() through a parallelized module fills its parameters'
.grad (and its inputs') from our compiled backward, equal to torch's own, on transformers' blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch")
from test_torch_frontend import LlamaWithRotary, llama_config, transformers_or_skip  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import relational_tensors as rt  # noqa: E402


def _rel(a: Any, b: Any, floor: float = 1e-30) -> float:
    """max |a - b| over the largest magnitude of b (at least ``floor``: a gradient that is zero in exact
    arithmetic, such as a key bias's under softmax, is rounding noise in both)."""
    a, b = np.asarray(a.detach(), np.float64), np.asarray(b.detach(), np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor)


def assert_same_gradients(module: nn.Module, x: Any, loss_fn: Any, device: str = "cpu:4",
                          tol: float = 1e-4) -> Any:
    """Our backward's gradients of every parameter (and of x) against torch's, at ``tol`` of the
    largest magnitude of each."""
    module.train()  # dropout is 0 in the configs; train mode only turns on gradients' bookkeeping
    pm = rt.parallelize(module, (x.detach(),), device=device)
    xs = x.detach().clone().requires_grad_(True)
    out = pm(xs)
    assert out.requires_grad
    loss_fn(out).backward()
    ours = {k: p.grad.clone() for k, p in module.named_parameters()}
    ours_x = xs.grad.clone()
    module.zero_grad()
    xt = x.detach().clone().requires_grad_(True)
    loss_fn(module(xt)).backward()
    floor = 1e-4 * max(float(p.grad.abs().max()) for p in module.parameters())
    for k, p in module.named_parameters():
        assert _rel(ours[k], p.grad, floor) <= tol, (k, _rel(ours[k], p.grad, floor))
    assert _rel(ours_x, xt.grad) <= tol
    return pm


def test_mlp_gradients_and_a_torch_training_loop() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(13, 16)
    pm = assert_same_gradients(m, x, lambda y: y.square().mean(), device="cpu:3")
    twin = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    twin.load_state_dict(m.state_dict())
    ours_opt, their_opt = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(3):  # the user's own optimizer and loop: the module's weights are read again each step
        ours_opt.zero_grad()
        pm(x).square().mean().backward()
        ours_opt.step()
        their_opt.zero_grad()
        twin(x).square().mean().backward()
        their_opt.step()
    for (k, a), b in zip(m.named_parameters(), twin.parameters()):
        assert _rel(a, b) <= 1e-5, k


def test_outputs_require_grad_as_torch_s_would() -> None:
    m = nn.Linear(4, 3)
    pm = rt.parallelize(m, (torch.randn(2, 4),), device="cpu:2")
    assert pm(torch.randn(2, 4)).requires_grad
    with torch.no_grad():
        assert not pm(torch.randn(2, 4)).requires_grad
    for p in m.parameters():
        p.requires_grad_(False)
    assert not pm(torch.randn(2, 4)).requires_grad
    assert pm(torch.randn(2, 4, requires_grad=True)).requires_grad


def test_llama_decoder_layer_gradients_equal_torch() -> None:
    torch.manual_seed(1)
    assert_same_gradients(LlamaWithRotary(llama_config()), torch.randn(1, 64, 64), lambda y: y.square().mean())


def test_gpt2_block_gradients_equal_torch() -> None:
    transformers = transformers_or_skip()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(2)
    config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=512, attn_implementation="sdpa",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert_same_gradients(GPT2Block(config, layer_idx=0), torch.randn(2, 32, 64), lambda y: y[0].square().mean())


def test_llama_for_causal_lm_with_cross_entropy_gradients_equal_torch() -> None:
    transformers = transformers_or_skip()

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=2, vocab_size=97))

        def forward(self, ids: Any) -> Any:
            return self.lm(input_ids=ids).logits

    torch.manual_seed(3)
    model = Logits().train()
    ids = torch.randint(0, 97, (1, 40))
    targets = torch.randint(0, 97, (1, 40))
    pm = rt.parallelize(model, (ids,), device="cpu:4")
    F.cross_entropy(pm(ids).flatten(0, 1), targets.flatten()).backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    assert ours.keys() == {k for k, p in model.named_parameters() if p.grad is not None}
    for k, p in model.named_parameters():
        if p.grad is not None:
            assert _rel(ours[k], p.grad) <= 1e-4, k


def test_bert_layer_gradients_equal_torch() -> None:
    transformers = transformers_or_skip()
    from transformers.models.bert.modeling_bert import BertLayer

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                             attn_implementation="sdpa")
            self.layer = BertLayer(config)

        def forward(self, x: Any) -> Any:
            return self.layer(x)[0]

    torch.manual_seed(4)
    probe = torch.randn(24, 64)  # the output is layer-normalized: mean(y²) would not depend on the weights
    assert_same_gradients(Layer(), torch.randn(2, 24, 64), lambda y: (y * probe).sum())


class PaddedLookup(nn.Module):
    """Token ids through an embedding with a padding row (nn.Embedding(padding_idx=...)) and a linear head."""

    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=padding_idx)
        with torch.no_grad():
            self.embed.weight.normal_()  # the padding row too: torch still gives it no gradient
        self.head = nn.Linear(6, 5)

    def forward(self, ids: Any) -> Any:
        return self.head(self.embed(ids))


@pytest.mark.parametrize("padding_idx", [None, 3, -2])
def test_an_embeddings_padding_row_gets_no_gradient_as_in_torch(padding_idx: int | None) -> None:
    """nn.Embedding(padding_idx=p): the row p reads its values but is never trained, through rt.parallelize's
    backward and through rt.train_step's whole step, as in torch."""
    torch.manual_seed(0)
    m = PaddedLookup(padding_idx)
    ids = torch.tensor([[3, 1, 9, 3], [0, 3, 2, 9]])
    pm = rt.parallelize(m, (ids,), device="cpu:2")
    torch.testing.assert_close(pm(ids), m(ids))
    pm(ids).square().mean().backward()
    ours = m.embed.weight.grad.clone()
    m.zero_grad()
    m(ids).square().mean().backward()
    torch.testing.assert_close(ours, m.embed.weight.grad, rtol=1e-5, atol=1e-7)
    row = m.embed.padding_idx
    if row is not None:
        assert not ours[row].any()
    before = m.embed.weight.detach().clone()
    step = rt.train_step(m, lambda mod, i: mod(i).square().mean(), (ids,), optimizer=rt.optim.SGD(lr=0.5),
                         device="cpu:3")
    for _ in range(2):
        step(ids)
    step.load_into(m)
    if row is not None:
        assert torch.equal(m.embed.weight[row], before[row])  # never trained
    assert not torch.equal(m.embed.weight[2], before[2])  # a row that was read trained


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        h = self.lin(x)
        return h.max(), h * 2


@pytest.mark.parametrize("read", ["second", "both"])
def test_outputs_the_loss_does_not_read_take_no_part_in_the_backward(read: str) -> None:
    """torch's backward skips an output the loss does not read: a max over a row holding NaN leaves the
    other output's gradients finite; read too, its gradient goes to the NaN entries, as torch's does."""
    torch.manual_seed(0)
    m = TwoHeads()
    x = torch.tensor([[1.0, float("nan"), 0.0, 2.0], [3.0, 2.0, 2.0, 3.0]])
    fast = rt.parallelize(m, (x,), device="cpu:2")

    def grads(f: Any) -> Any:
        m.zero_grad()
        top, twice = f(x)
        loss = twice[1].sum() if read == "second" else top + twice.sum()
        loss.backward()
        return m.lin.weight.grad.clone(), m.lin.bias.grad.clone()

    for a, b in zip(grads(fast), grads(m)):
        torch.testing.assert_close(a, b, equal_nan=True)
    for _ in range(2):  # the program for the outputs read is kept: the next steps run it directly
        for a, b in zip(grads(fast), grads(m)):
            torch.testing.assert_close(a, b, equal_nan=True)

"""transformers models as a new user runs them: random weights, ``rt.parallelize(..., device="cpu:4")``,
compared with the module's own output at 1e-4 of the largest magnitude (float32) at real positions."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import relational_tensors as rt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the model tests need pip install transformers")
nn = torch.nn

REL = 1e-4


class Logits(nn.Module):
    """model(**named inputs).logits, called with the inputs by position."""

    def __init__(self, model: Any, *names: str) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *xs: Any) -> Any:
        return self.model(**dict(zip(self.names, xs))).logits


def _compare(module: Any, inputs: tuple, real: Any = None, rel: float = REL, device: str = "cpu:4") -> Any:
    """The parallelized module against the module; ``real`` [batch, seq] marks the positions compared."""
    module = module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = rt.parallelize(module, inputs, device=device)
    with torch.no_grad():
        want = module(*inputs).float()
    got = fast(*inputs).float()
    diff = (got - want).abs()
    if real is not None:
        diff = diff[real]
    err = float(diff.max()) / float(want.abs().max())
    assert err <= rel, f"error {err:.2e} of the largest magnitude"
    return fast


def _attention_ops(fast: Any) -> list:
    return [n.op for n in fast.graph.operators if n.kind == "attention"]


def _padded_batch(vocab: int) -> tuple[Any, Any]:
    """3 sequences of lengths 10, 7 and 4 (right-padded), with HF's attention_mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


def _llama_config(**kw: Any) -> Any:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return transformers.LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_with_a_padded_batch_and_its_attention_mask(impl: str) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(attn_implementation=impl))
    ids, mask = _padded_batch(64)
    fast = _compare(Logits(model, "input_ids", "attention_mask"), (ids, mask), real=mask.bool())
    if impl == "sdpa":  # the mask read as structure: causal, with the padding as key padding
        ops = _attention_ops(fast)
        assert len(ops) == 2 and all(op.causal is True and op.extras == ("key_padding",) for op in ops)
    # another batch through the same program: the mask is an input, not a constant
    ids2, mask2 = _padded_batch(64)
    mask2 = mask2.flip(0)
    with torch.no_grad():
        want = Logits(model, "input_ids", "attention_mask").eval()(ids2, mask2)
    got = fast(ids2, mask2)
    assert float((got - want).abs()[mask2.bool()].max()) <= REL * float(want.abs().max())


def test_t5_encoder_decoder_with_cross_attention_under_sdpa() -> None:
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                attn_implementation="sdpa", use_cache=False, dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(cfg)
    ids, mask = _padded_batch(64)
    dec = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    fast = _compare(Logits(model, "input_ids", "attention_mask", "decoder_input_ids"), (ids, mask, dec))
    ops = _attention_ops(fast)
    cross = [op for op in ops if op.input_types[0].shape[1] != op.input_types[1].shape[1]]
    assert len(ops) == 6 and len(cross) == 2  # 2 encoder, 2 decoder self-, 2 cross-attention layers
    assert all("bias" in op.extras for op in ops if op not in cross)  # the relative position bias
    assert all(op.causal is True for op in ops if op.input_types[0].shape[1] == 6 and op not in cross)


def test_phi3_with_its_default_config() -> None:
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = transformers.Phi3ForCausalLM(cfg)
    _compare(Logits(model, "input_ids"), (torch.randint(0, 64, (2, 10)),))


def test_mistral_with_a_sliding_window_shorter_than_the_sequence() -> None:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=4, use_cache=False, attn_implementation="sdpa")
    model = transformers.MistralForCausalLM(cfg)
    fast = _compare(Logits(model, "input_ids"), (torch.randint(0, 64, (2, 12)),))
    assert [(op.causal, op.window) for op in _attention_ops(fast)] == [(True, 4), (True, 4)]


def test_llama_in_bfloat16_recognizes_rope() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(num_hidden_layers=1)).to(torch.bfloat16)
    # bfloat16 keeps 8 bits: both sides round at every operator, in different places
    fast = _compare(Logits(model, "input_ids"), (torch.randint(0, 64, (2, 10)),), rel=1.6e-2)
    kinds = [n.kind for n in fast.graph.operators]
    assert kinds.count("rope") == 2 and kinds.count("rmsnorm") == 3
    assert len(kinds) == 19 + 3  # one decoder layer, the embedding, the final norm and the head
    assert all(n.op.base == 10000.0 for n in fast.graph.operators if n.kind == "rope")


@pytest.mark.parametrize("buffer", ["bfloat16", "float32"])
def test_rope_tables_of_a_16_bit_frequency_buffer_are_told_apart(buffer: str) -> None:
    """Over 2048 positions a bfloat16 frequency buffer moves the angles by radians: the fit says which."""
    import numpy as np

    from relational_tensors.frontend.torch.patterns import _rope_tables

    d, s = 64, 2048
    inv = (500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)).to(getattr(torch, buffer)).float()
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    cos, sin = (t.to(torch.bfloat16).float().numpy() for t in (ang.cos(), ang.sin()))
    found = _rope_tables(cos.astype(np.float32), sin.astype(np.float32), d, "bfloat16")
    assert found is not None and found[0] == 500000.0
    assert found[2] == (buffer if buffer == "bfloat16" else None)


def test_zero_dimensional_outputs_are_zero_dimensional() -> None:
    class Losses(nn.Module):
        def forward(self, x: Any, y: Any) -> Any:
            return x.sum(), nn.functional.mse_loss(x, y)

    x, y = torch.randn(4, 6), torch.randn(4, 6)
    fast = rt.parallelize(Losses(), (x, y), device="cpu:4")
    total, mse = fast(x, y)
    assert total.shape == () and mse.shape == ()
    torch.testing.assert_close(total, x.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mse, nn.functional.mse_loss(x, y), rtol=1e-5, atol=1e-6)

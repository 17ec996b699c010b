"""A zoo of transformers architectures in tiny configurations, with random weights, for the gradient and
training-step tests that compare the compiler with torch.

Every case builds ``(module, batch, loss_fn)``: ``module`` is a :class:`Call` (float64, ``eval()``) that takes
tensors only, by position; ``batch`` is a tuple of tensors; ``loss_fn(module, *batch)`` is a scalar loss. For the
cross-entropy cases the last tensor of the batch is the int64 targets and the module's inputs are the rest
(``batch[:len(module.names)]``); for the others the whole batch is the module's input.

``ZooCase.build`` sets every dropout of the config to 0 (so the module is deterministic in ``train()`` mode too,
ResNet's batch norm statistics apart); :func:`train_mode_case` builds the same weights with dropout 0.1 wherever
the config has one, in ``train()`` mode. ``python tests/hf_zoo.py`` checks every case in torch alone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import transformers
from torch import nn
from torch.nn import functional as F

__all__ = ["ZOO", "Call", "ZooCase", "ce_loss", "projection_loss", "train_mode_case"]

VOCAB = 64  # every text model's vocabulary
BATCH = 2
SEQ = 12  # every text model's sequence length (16 for ModernBERT, whose local window is 8)
IMAGE = 32  # images are [BATCH, 3, IMAGE, IMAGE]
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # special tokens inside the tiny vocabulary


class Call(nn.Module):
    """``getattr(model(**dict(zip(names, xs))), output)``: a transformers model called with tensors by position."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], output: str) -> None:
        super().__init__()
        self.model, self.names, self.output = model, names, output

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**dict(zip(self.names, xs))), self.output)


def ce_loss(module: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the module's logits [..., classes] on ``batch[-1]``, the int64 targets [...]."""
    logits = module(*batch[:-1])
    return F.cross_entropy(logits.flatten(0, -2), batch[-1].flatten())


def projection_loss(module: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """The module's output (hidden states or pooled features) projected on a fixed tensor of its shape:
    a loss whose gradient reaches every parameter at its own scale (the mean square of a normalized output is
    nearly scale-invariant, which leaves most gradients at rounding noise)."""
    out = module(*batch)
    # cosines of multiples of the golden angle: fixed, of mixed sign, and no random generator in the trace
    weights = torch.cos(torch.arange(out.numel(), dtype=out.dtype) * 2.399963229728653).reshape(out.shape)
    return (out * weights).sum() / out.numel() ** 0.5


@dataclass(frozen=True)
class ZooCase:
    name: str
    build: Callable[[], Any]  # () -> (module, batch, loss_fn)
    slow: bool = False  # torch alone takes more than ~1 s to build and run 3 forward/backward steps
    dropout: bool = False  # the config has dropout that the model applies in train() mode


class _Spec(NamedTuple):
    """What a case is made of: the model class, its config, the names the inputs are passed under, the batch
    (inputs then, for ``ce_loss``, the targets), the output read and the loss."""

    model: type
    config: Any
    names: tuple[str, ...]
    batch: tuple[torch.Tensor, ...]
    output: str = "logits"
    loss: Callable[..., torch.Tensor] = ce_loss


# config fields that are dropout probabilities (stochastic depth included). Not layerdrop, which skips whole layers
# on a Python-level coin toss: it stays 0 (wav2vec2's default of 0.1 is overridden in its config)
_DROPOUT = re.compile(r"dropout|pdrop|drop_path")


def _set_dropout(config: Any, p: float) -> list[str]:
    """Sets every dropout probability of ``config`` to ``p``; returns the fields set."""
    names = [k for k, v in vars(config).items()
             if _DROPOUT.search(k) and "layerdrop" not in k and (v is None or type(v) in (float, int))]
    for k in names:
        setattr(config, k, p)
    return names


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(seq: int = SEQ, low: int = 3, seed: int = 1) -> torch.Tensor:
    """Token ids [BATCH, seq] in [low, VOCAB): no special tokens (RoBERTa reads its pad id as padding)."""
    return torch.randint(low, VOCAB, (BATCH, seq), generator=_gen(seed))


def _lm(model: type, config: Any, seq: int = SEQ) -> _Spec:
    """A causal LM on random ids, trained on the next token (the last position on the first)."""
    ids = _ids(seq)
    return _Spec(model, config, ("input_ids",), (ids, ids.roll(-1, dims=1)))


def _padding_mask(seq: int = SEQ) -> torch.Tensor:
    """HF's attention mask [BATCH, seq]: the second sequence right-padded to 2/3 of its length."""
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, 2 * seq // 3:] = 0
    return mask


def _labels(classes: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, classes, (BATCH,), generator=_gen(seed))


def _pixels() -> torch.Tensor:
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=_gen(), dtype=torch.float64)


# the decoder-only LMs' common shape: 2 layers of 4 query and 2 key/value heads of 8
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, use_cache=False, **TOKENS)
_SDPA = dict(attn_implementation="sdpa")
_EAGER = dict(attn_implementation="eager")


# --- decoder-only language models -------------------------------------------------------------------------------

def _llama() -> _Spec:
    return _lm(transformers.LlamaForCausalLM, transformers.LlamaConfig(**_DECODER, **_SDPA))


def _qwen2() -> _Spec:  # q/k/v biases
    return _lm(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**_DECODER, **_SDPA))


def _qwen3() -> _Spec:  # RMS norms on q and k per head
    return _lm(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**_DECODER, head_dim=8, **_SDPA))


def _mistral() -> _Spec:  # a sliding window shorter than the sequence
    return _lm(transformers.MistralForCausalLM, transformers.MistralConfig(**_DECODER, sliding_window=4, **_SDPA))


def _phi3() -> _Spec:  # fused qkv and gate/up projections
    return _lm(transformers.Phi3ForCausalLM, transformers.Phi3Config(**_DECODER, **_SDPA))


def _gemma() -> _Spec:  # tied embeddings, scaled by sqrt(hidden); (1 + weight) RMS norms
    return _lm(transformers.GemmaForCausalLM, transformers.GemmaConfig(**_DECODER, head_dim=8, **_SDPA))


def _gemma2() -> _Spec:
    # attention and final logit soft-capping, which only the eager attention applies; sliding and full layers
    cfg = transformers.Gemma2Config(**_DECODER, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, **_EAGER)
    return _lm(transformers.Gemma2ForCausalLM, cfg)


def _gemma3() -> _Spec:  # text only: q/k norms, a sliding layer then a full one with their own rotary bases
    cfg = transformers.Gemma3TextConfig(**_DECODER, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"], **_SDPA)
    return _lm(transformers.Gemma3ForCausalLM, cfg)


def _gpt2() -> _Spec:  # learned positions, Conv1D (transposed) linears, tied head
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                                  bos_token_id=1, eos_token_id=2, **_SDPA)
    return _lm(transformers.GPT2LMHeadModel, cfg)


def _opt() -> _Spec:  # learned positions offset by 2, computed from the attention mask's cumulative sum
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                 num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
                                 use_cache=False, **TOKENS, **_SDPA)
    return _lm(transformers.OPTForCausalLM, cfg)


def _falcon() -> _Spec:  # multi-query attention, attention and MLP in parallel
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=64, use_cache=False, **TOKENS, **_SDPA)
    return _lm(transformers.FalconForCausalLM, cfg)


def _gpt_neox() -> _Spec:  # rotary on a quarter of each head, parallel residual
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, use_cache=False, **TOKENS,
                                     **_SDPA)
    return _lm(transformers.GPTNeoXForCausalLM, cfg)


def _phi() -> _Spec:  # partial rotary, parallel attention and MLP, biased LM head
    cfg = transformers.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, use_cache=False, **TOKENS, **_SDPA)
    return _lm(transformers.PhiForCausalLM, cfg)


def _gptj() -> _Spec:  # interleaved (rotate-every-two) rotary on part of each head
    cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                                  use_cache=False, **TOKENS, **_SDPA)
    return _lm(transformers.GPTJForCausalLM, cfg)


def _bloom() -> _Spec:  # ALiBi position biases, layer norm after the embedding
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, use_cache=False, **TOKENS,
                                   **_EAGER)  # no SDPA path in transformers
    return _lm(transformers.BloomForCausalLM, cfg)


def _starcoder2() -> _Spec:  # biased layer norms and linears, GELU MLP, tied head
    return _lm(transformers.Starcoder2ForCausalLM, transformers.Starcoder2Config(**_DECODER, **_SDPA))


def _mamba() -> _Spec:  # selective state space (torch's sequential scan on CPU), tied head
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                   use_cache=False, **TOKENS)
    return _lm(transformers.MambaForCausalLM, cfg)


# --- encoders ---------------------------------------------------------------------------------------------------

_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)


def _bert() -> _Spec:  # segment ids and a padded batch, classified from the pooled [CLS]
    cfg = transformers.BertConfig(**_BERT, num_labels=3, use_cache=False, **_SDPA)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, SEQ // 2:] = 1
    batch = (_ids(), types, _padding_mask(), _labels(3))
    return _Spec(transformers.BertForSequenceClassification, cfg, ("input_ids", "token_type_ids", "attention_mask"),
                 batch)


def _distilbert() -> _Spec:
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                        max_position_embeddings=64, num_labels=3, **_SDPA)
    return _Spec(transformers.DistilBertForSequenceClassification, cfg, ("input_ids", "attention_mask"),
                 (_ids(), _padding_mask(), _labels(3)))


def _deberta_v2() -> _Spec:  # DeBERTa-v3's disentangled attention: log-bucketed relative positions, shared keys
    cfg = transformers.DebertaV2Config(**_BERT, num_labels=3, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                       position_buckets=8, max_relative_positions=-1, norm_rel_ebd="layer_norm",
                                       share_att_key=True, position_biased_input=False, type_vocab_size=0)
    return _Spec(transformers.DebertaV2ForSequenceClassification, cfg, ("input_ids", "attention_mask"),
                 (_ids(), _padding_mask(), _labels(3)))


def _roberta() -> _Spec:  # masked LM head tied to the embeddings; positions offset past the pad id
    cfg = transformers.RobertaConfig(**{**_BERT, "max_position_embeddings": 66}, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, use_cache=False, **_SDPA)
    return _Spec(transformers.RobertaForMaskedLM, cfg, ("input_ids",), (_ids(), _ids(seed=3)))


def _albert() -> _Spec:  # one layer's weights shared by both layers; factorized (16 -> 32) embeddings
    cfg = transformers.AlbertConfig(**_BERT, embedding_size=16, **_SDPA)
    return _Spec(transformers.AlbertForMaskedLM, cfg, ("input_ids",), (_ids(), _ids(seed=3)))


def _modernbert() -> _Spec:  # a global layer then a local one (window 8 of 16), rotary, tied MLM head
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                                        layer_types=["full_attention", "sliding_attention"], pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, **_SDPA)
    return _Spec(transformers.ModernBertForMaskedLM, cfg, ("input_ids",), (_ids(16), _ids(16, seed=3)))


_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
           relative_attention_num_buckets=8, relative_attention_max_distance=16, use_cache=False, **TOKENS)


def _t5_encoder() -> _Spec:  # relative position bias buckets, RMS norms without mean
    return _Spec(transformers.T5EncoderModel, transformers.T5Config(**_T5, **_SDPA), ("input_ids",), (_ids(),),
                 "last_hidden_state", projection_loss)


# --- encoder-decoders -------------------------------------------------------------------------------------------

def _t5() -> _Spec:  # cross-attention, tied head rescaled by d_model ** -0.5
    dec = _ids(8, seed=4)
    return _Spec(transformers.T5ForConditionalGeneration, transformers.T5Config(**_T5, **_SDPA),
                 ("input_ids", "decoder_input_ids"), (_ids(), dec, dec.roll(-1, dims=1)))


def _bart() -> _Spec:  # learned positions offset by 2, post-norm, tied head with a final logits bias buffer
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
                                  **_SDPA)
    dec = _ids(8, seed=4)
    return _Spec(transformers.BartForConditionalGeneration, cfg, ("input_ids", "decoder_input_ids"),
                 (_ids(), dec, dec.roll(-1, dims=1)))


# --- vision -----------------------------------------------------------------------------------------------------

_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMAGE,
            patch_size=8)


def _vit() -> _Spec:  # 16 patches and [CLS]
    cfg = transformers.ViTConfig(**_VIT, num_labels=3, **_SDPA)
    return _Spec(transformers.ViTForImageClassification, cfg, ("pixel_values",), (_pixels(), _labels(3)))


def _clip_vision() -> _Spec:  # pre-norm, quick-GELU, class embedding; the pooled [CLS] after post_layernorm
    cfg = transformers.CLIPVisionConfig(**_VIT, **_SDPA)
    return _Spec(transformers.CLIPVisionModel, cfg, ("pixel_values",), (_pixels(),), "pooler_output", projection_loss)


def _siglip_vision() -> _Spec:  # no [CLS]: an attention-pooling head with a learned probe
    cfg = transformers.SiglipVisionConfig(**_VIT, **_SDPA)
    return _Spec(transformers.SiglipVisionModel, cfg, ("pixel_values",), (_pixels(),), "pooler_output", projection_loss)


def _dinov2() -> _Spec:  # layer scale, interpolated position embeddings, stochastic depth
    cfg = transformers.Dinov2Config(**_VIT, **_SDPA)
    return _Spec(transformers.Dinov2Model, cfg, ("pixel_values",), (_pixels(),), "pooler_output", projection_loss)


def _resnet() -> _Spec:  # batch norm (running statistics in eval(), updated in train()), bottleneck blocks
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    return _Spec(transformers.ResNetForImageClassification, cfg, ("pixel_values",), (_pixels(), _labels(3)))


def _convnext() -> _Spec:  # depthwise 7x7 convolutions, channels-last layer norm, layer scale
    cfg = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=3)
    return _Spec(transformers.ConvNextForImageClassification, cfg, ("pixel_values",), (_pixels(), _labels(3)))


# --- audio ------------------------------------------------------------------------------------------------------

def _whisper_encoder() -> _Spec:
    # 16 mel bins x 16 frames (2 * max_source_positions, the only length the encoder takes) -> 8 positions;
    # the sinusoidal position table is a parameter HF freezes (requires_grad=False): _build unfreezes it
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                                     encoder_ffn_dim=64, decoder_layers=1, decoder_attention_heads=4,
                                     decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=8,
                                     max_target_positions=16, classifier_proj_size=16, num_labels=3, use_cache=False,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                     **_SDPA)
    features = torch.randn(BATCH, 16, 16, generator=_gen(), dtype=torch.float64)
    return _Spec(transformers.WhisperForAudioClassification, cfg, ("input_features",), (features, _labels(3)))


def _wav2vec2() -> _Spec:
    # the default feat_extract_norm="group" (group norm on the first conv), tiny convs: 400 samples -> 39 frames;
    # a weight-normed grouped positional convolution. SpecAugment (NumPy-random masks in train()) and layerdrop
    # are off; masked_spec_embed, which only SpecAugment reads, stays a parameter (as in the checkpoints)
    cfg = transformers.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                      apply_spec_augment=False, layerdrop=0.0, **_SDPA)
    audio = torch.randn(BATCH, 400, generator=_gen(), dtype=torch.float64)
    return _Spec(transformers.Wav2Vec2Model, cfg, ("input_values",), (audio,), "last_hidden_state", projection_loss)


# --- building ---------------------------------------------------------------------------------------------------

def _build(spec: Callable[[], _Spec], p: float = 0.0) -> tuple[Call, tuple[torch.Tensor, ...], Callable]:
    """The case's model with every dropout probability set to ``p``, in float64 and eval(), its weights seeded."""
    s = spec()
    _set_dropout(s.config, p)
    with torch.random.fork_rng(devices=[]):  # the same weights every time, the caller's RNG untouched
        torch.manual_seed(0)
        model = s.model(s.config)
    module = Call(model, s.names, s.output).double().eval()
    for param in module.parameters():  # HF freezes a few (Whisper's sinusoidal positions)
        param.requires_grad_(True)
    return module, s.batch, s.loss


_CASES: dict[str, tuple[Callable[[], _Spec], bool, bool]] = {  # name: (spec, slow, dropout)
    "llama": (_llama, False, True),
    "qwen2": (_qwen2, False, True),
    "qwen3": (_qwen3, False, True),
    "mistral": (_mistral, False, True),
    "phi3": (_phi3, False, True),
    "gemma": (_gemma, False, True),
    "gemma2": (_gemma2, False, True),
    "gemma3": (_gemma3, False, True),
    "gpt2": (_gpt2, False, True),
    "opt": (_opt, False, True),
    "falcon": (_falcon, False, True),
    "gpt_neox": (_gpt_neox, False, True),
    "phi": (_phi, False, True),
    "gptj": (_gptj, False, True),
    "bloom": (_bloom, False, True),
    "starcoder2": (_starcoder2, False, True),
    "mamba": (_mamba, False, False),
    "bert": (_bert, False, True),
    "distilbert": (_distilbert, False, True),
    "deberta_v2": (_deberta_v2, False, True),
    "roberta": (_roberta, False, True),
    "albert": (_albert, False, True),
    "modernbert": (_modernbert, False, True),
    "t5_encoder": (_t5_encoder, False, True),
    "t5": (_t5, False, True),
    "bart": (_bart, False, True),
    "vit": (_vit, False, True),
    "clip_vision": (_clip_vision, False, True),
    "siglip_vision": (_siglip_vision, False, True),
    "dinov2": (_dinov2, False, True),
    "resnet": (_resnet, False, False),
    "convnext": (_convnext, False, True),
    "whisper_encoder": (_whisper_encoder, False, True),
    "wav2vec2": (_wav2vec2, False, True),
}

ZOO: tuple[ZooCase, ...] = tuple(ZooCase(name, partial(_build, spec), slow, dropout)
                                 for name, (spec, slow, dropout) in _CASES.items())


def train_mode_case(name: str) -> tuple[Any, tuple, Callable]:
    """Case ``name``'s model (the same weights) with dropout 0.1 wherever its config has one, in train() mode."""
    module, batch, loss_fn = _build(_CASES[name][0], 0.1)
    return module.train(), batch, loss_fn


# --- the check in torch alone -----------------------------------------------------------------------------------

def _steps(case: ZooCase) -> tuple[nn.Module, torch.Tensor, float]:
    """Builds the case and runs 3 forward/backward steps: the module, the last loss and the seconds taken."""
    start = time.perf_counter()
    module, batch, loss_fn = case.build()
    for _ in range(3):
        module.zero_grad(set_to_none=True)
        loss = loss_fn(module, *batch)
        assert loss.dim() == 0 and torch.isfinite(loss), f"{case.name}: loss {loss}"
        loss.backward()
    return module, loss.detach(), time.perf_counter() - start


def _buffers_changed(module: nn.Module, batch: tuple[torch.Tensor, ...], loss_fn: Callable) -> list[str]:
    """The buffers one forward changes."""
    before = {n: b.clone() for n, b in module.named_buffers()}
    with torch.no_grad():
        loss_fn(module, *batch)
    return [n.removeprefix("model.") for n, b in module.named_buffers() if not torch.equal(b, before[n])]


def _kinds(names: list[str]) -> str:
    """``names`` in brief: how many, and their last components."""
    return f"{len(names)} ({', '.join(sorted({n.rsplit('.', 1)[-1] for n in names}))})" if names else "-"


def _check(case: ZooCase) -> str:
    """Checks the case in torch; its lines of the summary (raises on a failed check)."""
    first, loss, _ = _steps(case)  # warm: transformers imports its modeling files lazily
    runs = [_steps(case) for _ in range(3)]  # the fastest of 3 timings (the machine may be shared)
    module, loss2, seconds = min(runs, key=lambda run: run[2])
    # deterministic: a second build has the same weights and loss
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), module.state_dict().values()))
    assert torch.equal(loss, loss2)
    params = dict(module.named_parameters())
    assert all(p.requires_grad and p.dtype == torch.float64 for p in params.values())
    no_grad = [n.removeprefix("model.") for n, p in params.items() if p.grad is None]
    count = sum(p.numel() for p in params.values())
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n.removeprefix("model."))
    tied = [" = ".join(ns) for ns in names.values() if len(ns) > 1]
    # build()'s module: no buffer changes in eval(); train() is deterministic (no dropout), buffers may change
    module, batch, loss_fn = case.build()
    assert not _buffers_changed(module, batch, loss_fn)
    module.train()
    changed = _buffers_changed(module, batch, loss_fn)
    with torch.no_grad():
        assert torch.equal(loss_fn(module, *batch), loss_fn(module, *batch))
    # train_mode_case: runs; random exactly where the config has dropout (up to 30 draws: stochastic depth on 2
    # samples at 0.1 keeps both 81% of the time)
    train, tbatch, tloss = train_mode_case(case.name)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), train.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(batch, tbatch))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        first_loss = tloss(train, *tbatch)
        first_loss.backward()
        assert torch.isfinite(first_loss)
        random = any(not torch.equal(first_loss, tloss(train, *tbatch)) for _ in range(30))
    assert random == case.dropout, f"{case.name}: dropout={case.dropout} but train mode random={random}"
    fields = _set_dropout(_CASES[case.name][0]().config, 0.1)
    flag = "" if (seconds > 1) == case.slow else f"  (slow={case.slow}?)"
    has_attention = any("Attention" in type(m).__name__ for m in module.modules())
    attention = getattr(module.model.config, "_attn_implementation", None) if has_attention else "-"
    return "\n    ".join([f"{case.name:16} {seconds:5.2f} s {count:6d} params  attention: {attention}{flag}",
                           f"dropout fields: {', '.join(fields) or '-'}",
                           f"no grad: {', '.join(no_grad) or '-'}",
                           f"tied: {'; '.join(tied) or '-'}",
                           f"buffers a train() forward changes: {_kinds(changed)}"])


if __name__ == "__main__":
    torch.set_num_threads(1)  # steadier timings on a shared machine
    total = time.perf_counter()
    for case in ZOO:
        print(_check(case), flush=True)
    print(f"{len(ZOO)} cases in {time.perf_counter() - total:.1f} s")

"""Generation (``rt.generate``, ``rt.decoder``) against transformers: greedy tokens equal to ``model.generate``'s
on left-padded batches for tiny Llama, Qwen2 (with sliding layers), Mistral and Phi-3 (with windows shorter
than the run) and Gemma configs, on one and on several virtual devices; each step's logits equal to the
model's own forward with its cache; sampling reproducible for a seed and equal to transformers' for the same
seed; bad requests refused with the rule."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from serving import Requests  # noqa: E402

import relational_tensors as rt  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=None)


def _config(kind: str) -> object:
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON)
    if kind == "qwen2-sliding":  # layer 1 slides over 4 positions
        return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=4)
    if kind == "gemma":
        return transformers.GemmaConfig(**COMMON, head_dim=8)
    if kind == "phi3":
        return transformers.Phi3Config(**COMMON, sliding_window=5)
    raise ValueError(kind)


def _model(kind: str, dtype: torch.dtype = torch.float32) -> object:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(kind)).eval().to(dtype)


def _batch(b: int = 3, s: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left: row 1 by 2 tokens, row 2 by 5."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (b, s), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 2), (2, 5)):
        if row < b:
            mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("kind,device", [("llama", "cpu:2"), ("qwen2-sliding", "cpu:3"), ("mistral", "cpu"),
                                         ("gemma", "cpu:2"), ("phi3", "cpu:2")])
def test_greedy_tokens_equal_transformers(kind: str, device: str) -> None:
    model = _model(kind)
    ids, mask = _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = rt.generate(model, ids, mask, max_new_tokens=12, device=device)
    assert got.dtype == want.dtype and torch.equal(got, want)


MORE = {  # more families: eager attention with softcapping and windows (Gemma 2), mixed layers (Gemma 3), ...
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "stablelm": ("StableLmConfig", {}),
    "phi": ("PhiConfig", {}),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=4)),
    "smollm3": ("SmolLM3Config", {}),
}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "gemma2" else pytest.mark.slow) for k in MORE])
def test_greedy_tokens_of_more_families_equal_transformers(kind: str) -> None:
    name, extra = MORE[kind]
    if not hasattr(transformers, name):
        pytest.skip(f"this transformers has no {name}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**COMMON, **extra)).eval()
    ids, mask = _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(rt.generate(model, ids, mask, max_new_tokens=10, device="cpu:2"), want)


def test_each_step_logits_equal_the_models_forward() -> None:
    """Prefill and every decode step against the model's forward with its own cache, float32 to 1e-5."""
    model = _model("qwen2-sliding")
    ids, mask = _batch()
    dec = rt.decoder(model, max_batch=3, max_len=40, device="cpu:2")
    logits = dec.prefill(ids, mask)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        torch.testing.assert_close(logits, out.logits[:, -1], rtol=1e-5, atol=1e-5)
        full_mask = mask
        for _ in range(9):
            token = out.logits[:, -1].argmax(-1)
            full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], 1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token[:, None], attention_mask=full_mask, position_ids=positions,
                        past_key_values=cache)
            logits = dec.decode(token)
            torch.testing.assert_close(logits, out.logits[:, -1], rtol=1e-5, atol=1e-5)
    assert len(dec._prefills) == 1 and dec._decode is not None
    text = dec.explain()
    assert "prefill" in text and "decode step" in text


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_prefill_attends_causally_with_key_padding_not_through_a_dense_mask(kind: str) -> None:
    """The prompt's mask (its real tokens, the causal triangle, a window) reaches attention as the operator's
    own structure: the kernels skip the blocked tiles, and no [prompt, prompt] mask is made or read."""
    dec = rt.decoder(_model(kind), max_batch=3, max_len=32, device="cpu:2")
    ids, mask = _batch()
    dec.prefill(ids, mask)
    graph = dec.prefill_program(3, 16).graph
    attention = [n for n in graph.operators if n.kind == "attention"]
    assert attention and all(n.op.causal and n.op.extras == ("key_padding",) for n in attention)
    if kind == "mistral":
        assert all(n.op.window == 4 for n in attention)
    assert not [n for n in graph.inputs if n.type.shape[-2:] == (16, 16)]  # no constant triangle either


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_prefill_and_decode_rotate_by_the_position_tables_in_one_operator_each(kind: str) -> None:
    """The rotary tables of a step's position ids are computed once; each layer rotates q and k with one
    ``rope_table`` each (not the dozen slices, negations, concatenations and products of rotate-half)."""
    dec = rt.decoder(_model(kind), max_batch=3, max_len=32, device="cpu:2")
    ids, mask = _batch()
    dec.decode(dec.prefill(ids, mask).argmax(-1))
    layers = _config(kind).num_hidden_layers
    for graph in (dec.prefill_program(3, 16).graph, dec.decode_program().graph):
        kinds = [n.kind for n in graph.operators]
        assert kinds.count("rope_table") == 2 * layers and "rope" not in kinds
        assert kinds.count("concat") <= 1 + (layers if kind == "phi3" else 0)  # the tables' [freqs, freqs]


def test_one_catalog_holds_the_prefill_and_the_decode_plans(tmp_path: object) -> None:
    model = _model("llama")
    dec = rt.decoder(model, max_batch=2, max_len=48, device="cpu:2", catalog=str(tmp_path) + "/gen.duckdb")
    dec.decode(dec.prefill(_batch(2)[0]).argmax(-1))
    labels = dec.decode_program().compiled.sql("SELECT label FROM compilations ORDER BY compilation_id")
    assert labels["label"].to_pylist() == ["prefill 2x16", "decode 2x48"]


def test_the_prefill_and_decode_programs_read_one_copy_of_the_weights() -> None:
    """Both programs read the decoder's one copy of each weight in place (``compileGraph``'s ``bind``), a copy
    taken when the first program was made: a later change to the model does not reach them."""
    model = _model("llama")
    dec = rt.decoder(model, max_batch=2, max_len=48, device="cpu:2")
    first = dec.prefill(_batch(2)[0])
    dec.decode(first.argmax(-1))
    for program in (dec.prefill_program(2, 16), dec.decode_program()):  # traced without host copies of them
        assert not set(program.graph.parameters) & set(program.graph.origins)
        assert set(program.compiled._bind) == set(program.graph.origins)
    pre, step = dec.prefill_program(2, 16).compiled, dec.decode_program().compiled
    shared = set(pre._bind) & set(step._bind)
    assert len(shared) >= 2 * 7  # every layer's projections at least
    for name in shared:
        assert pre._bind[name] is step._bind[name]
        for ex in (pre.executor, step.executor):
            for _, b in ex.dag.inputs[name]:
                assert np.shares_memory(ex._get(b), pre._bind[name])
    # another decoder of the unchanged model reads the same copy; once the model changes, a new one copies it
    other = rt.decoder(model, max_batch=2, max_len=64, device="cpu:3")
    other.prefill(_batch(2)[0])
    assert all(other._weights[k] is w for k, w in dec._weights.items() if k in other._weights)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    again = dec.prefill(_batch(2)[0])
    assert torch.equal(again, first)
    fresh = rt.decoder(model, max_batch=2, max_len=48, device="cpu:2")
    changed = fresh.prefill(_batch(2)[0])
    assert not torch.equal(changed, first)
    torch.testing.assert_close(changed, model(_batch(2)[0]).logits[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu:1", "cpu:3"])
def test_a_decode_step_writes_one_row_of_each_cache_in_place(device: str) -> None:
    """Each layer's cache is a pool of rows that the step's ``put_rows`` writes in the state's own block (one
    row per sequence, no pass over the whole cache, no copy of it after the step)."""
    model = _model("llama")
    dec = rt.decoder(model, max_batch=2, max_len=48, device=device)
    dec.decode(dec.prefill(_batch(2)[0]).argmax(-1))
    cg = dec.decode_program().compiled
    assert "where" not in {n.kind for n in cg.graph.operators}
    kept = {b for name in cg.dag.inputs if name.startswith("cache.") for _, b in cg.dag.inputs[name]}
    puts = [t for t in cg.dag.tasks if t.kind == "kernel" and cg.graph.nodes[t.op].kind == "put_rows"]
    assert len({t.op for t in puts}) == 2 * 2  # keys and values of each layer
    assert all(cg.dag.root(t.outputs[0]) in kept for t in puts)
    assert not [t for t in cg.dag.tasks if t.kind == "assign"]


def test_prompt_lengths_share_a_bucket_and_a_new_batch_restarts() -> None:
    """Two prompt lengths in one bucket reuse one prefill program; a second prefill starts afresh (the cache
    of the first batch is not read)."""
    model = _model("llama")
    dec = rt.decoder(model, max_batch=2, max_len=64)
    for s in (5, 9):
        ids, mask = _batch(2, s, seed=s)
        first = dec.prefill(ids, mask)
        steps = [first.argmax(-1)]
        for _ in range(4):
            steps.append(dec.decode(steps[-1]).argmax(-1))
        want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(torch.stack(steps, 1), want[:, s:])
    assert list(dec._prefills) == [(2, 16)]


def test_prefill_programs_past_max_prefills_are_dropped_least_recent_first() -> None:
    """Each prompt bucket has a prefill program holding its activations' memory; past ``max_prefills`` the
    least recently used goes, and one needed again is planned again, with the same tokens."""
    model = _model("llama")
    dec = rt.decoder(model, max_batch=2, max_len=96, max_prefills=2)
    got = {}
    for s in (5, 20, 40, 6):  # buckets 16, 32, 48, then 16 again
        ids, mask = _batch(2, s, seed=s)
        got[s] = dec.prefill(ids, mask)
        assert len(dec._prefills) <= 2
    assert list(dec._prefills) == [(2, 48), (2, 16)]
    ids, mask = _batch(2, 5, seed=5)
    assert torch.equal(dec.prefill(ids, mask), got[5])
    with pytest.raises(rt.GraphError, match="max_prefills"):
        rt.decoder(model, max_prefills=0)


def test_sequences_joining_and_leaving_get_the_tokens_they_get_alone() -> None:
    """Continuous batching: three requests through two slots, joining and leaving between steps, each gets
    the greedy tokens it gets alone (and transformers gives it alone)."""
    model = _model("mistral")  # a window of 4: each slot's window follows its own positions
    gen = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(1, 64, (1, s), generator=gen) for name, s in (("a", 5), ("b", 9), ("c", 3))}
    wanted = {"a": 6, "b": 9, "c": 7}
    alone = {name: model.generate(p, max_new_tokens=wanted[name], do_sample=False, pad_token_id=0)[0, p.shape[1]:]
             for name, p in prompts.items()}
    dec = rt.decoder(model, max_batch=2, max_len=40, device="cpu:2")
    requests = Requests(dec, prompts, wanted)
    requests.join("a")
    requests.step()
    requests.join("b")  # a is two tokens in; b joins the free slot
    while "a" in requests.slot_of:
        requests.step()
    requests.join("c")  # c takes the slot a left
    assert requests.slot_of["c"] == 0
    while requests.slot_of:
        requests.step()
    for name in prompts:
        assert requests.got[name] == alone[name].tolist(), name
    assert list(dec._prefills) == [(1, 16)]  # one prompt bucket: one prefill program for all three


def test_a_plain_tensor_attribute_the_model_reads_is_a_weight_too() -> None:
    """A submodule's tensor that is neither a parameter nor a buffer is traced as a constant; the decoder reads
    it from the module by its attribute path, as it reads the parameters."""
    model = _model("llama")

    class Scaled(torch.nn.Module):
        def __init__(self, inner: object) -> None:
            super().__init__()
            self.inner, self.scale = inner, torch.linspace(0.5, 1.5, 32)  # a plain attribute

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * self.scale

    model.model.norm = Scaled(model.model.norm)
    ids, mask = _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(rt.generate(model, ids, mask, max_new_tokens=4, device="cpu:2"), want)


def test_a_decoder_for_gpus_plans_where_there_are_none() -> None:
    """Planning (and simulating) a decoder for GPUs needs no GPU: its weights are read only to run."""
    if torch.cuda.is_available():
        pytest.skip("a machine without GPUs")
    dec = rt.decoder(_model("llama"), max_batch=2, max_len=48, device="cuda:0,1")
    step = dec.decode_program()
    assert step.compiled.simulate() > 0 and not step.compiled._bind


def test_a_decoder_over_several_gpus_loads_each_program_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a plan spans several GPUs nothing is bound (each GPU loads its blocks from the module's tensors);
    run here on virtual devices with the decoder told it plans for two GPUs."""
    from relational_tensors.api import generation
    from relational_tensors.machine.devices import DeviceSet

    monkeypatch.setattr(generation, "parse_devices", lambda device: DeviceSet("cuda", (0, 1)))
    model = _model("llama")
    ids, mask = _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    dec = rt.decoder(model, max_batch=3, max_len=48, device="cpu:2")
    steps = [dec.prefill(ids, mask).argmax(-1)]
    for _ in range(3):
        steps.append(dec.decode(steps[-1]).argmax(-1))
    assert torch.equal(torch.stack(steps, 1), want[:, ids.shape[1]:])
    for program in (dec.prefill_program(3, 16), dec.decode_program()):
        assert not program.compiled._bind and not program.parameters  # loaded, and let go
        assert not set(program.graph.parameters) & set(program.graph.origins)


def test_generate_keeps_its_most_recent_decoders_per_model() -> None:
    from relational_tensors.api import generation

    model = _model("llama")
    for b in (1, 2, 3):
        rt.generate(model, _batch(b)[0], max_new_tokens=2, device="cpu:2")
    held = generation._DECODERS[model]
    assert len(held) == generation.KEPT_DECODERS and [k[2] for k in held] == [2, 3]


def test_generate_lets_a_deleted_model_go() -> None:
    """rt.generate's cached decoders hold their model weakly: deleting the model frees it, its programs and its
    weight copies (a decoder the user makes holds its model)."""
    import gc
    import weakref

    model = _model("llama")
    gone = weakref.ref(model)
    rt.generate(model, _batch(1)[0], max_new_tokens=2, device="cpu:2")
    kept = rt.decoder(_model("llama"), max_batch=1, max_len=32)
    del model
    gc.collect()
    assert gone() is None
    assert kept.prefill(_batch(1)[0]).shape == (1, 64)  # (its model is alive: it holds it)


def test_eos_pads_finished_sequences_and_stops() -> None:
    model = _model("llama")
    ids, mask = _batch()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eos = int(free[0, 7 + 2])  # the third token row 0 generates
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=eos)
    got = rt.generate(model, ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)


def test_sampling_is_seeded_and_equals_transformers() -> None:
    model = _model("gemma")
    ids, mask = _batch()
    kwargs = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    a = rt.generate(model, ids, mask, seed=7, **kwargs)
    b = rt.generate(model, ids, mask, seed=7, **kwargs)
    c = rt.generate(model, ids, mask, seed=8, **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # without a seed, torch's global generator draws, as transformers' sampling does
    torch.manual_seed(3)
    want = model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    torch.manual_seed(3)
    got = rt.generate(model, ids, mask, **kwargs)
    assert torch.equal(got, want)


def test_bfloat16_logits_match_at_16_bit_tolerance() -> None:
    """bf16 weights and cache: the prefill's and steps' logits against the model's within bf16 rounding
    (a few units of 2**-8 relative over two layers)."""
    model = _model("llama", torch.bfloat16)
    ids, mask = _batch()
    dec = rt.decoder(model, max_batch=3, max_len=32, device="cpu:2")
    logits = dec.prefill(ids, mask)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), want.float(), rtol=0.05, atol=0.05)


def test_bad_requests_are_refused_with_the_rule() -> None:
    model = _model("llama")
    ids, mask = _batch()
    right = torch.ones_like(mask)
    right[0, -2:] = 0
    with pytest.raises(rt.GraphError, match="padded on the left"):
        rt.generate(model, ids, right)
    with pytest.raises(rt.GraphError, match="at least one real token"):
        rt.generate(model, ids, torch.zeros_like(mask))
    with pytest.raises(rt.GraphError, match="max_new_tokens"):
        rt.generate(model, ids, mask, max_new_tokens=0)
    with pytest.raises(rt.GraphError, match="temperature"):
        rt.generate(model, ids, mask, do_sample=True, temperature=0.0)
    with pytest.raises(rt.GraphError, match="top_p"):
        rt.generate(model, ids, mask, do_sample=True, top_p=1.5)
    with pytest.raises(rt.GraphError, match="integer torch tensor"):
        rt.generate(model, ids.float(), mask)
    with pytest.raises(rt.GraphError, match="causal language model"):
        rt.generate(torch.nn.Linear(2, 2), ids)
    dec = rt.decoder(model, max_batch=2, max_len=16)
    with pytest.raises(rt.ExecError, match="max_batch=2"):
        dec.prefill(ids, mask)
    with pytest.raises(rt.ExecError, match="none is running"):
        dec.decode(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(rt.ExecError, match="max_len=16"):
        dec.prefill(torch.ones((1, 16), dtype=torch.int64))
    dec.prefill(torch.ones((1, 15), dtype=torch.int64))
    with pytest.raises(rt.ExecError, match="one token per running sequence"):
        dec.decode(torch.zeros(3, dtype=torch.int64))
    dec.decode(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(rt.ExecError, match="all used by slot"):
        dec.decode(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(rt.ExecError, match="leave takes slots"):
        dec.leave(1)
    dec.leave(0)
    with pytest.raises(rt.ExecError, match="slots with 0 free|free"):
        dec.join(torch.ones((3, 4), dtype=torch.int64))


def _graph_lm_and_its_transformers_twin() -> tuple[object, object]:
    """A graph-API CausalLM with random weights, and transformers' Llama holding the same weights."""
    import numpy as np

    from relational_tensors.graph.models import CausalLM

    shape = dict(vocab=64, d_model=32, layers=2, n_heads=4, n_kv_heads=2, d_ff=48, rope_base=10000.0)
    rng = np.random.default_rng(0)
    weights = {n: (rng.standard_normal(s) * (0.3 if len(s) == 2 else 0.1) + (len(s) == 1)).astype(np.float32)
               for n, s in CausalLM(**shape).parameter_shapes().items()}
    lm = CausalLM(**shape, weights=weights)
    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**COMMON, "intermediate_size": 48}, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None)).eval()
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "wq",
             "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo", "mlp.gate_proj": "w1",
             "mlp.up_proj": "w3", "mlp.down_proj": "w2"}
    state = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"],
             "lm_head.weight": weights["lm_head"].T}
    for i in range(2):
        for theirs, ours in names.items():
            w = weights[f"l{i}.{ours}"]
            state[f"model.layers.{i}.{theirs}.weight"] = w if w.ndim == 1 else w.T
    twin.load_state_dict({k: torch.tensor(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    return lm, twin


def test_a_graph_api_model_generates_what_its_transformers_twin_does() -> None:
    lm, twin = _graph_lm_and_its_transformers_twin()
    ids, mask = _batch()
    want = twin.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = rt.generate(lm, ids, mask, max_new_tokens=12, pad_token_id=0, device="cpu:3")
    assert torch.equal(got, want)
    from relational_tensors.graph.models import CausalLM

    with pytest.raises(rt.GraphError, match="no weights"):
        rt.generate(CausalLM(vocab=64, d_model=32, layers=1, n_heads=4, n_kv_heads=2, d_ff=48), ids)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0"])
def test_greedy_on_a_gpu(device: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("cupy")
    model = _model("qwen2-sliding").to("cuda:0")
    ids, mask = _batch()
    ids, mask = ids.cuda(), mask.cuda()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = rt.generate(model, ids, mask, max_new_tokens=12, device=device)
    assert got.device == want.device and torch.equal(got, want)
    bf = _model("llama", torch.bfloat16).to("cuda:0")
    dec = rt.decoder(bf, max_batch=3, max_len=48, device=device)
    logits = dec.prefill(ids, mask)
    assert logits.is_cuda and logits.dtype == torch.bfloat16
    bound = dec.prefill_program(*next(iter(dec._prefills))).compiled.executor.bound
    assert bound  # the weights' blocks read in place from the decoder's copy
    dec.decode(logits.argmax(-1))  # a join after a step reads the bf16 cache states back to write its prompt
    assert dec.decode_program().state("cache.0.k").dtype == torch.bfloat16
    dec.leave(0)
    (slot,), again = dec.join(ids[:1], mask[:1])
    assert slot == 0
    torch.testing.assert_close(again.float(), logits[:1].float(), rtol=0.02, atol=0.02)
    with torch.no_grad():
        ref = bf(input_ids=ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(logits.float(), ref.float(), rtol=0.05, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [None, 4])
def test_steps_queued_without_the_host_waiting_join_and_leave_on_a_gpu(block_size: int | None) -> None:
    """Continuous batching as a server on a GPU runs it: each step's tokens stay on the device (argmax of the
    last logits, never read back until the end), so the host queues steps, joins and leaves ahead of the GPU;
    every request still gets the greedy tokens it gets alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("cupy")
    model = _model("mistral").to("cuda:0")
    gen = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(1, 64, (1, s), generator=gen).cuda() for name, s in (("a", 5), ("b", 9), ("c", 3))}
    wanted = {"a": 6, "b": 9, "c": 7}
    alone = {name: model.generate(p, max_new_tokens=wanted[name], do_sample=False, pad_token_id=0)[0, p.shape[1]:]
             for name, p in prompts.items()}
    dec = rt.decoder(model, max_batch=2, max_len=40, device="cuda:0", block_size=block_size)
    got: dict[str, list[torch.Tensor]] = {}
    slot_of: dict[str, int] = {}

    def join(name: str) -> None:
        (slot,), logits = dec.join(prompts[name])
        slot_of[name], got[name] = slot, [logits[0].argmax(-1)]

    def step() -> None:
        running = {slot: n for n, slot in slot_of.items()}
        order = [running[r] for r in dec.slots]
        logits = dec.decode(torch.stack([got[n][-1] for n in order]))
        for n, row in zip(order, logits):
            got[n].append(row.argmax(-1))
        for n in order:
            if len(got[n]) == wanted[n]:
                dec.leave(slot_of.pop(n))

    join("a")
    step()
    join("b")
    while "a" in slot_of:
        step()
    join("c")
    while slot_of:
        step()
    for name in prompts:
        assert torch.stack(got[name]).tolist() == alone[name].tolist(), name

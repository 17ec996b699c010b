"""The paged key/value cache: a decoder whose cache is one pool of blocks per layer that the slots share
(``block_size``, ``num_blocks``).  Greedy tokens equal transformers' and the unpaged decoder's; sequences
that join and leave through a pool too small for every slot's whole length reuse the blocks the others gave
back and get the tokens they get alone; a step that finds no free block, and bad sizes, are refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from serving import Requests  # noqa: E402

import relational_tensors as rt  # noqa: E402
from relational_tensors.errors import ExecError, GraphError  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _model(kind: str = "llama") -> object:
    torch.manual_seed(0)
    config = (transformers.MistralConfig(**COMMON, sliding_window=4) if kind == "mistral"
              else transformers.LlamaConfig(**COMMON))
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize(("kind", "device", "block_size"),
                         [("llama", "cpu:2", 4), pytest.param("mistral", "cpu:3", 5, marks=pytest.mark.slow)])
def test_paged_greedy_tokens_equal_transformers(kind: str, device: str, block_size: int) -> None:
    """Blocks that do not divide the prompt bucket or the cache; a sliding window over paged positions."""
    model = _model(kind)
    ids, mask = _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = rt.generate(model, ids, mask, max_new_tokens=12, pad_token_id=0, device=device, block_size=block_size)
    assert torch.equal(got, want)


def test_the_decode_step_reads_the_pool_through_the_rows_table() -> None:
    model = _model()
    dec = rt.decoder(model, max_batch=2, max_len=32, device="cpu:2", block_size=8)
    dec.prefill(_batch()[0][:2])
    g = dec.decode_program().graph
    assert {"rows", "write_rows"} <= set(g.input_names)
    assert g.node("cache.0.k").type.shape[0] == dec.pool_rows == dec.num_blocks * 8
    assert dec.num_blocks == 2 * 4 + 1  # every slot's whole max_len, and the scratch block


def test_joining_and_leaving_reuse_blocks_in_a_small_pool() -> None:
    """Three requests through two slots and a pool of 6 blocks of 4 (two slots of 40 positions would need
    20): blocks taken as sequences grow, given back as they leave, taken again by the next; each sequence
    gets the greedy tokens it gets alone."""
    model = _model("mistral")
    gen = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(1, 64, (1, s), generator=gen) for name, s in (("a", 5), ("b", 3), ("c", 3))}
    wanted = {"a": 4, "b": 5, "c": 6}
    alone = {name: model.generate(p, max_new_tokens=wanted[name], do_sample=False, pad_token_id=0)[0, p.shape[1]:]
             for name, p in prompts.items()}
    dec = rt.decoder(model, max_batch=2, max_len=40, device="cpu:2", block_size=4, num_blocks=11)
    requests, held = Requests(dec, prompts, wanted), []

    def step() -> None:
        requests.step()
        held.append(dec.num_blocks - 1 - len(dec._free))

    requests.join("a")  # a 16-position prompt bucket: 4 blocks
    step()
    requests.join("b")  # 4 more: 8 of the 10 usable blocks
    while "a" in requests.slot_of:
        step()
    assert len(dec._free) >= 4  # a gave its blocks back
    requests.join("c")
    while requests.slot_of:
        step()
    for name in prompts:
        assert requests.got[name] == alone[name].tolist(), name
    assert max(held) <= 10 and len(dec._free) == 10  # every block back in the pool
    assert dec._decode is not None and len(dec._prefills) == 1  # no program planned again


def test_a_full_pool_and_bad_sizes_are_refused() -> None:
    model = _model()
    dec = rt.decoder(model, max_batch=2, max_len=64, device="cpu", block_size=8, num_blocks=3)
    dec.join(torch.randint(1, 64, (1, 5)))  # 16 positions: both usable blocks
    with pytest.raises(ExecError, match="num_blocks=3"):
        dec.join(torch.randint(1, 64, (1, 5)))
    with pytest.raises(GraphError, match="give block_size too"):
        rt.decoder(model, max_batch=2, max_len=64, num_blocks=4)
    with pytest.raises(GraphError, match="block_size is a positive int"):
        rt.decoder(model, max_batch=2, max_len=64, block_size=0)
    with pytest.raises(GraphError, match="scratch block"):
        rt.decoder(model, max_batch=2, max_len=64, block_size=8, num_blocks=1)


def test_a_sequence_that_outgrows_the_pool_is_refused_and_others_go_on() -> None:
    model = _model()
    dec = rt.decoder(model, max_batch=1, max_len=64, device="cpu", block_size=16, num_blocks=2)
    (slot,), logits = dec.join(torch.randint(1, 64, (1, 5)))  # one block: positions 0..15
    token = logits.argmax(-1)
    steps = 0
    with pytest.raises(ExecError, match="need a new cache block"):
        while True:
            token = dec.decode(token).argmax(-1)
            steps += 1
    assert steps == 0  # the bucket of 16 filled the block: the first step needs another
    dec.leave(slot)
    dec.join(torch.randint(1, 64, (1, 3)))  # its block came back


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0"])
def test_paged_greedy_on_a_gpu(device: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("cupy")
    model = _model("mistral").to("cuda:0")
    ids, mask = (t.cuda() for t in _batch())
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = rt.generate(model, ids, mask, max_new_tokens=12, pad_token_id=0, device=device, block_size=4)
    assert got.device == want.device and torch.equal(got, want)

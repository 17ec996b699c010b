"""PyTorch modules through ``from_torch`` and ``parallelize``: every translation rule and recognized
pattern against the module's own output, the transformers LLaMA decoder layer and GPT-2 block end to
end on virtual CPU devices, and every unsupported path's message (operation, source line, supported set)."""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch: pip install 'relational_tensors[torch]'")
nn = torch.nn
F = torch.nn.functional

import relational_tensors as rt  # noqa: E402
from relational_tensors.api.parallelize import ParallelModule, parallelize  # noqa: E402
from relational_tensors.frontend.torch import SUPPORTED_OPS, TorchGraph, from_torch  # noqa: E402

ATOL = 1e-4


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def transformers_or_skip() -> Any:
    return pytest.importorskip("transformers", reason="the transformers tests need pip install transformers")


def assert_matches(module: nn.Module, inputs: tuple[Any, ...], device: str = "cpu:2", atol: float = ATOL,
                   calls: int = 1) -> ParallelModule:
    """parallelize(module) equals module on ``inputs`` (and on ``calls - 1`` perturbed float inputs)."""
    module = module.eval()
    fast = parallelize(module, inputs, device=device)
    for n in range(calls):
        xs = tuple(x * (1 + 0.5 * n) if x.is_floating_point() else x for x in inputs)
        with torch.no_grad():
            want = module(*xs)
        got = fast(*xs)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    # the single-device NumPy reference of the traced graph agrees as well
    single = rt.reference(fast.graph, fast.graph.feeds(*inputs))
    with torch.no_grad():
        leaves = torch.utils._pytree.tree_leaves(module(*inputs))
    for (kind, name), want_leaf in zip(fast.graph.output_leaves, leaves):
        if kind == "saved":
            np.testing.assert_allclose(single[name].astype(np.float64), want_leaf.double().numpy(), atol=atol,
                                       rtol=atol)
    return fast


def kinds(g: rt.Graph) -> list[str]:
    return [n.kind for n in g.operators]


def line_of(fn: Callable[..., Any], text: str) -> int:
    """The line number in this file of the line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(k for k, line in enumerate(lines) if text in line)


def check_message(err: pytest.ExceptionInfo, op: str, fn: Callable[..., Any], code: str, reason: str) -> None:
    """The message names the operation, the module's source line (file, number, code) and the supported set."""
    msg = str(err.value)
    assert op in msg, msg
    assert f"{__file__}:{line_of(fn, code)}" in msg, msg
    assert code in msg, msg
    assert re.search(reason, msg), msg
    assert "Supported operations: " + ", ".join(SUPPORTED_OPS) in msg, msg
    for must in ("linear", "scaled_dot_product_attention", "layer_norm", "rms_norm", "embedding", "softmax"):
        assert must in SUPPORTED_OPS


# --- transformers blocks ------------------------------------------------------------------------------------

def llama_config(**extra: Any) -> Any:
    transformers = transformers_or_skip()
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=8,
                                    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                                    attn_implementation=extra.pop("attn_implementation", "sdpa"), **extra)


class LlamaWithRotary(nn.Module):
    """A LlamaDecoderLayer with the model's rotary embedding, as LlamaModel calls it."""

    def __init__(self, config: Any, mask: bool = False) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.mask = mask

    def forward(self, x: Any) -> Any:
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        mask = None
        if self.mask:  # the eager path's additive causal mask
            s = x.shape[1]
            mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        return self.layer(x, attention_mask=mask, position_embeddings=self.rotary(x, positions))


def test_llama_decoder_layer_matches_on_4_devices() -> None:
    config = llama_config()
    block = LlamaWithRotary(config).eval()
    x = torch.randn(2, 256, 64)
    fast = assert_matches(block, (x,), device="cpu:4", calls=2)
    g = fast.graph
    assert isinstance(g, TorchGraph) and fast.compiled.p == 4
    # the layer is recognized into the operators of rt.models.llama_block
    assert sorted(set(kinds(g))) == ["attention", "binary", "matmul", "reshape", "rmsnorm", "rope", "swiglu"]
    assert kinds(g).count("rmsnorm") == 2 and kinds(g).count("rope") == 2 and kinds(g).count("matmul") == 7
    att = next(n for n in g.operators if n.kind == "attention")
    assert att.op.causal and [g.nodes[i].type.shape[2] for i in att.inputs] == [8, 2, 2]  # GQA kept
    rope = next(n for n in g.operators if n.kind == "rope")
    assert rope.op.base == pytest.approx(config.rope_parameters["rope_theta"], rel=1e-3)
    assert g.folded == () and set(g.parameters) == {n.name for n in g.inputs if n.role == "parameter"}
    assert g.parameters["layer.self_attn.q_proj.weight"].shape == (64, 64)
    np.testing.assert_array_equal(g.parameters["layer.self_attn.k_proj.weight"],
                                  block.layer.self_attn.k_proj.weight.detach().numpy().T)
    assert "layer.self_attn" in g.source[att.name] and "modeling_llama.py" in g.source[att.name]


def test_llama_with_cos_sin_as_inputs_rotates_by_them() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = llama_config()

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = LlamaDecoderLayer(config, layer_idx=0)

        def forward(self, x: Any, cos: Any, sin: Any) -> Any:
            return self.layer(x, position_embeddings=(cos, sin))

    x = torch.randn(1, 128, 64)
    angles = torch.rand(1, 128, 4) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    fast = assert_matches(Layer(), (x, cos, sin), device="cpu:4")
    assert "rope" not in kinds(fast.graph) and fast.graph.input_names == ("x", "cos", "sin")
    # q's and k's rotations by the given tables: one operator each, reading the tables as given
    assert kinds(fast.graph).count("rope_table") == 2 and not {"slice", "concat"} & set(kinds(fast.graph))


def test_llama_with_scaled_rope_tables_keeps_them_as_constants() -> None:
    config = llama_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    fast = assert_matches(LlamaWithRotary(config), (torch.randn(1, 128, 64),), device="cpu:4")
    assert "rope" not in kinds(fast.graph) and len(fast.graph.folded) == 2  # the cos and sin tables
    assert kinds(fast.graph).count("rope_table") == 2
    for name in fast.graph.folded:
        assert fast.graph.parameters[name].shape == (1, 1, 128, 8)


def test_llama_eager_attention_with_a_causal_mask() -> None:
    """transformers' eager attention (scores, + mask, softmax in float32, · v) becomes one attention
    operator: its float causal mask read as causality, its scores never materialized."""
    config = llama_config(attn_implementation="eager")
    fast = assert_matches(LlamaWithRotary(config, mask=True), (torch.randn(1, 64, 64),), device="cpu:4")
    assert "attention" in kinds(fast.graph) and "softmax" not in kinds(fast.graph)
    att = next(n for n in fast.graph.operators if n.kind == "attention")
    assert att.op.causal is True and not att.op.extras and att.op.softcap is None


def test_gpt2_block_matches_on_4_devices() -> None:
    transformers = transformers_or_skip()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=512,
                                     attn_implementation="sdpa")
    block = GPT2Block(config, layer_idx=0).eval()
    fast = assert_matches(block, (torch.randn(2, 256, 64),), device="cpu:4", calls=2)
    g = fast.graph
    assert kinds(g).count("layernorm") == 2 and kinds(g).count("attention") == 1
    assert kinds(g).count("matmul") == 4 and kinds(g).count("unary") == 1  # gelu_new recognized
    gelu = next(n for n in g.operators if n.kind == "unary")
    assert gelu.op.op == "gelu_tanh"
    att = next(n for n in g.operators if n.kind == "attention")
    assert att.op.causal and att.op.softmax_scale == pytest.approx(0.25)
    # Conv1D keeps its [in, out] weight as it is
    np.testing.assert_array_equal(g.parameters["attn.c_attn.weight"], block.attn.c_attn.weight.detach().numpy())


def test_parallel_module_exposes_graph_plan_and_explain(capsys: pytest.CaptureFixture[str]) -> None:
    fast = parallelize(nn.Linear(16, 8).eval(), (torch.randn(4, 16),), device="cpu:2")
    assert isinstance(fast.graph, rt.Graph) and isinstance(fast.compiled, rt.CompiledGraph)
    text = fast.explain()
    assert "linear:matmul" in text and "linear:matmul" in capsys.readouterr().out
    assert fast.compiled.sql("SELECT count(*) AS n FROM plan").column("n")[0].as_py() == 2
    assert "2 operators on cpu:2" in repr(fast)
    x = torch.randn(5, 16)  # a new shape is traced and planned once, then kept
    torch.testing.assert_close(fast(x), fast.module(x))
    assert fast.cache_info().misses == 2
    static = parallelize(nn.Linear(16, 8).eval(), (torch.randn(4, 16),), device="cpu:2", recompile=False)
    with pytest.raises(rt.ExecError, match=r"input 0 must have the traced shape \(4, 16\) and dtype float32; "
                                           r"got \(5, 16\) float32"):
        static(torch.randn(5, 16))
    with pytest.raises(rt.ExecError, match="traced with 1 inputs; got 2"):
        static(torch.randn(4, 16), torch.randn(4, 16))


def test_outputs_keep_the_module_structure() -> None:
    class Many(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4.0))

        def forward(self, x: Any) -> Any:
            return x * 2, (x.relu(), 3), self.table

    fast = parallelize(Many().eval(), (torch.randn(4, 8),), device="cpu:2")
    x = torch.randn(4, 8)
    a, (b, three), table = fast(x)
    torch.testing.assert_close(a, x * 2)
    torch.testing.assert_close(b, x.relu())
    assert three == 3 and torch.equal(table, torch.arange(4.0))
    assert fast.graph.output_names == ("output_0", "output_1")


def test_importable_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import relational_tensors.frontend.torch as t, relational_tensors.api.parallelize as p\n"
            "try:\n    t.from_torch(object(), ())\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("GraphError from_torch and parallelize need PyTorch")


# --- hand-written modules: one per rule or pattern ------------------------------------------------------------

class Lambda(nn.Module):
    def __init__(self, fn: Callable[..., Any], **params: Any) -> None:
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            if isinstance(v, nn.Module):
                self.add_module(k, v)
            elif isinstance(v, nn.Parameter):
                self.register_parameter(k, v)
            else:
                self.register_buffer(k, v)

    def forward(self, *xs: Any) -> Any:
        return self.fn(self, *xs)


def rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q: Any, base: float = 10000.0, offset: int = 0, heads_first: bool = True) -> Any:
    d, s = q.shape[-1], q.shape[2 if heads_first else 1]
    inv = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(s).float() + offset, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if not heads_first:
        cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rotate_half(q) * sin


def x3(*shape: int) -> Any:
    return torch.randn(*shape)


def hand_rms(m: Any, x: Any) -> Any:
    var = x.pow(2).mean(-1, keepdim=True)
    return m.w * (x * torch.rsqrt(var + 1e-6))


def hand_layernorm(m: Any, x: Any) -> Any:
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return (x - mu) / torch.sqrt(var + 1e-5) * m.w + m.b


def causal_bool(s: int) -> Any:
    return torch.ones(s, s, dtype=torch.bool).tril()


def packed_mask(ends: tuple[int, ...], causal: bool) -> Any:
    seg = torch.zeros(ends[-1], dtype=torch.int64)
    for e in ends[:-1]:
        seg[e:] += 1
    m = seg[:, None] == seg[None, :]
    return m & causal_bool(ends[-1]) if causal else m


# name: (module, inputs, operator kinds the graph must contain)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]], set[str]]] = {
    # contractions
    "nn_linear": (lambda: nn.Linear(16, 24), lambda: (x3(2, 8, 16),), {"matmul", "binary"}),
    "nn_linear_no_bias": (lambda: nn.Linear(16, 24, bias=False), lambda: (x3(8, 16),), {"matmul"}),
    "nn_linear_on_a_vector": (lambda: nn.Linear(16, 8), lambda: (x3(16),), {"matmul"}),
    "F_linear_weight_from_input": (lambda: Lambda(lambda m, x, w, b: F.linear(x, w, b)),
                                   lambda: (x3(4, 16), x3(8, 16), x3(8)), {"matmul", "permute"}),
    "matmul_operator": (lambda: Lambda(lambda m, x: x @ m.w, w=nn.Parameter(torch.randn(16, 8))),
                        lambda: (x3(2, 4, 16),), {"matmul"}),
    "matmul_batched": (lambda: Lambda(lambda m, a, b: torch.matmul(a, b)), lambda: (x3(2, 3, 4, 8), x3(2, 3, 8, 6)),
                       {"matmul"}),
    "matmul_broadcast_batch": (lambda: Lambda(lambda m, a, b: a @ b), lambda: (x3(2, 3, 4, 8), x3(3, 8, 6)),
                               {"einsum"}),
    "matmul_broadcast_size_1": (lambda: Lambda(lambda m, a, b: a @ b), lambda: (x3(2, 1, 4, 8), x3(1, 3, 8, 6)),
                                {"einsum"}),
    "matmul_matrix_vector": (lambda: Lambda(lambda m, a, v: a @ v), lambda: (x3(6, 8), x3(8)), {"matmul"}),
    "bmm": (lambda: Lambda(lambda m, a, b: torch.bmm(a, b)), lambda: (x3(4, 6, 8), x3(4, 8, 2)), {"matmul"}),
    "mm_and_addmm": (lambda: Lambda(lambda m, a, b: torch.addmm(m.bias, a, b, beta=0.5, alpha=2.0) + a.mm(b),
                                    bias=torch.randn(6)), lambda: (x3(4, 8), x3(8, 6)), {"matmul", "unary"}),
    "einsum": (lambda: Lambda(lambda m, a, b: torch.einsum("bsh,hd->bsd", a, b)), lambda: (x3(2, 4, 8), x3(8, 6)),
               {"einsum"}),
    # elementwise
    "activations": (lambda: Lambda(lambda m, x: F.relu(x) + F.gelu(x) + F.gelu(x, approximate="tanh") + F.silu(x)
                                   + torch.sigmoid(x) + torch.tanh(x)), lambda: (x3(4, 16),), {"unary"}),
    "math_functions": (lambda: Lambda(lambda m, x: torch.exp(-x) + x.abs().sqrt() + torch.rsqrt(x * x + 1)
                                      + torch.log(x.abs() + 1) + torch.reciprocal(x.abs() + 1) + x ** 3
                                      + x.pow(0.5 * 4) + torch.square(x)), lambda: (x3(4, 16),), {"unary"}),
    "binary_broadcast": (lambda: Lambda(lambda m, x, y, z: (x + y) * z - x / (z.abs() + 1)),
                         lambda: (x3(2, 4, 16), x3(16), x3(4, 1)), {"binary"}),
    "binary_with_python_scalars": (lambda: Lambda(lambda m, x: (x + 1) * 3 - 2 - (1 - x) / 4 + 2 / (x.abs() + 1)),
                                   lambda: (x3(4, 16),), {"unary"}),
    "binary_with_a_bool_buffer": (lambda: Lambda(lambda m, x: x * m.keep, keep=torch.rand(16) > 0.5),
                                  lambda: (x3(4, 16),), {"binary"}),
    "binary_with_a_0_dim_buffer": (lambda: Lambda(lambda m, x: x * m.scale + m.scale, scale=torch.tensor(1.5)),
                                   lambda: (x3(4, 16),), {"unary"}),
    "add_sub_alpha": (lambda: Lambda(lambda m, x, y: torch.add(x, y, alpha=2) - torch.sub(x, y, alpha=0.5)),
                      lambda: (x3(4, 16), x3(4, 16)), {"binary"}),
    "maximum_minimum": (lambda: Lambda(lambda m, x, y: torch.maximum(x, y) + torch.minimum(x, y)),
                        lambda: (x3(4, 16), x3(16)), {"binary"}),
    "casts": (lambda: Lambda(lambda m, x: (x.double() * 2).float() + x.to(torch.float16).to(torch.float32)),
              lambda: (x3(4, 16) * 100,), {"unary"}),  # float16 rounds values near 100 by up to 0.03
    "exact_round_trip_cast": (lambda: Lambda(lambda m, x: x.double().float() * 2), lambda: (x3(4, 16),), {"unary"}),
    "int_ids_cast_to_float": (lambda: Lambda(lambda m, ids, x: ids.float() + x),
                              lambda: (torch.randint(0, 9, (4, 16)), x3(4, 16)), {"unary", "binary"}),
    # norms
    "nn_rmsnorm": (lambda: nn.RMSNorm(16, eps=1e-5), lambda: (x3(2, 4, 16),), {"rmsnorm"}),
    "F_rms_norm_without_weight": (lambda: Lambda(lambda m, x: F.rms_norm(x, (16,))), lambda: (x3(4, 16),),
                                  {"rmsnorm"}),
    "hand_written_rmsnorm": (lambda: Lambda(hand_rms, w=nn.Parameter(torch.rand(16) + 0.5)), lambda: (x3(2, 4, 16),),
                             {"rmsnorm"}),
    "hand_written_rmsnorm_div_sqrt": (lambda: Lambda(lambda m, x: x / torch.sqrt(
                                          (x * x).mean(-1, keepdim=True) + 1e-5)),
                                      lambda: (x3(4, 16),), {"rmsnorm"}),
    "nn_layernorm": (lambda: nn.LayerNorm(16), lambda: (x3(2, 4, 16),), {"layernorm"}),
    "nn_layernorm_two_dims": (lambda: nn.LayerNorm((4, 16)), lambda: (x3(2, 4, 16),), {"layernorm", "reshape"}),
    "nn_layernorm_no_affine": (lambda: nn.LayerNorm(16, elementwise_affine=False), lambda: (x3(4, 16),),
                               {"layernorm"}),
    "hand_written_layernorm": (lambda: Lambda(hand_layernorm, w=nn.Parameter(torch.rand(16)),
                                              b=nn.Parameter(torch.rand(16))), lambda: (x3(4, 16),), {"reduce"}),
    # row-wise and reductions
    "softmax": (lambda: Lambda(lambda m, x: x.softmax(-1) + F.softmax(x, dim=1, dtype=torch.float64).float()),
                lambda: (x3(2, 4, 16),), {"softmax"}),
    "log_softmax": (lambda: Lambda(lambda m, x: F.log_softmax(x, dim=-1)), lambda: (x3(4, 16),), {"reduce"}),
    "reductions": (lambda: Lambda(lambda m, x: (x.sum(-1), x.mean(dim=(0, 2)), x.amax(1, keepdim=True),
                                                x.amin(-1), x.var(-1), x.var(0))),
                   lambda: (x3(2, 4, 16),), {"reduce"}),
    # attention
    "sdpa_causal": (lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                    lambda: (x3(2, 4, 32, 8), x3(2, 4, 32, 8), x3(2, 4, 32, 8)), {"attention"}),
    "sdpa_full_scaled": (lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3)),
                         lambda: (x3(2, 4, 32, 8), x3(2, 4, 16, 8), x3(2, 4, 16, 8)), {"attention"}),
    "sdpa_enable_gqa": (lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      enable_gqa=True)),
                        lambda: (x3(1, 8, 32, 8), x3(1, 2, 32, 8), x3(1, 2, 32, 8)), {"attention"}),
    "sdpa_gqa_by_repeat_interleave": (
        lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)),
        lambda: (x3(1, 8, 32, 8), x3(1, 2, 32, 8), x3(1, 2, 32, 8)), {"attention"}),
    "sdpa_gqa_by_expand_reshape": (
        lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k[:, :, None].expand(1, 2, 4, 32, 8).reshape(1, 8, 32, 8),
            v[:, :, None].expand(1, 2, 4, 32, 8).reshape(1, 8, 32, 8), is_causal=True)),
        lambda: (x3(1, 8, 32, 8), x3(1, 2, 32, 8), x3(1, 2, 32, 8)), {"attention"}),
    "sdpa_causal_bool_mask": (
        lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bool(32))),
        lambda: (x3(2, 4, 32, 8), x3(2, 4, 32, 8), x3(2, 4, 32, 8)), {"attention"}),
    "sdpa_causal_float_mask": (
        lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.full((32, 32), float("-inf")).triu(1)[None, None])),
        lambda: (x3(2, 4, 32, 8), x3(2, 4, 32, 8), x3(2, 4, 32, 8)), {"attention"}),
    "sdpa_packed_causal_mask": (
        lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=packed_mask((5, 9, 20, 32), causal=True))),
        lambda: (x3(1, 4, 32, 8), x3(1, 4, 32, 8), x3(1, 4, 32, 8)), {"attention"}),
    "sdpa_packed_full_mask": (
        lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=packed_mask((12, 32), causal=False))),
        lambda: (x3(1, 4, 32, 8), x3(1, 4, 32, 8), x3(1, 4, 32, 8)), {"attention"}),
    "sdpa_rank_3": (lambda: Lambda(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                    lambda: (x3(2, 32, 8), x3(2, 32, 8), x3(2, 32, 8)), {"attention"}),
    "attention_by_hand_with_masked_fill": (
        lambda: Lambda(lambda m, q, k, v: (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(
            torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v),
        lambda: (x3(2, 4, 16, 8), x3(2, 4, 16, 8), x3(2, 4, 16, 8)), {"softmax", "matmul"}),
    "masked_fill_with_a_number": (
        lambda: Lambda(lambda m, x: x.masked_fill(torch.eye(16, dtype=torch.bool), 2.5)),
        lambda: (x3(2, 16, 16),), {"binary"}),
    # layout
    "view_reshape_flatten": (lambda: Lambda(lambda m, x: x.view(2, 4, 2, 8).reshape(8, 16).flatten()
                                            .unflatten(0, (4, 32))),
                             lambda: (x3(2, 4, 16),), {"reshape"}),
    "transpose_permute_t": (lambda: Lambda(lambda m, x, y: (x.transpose(1, 2).contiguous().permute(2, 0, 1), y.t(),
                                                            y.T)),
                            lambda: (x3(2, 4, 16), x3(6, 8)), {"permute"}),
    "unsqueeze_squeeze": (lambda: Lambda(lambda m, x: (x.unsqueeze(1) * 2).squeeze(1).unsqueeze(-1).squeeze(-1)),
                          lambda: (x3(4, 16),), {"reshape", "unary"}),
    "expand_and_repeat": (lambda: Lambda(lambda m, x, y: (x.expand(3, 4, 16), y.repeat(2, 3), y.expand_as(x[0]))),
                          lambda: (x3(1, 4, 16), x3(1, 16)), {"concat"}),
    "repeat_interleave": (lambda: Lambda(lambda m, x: x.repeat_interleave(3, dim=1)), lambda: (x3(2, 4, 8),),
                          {"concat"}),
    "slices_select_narrow": (lambda: Lambda(lambda m, x: (x[:, 1:3], x[..., -4:], x[:, 0], x.narrow(2, 4, 8),
                                                          x.select(-1, -1))),
                             lambda: (x3(2, 4, 16),), {"slice"}),
    "split_chunk_unbind": (lambda: Lambda(lambda m, x: (*x.split(6, dim=-1), *torch.split(x, [4, 12], -1),
                                                        *x.chunk(3, dim=1), *x.unbind(0))),
                           lambda: (x3(2, 6, 16),), {"slice"}),
    "cat_stack": (lambda: Lambda(lambda m, x, y: (torch.cat([x, y, x], dim=1), torch.stack([x, x], dim=1),
                                                  torch.cat([x, m.c.expand(2, 3, 16)], 1)), c=torch.randn(1, 1, 16)),
                  lambda: (x3(2, 4, 16), x3(2, 2, 16)), {"concat"}),
    "embedding": (lambda: nn.Embedding(50, 16), lambda: (torch.randint(0, 50, (2, 8)),), {"embedding"}),
    "embedding_tied_with_linear": (lambda: Lambda(lambda m, ids: m.e(ids) @ m.e.weight.T, e=nn.Embedding(32, 16)),
                                   lambda: (torch.randint(0, 32, (2, 8)),), {"embedding", "matmul"}),
    # rotary embeddings
    "rotary_standard_tables": (lambda: Lambda(lambda m, q: rotary(q)), lambda: (x3(2, 4, 32, 8),), {"rope"}),
    "rotary_seq_before_heads": (lambda: Lambda(lambda m, q: rotary(q, base=500000.0, heads_first=False)),
                                lambda: (x3(2, 32, 4, 8),), {"rope"}),
    "rotary_shifted_positions_by_tables": (lambda: Lambda(lambda m, q: rotary(q, offset=3)),
                                           lambda: (x3(2, 4, 32, 8),), {"rope_table"}),
    "swiglu": (lambda: Lambda(lambda m, a, b: F.silu(a) * b + b * F.silu(a)), lambda: (x3(4, 16), x3(4, 16)),
               {"swiglu"}),
    # empty tensors (a rotary slice of nothing) and masks: constant, from the inputs, boolean and float
    "empty_slice_and_split": (lambda: Lambda(lambda m, x: torch.cat([x[:, 3:3] + 1, torch.split(x, [0, 16], -1)[1],
                                                                    x[..., 16:] * 2, x], -1)),
                              lambda: (x3(4, 16),), {"concat"}),
    "sdpa_arbitrary_constant_mask": (lambda: RandomMask(), lambda: (x3(1, 2, 16, 8),), {"attention"}),
    "sdpa_float_mask_from_inputs": (lambda: InputMask(), lambda: (x3(1, 2, 16, 8), x3(16, 16)), {"attention"}),
    "sdpa_bool_mask_from_inputs": (
        lambda: Lambda(lambda m, q, x: F.scaled_dot_product_attention(q, q, q, attn_mask=(x > -1.0) | torch.eye(
            16, dtype=torch.bool))), lambda: (x3(1, 2, 16, 8), x3(1, 1, 16, 16)), {"attention"}),
    "sdpa_key_padding_from_inputs": (
        lambda: Lambda(lambda m, q, k, ids: F.scaled_dot_product_attention(
            q, k, k, attn_mask=(ids != 0)[:, None, None, :].expand(2, 1, 9, 11) & torch.ones(9, 11, dtype=torch.bool))),
        lambda: (x3(2, 4, 9, 8), x3(2, 4, 11, 8), torch.tensor([[1] * 11, [1] * 6 + [0] * 5])), {"attention"}),
    "sdpa_cross_attention_causal_top_left": (
        lambda: Lambda(lambda m, q, k: F.scaled_dot_product_attention(q, k, k, is_causal=True)),
        lambda: (x3(2, 4, 5, 8), x3(2, 4, 11, 8)), {"attention"}),
    "sdpa_sliding_window_constant_mask": (
        lambda: Lambda(lambda m, q: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(
            16, 16, dtype=torch.bool).tril() & ~torch.ones(16, 16, dtype=torch.bool).tril(-4))),
        lambda: (x3(1, 2, 16, 8),), {"attention"}),
    "masked_fill_by_the_input": (lambda: MaskedByInput(), lambda: (x3(4, 16),), {"where", "binary"}),
    "where_comparisons_and_logic": (
        lambda: Lambda(lambda m, x, y: torch.where((x > 0.5) ^ (y <= x) | ~(x == y), x, -y)),
        lambda: (x3(4, 16), x3(1, 16)), {"where", "binary", "unary"}),
    "dropout_in_eval_mode": (lambda: Lambda(lambda m, x: m.d(x) + F.dropout(x, 0.5, training=False), d=nn.Dropout(0.3)),
                             lambda: (x3(4, 16),), {"binary"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_module_matches_torch(name: str) -> None:
    make, inputs, expected = CASES[name]
    fast = assert_matches(make(), inputs())
    assert expected <= set(kinds(fast.graph)), kinds(fast.graph)
    # no node is left that no output needs
    consumers = fast.graph.consumers()
    saved = set(fast.graph.outputs.values())
    assert all(consumers[n.id] or n.id in saved for n in fast.graph.nodes)


def test_mlp_in_bfloat16() -> None:
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.RMSNorm(32)).to(torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    fast = assert_matches(mlp, (x,), atol=5e-2)
    assert {n.type.dtype for n in fast.graph.nodes} == {"bfloat16"}


def test_recognized_patterns_leave_no_trace_of_their_parts() -> None:
    g = from_torch(Lambda(hand_rms, w=nn.Parameter(torch.ones(16))).eval(), (x3(4, 16),))
    assert kinds(g) == ["rmsnorm"] and g.node("w").role == "parameter"
    g = from_torch(Lambda(lambda m, q: rotary(q)).eval(), (x3(1, 2, 16, 8),))
    assert kinds(g) == ["permute", "rope", "permute"] and g.parameters == {}


def test_parameters_are_named_by_module_path_and_kept_in_graph_layout() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    g = from_torch(model.eval(), (x3(2, 8),))
    assert [(n.name, n.role, n.type.shape) for n in g.inputs] == [
        ("input", "input", (2, 8)), ("0.weight", "parameter", (8, 16)), ("0.bias", "parameter", (16,)),
        ("2.0.weight", "parameter", (16, 4)), ("2.0.bias", "parameter", (4,))]
    np.testing.assert_array_equal(g.parameters["2.0.weight"], model[2][0].weight.detach().numpy().T)
    assert g.feeds(torch.ones(2, 8))["input"].tolist() == np.ones((2, 8)).tolist()


# --- unsupported operations: operation, source line, supported set ----------------------------------------------

class Lgamma(nn.Module):
    def forward(self, x: Any) -> Any:
        return torch.lgamma(x)


class EmptySlice(nn.Module):
    def forward(self, x: Any) -> Any:
        return x[:, 3:3] + 1


class EmptySplit(nn.Module):
    def forward(self, x: Any) -> Any:
        return torch.split(x, [0, 16], dim=-1)[1]


class RandomMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.rand(16, 16) > 0.5)

    def forward(self, q: Any) -> Any:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)


class InputMask(nn.Module):
    def forward(self, q: Any, mask: Any) -> Any:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class Rank5Attention(nn.Module):
    def forward(self, q: Any) -> Any:
        return F.scaled_dot_product_attention(q, q, q)


class RandomConstant(nn.Module):
    def forward(self, x: Any) -> Any:
        return x + torch.randn(16)


class FloorDiv(nn.Module):
    def forward(self, x: Any) -> Any:
        return torch.div(x, 2, rounding_mode="floor")


class Int8(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.to(torch.int8)


class ComplexBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("phase", torch.randn(16, dtype=torch.complex64))

    def forward(self, x: Any) -> Any:
        return x * self.phase


class MaskedByInput(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.masked_fill(x > 0, 0.0)


class TensorPower(nn.Module):
    def forward(self, x: Any, y: Any) -> Any:
        return x ** y


class ScalarBase(nn.Module):
    def forward(self, x: Any) -> Any:
        return 2 ** x


class Ellipsis(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x: Any) -> Any:
        return torch.einsum("...ij,jk->...ik", x, self.w)


class RaggedRepeat(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.repeat_interleave(torch.tensor([1, 2]), dim=0)


class BitCast(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.view(torch.int32)


class Sort(nn.Module):
    def forward(self, x: Any) -> Any:
        return torch.sort(x).values


class VarianceOfOne(nn.Module):
    def forward(self, x: Any) -> Any:
        return x.var(-1)


UNSUPPORTED: dict[str, tuple[type, Callable[[], tuple[Any, ...]], str, str, str]] = {
    # name: (module, inputs, operation, code on the source line, reason)
    "unknown_operation": (Lgamma, lambda: (x3(4, 16),), "aten.lgamma.default", "torch.lgamma(x)",
                          r"\(from `lgamma`\).*no translation rule for this operation"),
    "rank_5_attention": (Rank5Attention, lambda: (x3(1, 2, 2, 16, 8),),
                         "aten.scaled_dot_product_attention.default", "F.scaled_dot_product_attention(q, q, q)",
                         r"supported: \[batch, heads, seq, d\] or \[batch, seq, d\]"),
    "random_numbers": (RandomConstant, lambda: (x3(4, 16),), "aten.randn.default", "torch.randn(16)",
                       "normal draws are not supported"),
    "floor_division": (FloorDiv, lambda: (x3(4, 16),), "aten.div.Tensor_mode", 'rounding_mode="floor"',
                       "div with rounding_mode='floor'; supported: true division"),
    "int8_result": (Int8, lambda: (x3(4, 16),), "aten._to_copy.default", "x.to(torch.int8)",
                    "it produces a torch.int8 tensor"),
    "complex_constant": (ComplexBuffer, lambda: (x3(4, 16),), "aten.mul.Tensor", "x * self.phase",
                         r"a constant of dtype torch.complex64 \(phase, shape \(16,\)\)"),
    "tensor_exponent": (TensorPower, lambda: (x3(4, 16), x3(4, 16)), "aten.pow.Tensor_Tensor", "x ** y",
                        r"pow with a tensor exponent; supported: tensor \*\* number"),
    "scalar_base": (ScalarBase, lambda: (x3(4, 16),), "aten.pow.Scalar", "2 ** x",
                    r"pow with a tensor exponent; supported: tensor \*\* number"),
    "einsum_ellipsis": (Ellipsis, lambda: (x3(2, 4, 16),), "aten.einsum.default",
                        'torch.einsum("...ij,jk->...ik", x, self.w)', "einsum with an ellipsis"),
    "ragged_repeat_interleave": (RaggedRepeat, lambda: (x3(2, 16),), "aten.repeat_interleave.self_Tensor",
                                 "x.repeat_interleave(torch.tensor([1, 2]), dim=0)", "per-element repeats"),
    "bit_cast": (BitCast, lambda: (x3(2, 16),), "aten.view.dtype", "x.view(torch.int32)", "view as another dtype"),
    "sort": (Sort, lambda: (x3(4, 16),), "aten.sort.default", "torch.sort(x)", "data-dependent indices"),
    "variance_of_one_element": (VarianceOfOne, lambda: (x3(4, 1),), "aten.var.dim", "x.var(-1)",
                                "variance over 1 elements with correction 1.0"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_operation_names_op_source_line_and_supported_set(name: str) -> None:
    cls, inputs, op, code, reason = UNSUPPORTED[name]
    with pytest.raises(rt.GraphError) as err:
        from_torch(cls().eval(), inputs())
    check_message(err, op, cls.forward, code, reason)
    assert f"(top-level module {cls.__name__})" in str(err.value)


def test_unsupported_operation_inside_a_submodule_names_its_path() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.ReLU(), Lgamma()))
    with pytest.raises(rt.GraphError) as err:
        from_torch(model.eval(), (x3(4, 16),))
    check_message(err, "aten.lgamma.default", Lgamma.forward, "torch.lgamma(x)", "no translation rule")
    assert "(module '1.1' of type Lgamma)" in str(err.value)


def test_side_effects_are_refused() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x: Any) -> Any:
            self.calls += 1
            return x * 2

    with pytest.raises(rt.GraphError, match=r"updates buffer 'calls' by a value computed from no input that is not "
                                             r"an integer counter"):
        from_torch(Counter(), (x3(4, 8),))


def test_buffers_the_forward_updates_from_its_inputs_are_updated_in_place() -> None:
    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(8))
            self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

        def forward(self, x: Any) -> Any:
            self.total += x.sum(0)
            self.seen += 1
            return x * 2

    module, twin = Running(), Running()
    fast = rt.parallelize(module, (x3(4, 8),), device="cpu:2")
    for k in range(3):
        x = x3(4, 8) + k
        torch.testing.assert_close(fast(x), twin(x))
    torch.testing.assert_close(module.total, twin.total)
    assert int(module.seen) == int(twin.seen) == 3


def test_untraceable_and_non_tensor_inputs_are_refused() -> None:
    class Branchy(nn.Module):
        def forward(self, x: Any) -> Any:
            return x if x.sum() > 0 else -x

    with pytest.raises(rt.GraphError, match="torch.export could not trace Branchy: .*data-dependent control flow"):
        from_torch(Branchy(), (x3(4, 8),))
    with pytest.raises(rt.GraphError, match="from_torch takes tensor example inputs; input 1 is int"):
        from_torch(Lambda(lambda m, x, n: x * n), (x3(4, 8), 3))
    with pytest.raises(rt.GraphError, match="from_torch takes a torch.nn.Module; got function"):
        from_torch(lambda x: x, (x3(4, 8),))
    with pytest.raises(rt.GraphError, match="returns nothing that depends on its inputs"):
        from_torch(Lambda(lambda m, x: torch.ones(3)), (x3(4, 8),))


def test_packed_sequences_become_seq_ends_of_rope_and_attention() -> None:
    """Positions that restart per packed sequence and a block-diagonal causal mask: the graph of llama_block."""
    ends = (5, 9, 20, 22, 31, 40, 48)
    starts = torch.tensor([0, *ends[:-1]])
    positions = torch.arange(48) - starts[torch.searchsorted(starts, torch.arange(48), right=True) - 1]

    class Packed(nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            inv = 1.0 / 500000.0 ** (torch.arange(0, 8, 2).float() / 8)
            emb = torch.cat([torch.outer(positions.float(), inv)] * 2, dim=-1)
            q = q * emb.cos() + rotate_half(q) * emb.sin()
            k = k * emb.cos() + rotate_half(k) * emb.sin()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=packed_mask(ends, causal=True), enable_gqa=True)

    fast = assert_matches(Packed(), (x3(1, 4, 48, 8), x3(1, 2, 48, 8), x3(1, 2, 48, 8)), device="cpu:4")
    ops = {n.kind: n.op for n in fast.graph.operators}
    assert ops["rope"].seq_ends == ends and ops["rope"].base == pytest.approx(500000.0, rel=1e-3)
    assert ops["attention"].seq_ends == ends and ops["attention"].causal
    assert fast.graph.folded == ()


def test_shape_only_operations_are_constants() -> None:
    class Shapes(nn.Module):
        def forward(self, x: Any) -> Any:
            return x + torch.ones_like(x) * 2 + x.new_full((16,), 0.5) + torch.zeros_like(x[0])

    fast = assert_matches(Shapes(), (x3(4, 16),))
    assert "slice" not in kinds(fast.graph)  # x[0] feeds only zeros_like, so it is never translated


def test_an_hf_model_with_its_default_cache_is_traced_without_it_and_says_so() -> None:
    transformers = transformers_or_skip()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.config.use_cache  # the default
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="use_cache=True: its key/value cache is left out of the graph"):
        fast = parallelize(model, (ids,), device="cpu:2")
    assert model.config.use_cache  # the user's setting is as it was
    with torch.no_grad():
        got, want = fast(ids).logits, model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


class ListOfExperts(nn.Module):
    """A mixture of experts written as a loop over a list of expert modules (data-dependent shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: Any) -> Any:
        top = torch.topk(self.gate(x), 2).indices
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (top == e).any(-1).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


def test_a_mixture_of_experts_as_a_list_of_experts_is_refused_as_such() -> None:
    """transformers' MoE models trace (tests/test_moe.py); a loop over a list of experts is refused by name,
    before torch.export fails on its data-dependent shapes."""
    with pytest.raises(rt.GraphError, match="mixture-of-experts layer .*experts are not one module of stacked "
                                            "weights"):
        from_torch(ListOfExperts(), (torch.zeros(8, 16),))


class _WrittenAttention(nn.Module):
    """Attention written out the way transformers' eager paths write it: scores scaled by a number,
    optionally soft-capped, plus an optional float mask, softmax in float32, dropout, times v."""

    def __init__(self, softcap: float | None = None, divide: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.softcap, self.divide, self.dropout = softcap, divide, dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, 2, 8).transpose(1, 2) for t in self.proj(x).split(16, dim=-1))
        w = torch.matmul(q, k.transpose(2, 3))
        w = w / math.sqrt(8) if self.divide else w * 8 ** -0.5
        if self.softcap is not None:
            w = torch.tanh(w / self.softcap) * self.softcap
        if mask is not None:
            w = w + mask
        p = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        p = nn.functional.dropout(p, p=self.dropout, training=self.training)
        return torch.matmul(p, v).transpose(1, 2).reshape(b, s, 16)


@pytest.mark.parametrize("softcap, divide, masked", [(None, True, False), (2.0, False, False), (0.5, False, True)])
def test_written_out_attention_becomes_one_operator(softcap: float | None, divide: bool, masked: bool) -> None:
    x = torch.randn(2, 12, 16)
    inputs: tuple[Any, ...] = (x,)
    if masked:  # a runtime float mask: a bias added after the softcap, with -inf where a key is hidden
        bias = torch.randn(2, 1, 12, 12)
        bias[0, :, :, 7:] = float("-inf")
        inputs = (x, bias)
    fast = assert_matches(_WrittenAttention(softcap, divide), inputs, device="cpu:2")
    assert "softmax" not in kinds(fast.graph)
    att = next(n for n in fast.graph.operators if n.kind == "attention")
    assert att.op.softcap == softcap and att.op.softmax_scale == pytest.approx(8 ** -0.5)
    assert att.op.extras == (("bias",) if masked else ())


def test_written_out_attention_that_drops_in_training_stays_written_out() -> None:
    module = _WrittenAttention(dropout=0.1).train()
    fast = parallelize(module, (torch.randn(2, 12, 16),), device="cpu:2")
    assert "attention" not in kinds(fast.graph) and "softmax" in kinds(fast.graph)

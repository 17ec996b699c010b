"""``rt.parallelize`` as torch users hold a module: an ``nn.Module`` with the wrapped module's parameters
(state dicts, train/eval, ``.to()``, ``nn.Sequential``, a torch optimizer), keyword inputs and the module's
own output structure (a transformers ``ModelOutput``), one compiled program per input signature (counted),
sequence buckets, pickling, and constants read on the host.  Every result is compared with eager torch:
float32 at 1e-5 of the largest magnitude, float64 at 1e-10."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from typing import Any

import pytest

import relational_tensors as rt

torch = pytest.importorskip("torch")
nn = torch.nn

F32, F64 = 1e-5, 1e-10


def _rel(got: Any, want: Any) -> float:
    """max |got - want| over the largest magnitude of want."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def _mlp() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 8))


@pytest.fixture
def compilations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The graphs ``rt.compileGraph`` planned during the test."""
    import relational_tensors.api.compile as api_compile

    planned: list[Any] = []
    real = api_compile.compileGraph

    def counting(graph: Any, *args: Any, **kwargs: Any) -> Any:
        planned.append(graph)
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(api_compile, "compileGraph", counting)
    return planned


# --- an nn.Module ----------------------------------------------------------------------------------------------------

def test_it_is_a_torch_module_that_holds_the_wrapped_module_s_parameters() -> None:
    m = _mlp().eval()
    x = torch.randn(4, 16)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    assert isinstance(pm, nn.Module) and isinstance(pm, rt.ParallelModule) and pm.module is m
    assert [p for p in pm.parameters()] == [p for p in m.parameters()]  # the same Parameter objects
    assert [k for k, _ in pm.named_parameters()] == [f"module.{k}" for k, _ in m.named_parameters()]
    assert _rel(pm(x), m(x)) <= F32
    assert "operators on cpu:2" in repr(pm) and "(module): Sequential" in repr(pm)


def test_state_dict_round_trip_and_load_state_dict_then_call() -> None:
    m = _mlp().eval()
    x = torch.randn(4, 16)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    torch.manual_seed(1)
    other = rt.parallelize(_mlp().eval(), (x,), device="cpu:2")
    other(x)  # its own weights are loaded on the devices first
    other.load_state_dict(pm.state_dict())  # keys module.<name>, as under DistributedDataParallel
    with torch.no_grad():
        assert _rel(other(x), m(x)) <= F32  # the next call reads the loaded weights
    fresh = {k: torch.randn_like(v) for k, v in pm.state_dict().items()}
    pm.load_state_dict(fresh)
    assert torch.equal(m[0].weight, fresh["module.0.weight"])
    with torch.no_grad():
        assert _rel(pm(x), m(x)) <= F32


def test_train_and_eval_each_trace_their_mode_once(compilations: list[Any]) -> None:
    m = _mlp()
    x = torch.randn(4, 16)
    pm = rt.parallelize(m.eval(), (x,), device="cpu:2")
    with torch.no_grad():
        assert _rel(pm(x), m(x)) <= F32
        pm.train()
        assert m.training and all(s.training for s in m.modules())
        drawn = pm(x)  # dropout: drawn by the program's own generator, not torch's
        assert "dropout" in {n.kind for n in pm.graph.operators} or pm.graph.rng_input is not None
        assert not torch.allclose(drawn, m.eval()(x))
        pm.eval()
        assert _rel(pm(x), m(x)) <= F32
        pm.train()
        pm(x)
    assert len(compilations) == 2 and pm.cache_info().misses == 2


def test_inside_nn_sequential_trained_by_a_torch_optimizer() -> None:
    torch.manual_seed(2)
    inner = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    head = nn.Linear(16, 4)
    twin = copy.deepcopy(nn.Sequential(inner, head))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    model = nn.Sequential(rt.parallelize(inner, (x,), device="cpu:2"), head)
    ours = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs = torch.optim.SGD(twin.parameters(), lr=0.1)
    assert len(list(model.parameters())) == len(list(twin.parameters())) == 6
    for _ in range(3):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for (k, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _rel(a, b) <= F32, k


def test_a_call_loads_only_the_weights_that_changed() -> None:
    """After an in-place change of one parameter, the forward and the training program load that
    parameter's graph inputs again and nothing else, and their results are the changed module's."""
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(6, 16)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    with torch.no_grad():
        pm(x)
    program = pm.programs[pm._latest]
    loads: list[set[str]] = []
    real = type(pm.compiled).load

    def spy(cg: Any, feeds: Any, array: Any = None) -> None:
        loads.append(set(feeds) if isinstance(feeds, dict) else {str(feeds)})
        real(cg, feeds, array)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(pm.compiled), "load", spy)
        with torch.no_grad():
            m[2].bias.add_(1.0)
            got = pm(x)
        assert _rel(got, m(x)) <= F32
        held = {name for name, (origin, _) in program.graph.origins.items() if origin == "2.bias"}
        assert held and set().union(*loads) - set(program.graph.input_names) == held
        loads.clear()
        with torch.no_grad():  # nothing changed: the weights stay loaded
            pm(x)
        assert set().union(*loads) <= set(program.graph.input_names)
        # the training program: its first run loads every weight, a later change only that one
        torch.nn.functional.mse_loss(pm(x), torch.zeros(6, 8)).backward()
        with torch.no_grad():
            m[0].weight.mul_(0.5)
        loads.clear()
        m.zero_grad()
        torch.nn.functional.mse_loss(pm(x), torch.zeros(6, 8)).backward()
    twin = copy.deepcopy(m)
    twin.zero_grad()
    torch.nn.functional.mse_loss(twin(x), torch.zeros(6, 8)).backward()
    for (k, a), b in zip(m.named_parameters(), twin.parameters()):
        assert _rel(a.grad, b.grad) <= F32, k
    weights = set().union(*loads) - {n for n in set().union(*loads) if n.startswith("cot.")}
    origins = {origin for g, _, _ in program._backwards.values() for n, (origin, _) in g.origins.items()
               if n in weights}
    assert origins == {"0.weight"}, weights


def test_to_float64_moves_the_weights_and_the_example_and_plans_again() -> None:
    m = _mlp().eval()
    x = torch.randn(4, 16)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    assert pm.to(torch.float64) is pm and m[0].weight.dtype == torch.float64
    assert pm.example_inputs[0][0].dtype == torch.float64
    assert _rel(pm(x.double()), m(x.double())) <= F64
    assert pm.graph.input_types == (((4, 16), "float64"),)


# --- keyword inputs and output structure ------------------------------------------------------------------------------

class Tagger(nn.Module):
    """Called as transformers models are: ``input_ids=``, ``attention_mask=``, a Python value; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids: Any, attention_mask: Any = None, scale: float = 1.0) -> Any:
        h = torch.tanh(self.proj(self.embed(input_ids))) * scale
        if attention_mask is not None:
            h = h * attention_mask[..., None].to(h.dtype)
        return {"hidden": h, "pooled": (h.sum(1), h.amax(-1))}


def test_keyword_inputs_a_dict_output_and_their_gradients() -> None:
    torch.manual_seed(3)
    m = Tagger()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    pm = rt.parallelize(m, {"input_ids": ids, "attention_mask": mask, "scale": 2.0}, device="cpu:2", recompile=False)
    assert pm.graph.input_names == ("input_ids", "attention_mask")  # named as the forward names them
    got, want = pm(input_ids=ids, attention_mask=mask, scale=2.0), m(input_ids=ids, attention_mask=mask, scale=2.0)
    assert isinstance(got, dict) and list(got) == ["hidden", "pooled"] and isinstance(got["pooled"], tuple)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert _rel(a, b) <= F32
    got["pooled"][0].square().mean().backward()  # gradients through the keyword-bound trace
    ours = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    want["pooled"][0].square().mean().backward()
    for k, p in m.named_parameters():
        assert _rel(ours[k], p.grad) <= 1e-4, k
    # the same signature given as (args, kwargs), by position and keyword
    again = rt.parallelize(m, ((ids,), {"attention_mask": mask, "scale": 2.0}), device="cpu:2")
    assert _rel(again(ids, attention_mask=mask, scale=2.0)["hidden"], want["hidden"]) <= F32
    with pytest.raises(rt.ExecError, match=r"input 'attention_mask' must have the traced shape \(2, 7\) and dtype "
                                           r"int64; got \(2, 6\) int64\. This module was parallelized with "
                                           r"recompile=False"):
        pm(input_ids=ids, attention_mask=mask[:, :6], scale=2.0)
    with pytest.raises(rt.ExecError, match=r"input 'scale' was 2.0 when traced .*; got 3.0"):
        pm(input_ids=ids, attention_mask=mask, scale=3.0)
    with pytest.raises(rt.ExecError, match=r"traced with inputs \('input_ids', 'attention_mask', 'scale'\); got "
                                           r"\('input_ids'\)"):
        pm(input_ids=ids)


def test_a_forward_set_on_the_instance_is_the_one_traced() -> None:
    m = Tagger()
    ids = torch.randint(0, 50, (2, 5))
    plain = m.forward
    m.forward = lambda *a, **k: {"hidden": plain(*a, **k)["hidden"] * 2}  # as accelerate's hooks set one
    pm = rt.parallelize(m, {"input_ids": ids}, device="cpu:2")
    with torch.no_grad():
        assert _rel(pm(input_ids=ids)["hidden"], m(input_ids=ids)["hidden"]) <= F32


def _tiny_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=97,
                                      max_position_embeddings=128, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(4)
    return transformers.LlamaForCausalLM(config).eval()


def _batch(seq: int, vocab: int = 97) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, vocab, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0  # the second sequence is right-padded
    return ids, mask


def test_a_transformers_model_called_with_keywords_returns_its_model_output() -> None:
    model = _tiny_llama()
    ids, mask = _batch(9)
    pm = rt.parallelize(model, {"input_ids": ids, "attention_mask": mask}, device="cpu:4")
    got = pm(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask)
    assert type(got) is type(want) and list(got.keys()) == list(want.keys()) == ["logits"]
    real = mask.bool()
    assert _rel(got.logits[real], want.logits[real]) <= F32
    assert "attention" in {n.kind for n in pm.graph.operators}


# --- one program per signature -------------------------------------------------------------------------------------

def test_each_new_shape_compiles_once(compilations: list[Any]) -> None:
    m = _mlp().eval()
    a, b = torch.randn(4, 16), torch.randn(6, 16)
    pm = rt.parallelize(m, (a,), device="cpu:2", recompile=True)
    with torch.no_grad():  # inference: the forward programs only (a call with grad runs a training program)
        for x in (a, b, a, b, b):
            assert _rel(pm(x), m(x)) <= F32
    assert [g.input_types for g in compilations] == [(((4, 16), "float32"),), (((6, 16), "float32"),)]
    assert pm.cache_info() == rt.api.parallelize.CacheInfo(hits=4, misses=2, maxsize=8, currsize=2)
    assert pm.graph.input_types == (((6, 16), "float32"),)  # the latest call's program


def test_the_cache_keeps_the_most_recently_used_programs(compilations: list[Any]) -> None:
    m = _mlp().eval()
    xs = [torch.randn(n, 16) for n in (2, 3, 4)]
    pm = rt.parallelize(m, (xs[0],), device="cpu:2", recompile=True, cache_size=2)
    with torch.no_grad():
        for x in (xs[0], xs[1], xs[0], xs[2], xs[0], xs[1]):  # 4 rows evict 3 (least recent); 3 comes back
            assert _rel(pm(x), m(x)) <= F32
    assert [g.input_types[0][0][0] for g in compilations] == [2, 3, 4, 3]
    assert pm.cache_info().currsize == 2
    with pytest.raises(rt.GraphError, match="cache_size"):
        rt.parallelize(m, (xs[0],), device="cpu:2", cache_size=0)


def test_buckets_pad_the_sequence_and_cut_it_back(compilations: list[Any]) -> None:
    model = _tiny_llama()
    ids, mask = _batch(9)
    pm = rt.parallelize(model, {"input_ids": ids, "attention_mask": mask}, device="cpu:2", bucket=[16, 32])
    for seq in (9, 13, 16, 20):
        ids, mask = _batch(seq)
        with torch.no_grad():
            got = pm(input_ids=ids, attention_mask=mask).logits
            want = model(input_ids=ids, attention_mask=mask).logits
        assert got.shape == want.shape == (2, seq, 97)
        assert _rel(got[mask.bool()], want[mask.bool()]) <= F32
    assert [g.input_types[0][0] for g in compilations] == [(2, 16), (2, 32)]  # 9, 13 and 16 share one program


def test_buckets_refuse_a_module_that_padding_changes() -> None:
    class MeanPool(nn.Module):  # averages over the whole sequence, padding included
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return self.proj(x).mean(1)

    x = torch.randn(2, 8, 8)
    pm = rt.parallelize(MeanPool(), (x,), device="cpu:2", bucket=[8])  # a bucket's own length needs no padding
    assert _rel(pm(x), pm.module(x)) <= F32
    with pytest.raises(rt.ExecError, match=r"padding the sequence from 5 to 8 \(bucket=\) changes output leaf 0 of "
                                           r"MeanPool at real positions by .* Pad only a module that masks"):
        pm(x[:, :5])


# --- pickling --------------------------------------------------------------------------------------------------------

def test_a_compiled_graph_refuses_pickling_and_names_the_plan_files() -> None:
    m = _mlp().eval()
    pm = rt.parallelize(m, (torch.randn(4, 16),), device="cpu:2")
    for dump in (pickle.dumps, lambda cg: torch.save(cg, io.BytesIO()), copy.deepcopy):
        with pytest.raises(rt.PlanError, match=r"rt\.save_plan\(cg, path\).*rt\.load_plan\(path, graph\)"):
            dump(pm.compiled)


def test_a_parallel_module_pickles_its_module_and_plans_again() -> None:
    m = _mlp().eval()
    x = torch.randn(4, 16)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    buf = io.BytesIO()
    torch.save(pm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(pm)
    for copied in (loaded, twin, pickle.loads(pickle.dumps(pm))):
        assert copied.module is not m and copied.cache_info().currsize == 0
        assert _rel(copied(x), m(x)) <= F32 and copied.cache_info().misses == 1


# --- constants of a GPU module are read on the host ----------------------------------------------------------------

def test_frontend_constants_are_read_through_the_host_helper() -> None:
    from relational_tensors.frontend.torch.convert import host

    cpu = torch.arange(3.0)
    assert host(cpu) is cpu and host(3) == 3  # on the CPU, nothing changes

    class OnGpu:  # what a CUDA tensor answers, without a GPU
        device = torch.device("cuda", 0)

        def detach(self) -> Any:
            return self

        def cpu(self) -> Any:
            return cpu

    assert host(OnGpu()) is cpu


def test_the_trace_copies_no_module_tensor_and_the_weights_are_read_from_the_module() -> None:
    """Tracing reads the module's tensors for their shapes only (``module_values=False``): the graph's values
    are then read from the tensors themselves, equal to what a trace with copies holds."""
    model = _tiny_llama()
    ids, _ = _batch(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = rt.from_torch(model, (ids,), module_values=False)
        full = rt.from_torch(model, (ids,))
    assert set(bare.parameters) == set(full.folded) and set(bare.origins) == set(full.origins)
    pm = rt.parallelize(model, (ids,), device="cpu:2")
    with torch.no_grad():
        got, want = pm(ids).logits, model(ids).logits
    assert _rel(got, want) <= 1e-4
    (program,) = pm.programs.values()
    assert set(program.graph.parameters) == set(full.parameters)
    for k, v in full.parameters.items():
        assert (program.graph.parameters[k] == v).all(), k


@pytest.mark.gpu
def test_a_module_on_the_gpu_traces_with_its_constants_read_on_the_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _tiny_llama()
    ids, mask = _batch(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_cpu = rt.from_torch(model, (ids,))
        model.cuda()
        on_gpu = rt.from_torch(model, (ids.cuda(),))  # the causal mask, rotary tables: CUDA constants
    assert set(on_gpu.parameters) == set(on_cpu.parameters)
    for k, v in on_cpu.parameters.items():
        assert abs(on_gpu.parameters[k].astype("float64") - v.astype("float64")).max() <= 1e-6, k
    pm = rt.parallelize(model, {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}, device="cuda:0,0")
    with warnings.catch_warnings():  # weights read from the module on its GPU, not through the host
        warnings.simplefilter("ignore")
        bare = rt.from_torch(model, (ids.cuda(),), module_values=False)
    assert set(bare.parameters) == set(bare.folded)
    with torch.no_grad():
        got = pm(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits
        want = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits
    assert got.device.type == "cuda" and _rel(got[mask.bool().cuda()], want[mask.bool().cuda()]) <= 1e-4


def test_backward_twice_with_retain_graph_accumulates_as_torch() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    loss = pm(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    ours = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    want = m(x).square().mean()
    want.backward(retain_graph=True)
    want.backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, rtol=1e-10, atol=1e-12, msg=k)


def test_a_second_derivative_is_refused_and_create_graph_alone_keeps_first_gradients() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    pm = rt.parallelize(m, (x,), device="cpu:2")
    w = m[0].weight
    d, dx = torch.autograd.grad(pm(x).square().mean(), [w, x], create_graph=True)
    want_d, want_dx = torch.autograd.grad(m(x).square().mean(), [w, x])
    torch.testing.assert_close(d.detach(), want_d, rtol=1e-10, atol=1e-12)  # the first derivative is torch's
    torch.testing.assert_close(dx.detach(), want_dx, rtol=1e-10, atol=1e-12)
    for grad in (d, dx):  # differentiating it again is refused, never a silent zero
        with pytest.raises(rt.ExecError, match="double backward .* not supported.*with the torch module itself"):
            torch.autograd.grad(grad.pow(2).sum(), [w])
    # a linear loss (whose incoming gradient needs none) still reaches the refusal through the parameters
    (d,) = torch.autograd.grad(pm(x).sum(), [w], create_graph=True)
    with pytest.raises(rt.ExecError, match="double backward"):
        torch.autograd.grad(d.pow(2).sum(), [w])
    # backward(create_graph=True) fills .grad as torch does
    m.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of the parameter-gradient reference cycle
        pm(x).square().mean().backward(create_graph=True)
    torch.testing.assert_close(w.grad.detach(), want_d, rtol=1e-10, atol=1e-12)

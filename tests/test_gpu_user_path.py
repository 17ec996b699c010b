"""The user's path on a GPU: CUDA tensors into rt.train_step and rt.parallelize and out of them with the
host never waiting, every step after the first one CUDA-graph launch, and the results those of the
host path (the checked load) step for step.

Ordering is tested the way a user meets it: torch's stream is held busy (``torch.cuda._sleep``) and the
batch rewritten on it after the sleep; a step that waited on the host would take the sleep's time, and
one that read the batch too early would give the old batch's loss."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
import relational_tensors as rt  # noqa: E402

pytestmark = pytest.mark.gpu


def _needs_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("cupy")


class _Counting:
    """A captured graph that records each launch in ``launches`` (as ``tag``) and launches it."""

    def __init__(self, graph: object, launches: list, tag: object = None) -> None:
        self.graph, self.launches, self.tag = graph, launches, tag

    def launch(self, stream: object) -> None:
        self.launches.append(stream if self.tag is None else self.tag)
        self.graph.launch(stream)  # type: ignore[attr-defined]


def _count_launches(ex: object) -> list:
    """Record each launch of ``ex``'s captured graph (the list grows as the graph is launched)."""
    launches: list = []
    ex.graph_exec = _Counting(ex.graph_exec, launches)  # type: ignore[attr-defined]
    return launches


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))


def _loss(m: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(x), t)


def _batches(n: int, rows: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 64, generator=g), torch.randn(rows, 32, generator=g)) for _ in range(n)]


def _sleep_ms(ms: float) -> None:
    """Keep torch's current stream busy for about ``ms`` milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    per = max(start.elapsed_time(end), 1e-3) / 1_000_000
    torch.cuda._sleep(int(ms / per))


@pytest.mark.parametrize("device", ["cuda:0", "cuda:0,0,0"])
def test_cuda_batches_train_as_the_host_path_does(device: str) -> None:
    """Eight steps with CUDA batches (staged, captured) against the same steps fed from the host (the
    checked load, every step), with a learning-rate schedule changing the lr device scalar every step:
    the losses and the weights agree to float32 rounding."""
    _needs_gpu()
    batches = _batches(8)
    runs = {}
    for where in ("cuda", "cpu"):
        m = _mlp()
        step = rt.train_step(m, _loss, tuple(b.to(where) for b in batches[0]), optimizer=rt.optim.AdamW(lr=1e-2),
                             device=device, lr_schedule=lambda k: 1e-2 / (1 + k))
        losses = [step(*(b.to(where) for b in batch)) for batch in batches]
        assert all(loss.device.type == "cuda" for loss in losses)
        runs[where] = ([float(v) for v in losses], step.state_dict()["model"])
    (got, got_w), (want, want_w) = runs["cuda"], runs["cpu"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for k in want_w:
        torch.testing.assert_close(got_w[k].cpu(), want_w[k].cpu(), rtol=1e-5, atol=1e-6)


def test_a_step_returns_before_the_gpu_has_run_it_and_reads_the_batch_in_stream_order() -> None:
    _needs_gpu()
    batches = [tuple(b.cuda() for b in pair) for pair in _batches(3)]
    m = _mlp()
    step = rt.train_step(m, _loss, batches[0], optimizer=rt.optim.SGD(lr=0.0), device="cuda:0")
    x, t = (b.clone() for b in batches[0])
    for _ in range(3):  # eager, captured, replayed
        step(x, t)
    torch.cuda.synchronize()
    want = float(step(*batches[1]))  # lr 0: the loss is a function of the batch alone
    _sleep_ms(300)
    x.copy_(batches[1][0])  # queued after the sleep on torch's stream
    t.copy_(batches[1][1])
    began = time.perf_counter()
    loss = step(x, t)
    host_ms = (time.perf_counter() - began) * 1e3
    assert host_ms < 150, f"the step kept the host {host_ms:.0f} ms behind a 300 ms busy stream"
    assert float(loss) == pytest.approx(want, rel=1e-6)  # reading it synchronizes, as in torch


def test_every_step_after_the_first_two_is_one_graph_launch() -> None:
    _needs_gpu()
    batches = [tuple(b.cuda() for b in pair) for pair in _batches(6)]
    step = rt.train_step(_mlp(), _loss, batches[0], optimizer=rt.optim.AdamW(lr=1e-3), device="cuda:0,0")
    for batch in batches[:3]:
        step(*batch)
    ex = step.compiled.executor
    assert ex.graph_exec is not None
    eager: list = []
    real_issue = ex._issue_all
    launches = _count_launches(ex)
    ex._issue_all = lambda *a, **k: (eager.append(1), real_issue(*a, **k))
    for batch in batches[3:]:
        step(*batch)
    torch.cuda.synchronize()
    assert len(launches) == 3 and not eager


def test_out_of_range_ids_on_the_gpu_are_refused_at_the_next_call() -> None:
    """Ids checked on the device as they arrive: a bad batch is an ExecError by the next step at the
    latest (torch's device-side assert, typed), and never a memory fault."""
    _needs_gpu()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 7, 4))
    ids, t = torch.randint(0, 50, (5, 7), device="cuda"), torch.randn(5, 4, device="cuda")
    step = rt.train_step(m, _loss, (ids, t), optimizer=rt.optim.SGD(lr=0.1), device="cuda:0")
    for _ in range(3):
        step(ids, t)
    bad = ids.clone()
    bad[2, 3] = 50
    with pytest.raises(rt.ExecError, match=r"embedding ids must lie in \[0, 50\)"):
        step(bad, t)
        torch.cuda.synchronize()
        step(ids, t)


def test_parallelize_takes_and_gives_cuda_tensors_without_waiting() -> None:
    _needs_gpu()
    m = _mlp().cuda().eval()
    xs = [b[0].cuda() for b in _batches(4)]
    pm = rt.parallelize(m, (xs[0],), device="cuda:0,0")
    with torch.no_grad():
        for x in xs:
            got = pm(x)
            assert got.device.type == "cuda"
            torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
        x = xs[0].clone()
        _sleep_ms(300)
        x.copy_(xs[3])
        began = time.perf_counter()
        got = pm(x)
        host_ms = (time.perf_counter() - began) * 1e3
        torch.testing.assert_close(got, m(xs[3]), rtol=1e-5, atol=1e-5)
    assert host_ms < 150


def test_parallelize_training_on_the_gpu_gives_torch_gradients() -> None:
    """rt.parallelize under autograd on CUDA tensors: the two phases staged, the gradients CUDA tensors
    equal to eager torch's."""
    _needs_gpu()
    ref, m = _mlp().cuda(), _mlp().cuda()
    x, t = (b.cuda() for b in _batches(1)[0])
    pm = rt.parallelize(m, (x,), device="cuda:0")
    for _ in range(3):
        m.zero_grad()
        _loss(pm, x, t).backward()
    ref.zero_grad()
    _loss(ref, x, t).backward()
    for (k, a), b in zip(m.named_parameters(), ref.parameters()):
        assert a.grad.device.type == "cuda", k
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_a_bf16_llama_training_step_is_captured_whole(padded: bool) -> None:
    """transformers' LlamaForCausalLM in bfloat16 on the GPU, with and without a padded attention mask:
    every operator of its training step has a device kernel (rope with rounded frequencies, the mask's
    cast to bool, key padding in attention forward and backward), so after two steps each step is one
    graph launch; its first loss is torch's within bfloat16 rounding."""
    _needs_gpu()
    transformers = pytest.importorskip("transformers")
    from relational_tensors.kernels.launchers import allocates

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    labels = torch.randint(0, 512, (2, 64), device="cuda")
    mask = torch.ones(2, 64, dtype=torch.long, device="cuda")
    mask[0, 40:] = 0

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=ids, attention_mask=rest[0] if padded else None).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rest[-1].flatten())

    batch = (ids, mask, labels) if padded else (ids, labels)
    with torch.no_grad():
        want = float(loss_fn(model, *batch))
    step = rt.train_step(model, loss_fn, batch, optimizer=rt.optim.AdamW(lr=1e-4), device="cuda:0")
    assert not [n.kind for n in step.graph.operators if allocates(n.op)]
    first = float(step(*batch))
    assert first == pytest.approx(want, rel=2e-2)
    step(*batch)
    step(*batch)
    ex = step.compiled.executor
    assert ex.graph_exec is not None
    launches = _count_launches(ex)
    for _ in range(3):
        loss = step(*batch)
    assert len(launches) == 3 and torch.isfinite(loss).item()


def test_weights_a_torch_optimizer_steps_stay_on_the_gpu() -> None:
    """torch's own AdamW stepping a parallelized module on CUDA (as the torch.compile backend is used):
    the weights it changed are read again device to device (CUDA tensors, not host copies) and only
    those, and every step's gradients and forward are eager torch's."""
    _needs_gpu()
    ref, m = _mlp().cuda(), _mlp().cuda()
    x, t = (b.cuda() for b in _batches(1)[0])
    pm = rt.parallelize(m, (x,), device="cuda:0")
    ours = torch.optim.AdamW(m.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        for net, opt in ((pm, ours), (ref, theirs)):
            opt.zero_grad()
            _loss(net, x, t).backward()
            opt.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    program = pm.programs[pm._latest]
    read = [v for g, _, _ in program._backwards.values() for n, v in g.parameters.items() if n in g.origins]
    assert read and all(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in read)
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref(x), rtol=1e-4, atol=1e-5)


def test_each_phase_of_a_differentiable_call_is_one_graph_launch() -> None:
    """rt.parallelize under autograd (what the torch.compile backend runs for training): from the third
    call on, the forward phase and the backward phase are each one CUDA-graph launch, and the gradients
    and the torch optimizer's steps are eager torch's."""
    _needs_gpu()
    ref, m = _mlp().cuda(), _mlp().cuda()
    x, t = (b.cuda() for b in _batches(1)[0])
    pm = rt.parallelize(m, (x,), device="cuda:0,0")
    ours = torch.optim.SGD(m.parameters(), lr=0.1)
    theirs = torch.optim.SGD(ref.parameters(), lr=0.1)
    launches: list = []
    for step in range(5):
        for net, opt in ((pm, ours), (ref, theirs)):
            opt.zero_grad()
            _loss(net, x, t).backward()
            opt.step()
        ex = next(iter(pm.programs[pm._latest]._backwards.values()))[1].executor
        if step == 2:
            assert sorted(ex.phase_exec) == [0, 1]
            for phase, graph in list(ex.phase_exec.items()):
                ex.phase_exec[phase] = _Counting(graph, launches, phase)
    assert launches == [0, 1, 0, 1]
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

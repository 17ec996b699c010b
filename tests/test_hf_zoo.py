"""Every parameter of every model in the zoo trains exactly as torch trains it.

Each case of ``hf_zoo.ZOO`` (34 transformers architectures in tiny float64 configurations) is run as a user
runs it on ``cpu:4``: ``rt.parallelize(module, inputs)`` and ``loss.backward()`` against torch's own gradients,
and three steps of ``rt.train_step`` with ``rt.optim.AdamW`` against torch's ``AdamW`` loop.  A parameter torch
gives a gradient gets one here, equal to torch's; one torch gives none (read only where the batch does not
reach) gets none.

Tolerances.  Where the model computes in float64 throughout, a gradient agrees to ``1e-9`` of its own largest
magnitude.  A gradient that is zero in exact arithmetic (a key bias under softmax, which adds one number to a
whole row of scores) holds rounding noise in both programs, so each is measured against a millionth of the
model's largest gradient where that is larger.  Several models compute a part in float32 whatever the
parameters' dtype (``FLOAT32_PARTS`` says which part): rounding there is 6e-8 relative, and after two layers of
products the gradients agree to a few 1e-7, so those are held to ``1e-5``; after AdamW steps, to ``1e-3``
(Adam divides each element's gradient by that element's own running magnitude, so an element whose gradient is
small carries the float32 rounding of the larger ones into its update at full size); a parameter whose gradient
is rounding noise (the key bias) moves by up to lr a step in either program, and is held to that.

The default run checks a handful of architectures, one per mechanism the frontend must get right (tied
weights, transformed parameters, constant gathers, batch norm, decompositions); the rest are marked slow
(``pytest -m slow tests/test_hf_zoo.py`` runs them all, about five minutes on two cores).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs torch")
pytest.importorskip("transformers", reason="the zoo needs pip install transformers")
from hf_zoo import ZOO, ZooCase, train_mode_case  # noqa: E402

import relational_tensors as rt  # noqa: E402

# models that compute a part in float32 whatever their parameters' dtype, and that part
FLOAT32_PARTS = {
    "llama": "rotary tables", "qwen2": "rotary tables", "qwen3": "rotary tables", "mistral": "rotary tables",
    "phi3": "rotary tables", "gemma": "rotary tables", "gemma2": "rotary tables", "gemma3": "rotary tables",
    "phi": "rotary tables", "starcoder2": "rotary tables", "falcon": "rotary tables", "gpt_neox": "rotary tables",
    "bloom": "ALiBi slopes",
    "mamba": "the state matrix A = -exp(A_log.float())", "t5_encoder": "softmax (scores.float())",
    "t5": "softmax (scores.float())",
}
# one architecture per mechanism in the default run; the others are slow-marked
DEFAULT = {
    "gemma": "tied embedding, (1 + w) norms, rotary",
    "gpt2": "tied embedding, positions read at constant ids, Conv1D (transposed) weights",
    "falcon": "x @ w.T linears, tied embedding",
    "bert": "position and token-type embeddings at constant ids",
    "t5_encoder": "relative attention bias gathered at constant buckets",
    "vit": "cls token concatenated, position embedding",
    "resnet": "eval-mode batch norm affine",
    "roberta": "cumsum of a mask, gather of a buffer",
}
STEPS = 3


def _cases() -> list[Any]:
    return [pytest.param(c, id=c.name, marks=() if c.name in DEFAULT else pytest.mark.slow) for c in ZOO]


def _tolerance(case: ZooCase, adam: bool = False) -> float:
    return (1e-3 if adam else 1e-5) if case.name in FLOAT32_PARTS else 1e-9


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without transformers' notes about its kernels on CPU and torch.export's warnings."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def _rel(ours: Any, theirs: Any, floor: float) -> float:
    a, b = np.asarray(ours.detach(), np.float64), np.asarray(theirs.detach(), np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor, 1e-300)


@pytest.mark.parametrize("case", _cases())
def test_every_gradient_torch_gives_is_given_and_equal(case: ZooCase) -> None:
    with _quiet():
        module, batch, loss_fn = case.build()
        twin = copy.deepcopy(module)
        inputs = batch[: len(module.names)]
        fast = rt.parallelize(module, inputs, device="cpu:4")
        out = fast(*inputs)
        loss_fn(lambda *_: out, *batch).backward()
        loss_fn(twin, *batch).backward()
    theirs = dict(twin.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in theirs.values() if p.grad is not None)
    tol = _tolerance(case)
    for name, p in module.named_parameters():
        want = theirs[name].grad
        if want is None:
            assert p.grad is None, f"{name}: torch gives no gradient, ours is {p.grad}"
            continue
        assert p.grad is not None, f"{name}: torch gives a gradient and ours is None (the parameter is frozen)"
        assert _rel(p.grad, want, 1e-6 * largest) <= tol, name


@pytest.mark.parametrize("case", _cases())
def test_three_adamw_steps_leave_every_parameter_equal_to_torch(case: ZooCase) -> None:
    with _quiet():
        module, batch, loss_fn = case.build()
        twin = copy.deepcopy(module)
        opt = rt.optim.AdamW(lr=1e-2, weight_decay=0.1)
        step = rt.train_step(module, loss_fn, batch, optimizer=opt, device="cpu:4")
        ours = [float(step(*batch)) for _ in range(STEPS)]
        theirs_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
        theirs = []
        noise: set[str] = set()  # parameters whose gradient is zero in exact arithmetic
        for k in range(STEPS):
            theirs_opt.zero_grad()
            loss = loss_fn(twin, *batch)
            loss.backward()
            if k == 0:
                grads = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
                largest = max(float(g.abs().max()) for g in grads.values())
                noise = {n for n, g in grads.items() if float(g.abs().max()) <= 1e-9 * largest}
            theirs_opt.step()
            theirs.append(float(loss))
    tol = _tolerance(case, adam=True)
    np.testing.assert_allclose(ours, theirs, rtol=tol)
    params = step.state_dict()["params"]
    trained = {k for k, p in twin.named_parameters() if p.grad is not None}
    assert set(params) == trained, f"trained here but not by torch: {sorted(set(params) - trained)}; " \
                                   f"by torch but not here: {sorted(trained - set(params))}"
    for name, p in twin.named_parameters():
        if name in noise:  # Adam scales rounding noise up to steps of lr: both moved by at most that
            assert float((params[name] - p.detach()).abs().max()) <= 2 * STEPS * 1e-2, name
        elif name in params:
            assert _rel(params[name], p, 1e-2) <= tol, name


def _dropout_cases() -> list[Any]:
    return [pytest.param(c, id=c.name, marks=() if c.name in ("bert", "gemma", "vit") else pytest.mark.slow)
            for c in ZOO if c.dropout]


@pytest.mark.parametrize("case", _dropout_cases())
def test_train_mode_dropout_draws_the_same_masks_on_any_device_count(case: ZooCase) -> None:
    """Dropout 0.1 everywhere the config has it, in train() mode: for one torch seed, one device and four
    give the same outputs (the masks are drawn per element of the whole tensor; the sums' order may differ
    in the last bits), and another seed draws other masks; three AdamW steps of train_step run."""
    with _quiet():
        module, batch, loss_fn = train_mode_case(case.name)
        inputs = batch[: len(module.names)]
        outs = {}
        for device in ("cpu:1", "cpu:4"):
            fast = rt.parallelize(module, inputs, device=device)
            assert fast.graph.rng_input is not None  # dropout, or stochastic depth's rand
            for seed in (3, 4) if device == "cpu:4" else range(3, 13):
                torch.manual_seed(seed)
                with torch.no_grad():
                    outs[device, seed] = fast(*inputs)
        step = rt.train_step(module, loss_fn, batch, optimizer=rt.optim.AdamW(lr=1e-3), device="cpu:2")
        torch.manual_seed(5)
        losses = [float(step(*batch)) for _ in range(STEPS)]
    tol = 1e-5 if case.name in FLOAT32_PARTS else 1e-10
    for seed in (3, 4):
        assert _rel(outs["cpu:4", seed], outs["cpu:1", seed], 0.0) <= tol
    # another seed, other masks (one plan: the same masks give the same bits); stochastic depth drops a whole
    # sample's branch with probability 0.05, a branch that ConvNeXt's layer scale makes small: ten seeds
    assert max(_rel(outs["cpu:1", seed], outs["cpu:1", 3], 0.0) for seed in range(4, 13)) > 0.0
    assert np.all(np.isfinite(losses))

"""Batch norm in training mode (torch's ``BatchNorm1d/2d/3d`` with ``module.train()``): each channel
normalized by its batch statistics as reductions over batch and space (split batches aggregate partial
sums: synchronized batch norm), and the running statistics and counter updated as the module's own forward
updates them, through ``rt.parallelize`` (forward and gradients; the module's buffers updated in place) and
``rt.train_step`` (the statistics are states of the step, read back by ``load_into`` and ``state_dict``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import relational_tensors as rt  # noqa: E402

nn, F = torch.nn, torch.nn.functional


def _resnet_stem() -> nn.Module:
    """conv (no bias) -> batch norm -> ReLU -> conv -> batch norm, as a ResNet block's first half."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 4, 3, bias=False), nn.BatchNorm2d(4, momentum=0.3)).train()


@pytest.mark.parametrize("device", ["cpu:1", "cpu:4"])
def test_parallelize_normalizes_by_the_batch_and_updates_the_buffers(device: str) -> None:
    model, twin = _resnet_stem(), _resnet_stem()
    fast = rt.parallelize(model, (torch.randn(6, 3, 8, 8),), device=device)
    for _ in range(3):  # three calls: each reads the statistics the last one left
        x = torch.randn(6, 3, 8, 8, requires_grad=True)
        y, want = fast(x), twin(x)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        ct = torch.randn_like(want)
        got = torch.autograd.grad(y, (x, *model.parameters()), ct)
        ref = torch.autograd.grad(want, (x, *twin.parameters()), ct)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    assert int(model[1].num_batches_tracked) == 3
    model.eval()  # eval mode reads the running statistics the train-mode calls left
    twin.eval()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(rt.parallelize(model, (x,), device=device)(x), twin(x), rtol=1e-5, atol=1e-5)


def test_a_bn_network_trains_as_torch_does() -> None:
    model, twin = _resnet_stem(), _resnet_stem()
    x, target = torch.randn(8, 3, 8, 8), torch.randn(8, 4, 6, 6)

    def loss_fn(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x), t)
    step = rt.train_step(model, loss_fn, (x, target), optimizer=rt.optim.AdamW(lr=1e-2), device="cpu:4")
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for k in range(4):
        xb = x + 0.1 * k
        ours = float(step(xb, target))
        opt.zero_grad()
        theirs = loss_fn(twin, xb, target)
        theirs.backward()
        opt.step()
        assert ours == pytest.approx(theirs.item(), rel=1e-5)
    state = step.state_dict()["model"]
    step.load_into()
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)
        torch.testing.assert_close(state[k], b, rtol=1e-4, atol=1e-5, msg=k)
    assert int(model[4].num_batches_tracked) == 4


def test_bfloat16_statistics_are_computed_in_float32() -> None:
    """A bf16 module: batch statistics in float32 (as torch's kernels compute them), the output and the
    running statistics rounded once to bf16: within bf16 rounding of torch's."""
    model, twin = _resnet_stem().to(torch.bfloat16), _resnet_stem().to(torch.bfloat16)
    x = torch.randn(6, 3, 8, 8, dtype=torch.bfloat16)
    y = rt.parallelize(model, (x,), device="cpu:2")(x)
    torch.testing.assert_close(y.float(), twin(x).float(), rtol=0.05, atol=0.05)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02, msg=k)

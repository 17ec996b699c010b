"""The block's training step with PyTorch's data parallelism: DDP and FSDP2, one process per device.

The step is ``bench/gpu_train.py``'s: the block's forward, the mean-square error against a random target
(in float32), the backward and ``torch.optim.AdamW`` with gpu_train's hyperparameters on float32 master
weights.  The weights are gpu_train's (``initial_weights`` with ``seed``) and so is the batch (``x``, then
``target``, standard normal from ``numpy.random.default_rng(seed + 1)``, rounded to the activation
dtype), so seed 0 reproduces its step exactly.  Activations are in ``ctx.dtype`` (bfloat16 on CUDA,
float32 on CPU).

* ``ddp``: ``DistributedDataParallel`` over the float32 parameters, the forward under
  ``torch.autocast(dtype)`` as gpu_train's eager step; DDP all-reduces (averages) the float32 gradients
  in buckets while the backward runs; ``AdamW(fused=True)``.
* ``fsdp``: FSDP2, ``fully_shard`` of the block (one unit, the root: its parameters are all-gathered
  together once before the forward and kept for the backward, as FSDP2 keeps a root's, and the gradients
  reduce-scattered after it), ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``: float32
  shards, parameters gathered in ``dtype``, gradients reduce-scattered in float32.  No autocast: the
  policy casts the parameters and the input is already in ``dtype``.  The optimizer is
  ``AdamW(fused=True)`` on the DTensor shards where torch runs the fused kernel on them; where it
  refuses (at construction or at the first step) the step falls back to ``foreach=True``, and the row's
  note says which ran.

Both split the global batch over the ranks by whole sequences (contiguous and balanced, as ``llama_dp``).
A sequence is not cut: cutting one causal sequence over ranks is sequence (context) parallelism, a
different strategy, so a batch smaller than the world (the 8K single sequence on two or more GPUs) is
:class:`NotApplicable`.  Where the sequences do not divide evenly, each rank's loss is weighted by
``share * world / batch``, so the average of the ranks' gradients (what DDP and FSDP2 reduce) is the
global batch's gradient and the step equals the single-process step over the whole batch.

>>> tiny = BlockShape(64, 8, 4, 128)
>>> x, t = train_batch(3, 8, tiny.d_model, 0)
>>> x.shape, t.shape, x.dtype.name
((3, 8, 64), (3, 8, 64), 'float32')
>>> loss_weight(1, 2, 3), loss_weight(2, 2, 3), loss_weight(2, 2, 4)
(0.6666666666666666, 1.3333333333333333, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .block import PARAMS, block_forward, param_shapes
from .common import BlockShape, Dist, NotApplicable, split_range

__all__ = ["TRAIN_STRATEGIES", "HYPER", "TrainPrepared", "TrainBlock", "train_weights", "train_batch",
           "loss_weight", "prepare_ddp", "prepare_fsdp", "reference_train", "compare_states", "state_keys"]


def _gpu_train() -> Any:
    """``bench/gpu_train.py``: the step's hyperparameters and initial weights come from there (``bench/`` is
    on the path of every entry point: ``run.py`` puts it there, the tests and ``multigpu.py`` run from it)."""
    import gpu_train

    return gpu_train


_GT = _gpu_train()
HYPER: dict[str, Any] = {"lr": _GT.LR, "betas": _GT.BETAS, "eps": _GT.ADAM_EPS, "weight_decay": _GT.WEIGHT_DECAY}


@dataclass
class TrainPrepared:
    """A training strategy set up on this rank: ``step()`` runs one step (forward, loss, backward, AdamW) and
    returns this rank's weighted loss, whose sum over the ranks divided by the world is the global batch's
    loss; ``state()`` returns every parameter and AdamW moment whole, on every rank (a collective for
    sharded states), keyed as :func:`state_keys`; ``optimizer()`` names the AdamW that ran (``fused``, or
    ``foreach`` and why); ``note`` says how the strategy holds and reduces the parameters."""

    step: Callable[[], torch.Tensor]
    state: Callable[[], dict[str, torch.Tensor]]
    optimizer: Callable[[], str]
    note: str = ""


def state_keys() -> list[str]:
    """``param.<name>``, ``exp_avg.<name>`` and ``exp_avg_sq.<name>`` for every parameter of the block."""
    return [f"{kind}.{n}" for n in PARAMS for kind in ("param", "exp_avg", "exp_avg_sq")]


def train_weights(shape: BlockShape, seed: int) -> dict[str, np.ndarray]:
    """gpu_train's float32 initial weights for ``shape`` (its ``initial_weights``; for the LLaMA-3-8B shape
    and seed 0, exactly the weights it trains)."""
    return _GT.initial_weights(shape.d_model, {k: list(v) for k, v in param_shapes(shape).items()}, seed)


def train_batch(batch: int, seq: int, d_model: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """gpu_train's input and target in float32: ``x`` then ``target``, standard normal from
    ``default_rng(seed + 1)``.  Rounding them to bfloat16 (torch or ml_dtypes, both to nearest even) gives
    the bits gpu_train feeds."""
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((batch, seq, d_model), dtype=np.float32)
    target = rng.standard_normal((batch, seq, d_model), dtype=np.float32)
    return x, target


def loss_weight(share: int, world: int, batch: int) -> float:
    """The factor on a rank's mean loss over ``share`` of ``batch`` sequences such that the average over the
    ``world`` ranks of the weighted gradients is the gradient of the mean over the whole batch."""
    return share * world / batch


class TrainBlock(torch.nn.Module):
    """The block as a module: its parameters under the names of :data:`PARAMS`, the forward of
    :func:`block_forward`."""

    def __init__(self, weights: Mapping[str, torch.Tensor], shape: BlockShape) -> None:
        super().__init__()
        self.shape = shape
        for name in PARAMS:
            self.register_parameter(name, torch.nn.Parameter(weights[name]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(x, {n: getattr(self, n) for n in PARAMS}, self.shape)


class _AdamW:
    """``torch.optim.AdamW(fused=True)`` with gpu_train's hyperparameters; if torch refuses the fused kernel
    for these parameters (at construction or at the first step, before any update) it is rebuilt with
    ``foreach=True``.  ``kind`` says which runs."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.kind, self.stepped = "fused", False
        try:
            self.opt = torch.optim.AdamW(self.params, fused=True, **HYPER)
        except (RuntimeError, ValueError, TypeError) as e:
            self.opt = self._foreach(f"fused refused: {type(e).__name__}: {str(e)[:120]}")

    def _foreach(self, why: str) -> torch.optim.AdamW:
        self.kind = f"foreach ({why})"
        return torch.optim.AdamW(self.params, foreach=True, **HYPER)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        if self.stepped or not self.kind.startswith("fused"):
            self.opt.step()
        else:
            try:
                self.opt.step()
            except (RuntimeError, NotImplementedError, TypeError) as e:
                self.opt = self._foreach(f"fused failed at the first step: {type(e).__name__}: {str(e)[:120]}")
                self.opt.step()
        self.stepped = True

    def moments(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.opt.state[p]
        return st["exp_avg"], st["exp_avg_sq"]


def _local_batch(ctx: Dist, batch: int, seq: int, shape: BlockShape, seed: int,
                 strategy: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This rank's sequences of the global batch (input and target in ``ctx.dtype``) and its loss weight."""
    if batch < ctx.world:
        raise NotApplicable(f"{strategy} gives every rank whole sequences of the global batch, so it needs "
                            f"batch >= world; got batch={batch}, world={ctx.world} (one sequence of {seq} "
                            f"tokens is not cut: that is sequence parallelism).")
    r0, r1 = split_range(batch, ctx.world, ctx.rank)
    x, target = train_batch(batch, seq, shape.d_model, seed)
    xt, tt = (torch.from_numpy(np.ascontiguousarray(a[r0:r1])).to(ctx.device).to(ctx.dtype) for a in (x, target))
    return xt, tt, loss_weight(r1 - r0, ctx.world, batch)


def _weights(shape: BlockShape, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device) for k, v in train_weights(shape, seed).items()}


def _autocast(ctx_device: torch.device, dtype: torch.dtype) -> Any:
    return torch.autocast(ctx_device.type, dtype=dtype, enabled=dtype != torch.float32)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), a plain tensor as it is; detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def _states(model: torch.nn.Module, opt: _AdamW) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in PARAMS:  # the same order on every rank: full_tensor is a collective
        p = getattr(model, name)
        m, v = opt.moments(p)
        out[f"param.{name}"], out[f"exp_avg.{name}"], out[f"exp_avg_sq.{name}"] = _full(p), _full(m), _full(v)
    return out


def prepare_ddp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> TrainPrepared:
    """DDP on this rank: the whole float32 weights, its sequences, the forward under autocast."""
    from torch.nn.parallel import DistributedDataParallel

    x, target, weight = _local_batch(ctx, batch, seq, shape, seed, "ddp")
    block = TrainBlock(_weights(shape, seed, ctx.device), shape)
    model = DistributedDataParallel(block, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = _AdamW(model.parameters())

    def step() -> torch.Tensor:
        opt.zero_grad()
        with _autocast(ctx.device, ctx.dtype):
            y = model(x)
        loss = F.mse_loss(y.float(), target.float()) * weight
        loss.backward()
        opt.step()
        return loss.detach()

    return TrainPrepared(step, lambda: _states(block, opt), lambda: opt.kind,
                         "DDP: float32 parameters, "
                         + (f"autocast {_name(ctx.dtype)}" if ctx.dtype != torch.float32 else "no autocast")
                         + ", float32 all-reduce")


def prepare_fsdp(ctx: Dist, shape: BlockShape, batch: int, seq: int, seed: int) -> TrainPrepared:
    """FSDP2 on this rank: a shard of the float32 weights (gathered in ``ctx.dtype``), its sequences."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x, target, weight = _local_batch(ctx, batch, seq, shape, seed, "fsdp")
    block = TrainBlock(_weights(shape, seed, ctx.device), shape)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=ctx.dtype, reduce_dtype=torch.float32))
    opt = _AdamW(block.parameters())

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(block(x).float(), target.float()) * weight
        loss.backward()
        opt.step()
        return loss.detach()

    return TrainPrepared(step, lambda: _states(block, opt), lambda: opt.kind,
                         f"FSDP2: float32 shards gathered in {_name(ctx.dtype)}, float32 reduce-scatter")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


TRAIN_STRATEGIES: dict[str, Callable[[Dist, BlockShape, int, int, int], TrainPrepared]] = {
    "ddp": prepare_ddp, "fsdp": prepare_fsdp,
}


def reference_train(batch: int, seq: int, shape: BlockShape, seed: int, device: torch.device, dtype: torch.dtype,
                    steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The single-process eager step over the whole batch, ``steps`` times: the parameters and moments after
    them and the loss of each step.  The forward runs under autocast when ``dtype`` is not float32."""
    block = TrainBlock(_weights(shape, seed, device), shape)
    opt = _AdamW(block.parameters())
    x, target = (torch.from_numpy(a).to(device).to(dtype) for a in train_batch(batch, seq, shape.d_model, seed))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with _autocast(device, dtype):
            y = block(x)
        loss = F.mse_loss(y.float(), target.float())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return _states(block, opt), losses


def compare_states(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], steps: int) -> dict[str, float]:
    """How far ``got`` is from ``want``: parameters as the largest difference over ``lr * steps`` (AdamW moves
    an element by about lr per step whatever its gradient, so this is the fraction of the largest move), and
    each moment as the largest difference over the largest magnitude of that tensor.  AdamW's update hardly
    depends on the gradients' scale, so the moments (which do) are what catches a wrong reduction."""
    out = {"params_max_over_lr_steps": 0.0, "exp_avg_max_rel": 0.0, "exp_avg_sq_max_rel": 0.0}
    for key, ref in want.items():
        kind = key.split(".")[0]
        diff = float((got[key].float().cpu() - ref.float().cpu()).abs().max())
        if kind == "param":
            out["params_max_over_lr_steps"] = max(out["params_max_over_lr_steps"], diff / (HYPER["lr"] * steps))
        else:
            scale = float(ref.float().abs().max()) or 1.0
            out[f"{kind}_max_rel"] = max(out[f"{kind}_max_rel"], diff / scale)
    return out

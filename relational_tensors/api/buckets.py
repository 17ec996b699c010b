"""Sequence buckets: ``rt.parallelize(model, example, bucket=[64, 128, 256])`` pads a call's sequence up to
a bucket length, so that calls of many lengths share a few compiled programs.

The sequence length ``S`` of a call is axis 1 of its first tensor input of rank 2 or more (``input_ids``
[batch, seq]); it becomes ``P``, the smallest bucket at least ``S`` (``S`` itself past the largest), or
``bucket(S)`` for a function.  Every tensor input of rank 2 or more whose axis 1 has size ``S`` is padded on
the right with zeros up to ``P`` (token 0; ``attention_mask`` 0, so the padded keys are masked), and each
output's sequence axes are cut back to ``S``.

Padding changes a module's results unless the padded positions are masked, so it is checked, not assumed:
the first call a program runs padded also runs the module eagerly (eval mode, no grad) on the inputs as
given and as padded.  The outputs must have the same structure, differ in size only on axes that are
``S`` long unpadded and ``P`` long padded (the sequence axes cut afterwards), and agree elsewhere at
1e-9 (float64), 1e-4 (float32) or 1e-2 (16-bit) of the largest magnitude; positions where the call's own
``attention_mask`` keyword is 0 are not compared (they hold what the model computes for padding).  A module
that fails is refused with the output that changed: an encoder called without ``attention_mask``, a loss
over ``labels``, pooling over the sequence without the mask.  Causal decoders need no mask: a position sees
no later one.

>>> import pytest; torch = pytest.importorskip("torch")
>>> b = Buckets([16, 64])
>>> b.length(5), b.length(16), b.length(17), b.length(100)
(16, 16, 64, 100)
>>> padded = b.pad([torch.ones(2, 5, dtype=torch.long), 1.5])
>>> tuple(padded.flat[0].shape), padded.length, padded.padded
((2, 16), 5, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relational_tensors.api.program import in_modes
from relational_tensors.errors import ExecError, GraphError
from relational_tensors.frontend.torch.convert import _torch

__all__ = ["Buckets", "Padded", "Unpad"]

# how far the padded call may differ from the call as given, of the largest magnitude, per dtype
_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}


@dataclass(frozen=True)
class Padded:
    """A call's flattened inputs padded to a bucket: ``length`` was the sequence length, ``to`` is the bucket's."""

    flat: list[Any]
    length: int
    to: int

    @property
    def padded(self) -> bool:
        return self.to != self.length


class Unpad:
    """Cuts each output leaf's sequence axes (``axes[i]`` for leaf i) back to the call's length."""

    def __init__(self, axes: list[tuple[int, ...]]) -> None:
        self.axes = axes

    def __call__(self, out: Any, length: int) -> Any:
        pytree = _torch().utils._pytree
        leaves, spec = pytree.tree_flatten(out)
        cut = [x[tuple(slice(0, length) if d in ax else slice(None) for d in range(x.dim()))] if ax else x
               for x, ax in zip(leaves, self.axes)]
        return pytree.tree_unflatten(cut, spec)


class Buckets:
    """The bucket lengths a sequence is padded up to: a list of lengths, or a function of the length."""

    def __init__(self, bucket: Sequence[int] | Callable[[int], int]) -> None:
        self.fn: Callable[[int], int] | None = None
        self.lengths: tuple[int, ...] = ()
        if callable(bucket):
            self.fn = bucket
            return
        try:
            lengths = sorted({int(b) for b in bucket})
        except (TypeError, ValueError):
            raise GraphError(f"bucket is a list of sequence lengths or a function of the length; got {bucket!r}."
                             ) from None
        if not lengths or lengths[0] < 1:
            raise GraphError(f"bucket lengths are positive; got {list(bucket)!r}.")
        self.lengths = tuple(lengths)

    def length(self, n: int) -> int:
        """The length a sequence of ``n`` is padded to."""
        if self.fn is not None:
            to = self.fn(n)
            if not isinstance(to, int) or to < n:
                raise ExecError(f"bucket({n}) must be an int at least {n} (a length to pad up to); got {to!r}.")
            return to
        return next((b for b in self.lengths if b >= n), n)

    def pad(self, flat: Sequence[Any]) -> Padded | None:
        """``flat`` with the sequence axis of its tensors padded to the bucket (None: no tensor has one)."""
        torch = _torch()
        first = next((x for x in flat if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
        if first is None:
            return None
        n = int(first.shape[1])
        to = self.length(n)
        if to == n:
            return Padded(list(flat), n, n)
        fn = torch.nn.functional
        out = [fn.pad(x, (0, 0) * (x.dim() - 2) + (0, to - n)) if isinstance(x, torch.Tensor) and x.dim() >= 2
               and x.shape[1] == n else x for x in flat]
        return Padded(out, n, to)

    def check(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], padded_call: Any,
              padded: Padded) -> Unpad:
        """What cuts ``module``'s outputs back after padding, once its eager outputs on the call as given and
        as padded (``padded_call``: (args, kwargs)) are found to agree (see the module's docstring)."""
        torch = _torch()
        pytree = torch.utils._pytree
        n, to = padded.length, padded.to
        with torch.no_grad(), in_modes(module, tuple(False for _ in module.modules())):
            want = module(*args, **kwargs)
            got = module(*padded_call[0], **padded_call[1])
        (want_leaves, want_spec), (got_leaves, got_spec) = pytree.tree_flatten(want), pytree.tree_flatten(got)
        where = f"padding the sequence from {n} to {to} (bucket=)"
        fix = ("Pad only a module that masks the padded positions: call it with attention_mask=, or leave bucket= "
               "out (recompile=True compiles each length).")
        if str(want_spec) != str(got_spec):
            raise ExecError(f"{where} changes the structure of {type(module).__name__}'s output. {fix}")
        mask = kwargs.get("attention_mask")
        axes: list[tuple[int, ...]] = []
        for k, (a, b) in enumerate(zip(want_leaves, got_leaves)):
            what = f"{where} changes output leaf {k} of {type(module).__name__}"
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
                    raise ExecError(f"{what} ({a!r} -> {b!r}). {fix}")
                axes.append(())
                continue
            ax = tuple(d for d in range(a.dim()) if a.dim() == b.dim() and a.shape[d] != b.shape[d])
            if a.dim() != b.dim() or any(a.shape[d] != n or b.shape[d] != to for d in ax):
                raise ExecError(f"{what}: shape {tuple(a.shape)} becomes {tuple(b.shape)}, not only a sequence axis "
                                f"{n} -> {to}. {fix}")
            cut = b[tuple(slice(0, n) if d in ax else slice(None) for d in range(b.dim()))]
            a, cut = a.detach().cpu(), cut.detach().cpu()
            if a.is_floating_point():
                diff = (cut.double() - a.double()).abs()
                if isinstance(mask, torch.Tensor) and mask.dim() == 2 and 1 in ax and tuple(a.shape[:2]) == tuple(
                        mask.shape):  # positions the call masks itself hold what the model computes for padding
                    diff = diff * mask.detach().cpu().to(torch.float64).reshape(*mask.shape, *(1,) * (a.dim() - 2))
                scale = max(float(a.double().abs().max()) if a.numel() else 0.0, 1e-30)
                err = float(diff.max()) / scale if diff.numel() else 0.0
                tol = _TOLERANCE.get(str(a.dtype).removeprefix("torch."), 1e-4)
                if not err <= tol:
                    raise ExecError(f"{what} at real positions by {err:.2e} of its largest magnitude (more than "
                                    f"{tol:g}). {fix}")
            elif not torch.equal(a, cut):
                raise ExecError(f"{what} at real positions. {fix}")
            axes.append(ax)
        return Unpad(axes)

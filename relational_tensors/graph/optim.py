"""Optimizers as graph code: the update of a training step, with PyTorch's exact rules.

``sgd`` and ``adamw`` append to a graph the operators that compute each parameter's next value from its
gradient, and assign it (``g.assign``): the parameters must be states (``g.state``), which persist across
executions.  The optimizer's own states (moments, momentum buffers, the step count) are added as states
too; :meth:`Optimizer.initial` gives the values to load before the first step (torch's: zeros, step 0).
``lr`` is a [1] tensor (a graph input, so a schedule changes it without recompiling) or a number.
``clip_grad_norm`` scales gradients to a global norm, as ``torch.nn.utils.clip_grad_norm_`` does.

>>> import relational_tensors as rt
>>> g = rt.Graph(); x = g.input("x", [4, 3]); w = g.state("w", [3, 2])
>>> loss = g.sum(g.unary(g.matmul(x, w), "square"), axis=(0, 1))
>>> opt = sgd(g, [w], g.grad(loss, [w]), lr=0.1, momentum=0.9)
>>> sorted(opt.initial())
['w.momentum_buffer', 'w.sgd_first_step']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.numbers import is_number
from relational_tensors.errors import GraphError
from relational_tensors.graph.graph import Graph, Tensor

__all__ = ["Optimizer", "sgd", "adamw", "clip_grad_norm", "AdamW", "SGD"]


@dataclass
class Optimizer:
    """The states an optimizer added to a graph, with their initial values."""

    kind: str
    states: dict[str, tuple[Tensor, float]] = field(default_factory=dict)  # name -> (state, initial fill)
    masters: dict[str, str] = field(default_factory=dict)  # master weight state -> the parameter it copies

    def initial(self, params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        """The values to load into the optimizer's states before the first step; master weights
        (``master_dtype``) start as copies of the parameters' values, given in ``params``."""
        out = {name: np.full(t.shape, fill, dtype=numpy_dtype(t.dtype)) for name, (t, fill) in self.states.items()
               if name not in self.masters}
        for name, param in self.masters.items():
            if params is None or param not in params:
                raise GraphError(f"the master weights {name!r} start as a copy of {param!r}: pass the parameters' "
                                 "initial values, opt.initial({name: array, ...}).")
            t = self.states[name][0]
            out[name] = np.asarray(params[param], dtype=np.float64).astype(numpy_dtype(t.dtype))
        return out

    def _state(self, g: Graph, name: str, like: Tensor, fill: float = 0.0, shape: Sequence[int] | None = None,
               dtype: str | None = None) -> Tensor:
        t = g.state(name, list(shape or like.shape), dtype or like.dtype)
        g.optimizer_states.add(t.id)
        self.states[name] = (t, fill)
        return t


def _scoped(fn: Any) -> Any:
    """Name the operators ``fn`` appends ``optim.<kind>_<n>`` (memory reports count them as the update)."""
    import functools

    @functools.wraps(fn)
    def run(g: Graph, *args: Any, **kwargs: Any) -> Any:
        scope, g.name_scope = g.name_scope, "optim."
        try:
            return fn(g, *args, **kwargs)
        finally:
            g.name_scope = scope
    return run


def _check(g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    if len(params) != len(grads) or not params:
        raise GraphError(f"an optimizer takes one gradient per parameter; got {len(params)} parameters and "
                         f"{len(grads)} gradients.")
    for p, d in zip(params, grads):
        if p.node.role != "state":
            raise GraphError(f"an optimizer updates states: make {p.name!r} with g.state(...) instead of "
                             f"g.{p.node.role}(...), so its new value can be assigned.")
        if d.shape != p.shape:
            raise GraphError(f"the gradient of {p.name!r} must have its shape {p.shape}; got {d.shape}.")


def _rate(g: Graph, lr: Tensor | float, like: Tensor, what: str = "lr") -> Tensor | float:
    """``lr`` as a [1] tensor of the parameter's dtype, or a finite number."""
    if isinstance(lr, Tensor):
        if lr.graph is not g or lr.shape != (1,):
            raise GraphError(f"{what} must be a number or a [1] tensor of this graph; got {lr!r}.")
        return lr if lr.dtype == like.dtype else g.cast(lr, like.dtype)
    if not is_number(lr) or not math.isfinite(float(lr)) or float(lr) < 0:
        raise GraphError(f"{what} must be a finite number >= 0 or a [1] tensor; got {lr!r}.")
    return float(lr)


def _times(g: Graph, x: Tensor, a: Tensor | float) -> Tensor:
    """x · a for a number or a [1] tensor a."""
    return g.unary(x, "scale", a) if isinstance(a, float) else g.mul(x, a)


def _number(what: str, value: object, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False) -> float:
    ok = is_number(value) and lo <= float(value) and (float(value) < hi if hi_open else float(value) <= hi)  # type: ignore[arg-type]
    if not ok or not math.isfinite(float(value)):  # type: ignore[arg-type]
        bound = f"[{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise GraphError(f"{what} must be a finite number in {bound}; got {value!r}.")
    return float(value)  # type: ignore[arg-type]


def _master(g: Graph, opt: Optimizer, p: Tensor, d: Tensor, master_dtype: str | None) -> tuple[Tensor, Tensor]:
    """The tensor the update works on: ``p`` itself, or its master copy in ``master_dtype`` (mixed precision:
    16-bit parameters, float32 master weights and optimizer states), with the gradient in that dtype."""
    if master_dtype is None or master_dtype == p.dtype:
        return p, d
    master = opt._state(g, f"{p.name}.master", p, dtype=master_dtype)
    opt.masters[master.name] = p.name
    return master, (d if d.dtype == master_dtype else g.cast(d, master_dtype))


def _write(g: Graph, p: Tensor, work: Tensor, new: Tensor) -> None:
    """Assign the update: to the parameter, or to its master copy and the parameter rounded from it."""
    if work is p:
        g.assign(p, new)
    else:
        g.assign(work, new)
        g.assign(p, g.cast(new, p.dtype))


@_scoped
def clip_grad_norm(g: Graph, grads: Sequence[Tensor], max_norm: float) -> list[Tensor]:
    """The gradients scaled by min(1, max_norm / (‖grads‖₂ + 1e-6)), the global 2-norm over all of them
    (``torch.nn.utils.clip_grad_norm_``)."""
    max_norm = _number("max_norm", max_norm)
    if not grads:
        raise GraphError("clip_grad_norm needs at least one gradient.")
    squares = [g.sum(g.unary(d, "square"), axis=tuple(range(d.rank))) for d in grads]
    total = squares[0]
    for sq in squares[1:]:
        total = g.add(total, sq)
    norm = g.unary(g.unary(total, "sqrt"), "add_scalar", 1e-6)
    coef = g.unary(g.unary(norm, "pow", -1.0), "scale", max_norm)
    coef = g.binary(coef, g.unary(coef, "fill", 1.0), "minimum")
    return [g.mul(d, coef if coef.dtype == d.dtype else g.cast(coef, d.dtype)) for d in grads]


@_scoped
def sgd(g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Tensor | float, momentum: float = 0.0,
        dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
        maximize: bool = False, master_dtype: str | None = None) -> Optimizer:
    """``torch.optim.SGD``'s update of each parameter, assigned to it (with ``master_dtype``, kept in master
    weights of that dtype and rounded into the parameter)."""
    _check(g, params, grads)
    momentum, dampening = _number("momentum", momentum), _number("dampening", dampening)
    weight_decay = _number("weight_decay", weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise GraphError("Nesterov momentum needs momentum > 0 and dampening 0 (torch's rule).")
    opt = Optimizer("sgd")
    for p0, d0 in zip(params, grads):
        p, d = _master(g, opt, p0, d0, master_dtype)
        rate = _rate(g, lr, p)
        if maximize:
            d = g.unary(d, "neg")
        if weight_decay:
            d = g.add(d, g.unary(p, "scale", weight_decay))
        if momentum:
            buf = opt._state(g, f"{p.name}.momentum_buffer", p)
            first = opt._state(g, f"{p.name}.sgd_first_step", p, 1.0, shape=[1])  # 1 until the first step
            later = g.add(g.unary(buf, "scale", momentum), g.unary(d, "scale", 1.0 - dampening))
            # torch's buffer starts as a copy of the first step's gradient
            new_buf = g.add(g.mul(d, first), g.mul(later, g.unary(g.unary(first, "neg"), "add_scalar", 1.0)))
            g.assign(buf, new_buf)
            g.assign(first, g.unary(first, "scale", 0.0))
            d = g.add(d, g.unary(new_buf, "scale", momentum)) if nesterov else new_buf
        _write(g, p0, p, g.sub(p, _times(g, d, rate)))
    return opt


@_scoped
def adamw(g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Tensor | float,
          betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
          maximize: bool = False, master_dtype: str | None = None) -> Optimizer:
    """``torch.optim.AdamW``'s update (decoupled weight decay, bias-corrected moments) of each parameter,
    assigned to it; the step count is one [1] state shared by the parameters.  With ``master_dtype`` (e.g.
    float32 for bfloat16 parameters) the update, the moments and master weights are in that dtype and the
    parameters are rounded from the masters after each step."""
    _check(g, params, grads)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise GraphError(f"betas must be a pair of numbers in [0, 1); got {betas!r}.")
    b1, b2 = (_number("betas", b, 0.0, 1.0, hi_open=True) for b in betas)
    eps, weight_decay = _number("eps", eps), _number("weight_decay", weight_decay)
    opt = Optimizer("adamw")
    step = opt._state(g, "adamw.step", params[0], 0.0, shape=[1], dtype=master_dtype or params[0].dtype)
    step = g.assign(step, g.unary(step, "add_scalar", 1.0))

    def correction(beta: float, t: Tensor) -> Tensor:  # 1 - beta ** step
        power = g.unary(g.unary(t, "scale", math.log(beta)), "exp") if beta > 0 else g.unary(t, "scale", 0.0)
        return g.unary(g.unary(power, "neg"), "add_scalar", 1.0)

    for p0, d0 in zip(params, grads):
        p, d = _master(g, opt, p0, d0, master_dtype)
        rate = _rate(g, lr, p)
        t = step if step.dtype == p.dtype else g.cast(step, p.dtype)
        if maximize:
            d = g.unary(d, "neg")
        m = opt._state(g, f"{p.name}.exp_avg", p)
        v = opt._state(g, f"{p.name}.exp_avg_sq", p)
        decayed = p  # torch: param.mul_(1 - lr * weight_decay)
        if weight_decay and isinstance(rate, Tensor):
            decayed = g.mul(p, g.unary(g.unary(rate, "scale", -weight_decay), "add_scalar", 1.0))
        elif weight_decay and isinstance(rate, float):
            decayed = g.unary(p, "scale", 1.0 - rate * weight_decay)
        new_m = g.add(m, g.unary(g.sub(d, m), "scale", 1.0 - b1))  # torch's lerp
        new_v = g.add(g.unary(v, "scale", b2), g.unary(g.mul(d, d), "scale", 1.0 - b2))
        g.assign(m, new_m)
        g.assign(v, new_v)
        step_size = g.div(rate, correction(b1, t)) if isinstance(rate, Tensor) else \
            g.unary(g.unary(correction(b1, t), "pow", -1.0), "scale", rate)
        denom = g.unary(g.div(g.unary(new_v, "sqrt"), g.unary(correction(b2, t), "sqrt")), "add_scalar", eps)
        _write(g, p0, p, g.sub(decayed, g.mul(g.div(new_m, denom), step_size)))
    return opt


def _clipped(g: Graph, grads: Sequence[Tensor], max_norm: float | None, master_dtype: str | None) -> list[Tensor]:
    """The gradients in the master dtype (when there is one), clipped to ``max_norm`` (when given)."""
    out = [g.cast(d, master_dtype) if master_dtype and d.dtype != master_dtype else d for d in grads]
    return clip_grad_norm(g, out, max_norm) if max_norm is not None else out


@dataclass(frozen=True)
class AdamW:
    """``torch.optim.AdamW``'s arguments, for ``rt.train_step`` (plus ``max_grad_norm``: clip first)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None
    master_dtype: str | None = None

    def build(self, g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Tensor) -> Optimizer:
        grads = _clipped(g, grads, self.max_grad_norm, self.master_dtype)
        return adamw(g, params, grads, lr, self.betas, self.eps, self.weight_decay, master_dtype=self.master_dtype)


@dataclass(frozen=True)
class SGD:
    """``torch.optim.SGD``'s arguments, for ``rt.train_step`` (plus ``max_grad_norm``: clip first)."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    max_grad_norm: float | None = None
    master_dtype: str | None = None

    def build(self, g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Tensor) -> Optimizer:
        grads = _clipped(g, grads, self.max_grad_norm, self.master_dtype)
        return sgd(g, params, grads, lr, self.momentum, self.dampening, self.weight_decay, self.nesterov,
                   master_dtype=self.master_dtype)

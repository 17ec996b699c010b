"""Optimizers as graph code: the update of a training step, with PyTorch's exact rules.

``sgd`` and ``adamw`` append to a graph the operators that compute each parameter's next value from its
gradient, and assign it (``g.assign``): the parameters must be states (``g.state``), which persist across
executions.  The optimizer's own states (moments, momentum buffers, the step count) are added as states
too; :meth:`Optimizer.initial` gives the values to load before the first step (torch's: zeros, step 0).
``lr`` is a [1] tensor (a graph input, so a schedule changes it without recompiling) or a number.
``clip_grad_norm`` scales gradients to a global norm, as ``torch.nn.utils.clip_grad_norm_`` does.

Every hyperparameter (``lr``, ``weight_decay``, ``betas``, ``eps``, ``momentum``, ...) takes one value for
all parameters or a list of one per parameter: torch's parameter groups become constants per parameter
(``AdamW(param_groups=...)`` builds those lists).  ``accumulate`` sums gradients over executions into states,
and ``gate=`` makes an update take effect only in executions where the gate is 1 (gradient accumulation).

>>> import relational_tensors as rt
>>> g = rt.Graph(); x = g.input("x", [4, 3]); w = g.state("w", [3, 2])
>>> loss = g.sum(g.unary(g.matmul(x, w), "square"), axis=(0, 1))
>>> opt = sgd(g, [w], g.grad(loss, [w]), lr=0.1, momentum=0.9)
>>> sorted(opt.initial())
['w.momentum_buffer', 'w.sgd_first_step']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.numbers import is_number
from relational_tensors.errors import GraphError
from relational_tensors.graph.graph import Graph, Tensor

__all__ = ["Optimizer", "sgd", "adamw", "accumulate", "clip_grad_norm", "AdamW", "SGD"]

Rate = Tensor | float  # a learning rate: a [1] tensor of the graph (an input: no recompile) or a number


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


def _each(what: str, value: Any, n: int, nested: bool = False) -> list[Any]:
    """``value`` for each of ``n`` parameters: one value for all, or a list of one per parameter (``nested``:
    the value itself is a pair, as ``betas``, so a list of pairs is per parameter)."""
    per = isinstance(value, (list, tuple)) and (not nested or (len(value) > 0 and isinstance(value[0], (list, tuple))))
    if not per:
        return [value] * n
    if len(value) != n:
        raise GraphError(f"{what} takes one value for all parameters or one per parameter ({n}); got {len(value)} "
                         f"values: {value!r}.")
    return list(value)


def _rate(g: Graph, lr: Rate, like: Tensor, what: str = "lr") -> Rate:
    """``lr`` as a [1] tensor of the parameter's dtype, or a finite number."""
    if isinstance(lr, Tensor):
        if lr.graph is not g or lr.shape != (1,):
            raise GraphError(f"{what} must be a number or a [1] tensor of this graph; got {lr!r}.")
        return lr if lr.dtype == like.dtype else g.cast(lr, like.dtype)
    if not is_number(lr) or not math.isfinite(float(lr)) or float(lr) < 0:
        raise GraphError(f"{what} must be a finite number >= 0 or a [1] tensor; got {lr!r}.")
    return float(lr)


def _times(g: Graph, x: Tensor, a: Rate) -> Tensor:
    """x · a for a number or a [1] tensor a."""
    return g.unary(x, "scale", a) if isinstance(a, float) else g.mul(x, a)


def _number(what: str, value: object, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False) -> float:
    ok = is_number(value) and lo <= float(value) and (float(value) < hi if hi_open else float(value) <= hi)  # type: ignore[arg-type]
    if not ok or not math.isfinite(float(value)):  # type: ignore[arg-type]
        bound = f"[{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise GraphError(f"{what} must be a finite number in {bound}; got {value!r}.")
    return float(value)  # type: ignore[arg-type]


def _assign(g: Graph, state: Tensor, new: Tensor) -> None:
    """``g.assign(state, new)``, ``new`` in the state's shape: a 0-d parameter's update, computed with the
    [1]-shaped scalars (learning rate, step, gate), broadcasts to [1]."""
    scalar = state.shape == () and new.shape == (1,)  # only that case: any other mismatch is refused by assign
    g.assign(state, g.reshape(new, []) if scalar else new)


class _Put:
    """``g.assign``, or with a ``gate`` ([1], 0 or 1) the gated assignment ``new·gate + old·(1 - gate)``:
    exactly ``new`` where the gate is 1 and exactly ``old`` where it is 0 (x·1 = x and x + 0 = x in floating
    point), so an update computed in every execution takes effect only in some."""

    def __init__(self, g: Graph, gate: Tensor | None) -> None:
        if gate is not None and (gate.graph is not g or gate.shape != (1,)):
            raise GraphError(f"a gate must be a [1] tensor of this graph (1: apply the update, 0: keep the states); "
                             f"got {gate!r}.")
        self.g, self.gate = g, gate
        self._by_dtype: dict[str, tuple[Tensor, Tensor]] = {}

    def factors(self, dtype: str) -> tuple[Tensor, Tensor]:
        """(gate, 1 - gate) in ``dtype``."""
        assert self.gate is not None
        if dtype not in self._by_dtype:
            on = self.gate if self.gate.dtype == dtype else self.g.cast(self.gate, dtype)
            self._by_dtype[dtype] = (on, self.g.unary(self.g.unary(on, "neg"), "add_scalar", 1.0))
        return self._by_dtype[dtype]

    def __call__(self, state: Tensor, new: Tensor) -> None:
        if self.gate is not None:
            on, off = self.factors(state.dtype)
            new = self.g.add(self.g.mul(new, on), self.g.mul(state, off))
        _assign(self.g, state, new)


def _master(g: Graph, opt: Optimizer, p: Tensor, d: Tensor, master_dtype: str | None) -> tuple[Tensor, Tensor]:
    """The tensor the update works on: ``p`` itself, or its master copy in ``master_dtype`` (mixed precision:
    16-bit parameters, float32 master weights and optimizer states), with the gradient in that dtype."""
    if master_dtype is None or master_dtype == p.dtype:
        return p, d
    master = opt._state(g, f"{p.name}.master", p, dtype=master_dtype)
    opt.masters[master.name] = p.name
    return master, (d if d.dtype == master_dtype else g.cast(d, master_dtype))


def _write(put: _Put, p: Tensor, work: Tensor, new: Tensor) -> None:
    """Assign the update: to the parameter, or to its master copy and the parameter rounded from it."""
    put(work, new)
    if work is not p:
        put(p, put.g.cast(new, p.dtype))


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
def accumulate(g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor],
               apply: Tensor) -> tuple[list[Tensor], Optimizer]:
    """Gradient accumulation: each gradient plus the state ``<param>.grad_accum`` (zeros at first), what the
    executions since the last one where ``apply`` ([1]: 0 or 1) was 1 summed; after an execution where it
    is 1 the sums start again from zero.  Returns the sums (the gradients to apply, gated by ``apply``) and
    the accumulator states.  Scale each micro-batch's loss by 1/k for the mean, as torch's ``loss / k``.

    >>> import relational_tensors as rt
    >>> g = rt.Graph(); w = g.state("w", [3]); apply = g.input("apply", [1])
    >>> sums, acc = accumulate(g, [w], g.grad(g.sum(g.unary(w, "square"), axis=0), [w]), apply)
    >>> sorted(acc.initial())
    ['w.grad_accum']
    """
    if len(params) != len(grads) or not params:
        raise GraphError(f"accumulate takes one gradient per parameter; got {len(params)} parameters and "
                         f"{len(grads)} gradients.")
    put = _Put(g, apply)
    acc = Optimizer("accumulate")
    out = []
    for p, d in zip(params, grads):
        held = acc._state(g, f"{p.name}.grad_accum", d)
        total = g.add(held, d)
        _assign(g, held, g.mul(total, put.factors(total.dtype)[1]))  # zero after an applying execution
        out.append(total)
    return out, acc


@_scoped
def sgd(g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Rate | Sequence[Rate],
        momentum: float | Sequence[float] = 0.0, dampening: float | Sequence[float] = 0.0,
        weight_decay: float | Sequence[float] = 0.0, nesterov: bool | Sequence[bool] = False,
        maximize: bool = False, master_dtype: str | None = None, gate: Tensor | None = None) -> Optimizer:
    """``torch.optim.SGD``'s update of each parameter, assigned to it (with ``master_dtype``, kept in master
    weights of that dtype and rounded into the parameter; with ``gate``, only where the gate is 1).
    Hyperparameters are one value or one per parameter."""
    _check(g, params, grads)
    n, put = len(params), _Put(g, gate)
    rates = _each("lr", lr, n)
    hyper = zip(_each("momentum", momentum, n), _each("dampening", dampening, n),
                _each("weight_decay", weight_decay, n), _each("nesterov", nesterov, n))
    opt = Optimizer("sgd")
    for p0, d0, rate0, (mom, damp, wd, nest) in zip(params, grads, rates, hyper):
        mom, damp, wd = _number("momentum", mom), _number("dampening", damp), _number("weight_decay", wd)
        if nest and (mom <= 0 or damp != 0):
            raise GraphError(f"Nesterov momentum needs momentum > 0 and dampening 0 (torch's rule); got momentum "
                             f"{mom:g} and dampening {damp:g} for {p0.name!r}.")
        p, d = _master(g, opt, p0, d0, master_dtype)
        rate = _rate(g, rate0, p)
        if maximize:
            d = g.unary(d, "neg")
        if wd:
            d = g.add(d, g.unary(p, "scale", wd))
        if mom:
            buf = opt._state(g, f"{p.name}.momentum_buffer", p)
            first = opt._state(g, f"{p.name}.sgd_first_step", p, 1.0, shape=[1])  # 1 until the first step
            later = g.add(g.unary(buf, "scale", mom), g.unary(d, "scale", 1.0 - damp))
            # torch's buffer starts as a copy of the first step's gradient
            new_buf = g.add(g.mul(d, first), g.mul(later, g.unary(g.unary(first, "neg"), "add_scalar", 1.0)))
            put(buf, new_buf)
            put(first, g.unary(first, "scale", 0.0))
            d = g.add(d, g.unary(new_buf, "scale", mom)) if nest else new_buf
        _write(put, p0, p, g.sub(p, _times(g, d, rate)))
    return opt


@_scoped
def adamw(g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Rate | Sequence[Rate],
          betas: tuple[float, float] | Sequence[tuple[float, float]] = (0.9, 0.999),
          eps: float | Sequence[float] = 1e-8, weight_decay: float | Sequence[float] = 0.01,
          maximize: bool = False, master_dtype: str | None = None,
          decoupled_weight_decay: bool | Sequence[bool] = True, gate: Tensor | None = None) -> Optimizer:
    """``torch.optim.AdamW``'s update (decoupled weight decay, bias-corrected moments) of each parameter,
    assigned to it; the step count is one [1] state shared by the parameters.  With ``master_dtype`` (e.g.
    float32 for bfloat16 parameters) the update, the moments and master weights are in that dtype and the
    parameters are rounded from the masters after each step.  ``decoupled_weight_decay=False`` is
    ``torch.optim.Adam``'s L2 penalty (the decay added to the gradient); with ``gate``, the states change only
    where the gate is 1.  Hyperparameters are one value or one per parameter."""
    _check(g, params, grads)
    n, put = len(params), _Put(g, gate)
    rates = _each("lr", lr, n)
    hyper = zip(_each("betas", betas, n, nested=True), _each("eps", eps, n), _each("weight_decay", weight_decay, n),
                _each("decoupled_weight_decay", decoupled_weight_decay, n))
    opt = Optimizer("adamw")
    # the step count and the bias corrections are float32 (float64 for float64 parameters), as torch's: in a
    # 16-bit dtype the count stops at 256 and 1 - 0.999 ** 1 rounds to 0
    wide = "float64" if "float64" in (master_dtype, params[0].dtype) else "float32"
    step = opt._state(g, "adamw.step", params[0], 0.0, shape=[1], dtype=wide)
    new_step = g.unary(step, "add_scalar", 1.0)
    put(step, new_step)

    made: dict[tuple[float, bool, str], Tensor] = {}

    def correction(beta: float, root: bool, dtype: str) -> Tensor:
        """1 - beta ** step, or its square root, computed in the step's dtype and given in ``dtype``."""
        key = (beta, root, dtype)
        if key not in made:
            power = g.unary(g.unary(new_step, "scale", math.log(beta)), "exp") if beta > 0 else \
                g.unary(new_step, "scale", 0.0)
            c = g.unary(g.unary(power, "neg"), "add_scalar", 1.0)
            c = g.unary(c, "sqrt") if root else c
            made[key] = c if dtype == wide else g.cast(c, dtype)
        return made[key]

    for p0, d0, rate0, (pair, eps_p, wd, decoupled) in zip(params, grads, rates, hyper):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise GraphError(f"betas must be a pair of numbers in [0, 1); got {pair!r} for {p0.name!r}.")
        b1, b2 = (_number("betas", b, 0.0, 1.0, hi_open=True) for b in pair)
        eps_p, wd = _number("eps", eps_p), _number("weight_decay", wd)
        p, d = _master(g, opt, p0, d0, master_dtype)
        rate = _rate(g, rate0, p)
        if maximize:
            d = g.unary(d, "neg")
        m = opt._state(g, f"{p.name}.exp_avg", p)
        v = opt._state(g, f"{p.name}.exp_avg_sq", p)
        decayed = p  # AdamW: param.mul_(1 - lr * weight_decay); Adam: grad + weight_decay * param
        if wd and not decoupled:
            d = g.add(d, g.unary(p, "scale", wd))
        elif wd and isinstance(rate, Tensor):
            decayed = g.mul(p, g.unary(g.unary(rate, "scale", -wd), "add_scalar", 1.0))
        elif wd and isinstance(rate, float):
            decayed = g.unary(p, "scale", 1.0 - rate * wd)
        new_m = g.add(m, g.unary(g.sub(d, m), "scale", 1.0 - b1))  # torch's lerp
        new_v = g.add(g.unary(v, "scale", b2), g.unary(g.mul(d, d), "scale", 1.0 - b2))
        put(m, new_m)
        put(v, new_v)
        if isinstance(rate, Tensor):
            step_size = g.div(rate, correction(b1, False, p.dtype))
        else:
            step_size = g.unary(g.unary(correction(b1, False, wide), "pow", -1.0), "scale", rate)
            step_size = step_size if p.dtype == wide else g.cast(step_size, p.dtype)
        denom = g.unary(g.div(g.unary(new_v, "sqrt"), correction(b2, True, p.dtype)), "add_scalar", eps_p)
        _write(put, p0, p, g.sub(decayed, g.mul(g.div(new_m, denom), step_size)))
    return opt


class _Spec:
    """What ``AdamW`` and ``SGD`` share: parameter groups, and building the update into a graph.

    ``param_groups`` follows torch's: a list of dicts, each with ``params`` (state names; ``rt.train_step``
    also takes the module's parameter names or the ``torch.nn.Parameter`` objects) and any hyperparameter of
    ``GROUP_KEYS`` that differs from the optimizer's.  Each parameter gets its group's hyperparameters as
    constants of the graph; the learning rate stays an input: ``build`` takes one lr tensor per group, or one
    for all, which each group multiplies by its ratio ``group lr / optimizer lr``.
    """

    GROUP_KEYS: ClassVar[tuple[str, ...]] = ()
    lr: float
    param_groups: Sequence[Mapping[str, Any]]
    max_grad_norm: float | None
    master_dtype: str | None

    def __post_init__(self) -> None:
        """Every hyperparameter checked as torch checks it (and finite), the optimizer's and each group's."""
        for i, h in enumerate(self.groups()):
            where = "" if not self.param_groups else f" (parameter group {i})"
            for key, value in h.items():
                if key == "lr":
                    _number(f"{type(self).__name__} lr{where}", value)
                elif key == "betas":
                    if not isinstance(value, (tuple, list)) or len(value) != 2:
                        raise GraphError(f"betas{where} is a pair of numbers in [0, 1); got {value!r}.")
                    for k, b in enumerate(value):
                        _number(f"betas[{k}]{where}", b, 0.0, 1.0, hi_open=True)
                elif key in ("eps", "weight_decay", "momentum", "dampening"):
                    _number(f"{key}{where}", value)
                elif key in ("nesterov", "decoupled_weight_decay") and not isinstance(value, bool):
                    raise GraphError(f"{key}{where} is True or False; got {value!r}.")
            if h.get("nesterov") and (h.get("momentum", 0) <= 0 or h.get("dampening", 0) != 0):
                raise GraphError(f"Nesterov momentum{where} needs momentum > 0 and dampening 0 (torch's rule); got "
                                 f"momentum={h.get('momentum')}, dampening={h.get('dampening')}.")
        if self.max_grad_norm is not None and _number("max_grad_norm", self.max_grad_norm) == 0:
            raise GraphError("max_grad_norm is a positive number (or None: no clipping); got 0.")

    def groups(self) -> list[dict[str, Any]]:
        """Each parameter group's hyperparameters (the optimizer's, overridden by the group's own) and its
        ``params``; with no ``param_groups``, one group whose ``params`` is None (every parameter).

        >>> groups = [{"params": ["w"]}, {"params": ["b"], "weight_decay": 0}]
        >>> spec = AdamW(lr=1e-2, weight_decay=0.1, param_groups=groups)
        >>> [(h["params"], h["lr"], h["weight_decay"]) for h in spec.groups()]
        [(['w'], 0.01, 0.1), (['b'], 0.01, 0)]
        """
        base = {k: getattr(self, k) for k in self.GROUP_KEYS}
        if not self.param_groups:
            return [{**base, "params": None}]
        out = []
        for i, group in enumerate(self.param_groups):
            if not isinstance(group, Mapping) or "params" not in group:
                raise GraphError(f"a parameter group is a dict with 'params' and any of {list(self.GROUP_KEYS)}; "
                                 f"group {i} is {group!r}.")
            unknown = sorted(set(group) - {"params", *self.GROUP_KEYS})
            if unknown:
                raise GraphError(f"a parameter group of {type(self).__name__} may set {list(self.GROUP_KEYS)}; "
                                 f"group {i} sets {unknown}. Remove them, or use the optimizer that has them.")
            params = group["params"]
            if not (isinstance(params, str) or hasattr(params, "shape") or isinstance(params, Iterable)):
                raise GraphError(f"a parameter group's 'params' is a parameter or a list of them (state names, or "
                                 f"for rt.train_step the module's parameter names or tensors); group {i} has "
                                 f"{params!r}. Give it a list, e.g. {{'params': ['weight']}}.")
            params = [params] if isinstance(params, str) or hasattr(params, "shape") else list(params)
            out.append({**base, **{k: v for k, v in group.items() if k != "params"}, "params": params})
        return out

    def _group_of(self, params: Sequence[Tensor], groups: Sequence[int] | None,
                  hyper: list[dict[str, Any]]) -> list[int]:
        """The group of each parameter: ``groups`` as given, or found by state name in ``param_groups``."""
        if groups is not None:
            if len(groups) != len(params) or any(not 0 <= i < len(hyper) for i in groups):
                raise GraphError(f"groups= gives each of the {len(params)} parameters a group index below "
                                 f"{len(hyper)}; got {list(groups)}.")
            return list(groups)
        if hyper[0]["params"] is None:
            return [0] * len(params)
        where: dict[str, int] = {}
        for i, h in enumerate(hyper):
            for name in h["params"]:
                if not isinstance(name, str):
                    raise GraphError(f"parameter group {i} names a parameter by a tensor; here groups are matched by "
                                     "state name: list names, or pass groups= (rt.train_step resolves tensors).")
                if name in where:
                    raise GraphError(f"a parameter is in one group; {name!r} is in groups {where[name]} and {i}.")
                where[name] = i
        missing = [p.name for p in params if p.name not in where]
        if missing:
            raise GraphError(f"every parameter updated must be in a parameter group; got {missing} in none of the "
                             f"groups {[h['params'] for h in hyper]}. Add them to a group.")
        return [where[p.name] for p in params]

    def _rates(self, g: Graph, lr: Rate | Sequence[Rate | None], index: list[int],
               hyper: list[dict[str, Any]]) -> list[Rate]:
        """One learning rate per parameter: its group's lr input, or the one lr times the group's ratio."""
        if isinstance(lr, (list, tuple)):
            if len(lr) != len(hyper) or any(lr[i] is None for i in index):
                raise GraphError(f"build takes one lr per parameter group ({len(hyper)}, None only for a group "
                                 f"with no parameter here); got {len(lr)}: {list(lr)!r}.")
            return [lr[i] for i in index]  # type: ignore[misc]
        one = cast(Rate, lr)
        scaled: dict[int, Rate] = {}
        for i in sorted(set(index)):
            group_lr = _number("lr", hyper[i]["lr"])
            if group_lr == self.lr:
                scaled[i] = one
            elif not self.lr:
                raise GraphError(f"a group's lr is the optimizer's lr times a ratio, undefined when that lr is 0; "
                                 f"got group {i} lr {group_lr:g}. Give build one lr per group.")
            elif isinstance(one, Tensor):
                scaled[i] = g.unary(one, "scale", group_lr / self.lr)
            else:
                scaled[i] = float(one) * group_lr / self.lr
        return [scaled[i] for i in index]

    def build(self, g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], lr: Rate | Sequence[Rate | None],
              groups: Sequence[int] | None = None, apply: Tensor | None = None) -> Optimizer:
        """Append the update of ``params`` from ``grads`` to ``g``: clipped to ``max_grad_norm`` (when set),
        each parameter with its group's hyperparameters (``groups``: the group index of each parameter, else
        found by name), ``lr`` one [1] tensor per group or one for all.  With ``apply`` ([1], 0 or 1) the
        gradients accumulate over executions (``accumulate``) and the update (clipping included) applies
        their sum where ``apply`` is 1."""
        hyper = self.groups()
        index = self._group_of(params, groups, hyper)
        rates = self._rates(g, lr, index, hyper)
        master = self.master_dtype
        grads = [g.cast(d, master) if master and d.dtype != master else d for d in grads]
        acc = None
        if apply is not None:
            grads, acc = accumulate(g, params, grads, apply)
        if self.max_grad_norm is not None:
            grads = clip_grad_norm(g, grads, self.max_grad_norm)
        opt = self._update(g, params, grads, rates, [hyper[i] for i in index], apply)
        if acc is not None:
            opt.states = {**acc.states, **opt.states}
        return opt

    def _update(self, g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], rates: list[Rate],
                hyper: list[dict[str, Any]], gate: Tensor | None) -> Optimizer:
        raise NotImplementedError


@dataclass(frozen=True)
class AdamW(_Spec):
    """``torch.optim.AdamW``'s arguments, for ``rt.train_step`` (plus ``max_grad_norm``: clip first;
    ``param_groups``: torch's groups, see ``_Spec``; ``decoupled_weight_decay=False``: ``torch.optim.Adam``)."""

    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None
    master_dtype: str | None = None
    param_groups: Sequence[Mapping[str, Any]] = ()
    decoupled_weight_decay: bool = True

    def _update(self, g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], rates: list[Rate],
                hyper: list[dict[str, Any]], gate: Tensor | None) -> Optimizer:
        return adamw(g, params, grads, rates, [tuple(h["betas"]) for h in hyper], [h["eps"] for h in hyper],
                     [h["weight_decay"] for h in hyper], master_dtype=self.master_dtype,
                     decoupled_weight_decay=[bool(h["decoupled_weight_decay"]) for h in hyper], gate=gate)


@dataclass(frozen=True)
class SGD(_Spec):
    """``torch.optim.SGD``'s arguments, for ``rt.train_step`` (plus ``max_grad_norm``: clip first;
    ``param_groups``: torch's groups, see ``_Spec``)."""

    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    max_grad_norm: float | None = None
    master_dtype: str | None = None
    param_groups: Sequence[Mapping[str, Any]] = ()

    def _update(self, g: Graph, params: Sequence[Tensor], grads: Sequence[Tensor], rates: list[Rate],
                hyper: list[dict[str, Any]], gate: Tensor | None) -> Optimizer:
        return sgd(g, params, grads, rates, [h["momentum"] for h in hyper], [h["dampening"] for h in hyper],
                   [h["weight_decay"] for h in hyper], [bool(h["nesterov"]) for h in hyper],
                   master_dtype=self.master_dtype, gate=gate)

"""Torch optimizers and schedulers read into ``rt.train_step``'s graph optimizers, and torch's state_dict layout.

``resolve_optimizer(module, optimizer, lr_schedule)`` takes what a training user passes: ``rt.optim.AdamW``
or ``rt.optim.SGD`` (with or without ``param_groups``), or a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` built on
the module's parameters (its ``param_groups`` and hyperparameters read into the equivalent graph optimizer),
and a learning-rate schedule (a callable ``step -> lr`` or a torch ``LRScheduler`` of that torch optimizer).
It returns an :class:`OptimizerSetup`: the graph optimizer, each group's parameters under their
``named_parameters()`` names, in torch's order (the index of a parameter in a torch optimizer's state_dict),
and the torch objects that keep driving the learning rate.  ``param_groups_layout`` writes the groups as
``torch.optim.<cls>(...).state_dict()["param_groups"]`` has them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relational_tensors.errors import ExecError, GraphError
from relational_tensors.frontend.torch.convert import _torch
from relational_tensors.graph.optim import SGD, AdamW

__all__ = ["OptimizerSetup", "resolve_optimizer", "param_groups_layout", "compiled_hyperparameters", "same_value",
           "as_number", "torch_scalar_dtype", "check_rate"]


@dataclass
class OptimizerSetup:
    """What ``rt.train_step`` trains with: ``spec`` (the graph optimizer, one group per torch group),
    ``groups`` (each group's parameters, by first name, in torch's order), ``ratios`` (each group's lr over the
    optimizer's: ``step.lr = x`` gives group i ``x * ratios[i]``), ``lrs`` (each group's lr at the first step),
    the torch optimizer read (its ``param_groups`` then hold the live lrs) and the schedule."""

    spec: AdamW | SGD
    groups: list[list[str]]
    ratios: list[float]
    lrs: list[float]
    torch_optimizer: Any = None
    scheduler: Any = None  # a torch LRScheduler on torch_optimizer: stepped after each optimizer step
    schedule: Callable[[int], float] | None = None  # optimizer step index -> the optimizer's lr


def torch_scalar_dtype() -> Any:
    """The dtype of torch's ``state["step"]`` (``torch.optim.optimizer._get_scalar_dtype``)."""
    torch = _torch()
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _names(module: Any) -> tuple[dict[int, str], dict[str, str]]:
    """id(parameter) -> its first name in ``named_parameters()``; every name (tied ones too) -> first name."""
    first = {id(t): name for name, t in module.named_parameters()}
    alias = {name: first[id(t)] for name, t in module.named_parameters(remove_duplicate=False)}
    return first, alias


def _resolve_params(module: Any, entries: list[Any], where: str) -> list[str]:
    first, alias = _names(module)
    out = []
    for p in entries:
        name = alias.get(p) if isinstance(p, str) else first.get(id(p))
        if name is None:
            what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(getattr(p, 'shape', ()))}"
            raise GraphError(f"the optimizer's parameters must be the module's (matched by identity or by "
                             f"named_parameters() name); {where} holds {what}, which is not one of them. Build the "
                             f"optimizer on module.parameters() (or named groups of them).")
        out.append(name)
    return out


def as_number(value: Any) -> Any:
    """A torch hyperparameter as a plain number (torch accepts 0-d tensors for lr, betas, weight decay)."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple):
        return tuple(as_number(v) for v in value)
    return value


def check_rate(value: Any, where: str = "", fix: str = "") -> float:
    """``value`` as a learning rate, as torch takes one: a real number (or a one-element tensor), finite, >= 0.

    >>> check_rate(1e-2)
    0.01
    >>> check_rate(float("nan"))
    Traceback (most recent call last):
    ...
    relational_tensors.errors.ExecError: a learning rate is a finite number >= 0 (torch refuses others); got nan.
    """
    dtype = getattr(value, "dtype", None)
    complex_ = isinstance(value, complex) or getattr(dtype, "is_complex", False) is True or \
        getattr(dtype, "kind", "") == "c"
    rate = math.nan
    if not (complex_ or value is None or isinstance(value, (bool, str, bytes))):
        try:
            rate = float(value)
        except (TypeError, ValueError, RuntimeError):  # a list, a tensor of several elements
            pass
    if not 0 <= rate < math.inf:
        raise ExecError(f"a learning rate is a finite number >= 0 (torch refuses others); got {value!r}{where}.{fix}")
    return rate


def _checked_schedule(schedule: Callable[[int], Any]) -> Callable[[int], float]:
    """``schedule`` whose every lr is checked before a step takes it (a bad one is refused with nothing run)."""

    @functools.wraps(schedule)
    def checked(step: int) -> float:
        return check_rate(schedule(step), f" from lr_schedule({step})",
                          " Make the schedule return a finite float >= 0 for every step.")

    return checked


def _from_torch(module: Any, opt: Any) -> OptimizerSetup:
    """The graph optimizer equivalent to torch optimizer ``opt``: one group per torch group."""
    torch = _torch()
    kinds = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
    kind = kinds.get(type(opt))
    if kind is None:
        raise GraphError(f"train_step builds the update of torch.optim.AdamW, Adam and SGD (their exact rules); got "
                         f"{type(opt).__module__}.{type(opt).__qualname__}. Use one of those, or rt.optim.AdamW/SGD.")
    for i, group in enumerate(opt.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise GraphError(f"train_step's graph optimizers have no {flag}; got {flag}=True in param group {i} "
                                 f"of {type(opt).__name__}. Build the torch optimizer with {flag}=False.")
    groups = [_resolve_params(module, list(group["params"]), f"param group {i}")
              for i, group in enumerate(opt.param_groups)]
    keys = SGD.GROUP_KEYS if kind == "sgd" else AdamW.GROUP_KEYS
    hyper = [{k: as_number(group[k]) for k in keys if k in group} for group in opt.param_groups]
    defaults = {k: as_number(v) for k, v in opt.defaults.items() if k in keys}
    if kind == "adam":  # torch.optim.Adam: L2 penalty unless decoupled_weight_decay=True (then AdamW)
        defaults.setdefault("decoupled_weight_decay", False)
        for h in hyper:
            h.setdefault("decoupled_weight_decay", False)
    spec_params = [{"params": names, **h} for names, h in zip(groups, hyper)]
    spec: AdamW | SGD = SGD(**defaults, param_groups=spec_params) if kind == "sgd" else \
        AdamW(**defaults, param_groups=spec_params)
    base = float(as_number(opt.defaults["lr"]))
    initial = [float(as_number(group.get("initial_lr", group["lr"]))) for group in opt.param_groups]
    return OptimizerSetup(spec, groups, [lr / base if base else 1.0 for lr in initial],
                          [float(as_number(group["lr"])) for group in opt.param_groups], torch_optimizer=opt)


def _from_spec(module: Any, spec: AdamW | SGD) -> OptimizerSetup:
    if not spec.param_groups:  # as torch.optim.<cls>(module.parameters()): every parameter, frozen ones too
        groups = [[name for name, _ in module.named_parameters()]]
    else:
        groups = [_resolve_params(module, h["params"], f"param_groups[{i}]") for i, h in enumerate(spec.groups())]
    seen: dict[str, int] = {}
    for i, names in enumerate(groups):
        for name in names:
            if name in seen:
                raise GraphError(f"a parameter is in one parameter group; {name!r} is in groups {seen[name]} and {i}.")
            seen[name] = i
    lrs = [float(h["lr"]) for h in spec.groups()]
    return OptimizerSetup(spec, groups, [lr / spec.lr if spec.lr else 1.0 for lr in lrs], lrs)


def resolve_optimizer(module: Any, optimizer: Any, lr_schedule: Any) -> OptimizerSetup:
    """The graph optimizer, its groups and the learning-rate drivers for ``rt.train_step``; see the module
    docstring.  ``optimizer`` None is ``rt.optim.AdamW()`` (or the optimizer of a torch ``lr_schedule``)."""
    torch = _torch()
    scheduler = lr_schedule if isinstance(lr_schedule, torch.optim.lr_scheduler.LRScheduler) else None
    if scheduler is not None and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise GraphError("ReduceLROnPlateau steps on a metric, so train_step cannot step it; got it as lr_schedule. "
                         "Pass its torch optimizer as optimizer= and call scheduler.step(metric) yourself: each step "
                         "reads its lr from the optimizer's param_groups.")
    if scheduler is not None and optimizer is None:
        optimizer = scheduler.optimizer
    if optimizer is None:
        optimizer = AdamW()
    if isinstance(optimizer, (AdamW, SGD)):
        setup = _from_spec(module, optimizer)
    elif isinstance(optimizer, torch.optim.Optimizer):
        setup = _from_torch(module, optimizer)
    else:
        raise GraphError(f"optimizer must be rt.optim.AdamW(...) or rt.optim.SGD(...), or a torch.optim.AdamW, Adam "
                         f"or SGD built on the module's parameters; got {optimizer!r}.")
    if scheduler is not None:
        if scheduler.optimizer is not setup.torch_optimizer:
            raise GraphError("a torch lr_schedule must be built on the torch optimizer passed as optimizer= (its "
                             f"param_groups carry the lr); got a {type(scheduler).__name__} on another optimizer. "
                             "Build both on module.parameters() and pass both.")
        setup.scheduler = scheduler
    elif lr_schedule is not None:
        if not callable(lr_schedule):
            raise GraphError(f"lr_schedule must be a callable step -> lr or a torch LRScheduler; got {lr_schedule!r}.")
        setup.schedule = _checked_schedule(lr_schedule)
    return setup


def _template(spec: AdamW | SGD, group: dict[str, Any]) -> dict[str, Any]:
    """torch's own param_group dict for ``group``'s hyperparameters, every key in torch's order."""
    torch = _torch()
    args = {k: v for k, v in group.items() if k != "params"}
    if isinstance(spec, SGD):
        cls = torch.optim.SGD
    else:
        cls = torch.optim.AdamW if args.pop("decoupled_weight_decay") else torch.optim.Adam
        args["betas"] = tuple(args["betas"])
    return {k: v for k, v in cls([torch.zeros(1)], **args).param_groups[0].items() if k != "params"}


def param_groups_layout(setup: OptimizerSetup, lrs: list[float]) -> list[dict[str, Any]]:
    """The ``param_groups`` of a torch optimizer state_dict for these groups at learning rates ``lrs``: the
    torch optimizer's own groups where there is one, else what ``torch.optim.<cls>`` makes of the hyperparameters;
    ``params`` are the indices of the parameters in order."""
    if setup.torch_optimizer is not None:
        out = [{k: v for k, v in group.items() if k != "params"} for group in setup.torch_optimizer.param_groups]
    else:
        out = [_template(setup.spec, group) for group in setup.spec.groups()]
    start = 0
    for group, names, lr in zip(out, setup.groups, lrs):
        group["lr"] = lr
        group["params"] = list(range(start, start + len(names)))
        start += len(names)
    return out


def compiled_hyperparameters(setup: OptimizerSetup) -> list[dict[str, Any]]:
    """Per group, the hyperparameters compiled into the graph as constants, under torch's keys (what a loaded
    state_dict must agree with: only ``lr`` is an input)."""
    out = []
    for group in setup.spec.groups():
        h = {k: v for k, v in group.items() if k not in ("params", "lr")}
        h["maximize"] = False
        if not isinstance(setup.spec, SGD):
            h["amsgrad"] = False
        out.append(h)
    return out


def same_value(a: Any, b: Any) -> bool:
    """Hyperparameters equal as numbers (torch may hold them as tensors, tuples or lists)."""
    try:
        a, b = as_number(a), as_number(b)
    except (RuntimeError, ValueError):  # a tensor of several elements is no hyperparameter
        return False
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b) and \
            all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)

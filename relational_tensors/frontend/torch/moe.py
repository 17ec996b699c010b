"""Mixture-of-experts layers of transformers, traced in a form without data-dependent shapes.

transformers' MoE models keep their experts in one module with stacked weights (``gate_up_proj``
``[experts, 2 * intermediate, hidden]`` and ``down_proj``, or transposed, with or without biases; the
``use_experts_implementation`` interface), called as ``experts(hidden, top_k_index, top_k_weights)``.  Its
eager forward loops over the experts that were hit, with ``nonzero`` and ``index_add_``, which torch.export
cannot trace.  While ``from_torch`` traces, each such module computes the same sum in one of two forms,
chosen by the model's own setting (``config._experts_implementation``, transformers' knob):

* **grouped** (``"eager"``, the default, and ``"grouped_mm"``): the routed pairs sorted by expert and each
  row through its own expert only, with two operators of this package (``relational_tensors::route_index``
  and ``relational_tensors::grouped_mm``, torch custom ops whose translation rules give
  ``sql_specs/experts.py``'s operators), so the work is the routing's;
* **dense** (``"batched_mm"``, transformers' own batched form): every token through every expert, each
  expert's output weighted by the token's routing weight for it (zero where the router did not pick it),
  ``experts / top_k`` times the routed work.

In both the experts are an index the planner may split (expert parallelism), and the values are the
module's (float32 to rounding).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

from relational_tensors.errors import GraphError

__all__ = ["traceable_experts", "experts_modules", "experts_form", "custom_ops"]


def _is_experts(sub: Any) -> bool:
    """Whether ``sub`` is a transformers experts module of the stacked-weight interface."""
    import torch

    weights = [getattr(sub, n, None) for n in ("gate_up_proj", "up_proj")]
    return (isinstance(getattr(sub, "down_proj", None), torch.nn.Parameter)
            and any(isinstance(w, torch.nn.Parameter) for w in weights)
            and hasattr(sub, "num_experts") and (hasattr(sub, "_apply_gate") or hasattr(sub, "act_fn")))


def experts_modules(module: Any) -> list[tuple[str, Any]]:
    """The stacked-weight experts modules of ``module``, by name."""
    return [(name, sub) for name, sub in module.named_modules() if _is_experts(sub)]


def _dense_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output as the eager loop computes it, without data-dependent shapes."""
    import torch

    experts = torch.arange(self.num_experts, device=top_k_index.device)
    picked = top_k_index.unsqueeze(-1) == experts  # [tokens, k, experts]; a sentinel id picks none
    zero = torch.zeros((), dtype=top_k_weights.dtype, device=top_k_weights.device)
    combine = torch.where(picked, top_k_weights.unsqueeze(-1), zero).sum(1)  # [tokens, experts]
    # the interface's flags, as transformers' versions have them (a flag it lacks is off)
    gated, transposed = getattr(self, "has_gate", True), getattr(self, "is_transposed", False)
    biased = getattr(self, "has_bias", False)
    first = self.gate_up_proj if gated else self.up_proj
    h = torch.einsum("th,eho->teo" if transposed else "th,eoh->teo", hidden_states, first)
    if biased:
        h = h + (self.gate_up_proj_bias if gated else self.up_proj_bias)
    h = self._apply_gate(h) if gated else self.act_fn(h)
    y = torch.einsum("tei,eih->teh" if transposed else "tei,ehi->teh", h, self.down_proj)
    if biased:
        y = y + self.down_proj_bias
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    wide = torch.promote_types(y.dtype, combine.dtype)
    return torch.einsum("teh,te->th", y.to(wide), combine.to(wide)).to(hidden_states.dtype)


def experts_form(sub: Any) -> str:
    """``"dense"`` or ``"grouped"``: how the experts module ``sub`` is traced (the module docstring)."""
    impl = getattr(getattr(sub, "config", None), "_experts_implementation", None)
    return "dense" if impl == "batched_mm" else "grouped"


@functools.cache
def custom_ops() -> Any:
    """``torch.ops.relational_tensors``, with ``route_index`` and ``grouped_mm`` defined (once): eager
    implementations in torch (what a call outside a trace computes) and shape functions for tracing."""
    import torch

    lib = "relational_tensors"

    # the schemas are given: this module's annotations are strings (``from __future__ import annotations``)
    @torch.library.custom_op(f"{lib}::route_index", mutates_args=(),
                             schema="(Tensor ids, int experts, str what) -> Tensor")
    def route_index(ids: torch.Tensor, experts: int, what: str) -> torch.Tensor:
        flat = ids.reshape(-1)
        key = torch.where((flat >= 0) & (flat < experts), flat, experts)
        order = torch.sort(key, stable=True).indices
        if what == "token":
            return order // ids.shape[1]
        if what == "group":
            return key[order]
        return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device)) \
            .reshape(ids.shape)

    @route_index.register_fake
    def _(ids: torch.Tensor, experts: int, what: str) -> torch.Tensor:
        shape = ids.shape if what == "dest" else (ids.shape[0] * ids.shape[1],)
        return ids.new_empty(shape, dtype=torch.int64)

    @torch.library.custom_op(f"{lib}::grouped_mm", mutates_args=(),
                             schema="(Tensor xs, Tensor w, Tensor group, bool trans_w) -> Tensor")
    def grouped_mm(xs: torch.Tensor, w: torch.Tensor, group: torch.Tensor, trans_w: bool) -> torch.Tensor:
        w = w.transpose(1, 2) if trans_w else w
        out = xs.new_zeros((xs.shape[0], w.shape[2]))
        for e in range(w.shape[0]):  # each expert's rows through its weights (no [rows, h, f] gather)
            rows = group == e
            out[rows] = xs[rows] @ w[e]
        return out

    @grouped_mm.register_fake
    def _(xs: torch.Tensor, w: torch.Tensor, group: torch.Tensor, trans_w: bool) -> torch.Tensor:
        return xs.new_empty((xs.shape[0], w.shape[1] if trans_w else w.shape[2]))

    return getattr(torch.ops, lib)


def _grouped_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts' output as the eager loop computes it: the routed pairs sorted by expert, each row through
    its own expert (``custom_ops``), each token's rows gathered back and weighted."""
    import torch

    ops = custom_ops()
    token, dest, group = (ops.route_index(top_k_index, self.num_experts, what) for what in ("token", "dest", "group"))
    gated, transposed = getattr(self, "has_gate", True), getattr(self, "is_transposed", False)
    biased = getattr(self, "has_bias", False)
    first = self.gate_up_proj if gated else self.up_proj
    # stored [experts, out, in] (trans_w: read transposed) or, transposed, [experts, in, out]
    h = ops.grouped_mm(hidden_states[token], first, group, not transposed)
    if biased:
        h = h + (self.gate_up_proj_bias if gated else self.up_proj_bias)[group]
    h = self._apply_gate(h) if gated else self.act_fn(h)
    y = ops.grouped_mm(h, self.down_proj, group, not transposed)
    if biased:
        y = y + self.down_proj_bias[group]
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    wide = torch.promote_types(y.dtype, top_k_weights.dtype)
    return (y[dest].to(wide) * top_k_weights.unsqueeze(-1).to(wide)).sum(1).to(hidden_states.dtype)


@contextlib.contextmanager
def traceable_experts(module: Any) -> Iterator[None]:
    """Within the block, every stacked-weight experts module of ``module`` computes in a traceable form,
    grouped or dense (see the module docstring); a mixture-of-experts layer of another form is refused by
    name."""
    import torch

    found = experts_modules(module)
    inside = {id(sub) for _, sub in found}
    for name, sub in module.named_modules():
        experts = getattr(sub, "experts", None)
        if isinstance(experts, torch.nn.Module) and hasattr(sub, "gate") and id(experts) not in inside:
            raise GraphError(f"{type(module).__name__} has a mixture-of-experts layer ({name or 'the module'}: "
                             f"{type(sub).__name__}) whose experts are not one module of stacked weights "
                             "(transformers' experts interface: `gate_up_proj` and `down_proj` of shape "
                             "[experts, ...]); a loop over a list of experts has data-dependent shapes. Supported: "
                             "the transformers MoE models of that interface (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, "
                             "...).")
    for _, sub in found:
        form = _grouped_forward if experts_form(sub) == "grouped" else _dense_forward
        sub.forward = types.MethodType(form, sub)
    try:
        yield
    finally:
        for _, sub in found:
            vars(sub).pop("forward", None)

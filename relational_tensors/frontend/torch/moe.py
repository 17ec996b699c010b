"""Mixture-of-experts layers of transformers, traced in a form without data-dependent shapes.

transformers' MoE models keep their experts in one module with stacked weights (``gate_up_proj``
``[experts, 2 * intermediate, hidden]`` and ``down_proj``, or transposed, with or without biases; the
``use_experts_implementation`` interface), called as ``experts(hidden, top_k_index, top_k_weights)``.  Its
eager forward loops over the experts that were hit, with ``nonzero`` and ``index_add_``, which torch.export
cannot trace.  While ``from_torch`` traces, each such module computes the same sum densely: every token
through every expert, each expert's output weighted by the token's routing weight for it (zero where the
router did not pick it), as a product over the ``experts`` index that the planner may split (expert
parallelism).  The values are the module's (float32 to rounding); the work is ``experts / top_k`` times a
dispatch's (see docs/limits.md).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

from relational_tensors.errors import GraphError

__all__ = ["traceable_experts", "experts_modules"]


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


@contextlib.contextmanager
def traceable_experts(module: Any) -> Iterator[None]:
    """Within the block, every stacked-weight experts module of ``module`` computes densely (see the module
    docstring); a mixture-of-experts layer of another form is refused by name."""
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
        sub.forward = types.MethodType(_dense_forward, sub)
    try:
        yield
    finally:
        for _, sub in found:
            vars(sub).pop("forward", None)

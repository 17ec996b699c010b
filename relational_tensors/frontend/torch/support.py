"""The list of supported and refused PyTorch operations, generated from the rule registry
(docs/pytorch.md holds its output between ``<!-- torch-ops -->`` markers, and a test keeps the two equal).

``python -m relational_tensors.frontend.torch.support`` prints it.
"""

from __future__ import annotations

from collections import defaultdict

from relational_tensors.frontend.torch import translator
from relational_tensors.frontend.torch.registry import _RULES, REFUSED

__all__ = ["support_markdown"]

_FAMILIES = {"rules_conv": "convolution and pooling", "rules_elementwise": "elementwise and boolean",
             "rules_linalg": "matrix products",
             "rules_nn": "layers", "rules_random": "random draws (training)", "rules_reduce": "reductions",
             "rules_shape": "layout and shape"}


def support_markdown() -> str:
    """Markdown: the ATen operations with a built-in rule by family, and those refused with the reason."""
    by_family: dict[str, list[str]] = defaultdict(list)
    for name in translator.SUPPORTED_OPS:
        module = _RULES[name].__module__.rsplit(".", 1)[-1]
        by_family[_FAMILIES.get(module, module)].append(name)
    lines = ["| family | ATen operations translated |", "|---|---|"]
    for family in sorted(by_family):
        lines.append(f"| {family} | {', '.join(f'`{n}`' for n in sorted(by_family[family]))} |")
    reasons: dict[str, list[str]] = defaultdict(list)
    for name, why in REFUSED.items():
        reasons[why].append(name)
    lines += ["", "| refused | because |", "|---|---|"]
    for why, names in sorted(reasons.items(), key=lambda kv: sorted(kv[1])[0]):
        lines.append(f"| {', '.join(f'`{n}`' for n in sorted(names))} | {why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(support_markdown())

"""Every Python block of the manual (``docs/*.md``) runs as written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
BLOCKS = [(p.name, k, code) for p in DOCS
          for k, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


def _forget_torch_rules_defined_in(filename: str) -> None:
    """Drop the translation rules a block registered, so that no other test sees them."""
    registry = sys.modules.get("relational_tensors.frontend.torch.registry")
    if registry is None:
        return
    for name, rule in list(registry._RULES.items()):
        if getattr(getattr(rule, "__code__", None), "co_filename", None) == filename:
            del registry._RULES[name]


@pytest.mark.parametrize(("page", "k", "code"), BLOCKS, ids=[f"{p}-{k}" for p, k, _ in BLOCKS])
def test_doc_block_runs(page: str, k: int, code: str, tmp_path: Path, monkeypatch) -> None:
    if "import torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)  # blocks write their catalogs, traces and plan files in the working directory
    filename = f"docs/{page}"
    try:
        exec(compile(code, filename, "exec"), {})
    finally:
        _forget_torch_rules_defined_in(filename)

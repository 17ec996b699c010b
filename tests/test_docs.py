"""Every Python block of the manual (``docs/*.md``) runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
BLOCKS = [(p.name, k, code) for p in DOCS
          for k, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


@pytest.mark.parametrize(("page", "k", "code"), BLOCKS, ids=[f"{p}-{k}" for p, k, _ in BLOCKS])
def test_doc_block_runs(page: str, k: int, code: str) -> None:
    if "import torch" in code:
        pytest.importorskip("torch")
    exec(compile(code, f"docs/{page}", "exec"), {})

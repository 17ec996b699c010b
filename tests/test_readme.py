"""The README's examples run as written, and so do the manual's examples that other tests check more
closely than tests/test_docs.py does (each is found under its heading in its page of docs/)."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _page(name: str) -> str:
    return (ROOT / name).read_text()


def test_readme_example_runs() -> None:
    text = _page("README.md")
    section = text.split("## From graph to result", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), {})
    assert "plan for p=8" in out.getvalue() and "repartition_cost" in out.getvalue()


def test_readme_torch_example_runs() -> None:
    import pytest

    pytest.importorskip("torch")
    section = _page("README.md").split("## From PyTorch", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), scope)
    assert "plan for p=4" in out.getvalue()
    assert len(scope["losses"]) == 3 and all(math.isfinite(v) for v in scope["losses"])


def test_readme_training_example_runs() -> None:
    section = _page("docs/training.md").split("## Gradients and losses", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/training.md", "exec"), scope)
    assert set(scope["out"]) == {"loss"} | {f"grad.{p.name}" for p in scope["lm"].trainable()}
    assert scope["cg"].plan.p == 8


def test_readme_training_step_example_runs() -> None:
    section = _page("docs/training.md").split("## Training steps: states and optimizers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    import numpy as np

    import relational_tensors as rt
    scope: dict = {"np": np, "rt": rt}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "docs/training.md", "exec"), scope)
    losses = [float(line.strip("[]")) for line in out.getvalue().split()]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert scope["w1_now"].shape == (16, 32) and not np.allclose(scope["w1_now"], scope["states"]["w1"])


def test_readme_research_queries_run_and_print_what_the_readme_shows(tmp_path: Path, monkeypatch) -> None:
    section = _page("docs/sql.md").split("# Research with SQL", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)  # the example writes plans.duckdb in the working directory
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "docs/sql.md", "exec"), {})
    assert out.getvalue().rstrip("\n") == shown.rstrip("\n")


def test_readme_rule_example_adds_an_operation_the_frontend_does_not_know() -> None:
    import numpy as np
    import pytest

    torch = pytest.importorskip("torch")
    import relational_tensors as rt
    from relational_tensors.frontend.torch.registry import _RULES

    section = _page("docs/pytorch.md")
    code = next(c for c in re.findall(r"```python\n(.*?)```", section, re.S) if "register_torch_op(" in c)

    class Softplus(torch.nn.Module):
        def forward(self, x, beta: float = 1.0):
            return torch.nn.functional.softplus(x * 2.0, beta=self.beta) + x

    x = torch.randn(6, 10)
    m = Softplus()
    m.beta = 1.0
    assert "softplus" not in _RULES
    with pytest.raises(rt.GraphError, match="aten.softplus.default.*no translation rule"):
        rt.from_torch(m, (x,))
    try:
        exec(compile(code, "docs/pytorch.md", "exec"), {})
        fast = rt.parallelize(m, (x,), device="cpu:3")
        np.testing.assert_allclose(fast(x).numpy(), m(x).numpy(), rtol=1e-5, atol=1e-6)
        m.beta = 2.0
        with pytest.raises(rt.GraphError, match="softplus with beta=2.0; supported: beta=1"):
            rt.from_torch(m, (x,))
    finally:
        _RULES.pop("softplus", None)


def test_readme_lists_the_torch_operations_the_registry_has() -> None:
    import pytest

    pytest.importorskip("torch")
    from relational_tensors.frontend.torch.support import support_markdown

    listed = _page("docs/pytorch.md").split("<!-- torch-ops -->\n", 1)[1].split("\n<!-- /torch-ops -->", 1)[0]
    assert listed == support_markdown(), ("docs/pytorch.md's list of torch operations is stale; regenerate it with "
                                          "python -m relational_tensors.frontend.torch.support")


def test_readme_generation_example_runs() -> None:
    import pytest

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    section = _page("README.md").split("## From PyTorch", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(b for b in blocks if "rt.generate" in b)
    scope: dict = {"torch": torch, "rt": __import__("relational_tensors")}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["tokens"].shape == (2, 25)

"""The README's example from graph to result runs as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


def test_readme_example_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## From graph to result", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), {})
    assert "plan for p=8" in out.getvalue() and "repartition_cost" in out.getvalue()


def test_readme_training_example_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Training: gradients and losses", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert set(scope["out"]) == {"loss"} | {f"grad.{p.name}" for p in scope["lm"].trainable()}
    assert scope["cg"].plan.p == 8


def test_readme_training_step_example_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("### Training steps: states and optimizers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    import numpy as np

    import relational_tensors as rt
    scope: dict = {"np": np, "rt": rt}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), scope)
    losses = [float(line.strip("[]")) for line in out.getvalue().split()]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert scope["w1_now"].shape == (16, 32) and not np.allclose(scope["w1_now"], scope["states"]["w1"])


def test_readme_research_queries_run_and_print_what_the_readme_shows(tmp_path: Path, monkeypatch) -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Research with SQL", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)  # the example writes plans.duckdb in the working directory
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().rstrip("\n") == shown.rstrip("\n")

"""Where each operator kind runs on GPUs is declared and documented: every launcher that may leave the
device kernels says which forms do (``host_forms``), and docs/limits.md lists each such kind with its reason."""

from __future__ import annotations

import re
from pathlib import Path

from relational_tensors.driver.registry import describe, operator_rows, operator_table, problems

LIMITS = Path(__file__).resolve().parents[1] / "docs" / "limits.md"


def _documented() -> set[str]:
    section = LIMITS.read_text().split("## Operators off the device kernels", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| (\w+) \|", section, re.M)) - {"kind"}


def test_every_kind_off_the_device_kernels_is_documented() -> None:
    off = {r["kind"] for r in operator_rows() if r["gpu_form"] != "kernel"}
    assert off, "the registry lists no form off the device kernels; drop the docs table if that is true"
    missing = off - _documented()
    assert not missing, f"kinds that leave the device kernels without a row in docs/limits.md: {sorted(missing)}"
    stale = _documented() - off
    assert not stale, f"docs/limits.md lists kinds that now run in device kernels only: {sorted(stale)}"


def test_gpu_form_is_in_the_registry_and_the_catalog_table() -> None:
    assert problems() == []
    forms = dict(zip(operator_table()["kind"].to_pylist(), operator_table()["gpu_form"].to_pylist()))
    assert forms["matmul"] == "kernel"
    assert forms["sql"].startswith("host: ")
    assert forms["attention"] == "kernel"  # masks and biases included
    assert forms["attention_grad"].startswith("kernel except ") and "float64" in forms["attention_grad"]
    assert "on GPUs" in describe().splitlines()[0]


def test_a_launcher_that_may_allocate_must_say_which_forms_do() -> None:
    from relational_tensors.kernels.launchers.base import Launcher

    def nothing(*args: object) -> None:
        return None

    silent = {"attention": Launcher("attention", nothing, allocates=lambda op: True)}
    assert any("host_forms" in p for p in problems(launchers=silent))

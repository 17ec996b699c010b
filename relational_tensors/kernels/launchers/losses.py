"""Losses: cross-entropy, its gradient, and the count of tokens a mean divides by."""

from __future__ import annotations

from typing import Any

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import launcher


@launcher("cross_entropy")
def _cross_entropy(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_cross_entropy as tce

    tce.cross_entropy(ins[0], ins[1], ins[2], out, f.inputs[0].lower[-1], op.input_types[0].shape[-1],
                      op.ignore_index)


@launcher("cross_entropy_grad")
def _cross_entropy_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_cross_entropy as tce

    tce.cross_entropy_grad(ins[0], ins[1], ins[2], ins[3], out, f.inputs[0].lower[-1], op.input_types[0].shape[-1],
                           op.ignore_index)


@launcher("token_count")
def _token_count(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_cross_entropy as tce

    tce.token_count(ins[0], out, op.ignore_index)

"""Running the Triton kernel modules in tests: on a GPU as they are, without one in Triton's interpreter.

``kernel_module(name)`` imports a kernel module after asking for the interpreter (it must be the first
import of that module in the process, since Triton decides when a kernel is defined) and skips the
calling test module where that cannot be had.  In the interpreter a pointer argument must be a torch
tensor, so ``Tensors`` registers the tensors a test hands the kernels and stands in for the wrappers'
``Ptr``: an address is found in the registered tensor that holds it and viewed from there in the
pointer's dtype (a bool one as int8, as the kernels read it)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import numpy as np
import pytest

from relational_tensors.machine.devices import visible_gpus


def gpu_present() -> bool:
    torch = pytest.importorskip("torch")
    return visible_gpus() > 0 and torch.cuda.is_available()


def kernel_module(name: str) -> Any:
    """The kernel module ``name``, interpreted where there is no GPU (the calling test module is skipped
    where Triton is missing, or the module was already defined for a GPU)."""
    if not gpu_present():
        if name in sys.modules and not interpreted(sys.modules[name]):
            pytest.skip("the kernel module was defined for a GPU before this module could ask for the "
                        "interpreter", allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    return importlib.import_module(name)


def interpreted(module: Any) -> bool:
    """Whether ``module``'s kernels were defined for Triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return any(isinstance(v, InterpretedFunction) for v in vars(module).values())


class Tensors:
    """The tensors a test gives the kernels, and the ``Ptr`` the interpreter needs."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = "cuda" if gpu_present() else "cpu"
        self.held: list[Any] = []

    def buf(self, t: Any, strides: tuple[int, ...] | None = None) -> tuple[Any, Any]:
        """(a DevBuf over ``t`` on the test's device, the tensor holding it)."""
        from relational_tensors.kernels.common import DevBuf

        t = t.to(self.device)
        self.held.append(t)
        name = str(t.dtype).removeprefix("torch.")
        return DevBuf(t.data_ptr(), tuple(t.shape), name, 0, tuple(strides or t.stride())), t

    def ptr(self, buf: Any, dtype: str | None = None) -> Any:
        from relational_tensors.kernels.common import DevBuf

        torch = self.torch
        addr = buf.ptr if isinstance(buf, DevBuf) else int(buf)
        name = dtype or (buf.dtype if isinstance(buf, DevBuf) else "float32")
        want = torch.int8 if name == "bool" else getattr(torch, name)
        for t in self.held:
            raw = t.reshape(-1).view(torch.uint8)
            base = t.data_ptr()
            if base <= addr < base + raw.numel():
                size = torch.empty((), dtype=want).element_size()
                off = addr - base
                return raw[off:off + (raw.numel() - off) // size * size].view(want)
        raise AssertionError(f"pointer {addr:#x} lies in no registered tensor")

    def patch(self, monkeypatch: pytest.MonkeyPatch, *modules: Any, widen_dot: bool = False) -> None:
        """In the interpreter, ``modules``' ``Ptr`` resolves registered tensors; with ``widen_dot`` the
        interpreter's ``tl.dot``, which multiplies bfloat16 operands as their raw bits, gets them widened to
        float32 first (exact, and what the tensor cores compute)."""
        if self.device == "cuda":
            return
        for module in modules:
            monkeypatch.setattr(module, "Ptr", self.ptr)
        if widen_dot:
            widen_interpreted_dot(monkeypatch)


def widen_interpreted_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the interpreter's ``tl.dot`` multiply bfloat16 operands as the float32 values they are."""
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(h: Any) -> Any:
        if h.dtype == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, d, *rest: dot(self, widened(a), widened(b), d, *rest))

"""The GPU launcher of ``pad`` (zeros, then the block copied to its place) against the operator's NumPy
kernel, for blocks of split plans along and across the padded axis, into contiguous and strided outputs,
in float32, bfloat16, int64 and bool.  The results are copies, so they must be equal bit for bit.

Without a GPU the copy kernels run in Triton's interpreter on CPU."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

from relational_tensors.core.types import TensorType
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.sql_specs.shape import PadOp

torch = pytest.importorskip("torch")
GPU = visible_gpus() > 0 and torch.cuda.is_available()
_MODULE = "relational_tensors.kernels.triton_copy"
if not GPU and _MODULE in sys.modules:
    pytest.skip("the kernel module was defined for a GPU before this module could ask for the interpreter",
                allow_module_level=True)
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
K = importlib.import_module(_MODULE)

from relational_tensors.kernels.common import DevBuf  # noqa: E402
from relational_tensors.kernels.launchers import launcher_for  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool,
         "uint8": torch.uint8}
_TENSORS: list[object] = []


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    """In the interpreter a pointer argument must be a torch tensor: the one holding the address, viewed
    from there in the pointer's dtype (a bool one as int8)."""
    _TENSORS.clear()
    if not GPU:
        def ptr(buf, dtype=None):
            addr = buf.ptr if isinstance(buf, DevBuf) else int(buf)
            name = dtype or (buf.dtype if isinstance(buf, DevBuf) else "float32")
            want = torch.int8 if name == "bool" else TORCH[name]
            for t in _TENSORS:
                raw = t.view(-1).view(torch.uint8)
                base = t.data_ptr()
                if base <= addr < base + raw.numel():
                    size = torch.empty((), dtype=want).element_size()
                    off = addr - base
                    return raw[off:off + (raw.numel() - off) // size * size].view(want)
            raise AssertionError(f"pointer {addr:#x} lies in no registered tensor")
        monkeypatch.setattr(K, "Ptr", ptr)
    yield


def _buf(t, dtype: str, strides=None):
    t = t.to(DEVICE)
    _TENSORS.append(t)
    return DevBuf(t.data_ptr(), tuple(t.shape), dtype, 0, tuple(strides or t.stride())), t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
@pytest.mark.parametrize("strided", [False, True])
def test_pad_matches_the_operator(dtype: str, strided: bool) -> None:
    shape, axis, start, size = (3, 5, 4), 1, 2, 11
    op = PadOp((TensorType.zero(shape, dtype),), axis, start, size)
    g = np.random.default_rng(0)
    x = g.integers(1, 9, shape).astype(np.float32)
    x = (x > 4) if dtype == "bool" else x
    xt = torch.from_numpy(x).to(TORCH[dtype])
    zero, _ = _buf(torch.zeros(8, dtype=torch.uint8), "uint8")
    spec = op.spec({d.name: d.near_equal(k) for d, k in zip(op.shardable(), (1, 3, 2))})
    for f in spec.functions:
        block = xt[f.inputs[0].slices()]
        want = op.kernel([x[f.inputs[0].slices()]], f)
        xb, _ = _buf(block.contiguous(), dtype)
        if strided:  # the block a view inside a wider buffer: every other element of the last axis
            wide = torch.full((*f.output.shape[:-1], 2 * f.output.shape[-1]), 7, dtype=TORCH[dtype])
            ob, holder = _buf(wide, dtype)
            ob = DevBuf(ob.ptr, f.output.shape, dtype, 0, (*holder.stride()[:-1], 2))
            launcher_for("pad").launch(op, f, [xb], ob, {"zero": zero}, 0)
            got = holder.cpu()[..., ::2]
        else:
            ob, got = _buf(torch.full(f.output.shape, 7, dtype=TORCH[dtype]), dtype)
            launcher_for("pad").launch(op, f, [xb], ob, {"zero": zero}, 0)
            got = got.cpu()
        got = got.float().numpy() if dtype == "bfloat16" else got.numpy()
        np.testing.assert_array_equal(got, np.asarray(want).astype(got.dtype), err_msg=str(f))


def test_pad_is_captured_with_the_program() -> None:
    """No host copies: a program with a pad stays capturable in a CUDA graph."""
    from relational_tensors.kernels.launchers import HOST_KINDS, allocates

    assert "pad" not in HOST_KINDS
    assert not allocates(PadOp((TensorType.zero((2, 3), "bfloat16"),), 0, 1, 4))

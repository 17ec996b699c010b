"""The GPU launchers of the convolution and its gradients against the operator's NumPy kernels: 1, 2 and 3
spatial dimensions, strides, padding and dilation, the blocks of split plans (batch, channels and spatial
rows of x, y and dx; channels of dw, with batch and positions split into partials), float32 and bfloat16,
by each form: the GEMM form (im2col and one GEMM; the gradients one GEMM per kernel position, dx added
into the padded rows its taps reach) and cuDNN's (``kernels.cudnn_conv``, where its frontend is installed
and a GPU is present), whose block geometry (the rows read and the padding each side) is also checked
against the convolution's definition on random blocks.

Without a GPU the copy and add kernels run in Triton's interpreter on CPU and cuBLAS's GEMMs are stood in for
by torch on the same strided views (``einsum_gemm``'s contract: out = einsum(a, b), float32 accumulation;
``matmul``'s: out = a @ b)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpret import Tensors, gpu_present, kernel_module

from relational_tensors.core.types import TensorType
from relational_tensors.sql_specs.conv import ConvGradOp, ConvOp

torch = pytest.importorskip("torch")
TC = kernel_module("relational_tensors.kernels.triton_copy")
TE = kernel_module("relational_tensors.kernels.triton_elementwise")

from relational_tensors.kernels import blas, cudnn_conv  # noqa: E402
from relational_tensors.kernels.launchers import allocates, launcher_for, scratch_shape  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "bfloat16": 1e-2}  # of the block's largest magnitude: float32 sums in another order
T = Tensors()


def _view(buf):
    flat = T.ptr(buf)
    return torch.as_strided(flat, buf.shape, buf.strides)


def _einsum_gemm(a, b, out, la, lb, lo, stream):
    got = torch.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(lo)}", _view(a).float(), _view(b).float())
    _view(out).copy_(got.to(_view(out).dtype))
    return True


def _matmul(a, b, out, stream):
    _view(out).copy_(torch.matmul(_view(a).float(), _view(b).float()).to(_view(out).dtype))


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, TC, TE)
    if not gpu_present():
        monkeypatch.setattr(blas, "einsum_gemm", _einsum_gemm)
        monkeypatch.setattr(blas, "matmul", _matmul)


@pytest.fixture(params=["gemm", "cudnn"])
def form(request, monkeypatch):
    """Each form of the launchers: cuDNN's only where it is there (and a GPU with it)."""
    if request.param == "gemm":
        monkeypatch.setenv(cudnn_conv.CUDNN_ENV, "0")
    elif not (gpu_present() and cudnn_conv.available()):
        pytest.skip("cuDNN's frontend (nvidia-cudnn-frontend) or a GPU is missing")
    return request.param


CASES = [  # x shape, w shape, stride, padding, dilation
    ((2, 3, 11), (4, 3, 3), (2,), (1,), (1,)),
    ((2, 3, 9, 10), (5, 3, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((1, 2, 13, 12), (3, 2, 3, 2), (2, 3), (2, 1), (2, 1)),
    ((2, 4, 8, 8), (6, 4, 1, 1), (1, 1), (0, 0), (1, 1)),
    ((2, 4, 9, 8), (6, 4, 1, 1), (2, 3), (0, 0), (1, 1)),  # a strided 1×1 (ResNet's downsampling shortcut)
    ((1, 2, 6, 7, 5), (3, 2, 3, 2, 2), (1, 2, 1), (1, 0, 1), (1, 1, 1)),
]


def _run(op, f, arrays, dtype, kind="conv_grad"):
    bufs = [T.buf(torch.from_numpy(np.ascontiguousarray(a[box.slices()])).to(TORCH[dtype]))[0]
            for a, box in zip(arrays, f.inputs)]
    need = scratch_shape(op, f)
    consts = {}
    if need is not None:
        consts["scratch"] = T.buf(torch.full(need[0], float("nan"), dtype=getattr(torch, need[1])))[0]
    ob, got = T.buf(torch.full(f.output.shape, float("nan"), dtype=TORCH[dtype]))
    launcher_for(kind).launch(op, f, bufs, ob, consts, 0)
    return got.cpu().float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("part", ["dx", "dw"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-s{c[2]}-p{c[3]}-d{c[4]}" for c in CASES])
def test_conv_gradients_match_the_operator_on_split_blocks(case: tuple, part: str, dtype: str, form: str) -> None:
    xs, ws, stride, padding, dilation = case
    fwd = ConvOp((TensorType.zero(xs, dtype), TensorType.zero(ws, dtype)), stride, padding, dilation)
    ys = fwd.output_type.shape
    g = np.random.default_rng(0)
    x, w, dy = (torch.from_numpy(g.standard_normal(s).astype(np.float32)).to(TORCH[dtype]).float().numpy()
                for s in (xs, ws, ys))
    if part == "dx":
        op = ConvGradOp((TensorType.zero(ys, dtype), TensorType.zero(ws, dtype)), stride, padding, dilation,
                        part="dx", size=xs[2:])
        arrays = (dy, w)
    else:
        op = ConvGradOp((TensorType.zero(xs, dtype), TensorType.zero(ys, dtype)), stride, padding, dilation,
                        part="dw", size=ws[2:])
        arrays = (x, dy)
    assert not allocates(op)
    for request in ({}, {d.name: d.near_equal(min(2 if d.name[0] != "s" else 3, d.extent)) for d in op.requestable()}):
        spec = op.spec(request)
        for f in spec.functions:
            want = np.asarray(op.kernel([a[box.slices()] for a, box in zip(arrays, f.inputs)], f), np.float32)
            got = _run(op, f, arrays, dtype)
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale, err_msg=f"{part} {f}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-s{c[2]}-p{c[3]}-d{c[4]}" for c in CASES])
def test_convolution_matches_the_operator_on_split_blocks(case: tuple, dtype: str, form: str) -> None:
    xs, ws, stride, padding, dilation = case
    op = ConvOp((TensorType.zero(xs, dtype), TensorType.zero(ws, dtype)), stride, padding, dilation)
    g = np.random.default_rng(1)
    arrays = tuple(torch.from_numpy(g.standard_normal(s).astype(np.float32)).to(TORCH[dtype]).float().numpy()
                   for s in (xs, ws))
    assert not allocates(op)
    for request in ({}, {d.name: d.near_equal(min(2 if d.name[0] != "o" else 3, d.extent)) for d in op.requestable()}):
        for f in op.spec(request).functions:
            want = np.asarray(op.kernel([a[box.slices()] for a, box in zip(arrays, f.inputs)], f), np.float32)
            got = _run(op, f, arrays, dtype, kind="conv")
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale, err_msg=f"conv {f}")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_cudnn_block_geometry_reads_each_window_s_rows(data) -> None:
    """For output positions [o0, o0 + n) of a block whose input holds rows [lo, hi) (at least the rows that
    exist and the windows read), the rows skipped, read and padded make exactly n positions, and position j
    reads the rows the convolution's definition gives it."""
    k, s, d = (data.draw(st.integers(1, 4)) for _ in range(3))
    p = data.draw(st.integers(0, d * (k - 1)))
    size = data.draw(st.integers(d * (k - 1) + 1 - 2 * p if d * (k - 1) + 1 > 2 * p else 1, 40))
    n_out = (size + 2 * p - d * (k - 1) - 1) // s + 1
    o0 = data.draw(st.integers(0, n_out - 1))
    n = data.draw(st.integers(1, n_out - o0))
    first, last = o0 * s - p, (o0 + n - 1) * s - p + d * (k - 1)  # the rows the windows reach
    lo = data.draw(st.integers(0, max(0, min(first, size - 1))))
    hi = data.draw(st.integers(max(lo + 1, min(last + 1, size)), size))
    skip, rows, pre, post = cudnn_conv.geometry([lo], [hi], [o0], [n], [k], [s], [p], [d])
    assert 0 <= skip[0] and skip[0] + rows[0] <= hi - lo and pre[0] >= 0 and post[0] >= 0
    assert (rows[0] + pre[0] + post[0] - d * (k - 1) - 1) // s + 1 == n  # cuDNN's output size
    for j in range(n):
        for t in range(k):
            padded = j * s + t * d - pre[0]  # the row of the view position j's tap t reads (<0 or >=rows: padding)
            row = (o0 + j) * s - p + t * d  # the convolution's definition
            if 0 <= padded < rows[0]:
                assert lo + skip[0] + padded == row
            else:
                assert not 0 <= row < size, (j, t, row)  # padding only where the tensor has no row


def test_grouped_convolution_gradients_run_on_host_copies() -> None:
    op = ConvGradOp((TensorType.zero((1, 4, 6, 6)), TensorType.zero((4, 2, 3, 3))), (1, 1), (0, 0), (1, 1),
                    part="dx", size=(8, 8), groups=2)
    assert allocates(op)

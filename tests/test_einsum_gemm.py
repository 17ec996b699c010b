"""Einsums as one cuBLAS GEMM (gpu_exec/kernels/blas.einsum_gemm_plan): the planned call is run by a NumPy
model of cublasGemmStridedBatchedEx (column-major matrices at a pointer, a leading dimension and a batch
stride) over a flat memory, and must equal np.einsum; the matmul gradients the autodiff builds must be
planned as GEMMs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from relational_tensors.kernels.blas import Gemm, einsum_gemm_plan
from relational_tensors.kernels.common import DevBuf

ITEM = 8  # float64 bytes


def _view(mem: np.ndarray, ptr: int, buf: DevBuf) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(mem[ptr // ITEM:], buf.shape, tuple(s * ITEM for s in buf.strides))


def _cublas(g: Gemm, mem: np.ndarray, out_ptr: int) -> None:
    """cublasGemmStridedBatchedEx's arithmetic on ``mem``: C = op(A) op(B), all column-major."""

    def matrix(ptr: int, rows: int, cols: int, ld: int) -> np.ndarray:
        i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        return mem[ptr + i + j * ld]

    for n in range(g.batch):
        a = matrix(g.a // ITEM + n * g.stride_a, *((g.m, g.k) if g.op_a == 0 else (g.k, g.m)), g.lda)
        b = matrix(g.b // ITEM + n * g.stride_b, *((g.k, g.n) if g.op_b == 0 else (g.n, g.k)), g.ldb)
        c = (a if g.op_a == 0 else a.T) @ (b if g.op_b == 0 else b.T)
        i, j = np.meshgrid(np.arange(g.m), np.arange(g.n), indexing="ij")
        mem[out_ptr // ITEM + n * g.stride_c + i + j * g.ldc] = c


def _place(mem: list, shape: tuple[int, ...], perm: tuple[int, ...], pad: int, rng: np.random.Generator) -> DevBuf:
    """A buffer of ``shape`` whose memory order is ``perm`` (outermost first), padded rows (a strided view
    of a larger block when ``pad``), appended to ``mem``."""
    stored = [shape[p] for p in perm]
    if stored:
        stored[-1] += pad
    strides_stored, acc = [], 1
    for s in reversed(stored):
        strides_stored.append(acc)
        acc *= s
    strides_stored.reverse()
    strides = [0] * len(shape)
    for k, p in enumerate(perm):
        strides[p] = strides_stored[k]
    ptr = sum(len(m) for m in mem) * ITEM
    mem.append(rng.standard_normal(max(acc, 1)))
    return DevBuf(ptr, tuple(shape), "float64", 0, tuple(strides))


@st.composite
def einsums(draw: st.DrawFn) -> tuple:
    names = iter("abcdefghijkl")
    groups = {g: [next(names) for _ in range(draw(st.integers(0, 2 if g == "batch" else 2)))]
              for g in ("batch", "rows", "cols", "inner")}
    sizes = {c: draw(st.integers(1, 5)) for g in groups.values() for c in g}
    la = groups["batch"] + groups["rows"] + groups["inner"]
    lb = groups["batch"] + groups["inner"] + groups["cols"]
    lo = groups["batch"] + groups["rows"] + groups["cols"]
    la, lb, lo = (tuple(draw(st.permutations(x))) for x in (la, lb, lo))
    # a leading output index of one operand only: a batch the other operand is shared by
    lead = [next(names) for _ in range(draw(st.integers(0, 1)))]
    for c in lead:
        sizes[c] = draw(st.integers(1, 4))
        if draw(st.booleans()):
            la = tuple(draw(st.permutations((*la, c))))
        else:
            lb = tuple(draw(st.permutations((*lb, c))))
        lo = (c, *lo)
    perms = [tuple(draw(st.permutations(range(len(x))))) for x in (la, lb, lo)]
    pads = [draw(st.sampled_from([0, 0, 3])) for _ in range(3)]
    return la, lb, lo, sizes, perms, pads


@settings(max_examples=400, deadline=None)
@given(einsums(), st.integers(0, 2**31))
def test_a_planned_gemm_computes_the_einsum(case: tuple, seed: int) -> None:
    la, lb, lo, sizes, perms, pads = case
    rng = np.random.default_rng(seed)
    mem: list = []
    bufs = [_place(mem, tuple(sizes[c] for c in letters), perm, pad, rng)
            for letters, perm, pad in zip((la, lb, lo), perms, pads)]
    flat = np.concatenate(mem)
    g = einsum_gemm_plan(*bufs, la, lb, lo)
    if g is None:
        return
    a, b = _view(flat, bufs[0].ptr, bufs[0]).copy(), _view(flat, bufs[1].ptr, bufs[1]).copy()
    _cublas(g, flat, bufs[2].ptr)
    want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(lo)}", a, b)
    np.testing.assert_allclose(_view(flat, bufs[2].ptr, bufs[2]), want, rtol=1e-10, atol=1e-10)


def test_contiguous_products_and_the_matmul_gradients_are_gemms() -> None:
    """Row-major blocks: C = A @ B, dA = dC @ Bᵀ, dB = Aᵀ @ dC with a batch of activations, a batched
    product, and transposed layouts are each one GEMM; a trace (an index summed in one operand) is not."""
    rng = np.random.default_rng(0)
    cases = [(("b", "s", "d"), ("d", "f"), ("b", "s", "f")),
             (("b", "s", "f"), ("d", "f"), ("b", "s", "d")),
             (("b", "s", "d"), ("b", "s", "f"), ("d", "f")),
             (("h", "i", "j"), ("h", "j", "k"), ("h", "i", "k")),
             (("j", "i"), ("k", "j"), ("k", "i"))]
    for la, lb, lo in cases:
        sizes = {c: n for c, n in zip("bsdfhijk", (2, 3, 4, 5, 2, 3, 4, 5))}
        mem: list = []
        bufs = [_place(mem, tuple(sizes[c] for c in x), tuple(range(len(x))), 0, rng) for x in (la, lb, lo)]
        flat = np.concatenate(mem)
        g = einsum_gemm_plan(*bufs, la, lb, lo)
        assert g is not None, (la, lb, lo)
        a, b = _view(flat, bufs[0].ptr, bufs[0]).copy(), _view(flat, bufs[1].ptr, bufs[1]).copy()
        _cublas(g, flat, bufs[2].ptr)
        want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(lo)}", a, b)
        np.testing.assert_allclose(_view(flat, bufs[2].ptr, bufs[2]), want, rtol=1e-10)
    buf = DevBuf(0, (3, 3), "float64", 0)
    assert einsum_gemm_plan(buf, DevBuf(64, (3,), "float64", 0), DevBuf(128, (3,), "float64", 0),
                            ("i", "i"), ("i",), ("i",)) is None
    assert einsum_gemm_plan(buf, DevBuf(64, (3, 2), "float64", 0), DevBuf(128, (2,), "float64", 0),
                            ("i", "j"), ("i", "k"), ("k",)) is None  # j summed within one operand


def test_named_indices_plan_the_gemm_letters_do() -> None:
    """An einsum written with index names (the MoE layer's experts-first products) is the same GEMM as its
    lettered twin: the plan reads the names only to match them up."""
    names = (("experts", "groups", "capacity", "hidden"), ("experts", "hidden", "ff"),
             ("experts", "groups", "capacity", "ff"))
    letters = (("e", "g", "c", "h"), ("e", "h", "f"), ("e", "g", "c", "f"))
    sizes = {"e": 3, "g": 2, "c": 4, "h": 5, "f": 6}
    rng = np.random.default_rng(1)
    mem: list = []
    bufs = [_place(mem, tuple(sizes[c] for c in x), tuple(range(len(x))), 0, rng) for x in letters]
    named = einsum_gemm_plan(*bufs, *names)
    assert named is not None and named == einsum_gemm_plan(*bufs, *letters)
    assert named.batch == 3  # one batched GEMM over the experts


def test_a_one_by_one_convolution_is_one_gemm_per_image_with_the_weights_shared() -> None:
    """``fc,ncp->nfp`` (a 1×1 convolution over NCHW blocks, positions flattened) and its operands swapped:
    the images are the batch, the weights read again for each (batch stride 0), nothing transposed."""
    rng = np.random.default_rng(2)
    sizes = {"f": 5, "c": 3, "n": 4, "p": 6}
    for la, lb, lo in ((("f", "c"), ("n", "c", "p"), ("n", "f", "p")), (("n", "c", "p"), ("f", "c"), ("n", "f", "p"))):
        mem: list = []
        bufs = [_place(mem, tuple(sizes[c] for c in x), tuple(range(len(x))), 0, rng) for x in (la, lb, lo)]
        flat = np.concatenate(mem)
        g = einsum_gemm_plan(*bufs, la, lb, lo)
        assert g is not None and g.batch == 4, (la, lb, lo)
        assert 0 in (g.stride_a, g.stride_b)
        a, b = _view(flat, bufs[0].ptr, bufs[0]).copy(), _view(flat, bufs[1].ptr, bufs[1]).copy()
        _cublas(g, flat, bufs[2].ptr)
        want = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(lo)}", a, b)
        np.testing.assert_allclose(_view(flat, bufs[2].ptr, bufs[2]), want, rtol=1e-10)

"""The sparse experts' GPU launchers (``kernels/triton_experts.py``) against the operators' NumPy kernels:
``route_index``'s three maps (a stable counting sort, with ids outside every expert), ``capacity_route``'s
two (per group, cut at the capacity), ``routed_gather`` (dispatch and combine, split), ``grouped_matmul``
(plain and ``trans_w``) and ``grouped_weight_grad`` over blocks of rows, hidden, ff and experts (sizes
that do not divide the tiles), rows sorted by expert and in any order, in float32 and bfloat16.  The maps
are integers and must be equal; the products are float32 sums of products (bfloat16 ones of exact
products), compared at 1e-5 (float32) and at bfloat16's rounding of the result.

Without a GPU the kernels run in Triton's interpreter on CPU."""

from __future__ import annotations

import numpy as np
import pytest
from triton_interpret import Tensors, kernel_module

from relational_tensors.core.types import TensorType
from relational_tensors.sql_specs.experts import (
    CapacityRouteOp,
    GroupedMatmulOp,
    GroupedWeightGradOp,
    RoutedGatherOp,
    RouteIndexOp,
    capacity_maps,
)

torch = pytest.importorskip("torch")
K = kernel_module("relational_tensors.kernels.triton_experts")

from relational_tensors.kernels.launchers import allocates, launcher_for, scratch_shape  # noqa: E402

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
T = Tensors()


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    T.held.clear()
    T.patch(monkeypatch, K, widen_dot=True)


def _exact(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Values exact in ``dtype`` (small multiples of 1/8)."""
    x = np.random.default_rng(seed).integers(-8, 9, shape).astype(np.float32) / 8
    return torch.from_numpy(x).to(TORCH[dtype]).float().numpy()


@pytest.mark.parametrize("what", ["token", "dest", "group"])
@pytest.mark.parametrize(("tokens", "k", "experts"), [(7, 2, 4), (300, 3, 5), (1, 1, 1), (1500, 2, 8)])
def test_route_index_matches_the_operator(what: str, tokens: int, k: int, experts: int) -> None:
    ids = np.random.default_rng(tokens).integers(-1, experts + 1, (tokens, k))  # -1 and experts: no expert
    _check_map(RouteIndexOp((TensorType.zero(ids.shape, "int64"),), experts, what), ids)


def _check_map(op: object, ids: np.ndarray) -> None:
    """A routing map's launcher against its NumPy kernel, equal (the output starts as garbage)."""
    assert not allocates(op)  # type: ignore[arg-type]
    (f,) = op.spec({}).functions  # type: ignore[attr-defined]
    want = op.kernel([ids], f)  # type: ignore[attr-defined]
    ib, _ = T.buf(torch.from_numpy(ids))
    ob, got = T.buf(torch.full(want.shape, -7, dtype=torch.int64))
    launcher_for(op.kind).launch(op, f, [ib], ob, {}, 0)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got.cpu().numpy(), want)


def _check_blocks(op: object, arrays: list[np.ndarray], dtype: str, pieces: dict[str, int]) -> None:
    """Every block of ``op``'s spec split into ``pieces`` (an index -> count): the launcher's output against the
    NumPy kernel's on the same blocks (``arrays``: two floating operands of ``dtype``, then the group ids)."""
    request = {}
    for index in op.requestable():  # type: ignore[attr-defined]
        ivs = index.near_equal(pieces[index.name]) if index.name in pieces else None
        if ivs is not None:
            request[index.name] = ivs
    assert not allocates(op)  # type: ignore[arg-type]
    for fn in op.spec(request).functions:  # type: ignore[attr-defined]
        blocks = [a[box.slices()] for a, box in zip(arrays, fn.inputs)]
        want = np.asarray(op.kernel(blocks, fn), np.float32)  # type: ignore[attr-defined]
        bufs = [T.buf(torch.from_numpy(np.ascontiguousarray(b)).to(TORCH[dtype]))[0] for b in blocks[:2]]
        bufs.append(T.buf(torch.from_numpy(np.ascontiguousarray(blocks[2])))[0])
        ob, got = T.buf(torch.full(fn.output.shape, 7.0, dtype=TORCH[dtype]))
        consts = {}
        need = scratch_shape(op, fn)  # type: ignore[arg-type]
        if need is not None:  # garbage in the scratch: the kernel writes all it reads
            consts["scratch"] = T.buf(torch.full(need[0], -5, dtype=getattr(torch, need[1])))[0]
        launcher_for(op.kind).launch(op, fn, bufs, ob, consts, 0)  # type: ignore[attr-defined]
        np.testing.assert_allclose(got.cpu().float().numpy(), want, **_tolerance(dtype, want), err_msg=str(fn))


def _tolerance(dtype: str, want: np.ndarray) -> dict:
    if dtype == "float32":
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=2**-7, atol=2**-7 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("pieces", [{}, {"rows": 3, "experts": 2}, {"hidden": 2, "ff": 3, "experts": 3}])
def test_grouped_matmul_matches_the_operator(dtype: str, trans: bool, ordered: bool, pieces: dict) -> None:
    rows, h, f, e = 150, 40, 70, 5
    xs, w = _exact((rows, h), dtype, 1), _exact((e, f, h) if trans else (e, h, f), dtype, 2)
    group = np.random.default_rng(3).integers(0, e + 1, rows)  # e: rows of no expert
    if ordered:
        group = np.sort(group)
    op = GroupedMatmulOp((TensorType.zero(xs.shape, dtype), TensorType.zero(w.shape, dtype),
                          TensorType.zero(group.shape, "int64")), trans)
    _check_blocks(op, [xs, w, group], dtype, pieces)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("pieces", [{}, {"rows": 2, "experts": 2}, {"hidden": 3, "ff": 2}])
def test_grouped_weight_grad_matches_the_operator(dtype: str, ordered: bool, pieces: dict) -> None:
    rows, h, f, e = 130, 36, 70, 4
    xs, dy = _exact((rows, h), dtype, 4), _exact((rows, f), dtype, 5)
    group = np.random.default_rng(6).integers(0, e + 1, rows)
    if ordered:
        group = np.sort(group)
    op = GroupedWeightGradOp((TensorType.zero(xs.shape, dtype), TensorType.zero(dy.shape, dtype),
                              TensorType.zero(group.shape, "int64")), e)
    _check_blocks(op, [xs, dy, group], dtype, pieces)


def test_float64_runs_on_the_host() -> None:
    t = TensorType.zero
    assert allocates(GroupedMatmulOp((t((4, 3), "float64"), t((2, 3, 5), "float64"), t((4,), "int64"))))
    assert allocates(GroupedWeightGradOp((t((4, 3), "float64"), t((4, 5), "float64"), t((4,), "int64")), 2))


@pytest.mark.parametrize("what", ["slot", "pair"])
@pytest.mark.parametrize(("groups", "tokens", "k", "experts", "capacity"),
                         [(3, 7, 2, 4, 2), (2, 300, 3, 5, 100), (1, 1, 1, 1, 1), (4, 1500, 2, 8, 200)])
def test_capacity_route_matches_the_operator(what: str, groups: int, tokens: int, k: int, experts: int,
                                             capacity: int) -> None:
    ids = np.random.default_rng(tokens).integers(-1, experts + 1, (groups, tokens, k))
    _check_map(CapacityRouteOp((TensorType.zero(ids.shape, "int64"),), experts, capacity, what), ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("direction", ["dispatch", "combine"])
@pytest.mark.parametrize("pieces", [{}, {"groups": 2, "rows": 2}, {"m": 3, "hidden": 2}])
def test_routed_gather_matches_the_operator(dtype: str, direction: str, pieces: dict) -> None:
    groups, tokens, k, h, experts, capacity = 3, 11, 2, 40, 4, 5
    ids = np.random.default_rng(8).integers(0, experts, (groups, tokens, k))
    slot, pair = capacity_maps(ids, experts, capacity)
    if direction == "dispatch":
        arrays = [_exact((groups, tokens, h), dtype, 9), pair, slot]
    else:
        arrays = [_exact((groups, experts * capacity, h), dtype, 10), slot, pair]
    op = RoutedGatherOp(tuple(TensorType.zero(a.shape, dtype if i == 0 else "int64") for i, a in enumerate(arrays)))
    request = {}
    for index in op.requestable():
        ivs = index.near_equal(pieces[index.name]) if index.name in pieces else None
        if ivs is not None:
            request[index.name] = ivs
    assert not allocates(op)
    for fn in op.spec(request).functions:
        blocks = [a[box.slices()] for a, box in zip(arrays, fn.inputs)]
        want = np.asarray(op.kernel(blocks, fn), np.float32)
        bufs = [T.buf(torch.from_numpy(np.ascontiguousarray(blocks[0])).to(TORCH[dtype]))[0]]
        bufs += [T.buf(torch.from_numpy(np.ascontiguousarray(b)))[0] for b in blocks[1:]]
        ob, got = T.buf(torch.full(fn.output.shape, 7.0, dtype=TORCH[dtype]))
        launcher_for("routed_gather").launch(op, fn, bufs, ob, {}, 0)
        np.testing.assert_array_equal(got.cpu().float().numpy(), want, err_msg=str(fn))

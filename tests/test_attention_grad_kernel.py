"""The Triton kernels of attention's backward (``gpu_exec/kernels/triton_attention_grad.py``) against the
NumPy kernels of ``sql_specs/attention_grad.py``, block by block, and against torch autograd of SDPA.

Without a GPU the kernels run in Triton's interpreter on CPU (``TRITON_INTERPRET=1`` while the kernel
module is defined), with torch CPU tensors as their pointers; with a GPU they are compiled and run on
it, pointer and tensor-descriptor configurations alike.  The blocks are the operators' own function
specs: query blocks at an offset (packed sequences split at their ends), key blocks of a key split (with
their partial log-sum-exps and gradients), GQA head splits, uneven sizes.

Tolerances, relative to the largest magnitude of the reference: float32 1e-4 (IEEE float32 products,
float32 sums in another order); float64 1e-10 (interpreter only).  16-bit inputs: the reference runs in
float32 on the same rounded inputs, and the kernels round P and dS to the input type before the products
that use them (as FlashAttention-2 does) and round their output; with unit roundoff u (2^-8 bfloat16,
2^-11 float16) and sums of many such terms of both signs the error stays a few u of the largest
magnitude: 3e-2 for bfloat16, 4e-3 for float16.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relational_tensors.core.types import Interval, TensorType
from relational_tensors.machine.devices import visible_gpus
from relational_tensors.sql_specs.attention_grad import AttentionDeltaOp, AttentionGradOp, AttentionLseOp

torch = pytest.importorskip("torch")
GPU = visible_gpus() > 0 and torch.cuda.is_available()
from triton_interpret import interpreted  # noqa: E402

_MODULE = "relational_tensors.kernels.triton_attention_grad"
if not GPU and _MODULE in sys.modules and not interpreted(sys.modules[_MODULE]):
    pytest.skip("the kernel module was defined for a GPU before this module could ask for the interpreter",
                allow_module_level=True)
if not GPU:  # kernels are interpreted when they are defined, and Triton asks again at launch: set for good
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
K = importlib.import_module(_MODULE)

from relational_tensors.kernels.common import DevBuf  # noqa: E402
from relational_tensors.kernels.launchers import key_query_limits  # noqa: E402
from relational_tensors.kernels.scratch import dkv_scratch, dkv_splits  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
TORCH = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {v: k for k, v in TORCH.items()} | {torch.int32: "int32"}
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2, "float16": 4e-3}
DTYPES = ["float32", "bfloat16", "float16"] + ([] if GPU else ["float64"])
# (BLOCK_M, BLOCK_N, warps, stages, TMA): small tiles so that the blocks span several of them (masked,
# unmasked and skipped tiles); on a GPU the tensor-descriptor variants too
CONFIGS = [(16, 16, 4, 2, 0), (32, 16, 4, 2, 0), (16, 32, 4, 2, 0)] + ([(64, 64, 4, 2, 1), (64, 32, 4, 2, 1),
                                                                         (64, 64, 8, 2, 2)] if GPU else [])


@pytest.fixture(autouse=True)
def _pointers(monkeypatch):
    """In the interpreter a pointer argument must be the torch tensor itself: the wrappers' ``Ptr`` of a
    block becomes the tensor registered under its address.  The interpreter also multiplies bfloat16
    operands of ``tl.dot`` as their raw bits; they are widened to float32 first (exact: a product of two
    bfloat16 values fits float32), which is what the tensor cores compute."""
    _TENSORS.clear()
    if GPU:
        yield
        return
    from triton_interpret import widen_interpreted_dot

    monkeypatch.setattr(K, "Ptr", _view)
    monkeypatch.setattr(sys.modules["relational_tensors.kernels.triton_attention"], "Ptr", _view)  # masks' arguments
    widen_interpreted_dot(monkeypatch)
    yield


_TENSORS: dict[int, object] = {}


def _view(buf, dtype=None):
    """The registered tensor that holds ``buf``'s address, viewed from there as ``buf``'s dtype (scratch
    carved out of one tensor by the wrappers)."""
    found = _TENSORS.get(buf.ptr)
    if found is not None and NAMES[found.dtype] == buf.dtype:
        return found
    for t in _TENSORS.values():
        base = t.data_ptr()
        raw = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
        if base <= buf.ptr < base + raw.numel():
            size = torch.empty((), dtype=TORCH.get(buf.dtype, torch.int32)).element_size()
            off = buf.ptr - base
            return raw[off:off + (raw.numel() - off) // size * size].view(TORCH.get(buf.dtype, torch.int32))
    raise AssertionError(f"pointer {buf.ptr:#x} lies in no registered tensor")


def _buf(t):
    """A device view of a torch tensor (kept alive, and findable by address in the interpreter)."""
    t = t.to(DEVICE)
    _TENSORS[t.data_ptr()] = t
    return DevBuf(t.data_ptr(), tuple(t.shape), NAMES[t.dtype], 0, tuple(t.stride())), t


def _ints(a: np.ndarray) -> DevBuf:
    return _buf(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)))[0]


def _rounded(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    """Standard normal values rounded to ``dtype``, as float64."""
    x = torch.from_numpy(rng.standard_normal(shape) * scale).to(TORCH[dtype])
    return x.to(torch.float64).numpy()


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    ninf = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), ninf), f"{what}: -inf (rows that see no key) differ"
    got, want = np.where(ninf, 0.0, got), np.where(ninf, 0.0, want)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    assert err <= tol, f"{what}: error {err:.2e} of the largest magnitude {scale:.3g} (tolerance {tol:.0e})"


class Problem:
    """Rounded inputs of one attention backward and its operators (forward lse and o from the NumPy kernels)."""

    def __init__(self, b: int, sq: int, skv: int, hkv: int, group: int, d: int, dtype: str, seed: int,
                 **options: object) -> None:
        rng = np.random.default_rng(seed)
        hq = hkv * group
        self.dtype = dtype
        self.q = _rounded(rng, (b, sq, hq, d), dtype)
        self.k = _rounded(rng, (b, skv, hkv, d), dtype)
        self.v = _rounded(rng, (b, skv, hkv, d), dtype)
        self.do = _rounded(rng, (b, sq, hq, d), dtype)
        tq, tk = TensorType.zero(self.q.shape, dtype), TensorType.zero(self.k.shape, dtype)
        self.stat = "float64" if dtype == "float64" else "float32"
        ts = TensorType.zero(self.q.shape[:3], self.stat)
        self.lse_op = AttentionLseOp((tq, tk), **options)  # type: ignore[arg-type]
        self.ops = {part: AttentionGradOp((tq, tk, tk, tq, ts, ts), part=part, **options)  # type: ignore[arg-type]
                    for part in ("dq", "dkv", "dk", "dv")}
        whole = self.lse_op.spec({}).functions[0]
        self.lse = self.lse_op.kernel([self.q[whole.inputs[0].slices()], self.k[whole.inputs[1].slices()]], whole)
        self.o = _rounded(rng, self.do.shape, dtype)  # Δ needs some o; the gradients do not check it is attention's
        self.delta = np.einsum("bshd,bshd->bsh", self.o, self.do)
        lo, hi = self.lse_op._key_limits(np.arange(sq))
        qlo, qhi = key_query_limits(lo, hi, skv)
        self.limits = {name: _ints(a) for name, a in (("row_lo", lo), ("row_hi", hi), ("key_qlo", qlo),
                                                       ("key_qhi", qhi))}
        self.arrays = (self.q, self.k, self.v, self.do, self.lse, self.delta)

    def block(self, k: int, f) -> tuple[DevBuf, np.ndarray]:
        a = np.ascontiguousarray(self.arrays[k][f.inputs[k].slices()])
        t = torch.from_numpy(a).to(TORCH[self.dtype] if k < 4 else TORCH[self.stat])
        return _buf(t)[0], a

    def run(self, kind: str, f, config, out_dtype: str | None = None, split: bool = False,
            out_heads: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        """(kernel, NumPy kernel) outputs of function spec ``f`` of ``kind`` ('lse' or a part), or None for an
        empty block (the launcher fills those).  ``split``: the dk|dv pass gets the scratch to split its
        query heads; ``out_heads``: its output is a strided view of a block with that many more heads."""
        op = self.lse_op if kind == "lse" else self.ops[kind]
        n_in = 2 if kind == "lse" else 6
        bufs, blocks = zip(*(self.block(k, f) for k in range(n_in)))
        want = op.kernel(list(blocks), f)
        if f.output.volume == 0 or 0 in bufs[1].shape[1:2] or 0 in bufs[0].shape[1:2]:
            return None
        dtype = out_dtype or op.output_type.dtype
        shape = f.output.shape
        if out_heads:  # a view of heads [out_heads, ...) of a wider block
            big, whole = _buf(torch.full((*shape[:2], shape[2] + out_heads, *shape[3:]), float("nan"),
                                         dtype=TORCH[dtype]))
            t = whole[:, :, out_heads:]
            out = DevBuf(t.data_ptr(), tuple(t.shape), dtype, 0, tuple(t.stride()))
        else:
            out, t = _buf(torch.full(shape, float("nan"), dtype=TORCH[dtype]))
        scratch = None
        if split:
            nb, _, hq, _ = bufs[0].shape
            skv, hkv = bufs[1].shape[1], bufs[1].shape[2]
            need = dkv_scratch(nb, skv, hkv, hq // hkv, shape[-1])
            assert need, "this problem's blocks do not split"
            scratch = _buf(torch.full((need,), float("nan"), dtype=torch.float32))[0]
        lim = self.limits
        q_off, k_off = f.inputs[0].lower[1], f.inputs[1].lower[1]
        if kind == "lse":
            K.attention_lse(bufs[0], bufs[1], out, lim["row_lo"], lim["row_hi"], q_off, k_off, op.softmax_scale,
                            config=config)
        elif kind == "dq":
            K.attention_dq(*bufs, out, lim["row_lo"], lim["row_hi"], q_off, k_off, op.softmax_scale, config=config)
        else:
            K.attention_dkv(*bufs, out, lim["key_qlo"], lim["key_qhi"], q_off, k_off, op.softmax_scale,
                            dk=kind in ("dk", "dkv"), dv=kind in ("dv", "dkv"), config=config, scratch=scratch)
        return t.cpu().to(torch.float64).numpy(), want


def _request(op, splits: dict[str, int]) -> dict[str, tuple[Interval, ...]]:
    """Near-equal intervals for the indices named (the operator's legal positions; skipped where none)."""
    found = {s.name: s for s in op.shardable()}
    out = {}
    for name, n in splits.items():
        intervals = found[name].near_equal(min(n, found[name].extent))
        if intervals is not None:
            out[name] = intervals
    return out


def _check_specs(p: Problem, splits: dict[str, int], config, kinds=("lse", "dq", "dkv")) -> int:
    ran = 0
    tol = TOL[p.dtype]
    for kind in kinds:
        op = p.lse_op if kind == "lse" else p.ops[kind]
        spec = op.spec(_request(op, splits))
        shared = len({f.output for f in spec.functions}) < len(spec.functions)
        for f in spec.functions:
            # partials of 16-bit gradients are float32 blocks (the executor's ⊕ inputs), whole ones 16-bit
            out_dtype = "float32" if shared and kind != "lse" and p.dtype != "float64" else None
            res = p.run(kind, f, config, out_dtype)
            if res is None:
                continue
            _close(*res, tol, f"{kind} {f}")
            ran += 1
    return ran


FORMS = st.sampled_from(["none", "causal", "packed", "packed_causal", "bottom_right", "top_left", "window"])


@st.composite
def problems(draw, max_seq: int = 96, dims=(64, 128, 40, 72)):
    form = draw(FORMS)
    sq = draw(st.integers(1, max_seq))
    skv = sq if form in ("causal", "packed", "packed_causal", "window") else draw(st.integers(1, max_seq))
    options: dict[str, object] = {}
    if form in ("causal", "packed_causal"):
        options["causal"] = True
    if form in ("bottom_right", "top_left"):
        options["causal"] = form
    if form.startswith("packed") and sq > 2:
        cuts = sorted(draw(st.sets(st.integers(1, sq - 1), min_size=1, max_size=4)))
        options["seq_ends"] = (*cuts, sq)
    if form == "window":
        options["window"] = draw(st.integers(1, 24))
        options["causal"] = draw(st.booleans())
    if draw(st.booleans()):
        options["scale"] = draw(st.sampled_from([0.3, -0.2]))
    dims = dict(b=draw(st.integers(1, 2)), sq=sq, skv=skv, hkv=draw(st.integers(1, 2)),
                group=draw(st.sampled_from([1, 2, 4])), d=draw(st.sampled_from(dims)))
    return dims, options


SPLITS = st.fixed_dictionaries({}, optional={"seq_q": st.integers(2, 4), "seq_kv": st.integers(2, 4),
                                             "heads_kv": st.just(2), "batch": st.just(2)})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(max_seq=64), splits=SPLITS, dtype=st.sampled_from(DTYPES), config=st.sampled_from(CONFIGS),
       seed=st.integers(0, 2**16))
def test_blocks_of_every_split_match_the_numpy_kernels(problem, splits, dtype, config, seed) -> None:
    dims, options = problem
    p = Problem(**dims, dtype=dtype, seed=seed, **options)
    _check_specs(p, splits, config)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(max_seq=128), splits=SPLITS, dtype=st.sampled_from(DTYPES), config=st.sampled_from(CONFIGS),
       seed=st.integers(0, 2**16))
def test_blocks_of_every_split_match_the_numpy_kernels_sweep(problem, splits, dtype, config, seed) -> None:
    dims, options = problem
    p = Problem(**dims, dtype=dtype, seed=seed, **options)
    _check_specs(p, splits, config, kinds=("lse", "dq", "dkv", "dk", "dv"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_causal_gqa_with_query_and_key_splits(dtype: str) -> None:
    # three packed sequences, GQA 2:1 over 2 kv heads, queries split at the sequence ends and keys in 3
    p = Problem(b=1, sq=77, skv=77, hkv=2, group=2, d=40, dtype=dtype, seed=1, causal=True, seq_ends=(20, 51, 77))
    assert _check_specs(p, {"seq_q": 2, "seq_kv": 3}, CONFIGS[0]) >= 10


# on a GPU also tensor-descriptor ones, whose loads of a partial last key tile read past the block


def test_one_dkv_pass_equals_dk_and_dv_apart() -> None:
    p = Problem(b=1, sq=50, skv=61, hkv=1, group=2, d=64, dtype="float32", seed=2, causal="bottom_right")
    both, dk, dv = (p.run(part, p.ops[part].spec({}).functions[0], CONFIGS[1]) for part in ("dkv", "dk", "dv"))
    assert both is not None and dk is not None and dv is not None
    np.testing.assert_array_equal(both[0], np.concatenate((dk[0], dv[0]), axis=-1))


@pytest.mark.parametrize(("group", "dtype", "causal", "heads"),
                         [(4, "float32", True, 0), (6, "bfloat16", "bottom_right", 1), (2, "float16", "top_left", 0)])
def test_dkv_with_query_heads_split_among_programs(group: int, dtype: str, causal: object, heads: int) -> None:
    """A small grid splits each group's query heads among programs (float32 partials summed in split order):
    the NumPy kernel's dk and dv, alone and together, into contiguous and strided outputs, for whole blocks
    and a query block at an offset; and the same bits as a second run."""
    p = Problem(b=1, sq=45 if causal is not True else 37, skv=37, hkv=2, group=group, d=24, dtype=dtype, seed=4,
                causal=causal)
    assert dkv_splits(1, 37, 2, group) == group  # two programs: the whole group split
    ran = 0
    for part in ("dkv", "dk", "dv"):
        op = p.ops[part]
        for f in (*op.spec({}).functions, *op.spec(_request(op, {"seq_q": 2})).functions):
            got = p.run(part, f, CONFIGS[0], split=True, out_heads=heads)
            if got is None:
                continue
            _close(got[0], got[1], TOL[dtype], f"{part} of {f.output} split {group} ways")
            again = p.run(part, f, CONFIGS[0], split=True, out_heads=heads)
            assert again is not None and np.array_equal(got[0], again[0])
            ran += 1
    assert ran >= 6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delta_of_strided_blocks(dtype: str) -> None:
    rng = np.random.default_rng(3)
    o = torch.from_numpy(rng.standard_normal((2, 9, 6, 72))).to(TORCH[dtype])
    wide = torch.from_numpy(rng.standard_normal((2, 11, 6, 80))).to(TORCH[dtype]).to(DEVICE)
    ob, ot = _buf(o)
    gb, gt = _buf(wide[:, 1:10, :, 3:75])  # a view: strides of the wider block
    assert not gt.is_contiguous()
    out, t = _buf(torch.full((2, 9, 6), float("nan"), dtype=torch.float32))
    K.attention_delta(ob, gb, out)
    op = AttentionDeltaOp((TensorType.zero(ot.shape, dtype),) * 2)
    want = op.kernel([ot.cpu().float().numpy(), gt.cpu().float().numpy()], op.spec({}).functions[0])
    _close(t.cpu().numpy(), want, 1e-5, "delta")


def _visible(p: Problem) -> np.ndarray:
    lo, hi = p.lse_op._key_limits(np.arange(p.q.shape[1]))
    cols = np.arange(p.k.shape[1])
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


@pytest.mark.parametrize("form,dtype", [(dict(causal=True), "float32"), (dict(causal=True), "bfloat16"),
                                        (dict(causal=True, seq_ends=(17, 40, 64)), "bfloat16"),
                                        (dict(window=9), "float32"), (dict(causal="top_left", skv=80), "bfloat16"),
                                        (dict(skv=37), "float32")])
def test_whole_gradients_match_torch_autograd_of_sdpa(form: dict, dtype: str) -> None:
    """Our backward (lse, Δ, dq, dk|dv kernels) on the unsplit blocks against torch autograd of SDPA with the
    operator's mask, on the same rounded inputs, computed in float32 (every row sees a key here)."""
    options = dict(form)
    skv = int(options.pop("skv", 64))  # type: ignore[call-overload]
    p = Problem(b=2, sq=64, skv=skv, hkv=2, group=2, d=72, dtype=dtype, seed=5, **options)
    config = CONFIGS[1]
    q, k, v, do = (torch.from_numpy(a).to(torch.float32).requires_grad_(True) for a in (p.q, p.k, p.v, p.do))
    mask = torch.from_numpy(_visible(p))
    assert bool(mask.any(dim=1).all())
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask, enable_gqa=True).transpose(1, 2)
    o.backward(do.detach())
    # ours, end to end: lse, Δ from torch's o, then the gradients
    f_lse = p.lse_op.spec({}).functions[0]
    got_lse = p.run("lse", f_lse, config)
    assert got_lse is not None
    p.lse = got_lse[0]
    o_r = o.detach().to(TORCH[dtype])
    ob, _ = _buf(o_r)
    gb, _ = _buf(torch.from_numpy(p.do).to(TORCH[dtype]))
    delta, dt = _buf(torch.empty(p.q.shape[:3], dtype=torch.float32))
    K.attention_delta(ob, gb, delta)
    p.delta = dt.cpu().to(torch.float64).numpy()
    p.arrays = (p.q, p.k, p.v, p.do, p.lse, p.delta)
    tol = TOL[dtype] if dtype == "float32" else 4e-2  # and o rounded to 16 bits for Δ
    f = p.ops["dq"].spec({}).functions[0]
    dq = p.run("dq", f, config, "float32")
    dkv = p.run("dkv", p.ops["dkv"].spec({}).functions[0], config, "float32")
    assert dq is not None and dkv is not None
    _close(dq[0], q.grad.double().numpy(), tol, "dq")
    _close(dkv[0][..., :72], k.grad.double().numpy(), tol, "dk")
    _close(dkv[0][..., 72:], v.grad.double().numpy(), tol, "dv")
    logits = torch.einsum("bqhd,bkhd->bhqk", q.detach(), k.detach().repeat_interleave(2, dim=2)) / np.sqrt(72)
    want_lse = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1).transpose(1, 2)
    _close(p.lse, want_lse.double().numpy(), 1e-5, "lse")


def _plan_problem(p_devices: int, constraints: dict[str, str], dtype: str) -> tuple[list, Problem]:
    """The attention backward's function specs from a real plan (``rt.compileGraph`` on cpu:p)."""
    import relational_tensors as rt

    g = rt.Graph()
    b, s, hq, hkv, d = 1, 70, 4, 2, 64
    q, k, v = (g.input(n, shape, dtype) for n, shape in (("q", [b, s, hq, d]), ("k", [b, s, hkv, d]),
                                                       ("v", [b, s, hkv, d])))
    ends = (23, 41, 70)
    o = g.attention(q, k, v, causal=True, seq_ends=ends, name="attn")
    grads = g.vjp(o, g.input("do", [b, s, hq, d], dtype), [q, k, v])
    for i, t in enumerate(grads):
        g.save(t, f"d{i}")
    names = {n.name: n for n in g.nodes if n.kind in ("attention_lse", "attention_grad")}
    cons = {name: constraints[n.kind] for name, n in names.items() if n.kind in constraints}
    cg = rt.compileGraph(g, device=f"cpu:{p_devices}", constraints=cons)
    specs = [(n.kind, getattr(n.op, "part", "lse"), cg.spec(name)) for name, n in names.items()]
    return specs, Problem(b=b, sq=s, skv=s, hkv=hkv, group=hq // hkv, d=d, dtype=dtype, seed=p_devices,
                          causal=True, seq_ends=ends)


@pytest.mark.parametrize("p_devices,split", [(2, "seq_kv=2"), pytest.param(3, "seq_q=3", marks=pytest.mark.slow),
                                             pytest.param(4, "seq_q=2,seq_kv=2", marks=pytest.mark.slow),
                                             (6, "heads_kv=2,seq_kv=3"), (8, "heads_kv=2,seq_q=2,seq_kv=2")])
def test_function_specs_of_real_plans(p_devices: int, split: str) -> None:
    specs, p = _plan_problem(p_devices, {"attention_lse": split, "attention_grad": split}, "bfloat16")
    ran = 0
    for _, part, spec in specs:
        assert spec.p == p_devices
        shared = len({f.output for f in spec.functions}) < len(spec.functions)
        for f in spec.functions:
            res = p.run(part, f, CONFIGS[0], "float32" if shared and part != "lse" else None)
            if res is not None:
                _close(*res, TOL["bfloat16"], f"{part} {f}")
                ran += 1
    assert ran >= p_devices


def test_refusals() -> None:
    p = Problem(b=1, sq=8, skv=8, hkv=1, group=1, d=16, dtype="float32", seed=0)
    f = p.ops["dkv"].spec({}).functions[0]
    bufs = [p.block(k, f)[0] for k in range(6)]
    out, _ = _buf(torch.empty((1, 8, 1, 16)))
    with pytest.raises(ValueError, match=r"writes \[b, skv, hkv, 32\]"):
        K.attention_dkv(*bufs, out, p.limits["key_qlo"], p.limits["key_qhi"], 0, 0, 0.25)
    strided = DevBuf(bufs[0].ptr, bufs[0].shape, "float32", 0, (128, 16, 16, 2))
    with pytest.raises(ValueError, match="last axis is contiguous"):
        K.attention_dq(strided, *bufs[1:], bufs[0], p.limits["row_lo"], p.limits["row_hi"], 0, 0, 0.25)


_COMPILE = r'''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from relational_tensors.kernels import triton_attention as F
from relational_tensors.kernels import triton_attention_grad as K
from relational_tensors.kernels import triton_attention_dbias as B

def compile_one(kind, t16, d, cfg, padded=False, masks=False):
    bm, bn, warps, stages, tma = cfg
    bd = max(16, triton.next_power_of_2(d))
    fn = {"lse": K._lse_kernel, "dq": K._dq_kernel, "dkv": K._dkv_kernel, "forward": F._attention_kernel,
          "dbias": B._dbias_kernel}[kind]
    consts = dict(D=d, BLOCK_D=bd, DV=d, BLOCK_DV=bd, BLOCK_M=bm, BLOCK_N=bn, IEEE=t16 == "fp32", ACC=tl.float32,
                  TMA=bool(tma), WRITE_DK=True, WRITE_DV=True, RELOAD=tma == 2, SPLITS=1, LIMITS=padded,
                  BITS=padded, WRITE_LSE=True, KT=True, HEADS_INNER=True, NEG_SCALE=False, MASK=masks,
                  BIAS=masks or kind == "dbias", SOFTCAP=masks)
    blocks = {"q_desc": bm, "do_desc": bm, "k_desc": bn, "v_desc": bn}
    stats = {"lse_ptr", "delta_ptr"}
    limits = {"lo_ptr", "hi_ptr", "kqlo_ptr", "kqhi_ptr", "klim_ptr"}
    sig, cst = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts or (name in blocks and not tma):
            sig[name], cst[(i,)] = "constexpr", consts.get(name)
        elif name in blocks:
            sig[name] = f"tensordesc<{t16}[{blocks[name]},{bd}]>"
        elif name.endswith("_ptr"):
            sig[name] = ("*i32" if name in limits else "*fp32" if name in stats else "*i8" if name in ("kp_ptr",
                         "mask_ptr") else f"*{t16}")
        else:
            sig[name] = "fp32" if name in ("scale", "qk_scale", "cap2") else "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=cst), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    return getattr(k, "n_spills", None), getattr(k, "n_regs", None)

# then key padding and per-batch key limits (the padded forms); then a mask, a bias and a softcap beside them
for kind, t16, d, cfg, padded in [("dq", "bf16", 128, (128, 64, 8, 3, 1), False),
                                  ("dkv", "bf16", 128, (32, 64, 8, 2, 1), False),
                                  ("lse", "bf16", 128, (128, 64, 8, 3, 1), False),
                                  ("dkv", "fp16", 72, (64, 64, 8, 2, 0), False),
                                  ("dkv", "bf16", 128, (64, 64, 8, 3, 2), False),
                                  ("forward", "bf16", 128, (128, 64, 8, 3, 0), True),
                                  ("lse", "bf16", 128, (128, 64, 8, 3, 1), True),
                                  ("dq", "bf16", 128, (128, 64, 8, 3, 1), True),
                                  ("dkv", "bf16", 128, (64, 64, 8, 2, 1), True),
                                  ("forward", "bf16", 128, (128, 64, 8, 3, 0), "masks"),
                                  ("lse", "bf16", 128, (128, 64, 8, 3, 1), "masks"),
                                  ("dq", "bf16", 128, (128, 64, 8, 3, 1), "masks"),
                                  ("dkv", "bf16", 128, (64, 64, 8, 2, 1), "masks"),
                                  ("dbias", "bf16", 128, (64, 64, 4, 1, 0), "masks"),
                                  ("dbias", "fp32", 64, (32, 32, 4, 1, 0), False)]:
    spills, regs = compile_one(kind, t16, d, cfg, bool(padded), padded == "masks")
    print(kind, t16, d, cfg, padded, "compiled", spills, regs, flush=True)
'''


@pytest.mark.skipif(GPU, reason="with a GPU the kernels are compiled by the other tests")
def test_the_kernels_compile_for_hopper_without_a_gpu() -> None:
    """The interpreter does not compile: Triton's own compiler (with the ptxas it ships) builds the kernels
    for sm_90, tensor-descriptor and pointer variants, in a process without ``TRITON_INTERPRET``."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    if run.returncode and ("ptxas" in run.stderr and "not found" in run.stderr or "TypeError" in run.stderr):
        pytest.skip(f"this Triton cannot compile for sm_90 here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 15

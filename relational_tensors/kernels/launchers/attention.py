"""Attention and its backward: the Triton flash-style kernels (or the FlashAttention library), the
masked and float64 forms on host copies or CuPy."""

from __future__ import annotations

from typing import Any

import numpy as np

from relational_tensors.core.dtypes import float32_to_bf16_bits
from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import _computable, host_kernel, launcher


def _attention_constants(op: Any) -> dict[str, np.ndarray]:
    rows = np.arange(op.input_types[0].shape[1])
    lo, hi = op._key_limits(rows)
    out = {"row_lo": lo.astype(np.int32), "row_hi": hi.astype(np.int32)}
    if op.key_lengths is not None:  # batch row b sees the keys [0, key_lengths[b]): the kernel's key limits
        lengths = np.asarray(op.key_lengths, dtype=np.int32)
        out["key_limits"] = np.stack([np.zeros_like(lengths), lengths], axis=1)
    return out


def _padding_only(op: Any) -> bool:
    """Key padding is the attention's only extra input: the Triton kernel masks it (and skips the tiles
    before a row's first real key and after its last)."""
    return op.extras == ("key_padding",)


def _attention_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """int32 [batch rows, 2]: each row's first and one-past-last real key (``triton_attention.padding_limits``)."""
    return ((2 * f.inputs[0].shape[0],), "int32") if _padding_only(op) else None


def _dense_attention(op: Any, f: FunctionSpec, ins: list, out: Any, stream: int) -> None:
    """The operator's chunked kernel with CuPy arrays (float32 scores, cuBLAS contractions): the GPU path of
    key padding, masks and biases, which the Triton kernel's per-row key ranges cannot express."""
    import cupy

    with cupy.cuda.ExternalStream(stream):
        o, lse = op.dense([_computable(b) for b in ins], f, cupy)
        for buf, value in (zip(out, (o, lse)) if isinstance(out, tuple) else [(out, o)]):
            dst = buf.cupy()
            dst[...] = float32_to_bf16_bits(value.astype(cupy.float32), cupy) if buf.dtype == "bfloat16" \
                else value.astype(dst.dtype)


def _dense(op: Any) -> bool:
    """The forward forms the Triton kernel does not take (a boolean mask or a bias) run on CuPy, which
    allocates; key padding and key lengths run in the kernel."""
    return bool(op.extras) and not _padding_only(op)


def _lse_allocates(op: Any) -> bool:
    return _host_form(op)  # masks, biases and float64 run the NumPy kernel on host copies


def _grad_allocates(op: Any) -> bool:
    return _host_form(op)  # masks, biases, the bias gradient and float64 run the NumPy kernel on host copies


@launcher("attention", constants=_attention_constants, scratch=_attention_scratch, allocates=_dense,
          host_forms="a boolean mask or an additive bias (chunked CuPy: float32 scores through cuBLAS)")
def _attention(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import flash
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.common import DevBuf
    from relational_tensors.kernels.triton_attention import attention, padding_limits

    if _dense(op):  # masks and biases: dense chunks on the device
        _dense_attention(op, f, ins, out, stream)
        return
    q, k, v = ins[:3]
    o, lse = out if isinstance(out, tuple) else (out, None)
    if k.shape[1] == 0:  # this query block sees none of these keys
        tc.fill(o, 0.0)
        if lse is not None:
            tc.fill(lse, float("-inf"))
        return
    rows, keys = f.inputs[0].lower[1], f.inputs[1].lower[1]
    if _padding_only(op):  # the real keys of each batch row: bits in every tile, tiles outside skipped
        kp = ins[3]
        room = consts["scratch"]
        limits = DevBuf(room.ptr, (kp.shape[0], 2), "int32", room.device)
        padding_limits(kp, limits, keys)
        attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], rows, keys, op.softmax_scale,
                  key_padding=kp, limits=limits)
        return
    if op.key_lengths is not None:  # each batch row's keys end at its length: tiles past it skipped
        attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], rows, keys, op.softmax_scale,
                  limits=consts["key_limits"], limits_batch=f.inputs[0].lower[0])
        return
    if "flash" in consts:  # a library FlashAttention kernel computes this block exactly
        flash.attention(q, k, v, o, consts["flash"], op.is_causal, op.softmax_scale, stream)
        return
    attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], rows, keys, op.softmax_scale)


def key_query_limits(row_lo: np.ndarray, row_hi: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key c, the rows [qlo[c], qhi[c]) that see it, from every row's keys [row_lo[r], row_hi[r]) (both
    ends non-decreasing in r, so the rows that see a key are one range, and its ends non-decreasing in c).

    >>> key_query_limits(np.array([0, 0, 0, 2]), np.array([1, 2, 3, 4]), 4)
    (array([0, 1, 2, 3]), array([3, 3, 4, 4]))
    """
    keys = np.arange(n_keys)
    return np.searchsorted(row_hi, keys, side="right"), np.searchsorted(row_lo, keys, side="right")


def _attention_grad_constants(op: Any) -> dict[str, np.ndarray]:
    lo, hi = op._key_limits(np.arange(op.input_types[0].shape[1]))
    qlo, qhi = key_query_limits(lo, hi, op.input_types[1].shape[1])
    out = {"row_lo": lo.astype(np.int32), "row_hi": hi.astype(np.int32), "key_qlo": qlo.astype(np.int32),
           "key_qhi": qhi.astype(np.int32)}
    if op.key_lengths is not None:
        lengths = np.asarray(op.key_lengths, dtype=np.int32)
        out["key_limits"] = np.stack([np.zeros_like(lengths), lengths], axis=1)
    return out


def _host_form(op: Any) -> bool:
    """Whether an attention-backward operator runs its NumPy kernel on host copies whatever its blocks: masks
    and biases (key padding and key lengths run in the kernels), the bias gradient and float64 (no float64
    attention on GPUs)."""
    return ((bool(op.extras) and not _padding_only(op)) or getattr(op, "part", "") == "dbias"
            or op.input_types[0].dtype == "float64")


_LIMITS_BYTES = 256  # the key limits' room at the head of a backward kernel's scratch (alignment kept after it)


def _limits_room(batch: int) -> int:
    """float32 elements of scratch that hold ``batch`` rows of int32 key limits, rounded to keep alignment."""
    return -(-(8 * batch) // _LIMITS_BYTES) * _LIMITS_BYTES // 4


def _key_padding(op: Any, f: FunctionSpec, ins: list, consts: dict, main: int) -> dict[str, Any]:
    """The key-padding and key-limit arguments of a backward kernel: padding's limits computed into the head
    of the task's scratch, or the key lengths' constant limits; none for the other forms."""
    from relational_tensors.kernels.common import DevBuf
    from relational_tensors.kernels.triton_attention import padding_limits

    if _padding_only(op):
        kp = ins[main]
        room = consts["scratch"]
        limits = DevBuf(room.ptr, (kp.shape[0], 2), "int32", room.device)
        padding_limits(kp, limits, f.inputs[1].lower[1])
        return {"key_padding": kp, "limits": limits}
    if op.key_lengths is not None:
        return {"limits": consts["key_limits"], "limits_batch": f.inputs[0].lower[0]}
    return {}


def _lse_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    return ((_limits_room(f.inputs[0].shape[0]),), "float32") if _padding_only(op) else None


def _grad_on_host(op: Any, bufs: list) -> bool:
    """Whether an attention-backward block runs on host copies: a host form (``_host_form``), or blocks
    whose last axis is not contiguous."""
    return _host_form(op) or any(b.shape[-1] > 1 and b.strides[-1] != 1 for b in bufs)


@launcher("attention_lse", constants=_attention_grad_constants, scratch=_lse_scratch, allocates=_lse_allocates,
          host_forms="a boolean mask, an additive bias, or float64 (the NumPy kernel on host copies)")
def _attention_lse(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.triton_attention_grad import attention_lse

    if _grad_on_host(op, [*ins[:2], out]):
        host_kernel(op, f, ins, out, stream)
        return
    q, k = ins[:2]
    if k.shape[1] == 0:  # this query block sees none of these keys
        tc.fill(out, float("-inf"))
        return
    attention_lse(q, k, out, consts["row_lo"], consts["row_hi"], f.inputs[0].lower[1], f.inputs[1].lower[1],
                  op.softmax_scale, **_key_padding(op, f, ins, consts, 2))


@launcher("attention_delta")
def _attention_delta(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels.triton_attention_grad import attention_delta

    attention_delta(ins[0], ins[1], out)


def _attention_grad_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """float32 partials of a dk|dv pass that splits its query heads (``kernels.scratch.dkv_splits``), after
    the key limits of padding (``_limits_room``)."""
    from relational_tensors.kernels.scratch import dkv_scratch

    if _host_form(op):
        return None
    head = _limits_room(f.inputs[0].shape[0]) if _padding_only(op) else 0
    need = 0
    if op.part in ("dk", "dv", "dkv"):
        (nb, _, hq, d), (_, skv, hkv, _), dv = f.inputs[0].shape, f.inputs[1].shape, f.inputs[2].shape[3]
        width = (d if op.part in ("dk", "dkv") else 0) + (dv if op.part in ("dv", "dkv") else 0)
        need = dkv_scratch(nb, skv, hkv, hq // hkv, width) if hkv else 0
    return ((head + need,), "float32") if head + need else None


@launcher("attention_grad", constants=_attention_grad_constants, scratch=_attention_grad_scratch,
          allocates=_grad_allocates,
          host_forms="a boolean mask, an additive bias and its gradient, or float64 (the NumPy kernel on host "
                     "copies)")
def _attention_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.triton_attention_grad import attention_dkv, attention_dq

    if _grad_on_host(op, [*ins[:4], out]):
        host_kernel(op, f, ins, out, stream)
        return
    q, k, v, do, lse, delta = ins[:6]
    q_offset, k_offset = f.inputs[0].lower[1], f.inputs[1].lower[1]
    if op.part == "dq":
        if k.shape[1] == 0:  # these rows see none of these keys
            tc.fill(out, 0.0)
            return
        attention_dq(q, k, v, do, lse, delta, out, consts["row_lo"], consts["row_hi"], q_offset, k_offset,
                     op.softmax_scale, **_key_padding(op, f, ins, consts, 6))
        return
    if q.shape[1] == 0:  # no row of this query block sees these keys
        tc.fill(out, 0.0)
        return
    padding = _key_padding(op, f, ins, consts, 6)
    scratch = consts.get("scratch")
    if scratch is not None and _padding_only(op):  # the dk|dv partials after the key limits
        from relational_tensors.kernels.common import DevBuf

        head = _limits_room(f.inputs[0].shape[0]) * 4
        rest = scratch.nbytes - head
        scratch = DevBuf(scratch.ptr + head, (rest // 4,), "float32", scratch.device) if rest > 0 else None
    attention_dkv(q, k, v, do, lse, delta, out, consts["key_qlo"], consts["key_qhi"], q_offset, k_offset,
                  op.softmax_scale, dk=op.part in ("dk", "dkv"), dv=op.part in ("dv", "dkv"), scratch=scratch,
                  **padding)

"""Attention and its backward: the Triton flash-style kernels (or the FlashAttention library) for every
form of visibility, key padding, mask and bias; float64's backward on host copies (float64 attention is
refused on GPUs before it runs)."""

from __future__ import annotations

from typing import Any

import numpy as np

from relational_tensors.core.spec import FunctionSpec
from relational_tensors.kernels.launchers.base import host_kernel, launcher


def _attention_constants(op: Any) -> dict[str, np.ndarray]:
    rows = np.arange(op.input_types[0].shape[1])
    lo, hi = op._key_limits(rows)
    out = {"row_lo": lo.astype(np.int32), "row_hi": hi.astype(np.int32)}
    if op.key_lengths is not None:  # batch row b sees the keys [0, key_lengths[b]): the kernel's key limits
        lengths = np.asarray(op.key_lengths, dtype=np.int32)
        out["key_limits"] = np.stack([np.zeros_like(lengths), lengths], axis=1)
    return out


def _padding(op: Any) -> bool:
    """Key padding is among the attention's extra inputs: the Triton kernels mask it in every tile (and skip
    the tiles before a row's first real key and after its last, from limits computed into scratch)."""
    return "key_padding" in op.extras


def _masks(op: Any, ins: list, main: int) -> dict[str, Any]:
    """The mask and bias blocks of a launch and the softcap, as the kernels take them
    (``triton_attention.extra_arguments``)."""
    out: dict[str, Any] = {name: ins[main + op.extras.index(name)] for name in ("mask", "bias") if name in op.extras}
    if op.softcap is not None:
        out["softcap"] = op.softcap
    return out


def _decode_form(op: Any, f: FunctionSpec) -> bool:
    """Whether a forward block takes the decode kernel (``triton_attention_decode``: its keys split across
    programs): at most ``DECODE_ROWS`` query rows per kv head (a decode step's one row per sequence, a few with
    speculative tokens), in 16- or 32-bit floats, without a mask, a bias, a softcap or key lengths."""
    from relational_tensors.kernels.scratch import DECODE_ROWS

    (_, sq, hq, _), hkv = f.inputs[0].shape, f.inputs[1].shape[2]
    return (hkv > 0 and sq * (hq // hkv) <= DECODE_ROWS
            and op.input_types[0].dtype in ("float16", "bfloat16", "float32")
            and not {"mask", "bias"} & set(op.extras) and op.softcap is None and op.key_lengths is None)


def _attention_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    """The decode kernel's partial outputs and log-sum-exps of its key splits (float32), or int32 [batch
    rows, 2]: each row's first and one-past-last real key (``triton_attention.padding_limits``)."""
    if _decode_form(op, f):
        from relational_tensors.kernels.scratch import decode_scratch

        (nb, sq, hq, _), (_, skv, hkv, _), dv = f.inputs[0].shape, f.inputs[1].shape, f.inputs[2].shape[3]
        n = decode_scratch(nb, sq, hq, hkv, skv, dv)
        return ((n,), "float32") if n else None
    return ((2 * f.inputs[0].shape[0],), "int32") if _padding(op) else None


def _lse_allocates(op: Any) -> bool:
    return _host_form(op)  # float64 runs the NumPy kernel on host copies


def _grad_allocates(op: Any) -> bool:
    return _host_form(op)  # float64 runs the NumPy kernel on host copies


@launcher("attention", constants=_attention_constants, scratch=_attention_scratch)
def _attention(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import flash
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.triton_attention import attention

    q, k, v = ins[:3]
    o, lse = out if isinstance(out, tuple) else (out, None)
    if k.shape[1] == 0:  # this query block sees none of these keys
        tc.fill(o, 0.0)
        if lse is not None:
            tc.fill(lse, float("-inf"))
        return
    if "flash" in consts:  # a library FlashAttention kernel computes this block exactly (no extras: ``flash``)
        flash.attention(q, k, v, o, consts["flash"], op.is_causal, op.softmax_scale, stream)
        return
    if _decode_form(op, f):  # a few query rows over many keys: the keys split across programs
        from relational_tensors.kernels.triton_attention_decode import decode_attention

        kp = ins[3 + op.extras.index("key_padding")] if _padding(op) else None
        decode_attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], f.inputs[0].lower[1],
                         f.inputs[1].lower[1], op.softmax_scale, kp, consts.get("scratch"))
        return
    attention(q, k, v, o, lse, consts["row_lo"], consts["row_hi"], f.inputs[0].lower[1], f.inputs[1].lower[1],
              op.softmax_scale, **_extras(op, f, ins, consts, 3))


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
    """Whether an attention-backward operator runs its NumPy kernel on host copies whatever its blocks:
    float64 (no float64 attention on GPUs)."""
    return bool(op.input_types[0].dtype == "float64")


_LIMITS_BYTES = 256  # the key limits' room at the head of a backward kernel's scratch (alignment kept after it)


def _limits_room(batch: int) -> int:
    """float32 elements of scratch that hold ``batch`` rows of int32 key limits, rounded to keep alignment."""
    return -(-(8 * batch) // _LIMITS_BYTES) * _LIMITS_BYTES // 4


def _extras(op: Any, f: FunctionSpec, ins: list, consts: dict, main: int) -> dict[str, Any]:
    """The key-padding, key-limit, mask, bias and softcap arguments of an attention kernel (the extra inputs
    from ``ins[main]``): padding's limits computed into the head of the task's scratch (the tiles before a
    batch row's first real key and after its last are skipped), or the key lengths' constant limits."""
    from relational_tensors.kernels.common import DevBuf
    from relational_tensors.kernels.triton_attention import padding_limits

    masks = _masks(op, ins, main)
    if _padding(op):
        kp = ins[main]
        room = consts["scratch"]
        limits = DevBuf(room.ptr, (kp.shape[0], 2), "int32", room.device)
        padding_limits(kp, limits, f.inputs[1].lower[1])
        return {"key_padding": kp, "limits": limits, **masks}
    if op.key_lengths is not None:
        return {"limits": consts["key_limits"], "limits_batch": f.inputs[0].lower[0], **masks}
    return masks


def _lse_scratch(op: Any, f: FunctionSpec) -> tuple[tuple[int, ...], str] | None:
    return ((_limits_room(f.inputs[0].shape[0]),), "float32") if _padding(op) and not _host_form(op) else None


def _grad_on_host(op: Any, bufs: list) -> bool:
    """Whether an attention-backward block runs on host copies: a host form (``_host_form``), or blocks of
    q, k, v, dO or the output whose last axis is not contiguous (masks and biases are read at any strides)."""
    return _host_form(op) or any(b.shape[-1] > 1 and b.strides[-1] != 1 for b in bufs)


@launcher("attention_lse", constants=_attention_grad_constants, scratch=_lse_scratch, allocates=_lse_allocates,
          host_forms="float64 (the NumPy kernel on host copies)")
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
                  op.softmax_scale, **_extras(op, f, ins, consts, 2))


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
    head = _limits_room(f.inputs[0].shape[0]) if _padding(op) else 0
    need = 0
    if op.part in ("dk", "dv", "dkv"):
        (nb, _, hq, d), (_, skv, hkv, _), dv = f.inputs[0].shape, f.inputs[1].shape, f.inputs[2].shape[3]
        width = (d if op.part in ("dk", "dkv") else 0) + (dv if op.part in ("dv", "dkv") else 0)
        need = dkv_scratch(nb, skv, hkv, hq // hkv, width) if hkv else 0
    return ((head + need,), "float32") if head + need else None


@launcher("attention_grad", constants=_attention_grad_constants, scratch=_attention_grad_scratch,
          allocates=_grad_allocates,
          host_forms="float64 (the NumPy kernel on host copies)")
def _attention_grad(op: Any, f: FunctionSpec, ins: list, out: Any, consts: dict, stream: int) -> None:
    from relational_tensors.kernels import triton_copy as tc
    from relational_tensors.kernels.triton_attention_dbias import attention_dbias
    from relational_tensors.kernels.triton_attention_grad import attention_dkv, attention_dq

    if _grad_on_host(op, [*ins[:4], out] if op.part != "dbias" else ins[:4]):
        host_kernel(op, f, ins, out, stream)
        return
    q, k, v, do, lse, delta = ins[:6]
    q_offset, k_offset = f.inputs[0].lower[1], f.inputs[1].lower[1]
    if op.part == "dbias":  # every pair of the block is written (0 where no row sees the key)
        attention_dbias(q, k, v, do, lse, delta, out, consts["row_lo"], consts["row_hi"], q_offset, k_offset,
                        op.softmax_scale, **_extras(op, f, ins, consts, 6))
        return
    if op.part == "dq":
        if k.shape[1] == 0:  # these rows see none of these keys
            tc.fill(out, 0.0)
            return
        attention_dq(q, k, v, do, lse, delta, out, consts["row_lo"], consts["row_hi"], q_offset, k_offset,
                     op.softmax_scale, **_extras(op, f, ins, consts, 6))
        return
    if q.shape[1] == 0:  # no row of this query block sees these keys
        tc.fill(out, 0.0)
        return
    padding = _extras(op, f, ins, consts, 6)
    scratch = consts.get("scratch")
    if scratch is not None and _padding(op):  # the dk|dv partials after the key limits
        from relational_tensors.kernels.common import DevBuf

        head = _limits_room(f.inputs[0].shape[0]) * 4
        rest = scratch.nbytes - head
        scratch = DevBuf(scratch.ptr + head, (rest // 4,), "float32", scratch.device) if rest > 0 else None
    attention_dkv(q, k, v, do, lse, delta, out, consts["key_qlo"], consts["key_qhi"], q_offset, k_offset,
                  op.softmax_scale, dk=op.part in ("dk", "dkv"), dv=op.part in ("dv", "dkv"), scratch=scratch,
                  **padding)

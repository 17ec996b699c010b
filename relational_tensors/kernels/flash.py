"""FlashAttention from a library, for the blocks it computes exactly (``attention="flash"``).

flash-attn's ``flash_attn_varlen_func`` when the package is installed, otherwise the same
FlashAttention-2 kernel as PyTorch ships it (``torch.ops.aten._flash_attention_forward``).  Both
take packed sequences as cumulative lengths and align a causal mask to the bottom right when a
sequence has more keys than queries, which is exactly a causal query block [r0, r1) over its keys
[start(r0), r1).  A block qualifies when

* it is float16 or bfloat16 with one head dimension (q, k and v), a multiple of 8 up to 256;
* its key block is exactly the keys its rows see (no key split: no log-sum-exp output, no keys
  beyond the last query row), so every packed sequence is one varlen segment.

Other blocks (key splits and their lse partials, float32, odd head sizes) stay on the Triton
kernel.  The library kernels allocate their output, which a CUDA graph of ours cannot capture
safely, so a program that uses them runs eagerly.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from relational_tensors.core.types import Interval
from relational_tensors.kernels.common import DevBuf

__all__ = ["backend", "segments", "attention"]


@lru_cache(maxsize=1)
def backend() -> str | None:
    """'flash_attn', 'torch' or None (neither importable with CUDA)."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401

        return "flash_attn"
    except Exception:  # noqa: BLE001 - not installed, or built for another CUDA
        pass
    try:
        import torch

        if torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward"):
            return "torch"
    except Exception:  # noqa: BLE001
        pass
    return None


def segments(op: Any, f: Any, dtype: str, lse: bool) -> tuple[tuple[int, int], ...] | None:
    """Per packed sequence of this function spec's query rows, (query rows, keys); None when the
    library kernels cannot compute the block exactly."""
    if op.window is not None or op.offset or op.extras or op.key_lengths is not None or op.softcap is not None:
        return None  # windows, bottom-right alignment, padding, masks, biases and softcaps: our kernels
    qb, kb, vb = f.inputs
    d, dv = qb.shape[-1], vb.shape[-1]
    if lse or dtype not in ("float16", "bfloat16") or d != dv or d % 8 or d > 256:
        return None
    if op.scale is not None and op.scale <= 0:  # PyTorch's kernel returned NaN for scale -0.3 on an H200
        return None
    r0, r1 = qb.lower[1], qb.upper[1]
    k0, k1 = kb.lower[1], kb.upper[1]
    if r1 <= r0:
        return None
    out = []
    first = last = None
    for lo, hi, ss, se in op._segments(Interval(r0, r1)):
        keys_end = hi if op.is_causal else se  # a causal block's keys end at its last row: aligned bottom-right
        out.append((hi - lo, keys_end - ss))
        first = ss if first is None else first
        last = keys_end
    if first != k0 or last != k1:  # keys must be exactly what the rows see, in one run
        return None
    return tuple(out)


_cu: dict[tuple, Any] = {}


def _cumulative(device: int, lengths: tuple[int, ...]) -> Any:
    import torch

    key = (device, lengths)
    if key not in _cu:
        _cu[key] = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                                device=f"cuda:{device}")
    return _cu[key]


def _torch_view(buf: DevBuf, shape: tuple[int, ...]) -> Any:
    import torch

    assert buf.is_contiguous, "the library kernels take contiguous blocks"  # a reshape must not copy
    t = torch.from_dlpack(buf.cupy().reshape(shape))
    return t.view(torch.bfloat16) if buf.dtype == "bfloat16" else t


def attention(q: DevBuf, k: DevBuf, v: DevBuf, out: DevBuf, segs: tuple[tuple[int, int], ...], causal: bool,
              scale: float, stream_ptr: int) -> None:
    """out = attention(q, k, v) for a block that :func:`segments` accepted, on ``stream_ptr``."""
    import torch

    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    lq = tuple(n for _ in range(b) for n, _k in segs)
    lk = tuple(m for _ in range(b) for _n, m in segs)
    cu_q, cu_k = _cumulative(q.device, lq), _cumulative(q.device, lk)
    qt = _torch_view(q, (b * sq, hq, d))
    kt = _torch_view(k, (b * skv, hkv, d))
    vt = _torch_view(v, (b * skv, hkv, d))
    ot = _torch_view(out, (b * sq, hq, d))
    with torch.cuda.device(q.device), torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr)):
        if backend() == "flash_attn":
            from flash_attn import flash_attn_varlen_func

            res = flash_attn_varlen_func(qt, kt, vt, cu_q, cu_k, max(lq), max(lk), softmax_scale=scale,
                                         causal=causal)
        else:
            res = torch.ops.aten._flash_attention_forward(qt, kt, vt, cu_q, cu_k, max(lq), max(lk), 0.0, causal,
                                                          False, scale=scale)[0]
        ot.copy_(res)

"""GPU kernels: Triton kernels and cuBLAS calls, each behind a thin wrapper that
checks its arguments and launches on the caller's stream.

Arguments are :class:`DevBuf` views (device pointer, shape, strides, dtype
name); no wrapper allocates, so every launch can be captured in a CUDA graph -- except the
library FlashAttention of ``flash.py``, whose programs run eagerly.
"""

from relational_tensors.kernels.common import DevBuf

__all__ = ["DevBuf"]

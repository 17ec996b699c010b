"""Torch CUDA tensors into and out of a program compiled for GPUs, with the host never waiting.

What a torch user expects of a module on the GPU: a call queues work and returns, and reading a result
(``loss.item()``) is what synchronizes.  The GPU executor's ``stage`` copies a call's inputs on its
launch stream, ordered after the producer's stream by DLPack's stream handshake, and holds each tensor
until its copy has read it, so torch's caching allocator cannot hand its memory out before.  Outputs
are torch tensors allocated by torch, filled on the launch stream by ``offload_into``, and torch's
current stream waits for the launch stream before anything reads them.  Anything ``stage`` cannot take
this way (host arrays of weights, another dtype) goes through the checked ``load``, as on CPU devices.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from relational_tensors.frontend.torch.convert import _torch, _torch_dtype


def _external(compiled: Any) -> Any:
    """The executor's launch stream as torch sees it (made once per stream, not per call)."""
    return _stream(compiled.executor.launch_stream.ptr, compiled.devices.physical[0])


@functools.cache
def _stream(ptr: int, gpu: int) -> Any:
    return _torch().cuda.ExternalStream(ptr, device=f"cuda:{gpu}")


def stage(compiled: Any, feeds: Mapping[str, Any]) -> bool:
    """Load ``feeds`` without synchronizing the host where the GPU executor can (see the module
    docstring); False, having loaded nothing, where ``compiled.load`` must do it."""
    if compiled.devices.kind != "cuda" or not hasattr(compiled.executor, "stage"):
        return False
    return bool(compiled.executor.stage(feeds))


def output(compiled: Any, name: str) -> Any:
    """Saved output ``name`` of a program on GPUs as a new torch CUDA tensor, filled on the launch stream;
    torch's current stream waits for it, so the host does not."""
    torch = _torch()
    t = compiled.dag.saved_node(name).type
    gpu = compiled.devices.physical[0]
    dest = torch.empty(t.shape, dtype=_torch_dtype(t.dtype), device=f"cuda:{gpu}")
    compiled.executor.offload_into(name, dest)
    torch.cuda.current_stream(dest.device).wait_stream(_external(compiled))
    return dest

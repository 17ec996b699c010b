"""Torch CUDA tensors into and out of a program compiled for GPUs, with the host never waiting.

What a torch user expects of a module on the GPU: a call queues work and returns, and reading a result
(``loss.item()``) is what synchronizes.  The GPU executor's ``stage`` copies a call's inputs on its
launch stream, ordered after torch's current stream (a contiguous tensor handed by address,
``RawDevice``: one ``cudaMemcpyAsync`` after an event; any other through DLPack's stream handshake), and
holds each tensor until its copy has read it, so torch's caching allocator cannot hand its memory out
before.  Outputs
are torch tensors allocated by torch, filled on the launch stream by ``offload_into``, and torch's
current stream waits for the launch stream before anything reads them.  Anything ``stage`` cannot take
this way (host arrays of weights, another dtype) goes through the checked ``load``, as on CPU devices.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from relational_tensors.frontend.torch.convert import _dtype_name, _torch, _torch_dtype
from relational_tensors.runtime.cupy_staging import RawDevice


def launch_stream(compiled: Any) -> Any:
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
    current = _torch().cuda.current_stream(f"cuda:{compiled.devices.physical[0]}")  # once per call: it costs
    return bool(compiled.executor.stage({name: _raw(x, current) or x for name, x in feeds.items()}))


def _raw(x: Any, stream: Any) -> RawDevice | None:
    """A contiguous torch CUDA tensor on ``stream``'s GPU by address, ordered after ``stream`` (torch's
    current stream there); None for anything else (the checked paths take it)."""
    torch = _torch()
    if not isinstance(x, torch.Tensor) or x.device != stream.device or not x.is_contiguous():
        return None
    name = _dtype_name(x.dtype)
    return None if name is None else RawDevice(x.data_ptr(), tuple(x.shape), name, x.device.index,
                                               stream.cuda_stream, x)


def output(compiled: Any, name: str) -> Any:
    """Saved output ``name`` of a program on GPUs as a new torch CUDA tensor, filled on the launch stream;
    torch's current stream waits for it, so the host does not."""
    torch = _torch()
    t = compiled.dag.saved_node(name).type
    gpu = compiled.devices.physical[0]
    dest = torch.empty(t.shape, dtype=_torch_dtype(t.dtype), device=f"cuda:{gpu}")
    current = torch.cuda.current_stream(dest.device)
    compiled.executor.offload_into(name, _raw(dest, current) or dest)
    current.wait_stream(launch_stream(compiled))
    return dest

"""Device buffer views and the adapter that lets Triton take them as pointers."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from relational_tensors.core.dtypes import itemsize

__all__ = ["DevBuf", "Ptr", "acc_type", "fastest_config", "contiguous_strides", "pad4", "merge_dims", "outer_split",
           "ALIGN", "align", "env_switch"]

ALIGN = 256  # bytes: where every block of an arena (and every piece of a kernel's scratch) starts


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def env_switch(name: str, given: bool | None = None) -> bool:
    """``given`` when given, else whether the environment variable ``name`` leaves a switch on (unset: on;
    "0", "false", "off" or "no": off; anything else: on): how the executors' and kernels' optional paths
    are turned off."""
    if given is not None:
        return bool(given)
    value = os.environ.get(name)
    return value is None or value.strip().lower() not in ("0", "false", "off", "no")


def acc_type(dtype: str, exact_ints: bool = False):
    """The type a Triton kernel computes in for ``dtype``: float32 for 16- and 32-bit floats, float64
    for float64 (so a float64 program keeps float64 precision), and with ``exact_ints`` the integer type
    itself (an integer sum stays exact past 2**24)."""
    import triton.language as tl

    if dtype == "float64":
        return tl.float64
    if exact_ints and dtype in ("int32", "int64"):
        return tl.int32 if dtype == "int32" else tl.int64
    return tl.float32


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


@dataclass(frozen=True)
class DevBuf:
    """A view of device memory: pointer, shape, element strides, dtype name, device."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    device: int
    strides: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.strides:
            object.__setattr__(self, "strides", contiguous_strides(self.shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    def sub(self, lower: tuple[int, ...], shape: tuple[int, ...]) -> DevBuf:
        """The view of the box at ``lower`` (relative) with ``shape``."""
        off = sum(lo * s for lo, s in zip(lower, self.strides))
        return DevBuf(self.ptr + off * itemsize(self.dtype), tuple(shape), self.dtype, self.device, self.strides)

    def permuted(self, perm: tuple[int, ...]) -> DevBuf:
        return DevBuf(self.ptr, tuple(self.shape[p] for p in perm), self.dtype, self.device,
                      tuple(self.strides[p] for p in perm))

    def as_dtype(self, dtype: str) -> DevBuf:
        return DevBuf(self.ptr, self.shape, dtype, self.device, self.strides)

    @property
    def is_contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape)

    def cupy(self):  # -> cupy.ndarray
        """A CuPy array over this view, with its strides; bfloat16 as its uint16 bit patterns (CuPy has
        no bfloat16).  The memory stays owned by whoever allocated it."""
        import cupy
        import numpy as np

        from relational_tensors.core.dtypes import numpy_dtype

        dtype = np.dtype(np.uint16 if self.dtype == "bfloat16" else numpy_dtype(self.dtype))
        extent = (sum((n - 1) * st for n, st in zip(self.shape, self.strides)) + 1) * dtype.itemsize if self.size else 1
        mem = cupy.cuda.UnownedMemory(self.ptr, max(extent, 1), None, self.device)
        return cupy.ndarray(self.shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0),
                            strides=tuple(st * dtype.itemsize for st in self.strides))


class Ptr:
    """What Triton needs of a tensor argument: ``data_ptr()`` and a ``dtype`` it can name."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, buf: DevBuf | int, dtype: str | None = None) -> None:
        if isinstance(buf, DevBuf):
            self._ptr, self.dtype = buf.ptr, dtype or buf.dtype
        else:
            self._ptr, self.dtype = int(buf), dtype or "float32"
        if self.dtype == "bool":  # one byte each: copied as int8
            self.dtype = "int8"

    def data_ptr(self) -> int:
        return self._ptr


def merge_dims(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop unit dimensions and merge neighbours that are contiguous in every stride set."""
    dims = [(n, [s[d] for s in strides]) for d, n in enumerate(shape) if n != 1]
    if not dims:
        return (1,), [(1,) for _ in strides]
    merged = [dims[0]]
    for n, st in dims[1:]:
        pn, pst = merged[-1]
        if all(ps == s * n for ps, s in zip(pst, st)):
            merged[-1] = (pn * n, st)
        else:
            merged.append((n, st))
    return tuple(n for n, _ in merged), [tuple(st[k] for _, st in merged) for k in range(len(strides))]


def pad4(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Merge dims, then left-pad to rank 4 (the rank the strided kernels index)."""
    shape, strides_l = merge_dims(shape, *strides)
    if len(shape) > 4:
        raise ValueError(f"strided kernels handle rank <= 4 after merging; got shape {shape}")
    pad = 4 - len(shape)
    return (1,) * pad + shape, [(0,) * pad + s for s in strides_l]


def outer_split(shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...],
                rank: int) -> Iterator[tuple[list[int], tuple[int, ...], list[tuple[int, ...]]]]:
    """The pieces a rank-``rank`` strided kernel covers a view in: merged, left-padded to ``rank``, and
    where more dimensions than that are left, one piece per index of the leading ones.  Yields (the
    element offset of the piece in each stride set, its shape, its strides)."""
    merged, strides_l = merge_dims(shape, *strides)
    lead = len(merged) - rank
    if lead <= 0:
        yield [0] * len(strides_l), (1,) * -lead + merged, [(0,) * -lead + s for s in strides_l]
        return
    inner = merged[lead:]
    for idx in itertools.product(*(range(n) for n in merged[:lead])):
        yield ([sum(i * st for i, st in zip(idx, s[:lead])) for s in strides_l], inner,
               [s[lead:] for s in strides_l])


_BOUND = False


def bind_triton_to_cupy() -> None:
    """Make Triton launch on CuPy's current stream and device.

    Triton asks its active driver for the current stream and device at every
    launch (by default through torch, or the legacy default stream, which a
    CUDA graph cannot capture); answering with CuPy's lets the executor put
    every kernel on its own per-device streams."""
    global _BOUND
    if _BOUND:
        return
    import cupy
    from triton.runtime import driver

    active = driver.active
    active.get_current_stream = lambda device=None: cupy.cuda.get_current_stream().ptr
    active.get_current_device = lambda: cupy.cuda.runtime.getDevice()
    active.set_current_device = lambda device: cupy.cuda.runtime.setDevice(device)
    _BOUND = True


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was defined for Triton's interpreter (``TRITON_INTERPRET=1`` when its module was
    imported): no timing there, and no tensor descriptors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def chosen_config(chosen: dict, key: Any, configs: Sequence[Any], launch: Callable[[Any], None],
                  uses_tma: Callable[[Any], bool], what: str) -> Any:
    """:func:`fastest_config` of ``configs`` once per ``key`` (a shape class), kept in ``chosen``."""
    if key not in chosen:
        chosen[key] = fastest_config(configs, launch, uses_tma, what)
    return chosen[key]


def fastest_config(configs: Sequence[Any], launch: Callable[[Any], None], uses_tma: Callable[[Any], bool],
                   what: str) -> Any:
    """The fastest of ``configs`` for a kernel ``launch(config)`` runs: each is launched once (compile and
    warm-up), then timed over three launches between CUDA events on the current stream.  A config that does
    not fit the GPU's shared memory or registers, or a tensor-descriptor one (``uses_tma``) that this Triton
    cannot compile, is skipped.  Configurations are chosen in an eager run: during graph capture, or when
    none fits, an ExecError names ``what``."""
    import cupy

    from relational_tensors.errors import ExecError

    stream = cupy.cuda.get_current_stream()
    if cupy.cuda.runtime.streamIsCapturing(stream.ptr):
        raise ExecError(f"{what} configurations are chosen in the first (eager) run, not during graph capture; "
                        "execute once before capturing.")
    best, best_t = None, float("inf")
    for cfg in configs:
        try:
            launch(cfg)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(3):
                launch(cfg)
            end.record(stream)
            end.synchronize()
            t = cupy.cuda.get_elapsed_time(start, end)
        except Exception as e:  # out of shared memory or registers for this config
            out_of_resources = "OutOfResources" in type(e).__name__ or "out of resource" in str(e).lower()
            tma_unsupported = uses_tma(cfg) and ("CompilationError" in type(e).__name__ or "PassManager" in str(e))
            if not (out_of_resources or tma_unsupported):
                raise
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise ExecError(f"no {what} configuration fits this GPU's shared memory and registers.")
    return best

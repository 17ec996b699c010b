"""Calibration: how kernels are timed, and the calibration file that the kernel cost model reads.

A calibration file holds the achieved rates of our own kernels as curves (rate against FLOPs or bytes
per call, per family: ``matmul``, ``attention``, ``memory``) that ``KernelModel.from_calibration`` --
the whole-plan simulator and ``cost_model="calibrated"`` -- interpolate.  ``kernels.probes`` runs the
kernels (``relational-tensors calibrate``) with :func:`time_cuda` and writes the file with
:func:`write_calibration`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["time_cuda", "time_wall", "median_seconds", "write_calibration"]


def time_cuda(fn: Callable[[], None], stream: Any = None, rounds: int = 10, warmups: int = 2) -> list[float]:
    """Milliseconds of each of ``rounds`` calls of ``fn`` after ``warmups``, between CUDA events on
    ``stream`` (default: CuPy's current stream), the work ``fn`` issues there included."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    for _ in range(warmups):
        fn()
    stream.synchronize()
    times = []
    for _ in range(rounds):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return times


def time_wall(fn: Callable[[], None], rounds: int = 10, warmups: int = 2) -> list[float]:
    """Milliseconds of each of ``rounds`` calls of ``fn`` after ``warmups``, by the wall clock: for work
    on streams we hold no handle on (JAX), or not captured; ``fn`` must wait for its own work."""
    import time

    for _ in range(warmups):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_seconds(fn: Callable[[], None]) -> float:
    """Seconds: the median of :func:`time_cuda`."""
    return statistics.median(time_cuda(fn)) * 1e-3


def write_calibration(curves: dict[str, list[list[float]]], gpu: str, out: str | Path) -> dict:
    """Write a calibration file of ``curves`` measured on ``gpu`` to ``out``; returns what it wrote."""
    data = {"gpu": gpu, "source": "relational-tensors calibrate: our kernels, CUDA events, median of 10 rounds",
            "curves": curves}
    Path(out).write_text(json.dumps(data, indent=2))
    return data

"""What the ``device`` argument names: p logical devices, on CPUs or GPUs.

* ``"cpu:N"``       N virtual CPU devices (NumPy executor);
* ``N`` (int)       N GPUs (0..N-1), which may be absent when only planning;
* ``[0, 1, ...]``   those GPUs;
* ``"cuda:0,0,0,0"`` logical devices on the named GPUs (several may share one);
* ``None``          every visible GPU, or the CPU cores when there is none.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from relational_tensors.errors import PlanError

__all__ = ["DeviceSet", "parse_devices", "visible_gpus", "MAX_DEVICES", "host_available_memory", "gpu_total_memory"]

# the most logical devices a plan may span: planning grows faster than p**2 (every operator's splits,
# every exchange's all-to-all), and far beyond an NVLink domain it would not finish in useful time
MAX_DEVICES = 1024


@dataclass(frozen=True)
class DeviceSet:
    """p logical devices: their kind and the physical id behind each."""

    kind: str                 # "cpu" or "cuda"
    physical: tuple[int, ...]  # one entry per logical device

    @property
    def p(self) -> int:
        return len(self.physical)

    def per_physical(self) -> dict[int, int]:
        """Physical device -> how many logical devices it runs."""
        return dict(Counter(self.physical))

    def __str__(self) -> str:
        if self.kind == "cpu":
            return f"cpu:{self.p}"
        return "cuda:" + ",".join(map(str, self.physical))


def visible_gpus() -> int:
    """How many CUDA GPUs CuPy sees (0 without CuPy or a driver)."""
    try:
        import cupy  # type: ignore[import-not-found]

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def host_available_memory() -> int | None:
    """Bytes of host memory available to new work (Linux's MemAvailable), or None where it is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def gpu_total_memory(gpu: int) -> int | None:
    """Bytes of memory of CUDA GPU ``gpu``, or None without CuPy or that GPU."""
    try:
        import cupy  # type: ignore[import-not-found]

        with cupy.cuda.Device(gpu):
            return int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception:
        return None


def _bounded(count: int, device: object) -> int:
    if count > MAX_DEVICES:
        raise PlanError(f"a plan spans at most {MAX_DEVICES} logical devices; got {count:,} from device={device!r}. "
                        f"Plan for {MAX_DEVICES} or fewer.")
    return count


def parse_devices(device: object) -> DeviceSet:
    """Resolve ``device`` (see the module docstring).

    >>> parse_devices("cpu:8").p, str(parse_devices("cuda:0,0,1"))
    (8, 'cuda:0,0,1')
    """
    bad = PlanError(
        f"device must be None, an int count, a list of GPU ids, 'cpu:N' or 'cuda:i,j,...'; got {device!r}."
    )
    if device is None:
        n = visible_gpus()
        return DeviceSet("cuda", tuple(range(n))) if n else DeviceSet("cpu", tuple(range(os.cpu_count() or 1)))
    if isinstance(device, bool):
        raise bad
    if isinstance(device, int):
        if device < 1:
            raise PlanError(f"device count must be at least 1; got {device}. Use 1 or more.")
        return DeviceSet("cuda", tuple(range(_bounded(device, device))))
    if isinstance(device, str):
        kind, _, rest = device.partition(":")
        if kind == "cpu":
            if rest == "":
                return DeviceSet("cpu", (0,))
            if not (rest.isascii() and rest.isdigit()):  # '²'.isdigit() is True, and int('²') fails
                raise bad
            if int(rest) < 1:
                raise PlanError(f"device count must be at least 1; got {device!r}. Use 'cpu:1' or more.")
            return DeviceSet("cpu", tuple(range(_bounded(int(rest), device))))
        if kind in ("cuda", "gpu"):
            if rest == "":
                return parse_devices(None) if visible_gpus() else DeviceSet("cuda", (0,))
            parts = rest.split(",")
            if not all(x.strip().isascii() and x.strip().isdigit() for x in parts):
                raise bad
            _bounded(len(parts), device)
            return DeviceSet("cuda", tuple(int(x) for x in parts))
        raise bad
    if isinstance(device, Sequence) and not isinstance(device, (bytes, bytearray)):
        ids = list(device)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad
        _bounded(len(ids), device)
        return DeviceSet("cuda", tuple(ids))
    raise bad

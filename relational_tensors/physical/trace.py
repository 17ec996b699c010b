"""Chrome/Perfetto traces of a timeline, simulated or measured."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relational_tensors.physical.simulate import PlanSimResult

__all__ = ["write_trace"]


def write_trace(result: PlanSimResult, path: str | Path, device_names: Mapping[int, str] | None = None) -> Path:
    """A Chrome/Perfetto trace: one process per device, a compute track and a transfer track."""
    events: list[dict[str, Any]] = []
    devices = sorted({t.device for t in result.tasks})
    for d in devices:
        name = (device_names or {}).get(d, f"device {d}")
        events.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": name}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 1, "args": {"name": "transfers in"}})
    for t in result.tasks:
        events.append({
            "name": t.label, "cat": t.kind, "ph": "X", "pid": t.device, "tid": 1 if t.kind == "copy" else 0,
            "ts": t.start * 1e6, "dur": max((t.end - t.start) * 1e6, 0.001),
            "args": {"bytes": t.bytes, "task": t.task, **({"from": t.src_device} if t.src_device is not None else {})},
        })
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                "otherData": {"topology": result.topology, "predicted_s": result.time}}))
    return path

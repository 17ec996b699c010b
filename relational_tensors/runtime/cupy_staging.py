"""The GPU executor's asynchronous input and output path, a mixin of ``CupyExecutor``.

``stage`` takes a run's changing inputs (a batch, learning rates, a random state) onto the devices on the
launch stream, without the host waiting: a device array straight into the one block holding it, or whole
into a fixed buffer per GPU from which the program's first tasks (captured with it in its CUDA graph)
copy the blocks.  Ids are range-checked on the device as they arrive and read back later.
``offload_into`` copies a saved output into a caller's device array on the same stream.  A caller that
knows its arrays' addresses and producer stream (a torch CUDA tensor: ``api/device_io.py``) hands them
as :class:`RawDevice`, ordered after the producer's stream by an event, with no DLPack exchange on the
host.  A whole input, and an output held in one contiguous block, move as one ``cudaMemcpyAsync``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.feeds import refuse_bound
from relational_tensors.errors import ExecError

__all__ = ["Staging", "RawDevice", "_as_device_array"]

D2D = 3  # cudaMemcpyDeviceToDevice


@dataclass(frozen=True)
class RawDevice:
    """A contiguous device array by address: ``dtype`` a NumPy name or ``"bfloat16"``, ``device`` its GPU,
    ``stream`` the stream whose work so far the copies wait for (its producer's; for a destination, the
    stream its memory was last used on; 0 is the legacy default stream, None nothing to wait for),
    ``owner`` what keeps the memory alive until the copies ran."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    device: int
    stream: int | None
    owner: Any = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


class Staging:
    """What ``CupyExecutor`` adds for the asynchronous path (its attributes are the executor's)."""

    cp: Any
    dag: Any
    phys: tuple[int, ...]
    streams: list[Any]
    views: Any
    loaded: bool
    own_issue: bool
    done: int
    split: int
    held: bool
    resident: set[str]
    bound_arrays: dict[str, Any]
    graph_exec: Any
    staged: dict[str, dict[int, Any]]
    _eager_once: bool
    _id_rules: dict[str, list[tuple[str, int, int | None]]]
    _checks: list[tuple[Any, Any, str, str, int, int | None]]
    _pinned: list[Any]
    _inflight: list[tuple[Any, list[Any]]]
    _producer: Any  # the event _after records on a producer's stream (made on first use)

    _holds: Callable[[int], bool]
    _barrier: Callable[[Any], None]
    _check_offload: Callable[[str], None]

    # --- the asynchronous path: a step's inputs in and its outputs out without the host waiting ---------
    @property
    def launch_stream(self) -> Any:
        """The stream the program is launched on; stage() and offload_into() order their copies on it."""
        return self.streams[0]

    def stage(self, feeds: Mapping[str, Any]) -> bool:
        """Load inputs that change every run (a batch, a learning rate) without synchronizing the host:
        device arrays (CuPy, or any ``__dlpack__`` tensor on the plan's first GPU) of the input's exact
        dtype and shape, and host values of a few elements (a learning rate, a random state), each
        written by a kernel.  Every copy is ordered on the launch stream after the producer's stream
        (DLPack's stream handshake) and after the previous run.  An input held in one whole contiguous
        block is copied straight into it; any other is copied whole to each GPU holding blocks of it,
        and the program's first tasks (in its CUDA graph) copy the blocks out.  Ids that index an
        embedding table, the rows put_rows writes or a vocabulary are checked on the device as they arrive,
        and an id out of range is an ExecError at the next stage() or synchronization (as torch reports a
        device-side assert);
        the kernels read such an id as matching no row.  Returns False, changing nothing, where a feed
        needs the checks and conversions of load() (other dtypes, host arrays, a program not yet loaded)."""
        cp = self.cp
        refuse_bound(feeds, self.bound_arrays, "stage")
        self._check_pending(wait=False)
        self._inflight = [(ev, held) for ev, held in self._inflight if not ev.done]
        if not self.loaded or not feeds or not self.own_issue:  # an executor issuing its own way loads
            return False
        origin, home = self.launch_stream, self.phys[0]
        plans: list[tuple[str, Any, Any]] = []  # name, device array or None, host values or None
        with cp.cuda.Device(home), origin:
            for name, value in feeds.items():
                blocks = self.dag.inputs.get(name)
                if blocks is None:
                    return False
                t = self.dag.node(name).type
                storage = np.dtype(np.uint16 if t.dtype == "bfloat16" else numpy_dtype(t.dtype))
                if isinstance(value, (np.ndarray, np.generic, int, float)) and not isinstance(value, bool):
                    host = np.asarray(value)
                    if host.shape != t.shape or host.size > 8 or host.dtype != numpy_dtype(t.dtype):
                        return False
                    plans.append((name, None, host.view(storage).ravel()))
                    continue
                if isinstance(value, RawDevice):
                    if value.device != home or value.shape != t.shape or value.dtype != t.dtype:
                        return False
                    self._after(value.stream)
                    plans.append((name, value, None))
                    continue
                dev = _as_device_array(cp, value)  # under the launch stream: it waits for the producer's
                if dev is None or dev.device.id != home or tuple(dev.shape) != t.shape:
                    return False
                bf16 = str(getattr(value, "dtype", "")).endswith("bfloat16")
                if (t.dtype == "bfloat16") != bf16 or (not bf16 and dev.dtype != storage):
                    return False
                plans.append((name, dev.view(storage) if bf16 else dev, None))
        for name, dev, host in plans:
            self._stage_one(name, dev, host)
        # the callers' arrays stay referenced until the copies have read them: their memory cannot be
        # handed out again before (whatever stream the caller allocated them on)
        read = cp.cuda.Event(disable_timing=True)
        read.record(origin)
        self._inflight.append((read, list(feeds.values())))
        self.done = min(self.done, self.split if {n for n, _, _ in plans} <= self.dag.later else 0)
        self.held = self.held and {n for n, _, _ in plans} <= self.dag.later
        self.resident.update(n for n, _, _ in plans)
        return True

    def _stage_one(self, name: str, dev: Any, host: Any) -> None:
        cp = self.cp
        origin, home = self.launch_stream, self.phys[0]
        blocks = [(box, b) for box, b in self.dag.inputs[name] if self._holds(b)]
        t = self.dag.node(name).type
        direct = None
        if len(blocks) == 1 and blocks[0][0].shape == t.shape:
            view = self.views[blocks[0][1]]
            view = view[0] if isinstance(view, tuple) else view
            if view.device == home and view.is_contiguous:
                direct = view.cupy()
        if direct is not None:
            targets = [direct]
        else:
            if name not in self.staged:
                gpus = sorted({self.phys[self.dag.buffers[b].device] for _, b in blocks})
                storage = np.uint16 if t.dtype == "bfloat16" else numpy_dtype(t.dtype)
                place = {}
                for g in gpus:
                    with cp.cuda.Device(g):
                        place[g] = cp.empty(t.shape, dtype=storage)
                self.staged[name] = place
                self.graph_exec, self._eager_once = None, True
            targets = list(self.staged[name].values())
        with cp.cuda.Device(home), origin:
            if host is not None:  # a kernel per element, the value its argument: no host copy to wait for
                dev = targets[0] if direct is not None else cp.empty(t.shape, dtype=host.dtype)
                flat = dev.reshape(-1)
                for k, v in enumerate(host.tolist()):
                    flat[k:k + 1].fill(v)
                if direct is not None:
                    return
            if isinstance(dev, RawDevice):
                ptr, nbytes = dev.ptr, dev.nbytes
                if self._rules_for(name):
                    self._queue_id_checks(name, _cupy_view(cp, dev))
            else:
                self._queue_id_checks(name, dev)
                src = cp.ascontiguousarray(dev)
                ptr, nbytes = src.data.ptr, src.nbytes
            for dst in targets:  # one cudaMemcpyAsync each, on the launch stream
                if dst.device.id == home:
                    cp.cuda.runtime.memcpyAsync(dst.data.ptr, ptr, nbytes, D2D, origin.ptr)
                else:
                    cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, dst.device.id, ptr, home, nbytes, origin.ptr)

    def _after(self, stream: int | None) -> None:
        """Order the launch stream after the work queued so far on ``stream`` (a raw stream pointer, 0 the
        legacy default stream; None: nothing to wait for)."""
        if stream is None or stream == self.launch_stream.ptr:
            return
        cp = self.cp
        if self._producer is None:
            self._producer = cp.cuda.Event(disable_timing=True)
        cp.cuda.runtime.eventRecord(self._producer.ptr, stream)
        self.launch_stream.wait_event(self._producer)  # the wait takes the event as recorded now: reusable

    def _prologue(self, lo: int, hi: int | None) -> None:
        """Copy every staged input that the tasks ``lo:hi`` read first (a second phase: its own inputs) from
        its whole copy into the blocks of it that each GPU holds, then make every stream wait for all of
        them: the first tasks of a run, captured with the program."""
        first, second = lo == 0, (hi is None or hi > self.split) and lo <= self.split
        names = [n for n in self.staged if (second if n in self.dag.later else first)]
        if not names:
            return
        cp = self.cp
        for name in names:
            place = self.staged[name]
            for box, b in self.dag.inputs[name]:
                if not self._holds(b):
                    continue
                view = self.views[b]
                view = view[0] if isinstance(view, tuple) else view
                d = self.dag.buffers[b].device
                with cp.cuda.Device(self.phys[d]), self.streams[d]:
                    view.cupy()[...] = place[self.phys[d]][box.slices()]
        self._barrier(range(len(self.streams)))

    def _rules_for(self, name: str) -> list[tuple[str, int, int | None]]:
        """How input ``name`` is read as ids: (what, bound, ignored value) for each embedding table it
        indexes and each vocabulary it gives targets of."""
        if name not in self._id_rules:
            rules: list[tuple[str, int, int | None]] = []
            for node in self.dag.operators:
                assert node.op is not None
                if node.kind == "embedding" and self.dag.nodes[node.inputs[1]].name == name:
                    rules.append(("embedding ids", node.op.input_types[0].shape[0], None))
                elif node.kind == "put_rows" and self.dag.nodes[node.inputs[1]].name == name:
                    rules.append(("put_rows ids", node.op.input_types[0].shape[0], None))
                elif node.kind in ("cross_entropy", "cross_entropy_grad") and \
                        self.dag.nodes[node.inputs[2]].name == name:
                    rules.append(("cross-entropy targets", node.op.input_types[0].shape[-1],
                                  getattr(node.op, "ignore_index", None)))
            self._id_rules[name] = list(dict.fromkeys(rules))
        return self._id_rules[name]

    def _queue_id_checks(self, name: str, ids: Any) -> None:
        """Queue the range checks of ids ``ids`` (a device array) on the launch stream: their least and
        greatest value (the ignored value left out) copied to pinned host memory, read later."""
        cp = self.cp
        if not ids.size:
            return
        for what, bound, ignore in self._rules_for(name):
            kept = ids if ignore is None else cp.where(ids == ignore, 0, ids)
            pair = cp.stack([kept.min(), kept.max()]).astype(cp.int64)
            if not self._pinned:
                import cupyx

                self._pinned.append(cupyx.empty_pinned((2,), dtype=np.int64))
            host = self._pinned.pop()
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, pair.data.ptr, pair.nbytes, 2,  # device to host
                                        self.launch_stream.ptr)
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.launch_stream)
            self._checks.append((ev, host, name, what, bound, ignore))

    def _check_pending(self, wait: bool) -> None:
        """Read the id checks whose copies have arrived (``wait``: all of them) and refuse the first
        that found an id out of range."""
        while self._checks:
            ev, host, name, what, bound, ignore = self._checks[0]
            if wait:
                ev.synchronize()
            elif not ev.done:
                return
            self._checks.pop(0)
            lo, hi = int(host[0]), int(host[1])
            self._pinned.append(host)
            if lo < 0 or hi >= bound:
                self._checks.clear()
                allowed = f"[0, {bound})" + (f" or {ignore}" if ignore is not None else "")
                raise ExecError(f"{what} must lie in {allowed}; input {name!r} of an earlier run had values from "
                                f"{lo} to {hi}. That run has finished reading them as matching no row, so its "
                                "outputs and the states it assigned are not to be trusted: check the batch, and "
                                "reload the states from a checkpoint.")

    def offload_into(self, name: str, dest: Any) -> None:
        """Copy saved output ``name`` into ``dest`` (a device array or ``__dlpack__`` tensor of its whole
        shape and dtype on the plan's first GPU) on the launch stream, without synchronizing the host;
        the caller's stream must wait for the launch stream before reading ``dest``."""
        cp = self.cp
        self._check_offload(name)
        origin, home = self.launch_stream, self.phys[0]
        t = self.dag.saved_node(name).type
        with cp.cuda.Device(home), origin:
            if isinstance(dest, RawDevice):
                if dest.dtype != t.dtype:
                    raise ExecError(f"offload_into needs a device array of dtype {t.dtype}; got {dest.dtype}.")
                self._after(dest.stream)
                dest = _cupy_view(cp, dest)
            out = _as_device_array(cp, dest)
            if out is None or out.device.id != home or tuple(out.shape) != t.shape:
                raise ExecError(f"offload_into needs a device array of shape {t.shape} on GPU {home}; got "
                                f"{type(dest).__name__}.")
            if t.dtype == "bfloat16":
                out = out.view(cp.uint16)
            self._barrier([0])
            whole = self._whole_output(name, home)
            if whole is not None and out.flags.c_contiguous and out.dtype == whole.dtype:
                cp.cuda.runtime.memcpyAsync(out.data.ptr, whole.data.ptr, out.nbytes, D2D, origin.ptr)
                return
            for box, b in self.dag.outputs[name]:
                view = self.views[b]
                view = view[0] if isinstance(view, tuple) else view
                if view.device == home:
                    out[box.slices()] = view.cupy()
                else:
                    piece = cp.empty(box.shape, dtype=out.dtype)
                    src = view.cupy()
                    if not src.flags.c_contiguous:
                        with cp.cuda.Device(view.device), self.streams[self.dag.buffers[b].device]:
                            src = cp.ascontiguousarray(src)
                            ev = cp.cuda.Event(disable_timing=True)
                            ev.record()
                        origin.wait_event(ev)
                    cp.cuda.runtime.memcpyPeerAsync(piece.data.ptr, home, src.data.ptr, view.device, piece.nbytes,
                                                    origin.ptr)
                    out[box.slices()] = piece

    def _whole_output(self, name: str, home: int) -> Any:
        """The one contiguous block on ``home`` that holds all of saved output ``name``, as a CuPy array, or
        None."""
        blocks = self.dag.outputs[name]
        if len(blocks) != 1 or blocks[0][0].shape != self.dag.saved_node(name).type.shape:
            return None
        view = self.views[blocks[0][1]]
        view = view[0] if isinstance(view, tuple) else view
        return view.cupy() if view.device == home and view.is_contiguous else None


def _cupy_view(cp: Any, raw: RawDevice) -> Any:
    """A CuPy array over ``raw``'s memory (bfloat16 as its uint16 bits)."""
    mem = cp.cuda.UnownedMemory(raw.ptr, raw.nbytes, raw.owner, raw.device)
    dtype = np.uint16 if raw.dtype == "bfloat16" else np.dtype(raw.dtype)
    return cp.ndarray(raw.shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


def _as_device_array(cp: Any, value: Any) -> Any:
    """A CuPy view of a device array (CuPy, or anything with __dlpack__ on a GPU), else None."""
    if isinstance(value, cp.ndarray):
        return value
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        device = getattr(value, "__dlpack_device__", lambda: (1, 0))()
        if device[0] != 2:  # kDLCUDA
            return None
        if str(getattr(value, "dtype", "")).endswith("bfloat16"):
            value = value.view(__import__("torch").int16)  # CuPy has no bfloat16: move the bits
        return cp.from_dlpack(value)
    return None

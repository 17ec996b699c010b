"""The CuPy executor: the task DAG on NVIDIA GPUs, one process driving every device.

* a stream per logical device (several logical devices may share one GPU),
  CUDA events for the dependencies that cross streams;
* peer access enabled explicitly for every pair of GPUs used; a pair that
  cannot reach the other is an ExecError before anything runs;
* copies are cudaMemcpyPeerAsync (cudaMemcpyAsync within one GPU) issued on
  the destination's stream;
* one arena per logical device, allocated once and laid out from the liveness
  pass (first fit over buffer lifetimes); a buffer whose memory is reused waits
  for every reader of the buffer it replaces;
* chains of elementwise kernel tasks run as one generated kernel each, issued
  where the chain's last task stands (``fusion``; ``fuse=False`` or
  ``RELATIONAL_TENSORS_FUSE=0`` issues every task on its own);
* a kernel writes a sibling task's output as it goes: the forward attention the log-sum-exp rows that
  the backward's ``attention_lse`` task would recompute, one ``swiglu_grad`` both gradients
  (``memory_plan.sibling_tasks``; off with ``siblings=False`` or ``RELATIONAL_TENSORS_SIBLINGS=0``);
* the first execute() runs eagerly (it compiles the Triton kernels); the
  second captures the whole DAG into one CUDA graph, and every later execute()
  is a graph launch;
* ``stage`` (``cupy_staging``) takes the inputs that change every run on the
  launch stream without the host waiting; inputs held in several blocks are
  copied whole into a fixed buffer, and the graph's first tasks copy the blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from relational_tensors.core.dtypes import bf16_bits_to_float32, float32_to_bf16_bits, itemsize, numpy_dtype
from relational_tensors.core.feeds import (
    STALE_OUTPUTS,
    check_loaded,
    refuse_bound,
    refuse_out_of_range,
    refuse_overflow,
)
from relational_tensors.errors import ExecError
from relational_tensors.kernels import triton_copy as tc
from relational_tensors.kernels import triton_elementwise as te
from relational_tensors.kernels.common import DevBuf, bind_triton_to_cupy, env_switch
from relational_tensors.kernels.launchers import allocates
from relational_tensors.machine.devices import DeviceSet
from relational_tensors.physical.tasks import (
    AggregatePayload,
    DecomposePayload,
    Liveness,
    RecomposePayload,
    Task,
    TaskDAG,
    phase_range,
    phase_ready,
)
from relational_tensors.runtime.binding import gpu_bindings, place_copied
from relational_tensors.runtime.cupy_staging import Staging, _as_device_array
from relational_tensors.runtime.fusion import fusion_enabled
from relational_tensors.runtime.memory_plan import (
    ALIGN,
    SIBLINGS,
    buffer_bytes,
    plan_memory,
    sibling_tasks,
    view_geometry,
)
from relational_tensors.runtime.memory_plan import align as _align
from relational_tensors.sql_specs.base import Operator

__all__ = ["CupyExecutor"]

AGG_OPS = {"sum": "add", "max": "maximum", "min": "minimum", "logsumexp": "logaddexp"}
SIBLINGS_ENV = "RELATIONAL_TENSORS_SIBLINGS"  # "0": every task runs its own kernel (memory_plan.sibling_tasks)
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction (and the GPUs) from the unified addresses


class CupyExecutor(Staging):
    """Runs one TaskDAG on GPUs; ``load`` once, ``execute`` many times (a CUDA graph after the first)."""

    def __init__(self, dag: TaskDAG, live: Liveness, devices: DeviceSet,
                 attention: str = "triton", fuse: bool | None = None, siblings: bool | None = None,
                 bind: Mapping[str, Any] | None = None) -> None:
        try:
            import cupy
        except ImportError as e:
            raise ExecError(f"the GPU backend needs CuPy: {e}. Install the 'gpu' or 'gpu-cuda13' extra.") from None
        self.cp = cupy
        self.dag, self.live, self.devices = dag, live, devices
        self.attention = attention
        # kernels that write a sibling task's output as they go (memory_plan.sibling_tasks); not the forward's
        # log-sum-exp with library FlashAttention kernels, which do not hand it out
        on = env_switch(SIBLINGS_ENV, siblings)
        self.siblings = tuple(k for k in SIBLINGS if on and not (k == "attention_lse" and attention == "flash"))
        if attention == "flash":
            from relational_tensors.kernels.flash import backend

            if backend() is None:
                raise ExecError("attention='flash' needs flash-attn or PyTorch with CUDA, and neither can be "
                                "imported here; install one, or compile with attention='triton'.")
        wide = sorted({n.name for n in dag.nodes if n.kind == "attention" and n.type.dtype == "float64"})
        if wide:
            raise ExecError(f"attention in float64 has no GPU kernel (the Triton kernel computes in float16, "
                            f"bfloat16 or float32); got float64 attention {wide}. Cast q, k and v to float32 "
                            f"on the GPU, or run float64 on the CPU backend (device='cpu:N').")
        self.phys = devices.physical
        visible = cupy.cuda.runtime.getDeviceCount()
        missing = sorted({g for g in self.phys if g >= visible})
        if missing:
            raise ExecError(f"the plan uses GPUs {missing}, but only {visible} are visible.")
        self._enable_peers()
        bind_triton_to_cupy()
        self.streams = []
        for d in range(dag.p):
            with cupy.cuda.Device(self.phys[d]):
                self.streams.append(cupy.cuda.Stream(non_blocking=True))
        # fused kernels, and kernel scratch in the arena, where this class's _issue_all issues the tasks (a
        # subclass that issues them its own way, on two streams, runs every task alone with scratch apart)
        self.own_issue = type(self)._issue_all is CupyExecutor._issue_all
        self.fusing = fusion_enabled(fuse) and self.own_issue
        # inputs read in place from the caller's arrays (runtime/binding.py): their blocks' views point there
        self.bound_arrays: dict[str, Any] = {}
        self.bound: dict[int, DevBuf] = {}
        if bind:
            self.bound_arrays, self.bound = gpu_bindings(cupy, dag, bind, self.phys, self._keeps)
        self._layout()
        self._constants()
        self._dependencies()
        self._fuse()
        self.loaded = False
        self.resident: set[str] = set(self.bound_arrays)
        place_copied(cupy, dag, self.bound_arrays, self.bound, self.views, self._keeps)
        self.runs = 0
        self.done = 0  # tasks issued, in order, since the inputs they read were loaded (phases: see execute)
        self.split = dag.phase_split if dag.phase_split is not None else len(dag.tasks)
        self.ready = phase_ready(dag)
        self.held = False  # what a first phase left for the second is on the devices
        self.graph_exec: Any = None
        # inputs staged by stage(): per input, a whole copy on each GPU that holds a block of it, which the
        # program's first tasks (captured with it) copy into the blocks; and the id checks in flight
        self.staged: dict[str, dict[int, Any]] = {}
        self._eager_once = False  # run once eagerly before the next capture (new kernels, new staging)
        self._id_rules: dict[str, list[tuple[str, int, int | None]]] = {}
        self._checks: list[tuple[Any, Any, str, str, int, int | None]] = []
        self._pinned: list[Any] = []
        self._inflight: list[tuple[Any, list[Any]]] = []  # (copies read, the arrays they read)
        self._producer: Any = None  # the event stage() records on a producer's stream
        # a kernel task serves an operator node: its op and the node's operator are set
        self.capturable = not any(t.kind == "kernel"
                                  and (allocates(cast(Operator, dag.nodes[cast(int, t.op)].op))
                                       or "flash" in self.task_consts.get(t.id, {}))
                                  for t in dag.tasks)

    # --- setup ---------------------------------------------------------------------
    def _keeps(self, device: int) -> bool:
        """Whether this executor holds logical device ``device``'s memory and runs its tasks (all here)."""
        return True

    def _mine(self, t: Task) -> bool:
        """Whether this executor issues task ``t`` (every task here)."""
        return True

    def _enable_peers(self) -> None:
        rt = self.cp.cuda.runtime
        gpus = sorted(set(self.phys))
        for a in gpus:
            for b in gpus:
                if a == b:
                    continue
                if not rt.deviceCanAccessPeer(a, b):
                    raise ExecError(f"GPU {a} cannot access GPU {b} directly (no peer path); this plan copies "
                                    f"between them. Use GPUs that can reach each other, or one GPU with logical "
                                    f"devices (device='cuda:{a},{a},...').")
                with self.cp.cuda.Device(a):
                    try:
                        rt.deviceEnablePeerAccess(b)
                    except rt.CUDARuntimeError as e:  # already enabled is fine
                        if "PeerAccessAlreadyEnabled" not in str(e) and "already" not in str(e).lower():
                            raise ExecError(f"enabling peer access from GPU {a} to GPU {b} failed: {e}") from None

    def _layout(self) -> None:
        """One arena per logical device, laid out by the memory plan (no allocation after this)."""
        cp = self.cp
        dag = self.dag
        from relational_tensors.kernels.launchers import scratch_bytes, task_scratch

        self.fused_groups: list[Any] = []
        done_by = sibling_tasks(dag, self.siblings) if self.siblings else {}
        self.sibling_of = {w: s for s, w in done_by.items()}  # a kernel that writes a sibling task's output too
        self.scratch_needs = task_scratch(dag)  # task -> (shape, dtype) of its scratch
        scratch = scratch_bytes(self.scratch_needs) if self.own_issue else None
        if self.fusing:  # the plan keeps what the fused kernels read until they run (fusion.fusion_plan)
            from relational_tensors.runtime.fusion import fusion_plan

            plan, self.fused_groups = fusion_plan(dag, self.live, done_by, scratch, frozenset(self.bound))
        else:
            plan = plan_memory(dag, self.live, done_by, scratch=scratch, external=frozenset(self.bound))
        self.plan = plan
        self.arena_bytes = dict(plan.arena_bytes)
        self.arenas: list[Any] = []  # None for a device another process holds
        self.views: dict[int, Any] = {}
        for d in range(dag.p):
            if not self._keeps(d):
                self.arenas.append(None)
                continue
            total = plan.arena_bytes[d]
            with cp.cuda.Device(self.phys[d]):
                try:
                    arena = cp.empty(max(total, ALIGN), dtype=cp.uint8)
                except cp.cuda.memory.OutOfMemoryError as e:
                    raise ExecError(f"allocating the {total:,}-byte arena of logical device {d} on GPU "
                                    f"{self.phys[d]} failed: {e}") from None
            self.arenas.append(arena)
        self.views.update(self.bound)
        for b, buf in dag.buffers.items():
            if b in plan.alias or b in self.bound or not self._keeps(buf.device):
                continue
            ptr = self.arenas[buf.device].data.ptr + plan.slots[b].offset
            main, _ = buffer_bytes(dag, b)
            view = DevBuf(ptr, buf.box.shape, buf.dtype, self.phys[buf.device])
            if buf.partial == "lse":
                self.views[b] = (view, DevBuf(ptr + _align(main), buf.box.shape[:-1], "float32", self.phys[buf.device]))
            else:
                self.views[b] = view
        # reshape outputs reinterpret their root's bytes; views are strided sub-boxes of it
        for b, (offset, strides) in view_geometry(dag, plan).items():
            buf = dag.buffers[b]
            if not self._keeps(buf.device):
                continue
            root = self.views[plan.alias[b]]
            self.views[b] = DevBuf(root.ptr + offset * itemsize(buf.dtype), buf.box.shape, buf.dtype, root.device,
                                   strides)
        self.slot_bytes = {b: buffer_bytes(dag, b) for b in dag.buffers}

    def _constants(self) -> None:
        """Per-operator device constants (attention row limits, rope sequence starts) and per-task scratch."""
        from relational_tensors.kernels.launchers import op_constants

        cp = self.cp
        self.keep: list[Any] = []
        per_op: dict[tuple[int, int], dict[str, DevBuf]] = {}
        # per task: DevBufs by name, an lse pair (out, lse) "ping", the packed sequences "flash"
        self.task_consts: dict[int, dict[str, Any]] = {}
        for t in self.dag.tasks:
            if not self._keeps(t.device):
                continue
            if t.kind == "aggregate" and isinstance(t.payload, AggregatePayload) and \
                    t.payload.aggregation.name == "lse" and len(t.inputs) > 2:
                out = self.views[t.outputs[0]]
                with cp.cuda.Device(self.phys[t.device]):
                    o = cp.empty(out[0].nbytes, dtype=cp.uint8)
                    rows = cp.empty(max(out[1].nbytes, 4), dtype=cp.uint8)
                self.keep += [o, rows]
                self.task_consts[t.id] = {"ping": (DevBuf(o.data.ptr, out[0].shape, out[0].dtype, out[0].device),
                                                   DevBuf(rows.data.ptr, out[1].shape, "float32", out[1].device))}
            if t.kind != "kernel":
                continue
            assert t.op is not None  # a kernel task serves an operator node
            node = self.dag.nodes[t.op]
            assert node.op is not None
            key = (t.op, t.device)
            if key not in per_op:
                op_consts = {}
                with cp.cuda.Device(self.phys[t.device]):
                    for name, host in op_constants(node.op).items():
                        arr = cp.asarray(host)
                        self.keep.append(arr)
                        op_consts[name] = DevBuf(arr.data.ptr, host.shape, str(host.dtype), self.phys[t.device])
                per_op[key] = op_consts
            consts: dict[str, Any] = dict(per_op[key])
            if node.kind == "attention" and self.attention == "flash":
                from relational_tensors.kernels import flash

                out_buf = self.dag.buffers[t.outputs[0]]
                segs = flash.segments(node.op, t.kernel.function, out_buf.dtype, out_buf.partial == "lse")
                if segs is not None:
                    consts["flash"] = segs
            sib = self.sibling_of.get(t.id)
            if sib is not None:  # the sibling's operator and blocks, for a kernel that writes both
                sib_task = self.dag.tasks[sib]
                consts["sibling"] = (self.dag.nodes[sib_task.op].op, sib_task.kernel.function)  # type: ignore[index]
            need = self.scratch_needs.get(t.id)
            if need is not None:
                shape, dtype = need
                slot = self.plan.scratch.get(t.id)
                if slot is not None:  # in the arena, alive during this task (the memory plan's)
                    ptr = self.arenas[t.device].data.ptr + slot.offset
                else:
                    with cp.cuda.Device(self.phys[t.device]):
                        arr = cp.empty(max(int(np.prod(shape)) * itemsize(dtype), 1), dtype=cp.uint8)
                    self.keep.append(arr)
                    ptr = arr.data.ptr
                consts["scratch"] = DevBuf(ptr, tuple(shape), dtype, self.phys[t.device])
            self.task_consts[t.id] = consts

    def _dependencies(self) -> None:
        """Events for the tasks that tasks on other streams wait for (the memory plan's waits)."""
        self.waits = self.plan.waits
        self.events = {}
        for tid in sorted({w for ws in self.waits.values() for w in ws}):
            if not self._keeps(self.dag.tasks[tid].device):
                continue  # another process's task: its transfer orders what depends on it
            with self.cp.cuda.Device(self.phys[self.dag.tasks[tid].device]):
                self.events[tid] = self.cp.cuda.Event(block=False, disable_timing=True, interprocess=False)

    def _fuse(self) -> None:
        """The schedule of the fused groups of elementwise tasks (``fusion``; none when not ``fusing``), and
        their kinds and labels for ``profile()``."""
        from relational_tensors.runtime.fusion import FusedSchedule

        self.fusion: FusedSchedule | None = None
        self.profile_kinds: dict[int, tuple[str, str]] = {}
        if self.fusing:
            self.fusion = FusedSchedule.build(self.dag, self.plan, self.live, self.views, self.fused_groups)
            self.profile_kinds = self.fusion.labels(self.dag)

    # --- inputs and outputs ---------------------------------------------------------------
    def _holds(self, buf: int) -> bool:
        """Whether this executor keeps buffer ``buf`` (its device's memory is this process's)."""
        return self._keeps(self.dag.buffers[buf].device)

    def load(self, feeds: Mapping[str, Any], partial: bool = False, owned: bool = False) -> None:
        """Copy every graph input into the blocks the plan reads: NumPy arrays from the host, CuPy
        arrays and any ``__dlpack__`` tensor (a torch CUDA tensor) device to device without a host trip,
        or ``(offset, array)`` pieces of it on the host (``numpy_backend.block_pieces``; ``owned``: read
        for this load alone) assembled block by block."""
        from relational_tensors.core.feeds import check_feed_names, coerce_feed
        from relational_tensors.runtime.numpy_backend import _cover, block_pieces

        cp = self.cp
        refuse_bound(feeds, self.bound_arrays)
        # inputs loaded before (weights) stay loaded: a later load may name only the ones that change
        names = check_feed_names(self.dag.input_nodes, feeds,
                                 [] if partial else [n for n in self.dag.inputs
                                                     if n not in self.resident and n not in self.dag.later])
        # every feed is checked before any is copied: a load that fails changes nothing
        checked: dict[str, tuple[Any, Any]] = {}
        pieced: dict[str, Any] = {}
        for name in self.dag.inputs:
            if name not in feeds:
                continue
            t = names[name].type
            value = feeds[name]
            pieces = block_pieces(name, value, t)
            if pieces is not None:
                pieced[name] = [(box, b, _cover(name, box, pieces, t.dtype, owned)) for box, b in self.dag.inputs[name]
                                if self._holds(b)]
                for _, _, host in pieced[name]:
                    self._check_ids(name, host)
                checked[name] = (None, None)
                continue
            on_device = _as_device_array(cp, value)
            if on_device is not None:
                if tuple(on_device.shape) != t.shape:
                    raise ExecError(f"input {name!r} must have shape {t.shape}; got {tuple(on_device.shape)}.")
                on_device = _device_coerce(cp, name, on_device, t.dtype, value)
                self._check_ids(name, on_device)
                checked[name] = (on_device, None)
            else:
                whole = coerce_feed(name, value, t)
                self._check_ids(name, whole)
                checked[name] = (None, whole)
        # the saved outputs no longer belong to the loaded inputs; loading only second-phase inputs keeps
        # what the first phase made
        self.done = min(self.done, self.split if set(checked) <= self.dag.later else 0)
        self.held = self.held and set(checked) <= self.dag.later
        if set(checked) & set(self.staged):  # written to the blocks below: the staged copy is stale
            for name in set(checked) & set(self.staged):
                del self.staged[name]
            self.graph_exec, self._eager_once = None, True
        for name, (on_device, whole) in checked.items():
            t = names[name].type
            if name in pieced:
                for _, b, host in pieced[name]:
                    view = self.views[b]
                    with cp.cuda.Device(view.device):
                        host = np.asarray(host, order="C")  # (not ascontiguousarray: it makes a 0-d block 1-d)
                        view.cupy().set(host.view(np.uint16) if t.dtype == "bfloat16" else host)
                continue
            blocks = self.dag.inputs[name]
            blocks = [(box, b) for box, b in blocks if self._keeps(self.dag.buffers[b].device)]
            if on_device is not None:
                for box, b in blocks:
                    view = self.views[b]
                    with cp.cuda.Device(view.device):
                        src = on_device[box.slices()]
                        dst = view.cupy()
                        dst[...] = src
            else:
                for box, b in blocks:
                    view = self.views[b]
                    host = np.asarray(whole[box.slices()], order="C")  # a 0-d block stays 0-d
                    if t.dtype == "bfloat16":
                        host = host.view(np.uint16)
                    with cp.cuda.Device(view.device):
                        view.cupy().set(host)
        for d in set(self.phys):
            with cp.cuda.Device(d):
                cp.cuda.Device(d).synchronize()
        self.resident.update(n for n in self.dag.inputs if n in feeds)
        self.loaded = True

    def _check_ids(self, name: str, ids: Any) -> None:
        """Embedding and put_rows ids must index their table's rows and cross-entropy targets their vocabulary
        (or equal ``ignore_index``): the GPU kernels have no way to report a bad index, so a graph input read
        as any of them is checked when it is loaded."""
        from relational_tensors.sql_specs.losses import check_targets

        if not ids.size:
            return
        for what, bound, ignore in self._rules_for(name):  # (the staged path's rules: one list of id readers)
            if what == "cross-entropy targets":
                host = ids if isinstance(ids, np.ndarray) else self.cp.asnumpy(ids)
                try:
                    check_targets(host, bound, ignore)
                except ExecError as e:
                    raise ExecError(f"{e} (input {name!r})") from None
                continue
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= bound:
                raise ExecError(f"{what} must lie in [0, {bound}); got values from {lo} to {hi} in input {name!r}.")

    def offload(self, name: str, like: str = "numpy") -> Any:
        """The saved tensor ``name``: a NumPy array (bfloat16 through ml_dtypes) or, with like="cupy",
        a CuPy array on the GPU of its first block (bfloat16 as its uint16 bit pattern)."""
        self._check_offload(name)
        return self._assemble(self.dag.outputs[name], self.dag.saved_node(name).type, like)

    def _check_offload(self, name: str) -> None:
        """Refuse to offload ``name`` unless it is a saved output that a finished execution made."""
        if name not in self.dag.outputs:
            raise ExecError(f"no saved output named {name!r}; saved: {sorted(self.dag.outputs)}.")
        if self.done < self.ready[name]:
            if self.runs == 0 and not self.done:
                raise ExecError("execute the program before offloading results: cg.execute().")
            raise ExecError(STALE_OUTPUTS)

    def state(self, name: str, like: str = "numpy") -> Any:
        """The current value of a state, assembled from the blocks the GPUs keep of it."""
        if name not in self.resident:
            raise ExecError(f"state {name!r} has no value yet; load it first: cg.load({{{name!r}: array}}).")
        return self._assemble(self.dag.inputs[name], self.dag.node(name).type, like)

    def _assemble(self, blocks: list[tuple[Any, int]], t: Any, like: str) -> Any:
        cp = self.cp
        self.synchronize()
        if like not in ("numpy", "cupy"):
            raise ExecError(f"offload(like=...) takes 'numpy' or 'cupy'; got {like!r}.")
        first = self.views[blocks[0][1]]
        first = first[0] if isinstance(first, tuple) else first
        dtype = np.uint16 if t.dtype == "bfloat16" else numpy_dtype(t.dtype)
        with cp.cuda.Device(first.device):
            out = cp.empty(t.shape, dtype=dtype)
            caller = cp.cuda.get_current_stream()
        # each block is copied on the stream that owns it, so a later execute() or profile() reuses
        # its arena memory only after the copy; the caller's stream then waits for those copies
        for box, b in blocks:
            view = self.views[b]
            view = view[0] if isinstance(view, tuple) else view
            d = self.dag.buffers[b].device
            gpu = self.phys[d]
            with cp.cuda.Device(gpu), self.streams[d]:
                if gpu == first.device:
                    out[box.slices()] = view.cupy()
                    piece = None
                else:  # a contiguous copy here, then a peer copy into place on the caller's stream
                    piece = view.cupy().copy()
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(self.streams[d])
            with cp.cuda.Device(first.device):
                caller.wait_event(ev)
                if piece is not None:
                    here = cp.empty(piece.shape, dtype=dtype)
                    cp.cuda.runtime.memcpyPeerAsync(here.data.ptr, first.device, piece.data.ptr, gpu,
                                                    piece.nbytes, caller.ptr)
                    out[box.slices()] = here
                    caller.synchronize()  # the source piece lives on another GPU's pool: finish before it goes
        if like == "cupy":
            return out
        host = cp.asnumpy(out)
        return host.view(numpy_dtype("bfloat16")) if t.dtype == "bfloat16" else host

    # --- execution ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()
        self._check_pending(wait=True)

    @property
    def fresh(self) -> bool:
        """Every saved output belongs to the loaded inputs (a whole execution was issued after the last load)."""
        return self.done == len(self.dag.tasks)

    def execute(self, phase: int | None = None) -> None:
        """Run the DAG: eagerly the first time, captured into a CUDA graph the second, replayed after.
        With ``phase`` 0 or 1, one phase of a program split in two, eagerly (phase 1 continues a phase 0
        run since the last load of its inputs)."""
        lo, hi = phase_range(self.dag, phase, self.held)
        needed = self.dag.inputs if hi > self.split else {n: v for n, v in self.dag.inputs.items()
                                                           if n not in self.dag.later}
        check_loaded(self.loaded, self.resident & set(needed), needed)
        self.done = min(self.done, lo)  # until this run has been issued
        self.held = False  # a second phase frees what it reads last
        if phase is not None:
            # each phase captured into its own CUDA graph at its second run (since the last change that
            # made the graphs stale), replayed after, as a whole run is
            ex = self.phase_exec.get(phase)
            if ex is None and self.capturable and phase in self._phases_seen:
                try:
                    ex = self.phase_exec[phase] = self._capture(lo, hi)
                except ExecError as e:  # a phase runs inside torch's autograd: eagerly now, not an error
                    self.capturable = False
                    warnings.warn(f"{e} This program's phases run eagerly from now on.", RuntimeWarning,
                                  stacklevel=2)
            if ex is not None:
                self._barrier(into=[0])
                ex.launch(self.streams[0])
            else:
                self._barrier(into=range(len(self.streams)))
                self._issue_all(lo=lo, hi=hi)
                self._phases_seen.add(phase)
            self.done = hi
            self.held = phase == 0
            self.runs += hi == len(self.dag.tasks)
            return
        # the memory plan orders tasks within one run; a run starts only after every stream has
        # finished the previous run (and any offload copies issued on them)
        if self.graph_exec is not None:
            self._barrier(into=[0])
            self.graph_exec.launch(self.streams[0])
        elif self.runs >= 1 and self.capturable and not self._eager_once:
            try:
                self.graph_exec = self._capture()
            except ExecError:
                self.capturable = False  # a launch broke capture: run this program eagerly from now on
                raise
            self.graph_exec.launch(self.streams[0])
        else:
            self._barrier(into=range(len(self.streams)))
            self._issue_all()
            self._eager_once = False
        self.runs += 1
        self.done = len(self.dag.tasks)

    def _barrier(self, into: Any) -> None:
        """Make the streams ``into`` wait for everything issued so far on every other stream."""
        cp = self.cp
        if len(self.streams) < 2:
            return
        marks = []
        for d, s in enumerate(self.streams):
            with cp.cuda.Device(self.phys[d]):
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(s)
            marks.append(ev)
        for d in into:
            with cp.cuda.Device(self.phys[d]):
                for e, ev in enumerate(marks):
                    if e != d:
                        self.streams[d].wait_event(ev)

    def profile(self) -> list[tuple[int, float, float]]:
        """Run the DAG once eagerly with a CUDA event around every task: (task, start ms, end ms)
        measured from a common start on the first device."""
        cp = self.cp
        check_loaded(self.loaded, self.resident, self.dag.inputs)
        self.done, self.held = 0, False
        self.synchronize()
        t0 = cp.cuda.Event()
        t0.record(self.streams[0])
        for s in self.streams[1:]:
            s.wait_event(t0)
        marks: dict[int, tuple[Any, Any]] = {}
        self._issue_all(marks)
        self.synchronize()
        self.runs += 1
        self.done = len(self.dag.tasks)
        return [(tid, cp.cuda.get_elapsed_time(t0, a), cp.cuda.get_elapsed_time(t0, b))
                for tid, (a, b) in marks.items()]

    @property
    def graph_exec(self) -> Any:
        """The whole run captured (None until captured, and after anything that makes a capture stale:
        new staging buffers, a load into staged inputs); setting it to None drops the phases' too."""
        return self._graph_exec

    @graph_exec.setter
    def graph_exec(self, value: Any) -> None:
        self._graph_exec = value
        if value is None:
            self.phase_exec: dict[int, Any] = {}  # each phase of a two-phase program, captured
            self._phases_seen: set[int] = set()  # phases run eagerly since the captures were dropped

    def _capture(self, lo: int = 0, hi: int | None = None) -> Any:
        """Tasks ``lo:hi`` (all: the whole run) captured into a CUDA graph, returned."""
        cp = self.cp
        origin = self.streams[0]
        self.synchronize()
        fork = cp.cuda.Event(disable_timing=True)
        with cp.cuda.Device(self.phys[0]):
            origin.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            fork.record(origin)
            for s in self.streams[1:]:
                s.wait_event(fork)
            self._issue_all(capturing=True, lo=lo, hi=hi)
            self._join_into(origin)
        except BaseException as e:
            self._abandon_capture(origin)
            if isinstance(e, ExecError):
                raise
            raise ExecError(f"capturing the program into a CUDA graph failed: {type(e).__name__}: {e}") from e
        with cp.cuda.Device(self.phys[0]):
            try:
                return origin.end_capture()
            except Exception as e:  # noqa: BLE001 - an error CUDA only reports at the end of the capture
                raise ExecError(f"ending the capture of the program into a CUDA graph failed: "
                                f"{type(e).__name__}: {e}") from e

    def _join_into(self, origin: Any) -> None:
        """Make ``origin`` wait for everything issued on every other stream."""
        cp = self.cp
        for d, s in enumerate(self.streams[1:], start=1):
            with cp.cuda.Device(self.phys[d]):
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(s)
            origin.wait_event(ev)

    def _abandon_capture(self, origin: Any) -> None:
        """End a failed capture, best effort: on an invalidated capture each call may fail too, and the
        origin stream must leave capture mode whatever they do so that later runs are eager."""
        try:
            self._join_into(origin)
        except Exception:  # noqa: BLE001
            pass
        with self.cp.cuda.Device(self.phys[0]):
            try:
                origin.end_capture()
            except Exception:  # noqa: BLE001
                pass

    def _still_capturing(self, stream: Any) -> bool:
        """Whether ``stream`` is in an active capture (CuPy raises once the capture is invalidated)."""
        try:
            return bool(self.cp.cuda.runtime.streamIsCapturing(stream.ptr))
        except Exception:  # noqa: BLE001
            return False

    def _issue_all(self, marks: dict[int, tuple[Any, Any]] | None = None, capturing: bool = False,
                   lo: int = 0, hi: int | None = None) -> None:
        """Issue every task on its stream after the events it waits for; with ``marks``, bracket each
        task with timing events (for profile()).  While ``capturing``, a task after which its stream's
        capture is invalidated (an operation CUDA graphs cannot hold, which not every library reports
        at once) is named in the error.  A fused group runs at its last task, after all its members'
        waits, and records the events of all its members."""
        cp = self.cp
        fusion = self.fusion
        self._prologue(lo, hi)
        for t in self.dag.tasks[lo:hi]:
            if t.kind == "load" or not self._mine(t):
                continue
            if fusion is not None and t.id in fusion.deferred:
                continue  # issued with its group's last task
            fused = fusion.at.get(t.id) if fusion is not None else None
            stream = self.streams[t.device]
            with cp.cuda.Device(self.phys[t.device]), stream:
                for dep in (self.waits[t.id] if fused is None else fused.waits):
                    # a capture holds only its own tasks' events: one of an earlier phase is waited for by
                    # the barrier before the launch (CUDA refuses a wait on an event recorded outside it)
                    if dep in self.events and not (capturing and dep < lo):
                        stream.wait_event(self.events[dep])
                if marks is not None:
                    marks[t.id] = (cp.cuda.Event(), cp.cuda.Event())
                    marks[t.id][0].record(stream)
                try:
                    if fused is None:
                        self._run(t, stream)
                    else:
                        fused.launch()
                except ExecError:
                    raise
                except Exception as e:  # a CUDA, cuBLAS or Triton error: name the task
                    raise ExecError(f"task {t.id} ({t.label}, {t.kind}) on logical device {t.device} "
                                    f"(GPU {self.phys[t.device]}) failed: {type(e).__name__}: {e}") from e
                if capturing and not self._still_capturing(stream):
                    raise ExecError(f"task {t.id} ({t.label}, {t.kind}) on logical device {t.device} (GPU "
                                    f"{self.phys[t.device]}) invalidated the capture of the program into a "
                                    f"CUDA graph; the program runs eagerly from now on.")
                if marks is not None:
                    marks[t.id][1].record(stream)
                for done in (fused.group.tasks if fused is not None else (t.id,)):
                    if done in self.events:
                        self.events[done].record(stream)

    def _run(self, t: Task, stream: Any) -> None:
        dag = self.dag
        views = self.views
        if t.kind == "kernel":
            from relational_tensors.kernels.launchers import launcher_for

            if t.outputs[0] in self.plan.reshaped or t.id in self.plan.done_by:
                return  # a reshape whose output shares its input's memory; a sibling another kernel did
            assert t.op is not None  # a kernel task serves an operator node
            node = self.dag.nodes[t.op]
            out = views[t.outputs[0]]
            if t.id in self.plan.also_writes:  # a sibling's output too: (its own, the sibling's)
                out = (out, views[self.plan.also_writes[t.id]])
            launcher_for(node.kind).launch(node.op, t.kernel.function, [views[b] for b in t.inputs], out,
                                           self.task_consts.get(t.id, {}), stream.ptr)
        elif t.kind in ("copy", "assign"):  # an assign: a state's next value into its kept block
            src, dst = t.inputs[0], t.outputs[0]
            main, extra = self.slot_bytes[src]
            nbytes = _align(main) + extra if extra else main
            sv, dv = views[src], views[dst]
            sp = (sv[0] if isinstance(sv, tuple) else sv)
            dp = (dv[0] if isinstance(dv, tuple) else dv)
            if nbytes == 0:
                return
            if not (sp.is_contiguous and dp.is_contiguous):  # an atom read in place, or written into its block
                tc.copy_box(sp, dp)  # on the destination's stream; across GPUs it reads peer memory
                return
            rt = self.cp.cuda.runtime
            # across GPUs too: with unified addressing and peer access enabled a device-to-device copy
            # goes over the peer link on the copy engines, and unlike cudaMemcpyPeerAsync it can be
            # captured into a graph
            rt.memcpyAsync(dp.ptr, sp.ptr, nbytes, MEMCPY_DEFAULT, stream.ptr)
        elif t.kind == "decompose":
            src_buf = dag.buffers[t.inputs[0]]
            src = views[t.inputs[0]]
            assert isinstance(t.payload, DecomposePayload)
            for cell, b in zip(t.payload.cells, t.outputs):
                rel = tuple(c - s for c, s in zip(cell.lower, src_buf.box.lower))
                if isinstance(src, tuple):
                    tc.copy_box(src[0].sub(rel, cell.shape), views[b][0])
                    tc.copy_box(src[1].sub(rel[:-1], cell.shape[:-1]), views[b][1])
                else:
                    tc.copy_box(src.sub(rel, cell.shape), views[b])
        elif t.kind == "recompose":
            out_buf = dag.buffers[t.outputs[0]]
            out = views[t.outputs[0]]
            assert isinstance(t.payload, RecomposePayload)
            for cell, b in zip(t.payload.cells, t.inputs):
                piece = views[b]
                piece = piece[0] if isinstance(piece, tuple) else piece
                rel = tuple(c - s for c, s in zip(cell.lower, out_buf.box.lower))
                tc.copy_box(piece, out.sub(rel, cell.shape))
        elif t.kind == "aggregate":
            assert isinstance(t.payload, AggregatePayload)
            agg = t.payload.aggregation.name
            ins = [views[b] for b in t.inputs]
            out = views[t.outputs[0]]
            if agg == "lse":
                ping: Any = self.task_consts.get(t.id, {}).get("ping")  # set where it is used: 3+ partials
                # alternate between the output and a scratch pair so no launch reads what it writes
                targets = [out if (len(ins) - 2 - i) % 2 == 0 else ping for i in range(len(ins) - 1)]
                acc = ins[0]
                for i, x in enumerate(ins[1:]):
                    tc.lse_merge(acc, x, targets[i])
                    acc = targets[i]
            else:  # strided: atoms may be read in place and the result written into the block it joins
                op = AGG_OPS[agg]
                te.binary(ins[0], ins[1], out, op)
                for x in ins[2:]:
                    te.binary(out, x, out, op)
        else:
            raise ExecError(f"the GPU executor cannot run task kind {t.kind!r}.")


def _device_coerce(cp: Any, name: str, arr: Any, dtype: str, original: Any) -> Any:
    """A device array in the storage of ``dtype``: floats convert among float dtypes (bfloat16 by
    rounding to its 16-bit pattern), ints among ints; anything else is refused, as on the host."""
    was_bf16 = str(getattr(original, "dtype", "")).endswith("bfloat16")
    kind = "f" if was_bf16 else arr.dtype.kind
    if (kind == "b") != (dtype == "bool"):
        raise ExecError(f"input {name!r} must be {dtype}; got an array of dtype "
                        f"{getattr(original, 'dtype', arr.dtype)}. Pass a boolean array for a mask, and cast one "
                        "for a number.")
    if dtype == "bool":
        return arr
    want_int = dtype.startswith("int")
    if (kind in "iu") != want_int or kind not in "iuf":
        raise ExecError(f"input {name!r} must be {dtype}; got an array of dtype "
                        f"{getattr(original, 'dtype', arr.dtype)}. Convert it first.")
    if want_int:
        refuse_out_of_range(name, arr, dtype)
    if dtype == "bfloat16":
        if was_bf16:
            return arr.view(cp.uint16)
        wide = arr.astype(cp.float32)
        refuse_overflow(name, arr, wide, dtype, cp)
        return float32_to_bf16_bits(wide, cp)
    if was_bf16:
        return bf16_bits_to_float32(arr.view(cp.uint16), cp).astype(numpy_dtype(dtype))
    out = arr.astype(numpy_dtype(dtype), copy=False)
    if not want_int:
        refuse_overflow(name, arr, out, dtype, cp)
    return out

"""Convolutions by cuDNN, through NVIDIA's cuDNN frontend (``pip install nvidia-cudnn-frontend``, the
``cudnn`` extra), where it is installed and finds an engine for the block.

A block of a split convolution is a convolution of its own: its output positions [o0, o0 + n) read the
input rows ``o·stride - padding + tap·dilation``, and the block's input holds those rows that exist
(the halo the plan gave it), so cuDNN computes the block with padding of its own on each side (pre and
post padding, which cuDNN takes apart) after the input view is moved past rows the block does not read.
The gradients are the same geometry: the weight gradient (``conv_wgrad``) of an input block against a dy
block, and the data gradient (``conv_dgrad``) of a dy block written into the rows of the dx block its
windows reach.

Each geometry is built once (cuDNN's heuristics, mode A then its fallback), with its workspace held to
the scratch the plan already reserved for the GEMM form (``kernels.launchers.conv``): the memory the
liveness predicted is the most it uses.  Its execution enqueues on the task's stream and allocates
nothing, so it is captured into the program's CUDA graph with the rest.  Only 16-bit blocks take this
path (float32 keeps cuBLAS's exact float32 GEMMs: cuDNN may use TF32), and only ungrouped convolutions.
Where the package is missing, ``$RELATIONAL_TENSORS_CUDNN`` is ``0``, or cuDNN has no engine for a
block, the caller's GEMM form runs instead: every function returns whether it computed the block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

from relational_tensors.kernels.common import DevBuf, env_switch

__all__ = ["CUDNN_ENV", "available", "fprop", "wgrad", "dgrad", "geometry"]

log = logging.getLogger(__name__)
CUDNN_ENV = "RELATIONAL_TENSORS_CUDNN"  # "0", "false", "off" or "no": convolutions keep the GEMM form
_ALIGN = 16  # bytes: cuDNN's tensor-core engines read and write 16-byte aligned addresses
_builds: dict[tuple[Any, ...], Any] = {}  # geometry -> (graph, its x/w/dy tensors, output) or None (no engine)


@lru_cache(maxsize=1)
def _module() -> Any:
    """The ``cudnn`` frontend module with a cuDNN library loaded, or None."""
    try:
        import cudnn

        cudnn.backend_version()  # raises when no libcudnn could be loaded
        return cudnn
    except Exception:  # noqa: BLE001 - not installed, or no cuDNN library for it
        return None


def available() -> bool:
    """Whether convolution blocks go to cuDNN (the package and its library load, and the switch is on)."""
    return env_switch(CUDNN_ENV) and _module() is not None


@cache
def _handle(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return _module().create_handle()


def geometry(lo: Sequence[int], hi: Sequence[int], o0: Sequence[int], n: Sequence[int], kernel: Sequence[int],
             stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
             ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Output positions [o0, o0 + n) of a convolution whose input block holds rows [lo, hi), per spatial
    dimension: (the rows of the block to skip at its start, how many to read, pre padding, post padding)
    such that the convolution of those rows with that padding gives exactly the n positions.

    >>> geometry([0], [8], [0], [8], [3], [1], [1], [1])  # a whole row, padded 1 on each side
    ([0], [8], [1], [1])
    >>> geometry([3], [9], [4], [4], [3], [1], [1], [1])  # positions 4..7 read rows 3..8: all of the block
    ([0], [6], [0], [0])
    >>> geometry([0], [56], [0], [28], [1], [2], [0], [1])  # stride 2: the last row is never read
    ([0], [56], [0], [0])
    """
    skip, rows, pre, post = [], [], [], []
    for i in range(len(kernel)):
        first = o0[i] * stride[i] - padding[i] - lo[i]  # the first row read, relative to the block
        end = (o0[i] + n[i] - 1) * stride[i] - padding[i] + dilation[i] * (kernel[i] - 1) + 1 - lo[i]
        have = hi[i] - lo[i]
        start = max(first, 0)
        # rows past the last window are read as they are unless they would make another position
        stop = end if have - end >= stride[i] else have
        skip.append(start)
        rows.append(max(stop - start, 0))
        pre.append(max(-first, 0))
        post.append(max(end - have, 0))
    return skip, rows, pre, post


def _dtype(name: str) -> Any:
    dt = _module().data_type
    return {"bfloat16": dt.BFLOAT16, "float16": dt.HALF, "float32": dt.FLOAT}.get(name)


def _aligned(*bufs: DevBuf) -> bool:
    return all(b.ptr % _ALIGN == 0 for b in bufs)


def _tensor(graph: Any, name: str, buf: DevBuf) -> Any:
    return graph.tensor(name=name, dim=_dims(buf.shape), stride=_dims(buf.strides, buf.shape),
                        data_type=_dtype(buf.dtype))


def _dims(values: Sequence[int], shape: Sequence[int] | None = None) -> list[int]:
    """A block's dims (or, given its ``shape``, its strides) as cuDNN takes them: a 1-D convolution's
    tensors [n, c, l] as [n, c, 1, l] (cuDNN convolves 2-D and 3-D only); the unit row's stride is the
    whole row's."""
    out = list(values)
    if len(out) == 3:
        out.insert(2, 1 if shape is None else out[2] * max(shape[2], 1))
    return out


def _spatial(values: Sequence[int], unit: int, rank: int) -> list[int]:
    """Per-dimension padding, stride or dilation as cuDNN takes them (``unit`` for the row a 1-D convolution
    gains)."""
    return [unit, *values] if rank == 1 else list(values)


def _build(key: tuple[Any, ...], make: Any, workspace: int) -> Any:
    """The built graph of ``key`` (``make(graph)`` adds its operation and returns its tensors), or None when
    cuDNN has no engine for it within ``workspace`` bytes."""
    if key in _builds:
        return _builds[key]
    cudnn = _module()
    built = None
    try:
        graph = cudnn.pygraph(io_data_type=_dtype(key[2]), intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=_handle(key[1]))
        tensors = make(graph)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        # engines whose sums depend on the run (atomics) are left out: the same inputs give the same bits
        graph.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
        graph.deselect_workspace_greater_than(workspace)  # before check_support, which may pick an engine
        graph.check_support()
        graph.build_plans()
        if graph.get_workspace_size() <= workspace:
            built = (graph, tensors)
        else:
            log.debug("cuDNN %s: no engine within %d bytes of workspace; the GEMM form runs it", key[0], workspace)
    except Exception as e:  # noqa: BLE001 - no engine for this geometry: the GEMM form computes it
        log.debug("cuDNN has no engine for %s (%s); the GEMM form runs it", key, e)
        built = None
    _builds[key] = built
    return built


def _run(key: tuple[Any, ...], built: Any, pointers: Sequence[DevBuf], scratch: DevBuf, device: int,
         stream: int) -> bool:
    """Execute a built geometry on ``stream``; False (and the geometry is left to the GEMM form from now on)
    where cuDNN refuses to launch it.  The first run of a program is eager, so a refusal comes before any
    capture."""
    cudnn = _module()
    graph, tensors = built
    handle = _handle(device)
    try:
        cudnn.set_stream(handle=handle, stream=int(stream))
        graph.execute({t: int(b.ptr) for t, b in zip(tensors, pointers)}, int(scratch.ptr), handle=handle)
    except Exception as e:  # noqa: BLE001 - an engine that built but does not launch here
        log.debug("cuDNN did not launch %s (%s); the GEMM form runs it", key, e)
        _builds[key] = None
        return False
    return True


def _common(op: Any, scratch: DevBuf, *bufs: DevBuf) -> bool:
    """Whether a block may go to cuDNN at all: ungrouped, 16-bit inputs, aligned (the workspace too),
    nothing empty."""
    return (op.groups == 1 and bufs[0].dtype in ("bfloat16", "float16") and _aligned(scratch, *bufs)
            and all(b.size for b in bufs) and available())


# per operation: the graph method, its two operands' keyword names, and the output's name
_OPERATIONS = {"fprop": ("conv_fprop", "image", "weight"), "wgrad": ("conv_wgrad", "image", "loss"),
               "dgrad": ("conv_dgrad", "loss", "filter")}


def _convolve(kind: str, op: Any, a: DevBuf, b: DevBuf, out: DevBuf, pre: list[int], post: list[int],
              scratch: DevBuf, stream: int, before: Any = None) -> bool:
    """Operation ``kind`` of ``_OPERATIONS`` on operands ``a`` and ``b`` into ``out`` with that padding, built
    once per geometry (``before()``, when given, runs just before the launch); False where cuDNN has no
    engine for it."""
    if not _aligned(a, b, out):
        return False
    key = (kind, out.device, a.dtype, out.dtype, a.shape, a.strides, b.shape, b.strides, out.shape, out.strides,
           tuple(pre), tuple(post), tuple(op.stride), tuple(op.dilation), scratch.nbytes)
    method, first, second = _OPERATIONS[kind]

    def make(graph: Any) -> tuple[Any, ...]:
        A, B = _tensor(graph, "a", a), _tensor(graph, "b", b)
        rank = op.rank
        Y = getattr(graph, method)(**{first: A, second: B}, pre_padding=_spatial(pre, 0, rank),
                                   post_padding=_spatial(post, 0, rank), stride=_spatial(op.stride, 1, rank),
                                   dilation=_spatial(op.dilation, 1, rank),
                                   compute_data_type=_module().data_type.FLOAT, name=kind)
        Y.set_output(True)
        Y.set_data_type(_dtype(out.dtype))
        Y.set_dim(_dims(out.shape))
        Y.set_stride(_dims(out.strides, out.shape))
        return A, B, Y

    built = _build(key, make, scratch.nbytes)
    if built is None:
        return False
    if before is not None:
        before()
    return _run(key, built, (a, b, out), scratch, out.device, stream)


def _input_view(op: Any, x: DevBuf, x_box: Any, out_box: Any, n: Sequence[int]
                ) -> tuple[DevBuf, list[int], list[int]] | None:
    """The rows of input block ``x`` (at ``x_box``) that output positions [out_box's start, + n) read, with the
    pre and post padding that make exactly those positions (``geometry``); None where they read none."""
    skip, rows, pre, post = geometry(x_box.lower[2:], x_box.upper[2:], out_box.lower[2:], n, op.kernel_size,
                                     op.stride, op.padding, op.dilation)
    if 0 in rows:
        return None
    return x.sub((0, 0, *skip), (*x.shape[:2], *rows)), pre, post


def fprop(op: Any, x: DevBuf, w: DevBuf, out: DevBuf, x_box: Any, out_box: Any, scratch: DevBuf | None,
          stream: int) -> bool:
    """``out`` = the convolution of input block ``x`` (at ``x_box``) with weights ``w`` at the output positions
    of ``out_box``; False, having done nothing, where the GEMM form must."""
    if scratch is None or not _common(op, scratch, x, w, out):
        return False
    view = _input_view(op, x, x_box, out_box, out.shape[2:])
    return view is not None and _convolve("fprop", op, view[0], w, out, view[1], view[2], scratch, stream)


def wgrad(op: Any, x: DevBuf, dy: DevBuf, out: DevBuf, x_box: Any, dy_box: Any, scratch: DevBuf | None,
          stream: int) -> bool:
    """``out`` = the weight gradient of input block ``x`` (at ``x_box``) against the dy block at ``dy_box``
    (every kernel position of the block's filters and channels); False where the GEMM form must."""
    if scratch is None or tuple(out.shape[2:]) != tuple(op.kernel_size) or not _common(op, scratch, x, dy, out):
        return False
    view = _input_view(op, x, x_box, dy_box, dy.shape[2:])
    if view is None or (op.rank == 3 and view[1] != view[2]):
        # a 3-D weight gradient with different padding each side came back wrong from cuDNN 9.19 on an H100
        # (one element 8e35, as if read past dy; docs/limits.md), so such blocks keep the GEMM form
        return False
    return _convolve("wgrad", op, view[0], dy, out, view[1], view[2], scratch, stream)


def dgrad(op: Any, dy: DevBuf, w: DevBuf, out: DevBuf, span: Sequence[tuple[int, int]], out_box: Any,
          scratch: DevBuf | None, stream: int) -> bool:
    """The data gradient of the dy block into the dx block ``out`` (at ``out_box``): the rows of ``out`` that
    the block's windows reach (``span``, from ``ConvGradOp.span``) written by cuDNN, the others zeroed;
    False, having done nothing, where the GEMM form must."""
    if scratch is None or not _common(op, scratch, dy, w, out):
        return False
    view = dgrad_view(out, span, out_box)
    if view is None:
        return False
    dx, pre, post = view

    def zero_the_rest() -> None:  # rows no window of this block reaches get nothing
        if dx.shape != out.shape:
            from relational_tensors.kernels import triton_copy as tc

            tc.fill(out, 0.0)
    return _convolve("dgrad", op, dy, w, dx, pre, post, scratch, stream, before=zero_the_rest)


def dgrad_view(out: DevBuf, span: Sequence[tuple[int, int]], out_box: Any
               ) -> tuple[DevBuf, list[int], list[int]] | None:
    """The rows of dx block ``out`` that windows spanning ``span`` reach, as a view, with the pre and post
    padding that make the span's length; None when they reach none."""
    start, shape, pre, post = [], [], [], []
    for i, (lo, hi) in enumerate(span):
        r_lo, r_hi = out_box.lower[2 + i], out_box.upper[2 + i]
        a = max(r_lo, lo)
        b = min(r_hi, hi)
        if b <= a:
            return None
        start.append(a - r_lo)
        shape.append(b - a)
        pre.append(a - lo)
        post.append(hi - b)
    return out.sub((0, 0, *start), (*out.shape[:2], *shape)), pre, post

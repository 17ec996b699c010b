"""Weights read from safetensors checkpoints, shard by shard.

``cg.load_checkpoint(path)`` reads, for every graph input the checkpoint holds, only the slices of the
blocks its executor keeps (one process's devices; under ``device="dist"`` one rank's), with plain reads
of the documented safetensors layout (:class:`SafetensorsFile` says why not through a memory map);
nothing else of the file is read, and no tensor is materialized whole.  ``path`` is a ``.safetensors`` file or a
directory of them (an HF checkpoint, with or without its ``model.safetensors.index.json``).  A graph
traced from a torch module (``rt.from_torch``) names its inputs after the module's state dict
(``TorchGraph.origins``), with Linear weights transposed into the graph's layout; those are read
transposed, block by block.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.types import Box
from relational_tensors.errors import ExecError

__all__ = ["checkpoint_files", "read_pieces", "SafetensorsFile"]


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the file itself, or a directory's ``*.safetensors``."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise ExecError(f"no safetensors checkpoint at {str(path)!r}: give a .safetensors file or a directory "
                        "holding them.")
    return files


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_CHUNK = 16 << 20  # bytes of whole rows read at a time when a block takes part of each row


class SafetensorsFile:
    """One safetensors file, read block by block with plain reads (no memory map): its header (a
    little-endian u64 length, then JSON: per tensor its dtype, shape and byte range), then each block's
    rows read straight into the block, or in chunks of at most 16 MiB of whole rows when the block takes
    part of each row.  The process's memory grows by the blocks it reads, not by the file: a mapped
    file's touched pages (and the kernel's read-ahead around them) would count as its resident set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file = open(path, "rb")
            (n,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise ExecError(f"cannot read the checkpoint file {str(path)!r}: it is not a safetensors file "
                            f"({type(e).__name__}).") from None
        self.start = 8 + n
        self.tensors = {k: v for k, v in header.items() if k != "__metadata__"}

    def close(self) -> None:
        self.file.close()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def read(self, key: str, box: Box) -> np.ndarray:
        """Block ``box`` of tensor ``key``, in the file's dtype."""
        info = self.tensors[key]
        if info["dtype"] not in _DTYPES:
            raise ExecError(f"the checkpoint's {key!r} has dtype {info['dtype']}, which this reader does not know.")
        dtype = numpy_dtype(_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        base = self.start + int(info["data_offsets"][0])
        out = np.empty(box.shape, dtype=dtype)
        if out.size == 0:
            return out
        if len(shape) == 0:
            self._read_into(base, out)
            return out
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize  # bytes of one index of dim 0
        lo, hi = box.lower[0], box.upper[0]
        if box.shape[1:] == shape[1:]:  # whole rows: one contiguous range, read into the block itself
            self._read_into(base + lo * row, out)
            return out
        step = max(1, _CHUNK // max(row, 1))
        inner = tuple(slice(a, b) for a, b in zip(box.lower[1:], box.upper[1:]))
        for r in range(lo, hi, step):
            rows = np.empty((min(step, hi - r), *shape[1:]), dtype=dtype)
            self._read_into(base + r * row, rows)
            out[r - lo:r - lo + rows.shape[0]] = rows[(slice(None),) + inner]
        return out

    def _read_into(self, offset: int, out: np.ndarray) -> None:
        view = out.reshape(-1).view(np.uint8).data
        self.file.seek(offset)
        got = self.file.readinto(view)
        if got != len(view):
            raise ExecError(f"the checkpoint file {str(self.path)!r} ends early: it is truncated or damaged.")


@contextlib.contextmanager
def _opened(files: list[Path]) -> Iterator[dict[str, SafetensorsFile]]:
    """Each tensor key of the checkpoint -> the open file holding it."""
    opened = [SafetensorsFile(f) for f in files]
    try:
        keys: dict[str, SafetensorsFile] = {}
        for f in opened:
            for key in f.tensors:
                keys.setdefault(key, f)
        yield keys
    finally:
        for f in opened:
            f.close()


def read_pieces(path: str | Path, wanted: Mapping[str, tuple[tuple[int, ...], list[Box]]],
                keys: Mapping[str, tuple[str, bool]]) -> dict[str, list[tuple[tuple[int, ...], np.ndarray]]]:
    """For each graph input of ``wanted`` (name -> shape, the blocks to read) that the checkpoint
    holds (under its key in ``keys``, name -> (key, transposed), or its own name), its blocks as
    ``(offset, array)`` pieces, each read as a slice of the file."""
    out: dict[str, list[tuple[tuple[int, ...], np.ndarray]]] = {}
    with _opened(checkpoint_files(path)) as files:
        for name, (shape, boxes) in wanted.items():
            key, transposed = keys.get(name, (name, False))
            f = files.get(key)
            if f is None:
                continue
            stored = f.shape(key)
            want = tuple(reversed(shape)) if transposed else tuple(shape)
            if stored != want:
                raise ExecError(f"the checkpoint's {key!r} has shape {stored}; the graph's {name!r} needs {want}"
                                f"{' (stored transposed)' if transposed else ''}. Is it the checkpoint of this model?")
            pieces = []
            for box in boxes:
                if transposed:  # the graph's block (i, j) is the stored block (j, i), transposed
                    part = f.read(key, Box(tuple(reversed(box.lower)), tuple(reversed(box.upper))))
                    pieces.append((box.lower, np.ascontiguousarray(part.T)))
                else:
                    pieces.append((box.lower, f.read(key, box)))
            out[name] = pieces
    return out


"""Weights read from safetensors checkpoints, shard by shard.

``cg.load_checkpoint(path)`` reads, for every graph input the checkpoint holds, only the slices of the
blocks its executor keeps (one process's devices; under ``device="dist"`` one rank's), with plain reads
of the documented safetensors layout (:class:`SafetensorsFile` says why not through a memory map),
after checking each file's header as strictly as the safetensors library does (a damaged file, or a
tensor in two shards, is refused, never read as wrong weights); nothing else of the file is read, and
no tensor is materialized whole.  ``path`` is a ``.safetensors`` file or a
directory of them (an HF checkpoint, with or without its ``model.safetensors.index.json``).  A graph
traced from a torch module (``rt.from_torch``) names its inputs after the module's state dict
(``TorchGraph.origins``), with Linear weights transposed into the graph's layout; those are read
transposed, block by block.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.core.types import Box
from relational_tensors.errors import ExecError

__all__ = ["checkpoint_files", "read_pieces", "SafetensorsFile"]


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint: the file itself, or a directory's ``*.safetensors``."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise ExecError(f"a checkpoint is the path of a .safetensors file or of a directory of them (str or "
                        f"pathlib.Path); got {type(path).__name__} {path!r}. Give the path, e.g. "
                        "cg.load_checkpoint('model.safetensors').")
    if not os.fspath(path):  # Path('') is the working directory: never read it by accident
        raise ExecError("a checkpoint is the path of a .safetensors file or of a directory of them; got an empty "
                        "path. Give the path, e.g. cg.load_checkpoint('model.safetensors'), or '.' for the "
                        "working directory.")
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise ExecError(f"no safetensors checkpoint at {str(path)!r}: give a .safetensors file or a directory "
                        "holding them.")
    for f in files:
        if not f.is_file():
            raise ExecError(f"the checkpoint's {str(f)!r} is not a file; got a {'directory' if f.is_dir() else 'path'} "
                            "named like a safetensors shard. Move it out of the checkpoint's directory.")
    return files


# Every dtype of the safetensors format (as its library names them), with the bits of one element: the
# header is checked against all of them, so a shard is whole even when it holds a tensor this reader
# cannot read (refused only if asked for, in ``read``).
_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
         "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
         "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
_NUMPY: dict[str, np.dtype] = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": numpy_dtype("bfloat16"), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
          "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
          "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
_MAX_HEADER = 100_000_000  # bytes of JSON header: the safetensors library's own bound
_CHUNK = 16 << 20  # bytes of whole rows read at a time when a block takes part of each row


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a safetensors header, checked: its dtype, shape and byte range in the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class _Duplicate(ValueError):
    """A name given twice in one JSON object of a header."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a name given twice (json.loads would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _count(value: object) -> bool:
    """A JSON non-negative integer (not a bool, not a float that happens to be whole)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SafetensorsFile:
    """One safetensors file, checked whole when opened and read block by block with plain reads (no
    memory map).  The layout: a little-endian u64 length, then a JSON object of at most 100 MB that gives
    per tensor its dtype, shape and byte range ``data_offsets`` (from the end of the header), then the
    data.  Opening reads only the header, and refuses (``ExecError``, naming the file, the tensor and the
    values) whatever the safetensors library refuses: a header length past the file, a header that is not
    a UTF-8 JSON object, an entry without ``dtype``/``shape``/``data_offsets`` of the right types, an
    unknown dtype, a byte range that is not shape × itemsize, ranges that overlap, leave a gap or do not
    cover the data exactly (a truncated file's); and a name given twice (the library keeps one silently).
    A BOOL block with a byte other than 0 or 1 is refused when read.

    Each block's rows are read straight into the block, or in chunks of at most 16 MiB of whole rows
    when the block takes part of each row.  The process's memory grows by the blocks it reads, not by
    the file: a mapped file's touched pages (and the kernel's read-ahead around them) would count as its
    resident set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file = open(path, "rb")
        except OSError as e:
            raise ExecError(f"cannot open the checkpoint file {str(path)!r}: {e.strerror or e}. Check the path and "
                            "its permissions.") from None
        try:
            self.start, self.tensors = self._header()
        except BaseException:
            self.file.close()
            raise

    def _refuse(self, rule: str, got: str) -> ExecError:
        return ExecError(f"the checkpoint file {str(self.path)!r} is not a valid safetensors file: {rule}; got "
                         f"{got}. It is damaged, truncated or not a checkpoint: write it again (safetensors' "
                         "save_file), or leave it out of the checkpoint's directory.")

    def _header(self) -> tuple[int, dict[str, _Entry]]:
        size = os.fstat(self.file.fileno()).st_size
        if size < 8:
            raise self._refuse("it starts with the header's length, 8 bytes", f"a file of {size} bytes")
        (n,) = struct.unpack("<Q", self.file.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise self._refuse(f"the header's length (its first 8 bytes) is at most {_MAX_HEADER:,} bytes and "
                               "within the file", f"{n:,} bytes in a file of {size:,}")
        raw = self.file.read(n)
        if len(raw) != n:
            raise self._refuse("the file holds the header it announces", f"{len(raw):,} of {n:,} bytes")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
        except _Duplicate as e:
            raise self._refuse("the header names each tensor once", f"{e.args[0]!r} twice") from None
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise self._refuse("the header is a UTF-8 JSON object", " ".join(str(e).split())[:200]) from None
        if not isinstance(header, dict):
            kinds = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
            raise self._refuse("the header is a JSON object", f"a JSON {kinds.get(type(header), 'null')}")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise self._refuse("__metadata__ maps names to strings", f"{json.dumps(meta)[:200]}")
        tensors = {key: self._entry(key, info) for key, info in header.items()}
        data = size - 8 - n
        at, previous = 0, None
        for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
            if t.begin != at:
                what = (f"{key!r} at bytes [{t.begin}, {t.end}) overlaps {previous!r}, which ends at {at}"
                        if t.begin < at else f"bytes [{at}, {t.begin}) that no tensor holds, before {key!r}")
                raise self._refuse("the tensors' byte ranges follow each other, without gaps or overlaps", what)
            at, previous = t.end, key
        if at != data:
            raise self._refuse("the tensors' byte ranges cover the data after the header exactly",
                               f"{data:,} bytes of data and tensors covering {at:,}"
                               + (" (the file is cut short)" if at > data else ""))
        return 8 + n, tensors

    def _entry(self, key: str, info: object) -> _Entry:
        if not isinstance(info, dict):
            raise self._refuse("each tensor's entry is an object with dtype, shape and data_offsets",
                               f"{key!r}: {json.dumps(info)[:100]}")
        missing = [f for f in ("dtype", "shape", "data_offsets") if f not in info]
        if missing:
            raise self._refuse("each tensor's entry has dtype, shape and data_offsets",
                               f"{key!r} without {', '.join(missing)}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _BITS:
            raise self._refuse(f"a tensor's dtype is one of {', '.join(_BITS)}", f"{key!r} of dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise self._refuse("a tensor's shape is a list of non-negative integers", f"{key!r} of shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise self._refuse("a tensor's data_offsets are [begin, end], integers with 0 <= begin <= end",
                               f"{key!r} with data_offsets {offsets!r}")
        bits = math.prod(shape) * _BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise self._refuse("a tensor's byte range is its shape × the size of its dtype",
                               f"{key!r} of shape {tuple(shape)} {dtype} ({bits / 8:g} bytes) at data_offsets "
                               f"{offsets} ({offsets[1] - offsets[0]} bytes)")
        return _Entry(dtype, tuple(shape), offsets[0], offsets[1])

    def close(self) -> None:
        self.file.close()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def read(self, key: str, box: Box) -> np.ndarray:
        """Block ``box`` of tensor ``key``, in the file's dtype."""
        info = self.tensors[key]
        dtype = _NUMPY.get(info.dtype)
        if dtype is None:
            raise ExecError(f"the checkpoint's {key!r} (in {str(self.path)!r}) has dtype {info.dtype}; this reader "
                            f"reads {', '.join(_NUMPY)}. Store it in one of those.")
        shape = info.shape
        inside = all(0 <= lo <= hi <= n for lo, hi, n in zip(box.lower, box.upper, shape))
        if len(box.lower) != len(shape) or not inside:
            raise ExecError(f"a block of the checkpoint's {key!r} lies within its shape {shape}; got the block "
                            f"{box.lower}..{box.upper}.")
        out = self._block(info, dtype, box)
        if info.dtype == "BOOL" and out.size and out.view(np.uint8).max() > 1:
            raise ExecError(f"the checkpoint file {str(self.path)!r} is damaged: a BOOL tensor's bytes are 0 or 1; "
                            f"got {int(out.view(np.uint8).max())} in {key!r}. Write it again.")
        return out

    def _block(self, info: _Entry, dtype: np.dtype, box: Box) -> np.ndarray:
        shape = info.shape
        base = self.start + info.begin
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
        if got != len(view):  # checked whole when opened: it changed since
            raise ExecError(f"the checkpoint file {str(self.path)!r} ends early: it was cut short after it was "
                            "opened (written to while read?). Read it again once it is written whole.")


@contextlib.contextmanager
def _opened(files: list[Path]) -> Iterator[dict[str, SafetensorsFile]]:
    """Each tensor key of the checkpoint -> the open file holding it."""
    opened: list[SafetensorsFile] = []
    try:
        for path in files:
            opened.append(SafetensorsFile(path))
        keys: dict[str, SafetensorsFile] = {}
        for f in opened:
            for key in f.tensors:
                if key in keys:  # two shards, maybe of two versions: which one holds the weights is unknowable
                    raise ExecError(f"a checkpoint holds each tensor once; got {key!r} in both "
                                    f"{str(keys[key].path)!r} and {str(f.path)!r}. Remove the shard that does "
                                    "not belong (a leftover of another checkpoint), or load the file you mean.")
                keys[key] = f
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


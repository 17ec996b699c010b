"""Values fed to a program, checked against the types they feed: the rules every executor and the NumPy
reference share (shapes, dtypes, integers that fit, floats that stay finite, every input given)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from relational_tensors.core.dtypes import itemsize, numpy_dtype
from relational_tensors.core.types import TensorType
from relational_tensors.errors import ExecError

__all__ = ["coerce_feed", "check_feed_names", "refuse_bound", "refuse_out_of_range", "refuse_overflow", "STALE_OUTPUTS",
           "check_loaded"]

STALE_OUTPUTS = ("the saved outputs are stale: inputs were loaded after the last execute(), or it did not finish; "
                 "run cg.execute() before offloading.")


def coerce_feed(name: str, value: Any, t: TensorType) -> np.ndarray:
    """``value`` as an array of type ``t``; floats convert among float dtypes, ints among int dtypes."""
    a = np.asarray(value)
    if a.shape != t.shape:
        raise ExecError(f"input {name!r} must have shape {t.shape}; got {a.shape}.")
    want = numpy_dtype(t.dtype)
    if (a.dtype.kind == "b") != (want.kind == "b"):
        hint = ("Pass a boolean array (e.g. mask != 0)." if want.kind == "b" else
                "Convert it first (e.g. mask.astype(np.float32)), or declare the input bool.")
        raise ExecError(f"input {name!r} must be {t.dtype}; got an array of dtype {a.dtype}. {hint}")
    if want.kind == "b":
        return a
    is_int = want.kind in "iu"
    known = a.dtype.kind in "iuf" or a.dtype == numpy_dtype("bfloat16")  # bfloat16 is a float, of kind "V"
    if (a.dtype.kind in "iu") != is_int or not known:
        raise ExecError(f"input {name!r} must be {t.dtype}; got an array of dtype {a.dtype}. Convert it first.")
    if a.dtype == want:
        return a
    if is_int:
        refuse_out_of_range(name, a, t.dtype)
        return a.astype(want)
    with np.errstate(over="ignore"):
        out = a.astype(want)
    refuse_overflow(name, a, out.astype(np.float32) if t.dtype == "bfloat16" else out, t.dtype)
    return out


def refuse_out_of_range(name: str, a: Any, dtype: str) -> None:
    """Refuse integers that ``dtype`` cannot hold (they would wrap), naming one of them.  ``a`` is a
    NumPy or CuPy integer array."""
    have, want = np.iinfo(a.dtype), np.iinfo(numpy_dtype(dtype))
    if a.size == 0 or (have.min >= want.min and have.max <= want.max):
        return
    lo, hi = int(a.min()), int(a.max())
    if lo < want.min or hi > want.max:
        bad = lo if lo < want.min else hi
        raise ExecError(f"input {name!r} is {dtype}, which holds integers in [{want.min}, {want.max}]; got {bad}. "
                        f"Feed values that fit, or declare the input with a wider dtype.")


def refuse_overflow(name: str, a: Any, converted: Any, dtype: str, xp: Any = np) -> None:
    """Refuse finite floats that became infinite in ``dtype`` (NaN and infinities pass as they are),
    naming one of them.  ``a`` and ``converted`` are arrays of the array module ``xp`` (NumPy or CuPy;
    a bfloat16 ``converted`` is given as float32 values)."""
    if a.size == 0 or (a.dtype.itemsize <= itemsize(dtype) and dtype != "bfloat16"):
        return
    lost = xp.isfinite(a) & ~xp.isfinite(converted)
    if bool(lost.any()):
        bad = float(a[lost].ravel()[0])
        largest = float(ml_dtypes.finfo(numpy_dtype(dtype)).max)
        raise ExecError(f"input {name!r} is {dtype}, whose largest finite value is {largest:g}; got {bad:g}, which "
                        "would become infinite. Scale the values, or declare the input with a wider dtype.")


def check_loaded(loaded: bool, resident: set[str], inputs: Collection[str]) -> None:
    """Refuse to execute before every input has a value (the executors' shared rule): nothing loaded
    yet, or inputs loaded one at a time with some still absent.  ``resident`` holds names of ``inputs``
    only, so comparing sizes settles the common case without a walk (it runs before every replay)."""
    if not loaded:
        raise ExecError("load the inputs first: cg.load({name: array, ...}).")
    if len(resident) < len(inputs):
        missing = [n for n in inputs if n not in resident]
        raise ExecError(f"inputs {missing} have no value yet; load them before execute: cg.load(name, array).")


def check_feed_names(inputs: Iterable[Any], feeds: Mapping[str, Any], needed: Iterable[str]) -> dict[str, Any]:
    """The graph's input nodes (``inputs``: each has a ``name`` and a ``type``) by name, after checking that
    ``feeds`` names only inputs and covers ``needed``."""
    names = {n.name: n for n in inputs}
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise ExecError(f"feeds name no graph input: {unknown}; inputs are {sorted(names)}.")
    for name in needed:
        if name not in feeds:
            node = names[name]
            raise ExecError(f"missing a value for input {name!r} of shape {node.type.shape} ({node.type.dtype}).")
    return names


def refuse_bound(names: Any, bound: Any, what: str = "load") -> None:
    """A load or a stage of a bound input is refused: the program reads it in place from its array."""
    if not bound:  # (most programs bind nothing; a stage runs every step)
        return
    hit = sorted(set(names) & set(bound))
    if hit:
        raise ExecError(f"inputs {hit} were bound when the program was made (compileGraph's bind=): it reads "
                        f"them in place as constants, so a {what} of them is refused. Compile without binding "
                        "them to load new values.")

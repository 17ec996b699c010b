"""Data types by name, with their NumPy equivalents and widths.

bfloat16 comes from ml_dtypes, since NumPy has none.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from relational_tensors.errors import GraphError

__all__ = ["DTYPES", "FLOAT_DTYPES", "canonical_dtype", "numpy_dtype", "itemsize", "compute_dtype", "partial_dtype",
           "bf16_bits_to_float32", "float32_to_bf16_bits"]

DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
            "fp16": "float16", "half": "float16", "bf16": "bfloat16", "long": "int64", "int": "int32",
            "bool_": "bool"}


def canonical_dtype(dtype: object) -> str:
    """The canonical name of a dtype given as a name, a NumPy dtype or a type.

    >>> canonical_dtype("bf16"), canonical_dtype(np.float32)
    ('bfloat16', 'float32')
    """
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name in DTYPES:
            return name
    elif isinstance(dtype, (np.dtype, type)):  # not None or a number, which NumPy reads as float64 or a code
        try:
            npd = np.dtype(dtype)
        except TypeError:
            npd = None
        for name, known in DTYPES.items():
            if npd is not None and npd == known:
                return name
    raise GraphError(
        f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}. "
        "Pass one of those names (or a matching NumPy dtype)."
    )


def partial_dtype(name: str) -> str:
    """The dtype an unaggregated partial of a ``name`` operator is computed, kept and combined in: wider
    than ``name`` where a 16-bit ⊕ needs it, so that no partial overflows where the single-device result
    does not, and the result is rounded once, when the aggregate is assembled.  float16 (max 65504) in
    float32, whose range its sums cannot leave; bfloat16 in float64, since bfloat16 has float32's range
    (max 3.39e38) and two partials of a sum that cancels (+2·max, -2·max) would each overflow float32 and
    combine to NaN.  Other dtypes are their own partial dtype.

    >>> partial_dtype("bfloat16"), partial_dtype("float16"), partial_dtype("float64"), partial_dtype("int32")
    ('float64', 'float32', 'float64', 'int32')
    """
    return _PARTIAL.get(name, name)


_PARTIAL = {"float16": "float32", "bfloat16": "float64"}


def numpy_dtype(name: str) -> np.dtype:
    return DTYPES[name]


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def compute_dtype(name: str) -> np.dtype:
    """The dtype NumPy kernels compute in: 16-bit floats accumulate in float32."""
    return np.dtype(np.float32) if name in ("float16", "bfloat16") else DTYPES[name]


def bf16_bits_to_float32(bits: Any, xp: Any = np) -> Any:
    """float32 values of bfloat16 bit patterns (uint16, NumPy or CuPy): a bfloat16 is the top half of
    a float32, so this is exact.

    >>> bf16_bits_to_float32(np.array([0x3F80, 0xC040], dtype=np.uint16))
    array([ 1., -3.], dtype=float32)
    """
    return (xp.asarray(bits).astype(xp.uint32) << 16).view(xp.float32)


def float32_to_bf16_bits(x: Any, xp: Any = np) -> Any:
    """The bfloat16 bit patterns (uint16) nearest to float32 values, ties to even; NaN stays NaN.
    For arrays on devices without a bfloat16 type (CuPy).

    >>> float32_to_bf16_bits(np.array([1.0, 1.00390625, np.nan], dtype=np.float32))
    array([16256, 16256, 32704], dtype=uint16)
    """
    x = xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32))
    bits = x.view(xp.uint32)
    rounded = (bits + (xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1)))) >> 16
    return xp.where(xp.isnan(x), xp.uint32(0x7FC0), rounded).astype(xp.uint16)


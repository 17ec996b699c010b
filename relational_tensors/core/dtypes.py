"""Data types by name, with their NumPy equivalents and widths.

bfloat16 comes from ml_dtypes, since NumPy has none.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from relational_tensors.errors import GraphError

__all__ = ["DTYPES", "FLOAT_DTYPES", "canonical_dtype", "numpy_dtype", "itemsize", "compute_dtype"]

DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
            "fp16": "float16", "half": "float16", "bf16": "bfloat16", "long": "int64", "int": "int32"}


def canonical_dtype(dtype: object) -> str:
    """The canonical name of a dtype given as a name, a NumPy dtype or a type.

    >>> canonical_dtype("bf16"), canonical_dtype(np.float32)
    ('bfloat16', 'float32')
    """
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name in DTYPES:
            return name
    else:
        try:
            npd = np.dtype(dtype)  # type: ignore[call-overload]
        except TypeError:
            npd = None
        for name, known in DTYPES.items():
            if npd == known:
                return name
    raise GraphError(
        f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}. "
        "Pass one of those names (or a matching NumPy dtype)."
    )


def numpy_dtype(name: str) -> np.dtype:
    return DTYPES[name]


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def compute_dtype(name: str) -> np.dtype:
    """The dtype NumPy kernels compute in: 16-bit floats accumulate in float32."""
    return np.dtype(np.float32) if name in ("float16", "bfloat16") else DTYPES[name]

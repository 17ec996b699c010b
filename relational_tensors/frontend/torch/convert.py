"""Torch and NumPy at the frontend's edge: the lazy torch import, dtype names both ways, and
tensor <-> array conversions that share memory where the layout allows.

torch is imported only inside these functions (``_torch()`` raises ``GraphError`` with the install
hint when it is missing), so importing the frontend does not need PyTorch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relational_tensors.core.dtypes import numpy_dtype
from relational_tensors.errors import GraphError

__all__ = ["torch_to_numpy", "numpy_to_torch", "host", "module_tensor", "graph_value"]


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only without torch
        raise GraphError("from_torch and parallelize need PyTorch; install it with pip install "
                         "'relational_tensors[torch]'.") from e
    return torch


def _is_torch_tensor(x: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, torch.Tensor)


def _dtype_name(dtype: Any) -> str | None:
    torch = _torch()
    return {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
            torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}.get(dtype)


def _torch_dtype(name: str) -> Any:
    torch = _torch()
    return {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
            "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}[name]


def torch_to_numpy(t: Any) -> np.ndarray:
    """A CPU torch tensor as a NumPy array without a copy where the layout allows (bfloat16 via ml_dtypes)."""
    torch = _torch()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def numpy_to_torch(a: Any) -> Any:
    """An array (NumPy, or anything with ``__dlpack__`` such as a CuPy array) as a torch tensor, sharing memory."""
    torch = _torch()
    if isinstance(a, np.ndarray):
        shape = a.shape  # np.ascontiguousarray makes a 0-d array 1-d: the shape is put back
        if a.dtype == numpy_dtype("bfloat16"):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(shape)
    return torch.from_dlpack(a)


def host(value: Any) -> Any:
    """A module tensor or constant read at trace time, on the host: a GPU module's buffers, parameters and
    folded constants are copied (``.detach().cpu()``) before the translator reads their values (NumPy,
    comparisons with host tensors); a CPU tensor, or anything else, is returned as it is."""
    device = getattr(value, "device", None)
    if device is None or device.type == "cpu" or not hasattr(value, "detach"):
        return value
    return value.detach().cpu()


def module_tensor(module: Any, path: str) -> Any:
    """The tensor at attribute ``path`` of ``module`` (a parameter, a buffer, or a plain tensor attribute of a
    submodule, which tracing lifts as a constant: what ``TorchGraph.origins`` names), or None."""
    found = module
    for part in path.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, _torch().Tensor) else None


def graph_value(v: Any, dtype: str, on_gpus: bool) -> Any:
    """A module tensor already in its graph input's layout (transposed as traced) as the value loaded into
    it: cast to ``dtype``; a torch tensor on its GPU where the plan runs on GPUs (loaded device to device,
    no host copy), else a NumPy array."""
    v = v.detach().to(_torch_dtype(dtype))
    return v.contiguous() if on_gpus and v.is_cuda else torch_to_numpy(v)

"""Executors of the task DAG: ``numpy`` (virtual CPU devices) and, on GPUs, ``cupy``."""

from relational_tensors.runtime.numpy_backend import NumpyExecutor

__all__ = ["NumpyExecutor"]

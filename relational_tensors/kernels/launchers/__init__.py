"""The GPU launcher of every operator kind, one module per family of operators (``matmul``, ``elementwise``,
``norms``, ``shape``, ``losses``, ``conv``, ``attention``), registered in ``base.LAUNCHERS``.

>>> from relational_tensors.sql_specs import OPERATORS
>>> sorted(set(OPERATORS) - set(LAUNCHERS))
[]
"""

from relational_tensors.kernels.launchers import attention, conv, elementwise, losses, matmul, norms, shape
from relational_tensors.kernels.launchers.attention import key_query_limits
from relational_tensors.kernels.launchers.base import (
    HOST_KINDS,
    LAUNCHERS,
    Launcher,
    allocates,
    kernel_scratch,
    launcher,
    launcher_for,
    op_constants,
    scratch_bytes,
    scratch_shape,
    task_scratch,
)

FAMILIES = (attention, conv, elementwise, losses, matmul, norms, shape)

__all__ = ["Launcher", "LAUNCHERS", "HOST_KINDS", "FAMILIES", "launcher", "launcher_for", "allocates",
           "op_constants", "scratch_shape", "task_scratch", "scratch_bytes", "kernel_scratch", "key_query_limits"]

"""The PyTorch frontend: modules traced with torch.export into a ``Graph`` (``frontend.torch``), its
translation rules registered with ``register_torch_op``.  ``rt.parallelize`` and ``rt.train_step``
(``api/``) build on it.

Importing this package does not import torch; the torch frontend imports it when it traces.
"""

from relational_tensors.frontend.torch.registry import register_torch_op, unsupported

__all__ = ["register_torch_op", "unsupported"]

"""The frontends: ``graph`` (the ``Graph`` a computation is written against), ``torch`` (PyTorch modules
traced into a ``Graph``; its translation rules are registered with ``register_torch_op``) and
``parallelize`` (a traced module compiled and called like the module).

Importing this package does not import torch; the torch frontend imports it when it traces.
"""

from relational_tensors.frontend.torch.registry import register_torch_op, unsupported

__all__ = ["register_torch_op", "unsupported"]

"""The operator library and its registry: one module per abstract operator or family.

``OPERATORS`` maps each kind to its class.  Each module registers its classes with ``@register``;
this package imports every module, so the registry is complete as soon as anything in
``relational_tensors.sql_specs`` is imported (``relational_tensors.registry`` prints it whole).
"""

from relational_tensors.sql_specs.attention import AttentionOp
from relational_tensors.sql_specs.base import OPERATORS, IndexedOp, Operator, register
from relational_tensors.sql_specs.einsum import EinsumOp, MatmulOp
from relational_tensors.sql_specs.elementwise import BinaryOp, SwigluOp, UnaryOp
from relational_tensors.sql_specs.embedding import EmbeddingOp
from relational_tensors.sql_specs.norms import LayernormOp, RmsnormOp, SoftmaxOp
from relational_tensors.sql_specs.reduce import ReduceOp
from relational_tensors.sql_specs.rope import RopeOp
from relational_tensors.sql_specs.shape import ConcatOp, PermuteOp, ReshapeOp, SliceOp
from relational_tensors.sql_specs.sql_join import SqlJoinOp

__all__ = [
    "OPERATORS", "Operator", "IndexedOp", "register",
    "EinsumOp", "MatmulOp", "SqlJoinOp", "UnaryOp", "BinaryOp", "SwigluOp", "ReduceOp",
    "SoftmaxOp", "RmsnormOp", "LayernormOp", "RopeOp", "ReshapeOp", "PermuteOp", "SliceOp",
    "ConcatOp", "EmbeddingOp", "AttentionOp",
]

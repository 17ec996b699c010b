"""The operator library and its registry: one module per abstract operator or family.

``OPERATORS`` maps each kind to its class.  Each module registers its classes with ``@register``;
this package imports every module, so the registry is complete as soon as anything in
``relational_tensors.sql_specs`` is imported (``relational_tensors.driver.registry`` prints it whole).
"""

from relational_tensors.sql_specs.attention import AttentionOp
from relational_tensors.sql_specs.attention_grad import AttentionDeltaOp, AttentionGradOp, AttentionLseOp
from relational_tensors.sql_specs.base import OPERATORS, IndexedOp, Operator, register
from relational_tensors.sql_specs.conv import ConvGradOp, ConvOp
from relational_tensors.sql_specs.einsum import EinsumOp, MatmulOp
from relational_tensors.sql_specs.elementwise import (
    BinaryGradOp,
    BinaryOp,
    SwigluGradOp,
    SwigluOp,
    UnaryGradOp,
    UnaryOp,
    WhereOp,
)
from relational_tensors.sql_specs.embedding import EmbeddingGradOp, EmbeddingOp, PutRowsOp
from relational_tensors.sql_specs.experts import GroupedMatmulOp, GroupedWeightGradOp, RouteIndexOp
from relational_tensors.sql_specs.losses import CrossEntropyGradOp, CrossEntropyOp, TokenCountOp
from relational_tensors.sql_specs.norms import (
    LayernormOp,
    NormGradOp,
    NormWeightGradOp,
    RmsnormOp,
    SoftmaxGradOp,
    SoftmaxOp,
)
from relational_tensors.sql_specs.pool import PoolGradOp, PoolOp
from relational_tensors.sql_specs.random import DropoutOp, RandomOp
from relational_tensors.sql_specs.reduce import ReduceOp
from relational_tensors.sql_specs.rope import RopeOp, RopeTableOp
from relational_tensors.sql_specs.routing import OneHotOp, TakeAlongOp, TopkOp
from relational_tensors.sql_specs.shape import ConcatOp, ExpandOp, PadOp, PermuteOp, ReshapeOp, SliceOp
from relational_tensors.sql_specs.sql_join import SqlJoinOp

__all__ = [
    "OPERATORS", "Operator", "IndexedOp", "register",
    "EinsumOp", "MatmulOp", "SqlJoinOp", "UnaryOp", "BinaryOp", "SwigluOp", "ReduceOp",
    "SoftmaxOp", "RmsnormOp", "LayernormOp", "RopeOp", "RopeTableOp", "ReshapeOp", "PermuteOp", "SliceOp",
    "ConcatOp", "EmbeddingOp", "AttentionOp", "PadOp", "ExpandOp", "CrossEntropyOp", "TokenCountOp",
    "WhereOp", "ConvOp", "PoolOp", "DropoutOp", "RandomOp", "TopkOp", "OneHotOp", "TakeAlongOp",
    "RouteIndexOp", "GroupedMatmulOp",
    # gradient operators
    "UnaryGradOp", "BinaryGradOp", "SwigluGradOp", "SoftmaxGradOp", "NormGradOp", "NormWeightGradOp",
    "EmbeddingGradOp", "PutRowsOp", "AttentionLseOp", "AttentionDeltaOp", "AttentionGradOp", "CrossEntropyGradOp",
    "ConvGradOp", "PoolGradOp", "GroupedWeightGradOp",
]

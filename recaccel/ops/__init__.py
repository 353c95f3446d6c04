"""The operator layer: packed embeddings, fused interaction, packed per-field ops.

Every op is a triad behind one signature: ``reference`` (plain PyTorch, the
specification), ``triton`` (fused GPU kernels) and, for the embedding, ``fbgemm``.
"""

from recaccel.ops.embedding import InvalidIdError, PackedEmbeddingBag, SparseOptimConfig, TableSpec
from recaccel.ops.field_ops import DenseTransformParams, FieldIdParams, dense_transform, map_ids
from recaccel.ops.interaction import DotInteraction, dot_interaction

__all__ = [
    "DenseTransformParams",
    "DotInteraction",
    "FieldIdParams",
    "InvalidIdError",
    "PackedEmbeddingBag",
    "SparseOptimConfig",
    "TableSpec",
    "dense_transform",
    "dot_interaction",
    "map_ids",
]

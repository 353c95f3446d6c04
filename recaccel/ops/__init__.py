"""The operator layer: packed embeddings, fused interaction, packed per-field ops.

Every op is a triad behind one signature: ``reference`` (plain PyTorch, the
specification), ``triton`` (fused GPU kernels) and, for the embedding, ``fbgemm``.
One layout per op, ``ops/<op>/``: the public names and the backend dispatch in its
``__init__``, then ``reference.py``, ``triton`` and ``fbgemm.py`` where it has them (a
backend imports the reference or a shared module, never the package ``__init__``).
:mod:`recaccel.ops.backend` resolves a backend name for a device. ``ops`` imports no
``io``: batches come as :class:`recaccel.sparse.SparseFeatures`.
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

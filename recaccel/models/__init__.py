"""Recommendation models composed from small arches, as in TorchRec.

:class:`DLRM` glues :class:`SparseArch` (any module mapping SparseFeatures to pooled
[B, F, D]), :class:`DenseArch`, :class:`InteractionArch` and :class:`OverArch`;
:class:`MeLU` is a DLRM with MeLU's arches. :func:`build_model` builds either from the
config and a dataset's schema (read by attribute: models import nothing from io).
:class:`PerTableEmbeddingBag` is the per-table embedding baseline;
:class:`TorchRecEmbedding` looks fields up in a TorchRec (sharded) collection.
"""

from recaccel.models.arches import DenseArch, InteractionArch, OverArch, SparseArch
from recaccel.models.dlrm import DLRM
from recaccel.models.embedding import EMBEDDING_BACKENDS, PerTableEmbeddingBag, field_embedding
from recaccel.models.factory import build_embedding, build_melu, build_model
from recaccel.models.melu import MeLU, MeLUConfig, melu_embedding
from recaccel.models.table_memory import check_table_memory, table_memory_bytes
from recaccel.models.torchrec_sparse import TorchRecEmbedding

__all__ = [
    "DLRM",
    "EMBEDDING_BACKENDS",
    "DenseArch",
    "InteractionArch",
    "MeLU",
    "MeLUConfig",
    "OverArch",
    "PerTableEmbeddingBag",
    "SparseArch",
    "TorchRecEmbedding",
    "build_embedding",
    "build_melu",
    "build_model",
    "check_table_memory",
    "field_embedding",
    "melu_embedding",
    "table_memory_bytes",
]

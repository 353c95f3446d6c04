"""Packed embedding bag (PICASSO-style packing) with fused sparse optimizers.

Tables of the same dim and optimizer share one packed buffer; one lookup per pack pools
every feature of a batch; in fused mode the backward deduplicates rows and applies SGD,
row-wise Adagrad or Adam in place. Backends: ``reference`` (PyTorch, the specification),
``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``fbgemm`` (FBGEMM's
table-batched embedding). Triton and FBGEMM are imported only when used.
"""

from recaccel.ops.embedding.module import PackedEmbeddingBag, choose_backend, init_table_weights
from recaccel.ops.embedding.packing import PackingPlan, PackLayout
from recaccel.ops.embedding.specs import (
    OPTIMIZER_STATES,
    OPTIMIZERS,
    POOLINGS,
    InvalidIdError,
    SparseOptimConfig,
    TableSpec,
)

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "POOLINGS",
    "InvalidIdError",
    "PackLayout",
    "PackedEmbeddingBag",
    "PackingPlan",
    "SparseOptimConfig",
    "TableSpec",
    "choose_backend",
    "init_table_weights",
]

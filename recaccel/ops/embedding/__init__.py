"""Packed embedding bag (PICASSO-style packing) with fused sparse optimizers.

Tables of the same dim and optimizer share one packed buffer; one lookup per pack pools
every feature of a batch; in fused mode the backward deduplicates rows and applies SGD,
row-wise Adagrad or Adam in place.

Layout:

- :mod:`~recaccel.ops.embedding.module`: :class:`PackedEmbeddingBag`;
  :mod:`~recaccel.ops.embedding.backends`: the backend dispatch (:func:`choose_backend`,
  :func:`pack_backend_class`); :mod:`~recaccel.ops.embedding.init_weights`: the initial rows.
- :mod:`~recaccel.ops.embedding.preparation`, :mod:`~recaccel.ops.embedding.bounds_check`,
  :mod:`~recaccel.ops.embedding.deferred_check`, :mod:`~recaccel.ops.embedding.micro_batches`:
  a batch's preparation, its id checks, the micro-batch lookup and deferred update.
- :mod:`~recaccel.ops.embedding.specs`: :class:`TableSpec`, :class:`SparseOptimConfig`;
  :mod:`~recaccel.ops.embedding.options`: :class:`EmbeddingOptions`, the module's settings.
- :mod:`~recaccel.ops.embedding.packing`: the packing plan, the routing of a batch and
  each pack's ids; :mod:`~recaccel.ops.embedding.row_groups`: the backward's sort by row.
- :mod:`~recaccel.ops.embedding.prepared`: :class:`PreparedSparse`, a batch with its
  lookup's input preparation (made ahead by a pipeline).
- :mod:`~recaccel.ops.embedding.pack_backend`: the per-pack backend interface.
- Backends, one pack class each: :mod:`~recaccel.ops.embedding.reference` (PyTorch, the
  specification), :mod:`~recaccel.ops.embedding.triton` (CUDA, or CPU under
  ``TRITON_INTERPRET=1``), :mod:`~recaccel.ops.embedding.fbgemm` (FBGEMM's
  table-batched embedding). Triton and FBGEMM are imported only when used.
- :mod:`~recaccel.ops.embedding.optimizers`: the sparse update rules;
  :mod:`~recaccel.ops.embedding.state`: backend-independent checkpoints.
"""

from recaccel.ops.embedding.backends import choose_backend, pack_backend_class
from recaccel.ops.embedding.init_weights import init_table_weights
from recaccel.ops.embedding.model_checks import check_deferred_ids
from recaccel.ops.embedding.module import PackedEmbeddingBag
from recaccel.ops.embedding.options import EmbeddingOptions
from recaccel.ops.embedding.pack_backend import PackBackend
from recaccel.ops.embedding.packing import PackingPlan, PackLayout
from recaccel.ops.embedding.prepared import PreparedSparse
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
    "EmbeddingOptions",
    "InvalidIdError",
    "PackBackend",
    "PackLayout",
    "PackedEmbeddingBag",
    "PackingPlan",
    "PreparedSparse",
    "SparseOptimConfig",
    "TableSpec",
    "check_deferred_ids",
    "choose_backend",
    "init_table_weights",
    "pack_backend_class",
]

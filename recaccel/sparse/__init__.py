"""Batch types: the unit of data between the reader, the loader and the model.

:class:`SparseFeatures` (the sparse ids of B rows), :class:`Batch` (one mini-batch)
and :class:`TaskBatch` (T tasks of support and query rows), with the row operations
the rest of the library needs: slicing rows or tasks for a rank, stacking the rows of
two batches for one lookup, reordering fields to meet a model by name. This package
is the bottom of the package graph: it imports nothing from recaccel but its errors.

Shapes: B batch, F sparse fields, Dd dense features, N total ids in the batch,
T tasks, S / Q support / query rows per task.

- :mod:`~recaccel.sparse.features`: :class:`SparseFeatures` and its CSR operations.
- :mod:`~recaccel.sparse.batches`: :class:`Batch` and :class:`TaskBatch`.
- :mod:`~recaccel.sparse.csr`: index helpers they share.
"""

from recaccel.sparse.batches import Batch, TaskBatch
from recaccel.sparse.features import SparseFeatures

__all__ = ["Batch", "SparseFeatures", "TaskBatch"]

"""The mini-batch types: :class:`Batch` (B rows) and :class:`TaskBatch` (T tasks of
support and query rows), with the row and task slicing the readers and ranks need.

Shapes: B batch, Dd dense features, T tasks, S / Q support / query rows per task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recaccel.sparse.csr import check_rows
from recaccel.sparse.features import SparseFeatures


@dataclass
class Batch:
    """One mini-batch: B rows of dense features, sparse ids, labels and sample weights.

    Attributes:
        dense: float32 [B, Dd].
        sparse: the B rows' sparse ids.
        labels: float32 [B].
        weights: optional float32 [B] sample weights (also used as a row mask).

    Example::

        B = 3 rows, Dd = 2 dense features, the 2 sparse fields of SparseFeatures' example:

                   dense          sparse "user"   sparse "item"   label   weight
            row 0  [0.1, 2.0]     [10, 11]        [20]            1.0     1.0
            row 1  [0.3, 0.0]     []              [21, 22]        0.0     1.0
            row 2  [1.5, 0.2]     [12]            [23]            1.0     0.0  (masked out)

        ``batch.slice_rows(1, 3)`` is rows 1 and 2 of every column.
    """

    dense: Tensor
    sparse: SparseFeatures
    labels: Tensor
    weights: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    @property
    def training_rows(self) -> int:
        """Rows a step trains on (every row of a Batch)."""
        return self.batch_size

    def slice_rows(self, lo: int, hi: int) -> Batch:
        """Rows ``[lo, hi)`` of every column (see :meth:`SparseFeatures.slice_rows`).

        Raises:
            ValueError: the rows are not within ``[0, B]``.
        """
        check_rows(lo, hi, self.batch_size, "rows")
        return Batch(
            self.dense[lo:hi],
            self.sparse.slice_rows(lo, hi),
            self.labels[lo:hi],
            None if self.weights is None else self.weights[lo:hi],
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.dense.pin_memory(),
            self.sparse.pin_memory(),
            self.labels.pin_memory(),
            None if self.weights is None else self.weights.pin_memory(),
        )


@dataclass
class TaskBatch:
    """T tasks for meta-learning, each with S support and Q query rows.

    Rows are task-major: task t owns support rows ``t*S .. (t+1)*S - 1`` and query rows
    ``t*Q .. (t+1)*Q - 1``. Tasks with fewer rows are padded; the masks mark real rows,
    so every task has the same shape and the meta step can vmap over tasks.

    Attributes:
        support: Batch of T*S rows.
        query: Batch of T*Q rows.
        support_mask: float32 [T, S], 1 for a real row, 0 for padding.
        query_mask: float32 [T, Q].
        task_ids: int64 [T] task keys.
        stacked: the support then query rows' sparse ids stacked for one lookup, made
            ahead (and prepared for the model's embedding) by the train pipeline; None:
            :meth:`concat_sparse` stacks them when asked.

    Example::

        T = 2 tasks (keys 7 and 9), S = 2, Q = 3; task 9 has one support row and two
        query rows, the rest is padding (mask 0):

            support rows   0    1  |  2    3          support_mask  [[1, 1],
                           task 7  |  task 9                         [1, 0]]
            query rows     0  1  2 |  3  4  5         query_mask    [[1, 1, 1],
                           task 7  |  task 9                         [1, 1, 0]]

        ``tb.slice_tasks(1, 2)`` is task 9 alone (support rows 2-3, query rows 3-5).
    """

    support: Batch
    query: Batch
    support_mask: Tensor
    query_mask: Tensor
    task_ids: Tensor
    stacked: SparseFeatures | None = None

    @property
    def num_tasks(self) -> int:
        return self.task_ids.shape[0]

    @property
    def training_rows(self) -> int:
        """Rows a step trains on: the real (unpadded) support and query rows."""
        return int(self.support_mask.sum() + self.query_mask.sum())

    @property
    def support_size(self) -> int:
        return self.support_mask.shape[1]

    @property
    def query_size(self) -> int:
        return self.query_mask.shape[1]

    def slice_tasks(self, lo: int, hi: int) -> TaskBatch:
        """Tasks ``[lo, hi)`` with their support and query rows.

        Raises:
            ValueError: the tasks are not within ``[0, T]``.
        """
        check_rows(lo, hi, self.num_tasks, "tasks")
        s, q = self.support_size, self.query_size
        return TaskBatch(
            self.support.slice_rows(lo * s, hi * s),
            self.query.slice_rows(lo * q, hi * q),
            self.support_mask[lo:hi],
            self.query_mask[lo:hi],
            self.task_ids[lo:hi],
        )

    def concat_sparse(self) -> SparseFeatures:
        """The sparse ids of every support row, then of every query row: T*S + T*Q rows
        for one embedding lookup (:meth:`split_rows` splits its output back).

        Raises:
            DataError: support and query do not hold the same fields.
        """
        if self.stacked is not None:
            return self.stacked
        return self.support.sparse.concat_rows(self.query.sparse)

    def split_rows(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Splits per-row outputs of :meth:`concat_sparse`'s rows into task-major blocks.

        Args:
            rows: [T*S + T*Q, ...] (e.g. pooled embeddings [., F, D]), support rows first.

        Returns:
            Views [T, S, ...] (support) and [T, Q, ...] (query).

        Raises:
            ValueError: ``rows`` does not have T*(S+Q) rows.
        """
        t, s, q = self.num_tasks, self.support_size, self.query_size
        n_s = t * s
        if rows.shape[0] != n_s + t * q:
            raise ValueError(f"expected {n_s} + {t * q} rows for T={t}, S={s}, Q={q}, got {rows.shape[0]}")
        tail = rows.shape[1:]
        return rows[:n_s].view(t, s, *tail), rows[n_s:].view(t, q, *tail)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TaskBatch:
        return TaskBatch(
            self.support.to(device, non_blocking),
            self.query.to(device, non_blocking),
            self.support_mask.to(device, non_blocking=non_blocking),
            self.query_mask.to(device, non_blocking=non_blocking),
            self.task_ids.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> TaskBatch:
        return TaskBatch(
            self.support.pin_memory(),
            self.query.pin_memory(),
            self.support_mask.pin_memory(),
            self.query_mask.pin_memory(),
            self.task_ids.pin_memory(),
        )

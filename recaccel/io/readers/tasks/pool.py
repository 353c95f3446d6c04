"""Tasks held in memory and their assembly into fixed-shape TaskBatches.

A :class:`TaskPool` keeps rows in chunks (views of decoded row groups, or a small copy
for a task that crossed row groups) plus, per chunk, the index array that a split
produced, so a split that reorders or samples rows copies nothing. A shuffle window
is merged into one chunk (one copy), and building a batch gathers each task's support
and query rows from it: two gathers per batch.

Shapes: T tasks, S support and Q query rows per task, m tasks in a pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recaccel.io.format.columns import Columns, take_batch
from recaccel.sparse import Batch, TaskBatch


@dataclass
class TaskPool:
    """Tasks whose rows are in memory, in yield order.

    Attributes:
        chunks: the rows, in pieces.
        rows: per chunk, int64 row indices into it; task t owns
            ``chunks[c][rows[c][starts[t] : starts[t] + num_support[t] + num_query[t]]]``
            with ``c = chunk[t]``, support rows first.
        chunk: int64 [m] chunk of each task.
        starts, num_support, num_query, keys: int64 [m] per task.
    """

    chunks: list[Columns]
    rows: list[np.ndarray]
    chunk: np.ndarray
    starts: np.ndarray
    num_support: np.ndarray
    num_query: np.ndarray
    keys: np.ndarray

    @classmethod
    def single(cls, cols: Columns, rows: np.ndarray, starts, num_support, num_query, keys) -> TaskPool:
        """Tasks that all live in one chunk."""
        chunk = np.zeros(keys.shape[0], dtype=np.int64)
        return cls([cols], [rows], chunk, starts, num_support, num_query, keys)

    @property
    def num_tasks(self) -> int:
        return int(self.keys.shape[0])

    @property
    def held_rows(self) -> int:
        """Rows of the chunks this pool keeps alive."""
        return sum(c.num_rows for c in self.chunks)

    def subset(self, idx: np.ndarray) -> TaskPool:
        """Tasks ``idx`` (in that order), sharing the chunks (no row moves)."""
        return TaskPool(
            self.chunks,
            self.rows,
            self.chunk[idx],
            self.starts[idx],
            self.num_support[idx],
            self.num_query[idx],
            self.keys[idx],
        )

    def compact(self, row_major_ids: bool = False) -> TaskPool:
        """The same tasks with only their rows copied into one chunk (frees the rest),
        each task's rows contiguous (support, then query).

        Tasks come out grouped by chunk (stable), which keeps a gather to one pass per
        chunk. ``row_major_ids`` stores the single-hot ids row-major (see
        :meth:`Columns.concat`), as batches gather from a merged window.
        """
        pool = self.subset(np.argsort(self.chunk, kind="stable"))
        sizes = pool.num_support + pool.num_query
        new_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        pos = np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(pool.starts - new_starts, sizes)
        cols = _gather(pool, np.repeat(pool.chunk, sizes), pos, row_major_ids)
        return TaskPool.single(
            cols,
            np.arange(pos.shape[0], dtype=np.int64),
            new_starts,
            pool.num_support,
            pool.num_query,
            pool.keys,
        )

    def merged(self) -> TaskPool:
        """The same tasks with the chunks concatenated into one (one copy of the rows).

        A batch gathers from each chunk its tasks touch, and every gather has a fixed
        cost per field: one chunk per window makes that two gathers per batch.
        """
        if len(self.chunks) == 1:
            return self
        base = np.cumsum([0] + [c.num_rows for c in self.chunks[:-1]])
        rows = [r + b for r, b in zip(self.rows, base)]
        lengths = np.cumsum([0] + [r.shape[0] for r in rows[:-1]])
        return TaskPool.single(
            Columns.concat(self.chunks, row_major_ids=True),
            np.concatenate(rows).astype(np.int64),
            self.starts + lengths[self.chunk],
            self.num_support,
            self.num_query,
            self.keys,
        )

    @staticmethod
    def concat(pools: list[TaskPool]) -> TaskPool:
        """Tasks of ``pools`` one after another (chunks shared, not copied)."""
        if len(pools) == 1:
            return pools[0]
        base = np.cumsum([0] + [len(p.chunks) for p in pools[:-1]])
        return TaskPool(
            [c for p in pools for c in p.chunks],
            [r for p in pools for r in p.rows],
            np.concatenate([p.chunk + b for p, b in zip(pools, base)]).astype(np.int64),
            np.concatenate([p.starts for p in pools]),
            np.concatenate([p.num_support for p in pools]),
            np.concatenate([p.num_query for p in pools]),
            np.concatenate([p.keys for p in pools]),
        )


def build_task_batch(pool: TaskPool, support_size: int, query_size: int) -> TaskBatch:
    """Every task of ``pool`` as a TaskBatch padded to S / Q rows per task.

    Tasks appear grouped by chunk (stable). Sides with more rows than S / Q are not cut:
    pass sizes at least the largest side. Padding rows repeat the task's first row; the
    masks mark real rows and are also each side's ``Batch.weights``.
    """
    pool = pool.subset(np.argsort(pool.chunk, kind="stable"))
    st, ns, nq = pool.starts[:, None], pool.num_support[:, None], pool.num_query[:, None]
    js = np.arange(support_size)
    jq = np.arange(query_size)
    real_s = js < ns
    real_q = jq < nq
    sidx = np.where(real_s, st + js, st)
    qidx = np.where(real_q, st + ns + jq, st)
    support = _gather_batch(pool, np.repeat(pool.chunk, support_size), sidx.reshape(-1))
    query = _gather_batch(pool, np.repeat(pool.chunk, query_size), qidx.reshape(-1))
    smask = torch.from_numpy(real_s.astype(np.float32))
    qmask = torch.from_numpy(real_q.astype(np.float32))
    support.weights = smask.reshape(-1)
    query.weights = qmask.reshape(-1)
    return TaskBatch(support, query, smask, qmask, torch.from_numpy(np.array(pool.keys, dtype=np.int64)))


def _gather(pool: TaskPool, row_chunk: np.ndarray, pos: np.ndarray, row_major_ids: bool = False) -> Columns:
    """Rows ``pool.rows[row_chunk[i]][pos[i]]`` of their chunks; ``row_chunk`` grouped."""
    cuts = np.flatnonzero(row_chunk[1:] != row_chunk[:-1]) + 1
    bounds = [0, *cuts.tolist(), row_chunk.shape[0]]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = int(row_chunk[a]) if b > a else 0
        parts.append(pool.chunks[c].take(pool.rows[c][pos[a:b]]))
    return Columns.concat(parts, row_major_ids=row_major_ids)


def _gather_batch(pool: TaskPool, row_chunk: np.ndarray, pos: np.ndarray) -> Batch:
    """Like ``_gather(...).to_batch()``, gathering a one-chunk pool straight into the batch."""
    if len(pool.chunks) > 1 and np.any(row_chunk != row_chunk[0]):
        return _gather(pool, row_chunk, pos).to_batch()
    c = int(row_chunk[0]) if row_chunk.size else 0
    return take_batch(pool.chunks[c], pool.rows[c][pos])

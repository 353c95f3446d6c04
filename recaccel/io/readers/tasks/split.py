"""Support/query split of whole tasks, vectorized over every task of a chunk of rows.

Per task of n rows (rows of a task are contiguous; tasks with fewer than
``min_task_rows`` rows are skipped and counted):

- query count q: with ``query_count > 0`` exactly ``min(query_count, n - 1)`` rows (the
  MeLU protocol: 10 query ratings, the rest support); otherwise
  ``round(query_fraction * n)`` clipped to ``[1, n - 1]``. A task of one row has one
  query row and no support row. The other ``n - q`` rows are the support set.
- ``random``: the rows are ordered by a per-row pseudo-random number (below); the
  first q form the query set.
- ``time``: the rows are ordered by the timestamp (ties keep stream order); the latest
  q rows form the query set, the earlier ones the support set.
- sampling (training only): a side with more rows than its size (S support, Q query)
  keeps a uniform sample of that many rows: the rows with the smallest random numbers
  (for ``random`` these are simply the first rows of the random order). Kept rows stay
  in time order under ``time``. Evaluation keeps every row.

The random number of a row is a SplitMix64 hash of (seed words, task key, position of
the row inside its task), so a task's split depends only on its own rows and the
seed words, never on which chunk, rank or window it arrived in. Training seeds with
(seed, epoch): each epoch draws a new split; evaluation seeds with (seed,) only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recaccel.errors import ConfigError
from recaccel.hashing import GAMMA, mix64

SPLIT_POLICIES = ("random", "time")

SPLIT_COUNTERS = (
    "tasks_read",
    "tasks_skipped_small",
    "rows_skipped_small",
    "tasks_subsampled",
    "rows_subsampled",
)


@dataclass(frozen=True)
class SplitSpec:
    """How tasks are split (see the module docstring).

    Raises:
        ConfigError: on a bad value.
    """

    policy: str = "random"
    query_fraction: float = 0.5
    query_count: int = 0
    support_size: int = 32
    query_size: int = 32
    min_task_rows: int = 4
    sample: bool = True

    def __post_init__(self) -> None:
        if self.policy not in SPLIT_POLICIES:
            raise ConfigError(f"tasks.split must be one of {', '.join(SPLIT_POLICIES)}, got {self.policy!r}")
        if self.support_size < 1 or self.query_size < 1:
            raise ConfigError(
                "tasks.support_size and tasks.query_size must be >= 1, "
                f"got {self.support_size}, {self.query_size}"
            )
        if self.min_task_rows < 1:
            raise ConfigError(f"tasks.min_task_rows must be >= 1, got {self.min_task_rows}")
        if self.query_count < 0:
            raise ConfigError(f"tasks.query_count must be >= 0, got {self.query_count}")
        if self.query_count == 0 and not 0.0 < self.query_fraction < 1.0:
            raise ConfigError(
                "tasks.query_fraction must be in (0, 1) unless a fixed query count is set, "
                f"got {self.query_fraction}"
            )


@dataclass
class TaskSplit:
    """The kept tasks of a chunk, each laid out as [support rows, query rows].

    Attributes:
        rows: int64 [R] chunk row indices: task 0's support then query rows, task 1's, ...
        keys: int64 [m] task keys.
        num_support: int64 [m] support rows per task.
        num_query: int64 [m] query rows per task.
        counters: the :data:`SPLIT_COUNTERS` of this chunk.
    """

    rows: np.ndarray
    keys: np.ndarray
    num_support: np.ndarray
    num_query: np.ndarray
    counters: dict[str, int]

    @property
    def starts(self) -> np.ndarray:
        """int64 [m] position of each task's first row in ``rows``."""
        sizes = self.num_support + self.num_query
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes.size else sizes


def split_tasks(
    keys: np.ndarray, times: np.ndarray | None, spec: SplitSpec, seed_words: tuple[int, ...]
) -> TaskSplit:
    """Splits every task of a chunk (rows of a task contiguous, any key order).

    Args:
        keys: int64 [n] task key per row.
        times: int64 [n] timestamps (required by the ``time`` policy), or None.
        spec: the split rules.
        seed_words: non-negative ints seeding the per-row random numbers.

    Returns:
        The kept tasks in chunk order.
    """
    n = keys.shape[0]
    counters = dict.fromkeys(SPLIT_COUNTERS, 0)
    empty = np.zeros(0, dtype=np.int64)
    if n == 0:
        return TaskSplit(empty, empty, empty, empty, counters)
    starts = np.concatenate([[0], np.flatnonzero(keys[1:] != keys[:-1]) + 1]).astype(np.int64)
    counts = np.diff(np.append(starts, n))
    small = counts < spec.min_task_rows
    counters["tasks_skipped_small"] = int(small.sum())
    counters["rows_skipped_small"] = int(counts[small].sum())
    kept = np.flatnonzero(~small)
    counters["tasks_read"] = int(kept.size)
    if kept.size == 0:
        return TaskSplit(empty, empty, empty, empty, counters)
    if small.any():
        row_ids = _ranges(starts[kept], counts[kept])
        starts, counts = np.concatenate([[0], np.cumsum(counts[kept])[:-1]]), counts[kept]
        keys, times = keys[row_ids], None if times is None else times[row_ids]
    else:
        row_ids = np.arange(n, dtype=np.int64)
    m = counts.shape[0]
    seg = np.repeat(np.arange(m), counts)
    pos = np.arange(row_ids.shape[0], dtype=np.int64) - starts[seg]
    nq = _query_counts(counts, spec)
    ns = counts - nq
    rand = _row_random(keys, pos, seed_words)
    # Positions: rows ordered by task, then (random) by random number or (time) by time.
    # Either way each task's query rows and support rows form two contiguous groups.
    if spec.policy == "random":
        order = np.argsort(_seg_key(seg, rand >> np.uint64(32)))  # rank inside a task = pos
        is_query = pos < nq[seg]
        chosen_rank = np.where(is_query, pos, pos - nq[seg])
    else:
        order = _time_order(seg, times)
        is_query = pos >= ns[seg]
        chosen_rank = None
        if spec.sample:
            # Rank of each row's random number inside its (task, side) group.
            side_key = (seg.astype(np.uint64) << np.uint64(1)) | is_query.astype(np.uint64)
            by_rand = np.argsort(_seg_key(side_key, rand[order] >> np.uint64(32)))
            chosen_rank = np.empty(seg.shape[0], dtype=np.int64)
            chosen_rank[by_rand] = np.arange(by_rand.shape[0]) - _group_starts(
                seg[by_rand], is_query[by_rand]
            )
    if spec.sample:
        keep = chosen_rank < np.where(is_query, spec.query_size, spec.support_size)
        num_support = np.minimum(ns, spec.support_size)
        num_query = np.minimum(nq, spec.query_size)
        dropped = int(seg.shape[0] - keep.sum())
        counters["rows_subsampled"] = dropped
        counters["tasks_subsampled"] = int(np.count_nonzero(num_support + num_query < counts))
    else:
        keep = np.ones(seg.shape[0], dtype=bool)
        num_support, num_query = ns, nq
    # Scatter kept rows to [support, query] per task, keeping position order inside a side.
    group_first = _group_starts(seg, is_query)
    before = np.cumsum(keep) - keep
    dense = before - before[group_first]
    sizes = num_support + num_query
    out_start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    dest = out_start[seg] + np.where(is_query, num_support[seg], 0) + dense
    rows = np.empty(int(sizes.sum()), dtype=np.int64)
    rows[dest[keep]] = row_ids[order[keep]]
    return TaskSplit(rows, keys[starts], num_support.astype(np.int64), num_query.astype(np.int64), counters)


def _seg_key(seg: np.ndarray, low32: np.ndarray) -> np.ndarray:
    """uint64 sort key: ``seg`` in the high bits, a 32-bit value in the low bits."""
    return (seg.astype(np.uint64) << np.uint64(32)) | low32.astype(np.uint64)


def _time_order(seg: np.ndarray, times: np.ndarray | None) -> np.ndarray:
    """Positions sorted by (task, time), ties in stream order."""
    n = seg.shape[0]
    if times is None:
        return np.arange(n)
    same_task = seg[1:] == seg[:-1]
    if not np.any(same_task & (times[1:] < times[:-1])):
        return np.arange(n)  # already in time order (grouped with a timestamp)
    return np.lexsort((times, seg))


def _query_counts(counts: np.ndarray, spec: SplitSpec) -> np.ndarray:
    upper = np.maximum(counts - 1, 1)
    if spec.query_count > 0:
        return np.minimum(spec.query_count, upper).astype(np.int64)
    q = np.rint(spec.query_fraction * counts).astype(np.int64)
    return np.clip(q, 1, upper)


def _row_random(keys: np.ndarray, pos: np.ndarray, seed_words: tuple[int, ...]) -> np.ndarray:
    """uint64 [n] pseudo-random numbers of (seed words, task key, position in task)."""
    with np.errstate(over="ignore"):
        salt = np.array([GAMMA], dtype=np.uint64)
        for w in seed_words:
            salt = mix64(salt + np.uint64(w))
        h = mix64(keys.astype(np.int64, copy=False).view(np.uint64) ^ salt)
        return mix64(h + pos.astype(np.uint64))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for each (s, c): int64 [sum c]."""
    total = int(counts.sum())
    out_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.arange(total, dtype=np.int64) + np.repeat(starts - out_start, counts)


def _group_starts(seg: np.ndarray, side: np.ndarray) -> np.ndarray:
    """For rows sorted by (seg, side): index of the first row of each row's group."""
    n = seg.shape[0]
    new = np.ones(n, dtype=bool)
    new[1:] = (seg[1:] != seg[:-1]) | (side[1:] != side[:-1])
    first = np.flatnonzero(new)
    return first[np.cumsum(new) - 1]

"""Whole tasks out of a task-grouped dataset, one owned row group at a time.

The dataset's non-empty row groups, in file order, form one stream sorted by task key.
Row group ``g`` *owns* the tasks that start in it: every task whose key is greater
than the last key of row group ``g-1`` (all of them for the first row group). A task
that runs past the end of ``g`` is completed from ``g+1``, ``g+2``, ... and belongs to
``g``; those rows are skipped when ``g+1`` is read as an owner. So every row belongs to
exactly one owned row group, which lets ranks and shuffles work on row groups while
tasks stay whole.

Boundaries come from reading the task key column of every row group once, when the
stream is opened (a small column, about a millisecond per row group); a pre-decoded
cache recorded the same keys when it was built, and they are read from it instead. The footer's
min/max statistics would be cheaper but cannot be trusted to be safe: pyarrow aborts
the process (a C++ exception it does not convert) when Python code opens the metadata
of a column chunk whose size statistics disagree with the schema, as in a damaged
footer; reading the column reports the same damage as an error.

Not thread-safe: one thread at a time may use a stream (the task reader's read-ahead
thread, or the iterating thread).

Order checks. Opening the stream checks that no row group starts below the previous
one's last key; decoding a row group checks that its keys never decrease. A violation
is a :class:`DataError` naming the file, row group and the two keys, and saying
whether the file claimed to be grouped (written by ``recaccel-data tasks``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recaccel.errors import DataError
from recaccel.io.format.cache.read import cached_task_keys
from recaccel.io.format.columns import Columns
from recaccel.io.format.dataset import DatasetInfo, RowGroupReader
from recaccel.io.format.grouping import grouped_claim
from recaccel.io.format.task_keys import KeyColumnReader


@dataclass
class OwnedRows:
    """The rows of the tasks one row group owns, in stream order.

    Attributes:
        cols: the rows (every projected feature plus the task key, and timestamp).
        keys: int64 [n] task key of each row (sorted).
        times: int64 [n] timestamps, or None.
    """

    cols: Columns
    keys: np.ndarray
    times: np.ndarray | None


class HeadStash:
    """Heads of row groups kept for a unit read later, shared by the streams of one pass.

    The head of row group ``h`` is its rows that complete row group ``h-1``'s last task.
    When ``h`` starts a unit and ``h-1`` ends a unit read later, the owner of ``h`` keeps
    a copy of that head here (a few rows), so completing the task does not decode ``h``
    a second time. Thread-safe.

    Args:
        wanted: the row groups whose heads a later unit needs.

    Attributes:
        rows: rows held.
    """

    def __init__(self, wanted: set[int]) -> None:
        self._wanted = set(wanted)
        self._heads: dict[int, Columns] = {}
        self._lock = threading.Lock()
        self.rows = 0

    def offer(self, g: int, head: Callable[[], Columns]) -> None:
        """Keeps ``head()`` (called only if needed) as row group ``g``'s head."""
        with self._lock:
            if g in self._wanted:
                self._wanted.discard(g)
                cols = self._heads[g] = head()
                self.rows += cols.num_rows

    def claim(self, g: int) -> Columns | None:
        """Row group ``g``'s head if kept (then dropped from here); None otherwise, and
        then it is no longer wanted (the caller decodes ``g`` itself)."""
        with self._lock:
            self._wanted.discard(g)
            cols = self._heads.pop(g, None)
            if cols is not None:
                self.rows -= cols.num_rows
            return cols


def wanted_heads(units: list[range]) -> set[int]:
    """Row groups starting a unit whose predecessor ends a unit later in ``units``."""
    pos = {g: i for i, unit in enumerate(units) for g in unit}
    return {u.start for j, u in enumerate(units) if len(u) and pos.get(u.start - 1, -1) > j}


@dataclass(frozen=True)
class KeyIndex:
    """The task key's row-group index: what the reader knows of each row group's tasks
    from its key column alone (int64 [G] arrays, G = row groups).

    Attributes:
        first, last: first and last task key.
        runs: distinct keys (runs of equal keys).
        head, tail: rows of the first and of the last run.
        inner_kept: runs strictly between the first and the last one with at least
            ``min_rows`` rows (such a task lies wholly inside the row group).
        min_rows: the size threshold ``inner_kept`` was counted with.
    """

    first: np.ndarray
    last: np.ndarray
    runs: np.ndarray
    head: np.ndarray
    tail: np.ndarray
    inner_kept: np.ndarray
    min_rows: int


def key_index(info: DatasetInfo, column: str, min_rows: int = 1) -> KeyIndex:
    """The :class:`KeyIndex` of ``info``, reading the task key column of every row group
    (from Parquet, or the keys a pre-decoded cache recorded of it).

    Raises:
        DataError: on an unreadable footer or key column, or a null key.
    """
    rows = np.zeros((6, len(info.row_groups)), dtype=np.int64)
    if info.cache is not None:
        for g, keys in enumerate(cached_task_keys(info.cache)):
            rows[:, g] = _summarize(keys, min_rows)
        return KeyIndex(*rows, min_rows=min_rows)
    reader = KeyColumnReader(column)
    try:
        for g, ref in enumerate(info.row_groups):
            rows[:, g] = _summarize(reader.read(ref), min_rows)
    finally:
        reader.close()
    return KeyIndex(*rows, min_rows=min_rows)


def key_bounds(info: DatasetInfo, column: str) -> tuple[np.ndarray, np.ndarray]:
    """First and last task key of every row group of ``info``: two int64 [G] arrays.

    Raises:
        DataError: on an unreadable footer or key column, or a null key.
    """
    index = key_index(info, column)
    return index.first, index.last


def _summarize(keys: np.ndarray, min_rows: int) -> tuple[int, ...]:
    """(first, last, runs, head, tail, inner_kept) of one row group's keys."""
    starts = np.concatenate([[0], np.flatnonzero(keys[1:] != keys[:-1]) + 1])
    sizes = np.diff(np.append(starts, keys.shape[0]))
    inner = int(np.count_nonzero(sizes[1:-1] >= min_rows))
    return int(keys[0]), int(keys[-1]), int(sizes.shape[0]), int(sizes[0]), int(sizes[-1]), inner


class TaskStream:
    """Reads the rows owned by a row group, completing tasks across row groups.

    Args:
        info: the dataset (its non-empty row groups are the stream).
        source: decodes a row group (its projection must include the task key and,
            when used, the timestamp as side columns).
        task_key: the task key column.
        timestamp: the timestamp column, or None.
        cache_row_groups: decoded row groups kept for reuse (a continuation is
            usually the next owner).
        bounds: the (first, last) key arrays of :func:`key_bounds` if already known.
        stats: counter dict to update (``row_groups_read``: row groups decoded).
        heads: heads of row groups shared with other streams of the pass, or None.

    Attributes:
        first, last: int64 [G] first / last task key of each row group.
        cached_rows: rows of the cached decoded row groups.

    Raises:
        DataError: if a row group starts below the previous one's last key.
    """

    def __init__(
        self,
        info: DatasetInfo,
        source: RowGroupReader,
        task_key: str,
        timestamp: str | None,
        cache_row_groups: int = 2,
        bounds: tuple[np.ndarray, np.ndarray] | None = None,
        stats: dict[str, int] | None = None,
        heads: HeadStash | None = None,
    ) -> None:
        self.info = info
        self.source = source
        self.task_key = task_key
        self.timestamp = timestamp
        self.first, self.last = bounds if bounds is not None else key_bounds(info, task_key)
        self._cache: OrderedDict[int, Columns] = OrderedDict()
        self._cache_size = max(1, cache_row_groups)
        self.cached_rows = 0
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("row_groups_read", 0)
        self.heads = heads
        check_order(info, self.first, self.last, task_key)

    @property
    def num_row_groups(self) -> int:
        return len(self.info.row_groups)

    def owned(self, g: int) -> list[OwnedRows]:
        """The rows of the tasks row group ``g`` owns, in stream order; [] if none.

        The rows are views of the decoded row group, except for a last task that runs
        into later row groups: that one comes as a separate, concatenated part.

        Raises:
            DataError: for unsorted keys, and as the row-group reader does.
        """
        last = int(self.last[g])
        skip = int(self.last[g - 1]) if g > 0 and self.first[g] == self.last[g - 1] else None
        if skip is not None and last == skip:
            return []  # the whole row group continues a task owned earlier
        cols = self._read(g)
        keys = cols.side[self.task_key]
        start = int(np.searchsorted(keys, skip, "right")) if skip is not None else 0
        if start and self.heads is not None:
            self.heads.offer(g, lambda: cols.take(np.arange(start)))
        h = g + 1
        if h >= self.num_row_groups or int(self.first[h]) != last:
            return [self._part(cols.slice(start, cols.num_rows))]
        tail = max(start, int(np.searchsorted(keys, last, "left")))
        parts = [cols.slice(tail, cols.num_rows)]
        while h < self.num_row_groups and int(self.first[h]) == last:
            head = self.heads.claim(h) if self.heads is not None else None
            if head is None:
                nxt = self._read(h)
                head = nxt.slice(0, int(np.searchsorted(nxt.side[self.task_key], last, "right")))
            parts.append(head)
            if int(self.last[h]) != last:
                break
            h += 1
        out = [self._part(cols.slice(start, tail))] if tail > start else []
        return out + [self._part(Columns.concat(parts))]

    def _part(self, rows: Columns) -> OwnedRows:
        times = rows.side[self.timestamp] if self.timestamp is not None else None
        return OwnedRows(rows, rows.side[self.task_key], times)

    def _read(self, g: int) -> Columns:
        cols = self._cache.get(g)
        if cols is not None:
            self._cache.move_to_end(g)
            return cols
        cols = self._decode(g)
        self._cache[g] = cols
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        # A plain int, so another thread may read it while this one reads on.
        self.cached_rows = sum(c.num_rows for c in self._cache.values())
        return cols

    def _decode(self, g: int) -> Columns:
        cols = self.source.read(self.info.row_groups[g])
        self.stats["row_groups_read"] += 1
        keys = cols.side[self.task_key]
        down = np.flatnonzero(keys[1:] < keys[:-1])
        if down.size:
            i = int(down[0])
            raise_unsorted(self.info, g, self.task_key, int(keys[i]), int(keys[i + 1]), f"at row {i + 1}")
        return cols


def check_order(info: DatasetInfo, first: np.ndarray, last: np.ndarray, column: str) -> None:
    """Checks that no row group starts below the previous one's last key.

    Raises:
        DataError: naming the file and row group where the key decreases.
    """
    bad = np.flatnonzero(first[1:] < last[:-1])
    if bad.size:
        g = int(bad[0]) + 1
        raise_unsorted(info, g, column, int(last[g - 1]), int(first[g]), "at its first row")


def raise_unsorted(info: DatasetInfo, g: int, column: str, before: int, after: int, where: str) -> None:
    """Raises the DataError for a task key that decreases inside or before row group ``g``."""
    ref = info.row_groups[g]
    if grouped_claim(info.schema) is not None:
        claim = "the file claims to be grouped by task (recaccel-data tasks) but is not sorted"
    elif info.schema.source is not None:  # no recaccel metadata: recaccel-data tasks refuses it
        claim = (
            "the data is not sorted by task key; rewrite it sorted with "
            "recaccel.io.convert.group_by_task.group_by_task(src, out_dir, "
            f"task_key={column!r}, schema=cfg.data.schema), or sort the files by {column!r}"
        )
    else:
        claim = "the data is not sorted by task key; rewrite it with recaccel-data tasks"
    raise DataError(
        f"task key decreases from {before} to {after} {where}: {claim}",
        path=str(ref.path),
        row_group=ref.row_group,
        column=column,
    )

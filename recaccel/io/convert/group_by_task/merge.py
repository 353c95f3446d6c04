"""The external merge sort of :func:`~recaccel.io.convert.group_by_task.group_by_task`:
sorted runs spilled to temporary Parquet files, then merged k-way in bounded memory
(see the package's docstring for the bound that keeps the output sorted).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from recaccel.io.convert.group_by_task.sort_keys import KeySource, writer_columns
from recaccel.io.format.columns import Columns
from recaccel.io.format.dataset import RowGroupReader, RowGroupRef, open_dataset
from recaccel.io.format.decode import Policies, Projection, new_decode_stats
from recaccel.io.format.grouping import task_order
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.format.writer import DatasetWriter

_MIN_MERGE_ROWS = 1024


class Sink:
    """The output writer plus counters (rows, distinct tasks, memory high-water mark);
    ``bar``, if given, advances by the rows written."""

    def __init__(self, writer: DatasetWriter, bar: tqdm | None = None) -> None:
        self.writer = writer
        self.bar = bar
        self.rows = 0
        self.tasks = 0
        self.max_rows = 0
        self._last: int | None = None

    def high(self, rows: int) -> None:
        self.max_rows = max(self.max_rows, rows)

    def write_sorted(self, cols: Columns, keys: np.ndarray, times: np.ndarray | None) -> None:
        """Sorts ``cols`` by (key, time) and appends them."""
        order = task_order(keys, times)
        self.write(cols.take(order), keys[order], None if times is None else times[order])

    def write(self, cols: Columns, keys: np.ndarray, times: np.ndarray | None) -> None:
        """Appends rows already in order (each call continues the previous one's order)."""
        if cols.num_rows == 0:
            return
        changes = int(np.count_nonzero(keys[1:] != keys[:-1])) + 1
        if self._last is not None and int(keys[0]) == self._last:
            changes -= 1
        self.tasks += changes
        self._last = int(keys[-1])
        self.rows += cols.num_rows
        self.writer.write(writer_columns(cols, self.writer.schema, keys, times))
        if self.bar is not None:
            self.bar.update(cols.num_rows)


def spill_runs(
    refs: tuple[RowGroupRef, ...],
    reader: RowGroupReader,
    ks: KeySource,
    memory_rows: int,
    merge_rows: int,
    work: Path,
    out: Sink,
    bar: tqdm,
) -> list[Path]:
    """Writes sorted runs of at most ``memory_rows`` rows (or one row group) under ``work``;
    ``bar`` advances by the rows read."""
    run_dirs: list[Path] = []

    def spill(parts: list[Columns]) -> None:
        cols = Columns.concat(parts)
        out.high(cols.num_rows)
        run_dir = work / f"run-{len(run_dirs):05d}"
        sink = Sink(DatasetWriter(run_dir, ks.out_schema, merge_rows, prefix="run"))
        sink.write_sorted(cols, *ks.keys(cols))
        sink.writer.close()
        run_dirs.append(run_dir)

    parts: list[Columns] = []
    held = 0
    for ref in refs:
        if parts and held + ref.num_rows > memory_rows:
            spill(parts)
            parts, held = [], 0
        parts.append(reader.read(ref))
        held += ref.num_rows
        bar.update(ref.num_rows)
    if parts:
        spill(parts)
    return run_dirs


class _Run:
    """A cursor over one sorted run: one decoded row group at a time."""

    def __init__(self, run_dir: Path, schema: FeatureSchema) -> None:
        info = open_dataset(run_dir, schema)
        side = tuple(c for c in (schema.task_key, schema.timestamp) if c is not None)
        self._reader = RowGroupReader(
            schema, Projection.select(schema, None, side), Policies(), new_decode_stats()
        )
        self._refs = list(info.row_groups)
        self._schema = schema
        self._next = 0
        self.cols: Columns | None = None
        self.pos = 0
        self._fill()

    def _fill(self) -> None:
        while (self.cols is None or self.pos >= self.cols.num_rows) and self._next < len(self._refs):
            self.cols = self._reader.read(self._refs[self._next])
            self._next += 1
            self.pos = 0
        if self.cols is not None and self.pos >= self.cols.num_rows:
            self.cols = None
            self._reader.close()

    @property
    def live(self) -> bool:
        return self.cols is not None

    @property
    def more(self) -> bool:
        """True while row groups beyond the buffered one remain."""
        return self._next < len(self._refs)

    def keys(self) -> tuple[np.ndarray, np.ndarray | None]:
        k = self.cols.side[self._schema.task_key][self.pos :]
        t = None if self._schema.timestamp is None else self.cols.side[self._schema.timestamp][self.pos :]
        return k, t

    def last(self) -> tuple[int, int]:
        k, t = self.keys()
        return int(k[-1]), (0 if t is None else int(t[-1]))

    def count_le(self, bound: tuple[int, int] | None, inclusive: bool = True) -> int:
        """Buffered rows (from ``pos``) whose (key, time) <= ``bound`` (< when not
        ``inclusive``); a prefix, as runs are sorted."""
        k, t = self.keys()
        if bound is None:
            return k.shape[0]
        side = "right" if inclusive else "left"
        lo = int(np.searchsorted(k, bound[0], "left"))
        if t is None:
            return int(np.searchsorted(k, bound[0], side))
        hi = int(np.searchsorted(k, bound[0], "right"))
        return lo + int(np.searchsorted(t[lo:hi], bound[1], side))

    def pop(self, n: int) -> Columns:
        part = self.cols.slice(self.pos, self.pos + n)
        self.pos += n
        self._fill()
        return part


def merge_plan(num_runs: int, memory_rows: int) -> tuple[int, int]:
    """``(fan_in, merge_rows)``: runs merged at once and rows per run row group, so that a
    merge holds at most ``memory_rows`` rows (``fan_in`` row groups buffered, as many
    rows again in the block being written). Up to ``memory_rows // 2048`` runs merge in
    one pass with row groups of at least 1024 rows; more runs (or less memory) take
    several passes, each merging ``fan_in`` runs into one."""
    fan_in = max(2, min(num_runs, memory_rows // (2 * _MIN_MERGE_ROWS)))
    return fan_in, max(1, memory_rows // (2 * fan_in))


def merge_passes(
    run_dirs: list[Path], schema: FeatureSchema, out: Sink, fan_in: int, merge_rows: int, work: Path
) -> None:
    """Merges groups of ``fan_in`` consecutive runs into longer runs until ``fan_in`` or
    fewer remain, then those into ``out``. Consecutive groups keep ties in source order."""
    level = 0
    while len(run_dirs) > fan_in:
        level += 1
        merged: list[Path] = []
        for i in range(0, len(run_dirs), fan_in):
            group = run_dirs[i : i + fan_in]
            if len(group) == 1:
                merged.append(group[0])
                continue
            run_dir = work / f"pass-{level:02d}-run-{len(merged):05d}"
            sink = Sink(DatasetWriter(run_dir, schema, merge_rows, prefix="run"))
            _merge(group, schema, sink)
            sink.writer.close()
            out.high(sink.max_rows)
            for done in group:
                shutil.rmtree(done, ignore_errors=True)
            merged.append(run_dir)
        run_dirs = merged
    _merge(run_dirs, schema, out)


def _merge(run_dirs: list[Path], schema: FeatureSchema, out: Sink) -> None:
    """k-way merge of sorted runs into ``out`` (see the module docstring)."""
    runs = [_Run(d, schema) for d in run_dirs]
    while True:
        live = [r for r in runs if r.live]
        if not live:
            return
        # Rows equal to the bound may still be unread in the first run ending on it: later
        # runs hold theirs back, so ties leave in run order whatever the row group sizes.
        bounded = [(r.last(), i) for i, r in enumerate(live) if r.more]
        bound, first = min(bounded) if bounded else (None, len(live))
        parts = [r.pop(n) for i, r in enumerate(live) if (n := r.count_le(bound, i <= first)) > 0]
        cols = Columns.concat(parts)
        out.high(sum(r.cols.num_rows for r in runs if r.live) + cols.num_rows)
        keys = cols.side[schema.task_key]
        times = None if schema.timestamp is None else cols.side[schema.timestamp]
        out.write_sorted(cols, keys, times)

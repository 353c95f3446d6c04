"""Task-grouped Parquet: a dataset rewritten sorted by task key (then timestamp).

Meta-IO reads a task's rows contiguously, so the files must be sorted by task key.
:func:`group_by_task` rewrites any recaccel dataset that way with bounded memory, by
an external merge sort:

1. runs: the source is read row group by row group; every ``memory_rows`` rows are
   sorted (stable, by task key then timestamp) and spilled to a temporary Parquet run;
2. merge: the runs are merged k-way, one row group of each run in memory. Each round
   emits, from every run, the rows not greater than the smallest *last* (key, time)
   among the runs that still have unread row groups; every later row is at least that
   large, so the output stays sorted. Rows equal to that bound leave only from runs up
   to the first one ending on it, and each round sorts its block stably, so ties keep
   run order and the whole rewrite is deterministic.

When everything fits in ``memory_rows`` no run is spilled. Memory holds at most
``memory_rows`` rows (or one source row group, if larger) while making runs, and at
most ``memory_rows`` while merging: a merge reads ``fan_in`` runs at once, one row group
of ``memory_rows // (2 fan_in)`` rows each (:func:`merge_plan`); with more runs than
that, groups of runs are first merged into longer runs (several passes).

What marks a file as grouped: the claim of :mod:`recaccel.io.format.grouping` in the
output schema (stored in every file's metadata). The task reader reads the task key column of
every row group once to find task boundaries and check the order across row groups;
a file that claims to be grouped is still verified (:mod:`recaccel.io.readers.tasks.stream`).

The task key may be the schema's task key column or a single-hot sparse field (a user
id field, say): then its ids are copied into a new int64 task column (``task_column``,
default ``"task"``). A previous task key column that is not the new key is dropped.

Any Parquet file is read through a ``[data.schema]`` mapping (``schema``), the decode
path training uses (:mod:`recaccel.io.format.mapping`): string categoricals are hashed
as the mapping says, a string task key becomes its 63-bit hash
(:func:`recaccel.io.format.grouping.task_id`; the output's grouped claim records
``key_hash = "string63"``, and ``task_keys.csv`` beside the files lists each key with
its id), and the output is a recaccel dataset needing no mapping.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from recaccel.config import SchemaMapping
from recaccel.errors import ConfigError
from recaccel.io.format.columns import Columns
from recaccel.io.format.dataset import DatasetInfo, RowGroupReader, RowGroupRef, open_dataset
from recaccel.io.format.decode import Policies, Projection, new_decode_stats
from recaccel.io.format.grouping import TASK_ID_BUCKETS, grouped_schema, task_order
from recaccel.io.format.id_hash import hash_strings
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.format.writer import DatasetWriter

logger = logging.getLogger(__name__)

_MIN_MERGE_ROWS = 1024
TASK_KEYS_FILE = "task_keys.csv"  # beside the grouped files: task_id,key of string keys


def writer_columns(cols: Columns, schema: FeatureSchema, keys: np.ndarray, times: np.ndarray | None) -> dict:
    """Rows of ``cols`` as the ``columns`` mapping of :class:`DatasetWriter` for ``schema``.

    ``cols`` must hold every dense and sparse feature of ``schema`` (in schema order);
    ``keys`` / ``times`` (int64 [n]) fill the task key and timestamp columns.
    """
    out: dict = {schema.label: cols.labels}
    out.update({name: np.ascontiguousarray(cols.dense[:, j]) for j, name in enumerate(schema.dense)})
    for f, sf in enumerate(schema.sparse):
        out[sf.name] = (cols.values[f], cols.offsets[f]) if sf.multi_hot else cols.values[f]
    out[schema.task_key] = keys
    if schema.timestamp is not None:
        out[schema.timestamp] = times
    return out


@dataclass
class GroupReport:
    """What :func:`group_by_task` wrote.

    Attributes:
        src: the source dataset.
        out_dir: the grouped dataset directory.
        task_key: the output task key column.
        timestamp: the output timestamp column (None: rows of a task keep source order).
        rows: rows written.
        tasks: distinct task keys.
        runs: sorted runs spilled to disk (0: sorted in memory).
        max_rows_in_memory: high-water mark of rows held at once.
        paths: files written.
        schema: the output schema.
        task_keys: the ``task_id,key`` CSV of a string task key (None: integer keys).
    """

    src: str
    out_dir: str
    task_key: str
    timestamp: str | None
    rows: int
    tasks: int
    runs: int
    max_rows_in_memory: int
    paths: list[str]
    schema: FeatureSchema
    task_keys: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _KeySource:
    """Extracts the (task key, timestamp) of decoded rows of the source."""

    def __init__(
        self,
        schema: FeatureSchema,
        task_key: str,
        timestamp: str | None,
        task_column: str | None,
        key_hash: str | None = None,
    ):
        single = {f.name: i for i, f in enumerate(schema.sparse) if not f.multi_hot}
        if task_key == schema.task_key:
            self.field = None
            out_key = task_key
        elif task_key in single:
            self.field = single[task_key]
            out_key = task_column or "task"
        else:
            valid = sorted([*single, *([schema.task_key] if schema.task_key else [])])
            raise ConfigError(
                f"task key {task_key!r} is neither the schema's task key column nor a single-hot "
                f"sparse field (valid: {valid})"
            )
        if timestamp is None:
            timestamp = schema.timestamp
        elif timestamp != schema.timestamp:
            raise ConfigError(
                f"timestamp {timestamp!r} is not the schema's timestamp column ({schema.timestamp!r})"
            )
        self.task_key = task_key
        self.timestamp = timestamp
        self.side = tuple(c for c in (schema.task_key, schema.timestamp) if c is not None)
        # source=None: a mapped source is written in recaccel's own column types.
        base = dataclasses.replace(schema, task_key=None, timestamp=None, source=None)
        taken = set(base.column_names())
        if out_key in taken:
            raise ConfigError(f"task column name {out_key!r} is already a column; pass another task_column")
        self.out_schema = grouped_schema(base, out_key, timestamp, key_hash if self.field is None else None)

    def keys(self, cols: Columns) -> tuple[np.ndarray, np.ndarray | None]:
        keys = cols.side[self.task_key] if self.field is None else cols.values[self.field]
        times = cols.side[self.timestamp] if self.timestamp is not None else None
        return keys, times


def group_by_task(
    src: str | Path,
    out_dir: str | Path,
    *,
    task_key: str,
    timestamp: str | None = None,
    rows_per_row_group: int = 8192,
    rows_per_file: int | None = None,
    memory_rows: int = 1_000_000,
    task_column: str | None = None,
    policies: Policies | None = None,
    overwrite: bool = False,
    tmp_dir: str | Path | None = None,
    compression: str = "snappy",
    progress: bool = False,
    schema: SchemaMapping | None = None,
) -> GroupReport:
    """Rewrites ``src`` as ``out_dir/part-*.parquet`` sorted by task key, then timestamp.

    Args:
        src: a recaccel ``.parquet`` file or directory (any Parquet with ``schema``).
        out_dir: output directory (must differ from the source directory).
        task_key: the schema's task key column or a single-hot sparse field.
        timestamp: the schema's timestamp column; None = the schema's timestamp if it
            has one (rows of a task are then in time order), else source order.
        rows_per_row_group: rows per output row group (the unit the task reader streams).
        rows_per_file: rows per output file; None = one file.
        memory_rows: rows sorted in memory at once (the size of a spilled run).
        task_column: name of the new task column when ``task_key`` is a sparse field.
        policies: bad-value policies for reading the source (default: error).
        overwrite: replace existing part files in ``out_dir``.
        tmp_dir: where sorted runs are spilled (default: inside ``out_dir``); removed after.
        progress: show a progress bar over the rows read (and, when runs are spilled,
            over the rows merged).
        compression: Parquet codec of the written files (``snappy``, ``lz4``, ``zstd``,
            ``gzip``, ``none``; see :mod:`recaccel.io.format.writer`).
        schema: a ``[data.schema]`` mapping (``cfg.data.schema``) for files written without
            recaccel metadata; the output is then a recaccel dataset (no mapping needed).

    Returns:
        The report (rows, tasks, runs, files, output schema).

    Raises:
        ConfigError: on bad arguments.
        DataError: as :func:`open_dataset` and the row-group reader do for bad input.
    """
    if rows_per_row_group < 1 or memory_rows < 1:
        raise ConfigError(
            f"rows_per_row_group and memory_rows must be >= 1, got {rows_per_row_group} and {memory_rows}"
        )
    info = open_dataset(src, schema)
    src_dir = Path(src) if Path(src).is_dir() else Path(src).parent
    if src_dir.resolve() == Path(out_dir).resolve():
        raise ConfigError(f"out_dir {out_dir} is the source directory; write the grouped copy elsewhere")
    ks = _KeySource(info.schema, task_key, timestamp, task_column, _key_hash(info, task_key))
    stats = new_decode_stats()
    reader = RowGroupReader(
        info.schema, Projection.select(info.schema, None, ks.side), policies or Policies(), stats
    )
    spills = info.num_rows > memory_rows
    bar = tqdm(
        total=info.num_rows * (2 if spills else 1), unit="rows", desc="group by task", disable=not progress
    )
    out = _Sink(
        DatasetWriter(
            out_dir,
            ks.out_schema,
            rows_per_row_group,
            rows_per_file,
            overwrite=overwrite,
            compression=compression,
        ),
        bar if spills else None,
    )
    runs = 0
    try:
        if not spills:
            parts = []
            for ref in info.row_groups:
                parts.append(reader.read(ref))
                bar.update(ref.num_rows)
            if parts:
                cols = Columns.concat(parts)
                out.high(cols.num_rows)
                out.write_sorted(cols, *ks.keys(cols))
        else:
            work = Path(tempfile.mkdtemp(prefix=".recaccel-sort-", dir=tmp_dir or out_dir))
            try:
                fan_in, merge_rows = merge_plan(-(-info.num_rows // memory_rows), memory_rows)
                run_dirs = _spill_runs(info.row_groups, reader, ks, memory_rows, merge_rows, work, out, bar)
                runs = len(run_dirs)
                _merge_passes(run_dirs, ks.out_schema, out, fan_in, merge_rows, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        paths = out.writer.close()
    except BaseException:
        out.writer.abort()
        raise
    finally:
        reader.close()
        bar.close()
    if stats["rows_skipped"]:
        logger.warning("group_by_task: %d bad source rows skipped (policy)", stats["rows_skipped"])
    task_keys = None
    if _key_hash(info, task_key):
        task_keys = _write_task_keys(info, task_key, Path(out_dir))
    elif overwrite:  # a key table of the data replaced would name other tasks
        (Path(out_dir) / TASK_KEYS_FILE).unlink(missing_ok=True)
    return GroupReport(
        src=str(src),
        out_dir=str(out_dir),
        task_key=ks.out_schema.task_key,
        timestamp=ks.timestamp,
        rows=out.rows,
        tasks=out.tasks,
        runs=runs,
        max_rows_in_memory=out.max_rows,
        paths=[str(p) for p in paths],
        schema=ks.out_schema,
        task_keys=task_keys,
    )


def _key_hash(info: DatasetInfo, task_key: str) -> str | None:
    """``"string63"`` when a mapped source's task key column holds strings (read from the
    first file's footer), so the grouped claim says its ids are
    :func:`~recaccel.io.format.grouping.task_id` hashes."""
    if info.schema.source is None or task_key != info.schema.task_key or not info.files:
        return None
    typ = pq.read_schema(info.files[0]).field(task_key).type
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return None if pa.types.is_integer(typ) else "string63"


def _write_task_keys(info: DatasetInfo, task_key: str, out_dir: Path) -> str:
    """Writes ``out_dir/task_keys.csv``: each distinct string key of the source and its
    task id, by id, so a task id in predictions leads back to its key. Reads the key
    column alone; holds one entry per distinct key."""
    keys: set = set()
    for path in info.files:
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            col = pf.read_row_group(g, columns=[task_key]).column(0).combine_chunks()
            if pa.types.is_dictionary(col.type):
                col = col.dictionary_decode()
            keys.update(v for v in pc.unique(col).to_pylist() if v is not None)
    names = pa.array(
        sorted(keys), pa.binary() if keys and isinstance(next(iter(keys)), bytes) else pa.string()
    )
    ids = hash_strings(names, TASK_ID_BUCKETS)
    order = np.argsort(ids, kind="stable")
    table = pa.table({"task_id": pa.array(ids[order]), "key": names.take(pa.array(order))})
    target = out_dir / TASK_KEYS_FILE
    tmp = target.with_name(target.name + ".tmp")
    pa_csv.write_csv(table, tmp)
    tmp.replace(target)
    return str(target)


class _Sink:
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


def _spill_runs(
    refs: tuple[RowGroupRef, ...],
    reader: RowGroupReader,
    ks: _KeySource,
    memory_rows: int,
    merge_rows: int,
    work: Path,
    out: _Sink,
    bar: tqdm,
) -> list[Path]:
    """Writes sorted runs of at most ``memory_rows`` rows (or one row group) under ``work``;
    ``bar`` advances by the rows read."""
    run_dirs: list[Path] = []

    def spill(parts: list[Columns]) -> None:
        cols = Columns.concat(parts)
        out.high(cols.num_rows)
        run_dir = work / f"run-{len(run_dirs):05d}"
        sink = _Sink(DatasetWriter(run_dir, ks.out_schema, merge_rows, prefix="run"))
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


def _merge_passes(
    run_dirs: list[Path], schema: FeatureSchema, out: _Sink, fan_in: int, merge_rows: int, work: Path
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
            sink = _Sink(DatasetWriter(run_dir, schema, merge_rows, prefix="run"))
            _merge(group, schema, sink)
            sink.writer.close()
            out.high(sink.max_rows)
            for done in group:
                shutil.rmtree(done, ignore_errors=True)
            merged.append(run_dir)
        run_dirs = merged
    _merge(run_dirs, schema, out)


def _merge(run_dirs: list[Path], schema: FeatureSchema, out: _Sink) -> None:
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

"""The rewrite itself: :func:`group_by_task` reads a dataset, sorts it by task key through
the external merge sort of :mod:`~recaccel.io.convert.group_by_task.merge`, and writes it
with the grouped claim; string task keys are listed beside the files."""

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
from recaccel.io.convert.group_by_task.merge import Sink, merge_passes, merge_plan, spill_runs
from recaccel.io.convert.group_by_task.sort_keys import KeySource
from recaccel.io.format.columns import Columns
from recaccel.io.format.dataset import DatasetInfo, RowGroupReader, open_dataset
from recaccel.io.format.decode import Policies, Projection, new_decode_stats
from recaccel.io.format.grouping import TASK_ID_BUCKETS
from recaccel.io.format.id_hash import hash_strings
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.format.writer import DatasetWriter

logger = logging.getLogger(__name__)

TASK_KEYS_FILE = "task_keys.csv"  # beside the grouped files: task_id,key of string keys


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
    ks = KeySource(info.schema, task_key, timestamp, task_column, _key_hash(info, task_key))
    stats = new_decode_stats()
    reader = RowGroupReader(
        info.schema, Projection.select(info.schema, None, ks.side), policies or Policies(), stats
    )
    spills = info.num_rows > memory_rows
    bar = tqdm(
        total=info.num_rows * (2 if spills else 1), unit="rows", desc="group by task", disable=not progress
    )
    out = Sink(
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
                run_dirs = spill_runs(info.row_groups, reader, ks, memory_rows, merge_rows, work, out, bar)
                runs = len(run_dirs)
                merge_passes(run_dirs, ks.out_schema, out, fan_in, merge_rows, work)
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

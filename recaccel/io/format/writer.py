"""Writing recaccel Parquet datasets: ``part-00000.parquet``, ``part-00001.parquet``, ...

Every file has the schema's Arrow schema (so the :class:`FeatureSchema` travels in its
metadata), row groups of ``rows_per_row_group`` rows (the last one of a file may be
shorter) and page CRC checksums, which the reader verifies so that corrupted pages
are an error rather than silent garbage. A file is written under a ``.tmp`` name and
renamed when complete, so a reader never sees a half-written file.

Task-aligned row groups. When the schema has a task key, a row group ends at the last
task boundary (change of key) within ``rows_per_row_group`` rows, so a task spans row
groups only if it alone is longer than a row group or the data arrives unsorted, and a
file ends before a row group that could take it past ``rows_per_file``. The task reader
then decodes every row group once per pass instead of decoding the next one again to
complete a task. Row groups and files never exceed their sizes.

Column data convention (``columns`` maps every schema column name to its data):

- label, dense, single-hot, task key, timestamp: a 1-D numpy array or sequence, or a
  pyarrow Array / ChunkedArray (which may hold nulls);
- multi-hot: a pair ``(values, offsets)`` of numpy arrays in the per-field CSR layout
  of :class:`~recaccel.sparse.SparseFeatures` (``values`` int [N], ``offsets`` int
  [n+1] starting at 0: row i is ``values[offsets[i]:offsets[i+1]]``), or a pyarrow
  ListArray, or a sequence of lists.

The writer checks structure (names, lengths, types) but not values: the reader's
policies decide what bad values mean. One exception: ids are stored as int32 where the
field's cardinality fits (:meth:`~recaccel.io.format.schema.SparseField.arrow_type`), so
an id beyond int32's range (invalid for such a field whatever the policy) is refused
with a :class:`DataError` naming the column and the id rather than wrapped. Id columns
with large vocabularies are written without dictionary pages (faster to decode).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recaccel.config import ParquetCodec, choices
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.schema import FeatureSchema


class DatasetWriter:
    """Streams rows into a directory of Parquet files with bounded memory.

    Holds at most one row group of pending rows beyond what one ``write`` call passes.
    Usable as a context manager; on an exception the file in progress is discarded.

    Args:
        out_dir: directory to write (created if missing).
        schema: the dataset schema.
        rows_per_row_group: rows per Parquet row group (the unit a reader streams).
        rows_per_file: start a new file after this many rows; None = one file.
        prefix: file name prefix.
        overwrite: delete existing ``{prefix}-*.parquet`` files first instead of failing.
        compression: Parquet codec, one of :data:`recaccel.config.ParquetCodec`. ``snappy`` (default)
            is the most widely readable. With int64 ids ``lz4`` decoded about twice as
            fast (bench/results/io_lz4.md); with the int32 ids written since, snappy and
            lz4 read at the same speed and ``none`` ~1.3x faster (criteo_1hot schema).
        align_tasks: with a task key in the schema, end row groups at task boundaries
            (module docstring); False = cut every ``rows_per_row_group`` rows.

    Raises:
        DataError: if ``out_dir`` already holds ``{prefix}-*.parquet`` files and not
            ``overwrite``.
    """

    def __init__(
        self,
        out_dir: str | Path,
        schema: FeatureSchema,
        rows_per_row_group: int = 8192,
        rows_per_file: int | None = None,
        *,
        prefix: str = "part",
        overwrite: bool = False,
        compression: str = "snappy",
        align_tasks: bool = True,
    ) -> None:
        if rows_per_row_group <= 0:
            raise ValueError(f"rows_per_row_group must be > 0, got {rows_per_row_group}")
        if rows_per_file is not None and rows_per_file <= 0:
            raise ValueError(f"rows_per_file must be > 0 or None, got {rows_per_file}")
        if compression not in choices(ParquetCodec):
            raise ConfigError(
                f"compression must be one of {', '.join(choices(ParquetCodec))}, got {compression!r}"
            )
        self.out_dir = Path(out_dir)
        self.schema = schema
        self.rows_per_row_group = rows_per_row_group
        self.rows_per_file = rows_per_file
        self.prefix = prefix
        self.compression = compression
        self._arrow_schema = schema.arrow_schema()
        plain = {f.name for f in schema.sparse if not f.dictionary_encoded()}
        self._dictionary_columns = [c for c in schema.column_names() if c not in plain]
        self._aligned = align_tasks and schema.task_key is not None
        # A file ends once it holds this many rows. Aligned files end before a full row
        # group could overflow them, so the file limit never cuts a row group mid-task.
        self._file_limit = (
            None
            if rows_per_file is None
            else max(rows_per_file - (rows_per_row_group if self._aligned else 0), 1)
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.out_dir.glob(f"{prefix}-*.parquet"))
        if existing and not overwrite:
            raise DataError(
                "file already exists; pass overwrite=True to replace the dataset", path=str(existing[0])
            )
        for p in existing:
            p.unlink()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._tmp_path: Path | None = None
        self._rows_in_file = 0
        self._paths: list[Path] = []
        self._closed = False

    @property
    def paths(self) -> list[Path]:
        """Files completed so far."""
        return list(self._paths)

    def write(self, columns: Mapping[str, Any]) -> None:
        """Appends rows; ``columns`` maps every schema column to n values (module docstring).

        Raises:
            DataError: naming a missing, unknown, mistyped or wrong-length column.
        """
        if self._closed:
            raise ValueError("DatasetWriter is closed")
        table = self._to_table(columns)
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self._drain(final=False)

    def close(self) -> list[Path]:
        """Flushes pending rows, finishes the last file and returns every file written.

        A dataset with no rows still gets one (empty) file, so it carries its schema.
        """
        if self._closed:
            return self.paths
        self._drain(final=True)
        if self._writer is None and not self._paths:
            self._open_file()
        self._finish_file()
        self._closed = True
        return self.paths

    def abort(self) -> None:
        """Discards the file in progress (completed files stay)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._tmp_path is not None and self._tmp_path.exists():
            self._tmp_path.unlink()
        self._tmp_path = None
        self._closed = True

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _drain(self, final: bool) -> None:
        rg = self.rows_per_row_group
        # Strictly more than a row group pending: the row after it shows whether a task
        # continues past the cut, whatever the sizes of the writes.
        while self._pending_rows > rg or (final and self._pending_rows > 0):
            room = rg if self.rows_per_file is None else min(rg, self.rows_per_file - self._rows_in_file)
            n = min(room, self._pending_rows)
            if self._aligned and n < self._pending_rows:
                n = self._last_task_boundary(n)
            chunk = self._pop_pending(n)
            if self._writer is None:
                self._open_file()
            self._writer.write_table(chunk, row_group_size=n)
            self._rows_in_file += n
            if self._file_limit is not None and self._rows_in_file >= self._file_limit:
                self._finish_file()

    def _last_task_boundary(self, n: int) -> int:
        """The largest cut ``1 <= i <= n`` between two tasks of the pending rows; ``n``
        when the first task alone runs past ``n`` rows."""
        parts, rows = [], 0
        for table in self._pending:  # the key column of the first n + 1 pending rows
            take = min(table.num_rows, n + 1 - rows)
            parts.append(table.column(self.schema.task_key).slice(0, take).to_numpy())
            rows += take
            if rows > n:
                break
        keys = np.concatenate(parts)
        cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1  # i: rows i-1 and i differ
        return int(cuts[-1]) if cuts.size else n

    def _pop_pending(self, n: int) -> pa.Table:
        table = pa.concat_tables(self._pending) if len(self._pending) > 1 else self._pending[0]
        head, rest = table.slice(0, n), table.slice(n)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows
        return head

    def _open_file(self) -> None:
        final = self.out_dir / f"{self.prefix}-{len(self._paths):05d}.parquet"
        self._tmp_path = final.with_name(final.name + ".tmp")
        self._writer = pq.ParquetWriter(
            str(self._tmp_path),
            self._arrow_schema,
            compression=self.compression,
            write_page_checksum=True,
            use_dictionary=self._dictionary_columns,
        )
        self._rows_in_file = 0

    def _finish_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        final = self._tmp_path.with_name(self._tmp_path.name[: -len(".tmp")])
        os.replace(self._tmp_path, final)
        self._paths.append(final)
        self._writer = None
        self._tmp_path = None
        self._rows_in_file = 0

    def _to_table(self, columns: Mapping[str, Any]) -> pa.Table:
        names = [f.name for f in self._arrow_schema]
        unknown = sorted(set(columns) - set(names))
        if unknown:
            raise DataError(f"column is not in the schema (columns: {names})", column=unknown[0])
        multi_hot = {f.name for f in self.schema.sparse if f.multi_hot}
        arrays = []
        for fld in self._arrow_schema:
            if fld.name not in columns:
                raise DataError("column is missing from the data to write", column=fld.name)
            arrays.append(_to_arrow(columns[fld.name], fld, fld.name in multi_hot))
        lengths = {len(a) for a in arrays}
        if len(lengths) > 1:
            detail = ", ".join(f"{f.name}={len(a)}" for f, a in zip(self._arrow_schema, arrays))
            raise DataError(f"columns have different lengths: {detail}", column=self._arrow_schema[0].name)
        return pa.Table.from_arrays(arrays, schema=self._arrow_schema)


def write_parquet(
    out_dir: str | Path,
    schema: FeatureSchema,
    columns: Mapping[str, Any],
    *,
    rows_per_row_group: int = 8192,
    rows_per_file: int | None = None,
    prefix: str = "part",
    overwrite: bool = False,
    align_tasks: bool = True,
    compression: str = "snappy",
) -> list[Path]:
    """Writes in-memory columns as a recaccel dataset (see :class:`DatasetWriter`).

    Returns:
        The files written, in order.
    """
    with DatasetWriter(
        out_dir,
        schema,
        rows_per_row_group,
        rows_per_file,
        prefix=prefix,
        overwrite=overwrite,
        align_tasks=align_tasks,
        compression=compression,
    ) as writer:
        writer.write(columns)
    return writer.paths


def _to_arrow(data: Any, fld: pa.Field, multi_hot: bool) -> pa.Array:
    """Converts one column's data to an Arrow array of the field's type."""
    try:
        if isinstance(data, (pa.Array, pa.ChunkedArray)):
            return _cast_arrow(data, fld)
        if multi_hot and isinstance(data, tuple) and len(data) == 2:
            return _csr_to_list(np.asarray(data[0]), np.asarray(data[1]), fld)
        arr = np.asarray(data) if not multi_hot else None
        if arr is None or arr.dtype == object:
            return pa.array(list(data), type=fld.type)
        if arr.ndim != 1:
            raise DataError(f"expected a 1-D array, got shape {arr.shape}", column=fld.name)
        if pa.types.is_integer(fld.type) and arr.dtype.kind not in "iu":
            raise DataError(f"expected integer ids, got dtype {arr.dtype}", column=fld.name)
        if pa.types.is_integer(fld.type):
            _check_ids_fit(arr, fld.type, fld.name)
        return pa.array(arr.astype(fld.type.to_pandas_dtype(), copy=False), type=fld.type)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise DataError(f"cannot convert to {fld.type}: {e}", column=fld.name) from None


def _csr_to_list(values: np.ndarray, offsets: np.ndarray, fld: pa.Field) -> pa.Array:
    if values.ndim != 1 or offsets.ndim != 1 or offsets.shape[0] < 1:
        raise DataError("(values, offsets) must be 1-D with len(offsets) = rows + 1", column=fld.name)
    if values.dtype.kind not in "iu" or offsets.dtype.kind not in "iu":
        raise DataError(
            f"ids and offsets must be integers, got {values.dtype} and {offsets.dtype}", column=fld.name
        )
    if offsets[0] != 0 or offsets[-1] != values.shape[0] or np.any(np.diff(offsets) < 0):
        raise DataError(
            f"offsets must start at 0, be non-decreasing and end at len(values)={values.shape[0]}",
            column=fld.name,
        )
    if offsets[-1] > np.iinfo(np.int32).max:
        raise DataError("more than 2**31-1 ids in one write call; write in smaller chunks", column=fld.name)
    _check_ids_fit(values, fld.type.value_type, fld.name)
    ids = values.astype(fld.type.value_type.to_pandas_dtype(), copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids))


def _cast_arrow(data: pa.Array | pa.ChunkedArray, fld: pa.Field) -> pa.Array | pa.ChunkedArray:
    """An Arrow column cast to the field's type; ids beyond the stored integer type are
    refused naming the first of them (Arrow's safe cast raises rather than wraps)."""
    try:
        return data.cast(fld.type)
    except pa.ArrowInvalid:
        ints = fld.type.value_type if pa.types.is_list(fld.type) else fld.type
        if not pa.types.is_integer(ints):
            raise
        flat = data.combine_chunks() if isinstance(data, pa.ChunkedArray) else data
        flat = flat.flatten() if pa.types.is_list(flat.type) else flat
        if not pa.types.is_integer(flat.type):
            raise
        _check_ids_fit(flat.drop_null().to_numpy(), ints, fld.name)
        raise


def _check_ids_fit(values: np.ndarray, stored: pa.DataType, column: str) -> None:
    """Raises :class:`DataError` naming an id that ``stored`` cannot hold."""
    target = np.dtype(stored.to_pandas_dtype())
    if values.size == 0 or values.dtype.kind not in "iu" or np.can_cast(values.dtype, target, "safe"):
        return
    info = np.iinfo(target)
    # Python ints compare uint64 and int64 values exactly.
    lo, hi = int(values.min()), int(values.max())
    if info.min <= lo and hi <= info.max:
        return
    bad = lo if lo < info.min else hi
    raise DataError(
        f"id {bad} does not fit the column's {stored} storage (every valid id of the field "
        "does); hash or map ids into 0..cardinality-1 before writing",
        column=column,
    )

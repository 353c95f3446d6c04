"""Every row's task key, read raw from a row group's Parquet key column.

The task reader's row-group index (``recaccel.io.readers.tasks.stream.key_index``) needs
the key of every row, including rows a read policy later drops, and the cache build
records the same keys so that index can be rebuilt from a cache. Both read them here,
so both see the same values and raise the same errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recaccel.errors import DataError
from recaccel.io.format.dataset import READ_ERRORS, read_error_text


class _Ref(Protocol):
    """A row group as the readers name it (``RowGroupRef``)."""

    path: Path
    row_group: int
    num_rows: int


class KeyColumnReader:
    """Reads the task key column of row groups, keeping each file open until :meth:`close`.

    Args:
        column: the task key column.
    """

    def __init__(self, column: str) -> None:
        self.column = column
        self._files: dict[Path, pq.ParquetFile] = {}

    def read(self, ref: _Ref) -> np.ndarray:
        """The keys of every row of ``ref`` (the footer's row count of them).

        Raises:
            DataError: naming file, row group and column: an unreadable footer or key
                column, a null key, a key that is not an integer, or fewer values than rows.
        """
        try:
            pf = self._files.get(ref.path)
            if pf is None:
                pf = self._files[ref.path] = pq.ParquetFile(str(ref.path), page_checksum_verification=True)
            return _read_keys(pf, ref, self.column)
        except READ_ERRORS as e:
            where = dict(path=str(ref.path), row_group=ref.row_group, column=self.column)
            raise DataError(f"cannot read the task key: {read_error_text(e)}", **where) from None

    def close(self) -> None:
        """Closes the open files."""
        for pf in self._files.values():
            pf.close()
        self._files.clear()


def _read_keys(pf: pq.ParquetFile, ref: _Ref, column: str) -> np.ndarray:
    arr = pf.read_row_group(ref.row_group, columns=[column]).column(0)
    where = dict(path=str(ref.path), column=column, row_group=ref.row_group)
    if len(arr) != ref.num_rows:  # a damaged file can decode to fewer values
        raise DataError(f"the task key has {len(arr)} values, the footer says {ref.num_rows} rows", **where)
    if arr.null_count:
        raise DataError("null task key", **where)
    if not pa.types.is_integer(arr.type):  # a mapped string key: its ids are hashes, unsorted here
        raise DataError(
            f"the task key holds {arr.type} values, not task ids sorted by value: group the files first "
            "with recaccel-data tasks SRC OUT --config (the same [data.schema]), then train on OUT",
            **where,
        )
    return arr.to_numpy()

"""Reading row groups out of a pre-decoded cache: the Parquet reader's Columns, mapped.

:class:`CachedRowGroupReader` has the row-group reader's interface (``read(ref)``,
``stats``, ``close()``): ``read`` returns the :class:`Columns` the Parquet reader
returns for the same row group under the same policies (views of the memory-mapped
column files, honouring the projection) and adds the counter increments the Parquet
read produced. Every slice it reads is checked against the CRC-32 the build recorded for
it (as the Parquet reader checks page checksums), and ids are range-checked per row group
(one min/max per field): a damaged file is an error, never different values.

:func:`cached_task_keys` gives the task reader's index every source row's task key, as
the build read them from Parquet.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from pathlib import Path
from typing import Protocol

import numpy as np

from recaccel.errors import ConfigError, DataError
from recaccel.io.format.cache.manifest import REBUILD, ColumnFile, Manifest, load_manifest
from recaccel.io.format.columns import Columns, id_dtype, single_hot_offsets
from recaccel.io.format.decode import Policies, Projection, add_counts
from recaccel.io.format.schema import FeatureSchema

logger = logging.getLogger(__name__)


class _Ref(Protocol):
    """A row group as the readers name it (``RowGroupRef``)."""

    path: Path
    row_group: int
    num_rows: int


def policy_mismatch(manifest: Manifest, policies: Policies) -> str | None:
    """Which read policy differs from the one the cache was built under (None: none)."""
    for key, wanted in dataclasses.asdict(policies).items():
        built = manifest.policies.get(key)
        if built != wanted:
            return f"data.{key} = {wanted!r} but the cache at {manifest.folder} was built with {built!r}"
    return None


class CachedRowGroupReader:
    """Row groups of a cache as validated :class:`Columns` (see the module docstring).

    Args:
        folder: the cache folder (its manifest is loaded and checked again).
        schema: the dataset schema (must equal the cache's).
        projection: the columns to return.
        policies: the read policies (must equal the cache's).
        stats: counters updated by every read.

    Raises:
        ConfigError: when a policy differs from the cache's.
        DataError: as :func:`load_manifest` does, or when the schema differs.
    """

    def __init__(
        self,
        folder: str | Path,
        schema: FeatureSchema,
        projection: Projection,
        policies: Policies,
        stats: dict[str, int],
    ) -> None:
        self.manifest = load_manifest(folder)
        mismatch = policy_mismatch(self.manifest, policies)
        if mismatch is not None:
            raise ConfigError(f"{mismatch}; set it back or {REBUILD}")
        if schema != self.manifest.schema:
            raise DataError(f"the reader's schema differs from the cache's; {REBUILD}", path=str(folder))
        _check_projection(self.manifest, schema, projection)
        self.schema = schema
        self.projection = projection
        self.policies = policies
        self.stats = stats
        self._index = {(g.path, g.row_group): i for i, g in enumerate(self.manifest.row_groups)}
        self._dense_cols = _dense_columns(schema, projection)
        self._id_dtype = (
            np.result_type(*(id_dtype(f.cardinality) for f in projection.sparse))
            if projection.sparse
            else None
        )
        self._maps: dict[str, np.ndarray] = {}
        self._starts = self._map("row_starts")
        self._crcs = self._map("checksums")
        if zlib.crc32(np.ascontiguousarray(self._crcs)) != self.manifest.checksums_crc32:
            raise DataError(
                f"cache checksum file does not match its CRC-32 (damaged?); {REBUILD}",
                path=str(self.manifest.folder / self.manifest.columns["checksums"].file),
            )
        self._crc_of = {name: k for k, name in enumerate(self.manifest.checksum_columns)}

    def read(self, ref: _Ref) -> Columns:
        """The rows of ``ref`` as the Parquet reader decodes them, from the mapped files.

        Raises:
            DataError: naming file and row group when the cache does not hold it, or
                holds an id out of its table's range.
        """
        g = self._index.get((Path(ref.path), ref.row_group))
        if g is None:
            raise DataError(
                f"row group is not in the cache; {REBUILD}", path=str(ref.path), row_group=ref.row_group
            )
        start, stop = int(self._starts[g]), int(self._starts[g + 1])
        if not 0 <= start <= stop <= self._map("labels").shape[0]:
            raise DataError(
                f"cache row-start index is out of order; {REBUILD}", path=str(self.manifest.folder)
            )
        dense = self._checked("dense", self._map("dense")[start:stop], g)
        if self._dense_cols is not None:
            dense = np.ascontiguousarray(dense[:, self._dense_cols])
        values, offsets = [], []
        steps = single_hot_offsets(stop - start)
        for sf in self.projection.sparse:
            val, off = self._bag(sf.name, sf.multi_hot, start, stop, steps, g)
            _check_range(val, sf.cardinality, sf.name, ref)
            values.append(val)
            offsets.append(off)
        side = {
            name: self._checked(f"side:{name}", self._map(f"side:{name}")[start:stop], g)
            for name in self.projection.side
        }
        single = [not f.multi_hot for f in self.projection.sparse]
        keys = [f.name for f in self.projection.sparse]
        cols = Columns(
            dense,
            self._checked("labels", self._map("labels")[start:stop], g),
            keys,
            values,
            offsets,
            side,
            single,
            id_dtype=self._id_dtype,
        )
        self._count(self.manifest.row_groups[g].counters)
        return cols

    def close(self) -> None:
        """Drops the mapped files (arrays handed out keep theirs alive)."""
        self._maps.clear()

    def _bag(
        self, name: str, multi_hot: bool, start: int, stop: int, steps: np.ndarray, g: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, offsets) of rows ``start .. stop-1`` (row group ``g``) of one sparse field."""
        ids = self._map(f"ids:{name}")
        if not multi_hot:
            return self._checked(f"ids:{name}", ids[start:stop], g), steps
        off = self._map(f"offsets:{name}")[start : stop + 1]
        self._checked(f"offsets:{name}", off[1:], g)  # the row group's own; off[0] is the one before
        lo, hi = int(off[0]), int(off[-1])
        if not 0 <= lo <= hi <= ids.shape[0]:
            raise DataError(
                f"cache offsets of field {name!r} are out of order; {REBUILD}", path=str(self.manifest.folder)
            )
        return self._checked(f"ids:{name}", ids[lo:hi], g), off - lo

    def _checked(self, column: str, part: np.ndarray, g: int) -> np.ndarray:
        """``part``, row group ``g``'s slice of ``column``, once its CRC-32 matches the build's."""
        if zlib.crc32(part) != int(self._crcs[g, self._crc_of[column]]):
            ref = self.manifest.row_groups[g]
            raise DataError(
                f"cache column file {self.manifest.columns[column].file} does not match its CRC-32 "
                f"for this row group (damaged?); {REBUILD}",
                path=str(ref.path),
                row_group=ref.row_group,
                column=column.partition(":")[2] or column,
            )
        return part

    def _map(self, column: str) -> np.ndarray:
        """The column file ``column``, memory-mapped read-only (once per reader)."""
        arr = self._maps.get(column)
        if arr is None:
            col = self.manifest.columns.get(column)
            if col is None:
                raise DataError(f"cache has no column {column!r}; {REBUILD}", path=str(self.manifest.folder))
            arr = self._maps[column] = map_column(self.manifest.folder, col)
        return arr

    def _count(self, increments: dict[str, int]) -> None:
        """Adds a row group's recorded counters, warning on a first non-zero as decoding does."""
        first = [k for k, v in increments.items() if v and k != "rows_read" and not self.stats.get(k)]
        add_counts(self.stats, increments)
        for key in first:
            logger.warning("recaccel reader: %s (first occurrence; see the reader's counters)", key)


def map_column(folder: Path, col: ColumnFile) -> np.ndarray:
    """The column file ``col`` of the cache in ``folder``, memory-mapped read-only."""
    if col.nbytes == 0:  # an empty file cannot be mapped
        return np.zeros(col.shape, dtype=col.dtype)
    return np.asarray(np.memmap(folder / col.file, dtype=np.dtype(col.dtype), mode="r", shape=col.shape))


def cached_task_keys(folder: str | Path) -> list[np.ndarray]:
    """Every source row's task key, one int64 array per row group in the dataset's order
    (rows a policy dropped included), as the build read them from the Parquet key column.

    Raises:
        DataError: the line reading the source's keys raised at the build (the same as
            reading them from the source raises), or one naming a cache without keys or
            a key file that fails its checksum.
    """
    manifest = load_manifest(folder)
    if manifest.task_keys_error is not None:
        raise DataError(manifest.task_keys_error)
    col = manifest.columns.get("task_keys")
    if col is None:
        raise DataError(
            f"the cache holds no task keys (its dataset has no task key); {REBUILD}", path=str(folder)
        )
    keys = map_column(manifest.folder, col)
    if zlib.crc32(keys) != manifest.task_keys_crc32:
        raise DataError(
            f"cache column file does not match its CRC-32 (damaged?); {REBUILD}",
            path=str(manifest.folder / col.file),
        )
    starts = np.cumsum([0] + [g.rows for g in manifest.row_groups])
    return [keys[starts[g] : starts[g + 1]] for g in range(len(manifest.row_groups))]


def _check_projection(manifest: Manifest, schema: FeatureSchema, projection: Projection) -> None:
    """A subset of the columns is read as Parquet would only where no policy dropped or
    repaired a value: the cache's rows were kept or dropped looking at every column."""
    full = projection.dense == tuple(schema.dense) and projection.sparse == tuple(schema.sparse)
    acted = sorted({k for g in manifest.row_groups for k, v in g.counters.items() if v and k != "rows_read"})
    if not full and acted:
        raise ConfigError(
            f"the cache at {manifest.folder} was built dropping or repairing values ({', '.join(acted)}) "
            "looking at every column; reading a subset of its columns needs the Parquet source"
        )


def _dense_columns(schema: FeatureSchema, projection: Projection) -> list[int] | None:
    """Positions of the projected dense features among the schema's (None: all of them)."""
    if tuple(projection.dense) == tuple(schema.dense):
        return None
    return [schema.dense.index(name) for name in projection.dense]


def _check_range(ids: np.ndarray, cardinality: int, name: str, ref: _Ref) -> None:
    """Every id in ``[0, cardinality)``, checked with one min and one max."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= cardinality:
        bad = low if low < 0 else high
        raise DataError(
            f"cached id {bad} is out of range (valid ids are 0..{cardinality - 1}; damaged cache?); {REBUILD}",
            path=str(ref.path),
            row_group=ref.row_group,
            column=name,
        )

"""Building a pre-decoded cache: every row group of a Parquet dataset, decoded once.

:func:`build_cache` reads the source as the readers do (same schema resolution, the
given read policies, every dense and sparse feature plus the task key and timestamp)
and writes, in a temporary folder renamed into place at the end (an interrupted build
leaves nothing that reads as a cache):

- ``dense.f32``: float32 [N, Dd] row-major; ``labels.f32``: float32 [N];
- per sparse field ``ids.<j>``: its ids in the decoder's dtype (int32 where the table
  fits), and for a multi-hot field ``offsets.<j>``: int64 [N+1];
- per side column ``side.<k>``: int64 [N]; ``row_starts.i64``: int64 [G+1];
- with a task key, ``task_keys.i64``: int64 [R], every source row's key read raw from
  its Parquet column as the task reader's index reads it (rows a policy dropped too);
  where that read fails, no file but the error's line in the manifest;
- ``checksums.u32``: uint32 [G, W], the CRC-32 of each row group's slice of each of the W
  other column files (row starts and task keys aside);
- ``cache.json`` (see :mod:`recaccel.io.format.cache.manifest`).

N = rows kept, R = rows in the source's footers, G = non-empty row groups; every file is
little-endian.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm.auto import tqdm

from recaccel.config import SchemaMapping, UnreadableFilesPolicy
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.cache.manifest import (
    MANIFEST,
    CachedRowGroup,
    ColumnFile,
    Manifest,
    file_stamp,
    is_cache,
    manifest_json,
    mapping_text,
)
from recaccel.io.format.columns import Columns, id_dtype
from recaccel.io.format.dataset import RowGroupReader, open_dataset
from recaccel.io.format.decode import Policies, Projection, counter_increments, new_decode_stats
from recaccel.io.format.schema import FeatureSchema
from recaccel.io.format.task_keys import KeyColumnReader


@dataclass(frozen=True)
class CacheReport:
    """What a build wrote: rows, row groups, bytes of column files, seconds."""

    path: str
    rows: int
    row_groups: int
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class _ColumnWriter:
    """Appends arrays to one raw little-endian file, counting its elements and keeping the
    CRC-32 of each appended row group's bytes."""

    def __init__(self, folder: Path, file: str, dtype: np.dtype, width: int | None = None) -> None:
        self.file = file
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.width = width
        self.length = 0
        self.crcs: list[int] = []
        self._out: BinaryIO = open(folder / file, "wb")  # noqa: SIM115 (closed by close())

    def append(self, arr: np.ndarray, row_group: bool = True) -> None:
        """Appends ``arr``; ``row_group``: it is a row group's slice (its CRC-32 kept)."""
        data = np.ascontiguousarray(arr, dtype=self.dtype)
        self._out.write(data.tobytes())
        self.length += data.shape[0]
        if row_group:
            self.crcs.append(zlib.crc32(data))

    def close(self) -> ColumnFile:
        self._out.close()
        shape = (self.length,) if self.width is None else (self.length, self.width)
        return ColumnFile(self.file, self.dtype.str, shape)


class _Columns:
    """The column files of one build, fed one decoded row group at a time."""

    def __init__(self, folder: Path, schema: FeatureSchema, side: tuple[str, ...]) -> None:
        self.writers = {
            "dense": _ColumnWriter(folder, "dense.f32", np.float32, len(schema.dense)),
            "labels": _ColumnWriter(folder, "labels.f32", np.float32),
            "row_starts": _ColumnWriter(folder, "row_starts.i64", np.int64),
        }
        self.multi = {f.name: f.multi_hot for f in schema.sparse}
        for j, f in enumerate(schema.sparse):
            self.writers[f"ids:{f.name}"] = _ColumnWriter(folder, f"ids.{j}", id_dtype(f.cardinality))
            if f.multi_hot:
                self.writers[f"offsets:{f.name}"] = _ColumnWriter(folder, f"offsets.{j}", np.int64)
                self.writers[f"offsets:{f.name}"].append(np.zeros(1, dtype=np.int64), row_group=False)
        for k, name in enumerate(side):
            self.writers[f"side:{name}"] = _ColumnWriter(folder, f"side.{k}", np.int64)
        self.rows = 0
        self.writers["row_starts"].append(np.zeros(1, dtype=np.int64), row_group=False)
        self.folder = folder

    def append(self, cols: Columns) -> None:
        w = self.writers
        w["dense"].append(cols.dense)
        w["labels"].append(cols.labels)
        for key, val, off in zip(cols.keys, cols.values, cols.offsets):
            ids = w[f"ids:{key}"]
            if self.multi[key]:
                w[f"offsets:{key}"].append(np.asarray(off[1:], dtype=np.int64) + ids.length)
            ids.append(val)
        for name, col in cols.side.items():
            w[f"side:{name}"].append(col)
        self.rows += cols.num_rows
        w["row_starts"].append(np.array([self.rows], dtype=np.int64), row_group=False)

    def close(self) -> tuple[dict[str, ColumnFile], tuple[str, ...], int]:
        """The column files, the checksummed columns and the CRC-32 of ``checksums.u32``."""
        columns = {name: writer.close() for name, writer in self.writers.items()}
        names = tuple(name for name in self.writers if name != "row_starts")
        table = np.array([self.writers[n].crcs for n in names], dtype="<u4").T.reshape(-1, len(names))
        sums = _ColumnWriter(self.folder, "checksums.u32", np.uint32, len(names))
        sums.append(table, row_group=False)
        columns["checksums"] = sums.close()
        return columns, names, zlib.crc32(np.ascontiguousarray(table))


class _TaskKeys:
    """Every source row's task key, appended one row group at a time (see the module
    docstring); after a failed read, only the error's line."""

    def __init__(self, folder: Path, column: str) -> None:
        self.reader = KeyColumnReader(column)
        self.writer: _ColumnWriter | None = _ColumnWriter(folder, "task_keys.i64", np.int64)
        self.folder = folder
        self.error: str | None = None
        self.crc32 = 0

    def append(self, ref) -> None:
        if self.writer is None:
            return
        try:
            keys = np.ascontiguousarray(self.reader.read(ref), dtype="<i8")
            self.writer.append(keys)
            self.crc32 = zlib.crc32(keys, self.crc32)
        except DataError as e:  # plain reading still works; task reading gets this line
            self.error = str(e)
            self.writer.close()
            (self.folder / self.writer.file).unlink()
            self.writer = None

    def close(self) -> dict[str, ColumnFile]:
        self.reader.close()
        return {} if self.writer is None else {"task_keys": self.writer.close()}


def build_cache(
    src: str | Path,
    dst: str | Path,
    *,
    schema: FeatureSchema | SchemaMapping | None = None,
    policies: Policies = Policies(),  # noqa: B008 (frozen)
    unreadable: UnreadableFilesPolicy = "warn",
    force: bool = False,
    progress: bool = False,
) -> CacheReport:
    """Decodes every row group of ``src`` into the cache folder ``dst``.

    Args:
        src: a ``.parquet`` file or a folder of them.
        dst: the cache folder to write (absent or empty, or replaced with ``force``).
        schema: expected schema or ``[data.schema]`` mapping; None = the files' own.
        policies: the read policies the cache's rows are decoded under (readers of
            the cache must use the same).
        unreadable: a folder's unreadable entries (``data.unreadable_files``).
        force: replace a non-empty ``dst``.
        progress: show a progress bar over the row groups.

    Raises:
        ConfigError: if ``src`` is a cache, or ``dst`` holds something and not ``force``.
        DataError: as the readers do for bad input (under an ``error`` policy).
    """
    start = time.perf_counter()
    dst = Path(dst)
    if is_cache(src):
        raise ConfigError(f"{src} is already a cache; give the Parquet dataset it was built from")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not force:
        raise ConfigError(f"cache folder {dst} already holds files (pass --force to replace it)")
    info = open_dataset(src, schema, unreadable)
    side = tuple(c for c in (info.schema.task_key, info.schema.timestamp) if c is not None)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = _decode_into(tmp, info, Projection.select(info.schema, None, side), policies, progress)
        manifest = dataclasses.replace(manifest, mapping=mapping_text(schema))
        (tmp / MANIFEST).write_text(manifest_json(manifest))
        _replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(col.nbytes for col in manifest.columns.values())
    rows = sum(g.kept for g in manifest.row_groups)
    return CacheReport(str(dst), rows, len(manifest.row_groups), size, round(time.perf_counter() - start, 3))


def _decode_into(folder: Path, info, projection: Projection, policies: Policies, progress: bool) -> Manifest:
    """Decodes ``info``'s row groups into column files in ``folder``; their manifest."""
    stats = new_decode_stats()
    reader = RowGroupReader(info.schema, projection, policies, stats)
    out = _Columns(folder, info.schema, projection.side)
    keys = _TaskKeys(folder, info.schema.task_key) if info.schema.task_key is not None else None
    groups = []
    stamps = {Path(f).resolve(): file_stamp(Path(f)) for f in info.files}
    try:
        bar = tqdm(info.row_groups, desc="cache", unit="row group", disable=not progress)
        for ref in bar:
            before = dict(stats)
            cols = reader.read(ref)
            out.append(cols)
            if keys is not None:
                keys.append(ref)
            delta = counter_increments(before, stats)
            groups.append(
                CachedRowGroup(Path(ref.path).resolve(), ref.row_group, ref.num_rows, cols.num_rows, delta)
            )
    finally:
        reader.close()
        columns, checksummed, checksums_crc = out.close()
        if keys is not None:
            columns.update(keys.close())
    policy = dataclasses.asdict(policies)
    error = keys.error if keys is not None else None
    crc = keys.crc32 if keys is not None and keys.writer is not None else None
    return Manifest(
        folder,
        info.schema,
        policy,
        None,
        stamps,
        tuple(groups),
        columns,
        error,
        crc,
        checksummed,
        checksums_crc,
    )


def _replace(tmp: Path, dst: Path) -> None:
    """Moves the finished ``tmp`` folder to ``dst``, replacing what ``dst`` held."""
    if dst.is_dir() and not any(dst.iterdir()):
        dst.rmdir()
    if dst.exists():
        old = dst.with_name(f".{dst.name}.{os.getpid()}.old")
        os.replace(dst, old)
        os.replace(tmp, dst)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        os.replace(tmp, dst)
    if not (dst / MANIFEST).is_file():  # pragma: no cover (a rename that lost the folder)
        raise DataError("cache folder lost its manifest while being moved into place", path=str(dst))

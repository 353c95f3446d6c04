"""The cache's manifest, ``cache.json``: what a pre-decoded dataset holds, and its checks.

A cache folder holds ``cache.json`` and one raw little-endian file per column (see
:mod:`recaccel.io.format.cache.build`). The manifest records the format version, the
schema, the read policies and the ``[data.schema]`` mapping the rows were decoded
under, the source files (size, mtime_ns) with their row groups (footer rows, kept
rows, the decode counters their Parquet read added), and each column file's dtype and
shape. A dataset with a task key also has ``task_keys``: every source row's key, those of
rows a policy dropped included (what the task reader's row-group index reads), with the
CRC-32 of its file (``task_keys_crc32``: a damaged key would move task boundaries, which
no range check sees), or, where they could not be read, the one-line error reading them
raised (``task_keys_error``). Every row group's slice of every column file (row starts
and task keys aside) has its CRC-32 in ``checksums`` (uint32 [G, W], columns in
``checksum_columns`` order; the file's own CRC-32 in ``checksums_crc32``), which a reader
verifies for each slice it reads, as the Parquet reader verifies page checksums: a flipped
bit is an error, never a different value. :func:`load_manifest` trusts none of it: a bad version, a
missing or truncated column file, or a source file changed since the build is one
:class:`DataError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recaccel.config import SchemaMapping
from recaccel.errors import DataError
from recaccel.io.format.schema import FeatureSchema

MANIFEST = "cache.json"
FORMAT = "recaccel-cache"
VERSION = 3  # 2: the task key of every source row (task reading); 3: row-group checksums
REBUILD = "rebuild it with recaccel-data cache"


@dataclass(frozen=True)
class ColumnFile:
    """One column file: its name in the cache folder, dtype (little-endian) and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * np.prod(self.shape, dtype=np.int64))

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class CachedRowGroup:
    """A source row group: its file, index, footer rows, rows kept and counter increments."""

    path: Path
    row_group: int
    rows: int
    kept: int
    counters: dict[str, int]


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked ``cache.json`` (see the module docstring).

    Attributes:
        folder: the cache folder.
        schema: the dataset schema (the mapping already applied).
        policies: the read policies, ``{"invalid_ids": ..., ...}``.
        mapping: the ``[data.schema]`` mapping as JSON text, or None.
        files: the source files as recorded: path -> (size, mtime_ns).
        row_groups: every non-empty source row group, in file order.
        columns: the column files by column name (``dense``, ``labels``, ``row_starts``,
            ``ids:<field>``, ``offsets:<field>``, ``side:<name>``, ``task_keys``).
        task_keys_error: why the source's task keys could not be recorded, or None.
        task_keys_crc32: the CRC-32 of the ``task_keys`` file, or None without one.
        checksum_columns: the columns of the ``checksums`` file, in its column order.
        checksums_crc32: the CRC-32 of the ``checksums`` file.
    """

    folder: Path
    schema: FeatureSchema
    policies: dict[str, str]
    mapping: str | None
    files: dict[Path, tuple[int, int]]
    row_groups: tuple[CachedRowGroup, ...]
    columns: dict[str, ColumnFile]
    task_keys_error: str | None = None
    task_keys_crc32: int | None = None
    checksum_columns: tuple[str, ...] = ()
    checksums_crc32: int = 0


def is_cache(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a cache manifest."""
    return (Path(path) / MANIFEST).is_file()


def mapping_text(schema: object) -> str | None:
    """A ``[data.schema]`` mapping as comparable JSON text (None for a schema or nothing)."""
    if not isinstance(schema, SchemaMapping):
        return None
    return json.dumps(dataclasses.asdict(schema), sort_keys=True, default=str)


def file_stamp(path: Path) -> tuple[int, int]:
    """(size, mtime_ns) of a file: what says it changed."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def manifest_json(manifest: Manifest) -> str:
    """The ``cache.json`` text of ``manifest``."""
    files = []
    for path, (size, mtime) in manifest.files.items():
        groups = [
            {"row_group": g.row_group, "rows": g.rows, "kept": g.kept, "counters": g.counters}
            for g in manifest.row_groups
            if g.path == path
        ]
        files.append({"path": str(path), "size": size, "mtime_ns": mtime, "row_groups": groups})
    raw = {
        "format": FORMAT,
        "version": VERSION,
        "schema": json.loads(manifest.schema.to_json()),
        "policies": manifest.policies,
        "mapping": manifest.mapping,
        "files": files,
        "columns": {name: col.to_json() for name, col in manifest.columns.items()},
        "task_keys_error": manifest.task_keys_error,
        "task_keys_crc32": manifest.task_keys_crc32,
        "checksum_columns": list(manifest.checksum_columns),
        "checksums_crc32": manifest.checksums_crc32,
    }
    return json.dumps(raw, indent=1)


def load_manifest(folder: str | Path) -> Manifest:
    """Reads and checks a cache's manifest and column files (see the module docstring).

    Raises:
        DataError: one line naming the file: unreadable or malformed ``cache.json``, an
            unknown format version, a missing or wrongly sized column file, or a source
            file that exists with another size or mtime than when the cache was built.
    """
    folder = Path(folder)
    where = str(folder / MANIFEST)
    try:
        raw = json.loads((folder / MANIFEST).read_text())
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DataError(f"not a recaccel cache manifest; {REBUILD}", path=where)
        if raw.get("version") != VERSION:
            raise DataError(
                f"cache format version {raw.get('version')!r}, this recaccel reads {VERSION}; {REBUILD}",
                path=where,
            )
        manifest = _parse(folder, raw)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(
            f"unreadable cache manifest ({type(e).__name__}: {e}); {REBUILD}", path=where
        ) from None
    _check_columns(manifest)
    _check_sources(manifest)
    return manifest


def _parse(folder: Path, raw: dict[str, Any]) -> Manifest:
    """The manifest of the JSON object ``raw`` (a KeyError or TypeError where it is malformed)."""
    schema = FeatureSchema.from_json(json.dumps(raw["schema"]), str(folder / MANIFEST))
    files, groups = {}, []
    for entry in raw["files"]:
        path = Path(entry["path"])
        files[path] = (int(entry["size"]), int(entry["mtime_ns"]))
        for g in entry["row_groups"]:
            counters = {str(k): int(v) for k, v in g["counters"].items()}
            groups.append(CachedRowGroup(path, int(g["row_group"]), int(g["rows"]), int(g["kept"]), counters))
    columns = {
        str(name): ColumnFile(
            str(c["file"]), str(np.dtype(c["dtype"]).str), tuple(int(s) for s in c["shape"])
        )
        for name, c in raw["columns"].items()
    }
    policies = {str(k): str(v) for k, v in raw["policies"].items()}
    mapping, error, crc = raw["mapping"], raw["task_keys_error"], raw["task_keys_crc32"]
    return Manifest(
        folder,
        schema,
        policies,
        None if mapping is None else str(mapping),
        files,
        tuple(groups),
        columns,
        None if error is None else str(error),
        None if crc is None else int(crc),
        tuple(str(c) for c in raw["checksum_columns"]),
        int(raw["checksums_crc32"]),
    )


def _check_columns(manifest: Manifest) -> None:
    """Every column file exists, has the recorded size and stays inside the folder."""
    for col in manifest.columns.values():
        path = manifest.folder / col.file
        if Path(col.file).name != col.file:
            raise DataError(
                f"column file name {col.file!r} is not a plain file name; {REBUILD}", path=str(path)
            )
        if not path.is_file():
            raise DataError(f"cache column file is missing; {REBUILD}", path=str(path))
        size = path.stat().st_size
        if size != col.nbytes:
            raise DataError(
                f"cache column file holds {size} bytes, the manifest says {col.nbytes} "
                f"({col.dtype} x {list(col.shape)}; truncated?); {REBUILD}",
                path=str(path),
            )
    rows = sum(g.kept for g in manifest.row_groups)
    starts = manifest.columns.get("row_starts")
    if starts is None or starts.shape != (len(manifest.row_groups) + 1,):
        raise DataError(
            f"cache row-start index does not match its row groups; {REBUILD}", path=str(manifest.folder)
        )
    for name in ("dense", "labels"):
        col = manifest.columns.get(name)
        if col is None or col.shape[0] != rows:
            raise DataError(
                f"cache column {name!r} does not hold {rows} rows; {REBUILD}", path=str(manifest.folder)
            )
    keys = manifest.columns.get("task_keys")
    source_rows = sum(g.rows for g in manifest.row_groups)
    if keys is not None and keys.shape != (source_rows,):
        raise DataError(
            f"cache column 'task_keys' does not hold the source's {source_rows} rows; {REBUILD}",
            path=str(manifest.folder),
        )


def _check_sources(manifest: Manifest) -> None:
    """A recorded source file that still exists must be as it was at the build."""
    for path, stamp in manifest.files.items():
        try:
            now = file_stamp(path)
        except OSError:
            continue  # gone: the cache stands alone
        if now != stamp:
            raise DataError(
                f"the source file {path} changed since the cache was built "
                f"(size, mtime_ns {stamp} then, {now} now); {REBUILD}",
                path=str(manifest.folder),
            )

"""Opening a Parquet dataset: footers only, plus a row-group reader.

:func:`open_dataset` reads nothing but file footers: the schema, every file's column
types and the row groups with their row counts. :class:`RowGroupReader` then decodes
one row group at a time into validated :class:`Columns` (used by the batch reader and
the Meta-IO task reader).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from recaccel.config import SchemaMapping, UnreadableFilesPolicy, choices
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.cache.manifest import MANIFEST, is_cache, load_manifest, mapping_text
from recaccel.io.format.cache.read import CachedRowGroupReader
from recaccel.io.format.columns import Columns
from recaccel.io.format.decode import Policies, Projection, row_group_to_columns
from recaccel.io.format.mapping import resolve_mapping
from recaccel.io.format.schema import FeatureSchema

logger = logging.getLogger(__name__)

# What pyarrow raises on a corrupt, truncated or unreadable file.
READ_ERRORS = (pa.ArrowException, OSError, ValueError)


def read_error_text(e: BaseException, limit: int = 300) -> str:
    """pyarrow's message about a damaged file as one printable line of at most ``limit``
    characters (its messages span lines and may quote raw bytes)."""
    text = " ".join(str(e).split())
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RowGroupRef(NamedTuple):
    """One row group: (file, index in the file, rows)."""

    path: Path
    row_group: int
    num_rows: int


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the footers of a dataset say.

    Attributes:
        schema: the dataset schema.
        files: the files, sorted by name.
        row_groups: every non-empty row group, in file order.
        cache: the pre-decoded cache folder the rows are read from, or None (Parquet).
    """

    schema: FeatureSchema
    files: tuple[Path, ...]
    row_groups: tuple[RowGroupRef, ...]
    cache: Path | None = dataclasses.field(default=None, compare=False)

    @property
    def num_rows(self) -> int:
        return sum(rg.num_rows for rg in self.row_groups)


def display_path(path: str | Path) -> str:
    """``path`` as printable text: bytes of a name that is not UTF-8 (which Python keeps as
    surrogates, and which cannot be printed) escaped as ``\\xff``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def unreadable_reason(path: Path) -> str | None:
    """Why ``path`` cannot be read as a Parquet file, or None if it can (checked without
    opening it: opening a FIFO would block until something writes to it)."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        return "has a name that is not UTF-8 (rename it)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "is a dangling symlink" if path.is_symlink() else "does not exist"
    except OSError as e:
        return "is a symlink loop" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"is not a regular file ({_file_kind(st.st_mode)})"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return None


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def list_files(path: str | Path, unreadable: UnreadableFilesPolicy = "warn") -> list[Path]:
    """A ``.parquet`` file itself, or the ``*.parquet`` files of a directory sorted by name.

    Args:
        path: a file or a folder.
        unreadable: a folder's ``*.parquet`` entries that cannot be read (see
            :func:`unreadable_reason`): ``"warn"`` skips them and logs one warning per
            folder and process, ``"error"`` refuses them (``data.unreadable_files``).

    Raises:
        DataError: if the path does not exist, is itself unreadable (a FIFO, a device, no
            permission, a name that is not UTF-8), the directory has no readable Parquet
            file, or has an unreadable one under ``"error"``.
    """
    p = Path(path)
    if p.is_dir():
        return _folder_files(p, unreadable)
    if not p.exists() and not p.is_symlink():
        raise DataError("no such file or directory", path=display_path(p))
    reason = unreadable_reason(p)
    if reason is not None:
        raise DataError(reason, path=display_path(p))
    return [p]


_WARNED: set[tuple[Path, tuple[Path, ...]]] = set()  # folders warned about, with their bad entries


def _folder_files(folder: Path, unreadable: UnreadableFilesPolicy) -> list[Path]:
    """The readable ``*.parquet`` files of ``folder`` by name; the others reported as
    ``unreadable`` says."""
    if unreadable not in choices(UnreadableFilesPolicy):
        raise ConfigError(f"config key data.unreadable_files={unreadable!r} must be 'warn' or 'error'")
    files, bad = [], []
    for f in sorted(folder.glob("*.parquet")):
        reason = unreadable_reason(f)
        if reason is None:
            files.append(f)
        else:
            bad.append((f, reason))
    if bad:
        first, why = bad[0]
        entries = f"{len(bad)} *.parquet entr{'y' if len(bad) == 1 else 'ies'}"
        what = f"{entries} cannot be read (first: {display_path(first)}, which {why})"
        if unreadable == "error":
            raise DataError(
                f'{what}; fix or remove them, or set data.unreadable_files = "warn" to skip them',
                path=display_path(folder),
            )
        key = (folder.resolve(), tuple(f for f, _ in bad))
        if key not in _WARNED:  # every reader lists the folder; one warning is enough
            _WARNED.add(key)
            logger.warning(
                'data folder %s: %s; skipping them (data.unreadable_files = "error" refuses them)',
                display_path(folder),
                what,
            )
    if not files:
        raise DataError(
            "directory has no readable *.parquet files" if bad else "directory has no *.parquet files",
            path=display_path(folder),
        )
    return files


def open_dataset(
    path: str | Path,
    schema: FeatureSchema | SchemaMapping | None = None,
    unreadable: UnreadableFilesPolicy = "warn",
) -> DatasetInfo:
    """Reads and checks the footers of a dataset.

    Args:
        path: a ``.parquet`` file or a directory of them, or a cache folder (see
            :mod:`recaccel.io.format.cache`): then the source's row groups, read from it.
        schema: the expected schema; None = the one stored in the first file's metadata,
            which every other file must then carry too. A given schema lets files
            written by other tools (without recaccel metadata) be read; so does a
            ``[data.schema]`` mapping, resolved against the first file's columns (see
            :mod:`recaccel.io.format.mapping`).
        unreadable: what to do with a folder's unreadable entries (see :func:`list_files`).

    Returns:
        The schema, the files and their non-empty row groups. A file without rows is
        allowed (a warning is logged) and contributes nothing.

    Raises:
        DataError: naming the file (and column) for a missing path, an empty directory,
            an unreadable, corrupt or truncated file, a file whose stored schema differs
            from the first file's, or a missing or mistyped column.
    """
    if is_cache(path):
        return _open_cache(path, schema)
    files = list_files(path, unreadable)
    expected = schema
    first: Path | None = None
    row_groups: list[RowGroupRef] = []
    for f in files:
        try:
            with pq.ParquetFile(str(f)) as pf:
                arrow_schema = pf.schema_arrow
                meta = pf.metadata
        except READ_ERRORS as e:
            raise DataError(
                f"cannot read Parquet footer (corrupt or truncated file?): {read_error_text(e)}",
                path=display_path(f),
            ) from None
        if isinstance(expected, SchemaMapping):
            expected = resolve_mapping(expected, arrow_schema, str(f))
        if schema is None:
            stored = FeatureSchema.from_arrow(arrow_schema, str(f))
            if expected is None:
                expected, first = stored, f
            elif stored != expected:
                differ = ", ".join(_schema_diff(expected, stored))
                raise DataError(
                    f"stored schema differs from that of {first} in: {differ}", path=display_path(f)
                )
        expected.validate_arrow(arrow_schema, str(f))
        if meta.num_rows == 0:
            logger.warning("recaccel dataset: file %s has no rows; skipping it", f)
        row_groups += _row_groups(f, meta)
    return DatasetInfo(expected, tuple(files), tuple(row_groups))


def _open_cache(path: str | Path, schema: FeatureSchema | SchemaMapping | None) -> DatasetInfo:
    """The source's DatasetInfo as a cache folder records it (its checks passed)."""
    manifest = load_manifest(path)
    where = str(Path(path) / MANIFEST)
    if isinstance(schema, FeatureSchema) and schema != manifest.schema:
        differ = ", ".join(_schema_diff(schema, manifest.schema))
        raise DataError(f"the cache's schema differs from the expected one in: {differ}", path=where)
    if not isinstance(schema, FeatureSchema) and mapping_text(schema) != manifest.mapping:
        raise DataError(
            "the cache was built with another [data.schema] mapping than this config's; "
            "rebuild it with recaccel-data cache --config",
            path=where,
        )
    refs = tuple(RowGroupRef(g.path, g.row_group, g.rows) for g in manifest.row_groups)
    return DatasetInfo(manifest.schema, tuple(manifest.files), refs, cache=Path(path))


def row_group_reader(
    schema: FeatureSchema,
    projection: Projection,
    policies: Policies,
    stats: dict[str, int],
    cache: Path | None = None,
) -> RowGroupReader | CachedRowGroupReader:
    """The row-group reader of a dataset: Parquet, or the cache folder ``cache``
    (``DatasetInfo.cache``); both return the same Columns and counters."""
    if cache is None:
        return RowGroupReader(schema, projection, policies, stats)
    return CachedRowGroupReader(cache, schema, projection, policies, stats)


def _row_groups(path: Path, meta: pq.FileMetaData) -> list[RowGroupRef]:
    """The non-empty row groups of a file, checked against the file's row count (a
    damaged footer must not make rows vanish)."""
    counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    for i, rows in enumerate(counts):
        if rows < 0:
            raise DataError(
                f"the footer gives it {rows} rows (corrupt file?)", path=display_path(path), row_group=i
            )
    if sum(counts) != meta.num_rows:
        raise DataError(
            f"the footer's row groups hold {sum(counts)} rows but it says the file has {meta.num_rows} "
            "(corrupt file?)",
            path=display_path(path),
        )
    return [RowGroupRef(path, i, rows) for i, rows in enumerate(counts) if rows > 0]


def _schema_diff(a: FeatureSchema, b: FeatureSchema) -> list[str]:
    return [
        fld.name
        for fld in dataclasses.fields(FeatureSchema)
        if fld.compare and getattr(a, fld.name) != getattr(b, fld.name)
    ]


class RowGroupReader:
    """Decodes row groups into validated :class:`Columns`, keeping a few files open.

    Page checksums are verified, so a corrupted page is a :class:`DataError`.

    Args:
        schema: the dataset schema.
        projection: the columns to decode.
        policies: bad-value policies.
        stats: counters updated by every read (see :mod:`recaccel.io.format.decode`).
        max_open_files: open file handles kept for reuse (shuffled reads jump between files).
    """

    def __init__(
        self,
        schema: FeatureSchema,
        projection: Projection,
        policies: Policies,
        stats: dict[str, int],
        max_open_files: int = 8,
    ) -> None:
        self.schema = schema
        self.projection = projection
        self.policies = policies
        self.stats = stats
        self._names = projection.arrow_columns(schema)
        self._files: OrderedDict[Path, pq.ParquetFile] = OrderedDict()
        self._max_open = max(1, max_open_files)

    def read(self, ref: RowGroupRef) -> Columns:
        """Reads and decodes one row group.

        Raises:
            DataError: naming file and row group when it cannot be read, and as
                :func:`row_group_to_columns` does for bad values.
        """
        pf = self._file(ref.path)
        try:
            # Columns decode in parallel on Arrow's CPU pool (pyarrow.set_cpu_count).
            table = pf.read_row_group(ref.row_group, columns=self._names, use_threads=True)
        except READ_ERRORS as e:
            raise DataError(
                f"cannot read row group: {read_error_text(e)}",
                path=display_path(ref.path),
                row_group=ref.row_group,
                column=self._failing_column(pf, ref),
            ) from None
        if table.num_rows != ref.num_rows:
            raise DataError(
                f"row group has {table.num_rows} rows but the footer said {ref.num_rows}",
                path=display_path(ref.path),
                row_group=ref.row_group,
            )
        return row_group_to_columns(
            table,
            self.schema,
            self.policies,
            str(ref.path),
            ref.row_group,
            projection=self.projection,
            stats=self.stats,
        )

    def _failing_column(self, pf: pq.ParquetFile, ref: RowGroupRef) -> str | None:
        """The first projected column that cannot be read alone, or that reads another
        row count than the footer's (None if no single column is at fault)."""
        for name in self._names:
            try:
                rows = pf.read_row_group(ref.row_group, columns=[name], use_threads=False).num_rows
            except READ_ERRORS:
                return name
            if rows != ref.num_rows:
                return name
        return None

    def close(self) -> None:
        """Closes every open file."""
        while self._files:
            _, pf = self._files.popitem()
            pf.close()

    def _file(self, path: Path) -> pq.ParquetFile:
        pf = self._files.get(path)
        if pf is not None:
            self._files.move_to_end(path)
            return pf
        try:
            pf = pq.ParquetFile(str(path), page_checksum_verification=True)
        except READ_ERRORS as e:
            raise DataError(
                f"cannot open Parquet file: {read_error_text(e)}", path=display_path(path)
            ) from None
        self._files[path] = pf
        if len(self._files) > self._max_open:
            _, old = self._files.popitem(last=False)
            old.close()
        return pf

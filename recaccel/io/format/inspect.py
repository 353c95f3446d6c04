"""What a Parquet dataset holds, and a suggested ``[data.schema]`` mapping for it.

:func:`inspect_dataset` reads every row group of every file once, one column at a time,
and reports each column's Arrow type, null count and distinct count: exact while a
column has at most ``exact_limit`` distinct values, then an estimate (a K-minimum-values
sketch of the values' 64-bit hashes, a few percent off), flagged as such.
:func:`suggest_mapping` turns that into a TOML fragment: the label (given, else a column
named like one), dense = floating columns, sparse = integer, string and list columns,
with ``cardinality = max + 1`` for small non-negative integer ids and ``hash = N``
buckets (about twice the distinct count, at least 16) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recaccel.config_files import toml_key, toml_value
from recaccel.errors import DataError
from recaccel.hashing import mix64
from recaccel.io.format.dataset import READ_ERRORS, list_files, read_error_text
from recaccel.io.format.id_hash import hash_int_ids, hash_strings

_LABEL_NAMES = ("label", "labels", "target", "y", "click", "clicked", "clicks", "rating", "ratings", "stars")
_KMV = 4096  # sketch size: relative error about 1/sqrt(K), ~1.6%


@dataclass
class ColumnStats:
    """One column of a dataset.

    Attributes:
        name: the column.
        type: its Arrow type, as text.
        rows: rows (list columns: rows, not ids).
        nulls: null rows.
        distinct: distinct non-null values (list columns: distinct ids).
        exact: whether ``distinct`` is exact (else a sketch estimate).
        min, max: of integer values (ids), else None.
        whole: floating values that are all whole numbers (ids stored as float).
    """

    name: str
    type: str
    rows: int = 0
    nulls: int = 0
    distinct: int = 0
    exact: bool = True
    min: int | None = None
    max: int | None = None
    whole: bool = False
    _seen: set = field(default_factory=set, repr=False)
    _sketch: np.ndarray | None = field(default=None, repr=False)


def inspect_dataset(path: str | Path, exact_limit: int = 100_000) -> list[ColumnStats]:
    """Per-column statistics of a ``.parquet`` file or a folder of them.

    Raises:
        DataError: naming the file for a missing path or an unreadable file.
    """
    stats: dict[str, ColumnStats] = {}
    for f in list_files(path):
        try:
            with pq.ParquetFile(str(f)) as pf:
                for g in range(pf.metadata.num_row_groups):
                    table = pf.read_row_group(g)
                    for name, col in zip(table.column_names, table.columns):
                        s = stats.setdefault(name, ColumnStats(name, str(col.type)))
                        _add(s, col.combine_chunks(), exact_limit)
        except READ_ERRORS as e:
            raise DataError(f"cannot read Parquet file: {read_error_text(e)}", path=str(f)) from None
    for s in stats.values():
        if not s.exact and s._sketch is not None:
            if s._sketch.size < _KMV:  # the sketch holds every distinct value: a count
                s.exact, s.distinct = True, int(s._sketch.size)
            else:
                s.distinct = int((_KMV - 1) / (float(s._sketch[_KMV - 1]) / 2.0**64))
        s._seen, s._sketch = set(), None
    return list(stats.values())


def _add(s: ColumnStats, arr: pa.Array, limit: int) -> None:
    s.rows += len(arr)
    s.nulls += arr.null_count
    typ = arr.type
    if pa.types.is_dictionary(typ):
        arr, typ = arr.dictionary_decode(), typ.value_type
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        arr, typ = arr.flatten(), typ.value_type
        if pa.types.is_dictionary(typ):
            arr, typ = arr.dictionary_decode(), typ.value_type
    arr = arr.drop_null()
    if len(arr) == 0:
        return
    if pa.types.is_integer(typ) or pa.types.is_boolean(typ):
        values = arr.to_numpy(zero_copy_only=False).astype(np.int64)
        s.min = int(values.min()) if s.min is None else min(s.min, int(values.min()))
        s.max = int(values.max()) if s.max is None else max(s.max, int(values.max()))
        words = hash_int_ids(values, 2**62)
    elif pa.types.is_floating(typ):
        values = arr.to_numpy(zero_copy_only=False)
        whole = bool(np.all(np.isfinite(values) & (values == np.floor(values))))
        s.whole = whole and (s.whole or s.distinct == 0)
        if s.whole:  # whole numbers: their range (a 0/1 label, ids stored as float)
            s.min = int(values.min()) if s.min is None else min(s.min, int(values.min()))
            s.max = int(values.max()) if s.max is None else max(s.max, int(values.max()))
        else:
            s.min = s.max = None
        words = hash_int_ids(
            values.view(np.int64) if values.dtype == np.float64 else values.astype(np.float64).view(np.int64),
            2**62,
        )
    elif (
        pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
    ):
        words = hash_strings(arr, 2**62)
    else:  # timestamps, dates, decimals, nested: count distinct through their integer view
        try:
            words = hash_int_ids(pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False), 2**62)
        except (pa.ArrowException, ValueError):
            s.exact, s.distinct = False, -1
            return
    _count_distinct(s, np.unique(words), limit)


def _count_distinct(s: ColumnStats, words: np.ndarray, limit: int) -> None:
    """Exact (a set of 62-bit hashes) up to ``limit`` distinct values, then a KMV sketch."""
    if s.exact:
        s._seen.update(words.tolist())
        s.distinct = len(s._seen)
        if s.distinct <= limit:
            return
        s.exact = False
        words = np.fromiter(s._seen, dtype=np.int64, count=len(s._seen))
        s._seen = set()
    # Sketch: the K smallest of a second, uniform 64-bit hash of each distinct value.
    h = np.sort(mix64(words.view(np.uint64)))
    merged = h if s._sketch is None else np.union1d(s._sketch, h)
    s._sketch = merged[:_KMV]


def _guess_label(stats: list[ColumnStats]) -> str | None:
    for s in stats:
        if s.name.lower() in _LABEL_NAMES:
            return s.name
    return None


def suggest_mapping(stats: list[ColumnStats], label: str | None = None) -> str:
    """A ``[data.schema]`` TOML fragment for these columns (to review before training).

    Raises:
        DataError: ``label`` names no column.
    """
    names = [s.name for s in stats]
    if label is not None and label not in names:
        raise DataError(f"--label {label!r} is not a column (columns: {', '.join(names)})")
    label = label or _guess_label(stats)
    lines = ["[data.schema]"]
    if label is None:
        lines.append('label = "CHANGE_ME"  # no column is named like a label: give --label COL')
    else:
        lines.append(f"label = {toml_value(label)}")
        kind = next(s for s in stats if s.name == label)
        binary = kind.min is not None and kind.min >= 0 and (kind.max or 0) <= 1 or kind.type == "bool"
        lines.append(f'label_kind = "{"binary" if binary else "rating"}"')
    dense, sparse, skipped = [], [], []
    for s in stats:
        if s.name == label:
            continue
        t = s.type
        if "float" in t or "double" in t or "decimal" in t:
            if s.whole and s.distinct <= 10_000 and not t.startswith(("list", "large_list")):
                sparse.append((s, "whole numbers: ids stored as float?"))
            else:
                dense.append(s.name)
        elif t.startswith(("timestamp", "date")):
            skipped.append(f"{s.name} ({t}): a meta dataset's timestamp = {toml_value(s.name)}?")
        elif any(k in t for k in ("int", "string", "binary", "bool", "dictionary")):
            sparse.append((s, ""))
        else:
            skipped.append(f"{s.name} ({t}): no role for this type")
    lines.append(f"dense = [{', '.join(toml_value(d) for d in dense)}]")
    lines.append(
        '# task_key = "COL"  # meta data: the integer column grouping rows into tasks (rows sorted by it)'
    )
    lines.append("")
    lines.append("[data.schema.sparse]")
    for s, note in sparse:
        lines.append(f"{toml_key(s.name)} = {{ {_sparse_size(s)} }}" + _comment(s, note))
    for text in skipped:
        lines.append(f"# skipped: {text}")
    return "\n".join(lines) + "\n"


def _sparse_size(s: ColumnStats) -> str:
    ids = s.min is not None and s.min >= 0 and s.max is not None
    if ids and s.exact and s.max < 4 * max(s.distinct, 1) + 16:  # dense small ids: one row each
        return f"cardinality = {s.max + 1}"
    return f"hash = {max(16, 2 * s.distinct)}"


def _comment(s: ColumnStats, note: str) -> str:
    approx = "" if s.exact else "~"
    parts = [
        f"{approx}{s.distinct} distinct",
        *([f"{s.nulls} nulls"] if s.nulls else []),
        *([note] if note else []),
    ]
    return "  # " + ", ".join(parts)


def format_table(stats: list[ColumnStats]) -> str:
    """One line per column: name, type, nulls, distinct (``~`` = estimated), id range."""
    rows = [("column", "type", "rows", "nulls", "distinct", "min..max")]
    for s in stats:
        distinct = "?" if s.distinct < 0 else ("" if s.exact else "~") + str(s.distinct)
        span = f"{s.min}..{s.max}" if s.min is not None else ""
        rows.append((s.name, s.type, str(s.rows), str(s.nulls), distinct, span))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if any(not s.exact and s.distinct >= 0 for s in stats):
        out.append("~ = estimated (more distinct values than the exact count's cap)")
    return "\n".join(out)

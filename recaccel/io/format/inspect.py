"""What a Parquet dataset holds, and a suggested ``[data.schema]`` mapping for it.

:func:`inspect_dataset` reads every row group of every file of every path given (train
and test together) once, one column at a time, and reports each column's Arrow type,
null count and distinct count: exact while a column has at most ``exact_limit`` distinct
values, then an estimate (a K-minimum-values sketch of the values' 64-bit hashes, a few
percent off), flagged as such; the mean and standard deviation of numeric columns; each
path's largest id; and every value's count while a column has at most
``vocabulary_limit`` distinct values.

:func:`suggest_mapping` turns that into a TOML fragment: the label (given, else a column
named like one), dense = floating columns with a transform (``log1p`` for non-negative
long-tailed ones, else ``standardize`` with their statistics), sparse = integer, string
and list columns: ``cardinality = max + 1`` (over every path) for small non-negative
integer ids, ``vocabulary = true`` for other columns counted in full (when a vocabulary
file is written), else ``hash = N`` with N the smallest size whose expected number of
colliding values (:func:`expected_collisions`) is under 1% of the distinct count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recaccel.config.files import toml_key, toml_value
from recaccel.errors import DataError
from recaccel.hashing import mix64
from recaccel.io.format.dataset import READ_ERRORS, list_files, read_error_text
from recaccel.io.format.id_hash import hash_int_ids, hash_strings
from recaccel.io.format.vocabulary import Vocabulary, VocabularyCounter

_LABEL_NAMES = ("label", "labels", "target", "y", "click", "clicked", "clicks", "rating", "ratings", "stars")
_KMV = 4096  # sketch size: relative error about 1/sqrt(K), ~1.6%
COLLISION_SHARE = 0.01  # a suggested hash leaves under this share of the values colliding
_LONG_TAIL = 10.0  # (max - mean) / std above this: a long tail, log1p suggested


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
        mean, std: of the finite values of a numeric (not list) column, else None.
        low, high: the smallest and largest of those values, else None.
        path_max: each path's largest id, when several paths hold integer ids.
        vocabulary: every value with its count; None past ``vocabulary_limit`` distinct.
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
    mean: float | None = None
    std: float | None = None
    low: float | None = None
    high: float | None = None
    path_max: dict[str, int] = field(default_factory=dict)
    vocabulary: Vocabulary | None = None
    _seen: set = field(default_factory=set, repr=False)
    _sketch: np.ndarray | None = field(default=None, repr=False)
    _moments: tuple[int, float, float] = field(default=(0, 0.0, 0.0), repr=False)  # n, mean, M2
    _counter: VocabularyCounter | None = field(default=None, repr=False)


def inspect_dataset(
    path: str | Path | list[str | Path], exact_limit: int = 100_000, vocabulary_limit: int = 100_000
) -> list[ColumnStats]:
    """Per-column statistics of ``.parquet`` files or folders of them, all paths together.

    Args:
        path: a file or folder, or several (e.g. the train and the test data).
        exact_limit: distinct values counted exactly per column; beyond, an estimate.
        vocabulary_limit: the most distinct values whose counts are kept for a vocabulary.

    Raises:
        DataError: naming the file for a missing path or an unreadable file.
    """
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    stats: dict[str, ColumnStats] = {}
    for p in paths:
        for f in list_files(p):
            _read_file(f, str(p), stats, exact_limit, vocabulary_limit)
    for s in stats.values():
        _finish(s)
    return list(stats.values())


def _read_file(f: Path, path: str, stats: dict[str, ColumnStats], exact_limit: int, vocab_limit: int) -> None:
    g = None  # the row group being read, for the message
    try:
        # Page checksums verified, as the training reader does: a corrupted page is an
        # error here too, not statistics (and a schema suggestion) drawn from garbage.
        with pq.ParquetFile(str(f), page_checksum_verification=True) as pf:
            for g in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(g)
                for name, col in zip(table.column_names, table.columns):
                    s = stats.setdefault(
                        name, ColumnStats(name, str(col.type), _counter=VocabularyCounter(vocab_limit))
                    )
                    arr = col.combine_chunks()
                    _add(s, arr, exact_limit)
                    s._counter.add(arr)
                    _add_moments(s, arr)
                    top = _array_max(arr)
                    if top is not None:
                        s.path_max[path] = max(s.path_max.get(path, top), top)
    except READ_ERRORS as e:
        raise DataError(f"cannot read Parquet file: {read_error_text(e)}", path=str(f), row_group=g) from None


def _array_max(arr: pa.Array) -> int | None:
    """The largest integer (or whole-number) id of one array (its items for a list)."""
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = arr.flatten()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        return None
    top = pc.max(arr).as_py()
    return None if top is None or not math.isfinite(top) or top != math.floor(top) else int(top)


def _add_moments(s: ColumnStats, arr: pa.Array) -> None:
    """Merges one array's finite values into the running count, mean and M2 (Chan et al.)."""
    typ = arr.type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)):
        return
    x = arr.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return
    n, mean, m2 = s._moments
    k, mk = x.size, float(x.mean())
    total, delta = n + k, mk - mean
    s._moments = (
        total,
        mean + delta * k / total,
        m2 + float(((x - mk) ** 2).sum()) + delta * delta * n * k / total,
    )
    s.low = float(x.min()) if s.low is None else min(s.low, float(x.min()))
    s.high = float(x.max()) if s.high is None else max(s.high, float(x.max()))


def _finish(s: ColumnStats) -> None:
    """Turns the running counts into the reported statistics."""
    n, mean, m2 = s._moments
    if n:
        s.mean, s.std = mean, math.sqrt(m2 / n)
    s.vocabulary = s._counter.vocabulary() if s._counter is not None else None
    s._counter = None
    if s.min is None or len(s.path_max) < 2:
        s.path_max = {}
    if not s.exact and s._sketch is not None:
        if s._sketch.size < _KMV:  # the sketch holds every distinct value: a count
            s.exact, s.distinct = True, int(s._sketch.size)
        else:
            s.distinct = int((_KMV - 1) / (float(s._sketch[_KMV - 1]) / 2.0**64))
    s._seen, s._sketch = set(), None


def expected_collisions(n: int, m: int) -> float:
    """The expected number of values sharing a bucket with an earlier one when ``n``
    distinct values hash uniformly into ``m`` buckets: n - m (1 - (1 - 1/m)^n)."""
    if m <= 1:
        return float(max(n - 1, 0))
    occupied = -m * math.expm1(n * math.log1p(-1.0 / m))
    return max(0.0, n - occupied)


def hash_size(n: int, share: float = COLLISION_SHARE) -> int:
    """The smallest bucket count (at least 16) whose expected collisions stay at or under
    ``share`` of ``n`` distinct values (about n / (2 share))."""
    target = share * n
    lo, hi = 16, max(16, int(n / share) + 16)
    if expected_collisions(n, lo) <= target:
        return lo
    while hi - lo > 1:  # expected collisions fall as buckets grow
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if expected_collisions(n, mid) <= target else (mid, hi)
    return hi


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


def suggest_mapping(
    stats: list[ColumnStats],
    label: str | None = None,
    vocabulary_file: str | None = None,
    vocabulary_sha256: str | None = None,
) -> str:
    """A ``[data.schema]`` TOML fragment for these columns (to review before training).

    Args:
        stats: :func:`inspect_dataset`'s columns.
        label: the label column; None = a column named like one.
        vocabulary_file: where the caller writes :func:`vocabularies` of this suggestion;
            None = no vocabularies (every non-id column hashed).
        vocabulary_sha256: that file's digest, recorded so a changed file is refused.

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
    dense, sparse, skipped = _roles(stats, label)
    lines.append(f"dense = [{', '.join(toml_value(d.name) for d in dense)}]")
    if vocabulary_file is not None and any(
        _sparse_kind(s, vocabulary_file) == "vocabulary" for s, _ in sparse
    ):
        lines.append(f"vocabulary_file = {toml_value(vocabulary_file)}  # vocabulary = true columns' values")
        if vocabulary_sha256 is not None:
            lines.append(f"vocabulary_sha256 = {toml_value(vocabulary_sha256)}")
    lines.append(
        '# task_key = "COL"  # meta data: the integer column grouping rows into tasks (rows sorted by it)'
    )
    lines.append("")
    lines.append("[data.schema.sparse]")
    warnings = []
    for s, note in sparse:
        size, comment = _sparse_entry(s, vocabulary_file)
        lines.append(
            f"{toml_key(s.name)} = {{ {size} }}  # "
            + ", ".join([*_facts(s), comment, *([note] if note else [])])
        )
        warnings += _cold_start_warning(s, size)
    if dense:
        lines.append("")
        lines.append("[data.schema.transforms]")
        lines += [f"{toml_key(s.name)} = {{ {_transform(s)} }}" for s in dense]
    for text in skipped:
        lines.append(f"# skipped: {text}")
    lines += [f"# warning: {w}" for w in warnings]
    return "\n".join(lines) + "\n"


def vocabularies(stats: list[ColumnStats], label: str | None = None) -> dict[str, Vocabulary]:
    """The vocabularies :func:`suggest_mapping` refers to, by column (with a vocabulary file)."""
    label = label or _guess_label(stats)
    _, sparse, _ = _roles(stats, label)
    return {s.name: s.vocabulary for s, _ in sparse if _sparse_kind(s, "file") == "vocabulary"}


def _roles(stats: list[ColumnStats], label: str | None) -> tuple[list, list, list]:
    """(dense columns, (sparse column, note) pairs, skipped column notes)."""
    dense, sparse, skipped = [], [], []
    for s in stats:
        if s.name == label:
            continue
        t = s.type
        if "float" in t or "double" in t or "decimal" in t:
            if s.whole and s.distinct <= 10_000 and not t.startswith(("list", "large_list")):
                sparse.append((s, "whole numbers: ids stored as float?"))
            else:
                dense.append(s)
        elif t.startswith(("timestamp", "date")):
            skipped.append(f"{s.name} ({t}): a meta dataset's timestamp = {toml_value(s.name)}?")
        elif any(k in t for k in ("int", "string", "binary", "bool", "dictionary")):
            sparse.append((s, ""))
        else:
            skipped.append(f"{s.name} ({t}): no role for this type")
    return dense, sparse, skipped


def _small_ids(s: ColumnStats) -> bool:
    """Dense small non-negative integer ids: one row each, no map needed."""
    ids = s.min is not None and s.min >= 0 and s.max is not None
    return ids and s.exact and s.max < 4 * max(s.distinct, 1) + 16


def _sparse_kind(s: ColumnStats, vocabulary_file: str | None) -> str:
    if _small_ids(s):
        return "cardinality"
    if vocabulary_file is not None and s.vocabulary is not None and len(s.vocabulary.values):
        return "vocabulary"
    return "hash"


def _sparse_entry(s: ColumnStats, vocabulary_file: str | None) -> tuple[str, str]:
    """(the TOML of the column's size, a comment on its collisions)."""
    kind = _sparse_kind(s, vocabulary_file)
    if kind == "cardinality":
        return f"cardinality = {s.max + 1}", "one row per id"
    if kind == "vocabulary":
        return "vocabulary = true", f"rows 1..{len(s.vocabulary.values)}, row 0 for unseen values"
    n = max(s.distinct, 1)
    m = hash_size(n)
    expect = expected_collisions(n, m)
    return f"hash = {m}", f"expected colliding values {expect:.1f} ({100 * expect / n:.2f}%)"


def _cold_start_warning(s: ColumnStats, size: str) -> list[str]:
    """Where one path's ids stop below another's, a table sized from it alone would fail."""
    if not size.startswith("cardinality") or not s.path_max:
        return []
    low = min(s.path_max, key=s.path_max.get)
    high = max(s.path_max, key=s.path_max.get)
    if s.path_max[low] == s.path_max[high]:
        return []
    return [
        f"column {s.name}: ids reach {s.path_max[high]} in {high} but only {s.path_max[low]} in {low}; "
        f"cardinality = {s.path_max[low] + 1} from {low} alone would fail on {high} (sized here from every path)"
    ]


def _transform(s: ColumnStats) -> str:
    """A dense column's transform: log1p for a non-negative long tail, else standardize."""
    if s.std is None or s.std == 0 or s.mean is None:
        return 'transform = "none"'
    if s.low is not None and s.low >= 0 and s.high is not None and (s.high - s.mean) > _LONG_TAIL * s.std:
        return 'transform = "log1p"'
    return f'transform = "standardize", mean = {s.mean!r}, std = {s.std!r}'


def _facts(s: ColumnStats) -> list[str]:
    approx = "" if s.exact else "~"
    return [f"{approx}{s.distinct} distinct", *([f"{s.nulls} nulls"] if s.nulls else [])]


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

"""Exact id maps of categorical columns (``vocabulary = true`` in a ``[data.schema]`` mapping).

A vocabulary lists a column's distinct values with how often ``recaccel-data inspect``
saw each, most frequent first (ties by value). With ``min_count = c`` the values seen at
least ``c`` times get rows ``1 .. K`` in that order; row 0 is the out-of-vocabulary row,
shared by every value not kept (unseen at inspect time, or rarer than ``c``). A table of
``K + 1`` rows then holds each kept value in a row of its own: no collisions.

The vocabulary file (JSON) holds every vocabulary column of a mapping::

    {"format": "recaccel.vocabulary", "version": 1,
     "columns": {"city": {"type": "string", "values": ["paris", ...], "counts": [812, ...]}}}

``type`` is ``string`` (string, binary and dictionary columns) or ``integer`` (integer,
boolean and whole-number floating columns); a list column's vocabulary is of its items.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recaccel.errors import DataError

FORMAT = "recaccel.vocabulary"
VERSION = 1
OOV_ROW = 0
Kind = Literal["string", "integer"]


@dataclass(frozen=True)
class Vocabulary:
    """One column's values, most frequent first, and their counts.

    Attributes:
        kind: ``string`` or ``integer``.
        values: the distinct values.
        counts: how often each was seen (non-increasing).
    """

    kind: Kind
    values: tuple
    counts: tuple[int, ...]

    def kept(self, min_count: int = 1) -> int:
        """K: how many values have rows of their own (seen at least ``min_count`` times)."""
        return int(np.searchsorted(-np.asarray(self.counts, dtype=np.int64), -min_count, side="right"))

    def rows(self, min_count: int = 1) -> int:
        """The table size: K values plus the out-of-vocabulary row 0."""
        return self.kept(min_count) + 1

    def value_set(self, min_count: int = 1) -> pa.Array:
        """The kept values as an Arrow array (row ``i + 1`` holds ``value_set[i]``)."""
        kept = list(self.values[: self.kept(min_count)])
        return pa.array(kept, pa.string() if self.kind == "string" else pa.int64())

    def to_json(self) -> dict:
        return {"type": self.kind, "values": list(self.values), "counts": list(self.counts)}


def lookup(arr: pa.Array, value_set: pa.Array) -> np.ndarray:
    """Rows [n] of the values of ``arr`` (strings, or int64 ids): 1 + their index in
    ``value_set``, 0 where absent (a null's row is meaningless: the caller keeps the null)."""
    if pa.types.is_dictionary(arr.type):  # look each distinct value up once
        rows = lookup(arr.dictionary, value_set)
        return rows[arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)]
    if arr.type != value_set.type:
        arr = arr.cast(value_set.type)
    index = pc.index_in(arr, value_set=value_set)
    return pc.fill_null(pc.add(index.cast(pa.int64()), 1), OOV_ROW).to_numpy(zero_copy_only=False)


def column_kind(typ: pa.DataType) -> Kind | None:
    """The vocabulary kind of a column's (or list column's item) type; None = neither."""
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        typ = typ.value_type
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return "string"
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        return "string"
    if pa.types.is_integer(typ) or pa.types.is_boolean(typ) or pa.types.is_floating(typ):
        return "integer"
    return None


class VocabularyCounter:
    """Counts one column's values over many arrays, giving up past ``limit`` distinct values.

    Args:
        limit: the most distinct values counted; beyond, :attr:`overflow` is True and
            :meth:`vocabulary` returns None (the column wants a hash).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kind: Kind | None = None
        self.overflow = False
        self.counts: dict = {}

    def add(self, arr: pa.Array) -> None:
        """Counts the non-null values of ``arr`` (list columns: their items)."""
        if self.overflow:
            return
        typ = arr.type
        if pa.types.is_list(typ) or pa.types.is_large_list(typ):
            arr = arr.flatten()
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        kind = column_kind(arr.type)
        if kind is None or (self.kind is not None and kind != self.kind):
            self.overflow = True  # no one map for this column
            return
        self.kind = kind
        arr = arr.drop_null()
        if kind == "integer":
            values = arr.to_numpy(zero_copy_only=False)
            if values.dtype.kind == "f":
                if not np.all(np.isfinite(values) & (values == np.floor(values))):
                    self.overflow = True  # real-valued: not ids
                    return
            keys, counts = np.unique(values.astype(np.int64), return_counts=True)
            pairs = zip(keys.tolist(), counts.tolist())
        else:
            if not pa.types.is_string(arr.type):
                arr = arr.cast(pa.string())
            vc = pc.value_counts(arr)
            pairs = zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())
        for key, count in pairs:
            self.counts[key] = self.counts.get(key, 0) + int(count)
        if len(self.counts) > self.limit:
            self.overflow, self.counts = True, {}

    def vocabulary(self) -> Vocabulary | None:
        """The counted values, most frequent first (ties by value); None past the limit."""
        if self.overflow or self.kind is None:
            return None
        ordered = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return Vocabulary(self.kind, tuple(k for k, _ in ordered), tuple(c for _, c in ordered))


def vocabulary_text(vocabularies: dict[str, Vocabulary]) -> str:
    """The vocabulary file's text for ``vocabularies`` (by column); the caller writes it."""
    columns = {name: v.to_json() for name, v in vocabularies.items()}
    return json.dumps({"format": FORMAT, "version": VERSION, "columns": columns}) + "\n"


def text_digest(text: str) -> str:
    """The SHA-256 (hex) of a vocabulary file's text, as ``data.schema.vocabulary_sha256`` holds it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_vocabularies(path: str | Path, sha256: str | None = None) -> dict[str, Vocabulary]:
    """Every vocabulary of a vocabulary file, by column (cached while the file is unchanged).

    Args:
        path: the vocabulary file.
        sha256: the digest the file must have (``data.schema.vocabulary_sha256``); None =
            not checked.

    Raises:
        DataError: naming the file when it is missing, not JSON, not a vocabulary file, or
            changed since ``sha256`` was taken.
    """
    try:
        stat = os.stat(path)
    except OSError as e:
        raise DataError(f"cannot read the vocabulary file: {e.strerror}", path=str(path)) from None
    digest, vocabularies = _load(str(path), stat.st_mtime_ns, stat.st_size)
    if sha256 is not None and digest != sha256.lower():
        raise DataError(
            "the vocabulary file changed since the schema was written (its SHA-256 is not "
            "data.schema.vocabulary_sha256): rows would map differently; use the file the run "
            "was trained with, or inspect again and retrain",
            path=str(path),
        )
    return vocabularies


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> tuple[str, dict[str, Vocabulary]]:
    try:
        data = Path(path).read_bytes()
        raw = json.loads(data)
    except (OSError, ValueError) as e:
        raise DataError(f"not a readable vocabulary file ({' '.join(str(e).split())})", path=path) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("columns"), dict):
        raise DataError(
            'not a vocabulary file (no "format" and "columns" as recaccel-data inspect writes)', path=path
        )
    digest = hashlib.sha256(data).hexdigest()
    return digest, {name: _parsed(name, item, path) for name, item in raw["columns"].items()}


def _parsed(name: str, item: object, path: str) -> Vocabulary:
    ok = (
        isinstance(item, dict)
        and item.get("type") in ("string", "integer")
        and isinstance(item.get("values"), list)
        and isinstance(item.get("counts"), list)
        and len(item["values"]) == len(item["counts"])
    )
    if ok:
        want = str if item["type"] == "string" else int
        ok = all(isinstance(v, want) and not isinstance(v, bool) for v in item["values"])
        ok = ok and all(isinstance(c, int) and c > 0 for c in item["counts"])
        ok = ok and all(a >= b for a, b in zip(item["counts"], item["counts"][1:]))
        ok = ok and len(set(item["values"])) == len(item["values"])
    if not ok:
        raise DataError(
            f"vocabulary of column {name!r} must be {{type: string|integer, values: [distinct...], "
            "counts: [positive, non-increasing]}} of one length",
            path=path,
        )
    return Vocabulary(item["type"], tuple(item["values"]), tuple(item["counts"]))

"""Feature schema: which columns a dataset has and what they mean.

A recaccel Parquet dataset stores one float32 column per dense feature, one integer
column per single-hot sparse field (or a list of integers for multi-hot fields), a
float32 label, and optionally a task key and a timestamp (int64). Ids are written as
int32 where the field's cardinality fits (Arrow decodes them ~3x faster than int64:
``SparseField.arrow_type``); files with int64 ids, as older recaccel wrote, read the same. The schema itself travels in
the Parquet key-value metadata under :data:`SCHEMA_METADATA_KEY`, so a reader needs
nothing but the files.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Protocol

import numpy as np
import pyarrow as pa

from recaccel.config import LabelKind, choices
from recaccel.errors import DataError

SCHEMA_METADATA_KEY = b"recaccel.schema"
MAX_CARDINALITY = 2**63 - 1  # ids are int64
INT32_IDS = 2**31  # cardinalities up to this store ids as int32 (every valid id fits)
DICTIONARY_MAX_CARDINALITY = 2**16
LABEL_KINDS = choices(LabelKind)


class ColumnSource(Protocol):
    """The user's own column types behind a schema (a ``[data.schema]`` mapping's resolved
    columns), named here by what the readers call so that the schema needs no mapping."""

    def check(self, schema: pa.Schema, path: str) -> None:
        """Raises DataError when another file of the dataset has other column types."""

    def canonical(self, table: pa.Table, path: str, row_group: int) -> pa.Table:
        """The row group's columns in recaccel's types."""


@dataclass(frozen=True)
class SparseField:
    """One categorical field.

    Args:
        name: Column name.
        cardinality: Number of distinct ids; valid ids are ``0 .. cardinality-1``.
        multi_hot: True if the column is ``list<int64>`` (a bag of ids per row).
    """

    name: str
    cardinality: int
    multi_hot: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DataError(f"sparse field name must be a non-empty string, got {self.name!r}")
        card = self.cardinality
        if not isinstance(card, numbers.Integral) or isinstance(card, (bool, np.bool_)):
            raise DataError(f"sparse field {self.name!r} has cardinality {card!r}; must be an integer")
        if not 0 < int(card) <= MAX_CARDINALITY:
            raise DataError(
                f"sparse field {self.name!r} has cardinality {int(card)}; must be in 1..{MAX_CARDINALITY}"
            )
        if not isinstance(self.multi_hot, (bool, np.bool_)):
            raise DataError(
                f"sparse field {self.name!r} has multi_hot {self.multi_hot!r}; must be true or false"
            )
        # numpy scalars from converters become plain Python values (JSON, hashing).
        object.__setattr__(self, "cardinality", int(card))
        object.__setattr__(self, "multi_hot", bool(self.multi_hot))

    def arrow_type(self) -> pa.DataType:
        """The column type the writer stores: int32 ids where every valid id fits (half
        the bytes of int64, and Arrow decodes them ~3x faster), else int64."""
        ids = pa.int32() if self.cardinality <= INT32_IDS else pa.int64()
        return pa.list_(ids) if self.multi_hot else ids

    def dictionary_encoded(self) -> bool:
        """Whether the writer dictionary-encodes the column: only for small vocabularies.
        A large one makes dictionary pages about as big as the ids themselves and slower
        to decode than plain pages (measured with 8,192-row groups: plain is faster from
        ~2^16 values up, dictionary several times faster below)."""
        return self.cardinality < DICTIONARY_MAX_CARDINALITY


@dataclass(frozen=True)
class FeatureSchema:
    """Columns of a dataset and their roles.

    Args:
        dense: Names of float dense features (Dd of them).
        sparse: Sparse fields (F of them), in the order of ``SparseFeatures.keys``.
        label: Name of the label column.
        label_kind: ``"binary"`` (click, {0,1}) or ``"rating"`` (real-valued).
        task_key: Column grouping rows into tasks (meta-learning), if any.
        timestamp: Column ordering rows in time, if any.
        extra: Free-form JSON-able annotations (e.g. the task grouping claim).
        origin: The file this schema was read from, for error messages (not stored,
            not compared).
        source: For files without recaccel metadata, the ``[data.schema]`` mapping's
            column conversions (see :mod:`recaccel.io.format.mapping`); None = the files
            hold recaccel's own column types (not stored, not compared).

    Raises:
        DataError: on a value of the wrong type, an unknown label kind or duplicate
            column names.
    """

    dense: tuple[str, ...]
    sparse: tuple[SparseField, ...]
    label: str = "label"
    label_kind: LabelKind = "binary"
    task_key: str | None = None
    timestamp: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    origin: str | None = field(default=None, compare=False, hash=False, repr=False)
    source: ColumnSource | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.dense, (tuple, list)) or not all(_is_name(d) for d in self.dense):
            raise DataError(f"schema dense must be a list of column names, got {self.dense!r}")
        if not isinstance(self.sparse, (tuple, list)) or not all(
            isinstance(f, SparseField) for f in self.sparse
        ):
            raise DataError(f"schema sparse must be a list of sparse fields, got {self.sparse!r}")
        object.__setattr__(self, "dense", tuple(self.dense))
        object.__setattr__(self, "sparse", tuple(self.sparse))
        for key in ("label", "task_key", "timestamp"):
            value = getattr(self, key)
            if not (_is_name(value) or (value is None and key != "label")):
                raise DataError(f"schema {key} must be a column name, got {value!r}")
        if self.label_kind not in LABEL_KINDS:
            raise DataError(f"label_kind must be 'binary' or 'rating', got {self.label_kind!r}")
        if not isinstance(self.extra, dict):
            raise DataError(f"schema extra must be an object, got {self.extra!r}")
        names = self.column_names()
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise DataError(f"schema has duplicate column names: {dupes}")

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def num_sparse(self) -> int:
        return len(self.sparse)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def cardinalities(self) -> list[int]:
        return [f.cardinality for f in self.sparse]

    def column_names(self) -> list[str]:
        """All columns in file order: label, dense, sparse, then task key and timestamp."""
        cols = [self.label, *self.dense, *self.sparse_names]
        cols += [c for c in (self.task_key, self.timestamp) if c is not None]
        return cols

    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema of a dataset file, with this schema in its metadata."""
        fields = [pa.field(self.label, pa.float32())]
        fields += [pa.field(name, pa.float32()) for name in self.dense]
        fields += [pa.field(f.name, f.arrow_type()) for f in self.sparse]
        if self.task_key is not None:
            fields.append(pa.field(self.task_key, pa.int64()))
        if self.timestamp is not None:
            fields.append(pa.field(self.timestamp, pa.int64()))
        return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: self.to_json().encode()})

    def to_json(self) -> str:
        raw = asdict(replace(self, source=None))
        del raw["origin"], raw["source"]
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, path: str | None = None) -> FeatureSchema:
        """Parses :meth:`to_json`'s output, checking every key and value.

        Args:
            text: the JSON object (str, or bytes in a JSON encoding).
            path: the file it came from, for error messages and :attr:`origin`.

        Raises:
            DataError: naming ``path`` and the key for invalid JSON, a value that is not
                an object, a missing or unknown key, or a bad value.
        """
        bad = f"bad {SCHEMA_METADATA_KEY.decode()} metadata"
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise DataError(f"{bad}: not valid JSON ({_one_line(e)})", path=path) from None
        try:
            raw = _checked_keys(raw, "the schema", _SCHEMA_KEYS, required=("dense", "sparse"))
            for key in ("dense", "sparse"):
                if not isinstance(raw[key], list):
                    raise DataError(f"{key} must be a list, got {_short(raw[key])}")
            need = ("name", "cardinality")
            sparse = tuple(
                SparseField(**_checked_keys(item, f"sparse[{i}]", _FIELD_KEYS, required=need))
                for i, item in enumerate(raw["sparse"])
            )
            return cls(**{**raw, "dense": tuple(raw["dense"]), "sparse": sparse}, origin=path)
        except DataError as e:
            raise DataError(f"{bad}: {e}", path=path) from None

    @classmethod
    def from_arrow(cls, schema: pa.Schema, path: str) -> FeatureSchema:
        """Reads the recaccel schema stored in a file's metadata.

        Raises:
            DataError: naming the file if it carries no recaccel schema or a malformed one.
        """
        meta = schema.metadata or {}
        if SCHEMA_METADATA_KEY not in meta:
            raise DataError(
                "no recaccel schema in the Parquet metadata; write files with "
                "recaccel.io.format.write_parquet (or convert them: recaccel-data criteo, "
                "movielens, melu), or map their columns with a [data.schema] table (docs/data.md)",
                path=path,
            )
        return cls.from_json(meta[SCHEMA_METADATA_KEY], path)

    def validate_arrow(self, schema: pa.Schema, path: str) -> None:
        """Checks that a file has every column of this schema with the right type.

        Raises:
            DataError: naming the file and the first missing or mistyped column.
        """
        if self.source is not None:  # a mapped dataset: the user's own column types
            self.source.check(schema, path)
            return
        expected = self.arrow_schema()
        for want in expected:
            idx = field_index(schema, want.name, path)
            if idx < 0:
                raise DataError("column is missing", path=path, column=want.name)
            got = schema.field(idx).type
            if not _compatible(got, want.type):
                raise DataError(f"column has type {got}, expected {want.type}", path=path, column=want.name)


def field_index(schema: pa.Schema, name: str, path: str) -> int:
    """The index of column ``name`` in a file's Arrow schema, -1 if it has none.

    Raises:
        DataError: naming the file when the column appears more than once (Arrow finds
            neither copy by name, which would read as a missing column).
    """
    found = schema.get_all_field_indices(name)
    if len(found) > 1:
        raise DataError(f"column {name!r} appears {len(found)} times in {path}; rename or drop the copies")
    return found[0] if found else -1


def _compatible(got: pa.DataType, want: pa.DataType) -> bool:
    """Same type, or a lossless widening the reader casts (int32 ids, float64 dense)."""
    if got == want:
        return True
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return (pa.types.is_list(got) or pa.types.is_large_list(got)) and pa.types.is_integer(got.value_type)
    if pa.types.is_integer(want):
        return pa.types.is_integer(got)
    if pa.types.is_floating(want):
        return pa.types.is_floating(got) or pa.types.is_integer(got)
    return False


_SCHEMA_KEYS = tuple(f.name for f in fields(FeatureSchema) if f.name not in ("origin", "source"))
_FIELD_KEYS = tuple(f.name for f in fields(SparseField))


def _is_name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _checked_keys(raw: object, where: str, known: tuple[str, ...], required: tuple[str, ...]) -> dict:
    """``raw`` if it is a JSON object with only ``known`` keys, ``required`` among them."""
    if not isinstance(raw, dict):
        raise DataError(f"{where} must be a JSON object, got {type(raw).__name__} {_short(raw)}")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise DataError(f"{where} has unknown key(s) {unknown} (known: {list(known)})")
    missing = [k for k in required if k not in raw]
    if missing:
        raise DataError(f"{where} lacks key(s) {missing}")
    return raw

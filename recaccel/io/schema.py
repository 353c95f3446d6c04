"""Feature schema: which columns a dataset has and what they mean.

A recaccel Parquet dataset stores one float32 column per dense feature, one int64
column per single-hot sparse field (or ``list<int64>`` for multi-hot fields), a
float32 label, and optionally a task key and a timestamp. The schema itself travels in
the Parquet key-value metadata under :data:`SCHEMA_METADATA_KEY`, so a reader needs
nothing but the files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from recaccel.errors import DataError

SCHEMA_METADATA_KEY = b"recaccel.schema"


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
        if self.cardinality <= 0:
            raise DataError(f"sparse field {self.name!r} has cardinality {self.cardinality}; must be > 0")

    def arrow_type(self) -> pa.DataType:
        return pa.list_(pa.int64()) if self.multi_hot else pa.int64()


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
    """

    dense: tuple[str, ...]
    sparse: tuple[SparseField, ...]
    label: str = "label"
    label_kind: str = "binary"
    task_key: str | None = None
    timestamp: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.label_kind not in ("binary", "rating"):
            raise DataError(f"label_kind must be 'binary' or 'rating', got {self.label_kind!r}")
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
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FeatureSchema":
        raw = json.loads(text)
        raw["dense"] = tuple(raw["dense"])
        raw["sparse"] = tuple(SparseField(**f) for f in raw["sparse"])
        return cls(**raw)

    @classmethod
    def from_arrow(cls, schema: pa.Schema, path: str) -> "FeatureSchema":
        """Reads the recaccel schema stored in a file's metadata.

        Raises:
            DataError: if the file carries no recaccel schema.
        """
        meta = schema.metadata or {}
        if SCHEMA_METADATA_KEY not in meta:
            raise DataError(
                "no recaccel schema in the Parquet metadata; write files with "
                "recaccel.io.parquet.write_parquet or a recaccel-data converter",
                path=path,
            )
        return cls.from_json(meta[SCHEMA_METADATA_KEY].decode())

    def validate_arrow(self, schema: pa.Schema, path: str) -> None:
        """Checks that a file has every column of this schema with the right type.

        Raises:
            DataError: naming the file and the first missing or mistyped column.
        """
        expected = self.arrow_schema()
        for want in expected:
            idx = schema.get_field_index(want.name)
            if idx < 0:
                raise DataError("column is missing", path=path, column=want.name)
            got = schema.field(idx).type
            if not _compatible(got, want.type):
                raise DataError(f"column has type {got}, expected {want.type}", path=path, column=want.name)


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

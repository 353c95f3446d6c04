"""Reading any Parquet file through a ``[data.schema]`` mapping (no recaccel metadata needed).

:func:`resolve_mapping` checks a :class:`~recaccel.config.SchemaMapping` against a file's
Arrow schema and returns the :class:`FeatureSchema` the readers use, with a
:class:`MappedColumns` attached as its ``source``. Decoding a row group first passes the
table through :meth:`MappedColumns.canonical`, which turns the user's column types into
recaccel's (then the usual checks and ``data.invalid_*`` policies apply):

=============  ==============================================  ===========================
role           accepted Arrow types                            becomes
=============  ==============================================  ===========================
label          integer, floating, boolean                      float
dense          integer, floating, boolean                      float
sparse         integer, boolean, whole-number floating         int64 ids (``cardinality``)
sparse + hash  integer, floating, string, binary, dictionary    int64 bucket (``hash``)
sparse + vocab integer, whole-number floating, string, dict.    int64 row, 0 = unseen (``vocabulary``)
any sparse     a list of the above                             a multi-hot bag
task_key       integer, string, binary, dictionary of strings  int64 (strings: 63-bit hash)
timestamp      integer, timestamp, date                        int64 (the column's unit)
=============  ==============================================  ===========================

A null stays a null (so ``data.invalid_ids`` decides: error, or drop the row), a
floating id that is not a whole number is an error naming the file, row group, column
and row. Hashing is :mod:`recaccel.io.format.id_hash`, vocabularies
:mod:`recaccel.io.format.vocabulary`, dense transforms :mod:`recaccel.io.format.transforms`
(applied here, so every reader of the mapping sees the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recaccel.config import DenseTransform, SchemaMapping
from recaccel.errors import DataError
from recaccel.io.format.grouping import TASK_ID_BUCKETS
from recaccel.io.format.id_hash import hash_int_ids, hash_strings
from recaccel.io.format.schema import FeatureSchema, SparseField, field_index
from recaccel.io.format.transforms import apply_transform
from recaccel.io.format.vocabulary import load_vocabularies, lookup

_ROLES_NUMERIC = ("label", "dense")


@dataclass(frozen=True)
class ColumnPlan:
    """How one mapped column is converted.

    Attributes:
        name: the column.
        role: label, dense, sparse, task_key or timestamp.
        key: the config key naming it, for messages (``data.schema.sparse.item``).
        buckets: > 0: ids are hashed into this many buckets.
        vocabulary: the kept values of a ``vocabulary = true`` column (row ``i + 1`` holds
            ``vocabulary[i]``, row 0 every other value); None = no vocabulary.
        transform: a dense column's transform; None = as it is.
    """

    name: str
    role: str
    key: str
    buckets: int = 0
    vocabulary: pa.Array | None = None
    transform: DenseTransform | None = None


@dataclass(frozen=True)
class MappedColumns:
    """The column conversions of a resolved mapping (a :class:`FeatureSchema`'s ``source``).

    Attributes:
        mapping: the config's mapping.
        plans: one plan per mapped column, by column name.
        multi_hot: the sparse columns holding lists, as resolved from the first file.
    """

    mapping: SchemaMapping
    plans: dict[str, ColumnPlan]
    multi_hot: frozenset[str]

    def check(self, schema: pa.Schema, path: str) -> None:
        """Checks another file of the dataset: every column with an accepted type, and
        the same single-hot / multi-hot shape as the first file's.

        Raises:
            DataError: naming the file, the column and the config key.
        """
        for plan in self.plans.values():
            typ = _field_type(schema, plan, path)
            _check_type(plan, typ, path)
            if plan.role == "sparse" and _is_list(typ) != (plan.name in self.multi_hot):
                shape = "a list" if _is_list(typ) else "one id"
                raise DataError(
                    f"column holds {shape} per row here but not in the dataset's first file "
                    f"(config key {plan.key})",
                    path=path,
                    column=plan.name,
                )

    def canonical(self, table: pa.Table, path: str, row_group: int) -> pa.Table:
        """The row group's mapped columns in recaccel's types (others left as they are)."""
        for i, name in enumerate(table.column_names):
            plan = self.plans.get(name)
            if plan is None:
                continue
            col = table.column(i)
            arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
            converted = _convert(arr, plan, path, row_group)
            if converted is not arr:
                table = table.set_column(i, name, converted)
        return table


def resolve_mapping(
    mapping: SchemaMapping, schema: pa.Schema, path: str, vocabularies: dict[str, pa.Array] | None = None
) -> FeatureSchema:
    """The dataset schema a mapping gives a file with this Arrow schema.

    Args:
        mapping: the ``[data.schema]`` table.
        schema: the Arrow schema of the dataset's first file.
        path: that file, for messages and the schema's ``origin``.
        vocabularies: the kept values of each vocabulary column; None = read them from
            ``mapping.vocabulary_file`` (a model.json passes its recorded ones).

    Raises:
        DataError: naming the file, the column and the config key for a missing column
            or a column of a type its role cannot take.
    """
    plans = _plans(mapping, vocabularies)
    multi_hot = set()
    for plan in plans.values():
        typ = _field_type(schema, plan, path)
        _check_type(plan, typ, path)
        if plan.role == "sparse" and _is_list(typ):
            multi_hot.add(plan.name)
    sparse = tuple(
        SparseField(name, _table_rows(col, plans[name]), name in multi_hot)
        for name, col in mapping.sparse.items()
    )
    source = MappedColumns(mapping, plans, frozenset(multi_hot))
    return FeatureSchema(
        dense=tuple(mapping.dense),
        sparse=sparse,
        label=mapping.label,
        label_kind=mapping.label_kind,
        task_key=mapping.task_key,
        timestamp=mapping.timestamp,
        origin=path,
        source=source,
    )


def _table_rows(col, plan: ColumnPlan) -> int:
    """A sparse field's table size: its cardinality, buckets, or vocabulary rows (+ row 0)."""
    if plan.vocabulary is not None:
        return len(plan.vocabulary) + 1
    return col.cardinality or col.hash


def _vocabulary_sets(mapping: SchemaMapping) -> dict[str, pa.Array]:
    """The kept values of each vocabulary column (``true``, or ``"auto"`` where the file
    has one), from ``vocabulary_file``.

    Raises:
        DataError: naming the vocabulary file and config key of a column it lacks.
    """
    names = [n for n, c in mapping.sparse.items() if c.vocabulary]
    if not names or mapping.vocabulary_file is None:  # "auto" without a file: hashes
        return {}
    path = str(mapping.vocabulary_file)
    vocabularies = load_vocabularies(path, mapping.vocabulary_sha256)
    sets = {}
    for name in names:
        if name not in vocabularies and mapping.sparse[name].vocabulary == "auto":
            continue  # no vocabulary for this column (too many values): its hash
        if name not in vocabularies:
            raise DataError(
                f"no vocabulary of column {name!r} (config key data.schema.sparse.{name}.vocabulary): "
                "rerun recaccel-data inspect --write-schema over the data",
                path=path,
            )
        sets[name] = vocabularies[name].value_set(mapping.sparse[name].min_count)
    return sets


def _plans(mapping: SchemaMapping, vocab: dict[str, pa.Array] | None) -> dict[str, ColumnPlan]:
    vocab = _vocabulary_sets(mapping) if vocab is None else vocab
    plans = [ColumnPlan(mapping.label, "label", "data.schema.label")]
    plans += [
        ColumnPlan(d, "dense", f"data.schema.dense[{i}]", transform=mapping.transforms.get(d))
        for i, d in enumerate(mapping.dense)
    ]
    plans += [
        ColumnPlan(n, "sparse", f"data.schema.sparse.{n}", c.hash, vocab.get(n))
        for n, c in mapping.sparse.items()
    ]
    for role in ("task_key", "timestamp"):
        name = getattr(mapping, role)
        if name is not None:
            plans.append(ColumnPlan(name, role, f"data.schema.{role}"))
    return {p.name: p for p in plans}


def _field_type(schema: pa.Schema, plan: ColumnPlan, path: str) -> pa.DataType:
    idx = field_index(schema, plan.name, path)
    if idx < 0:
        names = ", ".join(schema.names[:20]) + (", ..." if len(schema.names) > 20 else "")
        raise DataError(
            f"no such column (named by config key {plan.key}); the file has: {names}",
            path=path,
            column=plan.name,
        )
    return schema.field(idx).type


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ)


def _is_text(typ: pa.DataType) -> bool:
    return any(
        f(typ)
        for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    )


def _is_number(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)


def _check_type(plan: ColumnPlan, typ: pa.DataType, path: str) -> None:
    ok, need = _accepts(plan, typ)
    if not ok:
        raise DataError(f"column has type {typ}; {need} (config key {plan.key})", path=path, column=plan.name)


def _accepts(plan: ColumnPlan, typ: pa.DataType) -> tuple[bool, str]:
    """(whether ``typ`` suits the plan's role, what the role needs)."""
    if plan.role in _ROLES_NUMERIC:
        return _is_number(typ), f"a {plan.role} column must be integer, floating or boolean"
    if plan.role == "task_key":
        item = typ.value_type if pa.types.is_dictionary(typ) else typ
        return pa.types.is_integer(typ) or _is_text(item), "a task key must be an integer or string column"
    if plan.role == "timestamp":
        ok = pa.types.is_integer(typ) or pa.types.is_timestamp(typ) or pa.types.is_date(typ)
        return ok, "a timestamp must be an integer, timestamp or date column"
    item = typ.value_type if _is_list(typ) else typ
    if pa.types.is_dictionary(item):
        item = item.value_type
    if _is_text(item):
        ok = plan.buckets > 0 or plan.vocabulary is not None
        return (
            ok,
            f"string ids need hash = N buckets ({plan.key}.hash) or vocabulary = true, not a cardinality",
        )
    return _is_number(item), "a sparse column must hold integer or string ids (or a list of them)"


def _convert(arr: pa.Array, plan: ColumnPlan, path: str, row_group: int) -> pa.Array:
    typ = arr.type
    if plan.role in _ROLES_NUMERIC:
        if plan.transform is not None and plan.transform.transform != "none":
            return _transformed(arr, plan.transform)
        return arr if pa.types.is_integer(typ) or pa.types.is_floating(typ) else arr.cast(pa.float32())
    if plan.role == "timestamp":
        return arr if pa.types.is_integer(typ) else arr.cast(pa.int64())
    if plan.role == "task_key":
        return _task_ids(arr)
    if not _is_list(typ):
        return _ids(arr, plan, path, row_group, None)
    parent = np.repeat(np.arange(len(arr)), pc.list_value_length(arr).fill_null(0).to_numpy())
    flat = _ids(arr.flatten(), plan, path, row_group, parent)
    offsets = np.zeros(len(arr) + 1, dtype=np.int32 if pa.types.is_list(typ) else np.int64)
    np.cumsum(pc.list_value_length(arr).fill_null(0).to_numpy(), out=offsets[1:])
    cls = pa.ListArray if pa.types.is_list(typ) else pa.LargeListArray
    mask = arr.is_null() if arr.null_count else None
    return cls.from_arrays(pa.array(offsets), flat, mask=mask)


def _task_ids(arr: pa.Array) -> pa.Array:
    """A task key column as int64: integers as they are, strings hashed as
    :func:`recaccel.io.format.grouping.task_id` hashes one (nulls stay nulls)."""
    if pa.types.is_integer(arr.type):
        return arr
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    return pa.array(hash_strings(arr, TASK_ID_BUCKETS), pa.int64(), mask=nulls)


def _transformed(arr: pa.Array, transform: DenseTransform) -> pa.Array:
    """A dense column through its transform, as float32 (nulls stay nulls)."""
    if not pa.types.is_floating(arr.type):
        arr = arr.cast(pa.float64())
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    values = apply_transform(arr.fill_null(0).to_numpy(zero_copy_only=False), transform)
    return pa.array(values, pa.float32(), mask=nulls)


def _vocabulary_rows(
    arr: pa.Array, plan: ColumnPlan, path: str, row_group: int, parent: np.ndarray | None
) -> pa.Array:
    """Vocabulary rows (int64, 0 = out of vocabulary) of one id column; nulls stay nulls."""
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    typ = arr.type.value_type if pa.types.is_dictionary(arr.type) else arr.type
    if _is_text(typ) != pa.types.is_string(plan.vocabulary.type):
        kind = "strings" if pa.types.is_string(plan.vocabulary.type) else "integers"
        raise DataError(
            f"column has type {arr.type} but its vocabulary holds {kind} (config key {plan.key})",
            path=path,
            column=plan.name,
            row_group=row_group,
        )
    if pa.types.is_floating(typ):
        whole = _whole(arr.fill_null(0).to_numpy(zero_copy_only=False), plan, path, row_group, parent)
        arr = pa.array(whole.astype(np.int64))
    elif pa.types.is_boolean(typ):
        arr = arr.cast(pa.int64())
    return pa.array(lookup(arr, plan.vocabulary), pa.int64(), mask=nulls)


def _ids(arr: pa.Array, plan: ColumnPlan, path: str, row_group: int, parent: np.ndarray | None) -> pa.Array:
    """One id column (or a list column's flattened ids; ``parent`` = their rows) as
    int64, hashed into ``plan.buckets`` when set, or its vocabulary rows; nulls stay nulls."""
    if plan.vocabulary is not None:
        return _vocabulary_rows(arr, plan, path, row_group, parent)
    typ = arr.type
    if not plan.buckets and pa.types.is_integer(typ):
        return arr
    nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    if pa.types.is_dictionary(typ):
        if _is_text(typ.value_type):  # hash each distinct string once
            buckets = hash_strings(arr.dictionary, plan.buckets)
            values = buckets[arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)]
            return pa.array(values, pa.int64(), mask=nulls)
        arr, typ = arr.dictionary_decode(), typ.value_type
    if _is_text(typ):
        return pa.array(hash_strings(arr, plan.buckets), pa.int64(), mask=nulls)
    values = arr.fill_null(0).to_numpy(zero_copy_only=False)
    if pa.types.is_floating(typ):
        values = _whole(values, plan, path, row_group, parent)
    values = values.astype(np.int64)
    if plan.buckets:
        values = hash_int_ids(values, plan.buckets)
    return pa.array(values, pa.int64(), mask=nulls)


def _whole(
    values: np.ndarray, plan: ColumnPlan, path: str, row_group: int, parent: np.ndarray | None
) -> np.ndarray:
    """Floating ids (pandas stores an integer column with missing values as float64) must
    be whole numbers within int64 range."""
    bad = ~np.isfinite(values) | (values != np.floor(values)) | (np.abs(values) >= 2.0**63)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        row = j if parent is None else int(parent[j])
        raise DataError(
            f"id {float(values[j]):g} at row {row} is not a whole number (config key {plan.key}: map a "
            "real-valued column under data.schema.dense)",
            path=path,
            column=plan.name,
            row_group=row_group,
        )
    return values

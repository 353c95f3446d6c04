"""Decoding one Arrow row group into validated :class:`Columns`.

What counts as bad, per column role:

- sparse ids: an id < 0 or >= cardinality, a null single-hot id, a null list, or a
  null element inside a list (an empty list is a legal empty bag);
- dense values: NaN, +-inf or null;
- labels: NaN, +-inf or null, and for ``label_kind == "binary"`` anything but 0 or 1.

Policies (see :class:`Policies`): ``error`` raises :class:`DataError` naming the file,
row group, column, first bad value and its row index inside the row group; ``skip``
drops the row; ``clip`` clamps ids into ``[0, cardinality)``; ``hash`` maps an id to
``id mod cardinality`` (non-negative, Python-style); ``zero`` replaces a bad dense value
by 0. A null id cannot be clamped or hashed, so under ``clip`` and ``hash`` its row is
dropped (and counted as skipped). Side columns (task key, timestamp) must not be null
under any policy.

Counters (``stats``) count per value decoded, before rows are dropped:
``rows_read``, ``rows_skipped`` (rows dropped for any reason),
``rows_skipped_invalid_ids`` / ``_dense`` / ``_labels`` (a row bad in two ways counts
in both), ``ids_clipped``, ``ids_hashed``, ``dense_zeroed``. A warning is logged the
first time each counter becomes non-zero in a given stats dict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recaccel.config import DataConfig, InvalidDensePolicy, InvalidIdsPolicy, InvalidLabelsPolicy, choices
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.blocks import BLOCK_MIN_FIELDS, clean_dense_block, valid_one_hot_block
from recaccel.io.format.columns import Columns, id_dtype, single_hot_offsets
from recaccel.io.format.schema import FeatureSchema, SparseField

logger = logging.getLogger(__name__)

DECODE_COUNTERS = (
    "rows_read",
    "rows_skipped",
    "rows_skipped_invalid_ids",
    "rows_skipped_invalid_dense",
    "rows_skipped_invalid_labels",
    "ids_clipped",
    "ids_hashed",
    "dense_zeroed",
)


@dataclass(frozen=True)
class Policies:
    """What to do with bad values (see the module docstring).

    Raises:
        ConfigError: on an unknown policy name.
    """

    invalid_ids: InvalidIdsPolicy = "error"
    invalid_dense: InvalidDensePolicy = "error"
    invalid_labels: InvalidLabelsPolicy = "error"

    def __post_init__(self) -> None:
        for key, value, allowed in (
            ("invalid_ids", self.invalid_ids, choices(InvalidIdsPolicy)),
            ("invalid_dense", self.invalid_dense, choices(InvalidDensePolicy)),
            ("invalid_labels", self.invalid_labels, choices(InvalidLabelsPolicy)),
        ):
            if value not in allowed:
                raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")

    @classmethod
    def from_config(cls, data: DataConfig) -> Policies:
        """The ``[data]`` section's ``invalid_*`` policies."""
        return cls(data.invalid_ids, data.invalid_dense, data.invalid_labels)


@dataclass(frozen=True)
class Projection:
    """The columns to decode: a subset of the schema's dense and sparse features.

    The label is always decoded; ``side`` names integer side columns (task key,
    timestamp) carried along as int64.
    """

    dense: tuple[str, ...]
    sparse: tuple[SparseField, ...]
    side: tuple[str, ...] = ()

    @classmethod
    def select(
        cls,
        schema: FeatureSchema,
        columns: list[str] | tuple[str, ...] | None = None,
        side: tuple[str, ...] = (),
    ) -> Projection:
        """Projects ``schema`` onto ``columns`` (dense/sparse names; None = all), in schema order.

        Raises:
            ConfigError: naming a column that is not a dense or sparse feature of the schema.
        """
        allowed = {c for c in (schema.task_key, schema.timestamp) if c is not None}
        for name in side:
            if name not in allowed:
                raise ConfigError(f"side column {name!r} is not the schema's task key or timestamp")
        if columns is None:
            return cls(tuple(schema.dense), tuple(schema.sparse), tuple(side))
        wanted = set(columns)
        known = set(schema.dense) | set(schema.sparse_names)
        unknown = sorted(wanted - known)
        if unknown:
            raise ConfigError(
                f"projected column(s) {unknown} are not dense or sparse features of the schema "
                f"(valid: {sorted(known)})"
            )
        return cls(
            tuple(c for c in schema.dense if c in wanted),
            tuple(f for f in schema.sparse if f.name in wanted),
            tuple(side),
        )

    def arrow_columns(self, schema: FeatureSchema) -> list[str]:
        """Parquet columns to read, in file order."""
        return [schema.label, *self.dense, *(f.name for f in self.sparse), *self.side]


def new_decode_stats() -> dict[str, int]:
    """A zeroed counter dict for :func:`row_group_to_columns`."""
    return {k: 0 for k in DECODE_COUNTERS}


def counter_increments(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters of ``after`` that grew since the snapshot ``before``, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def add_counts(stats: dict[str, int], increments: dict[str, int]) -> None:
    """Adds ``increments`` (e.g. from :func:`counter_increments`) to the counters ``stats``."""
    for key, value in increments.items():
        stats[key] = stats.get(key, 0) + value


def row_group_to_columns(
    table: pa.Table,
    schema: FeatureSchema,
    policies: Policies,
    path: str,
    row_group: int,
    *,
    projection: Projection | None = None,
    stats: dict[str, int] | None = None,
) -> Columns:
    """Converts one row group to validated :class:`Columns`, applying ``policies``.

    Args:
        table: the row group as read (it must hold the projection's columns).
        schema: the dataset schema (cardinalities, label kind).
        policies: bad-value policies.
        path: the file, for error messages.
        row_group: the row group index, for error messages.
        projection: which columns to decode; None = every dense and sparse feature.
        stats: counters to update (see module docstring); None = do not count.

    Returns:
        The kept rows: dense float32 [n, Dd], labels float32 [n], one CSR per field;
        batches made from them carry int32 ids when every projected field's cardinality
        fits int32, else int64 (``Columns.id_dtype``).

    Raises:
        DataError: under an ``error`` policy, or for a null side column value.
    """
    proj = projection if projection is not None else Projection.select(schema)
    stats = stats if stats is not None else new_decode_stats()
    if schema.source is not None:  # a [data.schema] mapping: the user's types to recaccel's
        table = schema.source.canonical(table, path, row_group)
    n = table.num_rows
    _count(stats, "rows_read", n)
    drop = np.zeros(n, dtype=bool)

    by_name = dict(zip(table.column_names, table.columns))  # one lookup table per row group
    labels, bad = _decode_labels(by_name, schema, policies, path, row_group)
    _drop_rows(stats, drop, bad, "rows_skipped_invalid_labels")

    dense = _dense_columns(by_name, proj.dense, policies, path, row_group, stats, drop)
    ids = np.result_type(*(id_dtype(f.cardinality) for f in proj.sparse)) if proj.sparse else None
    values, offsets, block = _sparse_columns(
        by_name, proj.sparse, ids, policies, path, row_group, stats, drop
    )

    side = {}
    for name in proj.side:
        arr = _column(by_name, name, path, row_group)
        if arr.null_count:
            row = int(np.flatnonzero(_null_mask(arr))[0])
            raise DataError(f"null value at row {row}", path=path, column=name, row_group=row_group)
        side[name] = np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)

    single = [not f.multi_hot for f in proj.sparse]  # null single-hot rows are dropped or raised
    keys = [f.name for f in proj.sparse]
    cols = Columns(dense, labels, keys, values, offsets, side, single, ids=block, id_dtype=ids)
    if drop.any():
        _count(stats, "rows_skipped", int(drop.sum()))
        cols = cols.take(np.flatnonzero(~drop))
    return cols


def _column(by_name: dict[str, pa.ChunkedArray], name: str, path: str, row_group: int) -> pa.Array:
    col = by_name.get(name)
    if col is None:
        raise DataError("column is missing", path=path, column=name, row_group=row_group)
    if isinstance(col, pa.ChunkedArray):  # one chunk is the common case: no copy then
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _dense_columns(
    by_name: dict[str, pa.ChunkedArray],
    names: tuple[str, ...],
    policies: Policies,
    path: str,
    row_group: int,
    stats: dict[str, int],
    drop: np.ndarray,
) -> np.ndarray:
    """float32 [n, Dd]: the dense columns; rows to drop are marked in ``drop``."""
    dense = clean_dense_block(by_name, names) if len(names) >= BLOCK_MIN_FIELDS else None
    if dense is not None:
        return dense
    # A null, NaN or inf somewhere, a missing column, or few columns: column by column.
    dense = np.empty((drop.shape[0], len(names)), dtype=np.float32)
    dense_bad = np.zeros(drop.shape[0], dtype=bool)
    for j, name in enumerate(names):
        dense[:, j], bad = _decode_dense(
            _column(by_name, name, path, row_group), name, policies, path, row_group, stats
        )
        if bad is not None:
            dense_bad |= bad
    _drop_rows(stats, drop, dense_bad, "rows_skipped_invalid_dense")
    return dense


def _sparse_columns(
    by_name: dict[str, pa.ChunkedArray],
    fields: tuple[SparseField, ...],
    ids: np.dtype | None,
    policies: Policies,
    path: str,
    row_group: int,
    stats: dict[str, int],
    drop: np.ndarray,
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray | None]:
    """(values, offsets) per field and the row-major block of the single-hot ids (None
    when they were checked column by column); rows to drop are marked in ``drop``."""
    steps = single_hot_offsets(drop.shape[0])  # shared by every single-hot field
    one_hot = [f for f in fields if not f.multi_hot]
    block = valid_one_hot_block(by_name, one_hot, ids) if len(one_hot) >= BLOCK_MIN_FIELDS else None
    values, offsets = [], []
    ids_bad = np.zeros(drop.shape[0], dtype=bool)
    k = 0  # column of the next single-hot field in ``block``
    for sf in fields:
        if block is not None and not sf.multi_hot:  # checked with the block: valid
            val, off, bad = block[:, k], steps, None
            k += 1
        else:
            val, off, bad = _decode_ids(
                _column(by_name, sf.name, path, row_group), sf, policies, path, row_group, stats, steps
            )
        values.append(val)
        offsets.append(off)
        if bad is not None:
            ids_bad |= bad
    _drop_rows(stats, drop, ids_bad, "rows_skipped_invalid_ids")
    return values, offsets, block


def _null_mask(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.zeros(len(arr), dtype=bool)
    return arr.is_null().to_numpy(zero_copy_only=False)


def _numbers(arr: pa.Array) -> np.ndarray:
    """Values of a primitive array with nulls replaced by 0, in the array's own dtype."""
    if arr.null_count:
        arr = pc.fill_null(arr, 0)
    return arr.to_numpy(zero_copy_only=False)


def _decode_labels(
    by_name: dict[str, pa.ChunkedArray], schema: FeatureSchema, policies: Policies, path: str, row_group: int
) -> tuple[np.ndarray, np.ndarray]:
    arr = _column(by_name, schema.label, path, row_group)
    nulls = _null_mask(arr)
    labels = _numbers(arr).astype(np.float32)
    bad = nulls | ~np.isfinite(labels)
    if schema.label_kind == "binary":
        bad |= (labels != 0) & (labels != 1)
    if bad.any() and policies.invalid_labels == "error":
        row = int(np.flatnonzero(bad)[0])
        shown = "null" if nulls[row] else repr(float(labels[row]))
        rule = "not 0 or 1 (label_kind='binary')" if schema.label_kind == "binary" else "not finite"
        raise DataError(
            f"invalid label {shown} at row {row}: {rule}", path=path, column=schema.label, row_group=row_group
        )
    return labels, bad


def _decode_dense(
    arr: pa.Array, name: str, policies: Policies, path: str, row_group: int, stats: dict[str, int]
) -> tuple[np.ndarray, np.ndarray | None]:
    """Returns (values float32 [n], bad-row mask [n] or None when no row is bad)."""
    # float64 beyond float32 range becomes inf: bad. The caller copies the values.
    vals = _numbers(arr).astype(np.float32, copy=False)
    # A NaN or inf makes the sum NaN or inf; a finite sum clears the column in one pass
    # (a sum that overflows only sends it down the exact path).
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: the exact path decides
        total = vals.sum(dtype=np.float32)
    if arr.null_count == 0 and np.isfinite(total):
        return vals, None
    nulls = _null_mask(arr)
    bad = nulls | ~np.isfinite(vals)
    if not bad.any():
        return vals, None
    vals = vals.copy()  # may be a read-only view of Arrow memory
    if policies.invalid_dense == "error":
        row = int(np.flatnonzero(bad)[0])
        shown = "null" if nulls[row] else repr(float(vals[row]))
        raise DataError(
            f"invalid dense value {shown} at row {row}", path=path, column=name, row_group=row_group
        )
    if policies.invalid_dense == "zero":
        vals[bad] = 0.0
        _count(stats, "dense_zeroed", int(bad.sum()))
        return vals, None
    return vals, bad


def _decode_ids(
    arr: pa.Array,
    sf: SparseField,
    policies: Policies,
    path: str,
    row_group: int,
    stats: dict[str, int],
    steps: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Returns (values [N], offsets int64 [n+1], bad-row mask [n] or None when no row is
    bad); ``steps`` is ``arange(n+1)``, the offsets of a single-hot field. Valid int32 or
    int64 ids stay as Arrow decoded them (no copy: the copy into a batch narrows them);
    other ids are converted to the field's :func:`id_dtype`."""
    n = len(arr)
    dtype = id_dtype(sf.cardinality)
    if sf.multi_hot:
        lengths = _numbers(pc.list_value_length(arr)).astype(np.int64)  # null list -> 0
        flat = arr.flatten()  # skips the contents of null lists
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
    else:
        lengths = None
        flat = arr
        offsets = steps
    raw = _numbers(flat)
    # Compare in the stored dtype so uint64 ids beyond int64 range are still caught;
    # nulls were filled with 0 (in range). A range check first: no mask in the common case.
    if arr.null_count == 0 and flat.null_count == 0 and _all_in_range(raw, sf.cardinality):
        return _as_ids(raw, dtype), offsets, None
    row_null = _null_mask(arr)
    elem_null = _null_mask(flat)
    out_of_range = (raw < 0) | (raw >= sf.cardinality)
    null_rows = row_null.copy() if sf.multi_hot else row_null
    has_bad_elem = out_of_range | elem_null
    if not (has_bad_elem.any() or null_rows.any()):
        return _as_ids(raw, dtype), offsets, None

    parent = (
        np.repeat(np.arange(n, dtype=np.int64), lengths) if sf.multi_hot else np.arange(n, dtype=np.int64)
    )
    if sf.multi_hot:
        null_rows[parent[elem_null]] = True
    if policies.invalid_ids == "error":
        _raise_first_bad_id(sf, raw, parent, out_of_range, elem_null, row_null, path, row_group)
    if policies.invalid_ids == "skip":
        bad = null_rows.copy()
        bad[parent[out_of_range]] = True
        return raw.astype(dtype), offsets, bad  # a bad id may wrap: its row is dropped
    vals = raw.astype(dtype)  # a bad id may wrap here: it is replaced below
    if out_of_range.any():
        if policies.invalid_ids == "clip":
            vals[out_of_range] = np.clip(raw[out_of_range], 0, sf.cardinality - 1).astype(dtype)
            _count(stats, "ids_clipped", int(out_of_range.sum()))
        else:
            vals[out_of_range] = np.mod(raw[out_of_range], sf.cardinality).astype(dtype)
            _count(stats, "ids_hashed", int(out_of_range.sum()))
    return vals, offsets, null_rows  # a null cannot be repaired: drop its row


def _as_ids(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Valid ids: Arrow's own int32/int64 array as it is, anything else as ``dtype``."""
    return raw if raw.dtype in (np.int32, np.int64) else raw.astype(dtype)


def _all_in_range(raw: np.ndarray, cardinality: int) -> bool:
    """Whether every id is in ``[0, cardinality)``, in one pass for 64-bit ids."""
    if raw.size == 0:
        return True
    if raw.dtype == np.int64:  # negatives wrap to >= 2**63 as uint64: one max() checks both ends
        return int(raw.view(np.uint64).max()) < cardinality
    return int(raw.min()) >= 0 and int(raw.max()) < cardinality


def _raise_first_bad_id(
    sf: SparseField,
    raw: np.ndarray,
    parent: np.ndarray,
    out_of_range: np.ndarray,
    elem_null: np.ndarray,
    row_null: np.ndarray,
    path: str,
    row_group: int,
) -> None:
    candidates = []  # (row, description)
    if row_null.any():
        row = int(np.flatnonzero(row_null)[0])
        candidates.append((row, f"null {'list' if sf.multi_hot else 'id'} at row {row}"))
    bad_elem = out_of_range | elem_null
    if bad_elem.any():
        j = int(np.flatnonzero(bad_elem)[0])
        row = int(parent[j])
        if elem_null[j]:
            candidates.append((row, f"null id at row {row}"))
        else:
            candidates.append(
                (row, f"invalid id {int(raw[j])} at row {row} (valid ids are 0..{sf.cardinality - 1})")
            )
    row, what = min(candidates)
    raise DataError(what, path=path, column=sf.name, row_group=row_group)


def _drop_rows(stats: dict[str, int], drop: np.ndarray, bad: np.ndarray, counter: str) -> None:
    if bad.any():
        _count(stats, counter, int(bad.sum()))
        drop |= bad


def _count(stats: dict[str, int], key: str, n: int) -> None:
    if n == 0:
        return
    before = stats.get(key, 0)
    stats[key] = before + n
    if before == 0 and key != "rows_read":
        logger.warning("recaccel reader: %s (first occurrence; see the reader's counters)", key)

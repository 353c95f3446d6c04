"""The decoder's block path: with BLOCK_MIN_FIELDS or more one-hot id (or dense) columns
it checks them as one 2-D block. Its output, counters and errors must be those of the
per-column path, which a projection onto fewer columns takes on the same data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recaccel.errors import DataError
from recaccel.io.format.blocks import BLOCK_MIN_FIELDS, valid_one_hot_block
from recaccel.io.format.columns import take_batch
from recaccel.io.format.decode import Policies, Projection, new_decode_stats, row_group_to_columns
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader

WIDE = BLOCK_MIN_FIELDS + 6  # one-hot fields and dense columns: enough for the block path
CARD = 50
CHECKED = Policies()  # error on every bad value


def wide_table(
    seed: int, n: int = 40, *, int64_fields: tuple[int, ...] = ()
) -> tuple[pa.Table, FeatureSchema]:
    """WIDE one-hot int32 fields (int64 where listed), one multi-hot field between them,
    WIDE float32 dense columns; every value valid."""
    rng = np.random.default_rng(seed)
    names = [f"c{i}" for i in range(WIDE)]
    sparse = [SparseField(name, CARD + i) for i, name in enumerate(names)]
    sparse.insert(3, SparseField("bag", 9, multi_hot=True))
    schema = FeatureSchema(dense=tuple(f"d{j}" for j in range(WIDE)), sparse=tuple(sparse))
    cols = {"label": pa.array(rng.integers(0, 2, n).astype(np.float32))}
    cols.update({d: pa.array(rng.standard_normal(n).astype(np.float32)) for d in schema.dense})
    for i, name in enumerate(names):
        ids = rng.integers(0, CARD + i, n)
        cols[name] = pa.array(ids.astype(np.int64 if i in int64_fields else np.int32))
    cols["bag"] = pa.array(
        [list(rng.integers(0, 9, rng.integers(0, 3))) for _ in range(n)], pa.list_(pa.int32())
    )
    return pa.table(cols), schema


def field_of(batch, name: str) -> np.ndarray:
    """A batch's ids of one field followed by its offsets."""
    values, offsets, _ = batch.sparse.field(name)
    return np.concatenate([values.numpy(), offsets.numpy()])


def decode(table: pa.Table, schema: FeatureSchema, policies: Policies = CHECKED, columns=None):
    stats = new_decode_stats()
    proj = Projection.select(schema, columns)
    cols = row_group_to_columns(table, schema, policies, "f.parquet", 2, projection=proj, stats=stats)
    return cols, stats


def per_column_fields(schema: FeatureSchema) -> list[list[str]]:
    """Projections of fewer than BLOCK_MIN_FIELDS columns each (the per-column path)."""
    names = [*schema.dense, *schema.sparse_names]
    step = BLOCK_MIN_FIELDS // 2
    return [names[i : i + step] for i in range(0, len(names), step)]


def assert_same_as_per_column(table: pa.Table, schema: FeatureSchema, policies: Policies = CHECKED) -> None:
    whole, stats = decode(table, schema, policies)
    assert whole.ids is not None  # the block path was taken
    batch = take_batch(whole, np.random.default_rng(1).permutation(whole.num_rows))
    order = np.random.default_rng(1).permutation(whole.num_rows)
    for names in per_column_fields(schema):
        part, part_stats = decode(table, schema, policies, names)
        assert part.ids is None or len(names) >= BLOCK_MIN_FIELDS
        np.testing.assert_array_equal(whole.labels, part.labels)
        for name in names:
            if name in schema.dense:
                k = Projection.select(schema, names).dense.index(name)
                np.testing.assert_array_equal(whole.dense[:, schema.dense.index(name)], part.dense[:, k])
                continue
            f, g = whole.keys.index(name), part.keys.index(name)
            np.testing.assert_array_equal(whole.values[f], part.values[g])
            np.testing.assert_array_equal(whole.offsets[f], part.offsets[g])
        small = take_batch(part, order)
        for name in part.keys:
            np.testing.assert_array_equal(field_of(batch, name), field_of(small, name))
    assert batch.sparse.values.dtype == small.sparse.values.dtype
    assert stats["rows_read"] == table.num_rows


def test_block_path_decodes_wide_row_groups_like_the_per_column_path():
    table, schema = wide_table(0)
    assert_same_as_per_column(table, schema)


def test_int64_and_mixed_width_id_columns_decode_like_the_per_column_path():
    table, schema = wide_table(1, int64_fields=tuple(range(WIDE)))  # int64 stored, int32 batches
    assert_same_as_per_column(table, schema)
    table, schema = wide_table(2, int64_fields=(5, 17))  # mixed widths: per-column after all
    whole, _ = decode(table, schema)
    assert whole.ids is None
    part, _ = decode(table, schema, columns=["c5", "c6"])
    np.testing.assert_array_equal(whole.values[whole.keys.index("c5")], part.values[0])


def with_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, values)


def test_an_out_of_range_id_in_a_wide_row_group_raises_the_per_column_message():
    table, schema = wide_table(3)
    ids = table.column("c40").to_numpy().copy()
    ids[7], ids[9] = CARD + 40, -1
    table = with_column(table, "c40", pa.array(ids))
    with pytest.raises(DataError) as caught:
        decode(table, schema)
    text = str(caught.value)
    assert f"invalid id {CARD + 40} at row 7 (valid ids are 0..{CARD + 39})" in text
    assert "c40" in text and "f.parquet" in text


@pytest.mark.parametrize("policy", ["skip", "clip", "hash"])
def test_bad_ids_in_a_wide_row_group_are_repaired_and_counted_as_per_column(policy):
    table, schema = wide_table(4)
    ids = table.column("c10").to_numpy().copy()
    ids[[2, 5]] = [-7, CARD + 10 + 3]
    table = with_column(table, "c10", pa.array(ids))
    whole, stats = decode(table, schema, Policies(invalid_ids=policy))
    part, part_stats = decode(table, schema, Policies(invalid_ids=policy), ["c10", "c11"])
    assert stats == part_stats
    assert stats["rows_skipped"] + stats["ids_clipped"] + stats["ids_hashed"] == 2
    np.testing.assert_array_equal(whole.values[whole.keys.index("c10")], part.values[0])
    np.testing.assert_array_equal(whole.labels, part.labels)


@pytest.mark.parametrize("policy", ["error", "skip", "zero"])
def test_a_nan_among_many_dense_columns_is_handled_as_per_column(policy):
    table, schema = wide_table(5)
    vals = table.column("d30").to_numpy().copy()
    vals[4] = np.nan
    table = with_column(table, "d30", pa.array(vals))
    if policy == "error":
        with pytest.raises(DataError, match="invalid dense value nan at row 4"):
            decode(table, schema, Policies(invalid_dense=policy))
        return
    whole, stats = decode(table, schema, Policies(invalid_dense=policy))
    part, part_stats = decode(table, schema, Policies(invalid_dense=policy), ["d30", "d31"])
    assert stats == part_stats
    np.testing.assert_array_equal(whole.dense[:, 30], part.dense[:, 0])


def test_int32_ids_of_a_table_beyond_int32_pass_unless_negative():
    big = SparseField("x", 3 * 2**30)  # above 2**31: every non-negative int32 id is valid
    by_name = {"x": pa.chunked_array([pa.array([0, 2**31 - 1, 5], pa.int32())])}
    block = valid_one_hot_block(by_name, [big], np.dtype(np.int64))
    np.testing.assert_array_equal(block[:, 0], [0, 2**31 - 1, 5])
    assert block.dtype == np.int64
    by_name = {"x": pa.chunked_array([pa.array([0, -(2**31)], pa.int32())])}
    assert valid_one_hot_block(by_name, [big], np.dtype(np.int64)) is None


def test_shuffled_and_plain_readers_over_a_wide_file_match_a_narrow_projection(tmp_path: Path):
    table, schema = wide_table(6, n=300)
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=70)
    narrow = ["c0", "bag", "c50"]
    for shuffle in (True, False):
        opts = ReadOptions(seed=3, shuffle=shuffle, read_ahead=0)
        wide_batches = list(BatchReader(tmp_path, 32, opts, shuffle_buffer_rows=100, schema=schema))
        narrow_batches = list(
            BatchReader(tmp_path, 32, opts, shuffle_buffer_rows=100, schema=schema, columns=narrow)
        )
        assert len(wide_batches) == len(narrow_batches) == 10
        for w, s in zip(wide_batches, narrow_batches):
            np.testing.assert_array_equal(w.labels.numpy(), s.labels.numpy())
            for name in narrow:
                np.testing.assert_array_equal(field_of(w, name), field_of(s, name))

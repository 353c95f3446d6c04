"""A pre-decoded cache reads as its Parquet source: the same dataset info and bit-identical
batch streams, states and counters (shuffled or not, 0 or 2 workers, rows dropped by a
policy, multi-hot fields, a Parquet-read position resumed on the cache)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recaccel.errors import ConfigError
from recaccel.io.format.cache.build import build_cache
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.decode import Policies
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers import BatchReader, ReadOptions
from tests.helpers.reader_resume import position_after, rest_from
from tests.helpers.row_data import make_columns, make_schema, skipping_dataset
from tests.helpers.same_batches import assert_same_batches

SKIP = Policies(invalid_ids="skip")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """300 rows in 3 files of 25-row groups, a multi-hot field, 23 rows with an id past its table."""
    return skipping_dataset(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def cache(source, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("caches") / "skip"
    build_cache(source, dst, policies=SKIP)
    return dst


def reader(path: Path, workers: int = 0, **options) -> BatchReader:
    opts = ReadOptions(seed=3, workers=workers, policies=SKIP, **options)
    return BatchReader(path, 16, opts, shuffle_buffer_rows=40)


def test_cache_opens_as_the_same_dataset_info_as_its_source(source, cache):
    parquet, cached = open_dataset(source), open_dataset(cache)
    assert cached == parquet  # schema, files, row groups (paths, numbers, footer rows)
    assert cached.cache == cache and parquet.cache is None


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, False])
def test_cached_batch_streams_states_and_counters_equal_the_parquet_ones(source, cache, workers, shuffle):
    want = list(reader(source, 0, shuffle=shuffle).iter_with_state())
    got = list(reader(cache, workers, shuffle=shuffle).iter_with_state())
    assert_same_batches([b for b, _ in want], [b for b, _ in got])
    assert [s for _, s in got] == [s for _, s in want]
    assert got[-1][1]["counters"]["rows_skipped"] == 23


def test_projected_columns_from_the_cache_equal_the_parquet_ones(tmp_path):
    schema = make_schema(2, [False, True, False], [50, 20, 7])
    write_parquet(tmp_path / "src", schema, make_columns(schema, 120, 3), rows_per_row_group=25)
    build_cache(tmp_path / "src", tmp_path / "cache")

    def run(path: Path) -> list:
        opts = ReadOptions(seed=5)
        return list(BatchReader(path, 16, opts, shuffle_buffer_rows=40, columns=["d1", "s1"]))

    got = run(tmp_path / "cache")
    assert_same_batches(run(tmp_path / "src"), got)
    assert got[0].sparse.keys == ["s1"] and got[0].dense.shape[1] == 1


def test_a_column_subset_of_a_cache_that_dropped_rows_is_refused_in_one_line(cache):
    # Parquet would keep the rows whose bad ids lie in a column left out; the cache cannot.
    opts = ReadOptions(seed=5, policies=SKIP)
    with pytest.raises(
        ConfigError, match=r"dropping or repairing values \(rows_skipped.*needs the Parquet source"
    ):
        list(BatchReader(cache, 16, opts, columns=["d1", "s1"]))


def test_a_parquet_read_position_resumes_on_the_cache_mid_epoch(source, cache):
    full = list(reader(source))
    rest = rest_from(reader(cache, 2), position_after(reader(source), 5))
    assert_same_batches(full[5:], [b for b, _ in rest])
    assert rest[-1][1]["counters"] == list(reader(source).iter_with_state())[-1][1]["counters"]


def test_one_hot_ids_are_cached_as_int32_and_batches_carry_no_offsets(tmp_path):
    schema = make_schema(3, [False, False], [1000, 2**31 - 1])
    write_parquet(tmp_path / "src", schema, make_columns(schema, 90, 4), rows_per_row_group=30)
    build_cache(tmp_path / "src", tmp_path / "cache")
    assert all(np.fromfile(tmp_path / "cache" / f"ids.{j}", dtype="<i4").shape == (90,) for j in (0, 1))
    want = list(BatchReader(tmp_path / "src", 32, ReadOptions(seed=1)))
    got = list(BatchReader(tmp_path / "cache", 32, ReadOptions(seed=1)))
    assert_same_batches(want, got)
    assert got[0].sparse.one_hot and got[0].sparse.values.dtype.itemsize == 4

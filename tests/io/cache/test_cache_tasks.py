"""Task batches (Meta-IO) read from a pre-decoded cache equal those read from its Parquet
source: support and query sets, states, counters and batch counts, shuffled or not, 0 or
2 workers, rows dropped by a policy, tasks dropped as too small, and a Parquet-read
position resumed on the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recaccel.config import config_from_dict
from recaccel.errors import DataError
from recaccel.io.format.cache.build import build_cache
from recaccel.io.format.decode import Policies
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers import ReadOptions, TaskReader
from tests.helpers.reader_resume import position_after, rest_from
from tests.helpers.same_batches import assert_same_batches
from tests.helpers.task_data import task_columns, task_schema, tasks_config

SKIP = Policies(invalid_ids="skip")
SIZES = [int(n) for n in np.random.default_rng(5).integers(1, 14, 40)]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """40 tasks in 2 files of 16-row groups (tasks cross them); the first row of every third
    task has an id past its table (14 rows), so some tasks fall below 4 rows kept."""
    path = tmp_path_factory.mktemp("tasks")
    cols = task_columns(SIZES, 5)
    cols["c"][np.cumsum([0, *SIZES[:-1]])[::3]] = 77
    write_parquet(path, task_schema(sum(SIZES)), cols, rows_per_row_group=16, rows_per_file=160)
    return path


@pytest.fixture(scope="module")
def cache(source, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("caches") / "tasks"
    build_cache(source, dst, policies=SKIP)
    return dst


def reader(
    path: Path, workers: int = 0, shuffle: bool = True, train: bool = True, per_batch: int = 3
) -> TaskReader:
    # read_ahead=0: the decode counters (row groups decoded twice) then do not depend on threads.
    opts = ReadOptions(seed=4, workers=workers, shuffle=shuffle, read_ahead=0, policies=SKIP)
    cfg = tasks_config(unit_row_groups=1, min_task_rows=4, tasks_per_batch=per_batch)
    return TaskReader(path, cfg, opts, train=train)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, False])
def test_cached_task_batches_states_and_counters_equal_the_parquet_ones(source, cache, workers, shuffle):
    want = list(reader(source, workers, shuffle).iter_with_state())
    got = list(reader(cache, workers, shuffle).iter_with_state())
    assert_same_batches([b for b, _ in want], [b for b, _ in got])
    assert [s for _, s in got] == [s for _, s in want]
    counters = got[-1][1]["counters"]
    assert counters["rows_skipped"] == 14 and counters["tasks_skipped_small"] > 0


@pytest.mark.parametrize("train", [True, False])
def test_batches_per_epoch_from_the_cache_equal_the_parquet_count(source, cache, train):
    # One task per batch: the count is the tasks of at least 4 rows in the source's key
    # column, rows dropped by the policy included (as Parquet counts them).
    parquet, cached = reader(source, train=train, per_batch=1), reader(cache, train=train, per_batch=1)
    assert [cached.batches_in_epoch(e) for e in range(3)] == [parquet.batches_in_epoch(e) for e in range(3)]
    assert cached.num_batches == parquet.num_batches > 0
    assert cached.counters["row_groups_read"] == 0  # counted from the recorded keys alone


def test_a_parquet_read_task_position_resumes_on_the_cache_mid_epoch(source, cache):
    full = list(reader(source).iter_with_state())
    rest = rest_from(reader(cache, 2), position_after(reader(source), 4))
    assert_same_batches([b for b, _ in full[4:]], [b for b, _ in rest])
    # Decode counters count the row groups the resumed window decodes again; the rest agree.
    work = ("rows_read", "row_groups_read", "max_buffered_rows")
    final = {k: v for k, v in rest[-1][1]["counters"].items() if k not in work}
    assert final == {k: v for k, v in full[-1][1]["counters"].items() if k not in work}


def test_the_cache_records_every_source_rows_task_key_dropped_rows_included(source, cache):
    keys = np.fromfile(cache / "task_keys.i64", dtype="<i8")
    assert np.array_equal(keys, task_columns(SIZES, 5)["user"])
    kept = np.fromfile(cache / "side.0", dtype="<i8")
    assert kept.shape[0] == keys.shape[0] - 14


def test_a_key_the_build_could_not_read_is_the_parquet_error_line_when_reading_tasks(tmp_path):
    # String task keys (hashed by a mapping): plain reading works; task reading is refused
    # in the same line from the cache as from Parquet.
    (tmp_path / "src").mkdir()
    frame = pd.DataFrame({"u": ["alice", "bob", "alice"], "y": [1.0, 0.0, 1.0], "i": [1, 2, 0]})
    frame.to_parquet(tmp_path / "src" / "s.parquet")
    mapping = config_from_dict(
        {"data": {"schema": {"label": "y", "task_key": "u", "sparse": {"i": {"cardinality": 3}}}}}
    ).data.schema
    build_cache(tmp_path / "src", tmp_path / "cache", schema=mapping)
    errors = []
    for path in (tmp_path / "src", tmp_path / "cache"):
        with pytest.raises(
            DataError, match=r"row group 0, column 'u': the task key holds (large_)?string values"
        ) as e:
            TaskReader(path, tasks_config(), ReadOptions(seed=1), schema=mapping)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "\n" not in errors[1]


def test_a_version_1_cache_is_refused_with_a_rebuild_line(cache, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for f in cache.iterdir():
        (old / f.name).symlink_to(f)
    raw = json.loads((cache / "cache.json").read_text())
    raw.pop("task_keys_error")
    (old / "cache.json").unlink()
    (old / "cache.json").write_text(json.dumps({**raw, "version": 1}))
    with pytest.raises(DataError, match=r"cache format version 1, this recaccel reads 3; rebuild it"):
        TaskReader(old, tasks_config(), ReadOptions(seed=1))


def test_a_flipped_task_key_byte_is_one_error_naming_the_key_file_not_moved_tasks(cache, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    raw = bytearray((copy / "task_keys.i64").read_bytes())
    raw[8 * 20] ^= 0x01  # row 20's key, one off: no range check would see it
    (copy / "task_keys.i64").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"task_keys\.i64: cache column file does not match its CRC-32"):
        reader(copy)

"""The shared reader engine: both readers on it, their read options, and saved states
pinned to those the readers wrote before the engine existed (same positions, settings,
counters and key order), so checkpoints stay compatible."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from recaccel.config import DataConfig
from recaccel.errors import ConfigError
from recaccel.io.format.decode import Policies
from recaccel.io.readers import BatchReader, Reader, ReadOptions, Shard, ShardedReader, TaskReader
from tests.helpers.row_data import small_dataset
from tests.helpers.task_data import tasks_config, write_tasks

# Written by the readers of commit 2d47b3b (before the engine) on the datasets below.
OLD_ROWS_STATE_AT_5 = {
    "version": 1,
    "epoch": 1,
    "buffer_index": 1,
    "row_offset": 25,
    "epoch_done": False,
    "seed": 3,
    "shuffle": True,
    "shuffle_buffer_rows": 40,
    "rank": 1,
    "world_size": 2,
    "policies": ["error", "error", "error"],
    "num_row_groups": 13,
    "num_rows": 300,
    "counters": {
        "rows_read": 55,
        "rows_skipped": 0,
        "rows_skipped_invalid_ids": 0,
        "rows_skipped_invalid_dense": 0,
        "rows_skipped_invalid_labels": 0,
        "ids_clipped": 0,
        "ids_hashed": 0,
        "dense_zeroed": 0,
        "rows_yielded": 80,
        "batches_yielded": 5,
        "rows_dropped_last": 0,
        "max_buffered_rows": 57,
    },
}
OLD_ROWS_FINAL_STATE = {
    "version": 1,
    "epoch": 1,
    "buffer_index": 3,
    "row_offset": 0,
    "epoch_done": True,
    "seed": 3,
    "shuffle": True,
    "shuffle_buffer_rows": 40,
    "rank": 1,
    "world_size": 2,
    "policies": ["error", "error", "error"],
    "num_row_groups": 13,
    "num_rows": 300,
    "counters": {
        "rows_read": 130,
        "rows_skipped": 0,
        "rows_skipped_invalid_ids": 0,
        "rows_skipped_invalid_dense": 0,
        "rows_skipped_invalid_labels": 0,
        "ids_clipped": 0,
        "ids_hashed": 0,
        "dense_zeroed": 0,
        "rows_yielded": 130,
        "batches_yielded": 9,
        "rows_dropped_last": 0,
        "max_buffered_rows": 57,
    },
}
OLD_ROWS_BATCHES = 9
OLD_TASKS_STATE_AT_3 = {
    "version": 1,
    "epoch": 0,
    "window": 1,
    "unit": 1,
    "task_offset": 4,
    "epoch_done": False,
    "seed": 5,
    "shuffle": True,
    "train": True,
    "rank": 0,
    "world_size": 1,
    "split": ["random", 0.5, 0, 6, 4, 2],
    "shuffle_buffer_tasks": 5,
    "unit_row_groups": 2,
    "policies": ["error", "error", "error"],
    "num_row_groups": 10,
    "num_rows": 156,
    "counters": {
        "rows_read": 28,
        "rows_skipped": 0,
        "rows_skipped_invalid_ids": 0,
        "rows_skipped_invalid_dense": 0,
        "rows_skipped_invalid_labels": 0,
        "ids_clipped": 0,
        "ids_hashed": 0,
        "dense_zeroed": 0,
        "tasks_read": 5,
        "tasks_skipped_small": 0,
        "rows_skipped_small": 0,
        "tasks_subsampled": 0,
        "rows_subsampled": 0,
        "tasks_yielded": 9,
        "rows_yielded": 41,
        "batches_yielded": 3,
        "tasks_dropped_last": 0,
        "row_groups_read": 2,
        "max_buffered_rows": 77,
    },
}
OLD_TASKS_FINAL_STATE = {
    "version": 1,
    "epoch": 0,
    "window": 0,
    "unit": 0,
    "task_offset": 0,
    "epoch_done": True,
    "seed": 5,
    "shuffle": True,
    "train": True,
    "rank": 0,
    "world_size": 1,
    "split": ["random", 0.5, 0, 6, 4, 2],
    "shuffle_buffer_tasks": 5,
    "unit_row_groups": 2,
    "policies": ["error", "error", "error"],
    "num_row_groups": 10,
    "num_rows": 156,
    "counters": {
        "rows_read": 156,
        "rows_skipped": 0,
        "rows_skipped_invalid_ids": 0,
        "rows_skipped_invalid_dense": 0,
        "rows_skipped_invalid_labels": 0,
        "ids_clipped": 0,
        "ids_hashed": 0,
        "dense_zeroed": 0,
        "tasks_read": 30,
        "tasks_skipped_small": 0,
        "rows_skipped_small": 0,
        "tasks_subsampled": 0,
        "rows_subsampled": 0,
        "tasks_yielded": 30,
        "rows_yielded": 156,
        "batches_yielded": 10,
        "tasks_dropped_last": 0,
        "row_groups_read": 10,
        "max_buffered_rows": 80,
    },
}
OLD_TASKS_BATCHES = 10
TASK_SIZES = [3, 7, 2, 9, 5, 4, 8, 6, 3, 5] * 3


def rows_reader(path: Path) -> BatchReader:
    return BatchReader(path, 16, ReadOptions(seed=3, shard=Shard(1, 2), read_ahead=0), shuffle_buffer_rows=40)


def tasks_reader(path: Path) -> TaskReader:
    return TaskReader(
        path, dataclasses.replace(tasks_config(), unit_row_groups=2), ReadOptions(seed=5, read_ahead=0)
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("engine")
    small_dataset(root / "rows")
    write_tasks(root / "tasks", TASK_SIZES, 0, rg=16)
    return root / "rows", root / "tasks"


def test_both_readers_run_on_the_engine_and_implement_the_protocol(data):
    for reader in (rows_reader(data[0]), tasks_reader(data[1])):
        assert isinstance(reader, ShardedReader) and isinstance(reader, Reader)
    assert rows_reader(data[0]).num_batches > 0 and tasks_reader(data[1]).num_batches > 0


def test_states_equal_those_written_before_the_engine(data):
    reader = rows_reader(data[0])
    reader.set_epoch(1)
    states = [s for _, s in reader.iter_with_state()]
    assert len(states) == OLD_ROWS_BATCHES
    # json: the same keys in the same order, as a saved checkpoint holds them
    assert json.dumps(states[4]) == json.dumps(OLD_ROWS_STATE_AT_5)
    assert json.dumps(states[-1]) == json.dumps(OLD_ROWS_FINAL_STATE)
    tasks = tasks_reader(data[1])
    states = [s for _, s in tasks.iter_with_state()]
    assert len(states) == OLD_TASKS_BATCHES
    assert json.dumps(states[2]) == json.dumps(OLD_TASKS_STATE_AT_3)
    assert json.dumps(states[-1]) == json.dumps(OLD_TASKS_FINAL_STATE)


def test_old_states_resume_to_the_same_end(data):
    # The task reader decodes a row group again to complete a task a resume starts
    # inside (as before the engine): its decode-work counters may end higher.
    work = {"rows_read", "row_groups_read", "max_buffered_rows"}
    for make, path, mid, final in (
        (rows_reader, data[0], OLD_ROWS_STATE_AT_5, OLD_ROWS_FINAL_STATE),
        (tasks_reader, data[1], OLD_TASKS_STATE_AT_3, OLD_TASKS_FINAL_STATE),
    ):
        reader = make(path)
        reader.load_state_dict(json.loads(json.dumps(mid)))
        rest = [s for _, s in reader.iter_with_state()]
        assert len(rest) == final["counters"]["batches_yielded"] - mid["counters"]["batches_yielded"]
        assert {k: v for k, v in rest[-1].items() if k != "counters"} == {
            k: v for k, v in final.items() if k != "counters"
        }
        same = {k: v for k, v in final["counters"].items() if k not in work or make is rows_reader}
        assert {k: reader.counters[k] for k in same} == same
        assert reader.epoch == final["epoch"] + 1


def test_an_epoch_without_batches_ends_done(data):
    reader = BatchReader(data[0], 1000, ReadOptions(drop_last=True))  # 300 rows
    assert list(reader.iter_with_state()) == []
    assert reader.state_dict()["epoch_done"] and reader.epoch == 1
    assert reader.counters["rows_dropped_last"] == 300


def test_read_options_checks_and_config():
    with pytest.raises(ConfigError, match="rank=2, world_size=2"):
        Shard(2, 2)
    with pytest.raises(ConfigError, match="seed must be >= 0"):
        ReadOptions(seed=-1)
    with pytest.raises(ConfigError, match="read_ahead must be >= 0"):
        ReadOptions(read_ahead=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReadOptions().seed = 1
    data_cfg = DataConfig(seed=4, shuffle=True, drop_last=True, invalid_dense="zero", read_ahead=3)
    train = ReadOptions.from_config(data_cfg, train=True, shard=Shard(1, 4))
    assert train == ReadOptions(True, 4, True, Policies(invalid_dense="zero"), 3, Shard(1, 4))
    ev = ReadOptions.from_config(data_cfg, train=False, shard=Shard(), read_ahead=0)
    assert (ev.shuffle, ev.drop_last, ev.read_ahead) == (False, False, 0)


def test_task_reader_never_shuffles_or_drops_in_evaluation(data):
    reader = TaskReader(data[1], tasks_config(), ReadOptions(shuffle=True, drop_last=True), train=False)
    assert not reader.options.shuffle and not reader.options.drop_last

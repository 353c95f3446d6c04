"""The task reader knows its batches per epoch before reading: exact, from the key column."""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from recaccel.cli import train_main
from recaccel.config import TasksConfig
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.tasks.reader import TaskReader
from tests.helpers.meta_run import meta_set_args
from tests.helpers.task_data import TASK_SETTINGS, task_columns, task_schema, tasks_config, write_tasks


def yielded(reader: TaskReader, epoch: int) -> int:
    reader.set_epoch(epoch)
    return sum(1 for _ in reader)


def check_every_rank(path: Path, cfg: TasksConfig, world_size: int, train: bool, **options) -> None:
    """num_batches before each epoch equals the batches the epoch then yields, on every rank."""
    for rank in range(world_size):
        shard = Shard(rank=rank, world_size=world_size)
        reader = TaskReader(path, cfg, ReadOptions(seed=7, shard=shard, **options), train=train)
        assert reader.num_batches >= 0
        assert reader.counters["row_groups_read"] == 0  # counted without decoding a row group
        for epoch in (0, 1):
            reader.set_epoch(epoch)
            expected = reader.num_batches
            assert yielded(reader, epoch) == expected, (rank, epoch)


@TASK_SETTINGS
@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=30),
    rg=st.integers(1, 20),
    min_rows=st.integers(1, 12),
    per_batch=st.integers(1, 5),
    unit=st.integers(1, 3),
    world_size=st.integers(1, 3),
    train=st.booleans(),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_num_batches_equals_the_batches_each_rank_yields(
    sizes, rg, min_rows, per_batch, unit, world_size, train, drop_last, shuffle, seed
):
    cfg = tasks_config(
        tasks_per_batch=per_batch, min_task_rows=min_rows, unit_row_groups=unit, shuffle_buffer_tasks=4
    )
    with tempfile.TemporaryDirectory() as tmp:
        write_tasks(Path(tmp), sizes, seed, rg=rg)
        check_every_rank(Path(tmp), cfg, world_size, train, shuffle=shuffle, drop_last=drop_last)


@pytest.mark.parametrize("min_rows", [1, 6, 40])
def test_tasks_spanning_many_row_groups_count_once_with_all_their_rows(tmp_path, min_rows):
    # Tasks of 37 and 50 rows run through several 4-row groups; 40 keeps only the 50-row one.
    write_tasks(tmp_path, [3, 37, 1, 50, 2, 2, 9], 3, rg=4)
    cfg = tasks_config(tasks_per_batch=1, min_task_rows=min_rows)
    reader = TaskReader(tmp_path, cfg, ReadOptions(seed=1))
    kept = sum(n >= min_rows for n in [3, 37, 1, 50, 2, 2, 9])
    assert reader.num_batches == kept == yielded(reader, 0)
    check_every_rank(tmp_path, cfg, 3, True, shuffle=True)


def test_files_without_the_grouped_claim_are_counted_too(tmp_path):
    # A file recaccel-data tasks did not write (sorted, but no grouping metadata).
    sizes = np.random.default_rng(2).integers(1, 15, 25).tolist()
    cols = task_columns(sizes, 2)
    schema = task_schema(int(sum(sizes)), grouped=False)
    write_parquet(tmp_path, schema, cols, rows_per_row_group=7, rows_per_file=50)
    cfg = tasks_config(tasks_per_batch=4, min_task_rows=5)
    reader = TaskReader(tmp_path, cfg, ReadOptions(seed=0), schema=schema)
    assert reader.num_batches == -(-sum(n >= 5 for n in sizes) // 4) == yielded(reader, 0)
    check_every_rank(tmp_path, cfg, 2, True, shuffle=True, drop_last=True)


def test_a_dataloader_worker_share_is_counted_by_batches_in_epoch(tmp_path):
    write_tasks(tmp_path, np.random.default_rng(4).integers(1, 20, 30).tolist(), 4, rg=6)
    cfg = tasks_config(tasks_per_batch=3, min_task_rows=3)
    whole = TaskReader(tmp_path, cfg, ReadOptions(seed=2, shard=Shard(rank=1, world_size=2)))
    total = 0
    for w in range(2):  # worker w of 2 on rank 1 reads shard 1 * 2 + w of 4
        alone = TaskReader(tmp_path, cfg, ReadOptions(seed=2, shard=Shard(rank=2 + w, world_size=4)))
        assert whole.batches_in_epoch(1, (2 + w, 4)) == alone.batches_in_epoch(1) == yielded(alone, 1)
        total += alone.batches_in_epoch(1)
    assert total >= whole.batches_in_epoch(1)  # each worker may cut its own short last batch


def test_a_meta_run_set_by_epochs_shows_a_bar_with_its_total(task_data, tmp_path, capsys):
    train, test = task_data
    cfg = TasksConfig(tasks_per_batch=8, support_size=16, query_size=8, query_count=5, min_task_rows=6)
    per_epoch = TaskReader(train, cfg, ReadOptions(seed=0)).num_batches
    args = meta_set_args(train, test, tmp_path / "run", "train.mode=meta", "train.epochs=2")
    args = [a.replace("train.progress=false", "train.progress=true") for a in args]
    assert train_main(args) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 * per_epoch
    totals = {int(m) for m in re.findall(r"\d+/(\d+) \[", capsys.readouterr().err)}
    assert 2 * per_epoch in totals


def test_each_epoch_of_a_shuffled_rank_is_counted_exactly(tmp_path):
    write_tasks(tmp_path, np.random.default_rng(9).integers(1, 25, 60).tolist(), 9, rg=5)
    cfg = dataclasses.replace(tasks_config(tasks_per_batch=2, min_task_rows=4), unit_row_groups=2)
    reader = TaskReader(tmp_path, cfg, ReadOptions(seed=3, shard=Shard(rank=0, world_size=3)))
    counts = [reader.batches_in_epoch(e) for e in range(6)]
    assert counts == [yielded(reader, e) for e in range(6)]

"""A run of ``train.epochs`` epochs knows its exact length ahead: the per-epoch batch
counts of readers whose count changes with the epoch (several ranks, shuffled shards)
are summed, so the learning-rate schedule ends on the run's last step on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recaccel.config import load_config
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.rows import BatchReader
from recaccel.io.readers.tasks.reader import TaskReader
from recaccel.train.loop.run_length import run_steps
from tests.helpers.gloo_ranks import run_ranks
from tests.helpers.task_data import tasks_config, write_tasks

WORLD = 2
EPOCHS = 3
SCHEMA = FeatureSchema(dense=("d0",), sparse=(SparseField("c", 7),), label_kind="binary")


def _rows(path: Path, groups: list[int]) -> Path:
    """Row groups of the given sizes (unequal, so ranks holding other groups differ)."""
    rng = np.random.default_rng(0)
    n = sum(groups)
    cols = {
        "label": rng.integers(0, 2, n).astype(np.float32),
        "d0": rng.normal(size=n).astype(np.float32),
        "c": rng.integers(0, 7, n),
    }
    path.mkdir()
    start = 0
    for i, size in enumerate(groups):  # one file per row group: the writer cuts equal ones
        part = {k: v[start : start + size] for k, v in cols.items()}
        (written,) = write_parquet(path.parent / f"group-{i}", SCHEMA, part, rows_per_row_group=size)
        written.rename(path / f"part-{i:03d}.parquet")
        start += size
    return path


def _row_reader(path: Path, rank: int, drop_last: bool) -> BatchReader:
    options = ReadOptions(seed=3, shuffle=True, drop_last=drop_last, shard=Shard(rank, WORLD))
    return BatchReader(path, 16, options, shuffle_buffer_rows=40)


@pytest.mark.parametrize("drop_last", [True, False])
def test_row_reader_counts_each_epochs_batches_on_each_rank_without_reading(tmp_path, drop_last):
    path = _rows(tmp_path / "rows", [10, 70, 25, 40, 90, 33, 55])
    counts = {}
    for rank in range(WORLD):
        reader = _row_reader(path, rank, drop_last)
        for epoch in range(EPOCHS):
            expected = reader.batches_in_epoch(epoch)
            reader.set_epoch(epoch)
            assert sum(1 for _ in reader) == expected, (rank, epoch)
            counts[rank, epoch] = expected
    # the case the first epoch's count times the epochs gets wrong
    assert len({counts[0, e] for e in range(EPOCHS)}) > 1


def test_task_reader_counts_each_epochs_batches_on_each_rank_without_reading(tmp_path):
    sizes = np.random.default_rng(1).integers(2, 12, 60).tolist()
    write_tasks(tmp_path / "tasks", sizes, rg=16)
    cfg = tasks_config(unit_row_groups=1)
    counts = {}
    for rank in range(WORLD):
        options = ReadOptions(seed=5, shuffle=True, drop_last=False, shard=Shard(rank, WORLD))
        reader = TaskReader(tmp_path / "tasks", cfg, options, train=True)
        for epoch in range(EPOCHS):
            counts[rank, epoch] = reader.batches_in_epoch(epoch)
            reader.set_epoch(epoch)
            assert sum(1 for _ in reader) == counts[rank, epoch], (rank, epoch)
    assert len({counts[0, e] for e in range(EPOCHS)}) > 1


def test_run_steps_sums_the_fewest_batches_of_each_epoch_over_ranks(tmp_path):
    path = _rows(tmp_path / "rows", [10, 70, 25, 40, 90, 33, 55])
    readers = [_row_reader(path, rank, drop_last=True) for rank in range(WORLD)]
    table = torch.tensor([[r.batches_in_epoch(e) for e in range(EPOCHS)] for r in readers])
    # every rank sees the same gathered table (what a gloo gather gives); each passes its own row
    for reader in readers:
        assert run_steps(reader, EPOCHS, lambda row: table) == int(table.min(dim=0).values.sum())
    assert run_steps(readers[0], EPOCHS, lambda row: row) == int(table[0].sum())
    assert run_steps(readers[0], EPOCHS, lambda row: torch.cat([row, torch.full_like(row, -1)])) is None


# ------------------------------------------------------------- two ranks, meta-DLRM, sharded


META = [
    "train.mode=meta",
    f"train.epochs={EPOCHS}",
    "train.progress=false",
    "train.eval_every=0",
    "data.shuffle=true",
    "data.seed=5",
    "parallel.mode=hybrid",
    "parallel.data=sharded",
    "tasks.tasks_per_batch=3",
    "tasks.support_size=6",
    "tasks.query_size=4",
    "tasks.min_task_rows=2",
    "tasks.unit_row_groups=1",
    "meta.inner_steps=1",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
    "optim.schedule=linear",
    "optim.final_lr_ratio=0.1",
]


def _meta_rank(rank: int, world: int, root: Path) -> None:
    from recaccel.train.distributed.hybrid import HybridParallel
    from recaccel.train.loop.observers import BatchCallback
    from recaccel.train.loop.trainer import Trainer

    sets = [
        *META,
        f'data.train="{root / "train"}"',
        f'data.test="{root / "test"}"',
        f'train.out_dir="{root / "run"}"',
    ]
    cfg = load_config(None, sets)
    parallel = HybridParallel(cfg, torch.device("cpu"))
    rates: list[float] = []
    held = {}  # the trainer, once built: each step records the dense rate it trains at
    observer = BatchCallback(lambda step, batch: rates.append(_dense_rate(held["trainer"])))
    trainer = held["trainer"] = Trainer(cfg, parallel=parallel, observers=[observer])
    reader = trainer.reader
    metrics = trainer.fit()
    decay = trainer.schedule.decay
    own = {
        "epoch_batches": [reader.batches_in_epoch(e) for e in range(EPOCHS)],
        "first_epoch_times_epochs": reader.batches_in_epoch(0) * EPOCHS,
        "schedule_end": decay.start + decay.steps,
        "steps": metrics["steps"],
        "rates": rates,
    }
    (root / f"rank-{rank}.json").write_text(json.dumps(own))


def _dense_rate(trainer) -> float:
    return float(trainer.optimizer.param_groups[0]["lr"])


def test_schedule_ends_on_the_last_step_of_a_sharded_run_on_every_rank(tmp_path):
    pytest.importorskip("torchrec", exc_type=ImportError)
    from recaccel.config import OptimConfig
    from recaccel.train.loop.schedule import lr_factor

    sizes = np.random.default_rng(2).integers(2, 12, 48).tolist()
    write_tasks(tmp_path / "train", sizes, seed=0, rg=16)
    write_tasks(tmp_path / "test", sizes[:12], seed=1, rg=16)
    run_ranks(_meta_rank, WORLD, tmp_path, timeout_s=60.0)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    per_epoch = [min(r["epoch_batches"][e] for r in ranks) for e in range(EPOCHS)]
    assert len(set(per_epoch)) > 1  # epochs differ: the first one's count would be wrong
    assert min(r["first_epoch_times_epochs"] for r in ranks) != sum(per_epoch)
    optim = load_config(None, META).optim
    assert isinstance(optim, OptimConfig)
    for r in ranks:
        assert r["steps"] == sum(per_epoch) == r["schedule_end"] == len(r["rates"])
        expected = [optim.lr * lr_factor(k, r["steps"], optim) for k in range(r["steps"])]
        assert r["rates"] == pytest.approx(expected, rel=1e-9)

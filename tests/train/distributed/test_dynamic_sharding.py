"""Stateful dynamic data sharding (``parallel.data = "dynamic"``): every row trained
exactly once per epoch, counted by row identity, through a read-ahead, a rank kill and
resumes with the same and another number of ranks.

Row identity: a dense feature holding the row index.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recaccel.config import load_config
from recaccel.errors import ConfigError
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.options import ReadOptions
from recaccel.io.readers.rows import BatchReader
from recaccel.train.distributed.collectives import CollectiveError
from recaccel.train.distributed.shard_service import (
    DynamicShardReader,
    ShardService,
    merge_ledgers,
    shard_ranges,
)
from recaccel.train.loop.trainer import build_parallel
from tests.helpers.gloo_ranks import run_ranks

# 8 row groups of 128 rows; batches of 64: a shard is 2 batches.
BATCH = 64
ROWS = 1024
SCHEMA = FeatureSchema(dense=("row_id", "d1"), sparse=tuple(SparseField(f"s{i}", 40) for i in range(3)))


def _write(path: Path, n: int, seed: int) -> None:
    """Rows whose dense ``row_id`` is the row index / 1024 (exact in float32)."""
    rng = np.random.default_rng(seed)
    cols = {"label": rng.integers(0, 2, n).astype(np.float32), "row_id": np.arange(n) / 1024.0}
    cols["d1"] = rng.normal(size=n)
    cols.update({f.name: rng.integers(0, 40, n) for f in SCHEMA.sparse})
    write_parquet(path, SCHEMA, cols, rows_per_row_group=128, rows_per_file=512)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dyn")
    _write(root / "train", ROWS, 0)
    _write(root / "test", 256, 1)
    return root


def _ids(batch) -> list[int]:
    return [round(v * 1024) for v in batch.dense[:, 0].tolist()]


def _all_ids(data: Path) -> list[int]:
    return list(range(ROWS))


def _readers(data: Path, store, world: int, state=None, per_shard: int = 1) -> list[DynamicShardReader]:
    readers = []
    for rank in range(world):
        base = BatchReader(data / "train", BATCH, ReadOptions(shuffle=True, seed=3, drop_last=True))
        reader = DynamicShardReader(base, ShardService(store, rank, world), per_shard)
        if state is not None:
            reader.load_state_dict(state)
        readers.append(reader)
    return readers


def _lockstep(readers, steps: int | None = None):
    """Steps as the hybrid agreement runs them: every rank one batch, until one has none
    (or ``steps``); returns the ids trained and each rank's state after its last step."""
    its = [r.iter_with_state() for r in readers]
    trained, states, step = [], [None] * len(readers), 0
    while steps is None or step < steps:
        got = [next(it, None) for it in its]  # each generator also reads one batch ahead
        if any(g is None for g in got):
            break
        for rank, (batch, state) in enumerate(got):
            trained += _ids(batch)
            states[rank] = state
        step += 1
    return trained, states


def test_shard_ranges():
    assert shard_ranges(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert shard_ranges(3, 1) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ConfigError, match="shard_row_groups"):
        shard_ranges(3, 0)


def test_one_epoch_every_row_once_and_shards_go_to_whoever_asks(data):
    store = dist.HashStore()
    readers = _readers(data, store, 2)
    trained, states = _lockstep(readers)
    assert Counter(trained) == Counter(_all_ids(data))  # 8 shards, 16 batches, 8 steps
    ledger = merge_ledgers(states)
    assert ledger["done"] == list(range(8)) and ledger["offsets"] == {}
    holders = [int(store.get(f"{readers[0].service._prefix}/0/1/holder/{i}")) for i in range(8)]
    assert sorted(holders) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_rank_reading_ahead_waits_for_the_others_then_times_out():
    store = dist.HashStore()
    fast, slow = ShardService(store, 0, 2, timeout_s=0.2), ShardService(store, 1, 2, timeout_s=0.2)
    assert fast.take("r", 8, 0) == 0  # a first shard at once
    with pytest.raises(CollectiveError, match="rank 0: the shard service saw 1 shard requests"):
        fast.take("r", 8, 1)  # a second only once the slow rank has asked
    assert slow.take("r", 8, 0) == 1 and fast.take("r", 8, 1) == 2
    assert fast.take("r", 3, 2) is None  # the queue is out: no waiting


@pytest.mark.parametrize("world_after", [1, 2, 3])
@pytest.mark.parametrize("killed_at", [2, 3])
def test_kill_and_resume_with_any_world_size_trains_every_row_once(data, world_after, killed_at):
    readers = _readers(data, dist.HashStore(), 2)
    before, states = _lockstep(readers, killed_at)  # then a rank dies: the states are the checkpoint's
    ledger = merge_ledgers(states)
    taken = int(readers[0].service.store.add(f"{readers[0].service._prefix}/0/1/next", 0))
    if killed_at % 2:  # mid-shard: both ranks' shards in progress at their offsets
        assert len(ledger["offsets"]) == 2 and set(ledger["offsets"].values()) == {BATCH}
    else:  # the read-ahead took shards nobody trained yet: pending again in the ledger
        assert ledger["offsets"] == {} and taken > len(ledger["done"])
    resumed = _readers(data, dist.HashStore(), world_after, ledger)
    # every rank drains the queue on its own thread (the ledger's exactness, whatever the agreement)
    with ThreadPoolExecutor(world_after) as pool:
        parts = list(pool.map(lambda r: [i for b in r for i in _ids(b)], resumed))
    after = [i for part in parts for i in part]
    assert Counter(before + after) == Counter(_all_ids(data))


def test_state_checks(data):
    reader = _readers(data, dist.HashStore(), 1)[0]
    state = reader.state_dict()
    with pytest.raises(ConfigError, match="seed"):
        reader.load_state_dict({**state, "seed": 4})
    with pytest.raises(ConfigError, match="bad ledger"):
        reader.load_state_dict({**state, "done": [99]})
    with pytest.raises(ConfigError, match="version"):
        reader.load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="needs parallel.mode=hybrid"):
        build_parallel(load_config(None, ["parallel.data=dynamic"]), torch.device("cpu"))


def test_epoch_end_moves_on_and_resumes_a_done_state(data):
    reader = _readers(data, dist.HashStore(), 1)[0]
    first = list(reader)
    assert reader.epoch == 1 and reader.state_dict()["epoch_done"]
    second = [i for b in reader for i in _ids(b)]
    assert Counter(second) == Counter(_all_ids(data))
    assert [i for b in first for i in _ids(b)] != second  # epochs are shuffled apart


# ------------------------------------------------ two gloo ranks through the Trainer

WORLD = 2
TRAIN = [
    "data.batch_size=64",
    "data.shuffle_buffer_rows=128",
    "model.embedding_dim=8",
    "model.bottom_mlp=[8, 8]",
    "model.top_mlp=[8, 1]",
    "optim.sparse=rowwise_adagrad",
    "parallel.mode=hybrid",
    "parallel.sharding=table_wise",
    "parallel.data=dynamic",
    "train.epochs=1",
    "train.progress=false",
]
KILL_AT, CHECKPOINT_EVERY = 5, 2  # the checkpoint before the kill: step 4, mid-epoch of 8 steps


def _cfg(data: Path, out: Path, *extra: str):
    sets = [
        *TRAIN,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
    ]
    return load_config(None, [*sets, *extra])


def _recording(log: Path) -> None:
    """Makes every hybrid step append this rank's row ids (one line per step) to ``log``."""
    from recaccel.train.distributed.hybrid import HybridParallel

    step = getattr(HybridParallel.train_step, "unrecorded", HybridParallel.train_step)

    def train_step(self, objective, optimizer, batch):
        with open(log, "a") as f:
            f.write(" ".join(map(str, _ids(batch))) + "\n")
        return step(self, objective, optimizer, batch)

    train_step.unrecorded = step
    HybridParallel.train_step = train_step


def _job(rank: int, world: int, root: Path, jobs: list[str]) -> None:
    from recaccel.errors import RecaccelError
    from recaccel.train.loop.trainer import Trainer

    for job in jobs:
        _recording(root / f"{job}-{rank}.ids")
        if job == "clean":
            Trainer(_cfg(root, root / "clean")).fit()
        elif job == "kill":
            kill = [
                "fault.kill_rank=1",
                f"fault.kill_rank_at_step={KILL_AT}",
                f"train.checkpoint_every={CHECKPOINT_EVERY}",
            ]
            try:
                Trainer(_cfg(root, root / "killed", *kill)).fit()
            except RecaccelError:
                pass  # rank 0: its peer died
        elif job == "resume":
            Trainer(_cfg(root, root / "killed"), resume=True).fit()


def _spawn(root: Path, jobs: list[str]) -> None:
    run_ranks(_job, WORLD, root, jobs, timeout_s=20, join_s=120)


def _steps(path: Path) -> list[list[int]]:
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()] if path.exists() else []


def test_two_ranks_train_every_row_once_through_a_kill_and_a_resume(data):
    pytest.importorskip("torchrec", exc_type=ImportError)
    _spawn(data, ["clean", "kill"])
    clean = [i for r in range(WORLD) for step in _steps(data / f"clean-{r}.ids") for i in step]
    assert Counter(clean) == Counter(range(ROWS))
    assert len(_steps(data / "clean-0.ids")) == len(_steps(data / "clean-1.ids")) == ROWS // (WORLD * BATCH)
    killed = [_steps(data / f"kill-{r}.ids") for r in range(WORLD)]
    assert len(killed[1]) == KILL_AT  # rank 1 died after step KILL_AT
    kept = KILL_AT - KILL_AT % CHECKPOINT_EVERY  # steps the checkpoint holds; later ones are lost
    before = [i for steps in killed for step in steps[:kept] for i in step]
    _spawn(data, ["resume"])
    after = [i for r in range(WORLD) for step in _steps(data / f"resume-{r}.ids") for i in step]
    assert Counter(before + after) == Counter(range(ROWS))

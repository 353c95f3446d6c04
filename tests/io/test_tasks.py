"""Meta-IO task reader: splits, sharding, shuffle buffer, resume, memory, bad input.

References are computed in plain Python from ``pyarrow.parquet.read_table().to_pylist()``:
every row carries a unique id in the single-hot field ``rid``, so each row a TaskBatch
yields can be traced back to the file.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from recaccel.config import Config, DataConfig, TasksConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.format.columns import Columns
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.decode import Policies
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.options import ReadOptions, Shard
from recaccel.io.readers.tasks.pool import take_batch
from recaccel.io.readers.tasks.reader import TaskReader
from tests.helpers.task_data import (
    TASK_SETTINGS,
    batch_tasks,
    task_columns,
    task_schema,
    tasks_config,
    write_tasks,
)

EXACT = dict(rtol=0, atol=0)


# ---------------------------------------------------------------- data helpers


def file_tasks(path: Path) -> dict[int, list[tuple[int, int]]]:
    """Task key -> [(rid, ts)] in file order, from pyarrow."""
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    for f in files:
        for r in pq.read_table(f).to_pylist():
            out[r["user"]].append((r["rid"], r.get("ts", 0)))
    return dict(out)


def expected_query(n: int, c: TasksConfig, count: int = 0) -> int:
    if count > 0:
        return min(count, max(n - 1, 1))
    return int(np.clip(np.rint(c.query_fraction * n), 1, max(n - 1, 1)))


def check_shapes(tb, c: TasksConfig) -> None:
    t, s, q = tb.num_tasks, tb.support_size, tb.query_size
    assert tb.support.batch_size == t * s and tb.query.batch_size == t * q
    assert tb.support.sparse.offsets.shape == (len(tb.support.sparse.keys) * t * s + 1,)
    torch.testing.assert_close(tb.support.weights, tb.support_mask.reshape(-1), **EXACT)
    torch.testing.assert_close(tb.query.weights, tb.query_mask.reshape(-1), **EXACT)
    # Masks are prefixes: real rows first, then padding (which repeats the task's first row).
    for m in (tb.support_mask, tb.query_mask):
        assert torch.all(m[:, 1:] <= m[:, :-1])


# ---------------------------------------------------------------- batch assembly


@TASK_SETTINGS
@given(st.integers(0, 30), st.integers(0, 3), st.lists(st.booleans(), max_size=6), st.integers(0, 2**16))
def test_take_batch_equals_take_then_to_batch(n, dd, multi, seed):
    rng = np.random.default_rng(seed)
    values, offsets = [], []
    for m in multi:
        lengths = rng.integers(0, 4, n) if m else np.ones(n, dtype=np.int64)
        offsets.append(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        values.append(rng.integers(0, 100, int(lengths.sum())))
    cols = Columns(
        rng.normal(size=(n, dd)).astype(np.float32),
        rng.random(n).astype(np.float32),
        [f"f{i}" for i in range(len(multi))],
        values,
        offsets,
    )
    idx = rng.integers(0, n, int(rng.integers(0, 40))) if n else np.zeros(0, dtype=np.int64)
    want, got = cols.take(idx).to_batch(), take_batch(cols, idx)
    assert got.sparse.keys == want.sparse.keys and got.weights is None
    for a, b in (
        (got.dense, want.dense),
        (got.labels, want.labels),
        (got.sparse.values, want.sparse.values),
        (got.sparse.offsets, want.sparse.offsets),
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **EXACT)


# ---------------------------------------------------------------- split rules


@TASK_SETTINGS
@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=12),
    st.sampled_from(["random", "time"]),
    st.sampled_from([0.5, 0.3, 0.0]),
    st.integers(1, 16),
    st.integers(0, 1000),
)
def test_eval_mode_keeps_every_row_with_the_split_rule(sizes, split, fraction, rg, seed):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, sizes, seed, rg=rg)
        ref = file_tasks(path)
        c = tasks_config(split=split, query_fraction=fraction, min_task_rows=1)
        reader = TaskReader(path, c, ReadOptions(seed=seed), train=False)
        seen = {}
        for tb in reader:
            check_shapes(tb, c)
            assert tb.support_size >= c.support_size and tb.query_size >= c.query_size
            for key, sup, qry in batch_tasks(tb):
                assert key not in seen
                seen[key] = (sup, qry)
        assert set(seen) == set(ref)
        ts = {rid: t for rows in ref.values() for rid, t in rows}
        for key, rows in ref.items():
            sup, qry = seen[key]
            assert sorted(sup + qry) == sorted(r for r, _ in rows)
            # query_fraction <= 0 means a fixed count of query_size rows
            assert len(qry) == expected_query(len(rows), c, c.query_size if fraction <= 0 else 0)
            if split == "time":
                assert sorted(ts[r] for r in sup) == [ts[r] for r in sup]
                assert sorted(ts[r] for r in qry) == [ts[r] for r in qry]
                if sup:
                    assert max(ts[r] for r in sup) <= min(ts[r] for r in qry)
        again = [batch_tasks(tb) for tb in TaskReader(path, c, ReadOptions(seed=seed), train=False)]
        assert [x for b in again for x in b] == [
            (k, *seen[k]) for k in sorted(seen)
        ]  # key order, deterministic


@TASK_SETTINGS
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=10),
    st.sampled_from(["random", "time"]),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 1000),
)
def test_train_mode_samples_to_sizes(sizes, split, s, q, seed):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, sizes, seed, rg=7)
        ref = file_tasks(path)
        c = tasks_config(split=split, support_size=s, query_size=q, min_task_rows=1, query_fraction=0.4)
        reader = TaskReader(path, c, ReadOptions(seed=seed, shuffle=True))
        got = {}
        for tb in reader:
            check_shapes(tb, c)
            assert (tb.support_size, tb.query_size) == (s, q)
            for key, sup, qry in batch_tasks(tb):
                got[key] = (sup, qry)
        assert set(got) == set(ref)
        ts = {rid: t for rows in ref.values() for rid, t in rows}
        subsampled = 0
        for key, rows in ref.items():
            n = len(rows)
            nq = expected_query(n, c)
            sup, qry = got[key]
            assert len(sup) == min(n - nq, s) and len(qry) == min(nq, q)
            assert len(set(sup + qry)) == len(sup) + len(qry)
            assert set(sup + qry) <= {r for r, _ in rows}
            subsampled += (len(sup) + len(qry)) < n
            if split == "time" and sup and qry:
                assert max(ts[r] for r in sup) <= min(ts[r] for r in qry)
        assert reader.counters["tasks_subsampled"] == subsampled
        assert reader.counters["tasks_yielded"] == len(ref)


def test_padding_repeats_the_first_row_and_masks_match():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [3, 9, 1, 5], 1, rg=4)
        c = tasks_config(support_size=5, query_size=3, min_task_rows=1, tasks_per_batch=4)
        (tb,) = list(TaskReader(path, c, ReadOptions(seed=0, shuffle=False)))
        rid_s = tb.support.sparse.field("rid")[0].view(4, 5)
        rid_q = tb.query.sparse.field("rid")[0].view(4, 3)
        for t in range(4):
            first = rid_s[t, 0] if tb.support_mask[t, 0] > 0 else rid_q[t, 0]
            assert torch.all(rid_s[t][tb.support_mask[t] == 0] == first)
            assert torch.all(rid_q[t][tb.query_mask[t] == 0] == first)
        assert tb.task_ids.dtype == torch.int64 and tb.support_mask.dtype == torch.float32


def test_fixed_query_count_melu_protocol():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [25, 11, 40, 13], 2, rg=8)
        c = tasks_config(support_size=40, query_size=10, min_task_rows=13)
        for reader in (
            TaskReader(path, c, ReadOptions(seed=0), query_count=10),
            TaskReader(path, dataclasses.replace(c, query_fraction=0.0), ReadOptions(seed=0)),
        ):
            counts = [(len(s), len(q)) for tb in reader for _, s, q in batch_tasks(tb)]
            assert sorted(counts) == sorted([(15, 10), (30, 10), (3, 10)])
            assert reader.counters["tasks_skipped_small"] == 1 and reader.counters["rows_skipped_small"] == 11


def test_small_tasks_are_skipped_and_counted():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        sizes = [1, 4, 2, 7, 3, 3, 9]
        write_tasks(path, sizes, 3, rg=5)
        reader = TaskReader(path, tasks_config(min_task_rows=4), ReadOptions(seed=0), train=False)
        keys = [k for tb in reader for k, _, _ in batch_tasks(tb)]
        assert len(keys) == 3
        small = [s for s in sizes if s < 4]
        assert reader.counters["tasks_skipped_small"] == len(small)
        assert reader.counters["rows_skipped_small"] == sum(small)
        assert reader.counters["rows_yielded"] == sum(s for s in sizes if s >= 4)


# ---------------------------------------------------------------- sharding, shuffle, resume


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("train,unit", [(False, 1), (True, 1), (True, 3)])
def test_every_row_once_per_epoch_across_ranks(world_size, train, unit):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        rng = np.random.default_rng(world_size)
        sizes = rng.integers(1, 25, 40).tolist()
        write_tasks(path, sizes, 4, rg=9, per_file=100)
        ref = file_tasks(path)
        c = tasks_config(support_size=30, query_size=30, min_task_rows=1, shuffle_buffer_tasks=4)
        for epoch in (0, 1):
            rids: Counter = Counter()
            keys: Counter = Counter()
            for rank in range(world_size):
                reader = TaskReader(
                    path,
                    dataclasses.replace(c, unit_row_groups=unit),
                    ReadOptions(seed=5, shard=Shard(rank=rank, world_size=world_size)),
                    train=train,
                )
                reader.set_epoch(epoch)
                for tb in reader:
                    for key, sup, qry in batch_tasks(tb):
                        keys[key] += 1
                        rids.update(sup + qry)
            assert keys == Counter(ref.keys())
            assert rids == Counter(r for rows in ref.values() for r, _ in rows)


@pytest.mark.parametrize("train", [True, False])
def test_every_row_once_across_ranks_and_dataloader_workers(train):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        sizes = np.random.default_rng(8).integers(1, 25, 60).tolist()
        write_tasks(path, sizes, 4, rg=9, per_file=100)
        ref = file_tasks(path)
        c = tasks_config(support_size=30, query_size=30, min_task_rows=1, shuffle_buffer_tasks=4)
        rids: Counter = Counter()
        for rank in range(2):
            reader = TaskReader(
                path,
                dataclasses.replace(c, unit_row_groups=1),
                ReadOptions(seed=5, shard=Shard(rank=rank, world_size=2)),
                train=train,
            )
            loader = torch.utils.data.DataLoader(reader, batch_size=None, num_workers=2)
            for tb in loader:
                rids.update(r for _, sup, qry in batch_tasks(tb) for r in sup + qry)
        assert rids == Counter(r for rows in ref.values() for r, _ in rows)
        reader = TaskReader(path, dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=5), train=train)
        state = next(iter(reader.iter_with_state()))[1]
        reader.load_state_dict(state)  # mid-epoch: one shard's position, not each worker's
        with pytest.raises(ConfigError, match="resume mid-epoch inside DataLoader workers"):
            list(torch.utils.data.DataLoader(reader, batch_size=None, num_workers=2))


def test_shuffle_is_seeded_and_changes_with_epoch():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [5] * 60, 6, rg=10)
        c = tasks_config(shuffle_buffer_tasks=20)

        def order(seed, epoch):
            r = TaskReader(path, dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=seed))
            r.set_epoch(epoch)
            return [batch_tasks(tb) for tb in r]

        assert order(1, 0) == order(1, 0)
        # Loading units ahead on threads changes neither the batches nor the task counters.
        runs = []
        for ahead in (0, 1, 3):
            r = TaskReader(
                path, dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=1, read_ahead=ahead)
            )
            batches = [batch_tasks(tb) for tb in r]
            runs.append((batches, {k: v for k, v in r.counters.items() if k.startswith(("tasks", "rows_y"))}))
        assert runs[0][0] == order(1, 0)
        assert runs[0] == runs[1] == runs[2]
        assert order(1, 0) != order(1, 1)
        assert order(1, 0) != order(2, 0)
        keys = [k for b in order(1, 0) for k, _, _ in b]
        assert keys != sorted(keys) and sorted(keys) == sorted(file_tasks(path))


@pytest.mark.parametrize("train", [True, False])
def test_resume_mid_epoch_yields_exactly_the_rest(train):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        rng = np.random.default_rng(7)
        write_tasks(path, rng.integers(1, 20, 45).tolist(), 7, rg=11)
        c = tasks_config(shuffle_buffer_tasks=7, tasks_per_batch=4, min_task_rows=3)
        full_reader = TaskReader(path, c, ReadOptions(seed=3), train=train)
        full = [(batch_tasks(tb), st) for tb, st in full_reader.iter_with_state()]
        assert full[-1][1]["epoch_done"] and not full[0][1]["epoch_done"] or len(full) == 1
        for k in range(len(full)):
            reader = TaskReader(path, c, ReadOptions(seed=3), train=train)
            reader.load_state_dict(full[k][1])
            if k == len(full) - 1:  # the state after the last batch starts the next epoch
                assert reader.epoch == 1
                continue
            assert reader.epoch == 0
            assert [batch_tasks(tb) for tb in reader] == [b for b, _ in full[k + 1 :]]
            # Counters travel with the position. Decode work and memory are the exception:
            # they depend on when the worker threads ran, and a resumed window may decode
            # once more a row group whose kept head an earlier unit held (seen: -1 to +3
            # row groups over repeated runs). They stay whole row groups.
            work = ("rows_read", "row_groups_read", "max_buffered_rows")
            assert {k: v for k, v in reader.counters.items() if k not in work} == {
                k: v for k, v in full_reader.counters.items() if k not in work
            }
            extra_rows, extra_groups = (reader.counters[k] - full_reader.counters[k] for k in work[:2])
            assert extra_rows == 11 * extra_groups, k
        assert full[-1][1]["counters"] == full_reader.counters
        # A reader resumed mid-epoch also continues into the next epoch normally.
        reader = TaskReader(path, c, ReadOptions(seed=3), train=train)
        reader.load_state_dict(full[len(full) // 2][1])
        list(reader)
        assert reader.epoch == 1


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_a_unit_read_after_the_next_one_reuses_its_kept_head(read_ahead):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        sizes = [5] * 40  # rg=7: tasks cross row groups, none spans three
        write_tasks(path, sizes, 9, rg=7)
        reader = TaskReader(
            path,
            dataclasses.replace(tasks_config(min_task_rows=1), unit_row_groups=1),
            ReadOptions(seed=2, read_ahead=read_ahead),
        )
        rids = Counter(r for tb in reader for _, sup, qry in batch_tasks(tb) for r in sup + qry)
        assert rids == Counter(range(sum(sizes)))
        units = [u.start for u in reader.units(0)]
        pos = {g: i for i, g in enumerate(units)}
        keys = task_columns(sizes, 9)["user"]
        rg_rows = [len(keys[g : g + 7]) for g in range(0, len(keys), 7)]
        first, last = keys[::7], keys[6::7]
        # Row group h is decoded again only when h-1's last task runs into it and h-1 is
        # read first (fewer times: a worker's cache may still hold it).
        again = [h for h in range(1, len(rg_rows)) if first[h] == last[h - 1] and pos[h - 1] < pos[h]]
        crossing = sum(first[h] == last[h - 1] for h in range(1, len(rg_rows)))
        assert 0 < len(again) < crossing
        assert sum(sizes) <= reader.counters["rows_read"] <= sum(sizes) + sum(rg_rows[h] for h in again)


@pytest.mark.parametrize("train", [True, False])
def test_task_aligned_row_groups_are_decoded_once(train):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        sizes = [5, 3, 8, 2, 7, 4, 4, 1, 7, 6] * 4  # none longer than a row group
        write_tasks(path / "aligned", sizes, 3, rg=8, align_tasks=True)
        write_tasks(path / "cut", sizes, 3, rg=8)
        c = tasks_config(min_task_rows=1)

        def read(p):
            reader = TaskReader(
                p, dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=4, read_ahead=0), train=train
            )
            return sorted(t for tb in reader for t in batch_tasks(tb)), reader.counters

        got, stats = read(path / "aligned")
        want, _ = read(path / "cut")
        assert got == want  # a task's split and sample do not depend on the layout
        info = open_dataset(path / "aligned")
        assert stats["rows_read"] == sum(sizes)
        assert stats["row_groups_read"] == len(info.row_groups)
        assert all(rg.num_rows <= 8 for rg in info.row_groups)


def test_files_without_statistics_read_the_key_column():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        sizes = [3, 8, 2, 6, 5, 9]
        write_tasks(path / "stats", sizes, 5, rg=4)
        table = pq.read_table(path / "stats")
        (path / "plain").mkdir()
        pq.write_table(table, path / "plain" / "part-00000.parquet", row_group_size=4, write_statistics=False)
        md = pq.ParquetFile(path / "plain" / "part-00000.parquet").metadata
        assert md.row_group(0).column(0).statistics is None
        c = tasks_config(min_task_rows=1)
        a = [
            batch_tasks(tb)
            for tb in TaskReader(
                path / "stats", dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=1)
            )
        ]
        b = [
            batch_tasks(tb)
            for tb in TaskReader(
                path / "plain", dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=1)
            )
        ]
        assert a == b and sum(len(x) for x in a) == len(sizes)


def test_state_is_checked():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [4, 5, 6], 0)
        state = TaskReader(path, tasks_config(), ReadOptions(seed=1)).state_dict()
        with pytest.raises(ConfigError, match="seed"):
            TaskReader(path, tasks_config(), ReadOptions(seed=2)).load_state_dict(state)
        with pytest.raises(ConfigError, match="version"):
            TaskReader(path, tasks_config(), ReadOptions(seed=1)).load_state_dict({"version": 99})
        bad = dict(state, task_offset=10_000)
        reader = TaskReader(path, tasks_config(), ReadOptions(seed=1))
        reader.load_state_dict(bad)
        with pytest.raises(DataError, match="past the window"):
            list(reader)


def test_memory_stays_bounded_on_a_file_ten_times_the_buffer():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        sizes = [20] * 500  # 10,000 rows
        write_tasks(path, sizes, 8, rg=100)
        c = tasks_config(shuffle_buffer_tasks=50, support_size=8, query_size=4, tasks_per_batch=8)
        reader = TaskReader(path, dataclasses.replace(c, unit_row_groups=1), ReadOptions(seed=0))
        n = sum(tb.num_tasks for tb in reader)
        assert n == 500
        # window: buffer + one unit of whole tasks; carry: T sampled tasks; row groups
        # cached (2) and decoded ahead (this unit, the next, one continuation).
        tasks_per_unit = 100 // 20 + 1
        bound = (c.shuffle_buffer_tasks + tasks_per_unit) * 20 + c.tasks_per_batch * (8 + 4) + (2 + 3) * 100
        assert 0 < reader.counters["max_buffered_rows"] <= bound
        assert reader.counters["max_buffered_rows"] * 5 < sum(sizes)


def test_from_config_uses_data_settings():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [4] * 10, 0)
        data = DataConfig(seed=9, shuffle=False, drop_last=True, invalid_ids="clip")
        r = TaskReader.from_config(path, tasks_config(), data, train=True)
        o = r.options
        assert (o.seed, o.shuffle, o.drop_last, o.policies.invalid_ids) == (9, False, True, "clip")
        assert sum(tb.num_tasks for tb in r) == 9 and r.counters["tasks_dropped_last"] == 1
        ev = TaskReader.from_config(path, tasks_config(), data, train=False)
        assert not ev.train and not ev.options.shuffle and not ev.options.drop_last
        whole = TaskReader.from_config(
            path, Config(data=data, tasks=tasks_config(tasks_per_batch=5)), train=True
        )
        assert (whole.options.seed, whole.cfg.tasks_per_batch, whole.options.drop_last) == (9, 5, True)
        with pytest.raises(ConfigError, match=r"\[data\]"):
            TaskReader.from_config(path, tasks_config(), train=True)


# ---------------------------------------------------------------- bad input


def test_unsorted_task_key_in_grouped_file_names_file_and_row_group():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        cols = task_columns([3, 3, 3, 3], 0, keys=[1, 2, 3, 4])
        cols["user"] = np.array([1, 1, 1, 3, 3, 3, 2, 2, 4, 4, 4, 4])  # inside row group 0
        write_parquet(path, task_schema(12), cols, rows_per_row_group=8, align_tasks=False)
        reader = TaskReader(path, tasks_config(), ReadOptions(seed=0))
        with pytest.raises(
            DataError, match=r"part-00000.parquet, row group 0.*from 3 to 2 at row 6.*claims to be grouped"
        ):
            list(reader)
    with tempfile.TemporaryDirectory() as tmp:  # across a row group boundary: found from the footers
        path = Path(tmp)
        cols = task_columns([4, 4, 4], 0, keys=[1, 2, 3])
        cols["user"] = np.array([5, 5, 5, 5, 1, 1, 1, 1, 2, 2, 2, 2])
        write_parquet(path, task_schema(12), cols, rows_per_row_group=4, align_tasks=False)
        with pytest.raises(DataError, match=r"row group 1.*decreases from 5 to 1"):
            TaskReader(path, tasks_config(), ReadOptions(seed=0))
    with tempfile.TemporaryDirectory() as tmp:  # not claimed: same check, other advice
        path = Path(tmp)
        cols = task_columns([2, 2], 0, keys=[2, 1])
        write_parquet(path, task_schema(4, grouped=False), cols, rows_per_row_group=4, align_tasks=False)
        with pytest.raises(DataError, match="not sorted by task key; rewrite it"):
            list(TaskReader(path, tasks_config(), ReadOptions(seed=0)))


def test_missing_task_key_or_timestamp():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        schema = FeatureSchema(dense=("d0",), sparse=(SparseField("c", 3),))
        write_parquet(
            path, schema, {"label": np.zeros(3, np.float32), "d0": np.ones(3), "c": np.zeros(3, int)}
        )
        with pytest.raises(DataError, match="no task key"):
            TaskReader(path, tasks_config(), ReadOptions(seed=0))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [3, 3], 0, timestamp=False)
        with pytest.raises(DataError, match="timestamp"):
            TaskReader(path, tasks_config(split="time"), ReadOptions(seed=0))
        with pytest.raises(ConfigError, match="query_fraction"):
            TaskReader(path, tasks_config(query_fraction=1.5), ReadOptions(seed=0))


def test_corrupt_truncated_and_empty_files():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [5, 5, 5, 5], 0, rg=4, per_file=8)
        files = sorted(path.glob("*.parquet"))
        data = files[1].read_bytes()
        files[1].write_bytes(data[: len(data) // 2])
        with pytest.raises(DataError, match="part-00001.parquet.*(corrupt|truncated)"):
            TaskReader(path, tasks_config(), ReadOptions(seed=0))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path, [5, 5, 5, 5], 0, rg=20)
        (f,) = path.glob("*.parquet")
        raw = bytearray(f.read_bytes())
        mid = len(raw) // 3
        raw[mid : mid + 64] = bytes(64)  # a data page, checksummed
        f.write_bytes(bytes(raw))
        with pytest.raises(DataError, match="part-00000.parquet"):
            list(TaskReader(path, tasks_config(), ReadOptions(seed=0)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_parquet(path, task_schema(1), task_columns([0], 0, keys=[1]) | {"rid": np.zeros(0, int)})
        reader = TaskReader(path, tasks_config(), ReadOptions(seed=0))
        assert list(reader) == [] and reader.state_dict()["epoch_done"]


def test_schemas_that_disagree():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_tasks(path / "a", [3, 3], 0)
        write_tasks(path / "b", [3, 3], 1, timestamp=False)
        (path / "b" / "part-00000.parquet").rename(path / "a" / "part-00001.parquet")
        with pytest.raises(DataError, match="part-00001.parquet.*schema differs"):
            TaskReader(path / "a", tasks_config(), ReadOptions(seed=0))


def test_null_values_in_list_columns_follow_the_policy():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        cols = task_columns([3, 3], 0, keys=[1, 2])
        cols["tags"] = pa.array([[1], None, [2], [3, None], [], [4]], pa.list_(pa.int64()))
        write_parquet(path, task_schema(6), cols)
        with pytest.raises(DataError, match=r"column 'tags'.*null list at row 1"):
            list(TaskReader(path, tasks_config(), ReadOptions(seed=0)))
        reader = TaskReader(
            path,
            tasks_config(min_task_rows=1),
            ReadOptions(seed=0, policies=Policies(invalid_ids="skip")),
            train=False,
        )
        rids = sorted(r for tb in reader for _, s, q in batch_tasks(tb) for r in s + q)
        assert rids == [0, 2, 4, 5] and reader.counters["rows_skipped_invalid_ids"] == 2

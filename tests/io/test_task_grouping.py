"""group_by_task: the external sort against a stable Python sort of pyarrow's rows."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from recaccel.config import TasksConfig
from recaccel.errors import ConfigError, DataError
from recaccel.io.convert.group_by_task import group_by_task
from recaccel.io.format.dataset import open_dataset
from recaccel.io.format.grouping import GROUPED_KEY, grouped_claim
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet
from recaccel.io.readers.tasks.reader import TaskReader
from tests.helpers.task_data import TASK_SETTINGS, batch_tasks


def source_schema(with_task: bool, with_ts: bool) -> FeatureSchema:
    sparse = (SparseField("uid", 30), SparseField("bag", 7, multi_hot=True), SparseField("rid", 10_000))
    return FeatureSchema(
        dense=("d0", "d1"),
        sparse=sparse,
        task_key="user" if with_task else None,
        timestamp="ts" if with_ts else None,
    )


def source_columns(n: int, seed: int, with_task: bool, with_ts: bool, key_range: int) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 3, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cols = {
        "label": rng.integers(0, 2, n).astype(np.float32),
        "d0": rng.normal(size=n),
        "d1": rng.normal(size=n),
        "uid": rng.integers(0, min(30, key_range), n),
        "bag": (rng.integers(0, 7, int(offsets[-1])), offsets),
        "rid": np.arange(n),
    }
    if with_task:
        cols["user"] = rng.integers(-key_range, key_range, n)  # negative keys too
    if with_ts:
        cols["ts"] = rng.integers(0, 5, n)  # many ties: the sort must be stable
    return cols


def read_rows(path: Path) -> list[dict]:
    return [r for f in sorted(path.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


@TASK_SETTINGS
@given(
    st.integers(0, 300),
    st.integers(1, 40),
    st.integers(1, 120),
    st.booleans(),
    st.booleans(),
    st.integers(1, 50),
    st.integers(0, 2**16),
)
def test_matches_a_stable_sort(n, src_rg, memory_rows, by_field, with_ts, key_range, seed):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        schema = source_schema(not by_field, with_ts)
        write_parquet(
            tmp / "src",
            schema,
            source_columns(n, seed, not by_field, with_ts, key_range),
            rows_per_row_group=src_rg,
            rows_per_file=97,
        )
        key = "uid" if by_field else "user"
        report = group_by_task(
            tmp / "src", tmp / "out", task_key=key, rows_per_row_group=13, memory_rows=memory_rows
        )
        src = read_rows(tmp / "src")
        want = sorted(src, key=lambda r: (r[key], r["ts"] if with_ts else 0))  # Python's sort is stable
        got = read_rows(tmp / "out")
        out_key = "task" if by_field else "user"
        assert [r["rid"] for r in got] == [r["rid"] for r in want]
        for g, w in zip(got, want):
            assert g[out_key] == w[key]
            assert {k: g[k] for k in w if k != "user" or not by_field} == {
                k: w[k] for k in w if k != "user" or not by_field
            }
        assert report.rows == n and report.tasks == len({r[key] for r in src})
        assert (report.runs > 0) == (n > memory_rows)  # spilled exactly when it does not fit
        info = open_dataset(tmp / "out")
        assert info.schema.task_key == out_key and info.schema.timestamp == ("ts" if with_ts else None)
        assert grouped_claim(info.schema) == {"task_key": out_key, "timestamp": info.schema.timestamp}
        assert not list((tmp / "out").glob(".recaccel-sort-*"))  # spilled runs are removed
        if n:
            md = pq.ParquetFile(info.files[0]).metadata
            assert all(md.row_group(i).num_rows <= 13 for i in range(md.num_row_groups))
            assert_task_aligned(info.files, out_key)


def assert_task_aligned(files: tuple[Path, ...], key: str) -> None:
    """Every row group ends at a task boundary unless it holds one task only (a task
    longer than a row group), across files too."""
    groups = [
        pf.read_row_group(i, columns=[key]).column(0).to_pylist()
        for f in files
        for pf in [pq.ParquetFile(f)]
        for i in range(pf.num_row_groups)
    ]
    for before, after in zip(groups, groups[1:]):
        if before and after and before[-1] == after[0]:
            assert len(set(before)) == 1, (before, after)


def test_grouped_output_reads_as_tasks_and_keeps_memory_bounded():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n = 3000
        write_parquet(
            tmp / "src",
            source_schema(True, True),
            source_columns(n, 1, True, True, 40),
            rows_per_row_group=100,
        )
        report = group_by_task(
            tmp / "src", tmp / "out", task_key="user", memory_rows=400, rows_per_row_group=64
        )
        assert report.runs == 8 and report.max_rows_in_memory <= 400 + 8 * 1024
        reader = TaskReader(tmp / "out", TasksConfig(min_task_rows=1, tasks_per_batch=7), train=False)
        keys = [k for tb in reader for k, _, _ in batch_tasks(tb)]
        assert keys == sorted(set(keys)) and len(keys) == report.tasks
        assert reader.counters["rows_yielded"] == n


def test_bad_arguments_and_input():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_parquet(tmp / "src", source_schema(True, False), source_columns(20, 0, True, False, 5))
        with pytest.raises(ConfigError, match="neither the schema's task key"):
            group_by_task(tmp / "src", tmp / "o1", task_key="bag")  # multi-hot
        with pytest.raises(ConfigError, match="timestamp"):
            group_by_task(tmp / "src", tmp / "o1", task_key="user", timestamp="d0")
        with pytest.raises(ConfigError, match="source directory"):
            group_by_task(tmp / "src", tmp / "src", task_key="user")
        with pytest.raises(ConfigError, match="already a column"):
            group_by_task(tmp / "src", tmp / "o1", task_key="uid", task_column="rid")
        group_by_task(tmp / "src", tmp / "o2", task_key="user")
        with pytest.raises(DataError, match="already exists"):
            group_by_task(tmp / "src", tmp / "o2", task_key="user")
        group_by_task(tmp / "src", tmp / "o2", task_key="user", overwrite=True)
        f = next((tmp / "src").glob("*.parquet"))
        f.write_bytes(f.read_bytes()[:100])
        with pytest.raises(DataError, match="corrupt or truncated"):
            group_by_task(tmp / "src", tmp / "o3", task_key="user")


def test_empty_source_writes_one_empty_grouped_file():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_parquet(tmp / "src", source_schema(True, True), source_columns(0, 0, True, True, 5))
        report = group_by_task(tmp / "src", tmp / "out", task_key="user")
        assert report.rows == 0 and report.tasks == 0 and len(report.paths) == 1
        info = open_dataset(tmp / "out")
        assert info.num_rows == 0 and GROUPED_KEY in info.schema.extra


def test_cli_groups_with_the_chosen_codec(tmp_path, capsys):
    from recaccel.cli import data_main

    write_parquet(
        tmp_path / "src",
        source_schema(True, False),
        source_columns(50, 2, True, False, 6),
        rows_per_row_group=10,
    )
    argv = [
        "tasks",
        str(tmp_path / "src"),
        str(tmp_path / "out"),
        "--task-key",
        "user",
        "--compression",
        "lz4",
        "--memory-rows",
        "20",
    ]
    assert data_main(argv) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert report["rows"] == 50 and report["runs"] == 3
    assert "group by task" in printed.err and "100/100" in printed.err  # read, then merged
    md = pq.ParquetFile(next((tmp_path / "out").glob("*.parquet"))).metadata
    assert md.row_group(0).column(0).compression == "LZ4"
    with pytest.raises(SystemExit):  # argparse names the valid choices
        data_main([*argv[:5], "--compression", "brotli2"])

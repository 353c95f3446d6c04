"""The io benchmark refuses a throughput whose passes did not read the whole dataset (its
figure is dataset rows over pass time)."""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import pytest

from recaccel.bench.data import io as bench
from recaccel.bench.data import io_workers
from recaccel.errors import RecaccelError
from recaccel.io.format.dataset import open_dataset

REAL_CANDIDATES = bench.candidates


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    return parser.parse_args(
        ["--rows", "3000", "--rows-per-row-group", "1000", "--batch-size", "256", "--tasks-per-batch", "4",
         "--support-size", "8", "--query-size", "4", "--repeats", "1", "--no-memory"]
    )  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    a = _args()
    work = tmp_path_factory.mktemp("io")
    return bench.make_dataset(work, a.rows, a.task_rows, a.zipf_a, a.rows_per_row_group, a.compression)


def test_a_reader_that_skips_rows_is_refused(dataset, monkeypatch):
    def first_row_group_only(path):
        with pq.ParquetFile(str(open_dataset(path).files[0])) as pf:
            return pf.read_row_group(0).num_rows

    def candidates(path, args):
        return {**REAL_CANDIDATES(path, args), "plain": lambda: first_row_group_only(path)}

    monkeypatch.setattr(bench, "candidates", candidates)
    with pytest.raises(RecaccelError, match=r"'plain' read \d+ rows per pass, the dataset has 3000"):
        bench.run_io_bench(dataset, _args())


def test_readers_that_read_every_row_are_timed(dataset):
    table, _ = bench.run_io_bench(dataset, _args())
    assert {r["candidate"] for r in table} >= {"raw_pyarrow", "plain", "plain_in_order", "tasks"}
    assert all(r["median_s"] > 0 for r in table)


class _FirstBatchOnly:
    """A reader that stops after its first batch (its counters: the rows it read)."""

    def __init__(self, reader):
        self.reader = reader

    def __iter__(self):
        yield next(iter(self.reader))

    @property
    def counters(self):
        return self.reader.counters


def _sweep_args():
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    return parser.parse_args(
        ["--workers", "0", "--schema", "criteo_1hot", "--rows", "3000", "--rows-per-row-group", "500",
         "--shuffle-buffer-rows", "500", "--batch-size", "256", "--repeats", "1", "--train-steps", "0"]
    )  # fmt: skip


def test_a_worker_sweep_reader_that_stops_early_is_refused(monkeypatch, tmp_path):
    real = io_workers.sweep_candidates

    def candidates(*args, **kwargs):
        cands = real(*args, **kwargs)
        plain = cands["plain", 0]
        cands["plain", 0] = lambda: _FirstBatchOnly(plain())
        return cands

    monkeypatch.setattr(io_workers, "sweep_candidates", candidates)
    with pytest.raises(
        RecaccelError, match=r"'plain at 0 workers' read \d+ rows per pass, the dataset has 3000"
    ):
        io_workers.run_sweep(tmp_path, _sweep_args())


def test_a_worker_sweep_whose_readers_read_every_row_is_timed(tmp_path):
    table, _ = io_workers.run_sweep(tmp_path, _sweep_args())
    assert {(r["candidate"], r["workers"]) for r in table} >= {("plain", 0), ("tasks", 0)}

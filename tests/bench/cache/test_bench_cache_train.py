"""recaccel-bench cache_train on CPU at a tiny size: rows, the minimal cache, the check that
the placements train alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from recaccel.bench.cache.train import check_same_training, window_unique_rows, zipf_ids
from recaccel.cli import bench_main
from recaccel.errors import ConfigError


def test_cache_train_writes_three_placements(tmp_path):
    out, js = tmp_path / "ct.md", tmp_path / "ct.json"
    argv = ["cache_train", "--rows", "3000", "--batch", "64", "--tables", "2", "--batches", "6"]
    argv += ["--repeats", "2", "--warmup", "1", "--block", "2", "--out", str(out), "--json", str(js)]
    assert bench_main(argv) == 0
    result = json.loads(js.read_text())
    rows = {r["candidate"]: r for r in result["rows"]}
    assert set(rows) == {"device", "host", "host_min"}
    assert rows["device"]["vs_device"] == 1.0 and rows["device"]["cache_rows"] == 0
    assert rows["host"]["cache_rows"] == 600  # 10% of the pack's 2 x 3000 rows
    assert rows["host_min"]["cache_rows"] == result["min_cache_rows"]
    assert 0.0 <= rows["host"]["cache_hit_rate"] <= 1.0 and rows["host"]["h2d_mb_per_step"] > 0
    assert "Target (GPU)" in out.read_text()


def test_zipf_ids_are_skewed_and_in_range():
    ids = zipf_ids(np.random.default_rng(0), 1000, 20_000, 1.05)
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.bincount(ids, minlength=1000)
    assert np.sort(counts)[-10:].sum() > 0.2 * ids.size  # the hottest 1% of rows: > 20% of lookups


def test_window_unique_rows_counts_the_union_of_consecutive_batches():
    class _B:
        def __init__(self, values):
            from recaccel.sparse import SparseFeatures

            self.sparse = SparseFeatures.from_lengths(
                ["a"], torch.tensor(values), torch.ones(len(values), dtype=torch.int64)
            )

    batches = [_B([1, 2]), _B([2, 3]), _B([4, 5])]
    assert window_unique_rows(batches, 1) == 2
    assert window_unique_rows(batches, 2) == 4  # {2,3} + {4,5}, or {4,5} + {1,2} (rotation)


def test_placements_that_train_differently_void_the_timing():
    same = {"device": [torch.tensor(0.5)], "host": [torch.tensor(0.5)]}
    check_same_training(same, cuda=False)
    with pytest.raises(ConfigError, match="host trained differently"):
        check_same_training({"device": [torch.tensor(0.5)], "host": [torch.tensor(0.5001)]}, cuda=False)

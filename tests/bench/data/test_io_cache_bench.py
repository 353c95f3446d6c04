"""``recaccel-bench io --workers N --cache``: the plain reader timed from a pre-decoded cache
of the same dataset, beside the Parquet candidates, with the build time in the notes."""

from __future__ import annotations

import json

import pytest

from recaccel.cli import bench_main

TINY = ["--rows", "3000", "--rows-per-row-group", "1000", "--batch-size", "256", "--repeats", "1"]


def test_cache_flag_adds_a_plain_cache_row_per_worker_count_and_notes_the_build(tmp_path):
    js = tmp_path / "io.json"
    argv = ["io", "--workers", "0", "--cache", *TINY, "--train-steps", "0", "--out", str(tmp_path / "io.md")]
    assert bench_main([*argv, "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    rows = {(r["candidate"], r["workers"]): r for r in doc["results"]}
    cached, plain = rows[("plain_cache", 0)], rows[("plain", 0)]
    for row in (cached, plain):  # both candidates read the whole dataset
        assert row["rows_per_s"] * row["median_s"] == pytest.approx(3000)
    assert any(n.startswith("cache of criteo_1hot: 3000 rows,") and "built in" in n for n in doc["notes"])

"""``recaccel-bench io --workers N --cache``: the plain and task readers timed from a
pre-decoded cache of the same dataset, beside the Parquet candidates, with the build time
in the notes."""

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


def test_cache_flag_adds_a_tasks_cache_row_per_worker_count_compared_with_plain_cache(tmp_path):
    js = tmp_path / "io.json"
    argv = [
        "io",
        "--workers",
        "0,1",
        "--cache",
        *TINY,
        "--train-steps",
        "0",
        "--out",
        str(tmp_path / "io.md"),
    ]
    assert bench_main([*argv, "--json", str(js)]) == 0
    rows = {(r["candidate"], r["workers"]): r for r in json.loads(js.read_text())["results"]}
    for n in (0, 1):
        tasks, plain = rows[("tasks_cache", n)], rows[("plain_cache", n)]
        assert tasks["rows_per_s"] * tasks["median_s"] == pytest.approx(3000)
        assert tasks["tasks_vs_plain"] == pytest.approx(tasks["rows_per_s"] / plain["rows_per_s"])
    assert "| tasks_cache | 1 |" in (tmp_path / "io.md").read_text()

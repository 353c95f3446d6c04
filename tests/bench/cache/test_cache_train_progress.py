"""recaccel-bench cache_train says what it is doing on stderr while it runs."""

from __future__ import annotations

from recaccel.cli import bench_main

TINY = ["--rows", "2000", "--batch", "32", "--tables", "2", "--batches", "4"]
TINY += ["--repeats", "1", "--warmup", "1", "--block", "1"]


def test_cache_train_reports_each_phase_and_every_timed_block_on_stderr(tmp_path, capsys):
    assert bench_main(["cache_train", *TINY, "--out", str(tmp_path / "ct.md")]) == 0
    err = capsys.readouterr().err
    for phase in ("building device", "building host", "building host_min", "timing 6 blocks of 1 steps"):
        assert f"cache_train: {phase}" in err
    assert "9/9" in err  # 3 builds + 3 placements x (1 warmup + 1 timed) blocks


def test_cache_train_progress_can_be_silenced(tmp_path, capsys):
    assert bench_main(["cache_train", *TINY, "--no-progress", "--out", str(tmp_path / "ct.md")]) == 0
    assert "cache_train:" not in capsys.readouterr().err

"""Every benchmark runs end to end through ``recaccel-bench`` on a tiny problem."""

from __future__ import annotations

from recaccel.cli import bench_main


def test_bench_io_through_the_cli(tmp_path, capsys):
    out = tmp_path / "io.md"
    argv = ["io", "--rows", "6000", "--rows-per-row-group", "1000", "--batch-size", "256",
            "--tasks-per-batch", "4", "--support-size", "8", "--query-size", "4", "--repeats", "1",
            "--no-memory", "--out", str(out)]
    assert bench_main(argv) == 0
    text = out.read_text()
    assert "raw_pyarrow" in text and "tasks" in text and "recaccel-bench io" in text
    assert f"results written to {out}" in capsys.readouterr().out


def test_bench_interaction_through_the_cli(tmp_path):
    out = tmp_path / "interaction.md"
    argv = ["interaction", "--batch", "32", "--fields", "3", "--dim", "8", "--repeats", "2", "--device", "cpu",
            "--out", str(out), "--plot", str(tmp_path / "i.png")]
    assert bench_main(argv) == 0
    assert "eager_fwd_ms" in out.read_text() and (tmp_path / "i.png").is_file()

"""Every benchmark runs end to end through ``recaccel-bench`` on a tiny problem."""

from __future__ import annotations

from recaccel.cli import bench_main


def test_bench_io_through_the_cli(tmp_path, capsys):
    out = tmp_path / "io.md"
    train_cfg = tmp_path / "tiny.toml"
    train_cfg.write_text(
        "[synth]\ntrain_rows = 2000\ntest_rows = 500\nnum_sparse = 3\ncardinality = 20\n"
        "[data]\nbatch_size = 128\n[model]\nembedding_dim = 4\nbottom_mlp = [8, 4]\ntop_mlp = [8, 1]\n"
    )
    argv = ["io", "--rows", "6000", "--rows-per-row-group", "1000", "--batch-size", "256",
            "--tasks-per-batch", "4", "--support-size", "8", "--query-size", "4", "--repeats", "1",
            "--no-memory", "--train-steps", "5", "--train-config", str(train_cfg), "--device", "cpu",
            "--out", str(out), "--plot", str(tmp_path / "io.png")]
    assert bench_main(argv) == 0
    text = out.read_text()
    assert "raw_pyarrow" in text and "raw_pyarrow_threads" in text and "tasks" in text
    assert "recaccel-bench io" in text and "debug_dlrm_train (cpu)" in text and "data_wait_fraction" in text
    assert (tmp_path / "io.png").is_file()
    assert f"results written to {out}" in capsys.readouterr().out


def test_bench_io_keeps_its_reading_results_when_the_training_run_fails(tmp_path, capsys):
    out = tmp_path / "io.md"
    argv = ["io", "--rows", "3000", "--rows-per-row-group", "1000", "--batch-size", "256",
            "--tasks-per-batch", "4", "--support-size", "8", "--query-size", "4", "--repeats", "1",
            "--no-memory", "--train-steps", "5", "--train-config", str(tmp_path / "missing.toml"),
            "--plot", "", "--out", str(out)]
    assert bench_main(argv) == 2  # the config error ends the command
    text = out.read_text()
    assert "raw_pyarrow" in text and "debug_dlrm_train FAILED (ConfigError" in text


def test_bench_interaction_through_the_cli(tmp_path):
    out = tmp_path / "interaction.md"
    argv = ["interaction", "--batch", "32", "--fields", "3", "--dim", "8", "--repeats", "2", "--device", "cpu",
            "--out", str(out), "--plot", str(tmp_path / "i.png")]
    assert bench_main(argv) == 0
    assert "eager_fwd_ms" in out.read_text() and (tmp_path / "i.png").is_file()

"""Every benchmark runs end to end through ``recaccel-bench`` on a tiny problem."""

from __future__ import annotations

from pathlib import Path

from recaccel.cli import bench_main


def test_bench_io_through_the_cli(tmp_path, capsys):
    out = tmp_path / "io.md"
    train_cfg = tmp_path / "tiny.toml"
    train_cfg.write_text(
        "[synth]\ntrain_rows = 2000\ntest_rows = 500\nnum_sparse = 3\ncardinality = 20\n"
        "[data]\nbatch_size = 128\n[model]\nembedding_dim = 4\nbottom_mlp = [8, 4]\ntop_mlp = [8, 1]\n"
    )
    argv = [
        "io",
        "--rows",
        "6000",
        "--rows-per-row-group",
        "1000",
        "--batch-size",
        "256",
        "--tasks-per-batch",
        "4",
        "--support-size",
        "8",
        "--query-size",
        "4",
        "--repeats",
        "1",
        "--no-memory",
        "--train-steps",
        "5",
        "--train-config",
        str(train_cfg),
        "--device",
        "cpu",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "io.png"),
    ]
    assert bench_main(argv) == 0
    text = out.read_text()
    assert "raw_pyarrow" in text and "raw_pyarrow_threads" in text and "tasks" in text
    assert "recaccel-bench io" in text and "debug_dlrm_train (cpu)" in text and "data_wait_fraction" in text
    assert (tmp_path / "io.png").is_file()
    assert f"results written to {out}" in capsys.readouterr().out


def test_bench_io_keeps_its_reading_results_when_the_training_run_fails(tmp_path, capsys):
    out = tmp_path / "io.md"
    argv = [
        "io",
        "--rows",
        "3000",
        "--rows-per-row-group",
        "1000",
        "--batch-size",
        "256",
        "--tasks-per-batch",
        "4",
        "--support-size",
        "8",
        "--query-size",
        "4",
        "--repeats",
        "1",
        "--no-memory",
        "--train-steps",
        "5",
        "--train-config",
        str(tmp_path / "missing.toml"),
        "--plot",
        "",
        "--out",
        str(out),
    ]
    assert bench_main(argv) == 2  # the config error ends the command
    text = out.read_text()
    assert "raw_pyarrow" in text and "debug_dlrm_train FAILED (ConfigError" in text


def test_bench_interaction_through_the_cli(tmp_path):
    out = tmp_path / "interaction.md"
    argv = [
        "interaction",
        "--batch",
        "32",
        "--fields",
        "3",
        "--dim",
        "8",
        "--repeats",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "i.png"),
    ]
    assert bench_main(argv) == 0
    assert "eager_fwd_ms" in out.read_text() and (tmp_path / "i.png").is_file()


def _listing(folder):
    return {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_a_benchmark_writes_under_runs_bench_unless_told(tmp_path, monkeypatch, repo_root, capsys):
    published = repo_root / "bench" / "results"
    before = _listing(published)
    monkeypatch.chdir(tmp_path)  # default paths are relative to the working directory
    argv = [
        "embedding",
        "--tables",
        "2",
        "--shapes",
        "8:4:2",
        "--rows",
        "50",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--batches",
        "1",
        "--device",
        "cpu",
    ]
    assert bench_main(argv) == 0
    assert _listing(published) == before
    assert not (tmp_path / "bench").exists()
    written = sorted(p.name for p in (tmp_path / "runs" / "bench").iterdir())
    assert written == ["embedding.md", "embedding.png"]
    assert "results written to runs/bench/embedding.md" in capsys.readouterr().out


def test_asked_for_a_place_the_plot_goes_next_to_the_summary():
    import argparse

    from recaccel.bench.harness.report import add_output_args, plot_file

    parser = argparse.ArgumentParser()
    add_output_args(parser, "x", plot="y")
    assert plot_file(parser.parse_args([])) == Path("runs/bench/x.png")
    assert plot_file(parser.parse_args(["--out", "bench/results/x.md"])) == Path("bench/results/x.png")
    assert plot_file(parser.parse_args(["--out", "a/x.md", "--plot", "b/p.png"])) == Path("b/p.png")
    assert plot_file(parser.parse_args(["--out", "a/x.md", "--plot", ""])) is None

"""``recaccel-bench io --workers``: rows/s per reader process count, and its gpu-check targets."""

from __future__ import annotations

import json

import pytest

from recaccel.bench.gpu_check import runner as gpu_check
from recaccel.bench.gpu_check.targets import MET, NOT_MEASURED, NOT_MET, TARGETS, evaluate
from recaccel.bench.step import report as train_report
from recaccel.cli import bench_main

TINY = [
    "--rows",
    "3000",
    "--wide-rows",
    "300",
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
    "2",
    "--train-steps",
    "0",
]
IO_TARGETS = (
    "criteo_1hot schema reader >= 12 M rows/s",
    "wide schema (500 fields) reader >= 1.5 M rows/s",
    "task batches >= 0.5x plain rows/s",
)


def test_workers_0_1_write_json_with_a_row_per_worker_count_and_the_speedup(tmp_path, capsys):
    out, js = tmp_path / "io.md", tmp_path / "io.json"
    argv = [
        "io",
        "--workers",
        "0,1",
        "--schema",
        "criteo_1hot,wide",
        *TINY,
        "--out",
        str(out),
        "--json",
        str(js),
    ]
    assert bench_main(argv) == 0
    doc = json.loads(js.read_text())
    assert doc["command"].startswith("recaccel-bench io --workers 0,1")
    assert {"device", "torch", "pyarrow", "date", "git_commit", "cpus"} <= set(doc["environment"])
    rows = {(r["schema"], r["candidate"], r["workers"]): r for r in doc["results"]}
    expected = {("criteo_1hot", name, n) for name in ("plain", "tasks") for n in (0, 1)}
    expected |= {("wide", "plain", 0), ("wide", "plain", 1)}
    expected |= {
        (s, raw, None) for s in ("criteo_1hot", "wide") for raw in ("raw_pyarrow", "raw_pyarrow_threads")
    }
    assert set(rows) == expected  # the wide schema has no task key: no task reader there
    for schema, name in (("criteo_1hot", "plain"), ("criteo_1hot", "tasks"), ("wide", "plain")):
        zero, one = rows[(schema, name, 0)], rows[(schema, name, 1)]
        assert one["speedup_vs_1_worker"] == 1.0
        assert zero["speedup_vs_1_worker"] == pytest.approx(zero["rows_per_s"] / one["rows_per_s"])
        assert one["vs_in_process"] == pytest.approx(one["rows_per_s"] / zero["rows_per_s"])
        raw = rows[(schema, "raw_pyarrow", None)]
        assert zero["vs_raw_pyarrow"] == pytest.approx(zero["rows_per_s"] / raw["rows_per_s"])
        assert zero["repeats"] == 2 and zero["median_s"] >= zero["startup_s"] > 0
    rows_3000 = rows[("criteo_1hot", "plain", 1)]
    assert rows_3000["rows_per_s"] == pytest.approx(3000 / rows_3000["median_s"])
    tasks = rows[("criteo_1hot", "tasks", 0)]
    assert tasks["tasks_vs_plain"] == pytest.approx(
        tasks["rows_per_s"] / rows[("criteo_1hot", "plain", 0)]["rows_per_s"]
    )
    text = out.read_text()
    assert "| schema | candidate | workers |" in text and "load average" in text
    assert (tmp_path / "io.png").is_file()  # rows/s against workers, next to --out
    assert f"results written to {out}" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["1,x", "-1", ""])
def test_a_bad_workers_value_is_one_line_and_exit_2(tmp_path, capsys, value):
    argv = ["io", "--workers", value, "--out", str(tmp_path / "io.md")]
    assert bench_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"recaccel-bench: error: io bench: --workers must be comma-separated counts >= 0, got {value!r}"
    )
    assert not (tmp_path / "io.md").exists()  # refused before any data was written


def test_an_unknown_schema_is_one_line_and_exit_2(tmp_path, capsys):
    assert (
        bench_main(["io", "--workers", "0", "--schema", "criteo,wide", "--out", str(tmp_path / "x.md")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["recaccel-bench: error: io bench: --schema must list criteo_1hot, wide, got 'criteo,wide'"]


def _io_row(schema, candidate, workers, rows_per_s):
    return {"schema": schema, "candidate": candidate, "workers": workers, "rows_per_s": rows_per_s}


def test_io_targets_take_each_schemas_best_worker_count_from_io_json(tmp_path):
    results = [
        _io_row("criteo_1hot", "raw_pyarrow_threads", None, 20e6),  # a ceiling, not a reader
        _io_row("criteo_1hot", "plain", 0, 2.5e6),
        _io_row("criteo_1hot", "plain", 16, 13e6),
        _io_row("criteo_1hot", "tasks", 0, 1.3e6),
        _io_row("criteo_1hot", "tasks", 16, 6e6),
        _io_row("wide", "plain", 8, 1.4e6),
        _io_row("wide", "plain", 16, 1.2e6),
    ]
    (tmp_path / "io.json").write_text(json.dumps({"results": results}))
    got = {t["target"]: t for t in evaluate(tmp_path, {})}
    assert set(IO_TARGETS) <= {t[0] for t in TARGETS}
    criteo = got["criteo_1hot schema reader >= 12 M rows/s"]
    assert criteo["status"] == MET and criteo["value"] == 13e6 and "workers=16" in criteo["figure"]
    wide = got["wide schema (500 fields) reader >= 1.5 M rows/s"]
    assert wide["status"] == NOT_MET and wide["value"] == 1.4e6 and "workers=8" in wide["figure"]
    share = got["task batches >= 0.5x plain rows/s"]
    assert share["status"] == NOT_MET and share["value"] == pytest.approx(6e6 / 13e6)
    assert got["data cost < 2% of step time"]["threshold"] == 0.02
    for target in IO_TARGETS:
        assert got[target]["source"] == "io.json"
        assert {t["target"]: t for t in evaluate(tmp_path / "none", {})}[target]["status"] == NOT_MEASURED


def test_gpu_check_runs_the_io_worker_sweep_in_both_modes():
    # The small mode's end-to-end run (tests/bench/test_gpu_check.py) reads the sweep's figures.
    for device, counts in (("cuda", "0,16"), ("cpu", "0,1")):
        args = gpu_check.BENCH_ARGS[device]["io"]
        assert args[args.index("--workers") + 1] == counts
        assert args[args.index("--schema") + 1] == "criteo_1hot,wide"
    plan = gpu_check.plan_text(("io",), "cuda", gpu_check.TOTAL_BUDGET_S["cuda"])
    assert "recaccel-bench io --workers 0,16 --schema criteo_1hot,wide" in plan


def test_train_reader_rows_carry_the_data_cost_against_the_same_device_step():
    def row(mode, precision, pipeline, ms):
        return {"candidate": "recaccel", "preset": "p", "mode": mode, "precision": precision, "step_ms": ms,
                "pipeline": pipeline, "micro_batches": 1, "cuda_graphs": False}  # fmt: skip

    rows = [
        row("device", "bf16", "off", 5.0),
        row("device", "bf16", "sync", 4.0),
        row("reader", "bf16", "off", 5.5),
        row("reader", "bf16", "sync", 4.0),
        row("reader", "tf32", "off", 9.0),  # no device row of this precision
    ]
    train_report.speedups(rows)
    assert [r["data_cost"] for r in rows] == [None, None, pytest.approx(0.5 / 5.5), 0.0, None]
    extra = {"status": "ok", "phases_ms": {}, "batch": 8, "samples_per_s": 1.0}
    flat = train_report.table_rows([{**r, **extra} for r in rows])
    assert flat[2]["data_cost"] == pytest.approx(0.5 / 5.5)

"""recaccel-plot: a PNG of a run's curves from its log.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recaccel.cli import plot_main, train_main
from recaccel.cli.plot import curves
from tests.helpers.resume import small_sets

pytest.importorskip("matplotlib", exc_type=ImportError)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_log(run: Path, events: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_plot_of_a_trained_run(small_data, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    sets = [
        "train.steps=6",
        "train.log_every=2",
        "train.eval_every=3",
        "optim.schedule=cosine",
        "optim.warmup_steps=2",
    ]
    assert train_main(small_sets(small_data, run, *sets)) == 0
    capsys.readouterr()
    assert plot_main([str(run)]) == 0
    png = run / "curves.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert str(png) in capsys.readouterr().out
    out = tmp_path / "elsewhere" / "c.png"
    assert plot_main([str(run), "--out", str(out)]) == 0 and out.read_bytes()[:8] == PNG_MAGIC

    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (700, 1100) and pixels.std() > 0.05  # drawn, not blank


def test_curves_pick_each_panel_and_replace_a_retrained_stretch():
    events = [
        {"event": "train", "step": 1, "loss": 0.9, "lr": 0.1, "sparse_lr": 1.0, "samples_per_s": 10.0},
        {"event": "train", "step": 2, "loss": 0.8, "lr": 0.2, "sparse_lr": 2.0, "samples_per_s": 20.0},
        {"event": "eval", "time": 1795487084.5, "step": 2, "auc": 0.6, "logloss": 0.7, "ctr": 0.25, "eval_rows": 400},
        {"event": "train", "step": 3, "loss": 0.7, "lr": 0.3, "sparse_lr": 3.0, "samples_per_s": 30.0},
        # resumed from the checkpoint at step 2: step 3 trained again
        {"event": "train", "step": 3, "loss": 0.65, "lr": 0.3, "sparse_lr": 3.0, "samples_per_s": 31.0},
        {"event": "final", "steps": 3, "auc": 0.7, "logloss": 0.6, "train_loss": 0.65, "samples_per_s": 9.0,
         "data_wait_s": 0.1, "cache_hit_rate": 0.5, "eval_rows": 400, "data": {"rows_read": 10}},
    ]  # fmt: skip
    got = curves(events)
    assert got["loss"] == {"train loss": [(1, 0.9), (2, 0.8), (3, 0.65)]}
    assert got["lr"] == {"lr": [(1, 0.1), (2, 0.2), (3, 0.3)], "sparse_lr": [(1, 1.0), (2, 2.0), (3, 3.0)]}
    assert got["throughput"] == {"samples/s": [(1, 10.0), (2, 20.0), (3, 31.0)]}
    assert got["eval"] == {"auc": [(2, 0.6), (3, 0.7)], "logloss": [(2, 0.7), (3, 0.6)]}


def test_an_older_log_without_rates_still_plots(tmp_path):
    run = tmp_path / "run"
    _write_log(run, [{"event": "train", "step": s, "epoch": 0, "loss": 1.0 / s} for s in (1, 5, 10)])
    assert plot_main([str(run)]) == 0 and (run / "curves.png").read_bytes()[:8] == PNG_MAGIC


def test_errors_are_one_line(tmp_path, capsys):
    assert plot_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recaccel-plot: error:") and "no run log" in err and "\n" not in err
    _write_log(tmp_path / "empty", [{"event": "something"}])
    assert plot_main([str(tmp_path / "empty")]) == 2
    assert "no train or eval event to plot" in capsys.readouterr().err

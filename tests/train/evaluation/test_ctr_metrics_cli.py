"""NE and calibration reach metrics.json, log.jsonl, eval json and the console; counts print
as integers. Expectations are recomputed from the written predictions in float64 numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from recaccel.cli import eval_main
from recaccel.cli.common import format_metric, print_metrics
from recaccel.cli.eval import _print
from tests.helpers.eval_run import STEPS, printed_metrics


def test_run_and_eval_report_ne_and_calibration_of_their_predictions(dlrm_run, tmp_path, capsys):  # noqa: F811
    from sklearn.metrics import log_loss

    preds, out = tmp_path / "preds.parquet", tmp_path / "eval.json"
    assert eval_main([str(dlrm_run), "--predictions", str(preds), "--out", str(out)]) == 0
    printed = printed_metrics(capsys.readouterr().out)
    written = json.loads(out.read_text())
    table = pq.read_table(preds)
    p = table["prediction"].to_numpy().astype(np.float64)
    y = table["label"].to_numpy().astype(np.float64)
    rate = y.mean()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert written["ne"] == pytest.approx(log_loss(y, p) / entropy, abs=1e-5)
    assert written["calibration"] == pytest.approx(p.sum() / y.sum(), abs=1e-5)
    assert float(printed["ne"]) == pytest.approx(written["ne"], abs=1e-5)
    assert float(printed["calibration"]) == pytest.approx(written["calibration"], abs=1e-5)
    assert printed["eval_rows"] == "2000" and printed["checkpoint_step"] == str(STEPS)
    # The final checkpoint is the trained model: the run's own final evaluation and its
    # final event in log.jsonl carry the same figures.
    run_metrics = json.loads((dlrm_run / "metrics.json").read_text())
    events = [json.loads(line) for line in (dlrm_run / "log.jsonl").read_text().splitlines()]
    final = [e for e in events if e.get("event") == "final"][-1]
    for record in (run_metrics, final):
        assert record["ne"] == pytest.approx(written["ne"], abs=1e-12)
        assert record["calibration"] == pytest.approx(written["calibration"], abs=1e-12)


METRICS = {
    "tasks": 189.0,
    "query_rows": 3780.0,
    "gauc_tasks": 120.0,
    "eval_rows": 2000,
    "cache_hits": 7.0,
    "auc": 1.0,
    "logloss": 2.0,
    "calibration": 1.0,
    "samples_per_s": 1000.0,
    "cache_hit_rate": 1.0,
    "ne": math.nan,
}
WANT = {
    "tasks": "189",
    "query_rows": "3780",
    "gauc_tasks": "120",
    "eval_rows": "2000",
    "cache_hits": "7",
    "auc": "1.00000",
    "logloss": "2.00000",
    "calibration": "1.00000",
    "samples_per_s": "1000.00000",
    "cache_hit_rate": "1.00000",
    "ne": "nan",
}


def test_train_console_prints_counts_as_integers_and_scores_with_decimals(tmp_path, capsys):
    print_metrics({**METRICS, "states": {"warm": {"auc": 1.0}}}, tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"metrics written to {tmp_path / 'metrics.json'}"
    assert dict(line.split() for line in lines[:-1]) == {**WANT, "warm.auc": "1.00000"}


def test_eval_console_prints_counts_as_integers_and_scores_with_decimals(capsys):
    _print({**METRICS, "run": "somewhere", "deterministic": True})
    assert dict(line.split() for line in capsys.readouterr().out.splitlines()) == WANT


@pytest.mark.parametrize("key", ["tasks", "warm.query_rows", "cache_bytes_h2d"])
def test_a_count_that_is_not_a_whole_number_keeps_its_decimals(key):
    assert format_metric(key, 2.5) == "2.50000"

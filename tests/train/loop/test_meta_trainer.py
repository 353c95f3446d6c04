"""Meta-DLRM through the Trainer and the CLI, on a small task-grouped dataset."""

from __future__ import annotations

import json

from recaccel.cli import train_main
from tests.helpers.meta_run import meta_set_args


def test_meta_mode_trains_and_reports_every_state(task_data, tmp_path, capsys):
    train, test = task_data
    out = tmp_path / "meta"
    assert (
        train_main(meta_set_args(train, test, out, "train.mode=meta", "train.steps=30", "meta.inner_lr=0.1"))
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["states"]) == {"grouped", "again"}
    for key in ("mae", "rmse", "ndcg@1", "ndcg@3", "mae_no_adapt"):
        assert key in metrics and key in metrics["states"]["again"]
    assert metrics["tasks"] == 16 and metrics["steps"] == 30
    # The planted per-user offset is only learnable by adapting on the support rows.
    assert metrics["mae"] < metrics["mae_no_adapt"]
    assert "again.mae" in capsys.readouterr().out


def test_plain_dlrm_scored_on_tasks(task_data, tmp_path):
    train, test = task_data
    out = tmp_path / "plain"
    assert (
        train_main(
            meta_set_args(
                train,
                test,
                out,
                "train.mode=dlrm",
                "train.eval_tasks=true",
                "train.epochs=2",
                "data.batch_size=64",
            )
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["tasks"] == 16 and "ndcg@3" in metrics and "mae_no_adapt" in metrics

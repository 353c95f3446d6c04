"""Meta-DLRM through the Trainer and the CLI, on a small task-grouped dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recaccel.cli import train_main
from recaccel.io.convert.group_by_task import group_by_task
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet


def _ratings(out: Path, users: range, seed: int) -> Path:
    """Ratings with a per-user offset: what one inner step on the support rows can fit."""
    rng = np.random.default_rng(seed)
    per_user = rng.integers(12, 30, len(users))
    user = np.repeat(np.array(users), per_user)
    item = rng.integers(0, 40, user.size)
    offset = (np.array(users) % 5 - 2.0)[np.repeat(np.arange(len(users)), per_user)]
    label = (3.0 + offset + rng.normal(0, 0.3, user.size)).astype(np.float32)
    schema = FeatureSchema(
        dense=("d0",), sparse=(SparseField("user", 64), SparseField("item", 40)), label_kind="rating"
    )
    cols = {"label": label, "d0": rng.normal(size=user.size).astype(np.float32), "user": user, "item": item}
    write_parquet(out / "raw", schema, cols, rows_per_row_group=100)
    group_by_task(out / "raw", out / "grouped", task_key="user", rows_per_row_group=100)
    return out / "grouped"


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tasks")
    return _ratings(root / "train", range(0, 48), 0), _ratings(root / "test", range(48, 64), 1)


def _argv(train: Path, test: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        f'data.train="{train}"',
        f'data.test="{test}"',
        f'train.out_dir="{out}"',
        "train.progress=false",
        "tasks.tasks_per_batch=8",
        "tasks.support_size=16",
        "tasks.query_size=8",
        "tasks.query_count=5",
        "tasks.min_task_rows=6",
        "model.embedding_dim=8",
        "model.bottom_mlp=[8]",
        "model.top_mlp=[16, 1]",
        f'meta.eval_states=["again={test}"]',
        *extra,
    ]
    return [a for s in sets for a in ("--set", s)]


def test_meta_mode_trains_and_reports_every_state(task_data, tmp_path, capsys):
    train, test = task_data
    out = tmp_path / "meta"
    assert train_main(_argv(train, test, out, "train.mode=meta", "train.steps=30", "meta.inner_lr=0.1")) == 0
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
            _argv(
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

"""A small task-grouped ratings dataset and the --set arguments of a meta-DLRM run on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recaccel.io.convert.group_by_task import group_by_task
from recaccel.io.format.schema import FeatureSchema, SparseField
from recaccel.io.format.writer import write_parquet


def write_ratings(out: Path, users: range, seed: int) -> Path:
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


def meta_set_args(train: Path, test: Path, out: Path, *extra: str) -> list[str]:
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

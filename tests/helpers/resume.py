"""The small DLRM run of the resume tests and the equality checks between two runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from recaccel.train.checkpoint.state import list_checkpoints
from tests.helpers.meta_run import meta_set_args

TIMING_KEYS = {"samples_per_s", "data_wait_s", "data_startup_s", "data_wait_fraction"}


TIMING_ENTRIES = {"train_seconds"}


SMALL = [
    "synth.train_rows=1800",
    "synth.test_rows=400",
    "synth.num_dense=2",
    "synth.num_sparse=3",
    "synth.cardinality=30",
    "synth.multi_hot_fields=1",
    "synth.rows_per_row_group=300",
    "synth.rows_per_file=900",
    "data.batch_size=128",
    "data.shuffle_buffer_rows=500",
    "data.prefetch=2",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
    "optim.sparse=adam",
    "train.log_every=5",
    "train.progress=false",
    "train.epochs=2",
]


STEPS_PER_EPOCH = 1800 // 128  # drop_last


def small_sets(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        *SMALL,
        f'data.train="{data / "train"}"',
        f'data.test="{data / "test"}"',
        f'train.out_dir="{out}"',
        *extra,
    ]
    return [a for s in sets for a in ("--set", s)]


def final_entries(run: Path) -> dict[str, Any]:
    """The final checkpoint's entries (a .pt file, or a DCP folder's consolidated view)."""
    found = list_checkpoints(run)
    assert found, f"no checkpoint in {run}"
    return torch.load(found[-1], weights_only=True)


def assert_same_run(full: Path, resumed: Path, measured: tuple[str, ...] = ()) -> None:
    """Every non-timing metric, and every tensor and entry of the final checkpoint, equal
    (``measured``: reader counters that are measurements, left out)."""
    a = json.loads((full / "metrics.json").read_text())
    b = json.loads((resumed / "metrics.json").read_text())
    for key in TIMING_KEYS:
        a.pop(key), b.pop(key)
    for key in measured:
        a["data"].pop(key), b["data"].pop(key)
    assert a == b
    assert a["train_loss"] is not None and a["data"]["batches_yielded"] == a["steps"]
    fa, fb = final_entries(full), final_entries(resumed)
    if measured:
        fa["data"], fb["data"] = (
            {k: v for k, v in json.loads(f["data"]).items() if k not in measured} for f in (fa, fb)
        )
    assert_same_entries(fa, fb)


def assert_same_entries(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            if key not in TIMING_ENTRIES:
                assert_same_entries(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_entries(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


def meta_sets(train: Path, test: Path, out: Path, *extra: str) -> list[str]:
    return meta_set_args(
        train,
        test,
        out,
        "train.mode=meta",
        "meta.inner_lr=0.1",
        "train.epochs=2",
        "train.log_every=4",
        "tasks.shuffle_buffer_tasks=12",
        "tasks.unit_row_groups=2",
        *extra,
    )

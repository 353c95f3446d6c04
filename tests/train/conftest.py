"""Fixtures shared by the training tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recaccel.cli import train_main
from tests.helpers.resume import (
    STEPS_PER_EPOCH,
    small_sets,
)


@pytest.fixture(scope="module")
def full_run(small_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    assert train_main(small_sets(small_data, out, f"train.checkpoint_every={STEPS_PER_EPOCH}")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 * STEPS_PER_EPOCH and metrics["epochs"] == 2
    return out
